"""Gated-attention input preparation: q/k RMSNorm(1 + w) per head, partial RoPE, and the attention layout.

One launch replaces, per full-attention layer (`Qwen3_5Attention.forward` up to the attention call): the
query/gate split of the per-head interleaved q projection, `q_norm` and `k_norm` (zero-centred RMSNorm over each
head), `apply_rotary_pos_emb` on the first rotary_dim dims, and the copies into the layout attention reads.
Input: the merged projection proj [T, P], P = 2·H·D + 2·Hkv·D, columns
  [head 0 query D | head 0 gate D | head 1 query D | ... | k Hkv·D | v Hkv·D],
with cos, sin [T, r] bf16 given (`reference.ops.rope_cos_sin`, r = rotary_dim). The gate half is not copied:
`attention_gate_view(proj, ...)` is the strided [T, H, D] view that `activations.attention_gate` reads.
Outputs q [T, H, D], k and v [T, Hkv, D] bf16 (layout "thd", packed varlen rows) or [H, T, D] / [Hkv, T, D]
(layout "htd", what SDPA reads as batch 1 after `unsqueeze(0)`).

Math and rounding points (reference: `reference.ops.attn_prep`, of `rmsnorm_1p`, `apply_partial_rope`), per head:
  n = bf16↓( (x_f · rsqrt(mean(x_f²) + eps)) · (1 + w_f) )                            q_norm / k_norm, one rounding
  for d < r:  out_d = bf16↓( bf16↓(n_d · cos_d) + bf16↓(rot_d · sin_d) ),  rot_d = −n_{d+r/2} (d < r/2), n_{d−r/2}
  for d >= r: out_d = n_d;   v = x (copy)
rot_d is recomputed from its own load of x_{d±r/2} (the norm is element-wise once the row's rsqrt is known), so no
cross-lane shuffle is needed. Every torch op of the chain is one fp32 op and one bf16↓ here (launched without fp
fusion, bf16↓ by integer rounding, see `kernels.numerics`). The mean and rsqrt follow torch per device as in
`kernels.norms`; the only rounding point not reproduced is the fp32 sum of squares' order (see `kernels.norms`):
an element of n may differ by one bf16 ulp, rarely. A pass-through dim then differs by that one ulp; a rotated dim,
whose two rounded terms read n_d and its partner n_{d±r/2}, by as many ulps as the flip makes after the sum (several
where the terms cancel). v and the layout are bitwise.

Exactness (`ablations.bit_identity`, the flip model): q and k differ from the reference in at most 1e-4
of the elements, and each differing element must equal the reference's RoPE with the element's n and its partner's
n each moved by -1, 0 or +1 ulp (`bit_identity.rope_flips`; a pass-through dim is its own n moved), however many
output ulps that is; v bitwise. Tests: tests/test_kernels.py and tests/test_bit_identity.py
(CPU interpreter), tests/test_gpu_kernels.py::test_gpu_bit_identity_27b (H200).

Batch invariance: BLOCK_T comes from the head width only, never from the row count (tested).

Versions (history: engine/stages/fused.md, "Kernel history"):
* v1: grid (row block, head slot) over the H query, Hkv key and Hkv value head slots; the norm weight of a slot
  is picked by a scalar pointer select, so q and k norm weights must share a dtype.
* v2: v1 plus optional key rows: k and v prepared straight in the prefix tree's key layout, bitwise
  against the gathered outputs (tests/test_kernels.py; tests/test_gpu_kernels.py::test_gpu_row_indexed_kernels_27b).
* v3 (this file): v2's per-row math on a one-dimensional grid that launches the query slots over the T rows and the
  key and value slots over the K key rows; v2 launched every slot over max(T, K) rows, so with a tree's keys
  (customer_service: T 1,152, K 7,000) most query programs only masked (engine/stages/core.md, "Prep kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norms import inverse_count, rms_inverse
from kernels.numerics import (
    LAUNCH_OPTIONS,
    check_tensor,
    ieee_quiet,
    kernel_mode,
    output_tensor,
    round_to_bf16,
    tile_elements,
    to_bf16,
    to_f32,
)

LAYOUTS = ("thd", "htd")


@triton.jit
def _attn_prep_kernel(
    proj_ptr,  # [T, P] bf16, row stride proj_sr
    q_weight_ptr,  # [D] bf16 or fp32 (offset from 1)
    k_weight_ptr,  # [D] bf16 or fp32
    cos_ptr,  # [T, r] bf16, row stride cos_sr
    sin_ptr,  # [T, r] bf16, row stride sin_sr
    q_ptr,  # q [T, H, D] or [H, T, D] bf16
    k_ptr,  # k [T, Hkv, D] or [Hkv, T, D] bf16 ([K, Hkv, D] with HAS_KEY_ROWS)
    v_ptr,  # v like k
    key_rows_ptr,  # [K] int32 or int64: the proj row of each key row (unused without HAS_KEY_ROWS)
    tokens,
    keys,  # K (T without HAS_KEY_ROWS)
    proj_sr,
    cos_sr,
    sin_sr,
    q_st,  # q strides of a token and a head, in elements
    q_sh,
    kv_st,  # k and v strides of a token and a head
    kv_sh,
    eps,
    inv_n,
    HEADS: tl.constexpr,  # H
    KV_HEADS: tl.constexpr,  # Hkv
    HEAD_DIM: tl.constexpr,  # D
    ROTARY_DIM: tl.constexpr,  # r
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KEY_ROWS: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    # one program per (row block, head slot): the query slots' blocks over the T rows first, then the key and value
    # slots' blocks over the K key rows (T without key rows), so no program is launched past its slot's rows
    program = tl.program_id(0)
    query_blocks = tl.cdiv(tokens, BLOCK_T)
    query_programs = query_blocks * HEADS
    is_key_program = program >= query_programs
    local = tl.where(is_key_program, program - query_programs, program)
    blocks = tl.where(is_key_program, tl.cdiv(keys, BLOCK_T), query_blocks)
    slot = tl.where(is_key_program, HEADS, 0) + local // blocks
    token = ((local % blocks) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]: output row
    token_ok = token < tl.where(is_key_program, keys, tokens)
    dim = tl.arange(0, BLOCK_D)
    if HAS_KEY_ROWS:  # key and value slots: output row j is proj row key_rows[j] (query slots: the rows themselves)
        gathered = tl.load(key_rows_ptr + token, mask=token_ok & (token < keys), other=0).to(tl.int64)
        source = tl.where(is_key_program, gathered, token)  # [BLOCK_T]: input row (proj, cos, sin)
    else:
        source = token
    mask = token_ok[:, None] & (dim < HEAD_DIM)[None, :]
    row_base = proj_ptr + source[:, None] * proj_sr
    if slot < HEADS + KV_HEADS:
        # query head (slot < H) or key head: norm + partial RoPE
        is_query = slot < HEADS
        first_column = tl.where(is_query, slot * 2 * HEAD_DIM, 2 * HEADS * HEAD_DIM + (slot - HEADS) * HEAD_DIM)
        weight_ptr = tl.where(is_query, q_weight_ptr, k_weight_ptr)
        x = to_f32(tl.load(row_base + first_column + dim[None, :], mask=mask, other=0.0))
        inverse = rms_inverse(x, eps, inv_n, HEAD_DIM, TORCH_CPU)[:, None]  # [BLOCK_T, 1]
        scale = 1.0 + to_f32(tl.load(weight_ptr + dim, mask=dim < HEAD_DIM, other=0.0))
        normed = round_to_bf16((x * inverse) * scale[None, :])  # q_norm / k_norm: bf16↓
        half = ROTARY_DIM // 2
        rotary = dim < ROTARY_DIM
        partner = tl.where(dim < half, dim + half, dim - half)  # rotate_half pairs (d, d + r/2)
        rope_mask = token_ok[:, None] & rotary[None, :]
        x_partner = to_f32(tl.load(row_base + first_column + partner[None, :], mask=rope_mask, other=0.0))
        scale_partner = 1.0 + to_f32(tl.load(weight_ptr + partner, mask=rotary, other=0.0))
        normed_partner = round_to_bf16((x_partner * inverse) * scale_partner[None, :])
        rotated = tl.where((dim < half)[None, :], -normed_partner, normed_partner)  # rotate_half(n)
        cos = to_f32(tl.load(cos_ptr + source[:, None] * cos_sr + dim[None, :], mask=rope_mask, other=0.0))
        sin = to_f32(tl.load(sin_ptr + source[:, None] * sin_sr + dim[None, :], mask=rope_mask, other=0.0))
        roped = round_to_bf16(round_to_bf16(normed * cos) + round_to_bf16(rotated * sin))  # n·cos + rot·sin
        out = to_bf16(tl.where(rotary[None, :], roped, normed))
        if is_query:
            tl.store(q_ptr + token[:, None] * q_st + slot * q_sh + dim[None, :], out, mask=mask)
        else:
            tl.store(k_ptr + token[:, None] * kv_st + (slot - HEADS) * kv_sh + dim[None, :], out, mask=mask)
    else:
        # value head: a copy into the attention layout
        head = slot - HEADS - KV_HEADS
        first_column = 2 * HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM + head * HEAD_DIM
        v = tl.load(row_base + first_column + dim[None, :], mask=mask, other=0.0)
        tl.store(v_ptr + token[:, None] * kv_st + head * kv_sh + dim[None, :], v, mask=mask)


def attn_prep(
    proj: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str = "thd",
    key_rows: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k RMSNorm(1 + w) + partial RoPE + layout for attention, from the merged attention projection.

    proj [T, 2·H·D + 2·Hkv·D] bf16 (any row stride, unit column stride); q_norm_weight, k_norm_weight [D] bf16 or
    fp32 (offsets of 1 + w); cos, sin [T, r] bf16 (r even, r <= D; any row stride). layout "thd" returns q [T, H, D],
    k, v [T, Hkv, D]; "htd" returns q [H, T, D], k, v [Hkv, T, D]; all contiguous bf16. out: optional (q, k, v) of
    those shapes, written in place. key_rows: optional [K] int32/int64 on proj's device ("thd" only): k and v are
    [K, Hkv, D], row j prepared from proj row key_rows[j], bit for bit what gathering the [T, ...] k and v would
    give (the prefix tree's keys: each node's path; values in [0, T) are not checked, a device sync).
    Exactness: v bitwise; q, k bitwise except the fp32 sum-of-squares order of the norm (module docstring), against
    `reference.ops.apply_partial_rope(reference.ops.rmsnorm_1p(...))`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"attn_prep: layout must be one of {LAYOUTS}, got {layout!r}")
    if proj.ndim != 2 or cos.ndim != 2:
        raise ValueError(f"attn_prep: proj must be [T, P] and cos [T, r], got {tuple(proj.shape)}, {tuple(cos.shape)}")
    tokens, rotary_dim = proj.shape[0], cos.shape[1]
    device = proj.device
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"attn_prep: rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    width = 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim
    check_tensor("attn_prep: proj", proj, dtype=torch.bfloat16, shape=(tokens, width), device=device)
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_tensor(
            f"attn_prep: {name}", weight, dtype=(torch.bfloat16, torch.float32), shape=(head_dim,), device=device
        )
    if q_norm_weight.dtype != k_norm_weight.dtype:
        raise ValueError(
            f"attn_prep: q/k norm weights must share a dtype, got {q_norm_weight.dtype}, {k_norm_weight.dtype}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(f"attn_prep: {name}", table, dtype=torch.bfloat16, shape=(tokens, rotary_dim), device=device)
    if key_rows is not None:
        if layout != "thd":
            raise ValueError("attn_prep: key_rows needs layout 'thd'")
        check_tensor("attn_prep: key_rows", key_rows, dtype=(torch.int32, torch.int64), shape=(None,), device=device)
    keys = tokens if key_rows is None else key_rows.shape[0]
    if layout == "thd":
        shapes = ((tokens, num_heads, head_dim), (keys, num_kv_heads, head_dim), (keys, num_kv_heads, head_dim))
    else:
        shapes = ((num_heads, tokens, head_dim), (num_kv_heads, tokens, head_dim), (num_kv_heads, tokens, head_dim))
    if out is not None and len(out) != 3:
        raise ValueError(f"attn_prep: out must be (q, k, v), got {len(out)} tensors")
    q, k, v = (
        output_tensor(f"attn_prep: out {name}", None if out is None else out[i], shape, torch.bfloat16, device)
        for i, (name, shape) in enumerate(zip("qkv", shapes))
    )
    if tokens == 0 and keys == 0:
        return q, k, v
    torch_cpu = kernel_mode(_attn_prep_kernel, device)
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, tile_elements(torch_cpu) // (2 * block_d))  # from the width only: batch-invariant bits
    programs = triton.cdiv(tokens, block_t) * num_heads + triton.cdiv(keys, block_t) * 2 * num_kv_heads
    with ieee_quiet(torch_cpu):
        _attn_prep_kernel[(programs,)](
            proj,
            q_norm_weight,
            k_norm_weight,
            cos,
            sin,
            q,
            k,
            v,
            q if key_rows is None else key_rows,
            tokens,
            keys,
            proj.stride(0),
            cos.stride(0),
            sin.stride(0),
            *(q.stride()[:2] if layout == "thd" else q.stride()[1::-1]),  # (token, head) strides
            *(k.stride()[:2] if layout == "thd" else k.stride()[1::-1]),
            eps,
            inverse_count(head_dim),
            HEADS=num_heads,
            KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            ROTARY_DIM=rotary_dim,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            HAS_KEY_ROWS=key_rows is not None,
            TORCH_CPU=torch_cpu,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return q, k, v


def attention_gate_view(proj: torch.Tensor, *, num_heads: int, head_dim: int) -> torch.Tensor:
    """The gate half of the per-head interleaved q projection as a strided [T, H, D] view of proj (no copy)."""
    if proj.ndim != 2 or proj.shape[1] < 2 * num_heads * head_dim or proj.stride(1) != 1:
        raise ValueError(f"attention_gate_view: proj {tuple(proj.shape)} is not a [T, >= 2·H·D] row-major buffer")
    return proj[:, : 2 * num_heads * head_dim].unflatten(1, (num_heads, 2 * head_dim))[:, :, head_dim:]
