"""The chunked gated delta rule forward in two launches: the solve, then one program per (sequence, value head, value
block) that walks the sequence's chunks with the state on chip; with a plan's tree walk, the shared prefixes once.

Replaces FLA 0.6.0's five forward launches (`kernels.gdn_core.FlaForwardCore`: cumsum, kkt + solve, w/u, state
pass, output). The solve launch (`gdn_chunk_solve`, one program per (chunk, value head) over FLA's `chunk_indices`)
writes T = (I + A)⁻¹ of every chunk [T, Hv, 64] (bf16); the walk reads it and keeps the recurrent state S [K, BV] in
fp32 registers from the first chunk to the last, so w, u, v' and the per-chunk states never touch memory. No
reductions across programs; the tree walk's atomics are tickets and flags only (below).

Inputs (packed varlen rows, B = 1 squeezed): q, k [T, Hk, K] bf16 (already L2-normalised, FLA's `l2norm_fwd`
numerics, by `kernels.gdn_prep`), v [T, Hv, V] bf16, g [T, Hv] fp32 (log decay), beta [T, Hv] bf16; sequence i is
rows cu_seqlens[i] .. cu_seqlens[i+1] - 1; value head j reads q/k head j // (Hv / Hk) (GVA). initial_state
[N, Hv, K, V] fp32 or None (zeros). Output o [T, Hv, V] bf16 (rows of the sequences only; rows after the last
sequence are not written), final state [N, Hv, K, V] fp32 when asked.

Math per chunk (rows r = 0..63 of the chunk, the state S at the chunk start; FLA's formulation, log2 units):
```
γ      = cumsum(g) · log2(e)                                     fp32 (in-chunk prefix sum)
A      = strict_lower(diag(β) K Kᵀ ⊙ 2^(γ_r − γ_s))                 [64, 64] fp32, bf16 dot operands
T      = (I + A)⁻¹                                                  fp32 (the solve, below); bf16↓
w, u   = bf16↓(T · bf16↓(bf16↓(K ⊙ β) ⊙ 2^γ)), bf16↓(T · bf16↓(V ⊙ β))
Sb     = bf16↓(S)
v'     = u − w Sb                                                   fp32
o      = bf16↓( scale · (Q Sb ⊙ 2^γ) + scale · bf16↓(causal(Q Kᵀ ⊙ 2^(γ_r − γ_s))) bf16↓(v') )
S      ← S · 2^(γ_last) + Kᵀ bf16↓(v' ⊙ 2^(γ_last − γ))            fp32 accumulate into S
```
The rounding points (bf16↓) are FLA's inter-kernel stores (reference-math.md §3.2): with `bf16_points=False` none is
taken (fp32 throughout, fp32 dots at IEEE precision: the exactness test of the algorithm). Dots take bf16 operands on
CUDA (tensor cores, fp32 accumulate); under the interpreter the same bf16 values go in as fp32 (the interpreter
computes bf16 `tl.dot` wrongly), which is exact for the products and differs only in the accumulation order.

The solve (`solve`; `solve_num_warps` defaults to `SOLVE_NUM_WARPS`, the fastest of a sweep for the first two):
* "doubling": recursive block inversion on the whole 64 × 64 tile: D starts as the inverse of the 2 × 2
  diagonal blocks (I − A on their one sub-diagonal entry), and for block sizes b = 2, 4, 8, 16, 32
  D ← D − D · (L_b · D), where L_b is A restricted to the lower-left b × b block of every 2b × 2b diagonal block:
  [[D₁₁, 0], [L₂₁, D₂₂]]⁻¹ = [[D₁₁, 0], [−D₂₂ L₂₁ D₁₁, D₂₂]] for all blocks of one level at once; 10 dots of
  64 × 64 × 64 at `solve_precision` (default "tf32", FLA's SOLVE_TRIL_DOT_PRECISION on sm >= 80).
* "fla-blocks" (one warp; the stage's from v3.1 to v3.4): FLA 0.6.0's fused kkt + solve in its own order
  (kernels/gdn_chunk_body.py `_inverse_fla_blocks`): the ten 16 × 16 blocks of A from 16-row key blocks, the diagonal
  blocks inverted by forward substitution in fp32, the others merged with 16 tf32 dots of 16 × 16 × 16. On the H200 the
  walk then gives FLA's output bits but for a few elements (0.9998-0.9999 of them at the kernel tests' inputs, all but
  about one in 10^7 on the probe's bucketed inputs; not enough for a bitwise forward: engine/stages/core.md,
  "Exactness"). Since v3.2 the faster of the two at 6683faa: the solve launch 17.9 / 16.7 / 31.2 us a layer on drone /
  easy-intent-00 / customer_service against doubling's 24.0 / 17.7 / 35.0. Its diagonal blocks' substitutions in a
  launch of their own (4 warps per chunk instead of one) were slower: 24.7 / 20.2 / 37.3 us for the two launches
  (attempt `gdn-chunk-solve-diagonal-launch`).
* "blocks-doubling" (the stage's since v3.5, one warp): fla-blocks with each diagonal 16 × 16 block inverted by the
  doubling rule on 16 rows (`_doubling_inverse`: 6 dependent dots of 16 × 16 × 16 at `solve_precision`) instead of
  the forward substitution's 14 dependent row steps, which took 66-69 % of the fla-blocks launch's warp samples (Nsight
  Compute of 6b8278c); the merges as fla-blocks'. sm_90 (Triton 3.9): 4,144 SASS instructions, straight-line, against
  fla-blocks' 3,136 with a 14-pass loop of 362 (about 7,900 executed). The solve launch on an H100 (probe of 37d05bf):
  12.4 / 11.7 / 22.1 us a layer on drone / easy-intent-00 / customer_service against fla-blocks' 17.5 / 16.5 / 31.1;
  FLA's bits on 0.9995-0.9997 of the elements, as the doubling solve (fla-blocks: 1.0000).
A Neumann product (I − A)(I + A²)(I + A⁴)... was rejected: exact in real arithmetic, but on strongly correlated keys
its powers grow to ~1e8 while T stays O(1) (engine/stages/core.md, ablations/attempts.toml).

The tree walk (`walk` [N, 8], a replicated call's: `engine.plan_arrays._tree_walk`). A replicated call holds every
candidate's whole path, so a shared prefix is in every path. With the walk, a path starts at chunk `start` from the fp32
state another program publishes there, instead of recomputing the prefix: programs take tickets from an atomic counter
(flags[0]), and the k-th group of Hv · V / BV tickets runs sequence walk[k, 0] if k < walk[0, 7] (the sequences that
run, every dummy path after them; a later group ends after its ticket); sequence i starts at chunk walk[i, 1] from bank
slot walk[i, 2] (-1: the zero state; a start of -1 marks a dummy path, whose rows of o the solve launch sets to zeros),
and after chunk walk[i, 3] (walk[i, 5]) publishes its state to slot walk[i, 4] (walk[i, 6]): a store, a CTA barrier,
then a release store of the slot's flag for its (value head, value block). A reader spins on its flag with acquire
loads, then reads the state through L2 (`.cg`). The walk's rows put every publisher before its readers, so a reader
waits only on programs holding earlier tickets, which are running or done: no deadlock whatever the hardware's dispatch
order. The state handed over at a chunk boundary has the bits the reader would have computed (the hand-off law below),
so every row read at its representative slot keeps its bits; slots of skipped chunks are not written. The solve skips
the chunks no program walks.

Exactness (tests/test_gdn_chunk.py, interpreter; tests/test_gpu_gdn_chunk.py, H200):
* against `reference.ops.gdn_recurrent` (fp32 token loop): fp32 mode within the fp32 bound, bf16 mode within the
  bf16 bound, both derived in the test module, for both solves;
* a sequence's bits depend on its own rows and initial state only: the grids are one program per (chunk or sequence,
  head, value block) and tile sizes are constexprs of the head dims, so batching, padding sequences and bucket
  trailing rows change nothing (bitwise tests); a row's output depends only on the rows up to its chunk (zeros of the
  masked rows enter the dots as exact zeros), so a path of the prefix tree gets the bits of the unshared sequence;
  a hand-off at a multiple of 64 equals one pass, and the tree walk equals the plain walk at every representative
  slot (CPU on a planned request with both publish slots and dummy paths; H200 on three bucketed workloads, five
  runs and a CUDA-graph replay);
* reading the path slots through `rows` gives the bits of the inputs gathered to the slots, in every output element
  (CPU: both solves with the walk, the stage's without; H200: within the tree-walk test, eager and replayed).

Tiles: the walk's value block of BV columns per program (`value_block`, default min(64, V), 4 warps: two programs per
(sequence, value head) at V = 128). BV < 64 is refused on CUDA unless asked for as unverified: BV = 32 gave wrong
outputs on sm_90 in v1 (relative RMSE 0.84-0.88 against FLA, a Triton 3.6 code-generation fault: core.md); v3.4's
walk compiles at BV = 32 with 36 bytes of spills at 255 registers and 312 at a 168-register cap (three programs an SM
instead of two), and at BV = 16 without spills (254 registers, 1,968 SASS instructions against BV = 64's 2,824; on 2
warps every value block spills kilobytes), which tests/test_gpu_gdn_chunk.py (`KERNELS`) and the probe check on the
GPU before the refusal goes: at v3.4 both were still wrong on an H100 (sm_90, Triton 3.6: relative error 0.905 against
the oracle, runs differ, an illegal address in the probe; attempt `gdn-chunk-value-block-32-and-16-v3.4`). The fault
is Triton 3.6's sm_90 warpgroup-MMA (wgmma) code at those widths: with DISABLE_MMA_V3=1 (mma.sync instead) BV 32 and 16
pass every bound, invariance and tree-walk test and give the stage's error figures to four digits, but the walk is
then slower at every BV, and slower at 32 and 16 than at 64 (attempt `gdn-chunk-value-block-below-64-mma-sync`). The
interpreter runs any BV. Loading each chunk's `rows` one chunk ahead (so that its gate and key loads do not wait for
that load first) gave the same bits and was slower on an H100: +4.7 / +1.9 / +7.9 us a layer on drone /
easy-intent-00 / customer_service (attempt `gdn-chunk-walk-prefetch-rows`, code at commit 450783f).

Version history (timings: one layer's core inside CUDA graphs on the H200, `python -m measure.gdn_chunk_probe`,
engine/stages/core.md):
* v3.6 (53af88e, dropped): the walk's chunks in up to three loops ending at the publish points. With the publish (a
  store, a CTA barrier and an atomic) inside the one chunk loop, Triton pipelines none of the tree walk's loads at any
  `num_stages` (sm_90 TTGIR: no async copy; the walk without the tree got 10 at 2 stages), so attempt
  `gdn-chunk-walk-pipelining-stages` timed one code three times. Split at the publish points, the loop got its 10
  async copies (g, k, T, v, q of the next chunk) and ran slower on an H100: 89.0 / 53.5 / 174.7 us a layer on drone /
  easy-intent-00 / customer_service pipelined against 78.1 / 46.3 / 160.0 with one stage (no pipelining), and its tree
  walk was wrong on the GPU at every stage count (relative RMSE against the fp32 oracle 6.7e-3 / 8.6e-3 on drone /
  customer_service where FLA's is 3e-3; easy-intent-00, which publishes nothing, kept its figures), though the
  interpreter's tests passed. Attempt `gdn-chunk-walk-segments-pipelined`.
* late wait (58f9ceb, dropped): a tree walk's reader ran its first chunk apart from the loop and acquired its starting
  state after that chunk's w and u instead of before the chunk, so the first wave of readers worked while candidate 0
  walked the root's chunk (inside the loop the conditional acquire doubled its spills). The same bits; on an H100
  (probe of 58f9ceb, one process) slower on all three workloads: 77.7 / 47.1 / 143.0 us a layer on drone /
  easy-intent-00 / customer_service against the stage's 76.3 / 45.4 / 141.9. Attempt `gdn-chunk-walk-late-wait`.
* stored operands (9a6886e, dropped): a third launch between the solve and the walk computed every walked chunk's w and
  masked Q Kᵀ once per value head (4 warps, the walk's functions and tiles) and stored them bf16; the walk loaded them
  instead of computing them in each of a head's two value-block programs (sm_90, Triton 3.9: 2,208 walk instructions
  against 2,808, the new launch 1,384 at 178 registers). The same bits under the interpreter; on an H100 (probe of
  9a6886e, one process) slower on all three workloads: 82.2 / 49.7 / 152.0 us a layer on drone / easy-intent-00 /
  customer_service against the stage's 75.2 / 45.2 / 142.6. Attempt `gdn-chunk-walk-stored-operands`.
* relaxed polls (e83eeeb, dropped): a tree walk's reader polled its flag with relaxed loads and acquired once it was
  set, instead of an acquire (a CCTL.IVALL, an L1 invalidation) each poll beside the root's programs. The same bits; on
  an H100 no effect: 74.43 / 74.37, 45.27 / 45.32, 140.39 / 140.25 us a layer. Attempt `gdn-chunk-walk-relaxed-spin`.
* root helper (d9de127, dropped): sequence 0 ran its root chunks (before its first publish) without their output,
  storing the chunk-start state's operand and bf16↓(v') instead and raising a flag a chunk, and the first reader of the
  root computed those outputs while it would have waited for the root's state, so that the root's chain, the
  critical path of customer_service (8 of its walk's chunk-latencies), would run at about the chain-only speed below.
  The interpreter's tree-walk tests passed; on an H100 (probe of d9de127, one process) it was slower on all three
  workloads, 85.5 / 51.8 / 143.0 us a layer against the stage's 75.1 / 45.6 / 140.7 (easy-intent-00 has no root:
  the larger kernel's own cost; sm_90 spills 376 -> 536 bytes, 3,000 -> 4,096 instructions, Triton 3.6), and not
  bitwise on customer_service's bucket (0.999999 of the read elements). Attempt `gdn-chunk-walk-root-helper`.
* chain only (e1195c2, timing only): the walk reading w and u, storing v' and the chunk states, computing nothing else,
  to bound a walk split into three launches: 1.50 / 1.68 / 1.56x faster than the whole walk on an H100 (the walk
  launch 63.3 -> 42.3 us on drone), short of the 2.2x the done-when asks. Attempt `gdn-chunk-walk-chain-only`.
* v3.7 (this file): v3.5 with the walk's tickets and flags zeroed by the solve launch's programs (`ZERO_FLAGS`, a
  grid-stride loop of 128-flag stores) instead of a torch fill kernel in front of it: one launch and one graph node
  fewer a GDN layer (48 fills a forward, 1.09 us each on drone in the H100 record of 1143e81, plus the node's gap).
  And the blocked solves store T's sixteen 16 x 16 blocks where they lie (`_store_block_row`) instead of assembling
  the [64, 64] tile with joins first, and take γ's and β's 16-row slices by reshapes and splits
  (`kernels.gdn_chunk_body._quarters`) instead of seven masked sums: sm_90 (Triton 3.9), at drone's bucket with the
  walk and `rows`, blocks-doubling 4,144 -> 3,816 -> 3,120 SASS instructions (shuffles 515 -> 283, selects 1,051 ->
  611, spills 8 -> 0 bytes, 255 -> 248 registers), fla-blocks 3,200 -> 2,896 -> 2,760. Every bit of v3.5 under the
  interpreter (the solve and the forward on three head shapes, every solve, both modes). On the H200 (probe of
  827fa63): the core 71.2 / 44.0 / 136.4 us a layer on drone / easy-intent-00 / customer_service, the solve alone
  11.4 / 9.9 / 19.5 (FLA 145.3 / 91.0 / 493.9); the GPU tests green (engine/stages/core.md, "The H200 record of
  827fa63"); no same-process timing of v3.5 on that card. Since 9a6886e the chunk's masked Q Kᵀ is a function of its
  own (`kernels.gdn_chunk_body._chunk_qk`, kept from the stored-operands attempt above), which moves it ahead of the
  inter-chunk dot: sm_90 (Triton 3.9) 2,808 walk instructions and 164 bytes of spills against 2,824 and 224, the
  stage's answers unchanged (JevBench through core on an H100 at 9a6886e: every flip and max |dp| of 827fa63's H200
  run), the probe's core 75.2 / 45.2 / 142.6 us a layer on an H100 (v3.5 at 37d05bf: 75.0 / 46.9 / 141.6).
* v3.5: v3.4 with the "blocks-doubling" solve as the stage's (the diagonal blocks by doubling, above; the
  walk unchanged). On an H100 (probe of 37d05bf, one process): the core 75.0 / 46.9 / 141.6 us a layer on drone /
  easy-intent-00 / customer_service against fla-blocks' 80.3 / 51.7 / 151.9 (FLA 134.5 / 81.5 / 527.4).
* v3.4: v3.2's arithmetic, every bit kept, and four changes to what surrounds it. The walk takes its ticket
  with a relaxed atomic (the default acq_rel one put a GPU-wide fence and an L1 invalidation in front of every program);
  the state's offsets (`_state_tile`) and the causal mask are built on an opaque zero where they are used (hoisted
  before the loop, they were tiles live across it: sm_90 spills 408 -> 240 bytes, spill loads in the loop body 79 -> 56
  a chunk; 224 bytes and 2,824 instructions with the early end below); the plan's walk runs the dummy paths last
  (`engine.plan_arrays._tree_walk`: on drone's bucket 1,056 dummy programs took their tickets before the 576 readers),
  and a dummy path's programs end after their ticket (walk column 7: the sequences that run), its rows of o zeroed by
  the solve launch's programs of its chunks, which it had anyway. Ncu of v3.3 put 23 % of the walk's stall samples in
  the prologue every program runs, dummies included. `max_registers` and `unverified_value_block` let the probe and the
  GPU tests try BV = 32 with three programs an SM. On an H100 (probe of 33f9910 against v3.2 at 01752fe, one machine):
  -3.9 / -4.8 / +1.0 us a layer on drone / easy-intent-00 / customer_service (78.7 / 51.7 / 150.2), FLA's bits on
  1.0000 of the elements; BV 32 and 16 still wrong there (engine/stages/core.md).
* v3.2: v3.1 plus the `rows` input: the path slots read q, k, v, g, beta at their packed rows, so stage
  `core` drops the `gather_slots` launch in front of the core. The fla-blocks solve forms all ten blocks of A before
  the substitution, so the four [16, K] key blocks are dead during it (sm_90: spills 600 -> 0 bytes, 2,984 -> 2,768
  SASS instructions, the same operations on the same values). v3.1's bits: the ladder records of 6683faa and 0538e72
  have the same probabilities and fidelity figures in `core` on all four workloads (`python -m measure.equivalence`);
  tests/test_gdn_chunk.py, and the tree-walk test of tests/test_gpu_gdn_chunk.py (passed at 6683faa). At 6683faa,
  drone 83.0 us a layer (solve 17.9) against stage-gathered 89.0 plus the gather's 9.0, customer_service 152.7
  (solve 31.2) against 150.0 plus 43.7; FLA 146.3 and 492.6. (Timed with v3.3's peeled last chunk, below, which
  changed the walk's time by -2.6 to +1.8 us; the kernels here are those of its `last_chunk_apart=False` with the
  one-launch solve, SASS instruction for instruction on sm_90, constant-bank offsets aside.)
  v3.3 (6683faa, dropped): the solve's diagonal substitutions in a launch of their own, and each sequence's last
  chunk after the walk's loop without the state update; neither gained (attempts `gdn-chunk-solve-diagonal-launch`,
  `gdn-chunk-walk-last-chunk-apart`).
* v3.1: the "fla-blocks" solve on one warp is the default; rounding points through the hardware
  conversion (`kernels.numerics` v2; `_rounded_operand` where only a dot reads the value): at 0538e72 drone 93.0 us
  a layer (FLA 145.7), customer_service 169.2 (FLA 493.6); the bit rounding of d6a7de0 took 143.5 and 276.4.
* v3: two launches, the solve apart (every chunk in parallel) and the walk reading T; the tree walk; the
  "fla-blocks" solve. At c2ff2ee, drone 133.8 us a layer with the walk and 156.7 without (FLA 145.1), customer_service
  251.9 and 562.6 (FLA 495.4).
* v2: the default tiling BV = 64 / 4 warps instead of BV = V / 8 warps: drone 207.9 us against 297.1.
* v1, body in functions: the chunk's steps (solve, w, u, output, state update) are the jit functions of
  kernels/gdn_chunk_body.py. A two-launch `schedule="split"` (w/u for every chunk in parallel, then the state pass)
  was added and removed: not bitwise with this kernel on the H200 and no faster than its best tiling
  (ablations/attempts.toml, `gdn-chunk-split-schedule`; code at commit 8a0fb8c).
* v1: q, k, v loaded where first used, q/k kept as the loaded bf16 tiles (dot operands on CUDA); spills
  1,372 bytes.
* v0 (never run): every tile converted to fp32 at its load and kept; spilled 1,680 bytes. The first compile for sm_90
  failed on module globals read inside the kernel (RCP_LN2, LOG2_CHUNK must be `tl.constexpr`), which the
  interpreter accepts: `python -m kernels.compile_check` caught it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_chunk_body import (
    RCP_LN2,
    _chunk_output,
    _chunk_qk,
    _chunk_state,
    _chunk_u,
    _chunk_w,
    _input_rows,
    _inverse_doubling,
    _inverse_fla_blocks,
    _loaded_operand,
    _opaque_zero,
    _rounded_operand,
)
from kernels.numerics import check_tensor, ieee_quiet, kernel_mode, output_tensor, to_bf16, to_f32

CHUNK = 64  # rows per chunk: FLA's chunk size, so a chunk boundary is where FLA's is
VALUE_BLOCK = 64  # the walk's BV (capped at V)
NUM_WARPS = 4  # the walk's warps
NUM_STAGES = 2
SOLVES = ("doubling", "fla-blocks", "blocks-doubling")
SOLVE = "blocks-doubling"  # the stage's since gdn_chunk v3.5 (core.md, "The solve's diagonal blocks by doubling")
SOLVE_NUM_WARPS = {"doubling": 4, "fla-blocks": 1, "blocks-doubling": 1}  # the first two swept (c2ff2ee); the third not
SOLVE_PRECISIONS = ("tf32", "tf32x3", "ieee")
WALK_FIELDS = (
    "sequence",
    "start",
    "source",
    "publish_chunks",
    "publish_slot",
    "publish2_chunks",
    "publish2_slot",
    "runs",
)
WALK_WIDTH = tl.constexpr(len(WALK_FIELDS))  # a walk row's entries (a jit global must be a constexpr)
WALK_RUNS = tl.constexpr(WALK_FIELDS.index("runs"))  # its column of the sequences that run (the same in every row)


@triton.jit
def _chunk_rows_and_gates(
    g, beta, slot_rows, bos, seq_len, i_t, i_hv, VALUE_HEADS: tl.constexpr, HAS_ROWS: tl.constexpr
):  # fmt: skip
    """Chunk i_t of the sequence at slot `bos` of length `seq_len`: its 64 slots, which of them are the sequence's, the
    input row of each (`_input_rows`), and its gates for value head i_hv in fp32: γ = cumsum(g) · log2(e) over the
    chunk (constant after the last valid row: g loads as 0 there) and β."""
    rows = i_t * 64 + tl.arange(0, 64)
    valid = rows < seq_len
    token = bos + rows
    input_row = _input_rows(slot_rows, token, valid, HAS_ROWS)
    gate_rows = input_row * VALUE_HEADS + i_hv
    b_gc = tl.cumsum(tl.load(g + gate_rows, mask=valid, other=0.0), axis=0) * RCP_LN2
    return token, valid, input_row, b_gc, to_f32(tl.load(beta + gate_rows, mask=valid, other=0.0))


@triton.jit
def _solve_chunk(cu_seqlens, chunk_indices, walk, i_c, TREE: tl.constexpr):
    """Program i_c's chunk of the solve launch: (needed, dummy, its sequence's first slot, the sequence's length, the
    chunk's index in it; the slot and length read only when needed or dummy). With TREE, chunks the walk does not
    compute (before the sequence's start chunk, or a dummy sequence's: column 1 of `walk`, negative for a dummy) are
    not needed, and a dummy sequence's chunk is `dummy` (its rows of o get zeros here: the walk skips dummy paths)."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int32)
    needed = i_t >= 0
    dummy = i_t < 0
    if TREE:
        start = tl.load(walk + i_n * WALK_WIDTH + 1).to(tl.int32)
        needed = (start >= 0) & (i_t >= start)
        dummy = start < 0
    bos = tl.load(cu_seqlens + i_n, mask=needed | dummy, other=0).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + i_n + 1, mask=needed | dummy, other=0).to(tl.int64) - bos).to(tl.int32)
    return needed, dummy, bos, seq_len, i_t


@triton.jit
def _gdn_chunk_solve_kernel(
    k,
    g,
    beta,
    solved,
    o,
    cu_seqlens,
    chunk_indices,
    walk,
    slot_rows,
    flags,
    num_flags,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    ROUND: tl.constexpr,
    TREE: tl.constexpr,
    ZERO_DUMMIES: tl.constexpr,
    ZERO_FLAGS: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    SOLVE: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    """T = (I + A)⁻¹ of one (chunk, value head) into `solved` [T, Hv, 64]: row r of the chunk holds T's row r (rows of
    the chunk's sequence only). With TREE, chunks the walk does not compute are skipped (`_solve_chunk`); with
    ZERO_DUMMIES a dummy path's chunk writes zeros to its rows of `o` [T, Hv, V] for the value head. With ZERO_FLAGS
    the programs zero the walk's `num_flags` int32 flags (its ticket counter first) in blocks of 128, block b by
    program b, b + programs, ... (the walk, the next launch, reads them). With HAS_ROWS, k, g and beta are read at row
    slot_rows[slot] of each slot."""
    BT: tl.constexpr = 64
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    if ZERO_FLAGS:
        programs = tl.num_programs(0) * tl.num_programs(1)
        flag = tl.arange(0, 128)
        for first in range((i_c * tl.num_programs(1) + i_hv) * 128, num_flags, programs * 128):
            tl.store(flags + first + flag, tl.zeros([128], dtype=tl.int32), mask=first + flag < num_flags)
    i_hk = i_hv // (VALUE_HEADS // KEY_HEADS)
    needed, dummy, bos, seq_len, i_t = _solve_chunk(cu_seqlens, chunk_indices, walk, i_c, TREE)
    if ZERO_DUMMIES:
        if dummy:  # a dummy path's chunk: zeros to its rows of o for this value head (no walk program runs it)
            rows = i_t * BT + tl.arange(0, BT)
            o_v = tl.arange(0, VALUE_DIM)
            zeros = tl.zeros([BT, VALUE_DIM], dtype=o.dtype.element_ty)
            tl.store(o + (((bos + rows) * VALUE_HEADS + i_hv) * VALUE_DIM)[:, None] + o_v[None, :], zeros,
                     mask=(rows < seq_len)[:, None])  # fmt: skip
    if needed:
        o_t = tl.arange(0, BT)
        token, valid, input_row, b_gc, b_beta = _chunk_rows_and_gates(
            g, beta, slot_rows, bos, seq_len, i_t, i_hv, VALUE_HEADS, HAS_ROWS
        )
        if SOLVE == "doubling":
            k16 = tl.load(k + ((input_row * KEY_HEADS + i_hk) * KEY_DIM)[:, None] + tl.arange(0, KEY_DIM)[None, :],
                          mask=valid[:, None], other=0.0)  # fmt: skip
            lower = o_t[:, None] > o_t[None, :]
            t_op = _inverse_doubling(
                _loaded_operand(k16, ROUND, TORCH_CPU), b_gc, b_beta, lower, ROUND, SOLVE_PRECISION, DOT_PRECISION,
                TORCH_CPU,
            )  # fmt: skip
            solved_rows = (token * VALUE_HEADS + i_hv) * BT
            tl.store(solved + solved_rows[:, None] + o_t[None, :], t_op, mask=valid[:, None])
        else:
            t00, t10, t11, t20, t21, t22, t30, t31, t32, t33 = _inverse_fla_blocks(
                k, slot_rows, bos + i_t * BT, seq_len - i_t * BT, i_hk, b_gc, b_beta, KEY_HEADS, KEY_DIM, HAS_ROWS,
                ROUND, SOLVE_PRECISION, DOT_PRECISION, TORCH_CPU, SOLVE == "blocks-doubling",
            )  # fmt: skip
            token0, rows_left = bos + i_t * BT, seq_len - i_t * BT
            zero = tl.zeros([16, 16], dtype=tl.float32)
            _store_block_row(solved, token0, rows_left, i_hv, 0, t00, zero, zero, zero, VALUE_HEADS, ROUND, TORCH_CPU)
            _store_block_row(solved, token0, rows_left, i_hv, 1, t10, t11, zero, zero, VALUE_HEADS, ROUND, TORCH_CPU)
            _store_block_row(solved, token0, rows_left, i_hv, 2, t20, t21, t22, zero, VALUE_HEADS, ROUND, TORCH_CPU)
            _store_block_row(solved, token0, rows_left, i_hv, 3, t30, t31, t32, t33, VALUE_HEADS, ROUND, TORCH_CPU)


@triton.jit
def _store_block_row(solved, token0, rows_left, i_hv, ROW_BLOCK: tl.constexpr, b0, b1, b2, b3,
                     VALUE_HEADS: tl.constexpr, ROUND: tl.constexpr, TORCH_CPU: tl.constexpr):  # fmt: skip
    """Rows 16 ROW_BLOCK .. 16 ROW_BLOCK + 15 of a chunk's T, given as four [16, 16] blocks (bf16↓ with rounding
    points), into `solved` [T, Hv, 64] at the chunk's first slot token0; rows at or past `rows_left` are not written."""
    rows = ROW_BLOCK * 16 + tl.arange(0, 16)
    base = solved + (((token0 + rows) * VALUE_HEADS + i_hv) * 64)[:, None] + tl.arange(0, 16)[None, :]
    mask = (rows < rows_left)[:, None]
    tl.store(base, _rounded_operand(b0, ROUND, TORCH_CPU), mask=mask)
    tl.store(base + 16, _rounded_operand(b1, ROUND, TORCH_CPU), mask=mask)
    tl.store(base + 32, _rounded_operand(b2, ROUND, TORCH_CPU), mask=mask)
    tl.store(base + 48, _rounded_operand(b3, ROUND, TORCH_CPU), mask=mask)


@triton.jit
def _walk_chunk(
    q, k, v, g, beta, o, solved, slot_rows, state, i_t, bos, seq_len, i_hv, i_hk, o_t, o_k, o_v, scale,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    HAS_ROWS: tl.constexpr, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """Chunk i_t of the walk's sequence from the chunk-start state: its output rows stored; returns the state after
    the chunk."""
    BT: tl.constexpr = 64
    token, valid, input_row, b_gc, b_beta = _chunk_rows_and_gates(
        g, beta, slot_rows, bos, seq_len, i_t, i_hv, VALUE_HEADS, HAS_ROWS
    )
    k_rows = (input_row * KEY_HEADS + i_hk) * KEY_DIM
    v_rows = (input_row * VALUE_HEADS + i_hv) * VALUE_DIM
    # Rows past the sequence end load k = q = v = beta = g = T = 0, so their rows and columns of u, w, v' and Q Kᵀ are
    # exact zeros and no mask beyond the triangles is needed. Tiles are loaded where they are first used and kept in
    # bf16 (the dot operands on CUDA), to keep the registers for the state.
    k16 = tl.load(k + k_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
    k_op = _loaded_operand(k16, ROUND, TORCH_CPU)
    t16 = tl.load(solved + ((token * VALUE_HEADS + i_hv) * BT)[:, None] + o_t[None, :], mask=valid[:, None],
                  other=0.0)  # fmt: skip
    t_op = _loaded_operand(t16, ROUND, TORCH_CPU)

    # w = T (K beta 2^γ), u = T (V beta)
    w_op = _chunk_w(t_op, k16, b_beta, b_gc, ROUND, DOT_PRECISION, TORCH_CPU)
    b_v = to_f32(tl.load(v + v_rows[:, None] + o_v[None, :], mask=valid[:, None], other=0.0))
    b_u = _chunk_u(t_op, b_v, b_beta, ROUND, DOT_PRECISION, TORCH_CPU)

    # v' = u - w Sb; output from the chunk-start state; then the state update
    state_op = _rounded_operand(state, ROUND, TORCH_CPU)
    v_new = b_u - tl.dot(w_op, state_op, input_precision=DOT_PRECISION)
    q_op = _loaded_operand(
        tl.load(q + k_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0), ROUND, TORCH_CPU
    )
    qk_op = _chunk_qk(q_op, k_op, b_gc, ROUND, DOT_PRECISION, TORCH_CPU)
    b_o = _chunk_output(state_op, v_new, q_op, qk_op, b_gc, scale, ROUND, DOT_PRECISION, TORCH_CPU)
    o_ptrs = o + ((token * VALUE_HEADS + i_hv) * VALUE_DIM)[:, None] + o_v[None, :]
    if ROUND:
        tl.store(o_ptrs, to_bf16(b_o), mask=valid[:, None])
    else:
        tl.store(o_ptrs, b_o, mask=valid[:, None])
    last = tl.minimum(seq_len - i_t * BT, BT) - 1
    g_last = tl.sum(tl.where(o_t == last, b_gc, 0.0), axis=0)
    return _chunk_state(state, v_new, k_op, b_gc, g_last, ROUND, DOT_PRECISION, TORCH_CPU)


@triton.jit
def _state_tile(i_v, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BV: tl.constexpr):
    """The offsets [K, BV] of value block i_v in a [K, V] state, built on an opaque zero where they are used: hoisted
    before the walk's loop, they were a tile live across it in spilled registers (sm_90, with the causal mask alike:
    408 -> 240 bytes of spills, gdn_chunk v3.4)."""
    key = tl.arange(0, KEY_DIM) + _opaque_zero()
    return key[:, None] * VALUE_DIM + (i_v * BV + tl.arange(0, BV))[None, :]


@triton.jit
def _publish(state, bank, flags, slot, i_hv, i_v, VALUE_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
             VALUE_DIM: tl.constexpr, NV: tl.constexpr):  # fmt: skip
    """Store the state in bank slot `slot`, then raise its flag (after a CTA barrier, with release semantics, so that
    a program that acquires the flag reads the whole state)."""
    state_tile = _state_tile(i_v, KEY_DIM, VALUE_DIM, VALUE_DIM // NV)
    tl.store(bank + ((slot * VALUE_HEADS + i_hv) * KEY_DIM).to(tl.int64) * VALUE_DIM + state_tile, state)
    tl.debug_barrier()
    tl.atomic_xchg(flags + 1 + (slot * VALUE_HEADS + i_hv) * NV + i_v, 1, sem="release", scope="gpu")


@triton.jit
def _gdn_chunk_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    solved,
    cu_seqlens,
    walk,
    bank,
    flags,
    slot_rows,
    scale,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    ROUND: tl.constexpr,
    TREE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    """The walk: one program per (sequence, value head, value block) through the sequence's chunks in order, the state
    in registers, T read from the solve launch's `solved`. With TREE, programs take tickets (flags[0]) and the k-th
    group of Hv · NV tickets runs sequence walk[k, 0] where k < walk[0, 7] (the sequences that run; the later groups,
    the dummy paths', end after their ticket: module docstring, "The tree walk"). With HAS_ROWS, q, k, v, g and beta
    are read at row slot_rows[slot] of each slot (T and o stay at the slots)."""
    NV: tl.constexpr = VALUE_DIM // BV
    if TREE:
        runs = tl.load(walk + WALK_RUNS)  # the walk's non-dummy sequences (beside the ticket: it does not depend on it)
        ticket = tl.atomic_add(flags, 1, sem="relaxed")  # orders nothing but the tickets (no fence, no L1 flush)
        group = ticket // (VALUE_HEADS * NV)
        if group < runs:  # the groups after them would run dummy paths: the solve launch zeroed their rows
            i_n = tl.load(walk + group * WALK_WIDTH).to(tl.int64)
            row = walk + i_n * WALK_WIDTH
            _walk_sequence(
                q, k, v, g, beta, o, h0, ht, solved, cu_seqlens, bank, flags, slot_rows, scale, i_n,
                (ticket // NV) % VALUE_HEADS, ticket % NV, tl.load(row + 1).to(tl.int32), tl.load(row + 2).to(tl.int32),
                tl.load(row + 3).to(tl.int32), tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32),
                tl.load(row + 6).to(tl.int32), KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, BV, HAS_H0, STORE_HT, ROUND,
                TREE, HAS_ROWS, DOT_PRECISION, TORCH_CPU,
            )  # fmt: skip
    else:
        _walk_sequence(
            q, k, v, g, beta, o, h0, ht, solved, cu_seqlens, bank, flags, slot_rows, scale, tl.program_id(2),
            tl.program_id(1), tl.program_id(0), 0, -1, 0, 0, 0, 0, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, BV,
            HAS_H0, STORE_HT, ROUND, TREE, HAS_ROWS, DOT_PRECISION, TORCH_CPU,
        )  # fmt: skip


@triton.jit
def _walk_sequence(
    q, k, v, g, beta, o, h0, ht, solved, cu_seqlens, bank, flags, slot_rows, scale, i_n, i_hv, i_v, start, source,
    publish_chunks, publish_slot, publish2_chunks, publish2_slot, KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    ROUND: tl.constexpr, TREE: tl.constexpr, HAS_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """Sequence i_n's value block i_v of value head i_hv from chunk `start`: from the zero state, h0, or (TREE, source
    >= 0) the state published in bank slot `source`; with TREE the state after chunk publish_chunks (publish2_chunks)
    published to bank slot publish_slot (publish2_slot); the final state to ht with STORE_HT."""
    BT: tl.constexpr = 64
    NV: tl.constexpr = VALUE_DIM // BV
    i_hk = i_hv // (VALUE_HEADS // KEY_HEADS)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    num_chunks = tl.cdiv(seq_len, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KEY_DIM)
    o_v = i_v * BV + tl.arange(0, BV)

    state_offsets = ((i_n * VALUE_HEADS + i_hv) * KEY_DIM).to(tl.int64) * VALUE_DIM
    if HAS_H0:
        state = tl.load(h0 + state_offsets + _state_tile(i_v, KEY_DIM, VALUE_DIM, BV))
    else:
        state = tl.zeros([KEY_DIM, BV], dtype=tl.float32)
    if TREE:
        if source >= 0:  # start from the state another program publishes at this sequence's start chunk
            flag = flags + 1 + (source * VALUE_HEADS + i_hv) * NV + i_v
            ready = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
            while ready == 0:
                ready = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
            source_state = ((source * VALUE_HEADS + i_hv) * KEY_DIM).to(tl.int64) * VALUE_DIM
            state = tl.load(bank + source_state + _state_tile(i_v, KEY_DIM, VALUE_DIM, BV), cache_modifier=".cg")

    for i_t in range(start, num_chunks):
        state = _walk_chunk(
            q, k, v, g, beta, o, solved, slot_rows, state, i_t, bos, seq_len, i_hv, i_hk, o_t, o_k, o_v, scale,
            KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, HAS_ROWS, ROUND, DOT_PRECISION, TORCH_CPU,
        )  # fmt: skip
        if TREE:
            if i_t + 1 == publish_chunks:
                _publish(state, bank, flags, publish_slot, i_hv, i_v, VALUE_HEADS, KEY_DIM, VALUE_DIM, NV)
            if i_t + 1 == publish2_chunks:
                _publish(state, bank, flags, publish2_slot, i_hv, i_v, VALUE_HEADS, KEY_DIM, VALUE_DIM, NV)
    if STORE_HT:
        tl.store(ht + state_offsets + _state_tile(i_v, KEY_DIM, VALUE_DIM, BV), state)


def gdn_chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    walk: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    bf16_points: bool = True,
    solve: str = SOLVE,
    solve_precision: str = "tf32",
    solve_num_warps: int | None = None,
    value_block: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    max_registers: int | None = None,
    unverified_value_block: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule forward over packed sequences (module docstring): returns (o, final state or None).

    q, k [T, Hk, K] bf16 (L2-normalised), v [T, Hv, V] bf16, g [T, Hv] fp32, beta [T, Hv] bf16, all contiguous;
    cu_seqlens [N + 1] int32/int64 on the same device; initial_state [N, Hv, K, V] fp32 contiguous or None. `out`
    [T, Hv, V] (bf16; fp32 with `bf16_points=False`) and `final_state_out` [N, Hv, K, V] fp32 are written in place when
    given. scale defaults to K ** -0.5. `chunk_indices` [chunks, 2]: FLA's varlen chunk layout of cu_seqlens (derived
    with a host sync when None). `walk` [N, 8] int32/int64: the tree walk of a plan with 64-row chunks (module
    docstring; no initial or final states with it). `rows` [T] int32/int64: the sequences' T rows are slots, and slot
    s reads q, k, v, g, beta at their row rows[s] (inputs of any R rows, values in [0, R) not checked: a device sync;
    the prefix tree's paths read straight from the packed rows, the bits of the inputs gathered to the slots first);
    o stays at the slots. Two launches, the solve (`gdn_chunk_solve`, grid chunks x Hv) and the walk (grid
    V / value_block x Hv x N, or its tickets; with `walk` the solve launch zeroes the walk's flags); no host sync
    when chunk_indices is given. `max_registers`: the walk's register cap per thread (ptxas `maxnreg`; None: the
    compiler's choice, 255 at the stage's tiling). A value block below 64 is refused on CUDA unless
    `unverified_value_block` (for the GPU tests and the probe that verify it: module docstring, "Tiles").
    """
    device = q.device
    if q.ndim != 3 or v.ndim != 3:
        shapes = f"{tuple(q.shape)}, {tuple(v.shape)}"
        raise ValueError(f"gdn_chunk_forward: q must be [T, Hk, K] and v [T, Hv, V], got {shapes}")
    input_rows, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    for name, t, dtype, shape in (
        ("q", q, torch.bfloat16, (input_rows, key_heads, key_dim)),
        ("k", k, torch.bfloat16, (input_rows, key_heads, key_dim)),
        ("v", v, torch.bfloat16, (input_rows, value_heads, value_dim)),
        ("g", g, torch.float32, (input_rows, value_heads)),
        ("beta", beta, torch.bfloat16, (input_rows, value_heads)),
    ):
        check_tensor(f"gdn_chunk_forward: {name}", t, dtype=dtype, shape=shape, device=device, contiguous=True)
    index_dtypes = (torch.int32, torch.int64)
    if rows is not None:
        check_tensor("gdn_chunk_forward: rows", rows, dtype=index_dtypes, shape=(None,), device=device, contiguous=True)
    tokens = input_rows if rows is None else rows.shape[0]
    check_tensor("gdn_chunk_forward: cu_seqlens", cu_seqlens, dtype=index_dtypes, shape=(None,), device=device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 1:
        raise ValueError(f"gdn_chunk_forward: cu_seqlens must hold N + 1 >= 2 offsets, got {tuple(cu_seqlens.shape)}")
    value_block = min(VALUE_BLOCK, value_dim) if value_block is None else value_block
    powers = (key_dim, value_dim, value_block)
    if any(n < 16 or n & (n - 1) for n in powers) or value_dim % value_block or value_heads % key_heads:
        raise ValueError(
            f"gdn_chunk_forward: K, V and the value block must be powers of two >= 16 with the block dividing V, and "
            f"Hk must divide Hv; got K={key_dim} V={value_dim} block={value_block} Hk={key_heads} Hv={value_heads}"
        )
    if value_block < 64 and device.type == "cuda" and not unverified_value_block:
        raise ValueError(
            f"gdn_chunk_forward: value block {value_block} < 64 gives wrong outputs on sm_90 under Triton 3.6 (its "
            "wgmma code; right but slower with DISABLE_MMA_V3=1: module docstring, 'Tiles'); "
            "unverified_value_block=True runs it anyway"
        )
    if solve_precision not in SOLVE_PRECISIONS:
        raise ValueError(f"gdn_chunk_forward: solve_precision {solve_precision!r} is not one of {SOLVE_PRECISIONS}")
    state_shape = (num_seqs, value_heads, key_dim, value_dim)
    if initial_state is not None:
        check_tensor(
            "gdn_chunk_forward: initial_state", initial_state, dtype=torch.float32, shape=state_shape, device=device,
            contiguous=True,
        )  # fmt: skip
    if walk is not None:
        check_tensor("gdn_chunk_forward: walk", walk, dtype=index_dtypes, shape=(num_seqs, WALK_WIDTH.value),
                     device=device, contiguous=True)  # fmt: skip
        if initial_state is not None or output_final_state:
            raise ValueError("gdn_chunk_forward: the tree walk takes no initial state and gives no final state")
    out_dtype = torch.bfloat16 if bf16_points else torch.float32
    o = output_tensor("gdn_chunk_forward: out", out, (tokens, value_heads, value_dim), out_dtype, device)
    final = None
    if output_final_state:
        final = output_tensor("gdn_chunk_forward: final_state_out", final_state_out, state_shape, torch.float32, device)
    blocks = value_dim // value_block
    if walk is None:
        grid, bank, flags = (blocks, value_heads, num_seqs), o, None  # bank and flags not read without TREE
    else:
        grid = (blocks * value_heads * num_seqs,)
        slots = num_seqs + 1  # the walk's publish slots: one per sequence and one more (module docstring)
        bank = torch.empty((slots, value_heads, key_dim, value_dim), dtype=torch.float32, device=device)
        flags = torch.empty(1 + slots * value_heads * blocks, dtype=torch.int32, device=device)  # the solve zeroes
    solved = gdn_chunk_solve(
        k, g, beta, cu_seqlens, chunk_indices, walk=walk, rows=rows, out=o, flags=flags, bf16_points=bf16_points,
        solve=solve, solve_precision=solve_precision, num_warps=solve_num_warps,
    )  # fmt: skip
    torch_cpu = kernel_mode(_gdn_chunk_fwd_kernel, device)
    scale = key_dim**-0.5 if scale is None else scale
    with ieee_quiet(torch_cpu):
        _gdn_chunk_fwd_kernel[grid](
            q,
            k,
            v,
            g,
            beta,
            o,
            o if initial_state is None else initial_state,  # not read without HAS_H0
            o if final is None else final,  # not written without STORE_HT
            solved,
            cu_seqlens,
            cu_seqlens if walk is None else walk,  # not read without TREE
            bank,
            o if flags is None else flags,  # not read without TREE
            cu_seqlens if rows is None else rows,  # not read without HAS_ROWS
            scale,
            KEY_HEADS=key_heads,
            VALUE_HEADS=value_heads,
            KEY_DIM=key_dim,
            VALUE_DIM=value_dim,
            BV=value_block,
            HAS_H0=initial_state is not None,
            STORE_HT=final is not None,
            ROUND=bf16_points,
            TREE=walk is not None,
            HAS_ROWS=rows is not None,
            DOT_PRECISION="tf32" if bf16_points else "ieee",  # bf16 operands: the precision is not used
            TORCH_CPU=torch_cpu,
            num_warps=num_warps,
            num_stages=num_stages,
            **({} if max_registers is None else {"maxnreg": max_registers}),
        )
    return o, final


def gdn_chunk_solve(
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor | None = None,
    *,
    walk: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    bf16_points: bool = True,
    solve: str = SOLVE,
    solve_precision: str = "tf32",
    num_warps: int | None = None,
) -> torch.Tensor:
    """The solve launch of `gdn_chunk_forward`: T = (I + A)⁻¹ of every (chunk, value head), one program each over
    `chunk_indices` [chunks, 2] (FLA's varlen layout; from `chunk_indices_of(cu_seqlens)` when None, a host sync),
    skipping the chunks a `walk` does not compute; with `rows`, slot s reads k, g, beta at row rows[s]. Returns
    T [T, Hv, 64] over the T slots (bf16, fp32 without rounding points): row r of a chunk holds T's row r; rows
    outside every sequence and of skipped chunks are not written. With a `walk` and `out` (the forward's o
    [T, Hv, V]), the rows of the walk's dummy paths in `out` get zeros here, since no walk program runs them. `flags`
    (the walk's int32 tickets and flags, any contiguous length) are zeroed here, by the launch's programs (no fill
    launch of their own: 48 per forward, about 1.1 us each on an H100 at 1143e81) or, with no chunk to solve, by
    torch. Inputs as `gdn_chunk_forward`'s, checked there."""
    device, value_heads = k.device, g.shape[1]
    tokens = k.shape[0] if rows is None else rows.shape[0]
    if solve not in SOLVES:
        raise ValueError(f"gdn_chunk_solve: solve {solve!r} is not one of {SOLVES}")
    num_warps = SOLVE_NUM_WARPS[solve] if num_warps is None else num_warps
    if chunk_indices is None:
        chunk_indices = chunk_indices_of(cu_seqlens)
    index_dtypes = (torch.int32, torch.int64)
    check_tensor("gdn_chunk_solve: chunk_indices", chunk_indices, dtype=index_dtypes, shape=(None, 2), device=device,
                 contiguous=True)  # fmt: skip
    torch_cpu = kernel_mode(_gdn_chunk_solve_kernel, device)
    solved = torch.empty((tokens, value_heads, CHUNK), dtype=torch.bfloat16 if bf16_points else torch.float32,
                         device=device)  # fmt: skip
    if flags is not None:
        check_tensor("gdn_chunk_solve: flags", flags, dtype=torch.int32, shape=(None,), device=device, contiguous=True)
    if chunk_indices.shape[0]:
        with ieee_quiet(torch_cpu):
            _gdn_chunk_solve_kernel[(chunk_indices.shape[0], value_heads)](
                k,
                g,
                beta,
                solved,
                solved if out is None else out,  # not written without ZERO_DUMMIES
                cu_seqlens,
                chunk_indices,
                chunk_indices if walk is None else walk,  # not read without TREE
                chunk_indices if rows is None else rows,  # not read without HAS_ROWS
                chunk_indices if flags is None else flags,  # not written without ZERO_FLAGS
                0 if flags is None else flags.shape[0],
                KEY_HEADS=k.shape[1],
                VALUE_HEADS=value_heads,
                KEY_DIM=k.shape[2],
                VALUE_DIM=CHUNK if out is None else out.shape[2],
                ROUND=bf16_points,
                TREE=walk is not None,
                ZERO_DUMMIES=walk is not None and out is not None,
                ZERO_FLAGS=flags is not None,
                HAS_ROWS=rows is not None,
                SOLVE=solve,
                SOLVE_PRECISION=solve_precision if bf16_points else "ieee",
                DOT_PRECISION="tf32" if bf16_points else "ieee",
                TORCH_CPU=torch_cpu,
                num_warps=num_warps,
            )
    elif flags is not None:
        flags.zero_()
    return solved


def chunk_indices_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """FLA's varlen chunk layout of `cu_seqlens` [N + 1]: [chunks, 2] int64 (sequence, chunk within it), one row per
    64-row chunk of every sequence in order (empty sequences have none). Syncs with the host (the engine passes the
    plan's instead)."""
    counts = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor").to(torch.int64)
    sequence = torch.repeat_interleave(torch.arange(len(counts), device=cu_seqlens.device), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.stack([sequence, torch.arange(len(sequence), device=cu_seqlens.device) - first], dim=1).contiguous()


class GdnChunkCore:
    """`gdn_chunk_forward` behind the varlen signature of `kernels.gdn_core.FlaForwardCore` (what the backbone and
    `engine.tree.tree_gdn_core` call): q, k [1, T, Hk, K], v [1, T, Hv, V], g, beta [1, T, Hv]; returns
    (o [1, T, Hv, V] bf16, final state or None). q/k must come normalised (`use_qk_l2norm_in_kernel=False`); FLA's
    `chunk_indices` layout goes to the solve launch, `walk` (the plan's tree walk of a replicated call) and `rows`
    (each slot's packed row: q, k, v, g, beta then hold the packed rows) to both; `chunk_offsets` and
    `cu_seqlens_cpu` are accepted and not needed. `options` go to every `gdn_chunk_forward` call (value_block,
    num_warps, solve, ...)."""

    def __init__(self, **options):
        self.options = options

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor | None = None,
        walk: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        scale: float | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        chunk_offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if use_qk_l2norm_in_kernel:
            raise ValueError("GdnChunkCore takes q/k already L2-normalised (kernels.gdn_prep with qk_l2norm=True)")
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            if t.shape[0] != 1:
                raise ValueError(f"GdnChunkCore: {name} must be [1, T, ...] (packed sequences), got {tuple(t.shape)}")
        if initial_state is not None and not initial_state.is_contiguous():
            initial_state = initial_state.contiguous()
        o, final = gdn_chunk_forward(
            q[0],
            k[0],
            v[0],
            g[0],
            beta[0],
            cu_seqlens,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_indices=chunk_indices,
            walk=walk,
            rows=rows,
            **self.options,
        )
        return o[None], final
