"""The chunk body of the chunked gated delta rule forward (`kernels.gdn_chunk`'s one-launch kernel): the rounding
points, the dot operands and the steps of one 64-row chunk (solve, w, u, output, state update) as jit functions. Math
and rounding points: `kernels.gdn_chunk`'s module docstring. Triton inlines these functions into the kernel (its
sm_90 PTX is the one it had with the steps written inline, debug info aside). A two-launch schedule that also called
them was dropped (ablations/attempts.toml, `gdn-chunk-split-schedule`): under the interpreter it had the kernel's
bits, on the H200 it did not.

On the GPU a rounding point's value is bf16-exact and reaches the dot as bf16 (exact); under the CPU interpreter the
dots run on fp32 operands holding the same values (products of bf16 values are exact in fp32 either way).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.numerics import round_to_bf16, to_f32

LOG2_CHUNK = tl.constexpr(6)  # log2 of the 64-row chunk (a jit global must be a constexpr)
RCP_LN2 = tl.constexpr(1.4426950216)  # FLA's constant (fla.ops.utils.constant.RCP_LN2): γ in log2 units


@triton.jit
def _bf16_point(x, ROUND: tl.constexpr):
    """A rounding point: x rounded to bf16 (kept as fp32) when ROUND, else x."""
    if ROUND:
        x = round_to_bf16(x)
    return x


@triton.jit
def _operand(x, ROUND: tl.constexpr, TORCH_CPU: tl.constexpr):
    """x (fp32, bf16-exact when ROUND) as a dot operand: bf16 on CUDA when ROUND (exact), else fp32."""
    if ROUND and not TORCH_CPU:
        y = x.to(tl.bfloat16)
    else:
        y = x
    return y


@triton.jit
def _loaded_operand(x16, ROUND: tl.constexpr, TORCH_CPU: tl.constexpr):
    """A loaded bf16 tile as a dot operand: itself on CUDA when ROUND, else fp32 (exact)."""
    if ROUND and not TORCH_CPU:
        y = x16
    else:
        y = to_f32(x16)
    return y


@triton.jit
def _chunk_inverse(
    k_op, b_gc, b_beta, o_t, lower, eye, ROUND: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """T = (I + A)⁻¹ as a dot operand, A = strict_lower(diag(β) K Kᵀ ⊙ 2^(γ_r − γ_s)), by recursive block inversion
    (10 dots at SOLVE_PRECISION); bf16↓ at the end with rounding points."""
    b_a = tl.dot(k_op, tl.trans(k_op), input_precision=DOT_PRECISION)
    b_a = tl.where(lower, b_a * tl.exp2(b_gc[:, None] - b_gc[None, :]), 0.0) * b_beta[:, None]
    first = (o_t[:, None] // 2 == o_t[None, :] // 2) & lower
    inverse = eye - tl.where(first, b_a, 0.0)
    for level in tl.static_range(1, LOG2_CHUNK):
        block = 1 << level
        off = (o_t[:, None] // (2 * block) == o_t[None, :] // (2 * block)) & (
            o_t[:, None] // block > o_t[None, :] // block
        )
        below = tl.dot(tl.where(off, b_a, 0.0), inverse, input_precision=SOLVE_PRECISION)
        inverse = inverse - tl.dot(inverse, below, input_precision=SOLVE_PRECISION)
    return _operand(_bf16_point(inverse, ROUND), ROUND, TORCH_CPU)


@triton.jit
def _chunk_w(t_op, k16, b_beta, b_gc, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr):
    """w = bf16↓(T · bf16↓(bf16↓(K ⊙ β) ⊙ 2^γ)) (fp32 holding bf16 values with rounding points)."""
    k_beta = _bf16_point(_bf16_point(to_f32(k16) * b_beta[:, None], ROUND) * tl.exp2(b_gc)[:, None], ROUND)
    return _bf16_point(tl.dot(t_op, _operand(k_beta, ROUND, TORCH_CPU), input_precision=DOT_PRECISION), ROUND)


@triton.jit
def _chunk_u(t_op, b_v, b_beta, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr):
    """u = bf16↓(T · bf16↓(V ⊙ β)) for one value block of V (fp32)."""
    v_beta = _bf16_point(b_v * b_beta[:, None], ROUND)
    return _bf16_point(tl.dot(t_op, _operand(v_beta, ROUND, TORCH_CPU), input_precision=DOT_PRECISION), ROUND)


@triton.jit
def _chunk_output(
    state_op, v_new, q_op, k_op, b_gc, causal, scale, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """o = scale · (Q S_b ⊙ 2^γ) + scale · (bf16↓(causal(Q Kᵀ ⊙ 2^(γ_r − γ_s))) · bf16↓(v')), from the chunk-start
    state S_b (as the operand `state_op`) and v' = u − w S_b; fp32."""
    inter = tl.dot(q_op, state_op, input_precision=DOT_PRECISION) * tl.exp2(b_gc)[:, None]
    b_qk = tl.dot(q_op, tl.trans(k_op), input_precision=DOT_PRECISION)
    b_qk = tl.where(causal, b_qk * tl.exp2(b_gc[:, None] - b_gc[None, :]), 0.0)  # inf above: never selected
    intra = tl.dot(
        _operand(_bf16_point(b_qk, ROUND), ROUND, TORCH_CPU),
        _operand(_bf16_point(v_new, ROUND), ROUND, TORCH_CPU),
        input_precision=DOT_PRECISION,
    )
    return inter * scale + intra * scale


@triton.jit
def _chunk_state(
    state, v_new, k_op, b_gc, g_last, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr
):
    """The state after the chunk: S · 2^γ_last + Kᵀ · bf16↓(v' ⊙ 2^(γ_last − γ)), fp32 (the dot accumulates onto it)."""
    v_decayed = _bf16_point(v_new * tl.exp2(g_last - b_gc)[:, None], ROUND)
    state = state * tl.exp2(g_last)
    return tl.dot(tl.trans(k_op), _operand(v_decayed, ROUND, TORCH_CPU), state, input_precision=DOT_PRECISION)
