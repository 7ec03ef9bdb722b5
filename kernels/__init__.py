"""Fast ops of the engine: fused Triton kernels, one module per op family, each with its reference in
`reference/ops.py` and its exactness stated in the module docstring.

* `norms.residual_rmsnorm`, `norms.rmsnorm_1p`: residual add + `Qwen3_5RMSNorm`. The residual is bitwise; the normed
  output bitwise except the fp32 sum-of-squares order (at most one bf16 ulp, rare).
* `norms.residual_rmsnorm_splitk`: the same with the delta summed from split-K fp32 partials [S, R, H] in split
  order and rounded to bf16 (issue 14). Delta and residual bitwise; normed as `residual_rmsnorm`.
* `norms.gated_rmsnorm`: `Qwen3_5RMSNormGated` (HF torch path). Bitwise except the sum-of-squares order.
* `activations.silu_mul`: `F.silu(gate) * up` on the merged gate|up output. Bitwise.
* `activations.attention_gate`: `attn * torch.sigmoid(gate)`. Bitwise.
* `gdn_prep.gdn_prep`: conv1d + SiLU, split, FLA's q/k l2norm, beta, g, FLA varlen layout. v, beta, g bitwise (g on
  the GPU; a few fp32 ulp under the CPU interpreter); q/k bitwise except the sum-of-squares order.
* `gdn_prep.gather_slots`: gdn_prep's five outputs moved from packed rows to the tree's path slots in one launch.
  Bitwise (bits copied).
* `gdn_chunk.gdn_chunk_forward` (and `GdnChunkCore`, its FLA-signature adapter): the chunked gated delta rule
  forward, a solve launch and a walk with the state in registers that can run a plan's tree walk and read the path
  slots at their packed rows (stage `core`).
  Bounded against the fp32 oracle `reference.ops.gdn_recurrent`; bitwise batch-, padding- and prefix-invariant, and
  the tree walk bitwise the plain walk where the engine reads.
* `attn_prep.attn_prep`: q/gate split, q/k norm, partial RoPE, attention layout. v bitwise; q/k bitwise except the
  sum-of-squares order. `attn_prep.attention_gate_view` is the gate half of the q projection as a view.

The torch-opmath helpers they share (bf16 rounding by bits, exp/silu/sigmoid as torch evaluates them, launch options,
tensor checks) are `numerics`.

CPU: the kernels run in the Triton interpreter when TRITON_INTERPRET=1 is set before this package is imported
(`nox -s tests` does); CUDA tensors need compiled kernels (TRITON_INTERPRET unset). The names `gdn_prep` and
`attn_prep` below are the functions; their modules are `sys.modules["kernels.gdn_prep"]` etc.
"""

from kernels.activations import attention_gate, silu_mul
from kernels.attn_prep import attention_gate_view, attn_prep
from kernels.gdn_prep import gather_slots, gdn_prep
from kernels.norms import gated_rmsnorm, residual_rmsnorm, residual_rmsnorm_splitk, rmsnorm_1p

__all__ = [
    "attention_gate",
    "attention_gate_view",
    "attn_prep",
    "gated_rmsnorm",
    "gather_slots",
    "gdn_prep",
    "residual_rmsnorm",
    "residual_rmsnorm_splitk",
    "rmsnorm_1p",
    "silu_mul",
]
