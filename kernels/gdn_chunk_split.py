"""The chunked gated delta rule forward in two launches (`schedule="split"` of `kernels.gdn_chunk`): the
state-independent work of every chunk in parallel, then the state pass per sequence.

Same math, same order and same rounding points as the one-kernel forward (`kernels.gdn_chunk`, its module docstring
has the math per chunk and the solve); only the schedule differs:
1. `_gdn_chunk_wu_kernel`, grid (C, Hv), one program per (chunk of a sequence, value head), C = the call's chunk count
   (`chunk_indices` [C, 2]: (sequence, chunk within it), FLA's varlen layout, the plan's `GdnCall.chunk_indices`):
   γ = cumsum(g)·log2(e) within the chunk, A = strict_lower(diag(β) K Kᵀ ⊙ 2^(γ_r − γ_s)), T = (I + A)⁻¹ (the same
   recursive block inversion, 10 dots at `solve_precision`), w = bf16↓(T · bf16↓(bf16↓(K ⊙ β) ⊙ 2^γ)) and
   u = bf16↓(T · bf16↓(V ⊙ β)), u computed in column blocks of the value block BV, as the one-kernel forward's
   programs compute it. Written to a workspace: w [T, Hv, K] and u [T, Hv, V] bf16 (they are bf16-exact at that
   point: the one-kernel forward rounds them there and keeps the rounded value) and the in-chunk cumsum(g) [T, Hv]
   fp32, before its scaling by log2(e) (the one-kernel forward keeps it in fp32; the second launch scales it as that
   kernel does, so that the compiler sees the same multiply feeding the same subtractions and may contract them into
   the same FMAs). Without rounding points (`bf16_points=False`) w and u are fp32.
2. `_gdn_chunk_state_kernel`, grid (V / BV, Hv, N), one program per (sequence, value head, value block) that walks
   its sequence's chunks in order with the fp32 state S [K, BV] in registers, from the initial state (or zeros) to
   the final state: reads cumsum(g), w, u, q, k, computes γ, v' = u − w Sb, the output and the state update exactly
   as the one-kernel forward (rows past the sequence end read w = u = 0, the values the one-kernel forward holds
   there, and γ = γ_last; on those rows γ reaches no written value; their outputs are not written).

Workspace: Hv · (2K + 2V + 4) bytes per row with rounding points (fp32 w/u: Hv · (4K + 4V + 4)), written once by the
first launch and read V / BV times (w, cumsum) or once (u) by the second; at the 27B shapes (Hv 48, K = V = 128) 24.8 KB
per row, 26.6 MB for drone's 1,074 path slots. No atomics, no reduction across programs: each element of w, u, cumsum, o
and the final state has one writer.

Exactness: bit-identical to the one-kernel forward (same tile shapes, operands and accumulation order in every dot,
the same values at every rounding point), outputs and final states, with and without rounding points, for every
value block (tests/test_gdn_chunk_split.py, interpreter). On the GPU expected, not yet shown: Triton 3.9 gives every
dot of both kernels the fused kernel's MMA version, instruction shape and precision for sm_90, and the same warp
layout at BV 64 / 4 warps; at BV 128 / 8 warps the w and u dots of the first launch are laid over warps [4, 2] where
the fused kernel has [8, 1] (same instruction, same k order). tests/test_gpu_gdn_chunk.py
`test_split_schedule_is_the_fused_kernel_bit_for_bit` and the probe's `bit_equal_share_vs_twin`
(`measure.gdn_chunk_probe`) check it. Untimed (engine/stages/core.md, "Split schedule").

The chunk index must come from the caller (the plan's, built on the host with the plan: no host sync, so the launch
can be captured in a CUDA graph); other callers get FLA's `prepare_chunk_indices` of their bounds (a host sync).

Version history (ptxas -v for sm_90a at the 27B shapes, BV 128 / 8 warps: first launch 249 registers, no spills;
second 404 bytes of spill stores, 48 at BV 64 / 4 warps; the one-kernel forward 1,372):
* v1 (this file): the steps shared with the one-kernel forward called from kernels/gdn_chunk_body.py instead of
  copied (the same sm_90 PTX as v0, debug info aside); the chunk index from FLA's `prepare_chunk_indices` when the
  caller has none. Never run on a GPU.
* v0: the two kernels above with the one-kernel forward's chunk body copied line for line.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_chunk_body import (
    RCP_LN2,
    _bf16_point,
    _chunk_inverse,
    _chunk_output,
    _chunk_state,
    _chunk_u,
    _chunk_w,
    _loaded_operand,
    _operand,
)
from kernels.numerics import to_bf16, to_f32


@triton.jit
def _gdn_chunk_wu_kernel(
    k,
    v,
    g,
    beta,
    w_out,
    u_out,
    g_cum_out,
    cu_seqlens,
    chunk_indices,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BV: tl.constexpr,
    ROUND: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    BT: tl.constexpr = 64
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_hk = i_hv // (VALUE_HEADS // KEY_HEADS)
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KEY_DIM)
    lower = o_t[:, None] > o_t[None, :]
    eye = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    rows = i_t * BT + o_t
    valid = rows < seq_len
    token = bos + rows
    k_rows = (token * KEY_HEADS + i_hk) * KEY_DIM
    v_rows = (token * VALUE_HEADS + i_hv) * VALUE_DIM
    gate_rows = token * VALUE_HEADS + i_hv

    # the one-kernel forward's chunk body up to u: the same loads, then the shared steps (kernels/gdn_chunk_body.py)
    b_g = tl.load(g + gate_rows, mask=valid, other=0.0)
    b_cum = tl.cumsum(b_g, axis=0)  # stored before the scaling (below: what the compiler may fuse it into)
    b_gc = b_cum * RCP_LN2
    b_beta = to_f32(tl.load(beta + gate_rows, mask=valid, other=0.0))
    k16 = tl.load(k + k_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
    k_op = _loaded_operand(k16, ROUND, TORCH_CPU)

    t_op = _chunk_inverse(k_op, b_gc, b_beta, o_t, lower, eye, ROUND, SOLVE_PRECISION, DOT_PRECISION, TORCH_CPU)
    b_w = _chunk_w(t_op, k16, b_beta, b_gc, ROUND, DOT_PRECISION, TORCH_CPU)
    w_rows = (token * VALUE_HEADS + i_hv) * KEY_DIM
    if ROUND:
        tl.store(w_out + w_rows[:, None] + o_k[None, :], to_bf16(b_w), mask=valid[:, None])
    else:
        tl.store(w_out + w_rows[:, None] + o_k[None, :], b_w, mask=valid[:, None])
    for i_v in tl.static_range(VALUE_DIM // BV):  # u per value block: the one-kernel forward's dot shapes
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = to_f32(tl.load(v + v_rows[:, None] + o_v[None, :], mask=valid[:, None], other=0.0))
        b_u = _chunk_u(t_op, b_v, b_beta, ROUND, DOT_PRECISION, TORCH_CPU)
        if ROUND:
            tl.store(u_out + v_rows[:, None] + o_v[None, :], to_bf16(b_u), mask=valid[:, None])
        else:
            tl.store(u_out + v_rows[:, None] + o_v[None, :], b_u, mask=valid[:, None])
    tl.store(g_cum_out + gate_rows, b_cum, mask=valid)


@triton.jit
def _gdn_chunk_state_kernel(
    q,
    k,
    w,
    u,
    g_cum,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    ROUND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    BT: tl.constexpr = 64
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_n = tl.program_id(2)
    i_hk = i_hv // (VALUE_HEADS // KEY_HEADS)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KEY_DIM)
    o_v = i_v * BV + tl.arange(0, BV)
    causal = o_t[:, None] >= o_t[None, :]

    state_offsets = ((i_n * VALUE_HEADS + i_hv) * KEY_DIM).to(tl.int64) * VALUE_DIM
    state_tile = o_k[:, None] * VALUE_DIM + o_v[None, :]
    if HAS_H0:
        state = tl.load(h0 + state_offsets + state_tile)
    else:
        state = tl.zeros([KEY_DIM, BV], dtype=tl.float32)

    for i_t in range(0, tl.cdiv(seq_len, BT)):
        rows = i_t * BT + o_t
        valid = rows < seq_len
        token = bos + rows
        k_rows = (token * KEY_HEADS + i_hk) * KEY_DIM
        v_rows = (token * VALUE_HEADS + i_hv) * VALUE_DIM
        w_rows = (token * VALUE_HEADS + i_hv) * KEY_DIM
        gate_rows = token * VALUE_HEADS + i_hv

        b_cum = tl.load(g_cum + gate_rows, mask=valid, other=0.0)
        last = tl.minimum(seq_len - i_t * BT, BT) - 1
        # past the end the one-kernel forward's cumsum is constant (g loads as 0 there); then γ as it computes it
        b_gc = tl.where(valid, b_cum, tl.sum(tl.where(o_t == last, b_cum, 0.0), axis=0)) * RCP_LN2
        g_last = tl.sum(tl.where(o_t == last, b_gc, 0.0), axis=0)
        k16 = tl.load(k + k_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
        k_op = _loaded_operand(k16, ROUND, TORCH_CPU)
        w_op = _loaded_operand(
            tl.load(w + w_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0), ROUND, TORCH_CPU
        )
        b_u = to_f32(tl.load(u + v_rows[:, None] + o_v[None, :], mask=valid[:, None], other=0.0))

        # from here the one-kernel forward's chunk body: the shared steps (kernels/gdn_chunk_body.py)
        state_op = _operand(_bf16_point(state, ROUND), ROUND, TORCH_CPU)
        v_new = b_u - tl.dot(w_op, state_op, input_precision=DOT_PRECISION)
        q_op = _loaded_operand(
            tl.load(q + k_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0), ROUND, TORCH_CPU
        )
        b_o = _chunk_output(state_op, v_new, q_op, k_op, b_gc, causal, scale, ROUND, DOT_PRECISION, TORCH_CPU)
        o_ptrs = o + v_rows[:, None] + o_v[None, :]
        if ROUND:
            tl.store(o_ptrs, to_bf16(b_o), mask=valid[:, None])
        else:
            tl.store(o_ptrs, b_o, mask=valid[:, None])
        state = _chunk_state(state, v_new, k_op, b_gc, g_last, ROUND, DOT_PRECISION, TORCH_CPU)

    if STORE_HT:
        tl.store(ht + state_offsets + state_tile, state)


def launch_split(
    q, k, v, g, beta, o, initial_state, final, cu_seqlens, chunk_indices, *, scale, value_block, bf16_points,
    solve_precision, num_warps, num_stages, torch_cpu,
) -> None:  # fmt: skip
    """Both launches into `o` (and `final` if not None), arguments checked by `kernels.gdn_chunk.gdn_chunk_forward`;
    the workspace (w, u, cumsum(g)) is allocated here (inside a CUDA graph: from the graph's pool, no host sync)."""
    tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    work_dtype = torch.bfloat16 if bf16_points else torch.float32
    w = torch.empty((tokens, value_heads, key_dim), dtype=work_dtype, device=q.device)
    u = torch.empty((tokens, value_heads, value_dim), dtype=work_dtype, device=q.device)
    g_cum = torch.empty((tokens, value_heads), dtype=torch.float32, device=q.device)
    heads = {"KEY_HEADS": key_heads, "VALUE_HEADS": value_heads, "KEY_DIM": key_dim, "VALUE_DIM": value_dim}
    common = heads | {"BV": value_block, "ROUND": bf16_points, "TORCH_CPU": torch_cpu}
    dot_precision = "tf32" if bf16_points else "ieee"  # bf16 operands: the precision is not used
    if chunk_indices.shape[0]:
        _gdn_chunk_wu_kernel[(chunk_indices.shape[0], value_heads)](
            k, v, g, beta, w, u, g_cum, cu_seqlens, chunk_indices,
            SOLVE_PRECISION=solve_precision if bf16_points else "ieee", DOT_PRECISION=dot_precision,
            num_warps=num_warps, num_stages=num_stages, **common,
        )  # fmt: skip
    _gdn_chunk_state_kernel[(value_dim // value_block, value_heads, cu_seqlens.shape[0] - 1)](
        q, k, w, u, g_cum, o,
        o if initial_state is None else initial_state,  # not read without HAS_H0
        o if final is None else final,  # not written without STORE_HT
        cu_seqlens, scale,
        HAS_H0=initial_state is not None, STORE_HT=final is not None, DOT_PRECISION=dot_precision,
        num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
