"""FlashInfer's Hopper GDN prefill kernel as a GDN core with FLA's varlen signature (stage `flashinfer_gdn`).

`flashinfer.gdn_prefill.chunk_gated_delta_rule` (flashinfer-python 0.7.4) runs, on sm_90, one warp-specialised CuTe-DSL
kernel per call: one CTA of 512 threads per (sequence, value head), a load/store warp group with TMA, the state split
over two math warp groups and a third for the chunk's K Kᵀ and its inverse (flashinfer/gdn_kernels/delta_rule_dsl/
delta_rule_sm90.py). That is the control over warps and asynchronous copies that the Triton walk of `kernels.gdn_chunk`
does not have (engine/stages/core.md, "What the done-when asks of the GDN core"). Value head j reads q/k head
j · Hk / Hv, FLA's and this lab's grouping (j // (Hv / Hk)).

The contract differences this adapter bridges (FlashInfer's docstring and the sm_90 launcher):
* q, k, v, o are [T, H, 128] without FLA's batch dim of 1; o comes back as [1, T, Hv, V];
* the decay enters linear, alpha = exp(g) fp32 (FLA: the log decay g), and beta fp32 (the engine's is bf16, exact);
* states are [N, Hv, V, K] fp32, FLA's [N, Hv, K, V] transposed: initial_state goes in transposed, the final state
  comes back in FLA's layout. The states travel as pools with per-sequence rows (`state_indices`,
  `output_state_indices`; -1 reads zeros or stores nothing), so a call that wants no final state stores none: by
  default the sm_90 kernel stores every sequence's [Hv, V, K] fp32 state (drone's bucket, 18 sequences: 57 MB a call);
* `use_cp=False` and `backend="flashinfer"`: never the context-parallel route (it splits a long sequence by the
  batch's shape, so a sequence's bits would depend on what shares its launch) nor cuDNN.

Math: the gated delta rule of `reference.ops.gdn_recurrent`, chunked by 64 rows in FlashInfer's own order and
rounding points (bf16 operands, fp32 accumulation and state), which are not FLA's: exactness is bounded, measured
against the fp32 oracle and against FLA by `measure.gdn_chunk_probe --flashinfer` and
tests/test_gpu_gdn_flashinfer.py. On the CPU the library's kernel cannot run; tests/test_gdn_flashinfer.py checks the
argument mapping against a stand-in that implements the documented contract with the oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.gdn_core import check_varlen_call

FLASHINFER = "flashinfer-python==0.7.4"


def flashinfer_gdn_function() -> Callable:
    """FlashInfer's `chunk_gated_delta_rule`, or a clear error naming the package to install."""
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
    except ImportError as error:
        raise ImportError(
            f"the FlashInfer GDN core needs {FLASHINFER} and CUTLASS's Python DSL (the `gpu` dependency group; on the "
            f"device its wheels travel as engine/stages/flashinfer_gdn.md, 'The campaign', says): {error}"
        ) from error
    return chunk_gated_delta_rule


class FlashInferCore:
    """FlashInfer's GDN prefill with `FlaForwardCore`'s call: `core(q, k, v, g, beta, *, cu_seqlens, initial_state=None,
    output_final_state=False, scale=None, **ignored)`; q, k [1, T, Hk, 128] bf16, v [1, T, Hv, 128] bf16, g fp32 and
    beta [1, T, Hv], initial_state [N, Hv, K, V] fp32. Returns (o [1, T, Hv, V] bf16, final state [N, Hv, K, V] fp32 or
    None). The arguments FLA's core takes for its chunk layout (`chunk_indices`, `chunk_offsets`, `workspace`,
    `cu_seqlens_cpu`) are accepted and not used: FlashInfer's kernel finds its chunks from `cu_seqlens` on the device.
    """

    def __init__(self, function: Callable | None = None):
        self._function = flashinfer_gdn_function() if function is None else function

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        scale: float | None = None,
        **_layout,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_varlen_call("FlashInferCore", q, k, v, g, beta, cu_seqlens, initial_state)
        count, value_heads, key_dim, value_dim = cu_seqlens.shape[0] - 1, v.shape[2], k.shape[3], v.shape[3]
        rows = torch.arange(count, dtype=torch.int32, device=q.device)
        skip = torch.full((count,), -1, dtype=torch.int32, device=q.device)
        if initial_state is None:  # one zero row that no sequence reads (-1: start from zeros)
            pool_in, read = torch.zeros((1, value_heads, value_dim, key_dim), device=q.device), skip
        else:
            pool_in, read = initial_state.float().transpose(-1, -2).contiguous(), rows
        if output_final_state:  # an empty sequence stores nothing: its row keeps its initial state, as in FLA
            pool_out = pool_in.clone() if initial_state is not None else pool_in.new_zeros((count, *pool_in.shape[1:]))
            write = rows
        else:  # -1: no final state stored (the call's default writes [N, Hv, V, K] fp32 that nobody reads)
            pool_out, write = pool_in, skip
        o, _ = self._function(
            q[0],
            k[0],
            v[0],
            g[0].float().exp(),
            beta[0].float(),
            scale=scale,
            initial_state=pool_in,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            output_state=pool_out,
            state_indices=read,
            output_state_indices=write,
            use_cp=False,
            backend="flashinfer",
        )
        return o[None], pool_out.transpose(-1, -2).contiguous() if output_final_state else None
