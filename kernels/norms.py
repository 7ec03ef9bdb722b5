"""Norms: residual add + zero-centred RMSNorm (decoder and final norms) and the gated RMSNorm of the GDN output.

Kernels (one launch each):

* `residual_rmsnorm(residual, delta, weight, eps)` replaces `h = residual + delta; Qwen3_5RMSNorm(h)` at every
  sublayer boundary (`reference.ops.residual_rmsnorm`; `delta=None` is the first layer's input norm):
    h = bf16↓( residual_f + delta_f )                                             (bf16 add)
    y = bf16↓( (h_f · rsqrt(mean(h_f²) + eps)) · (1 + w_f) )                      (Qwen3_5RMSNorm, one rounding)
* `residual_rmsnorm_splitk(residual, partials, weight, eps)` is `residual_rmsnorm` fed by a split-K GEMM's S fp32
  partials [S, R, H] instead of its bf16 output (`reference.ops.residual_rmsnorm_splitk`):
    delta = bf16↓( ((p_0 + p_1) + p_2) + ... + p_{S-1} )                          (fp32 adds in split order)
    then h and y as above. The order depends on S alone, never on R (no tree shaped by the row count).
* `gated_rmsnorm(o, z, weight, eps)` replaces `Qwen3_5RMSNormGated(o, z)` (HF torch path, per value head of V dims,
  `reference.ops.gated_rmsnorm`), reading z straight out of the merged GDN projection:
    n = bf16↓( o_f · rsqrt(mean(o_f²) + eps) )                                    round 1
    t = bf16↓( w · n ) when w is bf16 (round 2), w_f · n in fp32 when w is fp32 (as checkpoints store it)
    y = bf16↓( t · silu(z_f) ),  silu(z) = z / (1 + exp(-z)) in fp32              round 3

Each fp32 op above is one IEEE fp32 operation in torch's order (torch runs each as its own kernel; launched with
`enable_fp_fusion=False` nothing is contracted into an fma). The pieces that mirror torch exactly:
* mean = sum · fp32(1/N) on CUDA (`MeanOps` multiplies by `float(outputs)/numel`), sum / N on CPU (`mean_out`
  on CPU is `sum(...).div_(N)`); identical when N is a power of two (head norms), not for hidden = 5120.
* rsqrt: `rsqrtf` (libdevice) on CUDA, as torch's `rsqrt_kernel_cuda`. eps is added in fp32 after the mean.
* h_f² is exact in fp32 for bf16 h, so only the order of the sum can differ, never the products.

The one rounding point that is not reproduced: the fp32 sum of squares. torch sums in its own order (CUDA: per-thread
strided accumulators, then a shuffle-down tree whose shape depends on the row count; CPU: a cascade sum with vector
accumulators), Triton's `tl.sum` in another (per-thread sequential, then a butterfly tree; numpy's pairwise sum
under the interpreter). The two sums can differ in the last fp32 bits, that moves rsqrt by about one fp32 ulp,
and the normalised value (y of residual_rmsnorm, n of the gated norm) then differs by one bf16 ulp only when its fp32
value lies within ~2^-23 (relative) of a bf16 rounding boundary: about 2^-15 of the elements of an affected row.
Reproducing torch's CUDA reduction tree is possible in principle but ties the kernel to one torch version's launch
heuristics (block shape chosen from the row count), so it is not done. Under the interpreter the rsqrt can differ
too (`kernels.numerics`). In the gated norm rounded arithmetic follows n: a 1-ulp step of n is 2^-8 to 2^-7 of
n, which after t and y can span two ulps of y with an fp32 weight, more with a bf16 weight (t rounded as well).
Exactness (`ablations.bit_identity`, asserted by tests/test_kernels.py on
CPU and tests/test_gpu_kernels.py on the H200): the normed output differs in at most 1e-4 of the elements, by one ulp
at most; the gated norm's y differs in at most 1e-4 of the elements, and each differing element must equal the
reference's own t / y chain on n moved by one ulp (the flip model, `bit_identity.gated_rmsnorm_flips`), however many
ulps of y that is; the residual output h is always bitwise (residual_rmsnorm_splitk's delta and h too).

Batch invariance: tile shapes come from the widths only (`numerics.tile_elements`), never from the row count, so
a row's bits do not depend on the other rows of a call (tested); the prefix tree relies on that.

Versions (history: engine/stages/fused.md, "Kernel history"):
* v0 (dropped before it was measured): BLOCK_R sized from the row count too (a row's bits would depend on its batch).
* v1: a program normalises BLOCK_R rows of the full width; gated_rmsnorm flattens (row, value head) pairs.
* v2: gated_rmsnorm takes an optional row index into o (`o_rows`): the tree's rows read their path's output directly.
* v3: residual_rmsnorm_splitk, the same kernel with a SPLITS constexpr (0: a bf16 delta).
* v4 (this file): gated_rmsnorm normalises tile_elements / (2 V) (row, value head) pairs a program, 16 at V = 128 on
  the GPU, instead of tile_elements / V (32). The tile sweep on the H200 (tests/test_gpu_kernel_tiles.py at 827fa63,
  971 rows read through `o_rows` as stage `core` calls it, but with a bf16 weight where the engine's is fp32): 17.4 us
  against 22.0 (8 pairs 17.8, 64 pairs 31.0), every output element bit-equal to the 32-pair tile's (each row's sum
  of squares keeps its lanes and order: warps lie along the pairs). The sweep now passes the fp32 weight. Those
  times are `triton.testing.do_bench` medians, which carry host launch time (the same sweep put gdn_prep's shipped
  tile at 52.1 us, an H100 at 31.4); the sweep now times each tile in a CUDA graph (ablations/probes.py,
  `graph_kernel_us`). Its first GPU run (an H100, campaign 37 at 9a6886e: results/gpu/20261206T0508Z-nvidia-h100-
  9a6886e-kernel-tests.log): 17.1 us against 21.5 for 32 pairs, 16.3 for 8, each bit-equal to the shipped tile; the
  bit tests green; in the forward of results/runs/20261206T051321Z-nvidia-h100-80gb-hbm3-9a6886e.json 7.0 us a call
  on drone (1.61x its floor), 19.6 on customer_service (1.39x).
v2's row-indexed call is bitwise against the gathered call (tests/test_kernels.py under the interpreter,
tests/test_gpu_kernels.py::test_gpu_row_indexed_kernels_27b on the H200); v3's delta is bitwise against the
reference delta fed to residual_rmsnorm (tests/test_kernels.py, S = 1-4).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.numerics import (
    LAUNCH_OPTIONS,
    check_tensor,
    ieee_quiet,
    kernel_mode,
    output_tensor,
    round_to_bf16,
    rsqrt_f32,
    silu_f32,
    tile_elements,
    to_bf16,
    to_f32,
)


@triton.jit
def rms_inverse(x, eps, inv_n, N: tl.constexpr, TORCH_CPU: tl.constexpr):
    """rsqrt(mean(x²) + eps) of each row of x [BLOCK_R, BLOCK_N] (fp32, masked entries 0), torch's op order."""
    sum_sq = tl.sum(x * x, axis=1)
    if TORCH_CPU:
        mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, N, tl.float32))  # CPU: sum(...).div_(N)
    else:
        mean_sq = sum_sq * inv_n  # CUDA: MeanOps, sum · fp32(1/N)
    return rsqrt_f32(mean_sq + eps, TORCH_CPU)


@functools.cache
def inverse_count(n: int) -> float:
    """fp32(1/n) correctly rounded, the factor torch's CUDA mean multiplies by (cached: it sits on every launch)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / n)


# ---------------------------------------------------------------------------------------------------------------------
# residual add + RMSNorm(1 + w)


@triton.jit
def _residual_rmsnorm_kernel(
    residual_ptr,  # [R, H] bf16, row stride residual_sr
    delta_ptr,  # [R, H] bf16 (SPLITS 0) or [SPLITS, R, H] fp32 partials; row stride delta_sr (unused without HAS_DELTA)
    weight_ptr,  # [H] bf16 or fp32 (offset from 1)
    new_residual_ptr,  # [R, H] bf16 contiguous (unused without HAS_DELTA)
    normed_ptr,  # [R, H] bf16 contiguous
    rows,
    residual_sr,
    delta_sr,
    delta_ss,  # split stride of the partials (unused unless SPLITS >= 1)
    eps,
    inv_n,
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SPLITS: tl.constexpr,  # 0: delta is bf16; S >= 1: delta is the sum of S fp32 split-K partials
    TORCH_CPU: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    col = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_ok = col < HIDDEN
    mask = (row < rows)[:, None] & col_ok[None, :]
    h = to_f32(tl.load(residual_ptr + row[:, None] * residual_sr + col[None, :], mask=mask, other=0.0))
    if HAS_DELTA:
        delta_row_ptr = delta_ptr + row[:, None] * delta_sr + col[None, :]
        if SPLITS == 0:
            delta = to_f32(tl.load(delta_row_ptr, mask=mask, other=0.0))
        else:
            total = tl.load(delta_row_ptr, mask=mask, other=0.0)  # p_0
            for _ in tl.static_range(1, SPLITS):  # + p_1 + ... + p_{S-1}: fp32, in split order
                delta_row_ptr += delta_ss
                total += tl.load(delta_row_ptr, mask=mask, other=0.0)
            delta = round_to_bf16(total)  # the GEMM's output: bf16↓
        h = round_to_bf16(h + delta)  # residual + delta: bf16↓
        tl.store(new_residual_ptr + row[:, None] * HIDDEN + col[None, :], to_bf16(h), mask=mask)
    scale = 1.0 + to_f32(tl.load(weight_ptr + col, mask=col_ok, other=0.0))  # 1 + w_f
    inverse = rms_inverse(h, eps, inv_n, HIDDEN, TORCH_CPU)  # [BLOCK_R]
    normed = (h * inverse[:, None]) * scale[None, :]
    tl.store(normed_ptr + row[:, None] * HIDDEN + col[None, :], to_bf16(normed), mask=mask)  # .type_as(x): bf16↓


def residual_rmsnorm(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out_residual: torch.Tensor | None = None,
    out_normed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then zero-centred RMSNorm: returns (new_residual, normed), both [R, H] bf16.

    residual, delta [R, H] bf16 (any row stride, unit column stride); delta None means no add, and new_residual is
    `residual` itself. weight [H] bf16 or fp32, the offset w of (1 + w). out_residual / out_normed: contiguous
    [R, H] bf16 written in place when given; out_residual may be `residual` (an in-place residual update: each
    program reads its rows completely before writing them). Exactness: new_residual bitwise; normed bitwise except
    the fp32 sum-of-squares order (module docstring), against `reference.ops.residual_rmsnorm`.
    """
    name = "residual_rmsnorm"
    rows, hidden = _check_residual_and_weight(name, residual, weight)
    if delta is not None:
        check_tensor(f"{name}: delta", delta, dtype=torch.bfloat16, shape=(rows, hidden), device=residual.device)
    elif out_residual is not None:
        raise ValueError(f"{name}: out_residual given but delta is None (the residual does not change)")
    return _launch_residual_rmsnorm(name, residual, delta, 0, weight, eps, out_residual, out_normed)


def residual_rmsnorm_splitk(
    residual: torch.Tensor,
    partials: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out_residual: torch.Tensor | None = None,
    out_normed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual_rmsnorm` whose delta is a split-K GEMM's reduction: returns (new_residual, normed), [R, H] bf16.

    partials [S, R, H] fp32 (S >= 1; any split and row strides, unit column stride): the GEMM's partial sums over S
    slices of K. delta = bf16↓(p_0 + p_1 + ... + p_{S-1}), summed in fp32 in split order, then what
    `residual_rmsnorm` does with that delta, in the same launch. residual, weight, out_residual (may be `residual`),
    out_normed as in `residual_rmsnorm`. Exactness against `reference.ops.residual_rmsnorm_splitk`: delta and
    new_residual bitwise; normed bitwise except the fp32 sum-of-squares order, and bitwise against
    `residual_rmsnorm(residual, reference.ops.splitk_delta(partials), ...)` (the same kernel after the delta).
    """
    name = "residual_rmsnorm_splitk"
    rows, hidden = _check_residual_and_weight(name, residual, weight)
    if partials.ndim != 3 or partials.shape[0] < 1:
        raise ValueError(f"{name}: partials must be [S, R, H] with S >= 1, got {tuple(partials.shape)}")
    check_tensor(f"{name}: partials", partials, dtype=torch.float32, shape=(None, rows, hidden), device=residual.device)
    splits = partials.shape[0]
    return _launch_residual_rmsnorm(name, residual, partials, splits, weight, eps, out_residual, out_normed)


def _check_residual_and_weight(name: str, residual: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(R, H) of residual [R, H] bf16, after checking it and weight [H] bf16 or fp32 on its device."""
    if residual.ndim != 2:
        raise ValueError(f"{name}: residual must be [R, H], got {tuple(residual.shape)}")
    rows, hidden = residual.shape
    device = residual.device
    check_tensor(f"{name}: residual", residual, dtype=torch.bfloat16, shape=(rows, hidden), device=device)
    check_tensor(f"{name}: weight", weight, dtype=(torch.bfloat16, torch.float32), shape=(hidden,), device=device)
    return rows, hidden


def _launch_residual_rmsnorm(
    name: str,
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    splits: int,
    weight: torch.Tensor,
    eps: float,
    out_residual: torch.Tensor | None,
    out_normed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one launch of both wrappers, on checked inputs: delta None, bf16 [R, H] (splits 0) or the fp32 partials
    [splits, R, H]."""
    rows, hidden = residual.shape
    device = residual.device
    if delta is None:
        new_residual = residual
    else:
        new_residual = output_tensor(f"{name}: out_residual", out_residual, (rows, hidden), torch.bfloat16, device)
    normed = output_tensor(f"{name}: out_normed", out_normed, (rows, hidden), torch.bfloat16, device)
    if rows == 0:
        return new_residual, normed
    torch_cpu = kernel_mode(_residual_rmsnorm_kernel, device)
    block_h = triton.next_power_of_2(hidden)
    block_r = max(1, tile_elements(torch_cpu) // block_h)  # from the width only: batch-invariant bits
    with ieee_quiet(torch_cpu):
        _residual_rmsnorm_kernel[(triton.cdiv(rows, block_r),)](
            residual,
            residual if delta is None else delta,
            weight,
            new_residual,
            normed,
            rows,
            residual.stride(0),
            residual.stride(0) if delta is None else delta.stride(-2),
            delta.stride(0) if splits else 0,
            eps,
            inverse_count(hidden),
            HIDDEN=hidden,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            HAS_DELTA=delta is not None,
            SPLITS=splits,
            TORCH_CPU=torch_cpu,
            num_warps=max(4, min(16, block_h // 512)),
            **LAUNCH_OPTIONS,
        )
    return new_residual, normed


def rmsnorm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm alone (the final norm, or the first layer's input norm): [R, H] bf16 -> [R, H] bf16."""
    return residual_rmsnorm(x, None, weight, eps, out_normed=out)[1]


# ---------------------------------------------------------------------------------------------------------------------
# gated RMSNorm of the GDN output


@triton.jit
def _gated_rmsnorm_kernel(
    o_ptr,  # [L·Hv, V] bf16 contiguous (the GDN output [L, Hv, V]; L = R without HAS_O_ROWS)
    o_rows_ptr,  # [R] int32 or int64: the o row of each output row (unused without HAS_O_ROWS)
    z_ptr,  # [R, Hv·V] bf16, row stride z_sr
    weight_ptr,  # [V] bf16 or fp32 (plain scale)
    out_ptr,  # [R·Hv, V] bf16 contiguous (= [R, Hv·V])
    head_rows,  # R·Hv
    z_sr,
    eps,
    inv_n,
    HEADS: tl.constexpr,  # Hv
    HEAD_DIM: tl.constexpr,  # V
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    W_BF16: tl.constexpr,
    HAS_O_ROWS: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    head_row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (row, head) pairs
    dim = tl.arange(0, BLOCK_D)
    dim_ok = dim < HEAD_DIM
    mask = (head_row < head_rows)[:, None] & dim_ok[None, :]
    row, head = head_row // HEADS, head_row % HEADS
    if HAS_O_ROWS:  # output row `row` normalises o's row o_rows[row]
        o_head_row = tl.load(o_rows_ptr + row, mask=head_row < head_rows, other=0).to(tl.int64) * HEADS + head
    else:
        o_head_row = head_row
    o = to_f32(tl.load(o_ptr + o_head_row[:, None] * HEAD_DIM + dim[None, :], mask=mask, other=0.0))
    z_offset = row[:, None] * z_sr + (head * HEAD_DIM)[:, None] + dim[None, :]
    z = to_f32(tl.load(z_ptr + z_offset, mask=mask, other=0.0))
    weight = to_f32(tl.load(weight_ptr + dim, mask=dim_ok, other=0.0))
    normed = round_to_bf16(o * rms_inverse(o, eps, inv_n, HEAD_DIM, TORCH_CPU)[:, None])  # .to(input_dtype): round 1
    scaled = weight[None, :] * normed
    if W_BF16:
        scaled = round_to_bf16(scaled)  # bf16 weight · bf16: round 2
    out = to_bf16(scaled * silu_f32(z, TORCH_CPU))  # · silu(z_f), then .to(input_dtype): round 3
    tl.store(out_ptr + head_row[:, None] * HEAD_DIM + dim[None, :], out, mask=mask)


def gated_rmsnorm(
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    o_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDN output norm gated by silu(z), per value head: returns [R, Hv·V] bf16, ready for out_proj.

    o: the GDN core output, contiguous bf16 [R, Hv, V] (or FLA's [1, R, Hv, V]); z: [R, Hv·V] bf16 with any row
    stride and unit column stride, e.g. `gdn_proj[:, conv_dim : conv_dim + Hv·V]` of the merged projection;
    weight [V] bf16 or fp32 (plain scale). `out` (contiguous [R, Hv·V] bf16) is written in place when given.
    o_rows: optional [R] int32/int64 on o's device; then o is [L, Hv, V] (any L) and output row r normalises o's row
    o_rows[r], as `gated_rmsnorm(o.index_select(0, o_rows), ...)` would, bit for bit, without the gathered copy (the
    prefix tree's packed rows from their representative paths). Values in [0, L) are not checked (a device sync).
    Exactness: bitwise except the fp32 sum-of-squares order (module docstring), against
    `reference.ops.gated_rmsnorm(o, z.view(R, Hv, V), weight, eps)`.
    """
    if weight.ndim != 1 or z.ndim != 2 or z.shape[1] % max(1, weight.shape[0]):
        raise ValueError(
            f"gated_rmsnorm: weight must be [V] and z [R, Hv·V], got {tuple(weight.shape)} and {tuple(z.shape)}"
        )
    rows, head_dim = z.shape[0], weight.shape[0]
    heads = z.shape[1] // head_dim
    device = z.device
    check_tensor("gated_rmsnorm: z", z, dtype=torch.bfloat16, shape=(rows, heads * head_dim), device=device)
    check_tensor(
        "gated_rmsnorm: weight", weight, dtype=(torch.bfloat16, torch.float32), shape=(head_dim,), device=device
    )
    o_len = rows if o_rows is None else (o.shape[-3] if o.ndim >= 3 else -1)  # L: o's rows
    if o.shape[-3:] != (o_len, heads, head_dim) or o.numel() != o_len * heads * head_dim:
        want = f"[{rows}, {heads}, {head_dim}]" if o_rows is None else f"[L, {heads}, {head_dim}]"
        raise ValueError(f"gated_rmsnorm: o {tuple(o.shape)} must be [R or L, Hv, V] = {want}")
    if o_rows is not None:
        check_tensor("gated_rmsnorm: o_rows", o_rows, dtype=(torch.int32, torch.int64), shape=(rows,), device=device)
    check_tensor("gated_rmsnorm: o", o, dtype=torch.bfloat16, shape=tuple(o.shape), device=device, contiguous=True)
    out = output_tensor("gated_rmsnorm: out", out, (rows, heads * head_dim), torch.bfloat16, device)
    if rows == 0:
        return out
    torch_cpu = kernel_mode(_gated_rmsnorm_kernel, device)
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, tile_elements(torch_cpu) // (2 * block_d))  # from the width only: batch-invariant bits (v4)
    with ieee_quiet(torch_cpu):
        _gated_rmsnorm_kernel[(triton.cdiv(rows * heads, block_r),)](
            o,
            o if o_rows is None else o_rows,
            z,
            weight,
            out,
            rows * heads,
            z.stride(0),
            eps,
            inverse_count(head_dim),
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            W_BF16=weight.dtype == torch.bfloat16,
            HAS_O_ROWS=o_rows is not None,
            TORCH_CPU=torch_cpu,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return out
