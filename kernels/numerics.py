"""Torch opmath in Triton: the device helpers and launcher helpers that every kernel of `kernels/` uses.

Split. This module holds what is shared and computes no op of the model: the `@triton.jit` device functions (bf16
rounding by bits, exp/log1p/rsqrt/sigmoid/silu in fp32 as torch's kernels evaluate them, `sequence_index`: the packed
sequence of a row) and the host-side launch helpers (compile options, interpreter/CUDA mode, tile budget, numpy
warnings, tensor checks, output buffers). Each op family (`activations`, `norms`, `gdn_prep`, `attn_prep`) is a
module of its own that imports from here; nothing here imports them.

How torch's numerics are reproduced:
* Roundings to bf16 (nearest, ties to even): `round_to_bf16` between two ops, `to_bf16` at a store, and `to_f32`
  for bf16 loads. Compiled, the fp32 -> bf16 step is the hardware's `cvt.rn.bf16.f32` and the way back is bit
  arithmetic: MLIR folds `extf(truncf(x))` to `x` when both carry the `contract` flag (a documented Triton 3.6 trap is
  that round trip disappearing), and a bit-cast widening is no `extf`. Interpreted, both steps are integer bit
  arithmetic: the Triton 3.9 interpreter converts fp32 -> bf16 by truncation and mangles subnormals in both
  directions. (Before 2026-12-04 the compiled kernels also rounded by bits, about seven integer instructions an
  element, most of the GDN walk's instructions: engine/stages/core.md.) `to_bf16` equals torch's fp32 -> bf16
  conversion on random values, ties, carries, ±inf, ±0, subnormals, NaN and overflow, both ways:
  tests/test_kernels.py::test_round_to_bf16_matches_torch (interpreted) and
  tests/test_gpu_kernels.py::test_gpu_round_to_bf16_matches_torch (compiled, H200).
* Launch options `enable_fp_fusion=False` (torch runs each op as its own kernel: no mul+add across ops may become
  an fma) and `enable_reflect_ftz=False` (libdevice must not flush subnormals; torch's nvcc build does not).
* Gates rounded to bf16 at once (`silu_bf16`, `sigmoid_bf16`): compiled, a fast value (`ex2.approx`, `rcp.approx`)
  decides the rounding wherever it lies more than `ROUNDING_MARGIN` fp32 ulps from a bf16 midpoint, and torch's
  formula below (its PTX verbatim) runs for the rest: torch's bits, proved on every bf16 input on the GPU.
* On CUDA: `libdevice.exp` (= `expf`, which torch's kernels call; Triton's `tl.exp` is `ex2.approx`),
  `libdevice.log1p`, `libdevice.rsqrt` (= `rsqrtf`, torch's `rsqrt`) and `tl.math.div_rn` (IEEE division; Triton's
  `/` is `div.full.f32`). Checked by compiling every kernel for sm_90 here: the PTX has `div.rn.f32` and a non-ftz
  `rsqrt.approx.f32`, and no fma outside libdevice's own `expf` (`kernels/compile_check.py`).
* Under TRITON_INTERPRET=1 (CPU tensors) there is no libdevice: exp and log1p are evaluated in fp64 and rounded once
  (torch's CPU expf / log1pf are correctly rounded on most inputs, not all), rsqrt as 1/sqrt in fp32 (not always
  torch's CPU rsqrt). A last-bit fp32 difference almost never survives a bf16↓; where a
  kernel outputs fp32 (the GDN decay g) the CPU test bounds it in ulps. This limits the CPU check only.
* The interpreter runs numpy, which warns on IEEE overflow and division by zero (e.g. exp overflow in silu of a very
  negative x, or the untaken side of a `tl.where`); launches there run under `ieee_quiet`. No `tl.dot` anywhere (the
  interpreter computes bf16 dots wrongly).

Versions (history: engine/stages/fused.md, "Kernel history"):
* v3 (this file): `silu_bf16` and `sigmoid_bf16`, the gates the kernels round at once: a fast path and torch's exact
  path in inline PTX (their docstrings; `python -m kernels.compile_check --gates` checks the exact path on the CPU).
* v2: compiled roundings through the hardware conversion (same bits but for NaN payloads).
* v1: the helpers above, moved out of `kernels/activations.py` unchanged.
"""

from __future__ import annotations

import contextlib
import struct

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
def _defined_as_jit():
    """Nothing: its type tells whether this import compiles kernels or interprets them (`INTERPRETED`)."""
    pass


# True when the kernels are defined under TRITON_INTERPRET=1 (Triton's own test, the one `kernel_mode` reads)
INTERPRETED = tl.constexpr(not isinstance(_defined_as_jit, triton.runtime.JITFunction))


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32; overflow gives ±inf; NaN stays NaN. Compiled:
    the hardware conversion (`cvt.rn.bf16.f32`, two values an instruction) widened back by bits, so no `extf(truncf)`
    pair exists for MLIR to fold. Interpreted: integer arithmetic on the bits, the NaN with its quiet bit set."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, bits | 0x400000, rounded).to(tl.float32, bitcast=True)
    else:
        y = to_f32(x.to(tl.bfloat16))
    return y


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 tensor, round to nearest even: the hardware conversion when compiled, by bits when interpreted (the
    interpreter's `.to(tl.bfloat16)` truncates and mangles subnormals)."""
    if INTERPRETED:
        bits = round_to_bf16(x).to(tl.uint32, bitcast=True)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def to_f32(x):
    """A loaded bf16 or fp32 tensor as fp32, exactly: bf16 by bits (the interpreter's `.to(tl.float32)` mangles
    subnormals; compiled, bits keep `round_to_bf16` free of an `extf`), fp32 unchanged."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def sequence_index(cu_seqlens_ptr, position, num_seqs, SEARCH_STEPS: tl.constexpr):
    """The packed sequence holding each row in `position`: the largest i < num_seqs with cu_seqlens[i] <= position
    (binary search in SEARCH_STEPS = bit length of num_seqs - 1 steps; empty sequences are skipped), int32."""
    low = tl.zeros(position.shape, tl.int32)
    high = tl.zeros(position.shape, tl.int32) + (num_seqs - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high + 1) // 2
        go_right = tl.load(cu_seqlens_ptr + middle).to(tl.int64) <= position
        low = tl.where(go_right, middle, low)
        high = tl.where(go_right, high, middle - 1)
    return low


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


# The rounded gates' PTX (`silu_bf16`, `sigmoid_bf16`): a fast path, its check, and torch's exact path. `{op}` is the
# fast value from d = 1 + e and r ≈ 1 / d, `{exact}` torch's from d: both write y. Registers are typeless .b32, as
# Triton's own PTX; the labels are local to the braces (PTX scopes them so), so every element's copy may repeat them.
_ROUNDED_GATE_PTX = """{{
.reg .b32 t, e, d, r, y, n, s, low;
.reg .pred slow;
mul.rn.f32 t, $1, 0fBFB8AA3B;
ex2.approx.ftz.f32 e, t;
add.rn.f32 d, e, 0f3F800000;
rcp.approx.ftz.f32 r, d;
{op}
and.b32 low, y, 65535;
sub.s32 low, low, {low_start};
setp.lt.u32 slow, low, {low_span};
setp.lt.or.f32 slow, $1, {exact_below}, slow;
@!slow bra DONE;
neg.f32 n, $1;
fma.rn.f32 t, n, 0f3BBB989D, 0f3F000000;
cvt.sat.f32.f32 t, t;
fma.rm.f32 t, t, 0f437C0000, 0f4B400001;
add.rn.f32 e, t, 0fCB40007F;
neg.f32 e, e;
fma.rn.f32 e, n, 0f3FB8AA3B, e;
fma.rn.f32 e, n, 0f32A57060, e;
shl.b32 s, t, 23;
ex2.approx.ftz.f32 e, e;
mul.rn.f32 e, e, s;
add.rn.f32 d, e, 0f3F800000;
{exact}
DONE:
mov.b32 $0, y;
}}"""
ROUNDING_MARGIN = 64  # fp32 ulps of the fast value either side of a bf16 rounding midpoint that take the exact path
EXACT_BELOW = -16.0  # inputs below it take the exact path (there exp(-x) > 2^23 and the fast error grows with |x|)
_GATE_PTX_FIELDS = {
    "low_start": 0x8000 - ROUNDING_MARGIN,
    "low_span": 2 * ROUNDING_MARGIN + 1,
    "exact_below": f"0f{struct.unpack('<I', struct.pack('<f', EXACT_BELOW))[0]:08X}",  # PTX's fp32 literal
}
SILU_BF16_PTX = tl.constexpr(  # constexpr: a jit global
    _ROUNDED_GATE_PTX.format(op="mul.rn.f32 y, $1, r;", exact="div.rn.f32 y, $1, d;", **_GATE_PTX_FIELDS)
)
SIGMOID_BF16_PTX = tl.constexpr(
    _ROUNDED_GATE_PTX.format(
        op="mov.b32 y, r;", exact="mov.b32 n, 0f3F800000;\ndiv.rn.f32 y, n, d;", **_GATE_PTX_FIELDS
    )
)


@triton.jit
def silu_bf16(x, TORCH_CPU: tl.constexpr):
    """bf16↓(torch's silu(x)) as fp32: `round_to_bf16(silu_f32(x))` bit for bit, the rounding taken from a fast
    value where it cannot differ. Compiled (`SILU_BF16_PTX`, per element): y' = x · rcp(1 + ex2(−x·log2 e)) with the
    approximate MUFU instructions, then torch's exact path (libdevice's expf, IEEE division: `silu_f32`'s PTX) only
    where x < −16 or y' lies within `ROUNDING_MARGIN` fp32 ulps of a bf16 rounding midpoint (low 16 bits within 64 of
    0x8000: about 0.2 % of the elements). Elsewhere torch's y and y' round alike as long as they differ by less than
    64 ulps; for x >= −16 they differ by at most about 20 (x·log2 e rounded: |x| ulps of e; ex2 and rcp: a few).
    Proof on the device: every one of the 65,536 bf16 inputs against torch
    (tests/test_gpu_kernels.py::test_gpu_gates_on_every_bf16_input), run on the H100 (campaign 71); the approximate
    instructions belong to the card, so another architecture (a Blackwell) needs that test run on it first.
    Interpreted: `round_to_bf16(silu_f32(x))`."""
    if TORCH_CPU:
        y = round_to_bf16(silu_f32(x, TORCH_CPU))
    else:
        y = _rounded_gate(x, SILU_BF16_PTX)
    return y


@triton.jit
def sigmoid_bf16(x, TORCH_CPU: tl.constexpr):
    """bf16↓(torch's sigmoid(x)) as fp32: `round_to_bf16(sigmoid_f32(x))` bit for bit, as `silu_bf16` (fast value
    rcp(1 + ex2(−x·log2 e)), torch's exact path near a midpoint or below −16; `SIGMOID_BF16_PTX`)."""
    if TORCH_CPU:
        y = round_to_bf16(sigmoid_f32(x, TORCH_CPU))
    else:
        y = _rounded_gate(x, SIGMOID_BF16_PTX)
    return y


@triton.jit
def _rounded_gate(x, PTX: tl.constexpr):
    """A gate's inline PTX (`SILU_BF16_PTX` or `SIGMOID_BF16_PTX`) on fp32 x, one element a copy, its fp32 result
    rounded to bf16: compiled kernels only."""
    bits = tl.inline_asm_elementwise(PTX, "=r,r", [x.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1)
    return round_to_bf16(bits.to(tl.float32, bitcast=True))


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
