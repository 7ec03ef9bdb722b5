"""GDN input preparation: everything between the merged GDN input projection and FLA's `chunk_gated_delta_rule`.

One launch replaces, per Gated DeltaNet layer (`Qwen3_5GatedDeltaNet.forward`, HF torch path, and the l2norm that
FLA runs inside `chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True)`):
  causal depthwise conv (width W = 4) + SiLU over q|k|v  ->  split  ->  q/k L2 norm (FLA numerics)  ->  FLA layout,
  beta = sigmoid(b),  g = -exp(A_log) · softplus(a + dt_bias).
Input: the merged projection proj [T, P], P = conv_dim + Hv·V + 2·Hv, columns [q Hk·K | k Hk·K | v Hv·V | z | b | a]
(q/k/v in checkpoint channel order), packed varlen rows: sequence i is rows cu_seqlens[i] .. cu_seqlens[i+1] - 1,
and the conv sees zeros before each sequence's first row. z is left in place for `norms.gated_rmsnorm`.
Outputs, laid out for FLA's varlen call (B = 1): q, k [1, T, Hk, K] bf16, v [1, T, Hv, V] bf16, g [1, T, Hv] fp32,
beta [1, T, Hv] bf16.

Math and rounding points (reference: `reference.ops.gdn_prep`, of `causal_conv1d_silu`, `l2norm_fla`, `gdn_gates`):
  c[t, ch] = bf16↓( Σ_{w=0..W-1} x[t-W+1+w, ch] · weight[ch, w] )   F.conv1d in bf16 (the weight's dtype): fp32 sum,
                                                                   oldest tap first, as torch's depthwise kernel
  u = bf16↓( silu(c) )                                             F.silu on bf16
  q, k = bf16↓( u · rstd ), rstd = 1 / sqrt(Σ u² + 1e-6) per head   FLA l2norm_fwd (with qk_l2norm; else q, k = u)
  v = u
  beta = bf16↓( sigmoid(b) )
  g = (-exp(A_log_f)) · softplus(a_f + dt_bias_f)                  fp32, softplus(x) = x above 20 else log1p(exp(x))
Products bf16 × bf16 are exact in fp32, so the conv sum depends only on its order: sequential from the oldest tap,
as torch's native `conv_depthwise2d` CUDA kernel. Caveat for the GPU: HF (and `reference.ops`) hand F.conv1d a
transposed, i.e. channels-last, view, for which torch may pick cuDNN's depthwise conv, whose tap order is not
documented; a different order would flip a bf16↓ of c very rarely (the GPU test asserts v bitwise and will show it).
On the CPU the conv matched torch's bit for bit in every test.
The L2 norm uses Triton's `/` and `tl.sqrt` exactly as FLA's `l2norm_fwd_kernel` writes them (approximate PTX on the
GPU), because FLA computes the engine's q/k. Compiled for sm_90 (Triton 3.6, the H200's, and 3.9 alike; TTGIR of
2026-12-05), this kernel's 16 × 128 tile on 4 warps reduces over K = 128 with sizePerThread [1, 8] and 16 lanes along
K, warps along the rows (no cross-warp step), and so does FLA's `l2norm_fwd_kernel` at D = 128 in 22 of its 25
autotune configs, every one of ≤ 4 warps (not BT 8 / 8 warps, BT 16 / 16, BT 8 / 16): the same reduction tree, so
bitwise equality with FLA is expected then (GPU test). Each thread's 8 terms are added as a chain under Triton 3.6 and
as a pairwise tree under 3.9, in both kernels: bits taken with one Triton version need not hold under the other.
Against `reference.ops.l2norm_fla` (torch: IEEE sqrt and division, torch's own sum order) a q/k element can be one
ulp off, rarely. With `qk_l2norm=False` q and k are the conv outputs, for FLA to normalise
(`use_qk_l2norm_in_kernel=True`): equal to the HF+FLA path by construction. beta and g follow torch's CUDA kernels
(libdevice `expf`/`log1pf`, IEEE division, helpers of `kernels.numerics`): bitwise on GPU. Under the CPU
interpreter g (fp32, never rounded) may differ from torch's CPU result in the last fp32 bits, bounded in ulps by
tests/test_kernels.py.

Unsupported on purpose (clear errors): conv weights other than bf16 (HF then convolves in fp32 with one rounding),
K or V above 256. Not provided: conv history from a cache or a shared prefix (every sequence starts from zeros).

Batch invariance: BLOCK_T is fixed (16 rows on GPU, 256 interpreted), never derived from the row count; a packed call
equals per-sequence calls bit for bit (tested).

Versions (history: engine/stages/fused.md, "Kernel history"):
* v0 (dropped): same-named variables of other shapes in the two branches of a runtime `if` (sm_90 compile failed).
* v1: grid (row block, head slot); each row finds its sequence start by a binary search in cu_seqlens.
* v2: v1 plus an optional row index (`rows`): the tree's candidate paths read through it, no gather first;
  bitwise against the gathered call (tests/test_kernels.py, tests/test_gpu_kernels.py).
* v3: the row-index load masked by the row's validity at a clamped index (v2's bits; compiles on 3.6).
* v4: v3 plus optional output slots (`slots`): only the wanted conv-input rows are computed (v3's bits
  per row). The kernel is bound by its per-element arithmetic (the 4-tap conv,
  expf and IEEE division of the SiLU, two roundings by bits, the L2 norm: 971 rows took 33.9 us, 1.2 TB/s, in the
  tile sweep of 9be5aba), so the tree's replicated paths (drone 1,074 slots for 352 rows, customer_service 5,778
  for 1,152) are prepared once per packed row and laid out on the paths by `gather_slots`, one launch that moves
  the five outputs' bits (engine/stages/core.md, "Prep kernels").
* v5: v4 plus `taps`, the proj rows of each output row's conv window (a plan's `conv_taps`): the
  engine's call in every GDN mode, each packed row once, with no binary search in cu_seqlens for the row's sequence,
  no slot and row-index reads before the window's rows (two dependent loads in front of the conv instead of 5-9 on
  drone's bucket); and q/k and v in branches of their own (`_conv_silu` in each), so v, which has no L2 norm, gets
  code without its selects. sm_90 listing (`python -m kernels.compile_check --sass --only gdn_prep`): the q/k path
  976 and the v path 867 instructions against v4's shared path of 1,170 (the call at slots over 17 sequences), 20
  global loads against 34. v4's bits (tests/test_kernels.py: the taps of a plan against its `conv_paths` at the
  representative slots and its `conv_segments`; random windows against `rows` and `slots`). `rows` and `slots`
  stay as the tests' and the prep probe's reference. On an H100 (`measure.prep_probe` at 33f9910) the kernel took
  10.2 / 7.2 / 29.7 us on drone / easy-intent-00 / customer_service against v4's 11.9 / 8.5 / 34.1 at the slots
  (-13 to -15 %; predicted -20 %), bit-equal.
* v6 (this file): v5 with the SiLU and beta's sigmoid through `numerics.silu_bf16` / `sigmoid_bf16` (approximate
  exp2 and reciprocal, torch's exact path only near a bf16 rounding midpoint): v5's bits on every bf16 input
  (tests/test_gpu_kernels.py::test_gpu_gates_on_every_bf16_input); sm_90 (Triton 3.9) 72 registers against 80.
  Timing: engine/stages/core.md, "The gates' fast path".
* v7 (dropped, 253123e): each conv tap one fma (the bf16 product is exact, so v6's bits; 128 fewer sm_90
  instructions): the shipped tile 2.7 % slower on an H100 (attempt `gdn-prep-conv-fma`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.numerics import (
    LAUNCH_OPTIONS,
    check_tensor,
    exp_f32,
    ieee_quiet,
    kernel_mode,
    log1p_f32,
    output_tensor,
    round_to_bf16,
    sequence_index,
    sigmoid_bf16,
    silu_bf16,
    tile_elements,
    to_bf16,
    to_f32,
)

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus default: x itself above it (constexpr: a jit global)


@triton.jit
def _conv_silu(
    proj_ptr, conv_weight_ptr, cu_seqlens_ptr, rows_ptr, taps_ptr, token, token_ok, position, num_seqs, proj_rows,
    proj_sr, first_channel, dim, dim_ok, WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_TAPS: tl.constexpr, TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """bf16↓(silu(bf16↓(conv))) of channels first_channel + dim for the rows `token` [BLOCK_T, BLOCK_D], fp32: the
    depthwise conv over each row's window, oldest tap first, from its taps or from its position in its sequence."""
    channel = first_channel + dim
    if not HAS_TAPS:
        sequence = sequence_index(cu_seqlens_ptr, position, num_seqs, SEARCH_STEPS)
        start = tl.load(cu_seqlens_ptr + sequence).to(tl.int64)  # the first row of the row's sequence
    conv = tl.zeros((token.shape[0], dim.shape[0]), tl.float32)
    for tap in tl.static_range(WIDTH):  # oldest tap first
        if HAS_TAPS:  # the window's proj rows, given; outside [0, proj_rows): before the sequence (zeros)
            source = tl.load(taps_ptr + token * WIDTH + tap, mask=token_ok, other=-1).to(tl.int64)
            source_ok = token_ok & (source >= 0) & (source < proj_rows)
        else:
            source = position - (WIDTH - 1) + tap
            source_ok = token_ok & (source >= start)
            if HAS_ROWS:  # the conv input's row `source` is proj's row rows[source]
                source = tl.load(rows_ptr + tl.maximum(source, 0), mask=token_ok, other=0).to(tl.int64)
        x = to_f32(
            tl.load(
                proj_ptr + source[:, None] * proj_sr + channel[None, :],
                mask=source_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
        )
        weight = to_f32(tl.load(conv_weight_ptr + channel * WIDTH + tap, mask=dim_ok, other=0.0))
        conv = conv + x * weight[None, :]
    conv = round_to_bf16(conv)  # F.conv1d output: bf16↓
    return silu_bf16(conv, TORCH_CPU)  # F.silu: bf16↓


@triton.jit
def _gdn_prep_kernel(
    proj_ptr,  # [T, P] bf16, row stride proj_sr
    conv_weight_ptr,  # [conv_dim, W] bf16 contiguous
    a_log_ptr,  # [Hv] bf16 or fp32
    dt_bias_ptr,  # [Hv] bf16 or fp32
    cu_seqlens_ptr,  # [N + 1] int32 or int64
    rows_ptr,  # [M] int32 or int64: the proj row of each conv-input row (unused without HAS_ROWS)
    slots_ptr,  # [T] int32 or int64: the conv-input row of each output row (unused without HAS_SLOTS)
    taps_ptr,  # [T, W] int32 or int64: the proj rows of each output row's conv window (unused without HAS_TAPS)
    q_ptr,  # [T, Hk, K] bf16 contiguous
    k_ptr,  # [T, Hk, K] bf16 contiguous
    v_ptr,  # [T, Hv, V] bf16 contiguous
    g_ptr,  # [T, Hv] fp32 contiguous
    beta_ptr,  # [T, Hv] bf16 contiguous
    tokens,
    num_seqs,
    proj_rows,
    proj_sr,
    eps,
    KEY_HEADS: tl.constexpr,  # Hk
    VALUE_HEADS: tl.constexpr,  # Hv
    KEY_DIM: tl.constexpr,  # K
    VALUE_DIM: tl.constexpr,  # V
    WIDTH: tl.constexpr,  # conv kernel width W
    SEARCH_STEPS: tl.constexpr,
    QK_L2NORM: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_TAPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    slot = tl.program_id(1)
    token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]: output row
    token_ok = token < tokens
    if HAS_SLOTS:  # output row t is the conv of conv-input row slots[t]
        position = tl.load(slots_ptr + token, mask=token_ok, other=0).to(tl.int64)
    else:
        position = tl.minimum(token, tokens - 1)
    if slot < 2 * KEY_HEADS:  # conv + silu (+ l2norm) of one q or k head
        dim = tl.arange(0, BLOCK_D)
        activated = _conv_silu(
            proj_ptr, conv_weight_ptr, cu_seqlens_ptr, rows_ptr, taps_ptr, token, token_ok, position, num_seqs,
            proj_rows, proj_sr, slot * KEY_DIM, dim, dim < KEY_DIM, WIDTH, SEARCH_STEPS, HAS_ROWS, HAS_TAPS, TORCH_CPU,
        )  # fmt: skip
        if QK_L2NORM:  # FLA l2norm_fwd: rstd = 1 / sqrt(Σx² + eps); y = x · rstd (Triton's own / and sqrt)
            rstd = 1 / tl.sqrt(tl.sum(activated * activated, axis=1) + eps)
            activated = activated * rstd[:, None]
        out_mask = token_ok[:, None] & (dim < KEY_DIM)[None, :]
        out_offset = token[:, None] * (KEY_HEADS * KEY_DIM) + (slot % KEY_HEADS) * KEY_DIM + dim[None, :]
        tl.store(tl.where(slot < KEY_HEADS, q_ptr, k_ptr) + out_offset, to_bf16(activated), mask=out_mask)
    elif slot < 2 * KEY_HEADS + VALUE_HEADS:  # conv + silu of one v head (a layout of its own: no reduction)
        v_dim = tl.arange(0, BLOCK_D)  # names apart from the other branches' (the if is a runtime one: v0)
        v_head = slot - 2 * KEY_HEADS
        value = _conv_silu(
            proj_ptr, conv_weight_ptr, cu_seqlens_ptr, rows_ptr, taps_ptr, token, token_ok, position, num_seqs,
            proj_rows, proj_sr, 2 * KEY_HEADS * KEY_DIM + v_head * VALUE_DIM, v_dim, v_dim < VALUE_DIM, WIDTH,
            SEARCH_STEPS, HAS_ROWS, HAS_TAPS, TORCH_CPU,
        )  # fmt: skip
        v_offset = token[:, None] * (VALUE_HEADS * VALUE_DIM) + v_head * VALUE_DIM + v_dim[None, :]
        tl.store(v_ptr + v_offset, to_bf16(value), mask=token_ok[:, None] & (v_dim < VALUE_DIM)[None, :])
    else:
        # beta and g of every value head
        head = tl.arange(0, BLOCK_HV)
        head_ok = head < VALUE_HEADS
        gate_mask = token_ok[:, None] & head_ok[None, :]
        b_column = 2 * KEY_HEADS * KEY_DIM + 2 * VALUE_HEADS * VALUE_DIM  # b follows q | k | v | z
        if HAS_TAPS:  # the window's last row is the row itself
            proj_row = tl.load(taps_ptr + token * WIDTH + (WIDTH - 1), mask=token_ok, other=0).to(tl.int64)
        elif HAS_ROWS:
            proj_row = tl.load(rows_ptr + position, mask=token_ok, other=0).to(tl.int64)
        else:
            proj_row = position
        row_offset = proj_row[:, None] * proj_sr + head[None, :]
        b = to_f32(tl.load(proj_ptr + row_offset + b_column, mask=gate_mask, other=0.0))
        a = to_f32(tl.load(proj_ptr + row_offset + b_column + VALUE_HEADS, mask=gate_mask, other=0.0))
        beta = sigmoid_bf16(b, TORCH_CPU)  # b.sigmoid(): bf16↓
        decay_rate = -exp_f32(to_f32(tl.load(a_log_ptr + head, mask=head_ok, other=0.0)), TORCH_CPU)
        softplus_in = a + to_f32(tl.load(dt_bias_ptr + head, mask=head_ok, other=0.0))[None, :]
        softplus = tl.where(
            softplus_in > SOFTPLUS_THRESHOLD, softplus_in, log1p_f32(exp_f32(softplus_in, TORCH_CPU), TORCH_CPU)
        )
        g = decay_rate[None, :] * softplus
        gate_offset = token[:, None] * VALUE_HEADS + head[None, :]
        tl.store(beta_ptr + gate_offset, to_bf16(beta), mask=gate_mask)
        tl.store(g_ptr + gate_offset, g, mask=gate_mask)


def gdn_prep(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    qk_l2norm: bool = True,
    eps: float = 1e-6,
    rows: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    taps: torch.Tensor | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv + SiLU + split + q/k L2 norm + gates of a GDN layer over packed rows: returns (q, k, v, g, beta).

    proj [T, P] bf16, P = 2·Hk·K + 2·Hv·V + 2·Hv (any row stride, unit column stride): the merged in-projection
    output [q | k | v | z | b | a]. conv_weight [2·Hk·K + Hv·V, W] bf16 (`conv1d.weight.squeeze(1)`). A_log,
    dt_bias [Hv] bf16 or fp32. cu_seqlens [N + 1] int32/int64 on proj's device, cu_seqlens[0] = 0,
    cu_seqlens[N] = T, non-decreasing (not checked: that would need a device sync). qk_l2norm: apply FLA's l2norm
    to q and k here (then call FLA with `use_qk_l2norm_in_kernel=False`); eps is that l2norm's eps.
    rows: optional [T] int32/int64 on proj's device: the conv input is `proj.index_select(0, rows)`, read through
    the index instead of gathered first (bitwise the same; the prefix tree's candidate paths). Values in
    [0, proj rows) are not checked (a device sync).
    slots: optional [T] int32/int64 on proj's device: only the outputs of these conv-input rows are computed, output
    row t being conv-input row slots[t] (with its own sequence's history), bit for bit that row of the call without
    `slots`. The tree's packed rows, each prepared once at its representative path slot (`TreePlan.row_slot`) and
    gathered to every path slot afterwards, instead of once per path that holds it. Values in [0, conv-input rows)
    are not checked (a device sync).
    taps: optional [T, W] int32/int64 on proj's device, instead of cu_seqlens, rows and slots (pass None for them):
    output row t is the conv over proj rows taps[t, 0], ..., taps[t, W-1] (oldest first; an entry outside
    [0, proj rows) stands for a zero row before the sequence) and takes its gates from proj row taps[t, W-1]. A
    plan's `conv_taps` (every packed row's window on its path) gives each packed row once, in any GDN mode, with no
    search for the row's sequence and no index read before the conv's own: the bits of the `rows` and `slots` call
    for the same rows (tests/test_kernels.py).
    out: optional (q, k, v, g, beta) tensors of the output shapes below, written in place.
    Returns q, k [1, T, Hk, K] bf16; v [1, T, Hv, V] bf16; g [1, T, Hv] fp32; beta [1, T, Hv] bf16.
    """
    if proj.ndim != 2 or conv_weight.ndim != 2:
        raise ValueError(
            f"gdn_prep: proj must be [T, P] and conv_weight [C, W], got {tuple(proj.shape)}, {tuple(conv_weight.shape)}"
        )
    device = proj.device
    if taps is not None and (cu_seqlens is not None or rows is not None or slots is not None):
        raise ValueError("gdn_prep: taps replace cu_seqlens, rows and slots; pass None for those")
    conv_rows = proj.shape[0] if rows is None else rows.shape[0]
    tokens = conv_rows if slots is None else slots.shape[0]
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    width = conv_weight.shape[1]
    check_tensor(
        "gdn_prep: proj",
        proj,
        dtype=torch.bfloat16,
        shape=(None, conv_dim + num_v_heads * head_v_dim + 2 * num_v_heads),
        device=device,
    )
    if rows is not None:
        check_tensor("gdn_prep: rows", rows, dtype=(torch.int32, torch.int64), shape=(None,), device=device)
    if slots is not None:
        check_tensor("gdn_prep: slots", slots, dtype=(torch.int32, torch.int64), shape=(None,), device=device)
        if conv_rows == 0 and tokens > 0:
            raise ValueError("gdn_prep: slots index an empty conv input")
    check_tensor(
        "gdn_prep: conv_weight (bf16 only: an fp32 weight makes HF convolve in fp32)",
        conv_weight,
        dtype=torch.bfloat16,
        shape=(conv_dim, width),
        device=device,
        contiguous=True,
    )
    for name, param in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(
            f"gdn_prep: {name}", param, dtype=(torch.bfloat16, torch.float32), shape=(num_v_heads,), device=device
        )
    if taps is not None:
        check_tensor("gdn_prep: taps", taps, dtype=(torch.int32, torch.int64), shape=(None, width), device=device,
                     contiguous=True)  # fmt: skip
        tokens = taps.shape[0]
    elif cu_seqlens is None:
        raise ValueError("gdn_prep: needs cu_seqlens, or taps")
    else:
        check_tensor("gdn_prep: cu_seqlens", cu_seqlens, dtype=(torch.int32, torch.int64), shape=(None,), device=device)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"gdn_prep: cu_seqlens must hold N + 1 >= 2 offsets, got {tuple(cu_seqlens.shape)}")
    if max(head_k_dim, head_v_dim) > 256 or num_v_heads % num_k_heads:
        raise ValueError(f"gdn_prep: need K, V <= 256 and Hk | Hv, got K={head_k_dim} V={head_v_dim} Hk={num_k_heads}")
    shapes = (
        (1, tokens, num_k_heads, head_k_dim),
        (1, tokens, num_k_heads, head_k_dim),
        (1, tokens, num_v_heads, head_v_dim),
        (1, tokens, num_v_heads),
        (1, tokens, num_v_heads),
    )
    dtypes = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)
    names = ("q", "k", "v", "g", "beta")
    if out is not None and len(out) != 5:
        raise ValueError(f"gdn_prep: out must be (q, k, v, g, beta), got {len(out)} tensors")
    q, k, v, g, beta = (
        output_tensor(f"gdn_prep: out {name}", None if out is None else out[i], shape, dtype, device)
        for i, (name, shape, dtype) in enumerate(zip(names, shapes, dtypes))
    )
    if tokens == 0:
        return q, k, v, g, beta
    torch_cpu = kernel_mode(_gdn_prep_kernel, device)
    num_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    index = taps if cu_seqlens is None else cu_seqlens  # a tensor for the unused index arguments
    block_t = tile_elements(torch_cpu) // 256  # from the widths only (K, V <= 256): batch-invariant bits
    grid = (triton.cdiv(tokens, block_t), 2 * num_k_heads + num_v_heads + 1)
    with ieee_quiet(torch_cpu):
        _gdn_prep_kernel[grid](
            proj,
            conv_weight,
            A_log,
            dt_bias,
            index,  # cu_seqlens, or (not read) the taps
            index if rows is None else rows,
            index if slots is None else slots,
            index if taps is None else taps,
            q,
            k,
            v,
            g,
            beta,
            tokens,
            num_seqs,
            proj.shape[0],
            proj.stride(0),
            eps,
            KEY_HEADS=num_k_heads,
            VALUE_HEADS=num_v_heads,
            KEY_DIM=head_k_dim,
            VALUE_DIM=head_v_dim,
            WIDTH=width,
            SEARCH_STEPS=(num_seqs - 1).bit_length(),
            QK_L2NORM=qk_l2norm,
            HAS_ROWS=rows is not None,
            HAS_SLOTS=slots is not None,
            HAS_TAPS=taps is not None,
            BLOCK_T=block_t,
            BLOCK_D=triton.next_power_of_2(max(head_k_dim, head_v_dim)),
            BLOCK_HV=triton.next_power_of_2(num_v_heads),
            TORCH_CPU=torch_cpu,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return q, k, v, g, beta


@triton.jit
def _gather_slots_kernel(
    q_ptr,  # [N, KEY_WIDTH] int16 (bf16 bits): the packed rows' outputs
    k_ptr,
    v_ptr,  # [N, VALUE_WIDTH] int16
    g_ptr,  # [N, Hv] int32 (fp32 bits)
    beta_ptr,  # [N, Hv] int16
    q_out_ptr,  # [L, KEY_WIDTH] int16: the path slots
    k_out_ptr,
    v_out_ptr,
    g_out_ptr,
    beta_out_ptr,
    rows_ptr,  # [L] int32 or int64: the packed row of each slot
    count_ptr,  # [1] int64: the slots to write (HAS_COUNT), read on the device
    slots,
    KEY_WIDTH: tl.constexpr,  # Hk·K
    VALUE_WIDTH: tl.constexpr,  # Hv·V
    VALUE_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,  # divides KEY_WIDTH and VALUE_WIDTH
    BLOCK_HV: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    LINEAR_GATES: tl.constexpr,  # g as fp32, beta as bf16 in; exp(g) and beta as fp32 out
):
    part = tl.program_id(1)  # column block of q | k | v, then one for the gates
    limit = tl.minimum(tl.load(count_ptr), slots).to(tl.int32) if HAS_COUNT else slots
    key_parts: tl.constexpr = KEY_WIDTH // BLOCK_C
    # Blocks of BLOCK_T slots, strided over the programs along axis 0: the grid is sized to the GPU, not to L, and a
    # program stops at the count the device holds (v2).
    for first in range(tl.program_id(0) * BLOCK_T, limit, tl.num_programs(0) * BLOCK_T):
        slot = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
        slot_ok = slot < limit
        row = tl.load(rows_ptr + slot, mask=slot_ok, other=0).to(tl.int64)
        if part < 2 * key_parts + VALUE_WIDTH // BLOCK_C:
            is_q = part < key_parts
            is_k = (part >= key_parts) & (part < 2 * key_parts)
            source = tl.where(is_q, q_ptr, tl.where(is_k, k_ptr, v_ptr))
            target = tl.where(is_q, q_out_ptr, tl.where(is_k, k_out_ptr, v_out_ptr))
            width = tl.where(part < 2 * key_parts, KEY_WIDTH, VALUE_WIDTH)
            start = tl.where(is_q, 0, tl.where(is_k, key_parts, 2 * key_parts))
            column = (part - start) * BLOCK_C + tl.arange(0, BLOCK_C)
            bits = tl.load(source + row[:, None] * width + column[None, :], mask=slot_ok[:, None], other=0)
            tl.store(target + slot[:, None] * width + column[None, :], bits, mask=slot_ok[:, None])
        else:
            head = tl.arange(0, BLOCK_HV)
            mask = slot_ok[:, None] & (head < VALUE_HEADS)[None, :]
            g = tl.load(g_ptr + row[:, None] * VALUE_HEADS + head[None, :], mask=mask, other=0)
            beta = tl.load(beta_ptr + row[:, None] * VALUE_HEADS + head[None, :], mask=mask, other=0)
            if LINEAR_GATES:
                g, beta = tl.exp(g), beta.to(tl.float32)
            tl.store(g_out_ptr + slot[:, None] * VALUE_HEADS + head[None, :], g, mask=mask)
            tl.store(beta_out_ptr + slot[:, None] * VALUE_HEADS + head[None, :], beta, mask=mask)


def _gather_programs(device: torch.device, parts: int) -> int:
    """Programs along the slots of a `gather_slots` launch: 16 a SM over the `parts` column blocks (4 warps each, the
    most an sm_90 SM holds at once), so every program is resident and strides over the slot blocks; 2 off CUDA (the
    interpreter, so that the CPU tests run the stride; the compile check's meta tensors, whose grid is not compiled)."""
    if device.type != "cuda":
        return 2
    return max(1, 16 * torch.cuda.get_device_properties(device).multi_processor_count // parts)


def gather_slots(
    prepared: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    linear_gates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gdn_prep`'s five outputs of N rows laid out at L slots, slot s holding row rows[s]: one launch that moves the
    bits (int16 / int32 views), equal to `t.index_select(1, rows)` for each (tests/test_kernels.py). How each packed
    row, prepared once at its representative slot (`gdn_prep(..., slots=...)`), reaches every path that holds it.

    prepared: (q, k [1, N, Hk, K] bf16, v [1, N, Hv, V] bf16, g [1, N, Hv] fp32, beta [1, N, Hv] bf16), contiguous.
    rows: [L] int32/int64 on their device, values in [0, N) (not checked: a device sync).
    count: [1] int64 on the device, or None: only slots below count[0] are written (the others keep what the fresh
      buffers held), a count the host need not know (the hand-off arena's `gathered`, refilled per request in a
      captured graph).
    linear_gates: g out as exp(g) and beta out as fp32 (FlashInfer's gate contract: `kernels.gdn_flashinfer`); exp is
      Triton's `tl.exp` in fp32 (on CUDA an approximate exp2 of g·log2(e), within a few ulp of torch.exp), beta's
      widening exact.
    Returns the same five at L rows.

    Grid (a copy: any tiling moves the same bits):
    * v1: one program per slot and column block of 1,024, over all L slots; past the count a program only exited.
      customer_service's arena launched about 60,000 programs, most of them past its count, and took 38.5 us on an
      H100 against about 15 us to move its bytes once (engine/stages/flashinfer_gdn.md, campaign 85).
    * v2 (this): blocks of `tile_elements` / 1,024 slots (4; 64 interpreted), at most 16 programs a SM over the
      column blocks (`_gather_programs`), each striding over the blocks up to the count it reads on the device. On an
      H100 (campaign 88, e85e07c, another machine than v1's) the arena's gather took 15.9 / 6.3 / 4.9 us on
      customer_service / drone / easy-intent-00 against v1's 38.5 / 8.8 / 4.6; the whole-bucket gather of `graphs`
      58.0 / 8.8 / 4.8 us against 52.1 / 9.3 / 4.7, a difference a same-process A/B (`measure.gather_ab`) has not
      resolved yet.
    """
    if len(prepared) != 5:
        raise ValueError(f"gather_slots: need gdn_prep's (q, k, v, g, beta), got {len(prepared)} tensors")
    q, k, v, g, beta = prepared
    device, n = q.device, q.shape[1]
    if q.ndim != 4 or v.ndim != 4 or q.shape[0] != 1:
        raise ValueError(f"gather_slots: q and v must be [1, N, H, D], got {tuple(q.shape)}, {tuple(v.shape)}")
    heads_v = v.shape[2]
    expected = ((q, q.shape, torch.bfloat16), (k, q.shape, torch.bfloat16), (v, v.shape, torch.bfloat16),
                (g, (1, n, heads_v), torch.float32), (beta, (1, n, heads_v), torch.bfloat16))  # fmt: skip
    for name, (tensor, shape, dtype) in zip(("q", "k", "v", "g", "beta"), expected):
        check_tensor(f"gather_slots: {name}", tensor, dtype=dtype, shape=tuple(shape), device=device, contiguous=True)
    check_tensor("gather_slots: rows", rows, dtype=(torch.int32, torch.int64), shape=(None,), device=device)
    slots = rows.shape[0]
    if count is not None:
        check_tensor("gather_slots: count", count, dtype=torch.int64, shape=(1,), device=device)
    dtypes = [t.dtype for t in prepared[:3]] + [torch.float32, torch.float32 if linear_gates else beta.dtype]
    out = tuple(torch.empty((1, slots, *t.shape[2:]), dtype=d, device=device) for t, d in zip(prepared, dtypes))
    if slots == 0:
        return out
    key_width, value_width = q.shape[2] * q.shape[3], v.shape[2] * v.shape[3]
    torch_cpu = kernel_mode(_gather_slots_kernel, device)
    block_c = min(1024, math.gcd(key_width, value_width) & -math.gcd(key_width, value_width))  # a power of two
    block_t = max(1, tile_elements(torch_cpu) // block_c)
    parts = (2 * key_width + value_width) // block_c + 1
    grid = (min(triton.cdiv(slots, block_t), _gather_programs(device, parts)), parts)

    def bits(t: torch.Tensor) -> torch.Tensor:  # moved unchanged: bf16 as int16, fp32 as int32
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    moved = (q, k, v) if linear_gates else prepared  # linear gates: g and beta are computed on, as floats
    args = [*map(bits, moved), *prepared[len(moved) :], *map(bits, out[: len(moved)]), *out[len(moved) :]]
    _gather_slots_kernel[grid](
        *args,
        rows,
        rows if count is None else count,
        slots,
        KEY_WIDTH=key_width,
        VALUE_WIDTH=value_width,
        VALUE_HEADS=heads_v,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        BLOCK_HV=triton.next_power_of_2(heads_v),
        HAS_COUNT=count is not None,
        LINEAR_GATES=linear_gates,
        num_warps=4,
        **LAUNCH_OPTIONS,
    )
    return out
