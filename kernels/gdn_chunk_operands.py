"""The rounding points and dot operands of the chunked gated delta rule forward, shared by its two schedules
(`kernels.gdn_chunk`, one launch; `kernels.gdn_chunk_split`, two), so that both place every rounding point and feed
every dot the same way: the condition of their bit-identity (tests/test_gdn_chunk_split.py).

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
