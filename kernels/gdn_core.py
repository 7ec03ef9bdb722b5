"""The GDN core on CUDA: FLA 0.6.0's chunked gated delta rule, through its public function or its forward kernels.

Both return `(o, final_state)` for packed sequences (`[1, T, ...]` with `cu_seqlens` and precomputed
`chunk_indices`) and launch the same FLA kernels in the same order on the same tensors, so their outputs are the
same bits (tests/test_gpu_gdn_core.py):

```
g_cum = chunk_local_cumsum(g, 64) · log2(e)                       fp32   [1, T, Hv]
A     = (I + tril(diag(beta) K Kᵀ ⊙ exp(Δg_cum)))⁻¹ per 64-row chunk    [1, T, Hv, 64] bf16, fused kkt + solve_tril
w, u  = A (beta K ⊙ exp(g_cum)), A (beta V)                               recompute_w_u
h, v' = chunk-to-chunk fp32 recurrence from initial_state                  chunk_gated_delta_rule_fwd_h
o     = scale · (Q h + causal(Q Kᵀ ⊙ decay) v')                            chunk_fwd_o
```

* `fla_chunk_function()`: FLA's `chunk_gated_delta_rule` (the autograd Function, its input guard and checks), with
  the backend-dispatch wrapper peeled off. The `merged` stage calls it, as `hf_fla` does.
* `FlaForwardCore`: the five forward launches above, called directly, without the autograd Function, the input
  guard's per-tensor contiguity pass, or FLA's zero fill of the solve buffer `A` on every call: with a `workspace`
  (`engine.plan.SolveWorkspace`, a plan arena's), each call layout (the arena position of its `chunk_indices`) gets
  one `A`, zeroed at its first use in a forward, and every later layer of the forward reuses it. That is exact
  because the fused kkt + solve kernel writes the same elements on every call of one layout (the chunk's lower 16x16
  blocks of its valid rows) and never the upper blocks, which stay zero and are read as zeros by `recompute_w_u`. The
  buffers are zeroed again at the start of each forward (`begin_forward`), so a refilled arena never reads what
  another request wrote.

Measured effect (kernels per forward, host time, one call's time against FLA's function): engine/stages/fused.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from reference.model import fla_settings
from reference.ops import GDN_CHUNK_SIZE as CHUNK_SIZE  # the fused kkt + solve kernel is FLA's path for exactly 64

SOLVE_BLOCK = 16  # BC: the sub-block of the fused kkt + solve kernel (FLA's fixed choice for chunk 64)


def _check_dispatch_off() -> None:
    settings = fla_settings()
    dispatch_live = not settings["dispatch_disabled"]
    if dispatch_live and (settings["FLA_FLASH_QLA"] != "0" or settings["FLA_INTRACARD_CP"] not in (None, "0")):
        raise RuntimeError(
            f"FLA backend dispatch could pick FlashQLA or intra-card CP ({settings}); set FLA_FLASH_QLA=0 and leave "
            "FLA_INTRACARD_CP unset, or set FLA_DISABLE_BACKEND_DISPATCH=1 before anything imports fla"
        )


def check_varlen_call(owner: str, q, k, v, g, beta, cu_seqlens, initial_state) -> None:
    """A varlen GDN core's inputs: q, k, v, g, beta contiguous [1, T, ...] and one initial state per sequence, or a
    ValueError that names the core (`owner`)."""
    tokens = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.shape[:2] != (1, tokens) or not t.is_contiguous():
            raise ValueError(f"{owner}: {name} must be contiguous [1, {tokens}, ...], got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape[0] != cu_seqlens.shape[0] - 1:
        raise ValueError(f"{owner}: {initial_state.shape[0]} initial states for {cu_seqlens.shape[0] - 1} sequences")


def fla_chunk_function() -> Callable:
    """FLA 0.6.0's Triton `chunk_gated_delta_rule`, with any backend-dispatch wrapper peeled off."""
    _check_dispatch_off()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return inspect.unwrap(chunk_gated_delta_rule)


class FlaForwardCore:
    """FLA's GDN forward kernels launched directly; same signature and bits as `chunk_gated_delta_rule` (varlen).

    Call: `core(q, k, v, g, beta, *, cu_seqlens, chunk_indices, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, scale=None, workspace=None, cu_seqlens_cpu=None, chunk_offsets=None)` (workspace:
    an `engine.plan.SolveWorkspace`; chunk_offsets [N + 1] int64, each sequence's first chunk: pass it from the plan
    arena, because FLA otherwise derives it from `cu_seqlens` through `tensor_cache`, which keys on the tensor object
    and would hand a refilled arena, or a replayed graph, the offsets of the request it first saw);
    q, k [1, T, H, K] bf16, v [1, T, Hv, V] bf16, g fp32 and beta bf16 [1, T, Hv], all contiguous; initial_state
    [N, Hv, K, V] fp32.
    Returns o [1, T, Hv, V] in q's dtype and the final state (fp32) or None.
    """

    def __init__(self):
        _check_dispatch_off()
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum_scalar

        self._l2norm = l2norm_fwd
        self._cumsum = chunk_local_cumsum_scalar  # what chunk_local_cumsum dispatches to for [B, T, H] gates
        self._kkt_solve = chunk_gated_delta_rule_fwd_kkt_solve_kernel
        self._w_u = inspect.unwrap(recompute_w_u_fwd)
        self._h = inspect.unwrap(chunk_gated_delta_rule_fwd_h)
        self._o = inspect.unwrap(chunk_fwd_o)
        self._rcp_ln2 = RCP_LN2

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        scale: float | None = None,
        workspace=None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        chunk_offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, tokens, key_heads, key_dim = k.shape
        value_heads = v.shape[2]
        check_varlen_call("FlaForwardCore", q, k, v, g, beta, cu_seqlens, initial_state)
        if use_qk_l2norm_in_kernel:
            q, k = self._l2norm(q)[0], self._l2norm(k)[0]
        scale = key_dim**-0.5 if scale is None else scale
        g = self._cumsum(
            g, chunk_size=CHUNK_SIZE, scale=self._rcp_ln2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
        )
        solve = self._solve_buffer(workspace, chunk_indices, (1, tokens, value_heads, CHUNK_SIZE), k)
        self._kkt_solve[(chunk_indices.shape[0], value_heads)](
            k=k,
            g=g,
            beta=beta,
            A=solve,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
            T=tokens,
            H=key_heads,
            HV=value_heads,
            K=key_dim,
            BT=CHUNK_SIZE,
            BC=SOLVE_BLOCK,
        )
        w, u = self._w_u(k=k, v=v, beta=beta, A=solve, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        h, v_new, final_state = self._h(
            k=k,
            w=w,
            u=u,
            g=g,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_offsets=chunk_offsets,
            chunk_size=CHUNK_SIZE,
        )
        o = self._o(
            q=q,
            k=k,
            v=v_new,
            h=h,
            g=g,
            scale=scale,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=CHUNK_SIZE,
        )
        return o.to(q.dtype), final_state

    @staticmethod
    def _solve_buffer(workspace, chunk_indices: torch.Tensor, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """The zeroed `A` of this call layout: from the workspace (`engine.plan.SolveWorkspace`: zeroed at its first
        use in a forward), else a new one."""
        if workspace is None:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        return workspace.zeros(chunk_indices, shape, like)
