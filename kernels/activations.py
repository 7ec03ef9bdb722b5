"""Element-wise gates: SiLU·mul of the MLP and the sigmoid output gate of attention.

Kernels (one launch each):
* `silu_mul(gate_up)`: the SwiGLU middle of `Qwen3_5MLP`, read from the merged gate|up GEMM output
  [R, 2I] = [gate I | up I]; out [R, I] = bf16↓( bf16↓(silu(gate)) · up ). Replaces `F.silu(gate) * up`
  (`reference.ops.silu_mul`): two torch kernels and an [R, I] intermediate.
* `attention_gate(attn, gate)`: `attn_out * torch.sigmoid(gate)` of `Qwen3_5Attention`; out [R, H·D] =
  bf16↓( attn · bf16↓(sigmoid(gate)) ) (`reference.ops.attention_gate`). `gate` may be the strided per-head view of
  the q projection (`kernels.attn_prep.attention_gate_view`), so the gate half is never copied.

Rounding points. torch evaluates a bf16 element-wise op in fp32 ("opmath") and rounds once per op, so each torch op
of a chain is one bf16↓ here, at the same place, and nothing else is rounded:
  silu(x)    = bf16↓( x / (1 + exp(-x)) )      (torch's CUDA silu kernel; its CPU kernel computes the same formula)
  sigmoid(x) = bf16↓( 1 / (1 + exp(-x)) )      (torch's CUDA sigmoid kernel, opmath; CPU likewise)
  a · b      = bf16↓( fp32(a) · fp32(b) )
Exactness: bitwise against the reference on the same device (tests/test_kernels.py on CPU, tests/test_gpu_kernels.py
on the H200).

The torch-opmath helpers these kernels call (bf16 rounding by bits, exp/sigmoid/silu as torch evaluates them, launch
options and tensor checks) live in `kernels/numerics.py`, with how each reproduces torch.

Versions (history: engine/stages/fused.md, "Kernel history"):
* v1: silu_mul and attention_gate as 2-D tiles (rows x columns) of `tile_elements` elements.
* v2 (this file): v1 with each gate rounded through `numerics.silu_bf16` / `sigmoid_bf16` (compiled: approximate
  exp2 and reciprocal, torch's exact path only near a bf16 rounding midpoint): v1's bits on every bf16 input
  (tests/test_gpu_kernels.py::test_gpu_gates_on_every_bf16_input). sm_90 (Triton 3.9): silu_mul 64 registers against
  96, about 12 instructions an element on the fast path where torch's expf and IEEE division took about 19.
  Timing: engine/stages/core.md, "The gates' fast path".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.numerics import (
    LAUNCH_OPTIONS,
    check_tensor,
    ieee_quiet,
    kernel_mode,
    output_tensor,
    sigmoid_bf16,
    silu_bf16,
    tile_elements,
    to_bf16,
    to_f32,
)

# ---------------------------------------------------------------------------------------------------------------------
# silu_mul


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [R, 2I] bf16, row stride stride_in
    out_ptr,  # [R, I] bf16, contiguous
    rows,
    stride_in,
    INTER: tl.constexpr,  # I
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask = (row < rows)[:, None] & (col < INTER)[None, :]
    src = gate_up_ptr + row[:, None] * stride_in + col[None, :]
    gate = to_f32(tl.load(src, mask=mask, other=0.0))
    up = to_f32(tl.load(src + INTER, mask=mask, other=0.0))
    activated = silu_bf16(gate, TORCH_CPU)  # F.silu(gate): bf16↓
    tl.store(out_ptr + row[:, None] * INTER + col[None, :], to_bf16(activated * up), mask=mask)  # · up: bf16↓


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU middle from the merged gate|up projection: [R, 2I] bf16 -> [R, I] bf16 = bf16↓(bf16↓(silu(g)) · u).

    gate_up may be a row slice of a larger buffer (any row stride, unit column stride). `out` (contiguous [R, I] bf16)
    is written in place when given. Bitwise equal to `reference.ops.silu_mul(gate, up)`.
    """
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [R, 2I], got {tuple(gate_up.shape)}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    check_tensor("silu_mul: gate_up", gate_up, dtype=torch.bfloat16, shape=(rows, 2 * inter), device=gate_up.device)
    out = output_tensor("silu_mul: out", out, (rows, inter), torch.bfloat16, gate_up.device)
    if rows == 0:
        return out
    torch_cpu = kernel_mode(_silu_mul_kernel, gate_up.device)
    block_r, block_n = _tile(rows, inter, torch_cpu)
    with ieee_quiet(torch_cpu):
        _silu_mul_kernel[(triton.cdiv(rows, block_r), triton.cdiv(inter, block_n))](
            gate_up,
            out,
            rows,
            gate_up.stride(0),
            INTER=inter,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            TORCH_CPU=torch_cpu,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# attention_gate


@triton.jit
def _attention_gate_kernel(
    attn_ptr,  # [R, H, D] bf16, strides (attn_sr, attn_sh, 1)
    gate_ptr,  # [R, H, D] bf16, strides (gate_sr, gate_sh, 1)
    out_ptr,  # [R, H·D] bf16, contiguous
    rows,
    attn_sr,
    attn_sh,
    gate_sr,
    gate_sh,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] over H·D
    head, dim = col // HEAD_DIM, col % HEAD_DIM
    mask = (row < rows)[:, None] & (col < HEADS * HEAD_DIM)[None, :]
    attn = tl.load(attn_ptr + row[:, None] * attn_sr + (head * attn_sh + dim)[None, :], mask=mask, other=0.0)
    gate = tl.load(gate_ptr + row[:, None] * gate_sr + (head * gate_sh + dim)[None, :], mask=mask, other=0.0)
    gate = sigmoid_bf16(to_f32(gate), TORCH_CPU)  # torch.sigmoid(gate): bf16↓
    out = to_bf16(to_f32(attn) * gate)  # attn · sigmoid: bf16↓
    tl.store(out_ptr + row[:, None] * (HEADS * HEAD_DIM) + col[None, :], out, mask=mask)


def attention_gate(attn: torch.Tensor, gate: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output gate: out [R, H·D] bf16 = bf16↓( attn · bf16↓(sigmoid(gate)) ).

    attn and gate are [R, H, D] (or [R, N], read as H = 1) bf16 with any row and head strides and unit stride in D:
    e.g. attn the [T, H, D] attention output and gate `attention_gate_view(attn_proj, ...)`. `out` (contiguous
    [R, H·D] bf16) is written in place when given. Bitwise equal to `reference.ops.attention_gate` on the flattened
    [R, H·D] tensors.
    """
    if attn.ndim == 2:
        attn = attn.unsqueeze(1)
    if gate.ndim == 2:
        gate = gate.unsqueeze(1)
    if attn.ndim != 3:
        raise ValueError(f"attention_gate: attn must be [R, H, D] or [R, N], got {tuple(attn.shape)}")
    rows, heads, head_dim = attn.shape
    check_tensor("attention_gate: attn", attn, dtype=torch.bfloat16, shape=(rows, heads, head_dim), device=attn.device)
    check_tensor("attention_gate: gate", gate, dtype=torch.bfloat16, shape=(rows, heads, head_dim), device=attn.device)
    out = output_tensor("attention_gate: out", out, (rows, heads * head_dim), torch.bfloat16, attn.device)
    if rows == 0:
        return out
    torch_cpu = kernel_mode(_attention_gate_kernel, attn.device)
    block_r, block_n = _tile(rows, heads * head_dim, torch_cpu)
    with ieee_quiet(torch_cpu):
        _attention_gate_kernel[(triton.cdiv(rows, block_r), triton.cdiv(heads * head_dim, block_n))](
            attn,
            gate,
            out,
            rows,
            attn.stride(0),
            attn.stride(1),
            gate.stride(0),
            gate.stride(1),
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            TORCH_CPU=torch_cpu,
            num_warps=4,
            **LAUNCH_OPTIONS,
        )
    return out


def _tile(rows: int, cols: int, torch_cpu: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) of an element-wise kernel: up to 1024 columns (16384 interpreted), `tile_elements` in all.
    No reduction, so shrinking BLOCK_R to the row count changes no bits."""
    block_n = min(16384 if torch_cpu else 1024, triton.next_power_of_2(cols))
    return min(triton.next_power_of_2(rows), max(1, tile_elements(torch_cpu) // block_n)), block_n
