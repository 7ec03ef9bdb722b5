"""Element-wise gates: SiLU·mul of the MLP and the sigmoid output gate of attention, plus the torch-opmath helpers
that every kernel of this package uses.

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
Exactness: bitwise against the reference on the same device (tests/test_kernels.py on CPU, measured 100 %;
tests/test_gpu_kernels.py on the H200).

How torch's numerics are reproduced (helpers below, shared by the package):
* Roundings to bf16 are integer bit arithmetic (nearest, ties to even): `round_to_bf16` between two ops, `to_bf16`
  at a store, and `to_f32` for bf16 loads. Two reasons. MLIR folds `extf(truncf(x))` to `x` when both carry the
  `contract` flag, and a documented Triton 3.6 trap is that round trip disappearing. And the Triton 3.9 interpreter
  converts fp32 -> bf16 by truncation and mangles subnormals in both directions (measured: `.to(tl.bfloat16)` on
  random fp32 agreed with torch on 49.8 % of the values; bf16 -> fp32 was wrong for all 254 nonzero subnormals).
* Launch options `enable_fp_fusion=False` (torch runs each op as its own kernel: no mul+add across ops may become
  an fma) and `enable_reflect_ftz=False` (libdevice must not flush subnormals; torch's nvcc build does not).
* On CUDA: `libdevice.exp` (= `expf`, which torch's kernels call; Triton's `tl.exp` is `ex2.approx`),
  `libdevice.log1p`, `libdevice.rsqrt` (= `rsqrtf`, torch's `rsqrt`) and `tl.math.div_rn` (IEEE division; Triton's
  `/` is `div.full.f32`). Checked by compiling every kernel for sm_90 here: the PTX has `div.rn.f32` and a non-ftz
  `rsqrt.approx.f32`, and no fma outside libdevice's own `expf`.
* Under TRITON_INTERPRET=1 (CPU tensors) there is no libdevice: exp and log1p are evaluated in fp64 and rounded once
  (torch's CPU expf / log1pf are correctly rounded on ~99 % / ~98 % of inputs), rsqrt as 1/sqrt in fp32 (agrees
  with torch's CPU rsqrt on ~86 % of inputs). A last-bit fp32 difference almost never survives a bf16↓; where a
  kernel outputs fp32 (the GDN decay g) the CPU test bounds it in ulps. This limits the CPU check only.
* The interpreter runs numpy, which warns on IEEE overflow and division by zero (e.g. exp overflow in silu of a very
  negative x, or the untaken side of a `tl.where`); launches there run under `ieee_quiet`. No `tl.dot` anywhere (the
  interpreter computes bf16 dots wrongly).

Version history:
* v1 (this file): silu_mul and attention_gate as 2-D tiles (rows x columns) of `tile_elements` elements. On the
  H200 at the 27B width, silu_mul takes 45.7 us for 971 rows (54% of the copy rate); nine other tile shapes (8-32
  rows, 512-4096 columns, 4 or 8 warps) were all slower, 46.6-68.1 us (attempt `fused-kernel-tile-retune`,
  results/gpu/20261130T134352Z-nvidia-h200-be9cff4-kernel-tiles.json).
* v0 probes that failed: `libdevice.exp` under the interpreter returns None (`create_extern_elementwise` is not
  implemented there), hence the constexpr `TORCH_CPU` branches; stores through `.to(tl.bfloat16)` were one ulp off on
  about half the elements under the interpreter (truncation), hence `to_bf16`; numpy's float32 `exp` left the CPU g
  45-70 % bit-identical with up to 6 ulp, hence fp64 there (now 93-100 %, at most 2 ulp).
"""

from __future__ import annotations

import contextlib

import numpy
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Compile options for every kernel of the package (see module docstring). The interpreter accepts and ignores them.
LAUNCH_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# ---------------------------------------------------------------------------------------------------------------------
# Helpers: torch opmath in Triton


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32; overflow gives ±inf. NaN stays NaN with its
    quiet bit set, so that its upper 16 bits are a bf16 NaN too."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, bits | 0x400000, rounded).to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 tensor, round to nearest even, by bits (the interpreter's `.to(tl.bfloat16)` truncates and
    mangles subnormals)."""
    bits = round_to_bf16(x).to(tl.uint32, bitcast=True)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_f32(x):
    """A loaded bf16 or fp32 tensor as fp32, exactly: bf16 by bits (the interpreter's `.to(tl.float32)` mangles
    subnormals), fp32 unchanged."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def exp_f32(x, TORCH_CPU: tl.constexpr):
    """expf: libdevice on CUDA (what torch's CUDA kernels call); in the interpreter exp in fp64 rounded once to fp32
    (torch's CPU expf is correctly rounded ~99 % of the time, numpy's float32 exp only ~61 %)."""
    if TORCH_CPU:
        y = tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def log1p_f32(x, TORCH_CPU: tl.constexpr):
    """log1pf: libdevice on CUDA; in the interpreter (which has no log1p) log(w)·x/(w−1), w = 1 + x, in fp64, rounded
    once to fp32 (accurate far beyond fp32, so it is the correctly rounded log1pf that torch's CPU kernel returns
    ~98 % of the time)."""
    if TORCH_CPU:
        x64 = x.to(tl.float64)
        w = 1.0 + x64
        y = tl.where(w == 1.0, x64, tl.log(w) * (x64 / (w - 1.0))).to(tl.float32)
    else:
        y = libdevice.log1p(x)
    return y


@triton.jit
def rsqrt_f32(x, TORCH_CPU: tl.constexpr):
    """torch.rsqrt on fp32: `rsqrtf` (libdevice) on CUDA; 1/sqrt in fp32 in the interpreter (torch's CPU rsqrt is
    neither that nor correctly rounded: 1/sqrt agrees with it on ~86 % of inputs, the correctly rounded value on
    ~71 %)."""
    if TORCH_CPU:
        y = tl.rsqrt(x)
    else:
        y = libdevice.rsqrt(x)
    return y


@triton.jit
def sigmoid_f32(x, TORCH_CPU: tl.constexpr):
    """torch's sigmoid in fp32 opmath: 1 / (1 + exp(-x)), IEEE division."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x, TORCH_CPU))


@triton.jit
def silu_f32(x, TORCH_CPU: tl.constexpr):
    """torch's silu in fp32 opmath: x / (1 + exp(-x)), IEEE division."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x, TORCH_CPU))


# ---------------------------------------------------------------------------------------------------------------------
# Helpers: launcher side


def kernel_mode(kernel, device: torch.device) -> bool:
    """Return TORCH_CPU for a launch: True when `kernel` runs in the Triton interpreter on CPU tensors, False when it
    is compiled for CUDA tensors. Any other pairing is an error with the fix in its message."""
    interpreted = not isinstance(kernel, triton.runtime.JITFunction)
    if interpreted and device.type != "cpu":
        raise RuntimeError(
            f"kernels were defined under TRITON_INTERPRET=1 but got {device} tensors: unset TRITON_INTERPRET before "
            "`kernels` is imported to compile them for the GPU"
        )
    if not interpreted and device.type != "cuda":
        raise RuntimeError(
            f"kernels were compiled for CUDA but got {device} tensors: set TRITON_INTERPRET=1 before `kernels` is "
            "imported to run them on the CPU (the Triton interpreter)"
        )
    return interpreted


def tile_elements(torch_cpu: bool) -> int:
    """Elements per program that tile sizes are derived from (widths only, never row counts, so a row's bits do not
    depend on the other rows of a call). The interpreter pays about a millisecond per Triton op and per program, not
    per element, so it runs 16x larger tiles."""
    return 65536 if torch_cpu else 4096


def ieee_quiet(torch_cpu: bool):
    """Context of an interpreted launch: numpy's floating-point warnings off. Overflow to inf, division by zero in a
    `tl.where` branch that is not taken, underflow: these are the IEEE results torch's kernels produce silently
    (e.g. exp overflow in silu of a very negative x); the interpreter evaluates them with numpy, which warns."""
    return numpy.errstate(all="ignore") if torch_cpu else contextlib.nullcontext()


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device,
    contiguous: bool = False,
) -> None:
    """Raise ValueError unless `t` has the dtype, shape (None = any size), device and layout a kernel needs.
    Every tensor must have unit stride in its last dim; `contiguous` asks for a fully contiguous tensor."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if t.ndim != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want_text = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [{want_text}]")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
    if t.ndim and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, got strides {t.stride()}")


def output_tensor(
    name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`out` checked to be a contiguous tensor of exactly this shape and dtype, or a new one when None."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, dtype=dtype, shape=shape, device=device, contiguous=True)
    return out


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
    activated = round_to_bf16(silu_f32(gate, TORCH_CPU))  # F.silu(gate): bf16↓
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
    gate = round_to_bf16(sigmoid_f32(to_f32(gate), TORCH_CPU))  # torch.sigmoid(gate): bf16↓
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
