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

On a `graphs` bucket the core runs the replicated call's hand-off arena (`FlashInferCore.arena`, the plan's
`engine.plan.GdnArena`): one gather of the packed rows into the arena, then two calls. Call 1 runs the shared root to
its last 64-row boundary A0 and stores its fp32 state in a pool row; call 2 runs every candidate from A0, reading that
row (`state_indices`; the others from the zero state), so the root's recurrence runs once, where the replicated call
(every path from position 0) runs it once per candidate: customer_service's bucket holds 77 real chunks on its paths,
the arena 21. The kernel takes the sequence bounds from the device at every launch (`cu_seqlens`, and the sequences of
call 2 start at A0, not 0), so one captured graph serves every request of a bucket; rows of the arena after the last
sequence are neither gathered nor computed. Every sequence starts at a multiple of 64 of its path, so the chunk grid is
the replicated call's: the arena's outputs equal the replicated call's bit for bit exactly when the kernel's state
after a chunk does not depend on whether the chunk ends the sequence (stored) or not (kept in registers), which the GPU
tests check (tests/test_gpu_gdn_flashinfer.py).

Math: the gated delta rule of `reference.ops.gdn_recurrent`, chunked by 64 rows in FlashInfer's own order and
rounding points (bf16 operands, fp32 accumulation and state), which are not FLA's: exactness is bounded, measured
against the fp32 oracle and against FLA by `measure.gdn_chunk_probe --flashinfer` and
tests/test_gpu_gdn_flashinfer.py. On the CPU the library's kernel cannot run: `flashinfer_reference`, its documented
contract computed by the oracle, takes its place (the stage's CPU form; tests/test_gdn_flashinfer.py checks the adapter
and the arena through it against the oracle, the GPU tests check it against the kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.gdn_core import check_varlen_call
from kernels.gdn_prep import gather_slots
from reference import ops

FLASHINFER = "flashinfer-python==0.7.4"


def flashinfer_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    output: torch.Tensor | None = None,
    output_state: torch.Tensor,
    state_indices: torch.Tensor,
    output_state_indices: torch.Tensor,
    use_cp: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's `chunk_gated_delta_rule` as its docstring states it, for the calls this module makes, computed by
    the fp32 oracle `reference.ops.gdn_recurrent` token by token: the core's CPU form (the kernel needs sm_90) and the
    naive reference of the CPU tests. q, k [T, Hk, K], v [T, Hv, V], g the linear decay alpha and beta [T, Hv] fp32;
    sequence i is rows cu_seqlens[i] .. cu_seqlens[i+1] - 1 (the first bound need not be 0: the kernel reads each
    sequence's bounds on the device; a decreasing pair is an empty sequence); it starts from row state_indices[i] of the
    pool initial_state [P, Hv, V, K] fp32 (-1: zeros) and stores its final state in row output_state_indices[i] of
    output_state (-1, or an empty sequence: nothing). Output rows of no sequence keep what `output` held (NaN in a new
    one). Returns (output [T, Hv, V] in v's dtype, output_state). A recurrence token by token hands a state over at any
    row exactly, so on the CPU the arena's outputs equal the replicated call's bit for bit; the kernel's are checked
    against this reference on the GPU (tests/test_gpu_gdn_flashinfer.py)."""
    if (use_cp, backend, use_qk_l2norm_in_kernel, output_final_state) != (False, "flashinfer", False, True):
        raise ValueError("flashinfer_reference: only the calls of FlashInferCore (use_cp=False, backend='flashinfer', "
                         "q and k normalised, states through pools)")  # fmt: skip
    if g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError(f"flashinfer_reference: alpha and beta must be fp32, got {g.dtype}, {beta.dtype}")
    if output is None:
        output = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end <= start:
            continue
        read, write = int(state_indices[i]), int(output_state_indices[i])
        h0 = None if read < 0 else initial_state[read].transpose(-1, -2)  # [Hv, V, K] -> the oracle's [Hv, K, V]
        rows = slice(start, end)
        o, final = ops.gdn_recurrent(q[rows], k[rows], v[rows], g[rows].log(), beta[rows], h0, scale)
        output[rows] = o.to(output.dtype)
        if write >= 0:
            output_state[write] = final.transpose(-1, -2)
    return output, output_state


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

    def __init__(self, function: Callable | None = None, device: torch.device | str = "cuda"):
        """`function`: FlashInfer's call (default: the library's on CUDA, `flashinfer_reference` on the CPU)."""
        if function is None:
            function = flashinfer_reference if torch.device(device).type == "cpu" else flashinfer_gdn_function()
        self._function = function

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

    def arena(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        arena,
        *,
        scale: float | None = None,
        use_qk_l2norm_in_kernel: bool = False,
        **_layout,
    ) -> torch.Tensor:
        """The replicated call through its hand-off arena (module docstring; `arena` an `engine.plan.GdnArena`).
        q, k [N, Hk, 128], v [N, Hv, 128] bf16, g (log decay) fp32 and beta bf16 [N, Hv]: the packed rows, as the prep
        kernel writes them. Returns o [L, Hv, V] bf16 over the arena's slots: packed row n is o[arena.out_slots[n]];
        slots after the last sequence are not written. Three launches: `kernels.gather_slots` (exp(g) and fp32 beta, up
        to the arena's `gathered`: its sequences and the 64 slots after them), the root, the paths."""
        if use_qk_l2norm_in_kernel:
            raise ValueError("FlashInferCore.arena takes q and k L2-normalised (by the prep kernel)")
        num_paths = arena.cu_seqlens.shape[0] - 2
        if arena.states.shape[0] != 2 + 2 * num_paths:
            raise ValueError(
                f"arena: {arena.states.shape[0]} state rows for {num_paths} paths, want {2 + 2 * num_paths}"
            )
        packed = tuple(t[None] for t in (q, k, v, g, beta))
        gathered = (t[0] for t in gather_slots(packed, arena.rows, count=arena.gathered, linear_gates=True))
        return self.arena_calls(*gathered, arena, scale=scale)

    def arena_calls(self, q, k, v, alpha, beta, arena, *, scale: float | None = None) -> torch.Tensor:
        """`arena`'s two kernel calls on inputs already gathered into it (q, k, v [L, H, 128] bf16; alpha = exp(g) and
        beta [L, Hv] fp32): the root into pool row 0, then the paths from it. Returns o [L, Hv, V] bf16."""
        cu, states = arena.cu_seqlens, arena.states
        num_paths = cu.shape[0] - 2
        o = torch.empty_like(v)
        pool = torch.empty((1, v.shape[1], v.shape[2], k.shape[2]), dtype=torch.float32, device=q.device)
        calls = ((cu[:2], states[0:1], states[1:2]), (cu[1:], states[2 : 2 + num_paths], states[2 + num_paths :]))
        for bounds, read, write in calls:
            self._function(q, k, v, alpha, beta, scale=scale, initial_state=pool, output_final_state=True,
                           cu_seqlens=bounds, output=o, output_state=pool, state_indices=read,
                           output_state_indices=write, use_cp=False, backend="flashinfer")  # fmt: skip
        return o
