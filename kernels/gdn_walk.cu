// The tree walk of the chunked gated delta rule (kernels/gdn_chunk.py's second launch) in CUDA C++: one CTA of twelve
// warps per (sequence, value head), the whole fp32 state S [K, V] in the registers of its eight state warps, every
// dot on mma.sync m16n8k16 (bf16 operands, fp32 accumulate) with ldmatrix from shared memory. Math, rounding points
// and the walk's protocol (tickets, published states, flags) are kernels/gdn_chunk.py's; kernels/gdn_walk_cuda.py
// compiles and launches it.
//
// Compiled by NVRTC (cupy) with KEY_DIM and VALUE_DIM defined in front of this file (128 each at the 27B).
//
// Two roles (v5). The state warps 0-7 (warp w: row block rb = w % 4 of 16 rows, column half ch = w / 4) carry the
// chain from one chunk's state to the next; the output warps 8-11 (warp 8 + rb: rows rb, all columns) compute the
// chunk's output beside them, off the chain. Per 64-row chunk c:
//   state  A (warp 0)  the chunk's g and beta; gamma = cumsum(g) * log2(e) by a warp scan; 2^gamma (buffer c % 2)
//                      -> signal INPUTS (this chunk's K, Q landed, gates written; Sb = bf16(S_c) written before)
//          B (all)     K~ = bf16(bf16(K beta) 2^gamma), V~ = bf16(V beta) -> shared
//          C (warp)    w = bf16(T K~) -> shared, u = bf16(T V~) (registers), rows rb, columns ch; then, once the
//                      output warps are done with chunk c - 1 (DONE), the next chunk's K, Q, V, T by cp.async
//          D (warp)    v' = u - w Sb; bf16(v') -> shared (for the output warps), bf16(v' 2^(gamma_last - gamma))
//                      -> shared -> signal VPRIME
//          E (warp)    S <- S 2^gamma_last + K^T v'_decayed for the warp's 16 state rows, all 128 columns; once the
//                      output warps have read Sb_c (SB_READ), Sb = bf16(S) -> shared; publish where the walk says
//   output          wait INPUTS; QK = bf16(causal(Q K^T 2^(gamma_r - gamma_s))) (A fragments in registers);
//                   Q Sb_c 2^gamma -> signal SB_READ; wait VPRIME; o = bf16(scale (Q Sb 2^gamma) + scale (QK bf16(v')))
//                   -> global -> signal DONE
// Named barriers: STATE (the state warps), INPUTS, VPRIME (state arrives, output waits), SB_READ and DONE (output
// arrives, state waits); each is passed once a chunk and neither side can pass one twice before the other has passed
// it once. No atomics but the ticket and the flags.
//
// Versions (timings: engine/stages/core.md):
// * v1 (f1dc4fb): eight warps doing every phase; the chunk's loads in three loops of load, convert, store; on an H100
//   (probe of f1dc4fb) slower than the Triton walk: drone 90.5 against 76.0 us a layer, customer_service 198.6 against
//   141.6.
// * v2 (469524d, not run): every tile load of a chunk issued before its first shared store; the next chunk's input rows
//   and gates fetched by warp 0 during the chunk before.
// * v3 (7689bb6): v2 with the next chunk's K, Q, V and T copied into spare buffers by cp.async during the chunk
//   before; at parity with the Triton walk on an H100 (77.2 against 74.5 us a layer on drone, 141.7 against 139.6 on
//   customer_service).
// * v4 (c9eefae): sixteen warps at 127 registers, the masked Q K^T once per CTA through shared memory; slower (80.2
//   against 75.2 on drone).
// * v5 (this file): v3's state path without the output (the masked Q K^T, Q Sb, the output dot and store: 160 of a
//   warp's 352 mma a chunk), which four output warps compute beside it.

#define BT 64
#define STATE_WARPS 8
#define OUTPUT_WARPS 4
#define THREADS ((STATE_WARPS + OUTPUT_WARPS) * 32)
#define STATE_THREADS (STATE_WARPS * 32)
#define LDS (KEY_DIM + 8)  // row stride (bf16) of a [64, 128] tile in shared memory: 16 bytes of padding, so the
                           // eight rows one ldmatrix reads fall in distinct banks
#define LDT (BT + 8)       // the same for T [64, 64]
#define WALK_WIDTH 8
#define RCP_LN2 1.4426950216f  // FLA's constant, as kernels/gdn_chunk_body.py

typedef unsigned short bf16;

// Named barriers (bar.sync: arrive and wait; bar.arrive: arrive only), ids 1.. (0 is __syncthreads).
#define BAR_STATE 1    // the state warps among themselves
#define BAR_INPUTS 2   // state arrives, output waits: the chunk's K, Q, gates and Sb are in shared memory
#define BAR_VPRIME 3   // state arrives, output waits: bf16(v') is in shared memory
#define BAR_SB_READ 4  // output arrives, state waits: the output warps have read Sb
#define BAR_DONE 5     // output arrives, state waits: the output warps are done with the chunk's K, Q, gates, v'

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}


__device__ __forceinline__ float bf2f(unsigned bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ float round_bf16(float x) {  // bf16(x) (nearest, ties to even) widened back
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return bf2f(r);
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {  // two bf16(x): lo in the low half
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float exp2_approx(float x) {  // what Triton's tl.exp2 compiles to on sm_90
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

// d += a b for one 16 x 8 tile: a the 16 x 16 A fragment (4 registers), b the 16 x 8 B fragment (2 registers).
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
// (g+8, 2t+8..)}, b = {(k 2t..2t+1, n g), (k 2t+8.., n g)}, d = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void mma_bf16(float* d, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The A fragment of rows m0.. and columns k0.. of a row-major [m][k] tile.
__device__ __forceinline__ void load_a(unsigned* a, const bf16* base, int ld, int m0, int k0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  ldmatrix_x4(a, base + (m0 + i + (j & 1) * 8) * ld + k0 + (j >> 1) * 8);
}

// The A fragment of A = X^T (rows m0.., columns k0..) from a row-major X [k][m].
__device__ __forceinline__ void load_a_of_transposed(unsigned* a, const bf16* base, int ld, int m0, int k0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  ldmatrix_x4_trans(a, base + (k0 + i + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
}

// The B fragments of two 8-column tiles (n0.., n0 + 8..) and rows k0.. of a row-major B [k][n]: b[0..1], b[2..3].
__device__ __forceinline__ void load_b(unsigned* b, const bf16* base, int ld, int k0, int n0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  ldmatrix_x4_trans(b, base + (k0 + i + (j & 1) * 8) * ld + n0 + (j >> 1) * 8);
}

// The same for B = X^T from a row-major X [n][k].
__device__ __forceinline__ void load_b_of_transposed(unsigned* b, const bf16* base, int ld, int k0, int n0, int lane) {
  const int i = lane & 7, j = lane >> 3;
  ldmatrix_x4(b, base + (n0 + i + (j >> 1) * 8) * ld + k0 + (j & 1) * 8);
}

// 16 bytes global -> shared without the registers; zeros when `bytes` is 0 (a row past the sequence).
__device__ __forceinline__ void copy_async(bf16* to, const bf16* from, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(to)), "l"(from), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void store_pair(bf16* p, float lo, float hi) { *(unsigned*)p = pack_bf16(lo, hi); }

// One 8-column tile of a row block (rows r, r + 8) as bf16 into a row-major shared tile.
__device__ __forceinline__ void store_tile(bf16* base, int ld, int r, int col, const float* c) {
  store_pair(base + r * ld + col, c[0], c[1]);
  store_pair(base + (r + 8) * ld + col, c[2], c[3]);
}

// The output warps' part of chunk i_t (rows rb of the chunk, all value columns): the masked Q K^T, Q Sb 2^gamma, and
// after the state warps' v', the output rows.
__device__ __forceinline__ void output_chunk(const bf16* cQ, const bf16* cK, const bf16* sS, const bf16* sVn,
                                             const float* gamma, const float* decay, bf16* __restrict__ o,
                                             long long bos, int seq_len, int i_t, int hv, int value_heads,
                                             float scale, int rb, int lane) {
  const int gq = lane >> 2, tq = lane & 3, r0 = 16 * rb;
  const int ra = r0 + gq, rc = ra + 8;
  bar_sync(BAR_INPUTS, THREADS);
  unsigned qk[BT / 16][4];
  {
    float c[BT / 8][4];
#pragma unroll
    for (int nt = 0; nt < BT / 8; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
      unsigned a[4];
      load_a(a, cQ, LDS, r0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BT / 16; ++np) {
        unsigned b[4];
        load_b_of_transposed(b, cK, LDS, 16 * kk, 16 * np, lane);
        mma_bf16(c[2 * np], a, b);
        mma_bf16(c[2 * np + 1], a, b + 2);
      }
    }
    const float ga = gamma[ra], gc = gamma[rc];
#pragma unroll
    for (int nt = 0; nt < BT / 8; ++nt) {
      const int s0 = 8 * nt + 2 * tq;
      const float g0 = gamma[s0], g1 = gamma[s0 + 1];
      c[nt][0] = ra >= s0 ? c[nt][0] * exp2_approx(ga - g0) : 0.f;
      c[nt][1] = ra >= s0 + 1 ? c[nt][1] * exp2_approx(ga - g1) : 0.f;
      c[nt][2] = rc >= s0 ? c[nt][2] * exp2_approx(gc - g0) : 0.f;
      c[nt][3] = rc >= s0 + 1 ? c[nt][3] * exp2_approx(gc - g1) : 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < BT / 16; ++kk) {  // accumulator tiles 2 kk, 2 kk + 1 are the A fragment of columns 16 kk..
      qk[kk][0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
      qk[kk][1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
      qk[kk][2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
      qk[kk][3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
  }
  float inter[VALUE_DIM / 8][4];
#pragma unroll
  for (int nt = 0; nt < VALUE_DIM / 8; ++nt) inter[nt][0] = inter[nt][1] = inter[nt][2] = inter[nt][3] = 0.f;
#pragma unroll 2
  for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
    unsigned aq[4];
    load_a(aq, cQ, LDS, r0, 16 * kk, lane);
#pragma unroll
    for (int np = 0; np < VALUE_DIM / 16; ++np) {
      unsigned b[4];
      load_b(b, sS, LDS, 16 * kk, 16 * np, lane);
      mma_bf16(inter[2 * np], aq, b);
      mma_bf16(inter[2 * np + 1], aq, b + 2);
    }
  }
  bar_arrive(BAR_SB_READ, THREADS);
  const float ea = decay[ra], ec = decay[rc];
#pragma unroll
  for (int nt = 0; nt < VALUE_DIM / 8; ++nt) {
    inter[nt][0] *= ea;
    inter[nt][1] *= ea;
    inter[nt][2] *= ec;
    inter[nt][3] *= ec;
  }
  bar_sync(BAR_VPRIME, THREADS);
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // the output dot in two 64-column halves (32 accumulators at a time)
    float c[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BT / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned b[4];
        load_b(b, sVn, LDS, 16 * kk, 64 * half + 16 * np, lane);
        mma_bf16(c[2 * np], qk[kk], b);
        mma_bf16(c[2 * np + 1], qk[kk], b + 2);
      }
    }
    const int row_a = i_t * BT + ra, row_c = row_a + 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = 64 * half + 8 * nt + 2 * tq;
      const float* in = inter[8 * half + nt];
      if (row_a < seq_len)
        store_pair(o + ((bos + row_a) * value_heads + hv) * VALUE_DIM + col, in[0] * scale + c[nt][0] * scale,
                   in[1] * scale + c[nt][1] * scale);
      if (row_c < seq_len)
        store_pair(o + ((bos + row_c) * value_heads + hv) * VALUE_DIM + col, in[2] * scale + c[nt][2] * scale,
                   in[3] * scale + c[nt][3] * scale);
    }
  }
  bar_arrive(BAR_DONE, THREADS);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    gdn_walk_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const float* __restrict__ g, const bf16* __restrict__ beta, bf16* __restrict__ o,
                    const bf16* __restrict__ solved, const long long* __restrict__ cu_seqlens,
                    const long long* __restrict__ walk, float* bank, int* flags,
                    const long long* __restrict__ slot_rows, float scale, int key_heads, int value_heads) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = (bf16*)smem;                // K [64, K] as loaded, two buffers: this chunk's and the next one's
  bf16* sQ = sK + 2 * BT * LDS;          // Q [64, K], two buffers
  bf16* sV = sQ + 2 * BT * LDS;          // V [64, V] as loaded (the next chunk's once this chunk's V~ is made)
  bf16* sKt = sV + BT * LDS;             // K~ = bf16(bf16(K beta) 2^gamma); later in the chunk bf16(v' 2^(gl - gamma))
  bf16* sVt = sKt + BT * LDS;            // V~ = bf16(V beta)
  bf16* sVn = sVt + BT * LDS;            // bf16(v'), read by the output warps
  bf16* sW = sVn + BT * LDS;             // w = bf16(T K~)
  bf16* sS = sW + BT * LDS;              // Sb = bf16(S) [K, V]
  bf16* sT = sS + KEY_DIM * LDS;         // T [64, 64], two buffers
  float* sGamma = (float*)(sT + 2 * BT * LDT);  // gamma, two buffers (the output warps read a chunk's while the
  float* sDecay = sGamma + 2 * BT;              // state warps write the next one's); 2^gamma, two buffers
  float* sBeta = sDecay + 2 * BT;
  long long* sRow = (long long*)(sBeta + BT);  // each chunk row's input row (-1 past the sequence), two buffers
  int* sTicket = (int*)(sRow + 2 * BT);
  bf16* sVd = sKt;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  if (tid == 0) sTicket[0] = atomicAdd(flags, 1);  // orders nothing but the tickets
  __syncthreads();
  const int ticket = sTicket[0];
  const int group = ticket / value_heads;
  if (group >= (int)walk[WALK_WIDTH - 1]) return;  // a dummy path's group: the solve launch zeroed its rows of o
  const long long seq = walk[(long long)group * WALK_WIDTH];
  const long long* row = walk + seq * WALK_WIDTH;
  const int hv = ticket % value_heads, hk = hv / (value_heads / key_heads);
  const int start = (int)row[1], source = (int)row[2];
  const long long bos = cu_seqlens[seq];
  const int seq_len = (int)(cu_seqlens[seq + 1] - bos);
  const int num_chunks = (seq_len + BT - 1) / BT;

  if (warp >= STATE_WARPS) {  // the output warps
    __syncthreads();          // the state warps' first Sb and the first chunk's rows (below)
    for (int i_t = start; i_t < num_chunks; ++i_t) {
      const int cur = (i_t - start) & 1;
      output_chunk(sQ + cur * BT * LDS, sK + cur * BT * LDS, sS, sVn, sGamma + cur * BT, sDecay + cur * BT, o, bos,
                   seq_len, i_t, hv, value_heads, scale, warp - STATE_WARPS, lane);
    }
    return;
  }

  const int publish_chunks = (int)row[3], publish_slot = (int)row[4];
  const int publish2_chunks = (int)row[5], publish2_slot = (int)row[6];
  const long long state_size = (long long)KEY_DIM * VALUE_DIM;
  // The state: warp w holds rows 16 w + gq (+ 8), columns 8 nt + 2 tq (+ 1).
  const int srow = 16 * warp + gq;
  float s[VALUE_DIM / 8][4];
  if (source >= 0) {  // the state another CTA publishes at this sequence's start chunk
    if (tid == 0) {
      const int* flag = flags + 1 + source * value_heads + hv;
      int ready = 0;
      while (ready == 0) asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
    }
    bar_sync(BAR_STATE, STATE_THREADS);
    const float* from = bank + ((long long)source * value_heads + hv) * state_size;
#pragma unroll
    for (int nt = 0; nt < VALUE_DIM / 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x, y;
        asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];"
                     : "=f"(x), "=f"(y)
                     : "l"(from + (srow + 8 * h) * VALUE_DIM + 8 * nt + 2 * tq));
        s[nt][2 * h] = x;
        s[nt][2 * h + 1] = y;
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < VALUE_DIM / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  }
#pragma unroll
  for (int nt = 0; nt < VALUE_DIM / 8; ++nt) store_tile(sS, LDS, srow, 8 * nt + 2 * tq, s[nt]);

  // Warp 0 fetches a chunk's input rows (lanes: rows 2 lane, 2 lane + 1) and gates ahead of the chunk: the rows at the
  // start of the chunk before's phase C (stored for every thread at its end), the gates during its phase E. Every
  // state thread then copies the chunk's K, Q, V and T rows into the free buffers (cp.async) in phase C, so they land
  // while the chunk before computes. The first chunk's: here.
  long long next_input[2];
  float next_g[2], next_beta[2];
  auto fetch_rows = [&](int chunk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int offset = chunk * BT + 2 * lane + h;
      const long long token = bos + offset;
      next_input[h] = offset < seq_len ? (slot_rows ? slot_rows[token] : token) : -1;
    }
  };
  auto fetch_gates = [&]() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long input = next_input[h];
      next_g[h] = input >= 0 ? g[input * value_heads + hv] : 0.f;
      next_beta[h] = input >= 0 ? bf2f(beta[input * value_heads + hv]) : 0.f;
    }
  };
  const int kc = (tid & 15) * 8, tc = (tid & 7) * 8;  // each thread's 16-byte column of the tiles
  auto copy_tiles = [&](int chunk, int buffer) {       // rows tid / 16 + 16 j of K, Q, V; tid / 8 + 32 j of T
    const long long* rows = sRow + buffer * BT;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = (tid >> 4) + 16 * j;
      const long long input = rows[r];
      const int bytes = input >= 0 ? 16 : 0;
      const long long at = (input >= 0 ? input * key_heads + hk : 0) * KEY_DIM + kc;
      copy_async(sK + (buffer * BT + r) * LDS + kc, k + at, bytes);
      copy_async(sQ + (buffer * BT + r) * LDS + kc, q + at, bytes);
      copy_async(sV + r * LDS + kc, v + (input >= 0 ? input * value_heads + hv : 0) * VALUE_DIM + kc, bytes);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = (tid >> 3) + 32 * j;
      const bool valid = rows[r] >= 0;
      copy_async(sT + (buffer * BT + r) * LDT + tc,
                 solved + (valid ? (bos + chunk * BT + r) * value_heads + hv : 0) * BT + tc, valid ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if (start < num_chunks && warp == 0) {
    fetch_rows(start);
    sRow[2 * lane] = next_input[0];
    sRow[2 * lane + 1] = next_input[1];
    fetch_gates();
  }
  __syncthreads();  // with the output warps: Sb and the first chunk's rows stored
  if (start < num_chunks) copy_tiles(start, 0);

  const int rb = warp & 3, ch = warp >> 2, r0 = 16 * rb;
  for (int i_t = start; i_t < num_chunks; ++i_t) {
    const int cur = (i_t - start) & 1, nxt = cur ^ 1;
    const bf16* cK = sK + cur * BT * LDS;
    const bf16* cT = sT + cur * BT * LDT;
    float* gamma = sGamma + cur * BT;
    float* decay = sDecay + cur * BT;
    // A: gates; this chunk's tiles landed
    if (warp == 0) {
      sBeta[2 * lane] = next_beta[0];
      sBeta[2 * lane + 1] = next_beta[1];
      float inclusive = next_g[0] + next_g[1];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += y;
      }
      float before = __shfl_up_sync(0xffffffffu, inclusive, 1);
      if (lane == 0) before = 0.f;
      const float c0 = before + next_g[0], c1 = c0 + next_g[1];
      gamma[2 * lane] = c0 * RCP_LN2;
      gamma[2 * lane + 1] = c1 * RCP_LN2;
      decay[2 * lane] = exp2_approx(c0 * RCP_LN2);
      decay[2 * lane + 1] = exp2_approx(c1 * RCP_LN2);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    bar_sync(BAR_STATE, STATE_THREADS);
    bar_arrive(BAR_INPUTS, THREADS);

    // B: K~ and V~ from the landed tiles (shared to shared)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = (tid >> 4) + 16 * j;
      const float b = sBeta[r], e = decay[r];
      const uint4 kv = *(const uint4*)(cK + r * LDS + kc), vv = *(const uint4*)(sV + r * LDS + kc);
      const unsigned kw[4] = {kv.x, kv.y, kv.z, kv.w}, vw[4] = {vv.x, vv.y, vv.z, vv.w};
      unsigned kt[4], vt[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        kt[w] = pack_bf16(round_bf16(bf2f(kw[w] & 0xffffu) * b) * e, round_bf16(bf2f(kw[w] >> 16) * b) * e);
        vt[w] = pack_bf16(bf2f(vw[w] & 0xffffu) * b, bf2f(vw[w] >> 16) * b);
      }
      *(uint4*)(sKt + r * LDS + kc) = make_uint4(kt[0], kt[1], kt[2], kt[3]);
      *(uint4*)(sVt + r * LDS + kc) = make_uint4(vt[0], vt[1], vt[2], vt[3]);
    }
    bar_sync(BAR_STATE, STATE_THREADS);
    const bool more = i_t + 1 < num_chunks;
    if (warp == 0 && more) fetch_rows(i_t + 1);

    // C: w and u (the warp's rows and columns)
    const int c0 = 64 * ch;  // the warp's first value (and key) column
    {
      float c[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BT / 16; ++kk) {
        unsigned a[4];
        load_a(a, cT, LDT, r0, 16 * kk, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          unsigned b[4];
          load_b(b, sKt, LDS, 16 * kk, c0 + 16 * np, lane);
          mma_bf16(c[2 * np], a, b);
          mma_bf16(c[2 * np + 1], a, b + 2);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) store_tile(sW, LDS, r0 + gq, c0 + 8 * nt + 2 * tq, c[nt]);
    }
    float u[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) u[nt][0] = u[nt][1] = u[nt][2] = u[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BT / 16; ++kk) {
      unsigned a[4];
      load_a(a, cT, LDT, r0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned b[4];
        load_b(b, sVt, LDS, 16 * kk, c0 + 16 * np, lane);
        mma_bf16(u[2 * np], a, b);
        mma_bf16(u[2 * np + 1], a, b + 2);
      }
    }
    if (warp == 0 && more) {
      sRow[nxt * BT + 2 * lane] = next_input[0];
      sRow[nxt * BT + 2 * lane + 1] = next_input[1];
    }
    if (i_t > start) bar_sync(BAR_DONE, THREADS);  // the output warps are done with the chunk before: its K, Q
                                                    // buffers, gates and v' are free
    bar_sync(BAR_STATE, STATE_THREADS);  // w complete; every read of K~, V~ and of the raw V done; the rows stored
    if (more) copy_tiles(i_t + 1, nxt);

    // D: v' = u - w Sb
    float p[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < KEY_DIM / 16; ++kk) {
      unsigned aw[4];
      load_a(aw, sW, LDS, r0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned b[4];
        load_b(b, sS, LDS, 16 * kk, c0 + 16 * np, lane);
        mma_bf16(p[2 * np], aw, b);
        mma_bf16(p[2 * np + 1], aw, b + 2);
      }
    }
    const float gamma_last = gamma[BT - 1];  // gamma is constant past the sequence's last row (g = 0 there)
    {
      const int ra = r0 + gq, rc = ra + 8;
      const float da = exp2_approx(gamma_last - gamma[ra]), dc = exp2_approx(gamma_last - gamma[rc]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float vn[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) vn[e] = round_bf16(u[nt][e]) - p[nt][e];
        const int col = c0 + 8 * nt + 2 * tq;
        store_tile(sVn, LDS, ra, col, vn);
        store_pair(sVd + ra * LDS + col, vn[0] * da, vn[1] * da);
        store_pair(sVd + rc * LDS + col, vn[2] * dc, vn[3] * dc);
      }
    }
    bar_sync(BAR_STATE, STATE_THREADS);  // bf16(v') and its decayed copy complete; every read of Sb by the state warps
    bar_arrive(BAR_VPRIME, THREADS);
    if (warp == 0 && more) fetch_gates();

    // E: the state update
    const float decay_last = exp2_approx(gamma_last);
#pragma unroll
    for (int nt = 0; nt < VALUE_DIM / 8; ++nt) {
      s[nt][0] *= decay_last;
      s[nt][1] *= decay_last;
      s[nt][2] *= decay_last;
      s[nt][3] *= decay_last;
    }
#pragma unroll
    for (int kk = 0; kk < BT / 16; ++kk) {
      unsigned a[4];
      load_a_of_transposed(a, cK, LDS, 16 * warp, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < VALUE_DIM / 16; ++np) {
        unsigned b[4];
        load_b(b, sVd, LDS, 16 * kk, 16 * np, lane);
        mma_bf16(s[2 * np], a, b);
        mma_bf16(s[2 * np + 1], a, b + 2);
      }
    }
    bar_sync(BAR_SB_READ, THREADS);  // the output warps have read Sb_c
#pragma unroll
    for (int nt = 0; nt < VALUE_DIM / 8; ++nt) store_tile(sS, LDS, srow, 8 * nt + 2 * tq, s[nt]);
#pragma unroll
    for (int point = 0; point < 2; ++point) {  // the walk's two publish points (kernels/gdn_chunk.py)
      if (i_t + 1 != (point ? publish2_chunks : publish_chunks)) continue;
      const int slot = point ? publish2_slot : publish_slot;
      float* to = bank + ((long long)slot * value_heads + hv) * state_size;
#pragma unroll
      for (int nt = 0; nt < VALUE_DIM / 8; ++nt) {
        *(float2*)(to + srow * VALUE_DIM + 8 * nt + 2 * tq) = make_float2(s[nt][0], s[nt][1]);
        *(float2*)(to + (srow + 8) * VALUE_DIM + 8 * nt + 2 * tq) = make_float2(s[nt][2], s[nt][3]);
      }
      bar_sync(BAR_STATE, STATE_THREADS);  // the whole state stored before the flag
      if (tid == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flags + 1 + slot * value_heads + hv), "r"(1)
                     : "memory");
      }
    }
    bar_sync(BAR_STATE, STATE_THREADS);  // the next chunk overwrites the tiles and gates
  }
  if (num_chunks > start) bar_sync(BAR_DONE, THREADS);  // the output warps' last chunk
}
