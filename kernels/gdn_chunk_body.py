"""The chunk body of the chunked gated delta rule forward (`kernels.gdn_chunk`'s solve and walk kernels): the rounding
points, the dot operands and the steps of one 64-row chunk (the two solves, w, u, output, state update) as jit
functions. Math and rounding points: `kernels.gdn_chunk`'s module docstring. Triton inlines these functions into the
kernels (v1's sm_90 PTX was the one it had with the steps written inline, debug info aside). A two-launch schedule
of v1 that also called them was dropped (ablations/attempts.toml, `gdn-chunk-split-schedule`): under the interpreter it
had the kernel's bits, on the H200 it did not.

On the GPU a rounding point's value is bf16-exact and reaches the dot as bf16 (exact): where only a dot reads it,
`_rounded_operand` converts straight to the bf16 operand (the hardware's nearest-even conversion, one step); under the
CPU interpreter the dots run on fp32 operands holding the same values (products of bf16 values are exact in fp32
either way).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.numerics import INTERPRETED, round_to_bf16, to_f32

LOG2_CHUNK = tl.constexpr(6)  # log2 of the 64-row chunk (a jit global must be a constexpr)
RCP_LN2 = tl.constexpr(1.4426950216)  # FLA's constant (fla.ops.utils.constant.RCP_LN2): γ in log2 units


@triton.jit
def _opaque_zero():
    """The int32 0 as inline PTX that is not pure, so the compiler cannot see its value or hoist it: an index tile
    built on it inside the walk's loop is recomputed where it is used, not computed before the loop and kept live (in
    spilled registers) across it. Plain 0 when interpreted (the interpreter runs no PTX)."""
    if INTERPRETED:
        zero = 0
    else:
        zero = tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return zero


@triton.jit
def _bf16_point(x, ROUND: tl.constexpr):
    """A rounding point: x rounded to bf16 (kept as fp32) when ROUND, else x."""
    if ROUND:
        x = round_to_bf16(x)
    return x


@triton.jit
def _rounded_operand(x, ROUND: tl.constexpr, TORCH_CPU: tl.constexpr):
    """bf16↓(x) as a dot operand (a rounding point that only a dot reads): on CUDA with rounding points the hardware
    conversion to bf16 (nearest, ties to even) in one step; else fp32 (`_bf16_point`: rounded with rounding points)."""
    if ROUND and not TORCH_CPU:
        y = x.to(tl.bfloat16)
    else:
        y = _bf16_point(x, ROUND)
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
def _inverse_doubling(
    k_op, b_gc, b_beta, lower, ROUND: tl.constexpr, SOLVE_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """T = (I + A)⁻¹ as a dot operand, A = strict_lower(diag(β) K Kᵀ ⊙ 2^(γ_r − γ_s)), by recursive block inversion
    on the whole 64-row tile (`_doubling_inverse`: 10 dots at SOLVE_PRECISION); bf16↓ at the end with rounding
    points."""
    b_a = tl.dot(k_op, tl.trans(k_op), input_precision=DOT_PRECISION)
    b_a = tl.where(lower, b_a * tl.exp2(b_gc[:, None] - b_gc[None, :]), 0.0) * b_beta[:, None]
    return _rounded_operand(_doubling_inverse(b_a, 64, LOG2_CHUNK, SOLVE_PRECISION), ROUND, TORCH_CPU)


@triton.jit
def _doubling_inverse(a, SIZE: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)⁻¹ of a strictly lower SIZE x SIZE tile (SIZE = 2^LEVELS) by recursive block inversion: D = I − a on the
    2 x 2 diagonal blocks, then for b = 2, 4, ..., SIZE / 2 D ← D − D · (L_b · D), L_b = a on the lower-left b x b block
    of every 2b x 2b diagonal block ([[D₁₁, 0], [L₂₁, D₂₂]]⁻¹ = [[D₁₁, 0], [−D₂₂ L₂₁ D₁₁, D₂₂]], all blocks of a level
    at once): 2 (LEVELS − 1) dependent dots at PRECISION, fp32 accumulate. The `doubling` solve's on the whole chunk,
    `blocks-doubling`'s on each diagonal 16 x 16 block (6 dots instead of the substitution's 14 dependent row steps)."""
    o = tl.arange(0, SIZE)
    first = (o[:, None] // 2 == o[None, :] // 2) & (o[:, None] > o[None, :])
    inverse = (o[:, None] == o[None, :]).to(tl.float32) - tl.where(first, a, 0.0)
    for level in tl.static_range(1, LEVELS):
        block = 1 << level
        off = (o[:, None] // (2 * block) == o[None, :] // (2 * block)) & (o[:, None] // block > o[None, :] // block)
        below = _dot(tl.where(off, a, 0.0), inverse, PRECISION)
        inverse = inverse - _dot(inverse, below, PRECISION)
    return inverse


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a · b, fp32 accumulate, at PRECISION (the solve's merge dots)."""
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _quarters(x):
    """The four 16-row slices of a [64] vector, rows 16 j .. 16 j + 15 for j = 0..3 (moved, not computed)."""
    halves_b0, halves_b1 = tl.split(tl.permute(tl.reshape(x, (2, 2, 16)), (2, 0, 1)))  # [16, a] with j = 2 a + b
    q0, q2 = tl.split(halves_b0)
    q1, q3 = tl.split(halves_b1)
    return q0, q1, q2, q3


@triton.jit
def _input_rows(slot_rows, slots, valid, HAS_ROWS: tl.constexpr):
    """The input row of each slot: slot_rows[slot] with HAS_ROWS (masked slots read row 0), else the slot itself."""
    if HAS_ROWS:
        rows = tl.load(slot_rows + slots, mask=valid, other=0).to(tl.int64)
    else:
        rows = slots
    return rows


@triton.jit
def _key_block(
    k, slot_rows, token0, rows_left, j: tl.constexpr, i_hk, KEY_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
    HAS_ROWS: tl.constexpr, ROUND: tl.constexpr, TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """Rows 16 j .. 16 j + 15 of the chunk's keys [16, K] as a dot operand (slots token0 + ..., read through
    `slot_rows` with HAS_ROWS), rows at or past `rows_left` loaded as zeros."""
    rows = j * 16 + tl.arange(0, 16)
    valid = rows < rows_left
    source = _input_rows(slot_rows, token0 + rows, valid, HAS_ROWS)
    offsets = (source * KEY_HEADS + i_hk)[:, None] * KEY_DIM + tl.arange(0, KEY_DIM)[None, :]
    return _loaded_operand(tl.load(k + offsets, mask=valid[:, None], other=0.0), ROUND, TORCH_CPU)


@triton.jit
def _kkt_block(k_i, k_j, gc_i, gc_j, beta_i, DIAGONAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The (i, j) 16 x 16 block of A = strict_lower(diag(β) K Kᵀ ⊙ 2^(γ_r − γ_s)), fp32; only the diagonal blocks
    are masked (an off-diagonal block below the diagonal is whole)."""
    a = tl.dot(k_i, tl.trans(k_j), input_precision=DOT_PRECISION)
    if DIAGONAL:
        o = tl.arange(0, 16)
        a = tl.where(o[:, None] > o[None, :], a * tl.exp2(gc_i[:, None] - gc_j[None, :]), 0.0)
    else:
        a = a * tl.exp2(gc_i[:, None] - gc_j[None, :])
    return a * beta_i[:, None]


@triton.jit
def _substitution_step(a, inverse, i, o):
    """Row i of (I + a)⁻¹ − I by forward substitution: −a_i − a_i · (rows < i of the inverse so far), fp32."""
    row = tl.sum(tl.where((o == i)[:, None], -a, 0.0), axis=0)
    row = row + tl.sum(row[:, None] * inverse, axis=0)
    return tl.where((o == i)[:, None], row[None, :], inverse)


@triton.jit
def _diagonal_inverses(a0, a1, a2, a3):
    """(I + a)⁻¹ of four strictly lower 16 x 16 blocks by forward substitution row by row in fp32 (FLA's order: row i
    ← −a_i − a_i · rows < i; rows 0 and 1 are −a's), the four substitutions interleaved in one loop (independent)."""
    o = tl.arange(0, 16)
    t0, t1, t2, t3 = -a0, -a1, -a2, -a3
    for i in range(2, 16):
        t0 = _substitution_step(a0, t0, i, o)
        t1 = _substitution_step(a1, t1, i, o)
        t2 = _substitution_step(a2, t2, i, o)
        t3 = _substitution_step(a3, t3, i, o)
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    return t0 + eye, t1 + eye, t2 + eye, t3 + eye


@triton.jit
def _inverse_fla_blocks(
    k, slot_rows, token0, rows_left, i_hk, b_gc, b_beta, KEY_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
    HAS_ROWS: tl.constexpr, ROUND: tl.constexpr, SOLVE_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr, DIAGONAL_DOUBLING: tl.constexpr,
):  # fmt: skip
    """T = (I + A)⁻¹ in FLA's 16 x 16 blocks (fla.ops.gated_delta_rule.chunk_fwd, the fused kkt + solve kernel), as
    its ten lower blocks (T₀₀, T₁₀, T₁₁, T₂₀, T₂₁, T₂₂, T₃₀, T₃₁, T₃₂, T₃₃), fp32: the 10 lower blocks of A from the
    chunk's four 16-row key blocks, the 4 diagonal blocks inverted by forward substitution (`_diagonal_inverses`; with
    DIAGONAL_DOUBLING by `_doubling_inverse` at SOLVE_PRECISION instead), the 6 blocks below merged in FLA's order
    with 16 dots at SOLVE_PRECISION: T₁₀ = −(T₁₁ A₁₀) T₀₀, T₂₁, T₃₂ alike; T₂₀ = −T₂₂ (A₂₀ T₀₀ + A₂₁ T₁₀);
    T₃₁ = −T₃₃ (A₃₁ T₁₁ + A₃₂ T₂₁); T₃₀ = −T₃₃ (A₃₀ T₀₀ + A₃₁ T₁₀ + A₃₂ T₂₀). The solve launch rounds and stores
    each block where it lies in T (`kernels.gdn_chunk._store_block_row`; the blocks above the diagonal are zeros)."""
    k0 = _key_block(k, slot_rows, token0, rows_left, 0, i_hk, KEY_HEADS, KEY_DIM, HAS_ROWS, ROUND, TORCH_CPU)
    k1 = _key_block(k, slot_rows, token0, rows_left, 1, i_hk, KEY_HEADS, KEY_DIM, HAS_ROWS, ROUND, TORCH_CPU)
    k2 = _key_block(k, slot_rows, token0, rows_left, 2, i_hk, KEY_HEADS, KEY_DIM, HAS_ROWS, ROUND, TORCH_CPU)
    k3 = _key_block(k, slot_rows, token0, rows_left, 3, i_hk, KEY_HEADS, KEY_DIM, HAS_ROWS, ROUND, TORCH_CPU)
    g0, g1, g2, g3 = _quarters(b_gc)
    be0, be1, be2, be3 = _quarters(b_beta)
    # every block of A before the substitution, so that the key blocks ([16, K] each) are dead during it
    a00 = _kkt_block(k0, k0, g0, g0, be0, True, DOT_PRECISION)
    a11 = _kkt_block(k1, k1, g1, g1, be1, True, DOT_PRECISION)
    a22 = _kkt_block(k2, k2, g2, g2, be2, True, DOT_PRECISION)
    a33 = _kkt_block(k3, k3, g3, g3, be3, True, DOT_PRECISION)
    a10 = _kkt_block(k1, k0, g1, g0, be1, False, DOT_PRECISION)
    a20 = _kkt_block(k2, k0, g2, g0, be2, False, DOT_PRECISION)
    a21 = _kkt_block(k2, k1, g2, g1, be2, False, DOT_PRECISION)
    a30 = _kkt_block(k3, k0, g3, g0, be3, False, DOT_PRECISION)
    a31 = _kkt_block(k3, k1, g3, g1, be3, False, DOT_PRECISION)
    a32 = _kkt_block(k3, k2, g3, g2, be3, False, DOT_PRECISION)
    if DIAGONAL_DOUBLING:
        t00, t11 = _doubling_inverse(a00, 16, 4, SOLVE_PRECISION), _doubling_inverse(a11, 16, 4, SOLVE_PRECISION)
        t22, t33 = _doubling_inverse(a22, 16, 4, SOLVE_PRECISION), _doubling_inverse(a33, 16, 4, SOLVE_PRECISION)
    else:
        t00, t11, t22, t33 = _diagonal_inverses(a00, a11, a22, a33)
    t10 = -_dot(_dot(t11, a10, SOLVE_PRECISION), t00, SOLVE_PRECISION)
    t21 = -_dot(_dot(t22, a21, SOLVE_PRECISION), t11, SOLVE_PRECISION)
    t32 = -_dot(_dot(t33, a32, SOLVE_PRECISION), t22, SOLVE_PRECISION)
    t20 = -_dot(t22, _dot(a20, t00, SOLVE_PRECISION) + _dot(a21, t10, SOLVE_PRECISION), SOLVE_PRECISION)
    t31 = -_dot(t33, _dot(a31, t11, SOLVE_PRECISION) + _dot(a32, t21, SOLVE_PRECISION), SOLVE_PRECISION)
    t30_sum = _dot(a30, t00, SOLVE_PRECISION) + _dot(a31, t10, SOLVE_PRECISION) + _dot(a32, t20, SOLVE_PRECISION)
    t30 = -_dot(t33, t30_sum, SOLVE_PRECISION)
    return t00, t10, t11, t20, t21, t22, t30, t31, t32, t33


@triton.jit
def _chunk_w(t_op, k16, b_beta, b_gc, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr):
    """w = bf16↓(T · bf16↓(bf16↓(K ⊙ β) ⊙ 2^γ)) as a dot operand."""
    k_beta = _rounded_operand(_bf16_point(to_f32(k16) * b_beta[:, None], ROUND) * tl.exp2(b_gc)[:, None], ROUND,
                              TORCH_CPU)  # fmt: skip
    return _rounded_operand(tl.dot(t_op, k_beta, input_precision=DOT_PRECISION), ROUND, TORCH_CPU)


@triton.jit
def _chunk_u(t_op, b_v, b_beta, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr):
    """u = bf16↓(T · bf16↓(V ⊙ β)) for one value block of V (fp32)."""
    v_beta = _rounded_operand(b_v * b_beta[:, None], ROUND, TORCH_CPU)
    return _bf16_point(tl.dot(t_op, v_beta, input_precision=DOT_PRECISION), ROUND)


@triton.jit
def _chunk_qk(q_op, k_op, b_gc, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr):
    """bf16↓(causal(Q Kᵀ ⊙ 2^(γ_r − γ_s))) as a dot operand: the chunk's intra-chunk attention, [64, 64]."""
    b_qk = tl.dot(q_op, tl.trans(k_op), input_precision=DOT_PRECISION)
    o_t = tl.arange(0, 64) + _opaque_zero()  # the causal mask rebuilt in every chunk: not live across the loop
    causal = o_t[:, None] >= o_t[None, :]
    b_qk = tl.where(causal, b_qk * tl.exp2(b_gc[:, None] - b_gc[None, :]), 0.0)  # inf above: never selected
    return _rounded_operand(b_qk, ROUND, TORCH_CPU)


@triton.jit
def _chunk_output(
    state_op, v_new, q_op, qk_op, b_gc, scale, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """o = scale · (Q S_b ⊙ 2^γ) + scale · (qk_op · bf16↓(v')), from the chunk-start state S_b (as the operand
    `state_op`), v' = u − w S_b and the chunk's masked Q Kᵀ operand (`_chunk_qk`); fp32."""
    inter = tl.dot(q_op, state_op, input_precision=DOT_PRECISION) * tl.exp2(b_gc)[:, None]
    intra = tl.dot(qk_op, _rounded_operand(v_new, ROUND, TORCH_CPU), input_precision=DOT_PRECISION)
    return inter * scale + intra * scale


@triton.jit
def _chunk_state(
    state, v_new, k_op, b_gc, g_last, ROUND: tl.constexpr, DOT_PRECISION: tl.constexpr, TORCH_CPU: tl.constexpr
):
    """The state after the chunk: S · 2^γ_last + Kᵀ · bf16↓(v' ⊙ 2^(γ_last − γ)), fp32 (the dot accumulates onto it)."""
    v_decayed = _rounded_operand(v_new * tl.exp2(g_last - b_gc)[:, None], ROUND, TORCH_CPU)
    state = state * tl.exp2(g_last)
    return tl.dot(tl.trans(k_op), v_decayed, state, input_precision=DOT_PRECISION)
