"""The engine backbone: the Qwen3.5 hybrid over packed rows with merged weights (stages `merged`, `fused`, `tree`).

Plans. `prepare` hands the request to the planner (`engine.planner.Planner.plan`: batches, tree layout, GDN mode,
bucket, arena fill, mask) and the backbone runs the batches it gets: `plan_flat` layouts (candidates back to back, no
padding) for `merged` and `fused`, `plan_tree` (shared prefixes packed once: root | question nodes | leaves) for
`tree`, bucketed tree plans for `graphs`. Every row-wise op (embedding, GEMMs, norms, MLP, gates) runs once per
packed row; what reads other rows (the GDN conv and core, attention) follows the plan's index tensors, so one forward
serves both layouts and the flat plan is exactly the unshared run of the same kernels. Positions are each row's
position in its candidate (RoPE, GDN chunk grid).

Forward, per batch (`N` packed rows; masks and index tensors come with the plan, RoPE tables are computed inside):
```
x = embed[ids]                                         [N, H]
residual, normed = x, rmsnorm_1p(x)                    (input norm of layer 0)
per layer:
    proj = normed @ w_inᵀ                              one merged GEMM, [N, gdn_in_width] or [N, attn_in_width]
    GDN:  conv+SiLU (each row over its own path's previous rows) -> q, k, v; g, beta; GDN core; gated RMSNorm with z;
          out_proj
    attn: q/k RMSNorm, partial RoPE, q/gate split; causal attention over each row's path; sigmoid gate; o_proj
    residual, normed = residual + mixer_out, rmsnorm_1p(.)           (post-attention norm)
    m = silu_mul(normed @ w_gate_upᵀ); d = m @ w_downᵀ
    residual, normed = residual + d, rmsnorm_1p(.)                    (next layer's input norm, or the final norm)
return normed[read rows]                               [C, H]
```

GDN layer over a plan, by the batch's GDN mode (the planner's cost rule, or forced with `gdn_mode`):
* `replicated`: the conv input is every candidate's path (`plan.conv_paths`; identity for a flat plan), the core runs
  once over all paths (one varlen call, the plan's `replicated` schedule), and each packed row takes its
  representative path's output (`plan.row_slot`, read through by the gated norm kernel).
* `handoff`: the conv input is each node after its 3 history rows (`plan.conv_segments`), compacted to the packed
  rows, and `engine.tree.tree_gdn_core` runs the plan's `handoff` schedule (root once, fp32 states handed to the
  branches at 64-row chunk boundaries).
In both modes the `fused` prep kernel convolves each packed row once, from its conv window on its path
(`plan.conv_taps`), which gives the same values; the paths of a `replicated` call then get their rows by one
gather (FLA's core), or read them through `rows` (stage `core`'s).

Stages (element-wise ops). `merged` (`elementwise="torch"`) runs every element-wise op as the reference composition of
`reference/ops.py`, so each op has HF's rounding points; the conv is `reference.ops.causal_conv1d_silu` over the
conv input with W-1 zero rows before each sequence; the GDN gates run on rows zero-padded to a multiple of 32 (torch's
CPU kernels compute the last (n mod vector width) elements of a tensor in a scalar tail that rounds differently, so
without the padding a row's gates would depend on the batch's row count). `fused` (`elementwise="triton"`) runs the
Triton kernels of `kernels/` instead (residual add + RMSNorm, SiLU·mul, GDN input prep, gated RMSNorm, attention prep,
attention gate); each kernel states its exactness against the op it replaces and is batch-invariant by design.

GDN core (the config's `gdn_core`; on the CPU `torch` where the core cannot run there, `EngineConfig.on`):
* `"fla"` (CUDA default of `merged`): FLA 0.6.0 `chunk_gated_delta_rule` over all sequences of a call (`cu_seqlens`,
  chunks restart at each sequence, precomputed `chunk_indices`: no host sync). Backend dispatch is pinned off (checked
  at construction). q/k L2-normalised with FLA's `l2norm_fwd` numerics: inside FLA in `merged`, by the prep kernel in
  `fused`. This is the `hf_fla` numerics.
* `"fla_forward"` (CUDA default of `fused` and `tree`): the same FLA kernels launched directly
  (`kernels.gdn_core.FlaForwardCore`): bitwise equal to `"fla"`, without the autograd wrapper and with one zeroed solve
  buffer per batch forward instead of one per layer (48 fewer fills per forward).
* `"chunk_fused"` (stage `core`): our chunked forward (`kernels.gdn_chunk.GdnChunkCore`: a solve launch and a walk
  per call) in both modes, q/k normalised by the prep kernel; the replicated call walks the plan's tree (`walk`: the
  shared prefix's recurrence once, dummy paths skipped) and reads each path slot at its packed row (`rows`: the prep
  kernel's packed outputs, no `gather_slots` copy to the slots); on the CPU too (the interpreter gets bf16 operands as
  fp32).
* `"flashinfer"` (stage `flashinfer_gdn`): FlashInfer's sm_90 GDN prefill kernel (`kernels.gdn_flashinfer.
  FlashInferCore`). The replicated call runs through the plan's hand-off arena (`GdnArena`: the packed rows gathered
  once, the root to its last 64-row boundary in one call, every candidate from the root's fp32 state in a second); the
  `handoff` schedule calls it with FLA's signature (states through the adapter's pools). On the CPU the library's
  contract computed by the fp32 oracle stands in for the kernel (`flashinfer_reference`).
* `"torch"` (CPU default): HF's torch chunk rule per sequence (`engine.tree.torch_chunk_core`, `hf_torch` numerics;
  q/k normalised inside in fp32). FLA's chunk kernel is wrong for bf16 inputs under the Triton interpreter
  (reference-math.md §6), so the CPU never runs FLA.

Attention (`attention`):
* `"varlen"` (default of `fused` and `tree`): one varlen causal call per layer over the plan's nodes
  (`plan.attention`: a node's rows as queries, its path as keys, which the `fused` prep kernel writes in that key
  layout directly; a flat plan's nodes are the candidates, whose keys are the rows), GQA read natively, no mask.
  CUDA: FlashAttention-2's varlen forward (`engine.tree.flash_node_core`);
  CPU: `engine.tree.blockwise_node_core` (fp32, fixed 64-key blocks). Both are prefix-invariant (a row's result
  depends only on its path up to itself), which is what makes `tree` bitwise against `fused`.
* `"varlen_fa4"` (stage `core`): the same call with FlashAttention-4's varlen forward on CUDA
  (`engine.tree.flash4_node_core`: warpgroup MMA, one split, packed query heads; prefix-invariant on sm_90, measured),
  the blockwise core on the CPU.
* `"paged_fa4"` (stage `paged`): the prep writes k and v once per packed row (no key layout), and FlashAttention-4
  reads each node's path through a page table of one-row pages (`engine.tree.page_keys`, built on the device once per
  forward; `flash4_paged_node_core`); on the CPU the key rows are gathered for the blockwise core.
* `"mask"` (default of `merged`): one `scaled_dot_product_attention` call over all rows of a batch with an additive
  bf16 mask (0 where the plan lets a row see a key, -inf elsewhere; block-diagonal causal for a flat plan; built once by
  the planner, rows 16-byte aligned) and k/v repeated to the query heads, as HF's `repeat_kv` does when it passes a
  mask. Exact in real arithmetic; the kernel tiles keys differently from HF's padded batch, so it can depart from HF by
  a few bf16 ulps on some rows (tests/test_engine.py). Visits all N x N key tiles.

Exactness.
* `merged` vs `hf_torch` on the CPU (tiny twin, tests/test_engine.py): merged GEMMs, packed conv and per-candidate
  torch core are bitwise, so every state before the first attention layer is bit-identical; from the attention on,
  relative RMSE per residual state is bounded there. On the GPU (tests/test_gpu_engine.py) cuBLAS may pick other
  algorithms for the merged widths and row counts than for HF's separate padded GEMMs: measured and bounded.
* `fused` vs `merged`: bounded (kernels: sum-of-squares order, interpreter exp/log1p; attention kernel).
* `tree` vs `fused` (tree off, same kernels): every op but the GEMMs is batch- and prefix-invariant, so a row's bits do
  not depend on which rows share its batch: bitwise wherever the GEMMs are row-count invariant. Measured bitwise on the
  CPU (tiny twin, bf16: tests/test_engine_tree.py). On the H200, cuBLAS's default heuristics pick a split-K kernel for
  the down projection (K = 17408) at 150-199 rows, so a row's bits there depend on the row count; without a cuBLAS
  workspace (the config's `gemm="cublas_row_invariant"`, engine/gemm.py) all six GEMM shapes are row-count invariant
  (tests/test_gpu_gemm_rows.py; the runner's `gemm_rows` probe). The measurements: engine/stages/tree.md.
* Requests batched together (`reference.service.DecisionModel.answer_many`: several requests' candidates in one
  `prepare`, their questions numbered apart): the same invariance makes each request's rows bit-identical to the
  request alone, whatever root, question batches (`split_questions`), GDN mode or bucket the batch gets. Declared by
  `batch_invariant` (varlen attention, and on CUDA row-count-invariant GEMMs; not the masked SDPA, which tiles all N
  keys), measured bitwise on the CPU (tiny twin: `merged` with varlen attention in both layouts, `tree`, `graphs`;
  tests/test_batching.py). `batch_rows` weighs a batch (tree rows, or the bucket's rows on `graphs`), `queue_rows`
  weighs every prefix of a queue in one pass for `DecisionModel.batch_requests`, `batch_max_rows` bounds a batch
  (the grid's largest bucket on `graphs`).

NVTX. With `nvtx_ranges=True`, each layer and each op family (`norm`, `in_proj`, `gdn_prep`, `gdn_core`,
`gated_norm`, `out_proj`, `attn_prep`, `attention`, `attn_gate`, `mlp`, ...) is an NVTX range (the `nvtx` package if
it imports, else `torch.cuda.nvtx` where CUDA is present); with the default `False` a shared no-op context is entered,
nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from engine import gemm
from engine.config import VARLEN_ATTENTION, EngineConfig
from engine.gemm_table import GemmTable
from engine.graphs import GraphCache, capture_forward
from engine.plan import ConvInput, TreePlan
from engine.planner import EngineRows, Planner, RowBatch
from engine.tree import node_core, page_keys, torch_chunk_core, tree_gdn_core
from engine.weights import AttentionLayerWeights, GDNLayerWeights, MergedWeights
from kernels.gdn_chunk import GdnChunkCore
from kernels.gdn_core import FlaForwardCore, fla_chunk_function
from kernels.gdn_flashinfer import FlashInferCore
from reference import ops
from reference.shapes import ModelShapes

GATE_ROW_ALIGN = 32  # merged gates: rows padded so that rows x Hv is a multiple of torch's widest CPU vector (32 bf16)


# ---------------------------------------------------------------------------------------------------------------------
# NVTX ranges


class _Ranges:
    """`ranges(name)` -> an NVTX range context when enabled, else one shared no-op context (no allocation)."""

    def __init__(self, enabled: bool):
        self._off = contextlib.nullcontext()
        self._open: Callable[[str], contextlib.AbstractContextManager] | None = None
        if not enabled:
            return
        try:
            import nvtx

            self._open = lambda name: nvtx.annotate(name, domain="jevlab")
        except ImportError:
            if torch.cuda.is_available():
                self._open = torch.cuda.nvtx.range

    def __call__(self, name: str) -> contextlib.AbstractContextManager:
        return self._off if self._open is None else self._open(name)


# ---------------------------------------------------------------------------------------------------------------------
# Element-wise stages: reference compositions (merged) and kernels (fused), one interface
#
#   residual_rmsnorm(residual [N, H], delta [N, H] | None, weight [H]) -> (new residual, normed) [N, H]
#   residual_rmsnorm_splitk(residual [N, H], partials [S, N, H] fp32, weight [H]) -> the same, the delta reduced from
#       split-K partials (fp32 sum in split order, one rounding; engine/gemm.py)
#   silu_mul(gate_up [N, 2I]) -> [N, I]
#   gdn_prep(proj [N, gdn_in_width], layer, conv: ConvInput, taps [N, W], row_slot [N] | None, on_slots=True)
#       -> q, k [n, Hk, K], v [n, Hv, V] bf16; g fp32, beta bf16 [n, Hv], for the conv input's kept rows
#       (n = len(conv.keep)); q/k L2-normalised (FLA numerics) iff `qk_normalised`; taps: the plan's `conv_taps`
#       (each packed row's window on its path: how the kernels prepare each packed row once); row_slot (a tree's
#       paths): each packed row's slot; with on_slots=False the N packed rows themselves (a core that reads the
#       paths through conv.rows)
#   gated_rmsnorm(o [N, Hv, V] contiguous, z [N, Hv V], weight [V], o_rows [N] | None) -> [N, Hv V]; with o_rows,
#       o is [L, Hv, V] and row r is normalised from o's row o_rows[r] (a tree's packed rows from their paths)
#   attn_prep(proj [N, attn_in_width], layer, cos, sin [N, r], key_rows [K] | None, heads_first)
#       -> q, k, v (q/k normed and roped), gate (whatever attention_gate takes); rows first: q [N, Hq, D], k, v
#       [K, Hkv, D] at key_rows (or [N, Hkv, D] when None); heads first (the masked SDPA; key_rows unused):
#       q [Hq, N, D], k, v [Hkv, N, D]
#   attention_gate(attn [N, Hq, D], gate) -> [N, Hq D]


class _ReferenceOps:
    """The `merged` stage: `reference/ops.py` compositions, HF's rounding points."""

    qk_normalised = False  # q/k leave gdn_prep raw; the GDN core normalises them (FLA in-kernel, or torch in fp32)

    def __init__(self, shapes: ModelShapes):
        self.shapes = shapes

    def residual_rmsnorm(self, residual: Tensor, delta: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        return ops.residual_rmsnorm(residual, delta, weight, self.shapes.rms_norm_eps)

    def residual_rmsnorm_splitk(self, residual: Tensor, partials: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return ops.residual_rmsnorm_splitk(residual, partials, weight, self.shapes.rms_norm_eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return ops.silu_mul(gate, up)

    def gdn_prep(
        self,
        proj: Tensor,
        layer: GDNLayerWeights,
        conv: ConvInput,
        taps: Tensor,
        row_slot: Tensor | None = None,
        on_slots: bool = True,
    ):
        """Conv + SiLU over the conv input with W-1 zero rows before each sequence (zero history), split, gates.
        `taps` is the Triton ops' way to the same values (each packed row once, not read here); the torch ops
        convolve every slot (and with on_slots=False return each packed row's slot)."""
        s = self.shapes
        hv = s.linear_num_value_heads
        qkv, _, b, a = proj.split([s.conv_dim, s.linear_value_dim, hv, hv], -1)
        spaced = F.pad(qkv, (0, 0, 1, 0)).index_select(0, conv.spaced)  # [M + (W-1) S, conv_dim]
        x = ops.causal_conv1d_silu(spaced, layer.conv_weight).index_select(0, conv.spaced_keep)  # [n, conv_dim]
        q, k, v = x.split([s.linear_key_dim, s.linear_key_dim, s.linear_value_dim], -1)
        g, beta = _row_invariant_gates(a, b, layer.A_log, layer.dt_bias)  # [N, Hv]
        if not conv.keep_rows_are_packed:
            g, beta = g.index_select(0, conv.keep_rows), beta.index_select(0, conv.keep_rows)
        n = x.shape[0]
        q = q.reshape(n, s.linear_num_key_heads, s.linear_key_head_dim)
        k = k.reshape(n, s.linear_num_key_heads, s.linear_key_head_dim)
        out = q, k, v.reshape(n, hv, s.linear_value_head_dim), g, beta
        return out if row_slot is None or on_slots else tuple(t.index_select(0, row_slot) for t in out)

    def gated_rmsnorm(self, o: Tensor, z: Tensor, weight: Tensor, o_rows: Tensor | None) -> Tensor:
        o = o if o_rows is None else o.index_select(0, o_rows)
        return ops.gated_rmsnorm(o, z.view(o.shape), weight, self.shapes.rms_norm_eps).flatten(1)

    def attn_prep(self, proj, layer: AttentionLayerWeights, cos, sin, key_rows: Tensor | None, heads_first: bool):
        s = self.shapes
        t, hq, hkv, d = proj.shape[0], s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q_gate, k, v = proj.split([2 * hq * d, hkv * d, hkv * d], -1)
        query, gate = q_gate.view(t, hq, 2 * d).chunk(2, dim=-1)
        q = ops.apply_partial_rope(ops.rmsnorm_1p(query, layer.q_norm, s.rms_norm_eps), cos, sin)
        k = ops.apply_partial_rope(ops.rmsnorm_1p(k.view(t, hkv, d), layer.k_norm, s.rms_norm_eps), cos, sin)
        v = v.view(t, hkv, d)
        if heads_first:
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        elif key_rows is not None:
            k, v = k.index_select(0, key_rows), v.index_select(0, key_rows)
        return q, k, v, gate.reshape(t, hq * d)

    def attention_gate(self, attn: Tensor, gate: Tensor) -> Tensor:
        return ops.attention_gate(attn.reshape(gate.shape), gate)


def _row_invariant_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """`reference.ops.gdn_gates` on rows zero-padded to a multiple of GATE_ROW_ALIGN, then cut back.

    torch's CPU kernels for softplus, exp and sigmoid compute the last (numel mod vector width) elements of a tensor
    in a scalar tail that can round differently from the vector body; padding puts every real element in the body,
    so a row's gates do not depend on the number of rows (the tree computes fewer rows than the flat layout). CUDA has
    no such tail; the padding then only costs a few rows.
    """
    pad = -a.shape[0] % GATE_ROW_ALIGN
    g, beta = ops.gdn_gates(F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad)), A_log, dt_bias)
    return g[: a.shape[0]], beta[: a.shape[0]]


class _FusedOps:
    """The `fused` stage: the Triton kernels of `kernels/` (exactness per kernel in `kernels/__init__.py`)."""

    def __init__(self, shapes: ModelShapes, gdn_core: str):
        self.shapes = shapes
        # FLA takes q/k normalised by the prep kernel (its l2norm numerics); the torch core normalises in fp32 itself.
        self.qk_normalised = gdn_core != "torch"

    def residual_rmsnorm(self, residual: Tensor, delta: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        return kernels.residual_rmsnorm(residual, delta, weight, self.shapes.rms_norm_eps)

    def residual_rmsnorm_splitk(self, residual: Tensor, partials: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return kernels.residual_rmsnorm_splitk(residual, partials, weight, self.shapes.rms_norm_eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return kernels.silu_mul(gate_up)

    def gdn_prep(
        self,
        proj: Tensor,
        layer: GDNLayerWeights,
        conv: ConvInput,
        taps: Tensor,
        row_slot: Tensor | None = None,
        on_slots: bool = True,
    ):
        """The prep kernel over each packed row's conv window (`taps`, the plan's `conv_taps`; kernels/gdn_prep.py v5):
        the N packed rows once, with no search for a row's sequence. Those are the conv input's kept rows where its
        outputs are the packed rows in order (the hand-off's node segments, a flat plan's paths); a tree's paths
        (`row_slot`) get them by one gather to every slot that holds the row (`on_slots`), or take the packed rows
        (on_slots=False, for a core that reads the paths through conv.rows)."""
        if row_slot is None and not conv.keep_rows_are_packed:
            raise ValueError("gdn_prep: this conv input's outputs are not the packed rows; pass the tree's row_slot")
        s = self.shapes
        out = kernels.gdn_prep(
            proj,
            layer.conv_weight,
            layer.A_log,
            layer.dt_bias,
            None,
            num_k_heads=s.linear_num_key_heads,
            num_v_heads=s.linear_num_value_heads,
            head_k_dim=s.linear_key_head_dim,
            head_v_dim=s.linear_value_head_dim,
            qk_l2norm=self.qk_normalised,
            taps=taps,  # [N, W] the proj rows of each packed row's window
        )
        if row_slot is not None and on_slots:
            return tuple(t[0] for t in kernels.gather_slots(out, conv.rows))  # to every slot holding the row
        return tuple(t[0] for t in out)

    def gated_rmsnorm(self, o: Tensor, z: Tensor, weight: Tensor, o_rows: Tensor | None) -> Tensor:
        return kernels.gated_rmsnorm(o, z, weight, self.shapes.rms_norm_eps, o_rows=o_rows)

    def attn_prep(self, proj, layer: AttentionLayerWeights, cos, sin, key_rows: Tensor | None, heads_first: bool):
        """One prep launch; with key rows (a tree's node paths) k and v are prepared straight in the key layout."""
        s = self.shapes
        dims = dict(num_heads=s.num_attention_heads, head_dim=s.head_dim, num_kv_heads=s.num_key_value_heads)
        layout = "htd" if heads_first else "thd"
        key_rows = None if heads_first else key_rows
        q, k, v = kernels.attn_prep(
            proj, layer.q_norm, layer.k_norm, cos, sin, s.rms_norm_eps, layout=layout, key_rows=key_rows, **dims
        )
        return q, k, v, kernels.attention_gate_view(proj, num_heads=dims["num_heads"], head_dim=dims["head_dim"])

    def attention_gate(self, attn: Tensor, gate: Tensor) -> Tensor:
        return kernels.attention_gate(attn, gate)


# ---------------------------------------------------------------------------------------------------------------------
# The backbone


class EngineBackbone:
    """A `Backbone` over packed rows with merged weights, running what its `EngineConfig` says (`engine/config.py`).

    The config's `elementwise` picks the ops (`torch`: the reference compositions of `merged`; `triton`: the kernels),
    `layout` the row plan (`flat` or `tree`), `attention` the core (`mask` or `varlen`), `gdn_core` and `gdn_mode`
    the GDN path and `gemm` the GEMM op (engine/gemm.py); `max_batch_rows` bounds a batch. The config must be in its
    device form (`EngineConfig.on`): a FLA core on the CPU is refused here, and so is a GEMM choice the process
    cannot honour (`engine.gemm.check_process`). Stages are built through `engine.stages.build_backbone`.
    """

    def __init__(
        self,
        merged: MergedWeights,
        config: EngineConfig,
        *,
        nvtx_ranges: bool = False,
        gemm_table: GemmTable | str | Path | None = None,
        name: str = "engine",
    ):
        if config.backbone != "engine":
            raise ValueError(f"EngineBackbone runs backbone='engine' configs, got {config.backbone!r}")
        self.weights = merged
        self.shapes = merged.shapes
        self.device = merged.device
        self.config = config
        if config.gdn_core in ("fla", "fla_forward") and self.device.type == "cpu":
            raise ValueError(
                f"gdn_core={config.gdn_core!r} cannot run bf16 on the CPU: the Triton interpreter computes bf16 tl.dot "
                "wrongly (reference-math.md §6); use the config's CPU form (EngineConfig.on('cpu'))"
            )
        formats = merged.gemm_formats()
        if formats != {config.weight_format}:
            raise ValueError(f"the weights hold {sorted(formats)} GEMM weights; the config says {config.weight_format}")
        gemm.check_process(config, self.device)
        # `gemm="tuned"`: the table's kernels (`gemm_table`: a table, a path, or None for the default location; a table
        # that cannot be used here is one warning and cuBLAS); any other choice: F.linear everywhere
        by_shape = gemm.gemm_weights_by_shape(merged.layers)
        self._gemm = gemm.build_dispatch(config, self.device, by_shape, gemm_table)
        self.tree = config.layout == "tree"
        self.attention = config.attention
        self.gdn_mode = None if config.gdn_mode == "cost" else config.gdn_mode
        self.gdn_core = config.gdn_core
        self.max_batch_rows = config.max_batch_rows
        self.name = name  # the registry's name of the config (`engine.stages.stage_name`)
        self._core = {
            "fla": fla_chunk_function,
            "fla_forward": FlaForwardCore,
            "chunk_fused": GdnChunkCore,
            "flashinfer": lambda: FlashInferCore(device=self.device),
            "torch": lambda: torch_chunk_core,
        }[self.gdn_core]()
        fused = config.elementwise == "triton"
        self._ops = _FusedOps(self.shapes, self.gdn_core) if fused else _ReferenceOps(self.shapes)
        self._node_core = node_core(config.attention, self.device) if config.attention in VARLEN_ATTENTION else None
        self._range = _Ranges(nvtx_ranges)
        # RoPE inverse frequencies on the device once: the tables are computed inside the forward (capturable)
        self._inv_freq = ops.rope_inv_freq(self.shapes.rotary_dim, self.shapes.rope_theta).to(self.device)
        self.planner = Planner(config, self.device, self.shapes.vocab_size)  # every decision about a request's rows
        self.grid = self.planner.grid  # `graphs`: the buckets the planner pads batches to, on any device
        self.batch_max_rows = self.planner.batch_max_rows  # rows of one batched forward (`batch_rows`)
        self.graphs = None  # engine.graphs.GraphCache on CUDA with `graphs`
        if config.graphs and self.device.type == "cuda":
            self.graphs = GraphCache(self._forward_plan, self.device, self.grid)
        # Batching of requests (reference.service.DecisionModel.answer_many): a row's bits must not depend on the rows
        # beside it. Varlen attention and every other op are row- and prefix-invariant; the GEMMs are row-count
        # invariant on the CPU and, on CUDA, only without a cuBLAS workspace. The masked SDPA (`merged`) is not
        # claimed (its kernel tiles all N keys). Tested on the CPU: tests/test_batching.py.
        self.batch_invariant = config.attention in VARLEN_ATTENTION and (
            self.device.type == "cpu" or gemm.needs_row_invariant(config)
        )

    def gemm_weight_bytes(self) -> int:
        """Bytes of every GEMM weight (the weight-streaming floor's numerator)."""
        return self.weights.gemm_weight_bytes()

    def gemm_table(self) -> dict | None:
        """The tuned GEMM choices this backbone runs (`gemm="tuned"`: the table's source, commit, GPU and kernel per
        shape and bucket, `engine.gemm.GemmDispatch.describe`), for the run record; None for the other choices."""
        return self._gemm.describe() if self.config.gemm == "tuned" else None

    # -- Backbone protocol ---------------------------------------------------------------------------------------------

    def prepare(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> EngineRows:
        """The request's batches, planned once (`engine.planner.Planner.plan`: batches, layout, GDN mode, bucket,
        arena fill, mask)."""
        return self.planner.plan(candidates, groups)

    def _forward_plan(self, plan: TreePlan) -> Tensor:
        """The eager forward of one bucketed plan: what `engine.graphs.GraphCache` captures. [bucket candidates, H]."""
        return self._forward_batch(RowBatch(plan, tuple(range(plan.num_candidates)), "replicated", None), None)

    def _run_batch(self, batch: RowBatch) -> Tensor:
        """One batch's [C_batch, hidden]: replayed from its bucket's graph where one is captured, else eager (a
        bucketed plan, built on the host, moved to the device first: `TreePlan.to`)."""
        if self.graphs is not None:
            entry = None
            if batch.eager_reason is not None:
                self.graphs.count_miss(batch.eager_reason)
            else:
                entry = self.graphs.lookup(batch.plan)
            batch.graph_hit = entry is not None
            if entry is not None:
                return entry.run(batch.plan, self.graphs.staging)
        return self._forward_batch(self._on_device(batch), None)[: batch.plan.num_candidates]

    def _on_device(self, batch: RowBatch) -> RowBatch:
        """The batch with its plan on the backbone's device (a bucketed plan is built on the host: `TreePlan.to`)."""
        if batch.plan.device == self.device:
            return batch
        return dataclasses.replace(batch, plan=batch.plan.to(self.device))

    def warm_up(self, progress=None, buckets=None) -> dict:
        """`graphs` on CUDA: compile the eager paths (`EAGER_WARM_REQUESTS`: hand-off with one and with several
        questions, more candidates than any bucket holds, more rows than the largest bucket; each at two lengths of
        opposite 16-alignment, since Triton specializes integer arguments on it), then capture every bucket of the
        grid, or only `buckets` (a progress bar through `progress`, e.g. tqdm). Returns the cache's description
        (graphs, capture seconds, pool bytes, `eager_warm_s`) and `fla_configs`: whether FLA's configs were pinned
        (`engine.fla_configs`, set before fla was imported) and how many of the FLA autotune keys the warm-up reached
        were not loaded from the pinned files (`autotuned_keys`, listed in `autotuned`; 0 when the pinned set covers
        the start); also kept as `self.fla_configs` for the server's `/health`. Does nothing elsewhere (returns {})."""
        if self.graphs is None:
            return {}
        start = time.perf_counter()
        for candidates, groups in eager_warm_requests():
            self.forward(self.prepare(candidates, groups))
        torch.cuda.synchronize(self.device)
        eager_s = time.perf_counter() - start
        self.graphs.stats.misses.clear()  # the warm-up's eager batches are not requests
        self.graphs.capture_grid(progress, buckets)
        from engine.fla_configs import autotune_report  # imports no fla of its own: it reports what was imported

        self.fla_configs = autotune_report()
        return {**self.graphs.describe(), "eager_warm_s": round(eager_s, 3), "fla_configs": self.fla_configs}

    def exact_graph(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> Callable[[], Tensor] | None:
        """The yardstick of the `graphs` targets: the request's own unpadded tree plan captured as one CUDA graph
        (no bucket, no padding); returns a function that replays it and returns its [C, hidden] output (static:
        overwritten by the next replay). None when the request takes several batches or the device is not CUDA."""
        batch = self.planner.exact_batch(candidates, groups) if self.device.type == "cuda" else None
        if batch is None:
            return None
        graph, output = capture_forward(lambda: self._forward_batch(batch, None), batch.plan.arena, self.device)

        def replay(plan=batch.plan) -> Tensor:  # holds the plan: the graph reads its arena (freed memory is reused)
            graph.replay()
            return output

        return replay

    def graph_metadata(self, prepared: EngineRows) -> dict | None:
        """The response's `metadata.graph` (`graphs` only): each batch's bucket and whether a graph served it."""
        if not self.config.graphs:
            return None
        buckets = [None if b.plan.bucket is None else b.plan.bucket.name for b in prepared.batches]
        hits = [bool(b.graph_hit) for b in prepared.batches]
        return {
            "bucket": buckets[0] if len(buckets) == 1 else buckets,
            "hit": all(hits),
            "eager_reasons": [b.eager_reason for b in prepared.batches if b.eager_reason],
        }

    @torch.no_grad()
    def forward(self, prepared: EngineRows) -> Tensor:
        """[C, hidden] bf16: the final-norm output at each candidate's last token, in candidate order."""
        outs = [self._run_batch(batch) for batch in prepared.batches]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if prepared.order is None else out.index_select(0, prepared.order)

    @torch.no_grad()
    def hidden_states(self, prepared: EngineRows) -> list[Tensor]:
        """num_layers + 2 entries [total real tokens, hidden] bf16: embedding, each layer output, final-norm output;
        each candidate's tokens (its path's rows) concatenated in candidate order."""
        pieces: dict[int, list[Tensor]] = {}  # candidate -> its rows of every state
        for batch in prepared.batches:
            states: list[Tensor] = []
            batch = self._on_device(batch)
            self._forward_batch(batch, states)
            plan = batch.plan
            bounds = plan.path_cu_seqlens_cpu.tolist()
            paths = [state.index_select(0, plan.path_rows) for state in states]  # each [L, hidden]
            for j, c in enumerate(batch.candidates):
                pieces[c] = [p[bounds[j] : bounds[j + 1]] for p in paths]
        return [torch.cat(parts) for parts in zip(*(pieces[c] for c in range(prepared.num_candidates)))]

    # -- what the ablation runner and the service read -----------------------------------------------------------------

    def rows_computed(self, prepared: EngineRows) -> int:
        """Packed rows of all batches (the rows the GEMMs run over)."""
        return prepared.rows_computed

    def batch_rows(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> int | None:
        """The rows one forward over these candidates computes (`engine.planner.Planner.batch_rows`)."""
        return self.planner.batch_rows(candidates, groups)

    def queue_rows(
        self, requests: Iterable[tuple[Sequence[Sequence[int]], Sequence[int]]]
    ) -> Iterator[tuple[int | None, int | None]]:
        """Each queued request's `batch_rows` alone and with the queue before it (`Planner.queue_rows`)."""
        return self.planner.queue_rows(requests)

    def prefix_cache_metadata(self, prepared: EngineRows) -> dict:
        """The response's `metadata.prefix_cache`: Open-Jev's key names where they apply (contract §7).
        `processed_input_tokens` are the token rows computed (each shared token once), `reused_input_tokens` the
        logical tokens not computed again (never negative); `padding_rows`, this engine's own key, the dummy rows a
        bucket added (computed, but no input token)."""
        if not self.tree:
            return {"enabled": False, "mode": "independent_candidates"}
        plans = [b.plan for b in prepared.batches]
        return {
            "enabled": True,
            "mode": "prefix_tree",
            "logical_input_tokens": prepared.logical_tokens,
            "processed_input_tokens": prepared.token_rows,
            "reused_input_tokens": prepared.logical_tokens - prepared.token_rows,
            "padding_rows": prepared.rows_computed - prepared.token_rows,
            "shared_prefix_tokens": sum(p.root_len for p in plans),
            "question_prefix_tokens": sum(sum(p.question_lens) for p in plans),
            "candidate_sequences": prepared.num_candidates,
            "batches": len(plans),
            "gdn_modes": [b.gdn_mode for b in prepared.batches],
            "gdn_core_tokens": sum(b.plan.gdn[b.gdn_mode].num_tokens for b in prepared.batches),
            "recurrent_state_dtype": "float32",
        }

    # -- forward -------------------------------------------------------------------------------------------------------

    def _forward_batch(self, batch: RowBatch, states: list[Tensor] | None) -> Tensor:
        """One batch's forward; appends every residual state to `states` when given. Returns the head's rows
        [len(read_rows), hidden] (a bucketed plan reads its bucket's count: the real candidates come first)."""
        w, ops_, rng, gemm_ = self.weights, self._ops, self._range, self._gemm
        # FlaForwardCore: one zeroed solve buffer per GDN call layout of this batch, shared by its 48 GDN layers
        core_options = {"use_qk_l2norm_in_kernel": not ops_.qk_normalised}
        if self.gdn_core == "fla_forward":
            batch.plan.arena.workspace.begin_forward()
            core_options["workspace"] = batch.plan.arena.workspace
        with rng("rope"):
            rope = ops.rope_cos_sin(
                batch.plan.positions, self.shapes.rotary_dim, self.shapes.rope_theta, inv_freq=self._inv_freq
            )
        if self.attention == "paged_fa4":
            with rng("page_keys"):
                keys = page_keys(batch.plan.attention)  # the attention layers' page table, once per forward
        else:
            keys = batch.plan.attention
        with rng("embedding"):
            x = F.embedding(batch.plan.token_ids, w.embed)  # [N, H]
        with rng("norm"):
            residual, normed = ops_.residual_rmsnorm(x, None, w.layers[0].input_norm)
        if states is not None:
            states.append(x)
        for i, layer in enumerate(w.layers):
            gdn = isinstance(layer, GDNLayerWeights)
            with rng(f"layer {i:02d} {'gdn' if gdn else 'attn'}"):
                with rng("in_proj"):
                    proj = gemm_.linear(normed, layer.w_in, "gdn_in" if gdn else "attn_in")  # [N, in width]
                mixed = (
                    self._gdn(proj, layer, batch, core_options)
                    if gdn
                    else self._attention(proj, layer, batch, rope, keys)
                )  # the out projection: [N, H] bf16, or split-K's [S, N, H] fp32 partials
                with rng("norm"):
                    residual, normed = gemm_.residual_rmsnorm(ops_, residual, mixed, layer.post_norm)
                with rng("mlp"):
                    act = ops_.silu_mul(gemm_.linear(normed, layer.w_gate_up, "gate_up"))  # [N, I]
                    down = gemm_.project(act, layer.w_down, "down")  # [N, H] bf16, or split-K's [S, N, H] fp32
                next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
                with rng("norm"):
                    residual, normed = gemm_.residual_rmsnorm(ops_, residual, down, next_norm)
            if states is not None:
                states.append(residual)
        if states is not None:
            states.append(normed)
        return normed.index_select(0, batch.plan.read_rows)  # [C_batch, H]

    def _gdn(self, proj: Tensor, layer: GDNLayerWeights, batch: RowBatch, core_options: dict) -> Tensor:
        s, plan, rng = self.shapes, batch.plan, self._range
        row_slot = None if plan.kind == "flat" else plan.row_slot  # flat: each row is its own slot
        if batch.gdn_mode == "replicated" and self.gdn_core == "flashinfer":
            with rng("gdn_prep"):  # the packed rows, which the core gathers into its arena
                q, k, v, g, beta = self._ops.gdn_prep(
                    proj, layer, plan.conv_paths, plan.conv_taps, row_slot, on_slots=False
                )
            with rng("gdn_core"):
                arena = plan.gdn["replicated"].calls[0].arena  # the root once, then every candidate from its state
                o, o_rows = self._core.arena(q, k, v, g, beta, arena, **core_options), arena.out_slots
        elif batch.gdn_mode == "replicated":
            # our chunk core reads each path slot at its packed row (conv.rows); FLA's needs the rows on the slots
            slot_rows = plan.conv_paths.rows if row_slot is not None and self.gdn_core == "chunk_fused" else None
            with rng("gdn_prep"):  # the paths' rows [L, ...], or the packed rows [N, ...] for our core to read
                on_slots = slot_rows is None
                q, k, v, g, beta = self._ops.gdn_prep(
                    proj, layer, plan.conv_paths, plan.conv_taps, row_slot, on_slots=on_slots
                )
            with rng("gdn_core"):
                call = plan.gdn["replicated"].calls[0]  # all paths, from position 0
                o, _ = self._core(
                    q[None],
                    k[None],
                    v[None],
                    g[None],
                    beta[None],
                    cu_seqlens=call.cu_seqlens,
                    cu_seqlens_cpu=call.cu_seqlens_cpu,
                    chunk_indices=call.chunk_indices,
                    **({} if self.gdn_core == "fla" else {"chunk_offsets": call.chunk_offsets}),
                    **({"walk": call.walk, "rows": slot_rows} if self.gdn_core == "chunk_fused" else {}),
                    **core_options,
                )
                o = o[0]  # [L, Hv, V] over the paths; each packed row reads its representative path's row
                o_rows = row_slot
        else:
            o_rows = None
            with rng("gdn_prep"):
                q, k, v, g, beta = self._ops.gdn_prep(proj, layer, plan.conv_segments, plan.conv_taps)  # [N, ...]
            with rng("gdn_core"):
                offsets = self.gdn_core != "fla"  # the direct core takes the arena's chunk offsets
                o = tree_gdn_core(
                    q, k, v, g, beta, plan, mode="handoff", core=self._core, chunk_offsets=offsets, **core_options
                )
        with rng("gated_norm"):
            z = proj[:, s.conv_dim : s.conv_dim + s.linear_value_dim]
            y = self._ops.gated_rmsnorm(o, z, layer.out_norm, o_rows)  # [N, Hv V]
        with rng("out_proj"):
            return self._gemm.project(y, layer.w_out, "out")  # [N, H] bf16, or split-K's [S, N, H] fp32

    def _attention(self, proj: Tensor, layer: AttentionLayerWeights, batch: RowBatch, rope, keys) -> Tensor:
        """`keys`: the plan's `NodeAttention`, or its `PagedKeys` for `paged_fa4` (k and v then stay at the rows)."""
        rng, scale, nodes = self._range, self.shapes.head_dim**-0.5, batch.plan.attention
        varlen = self.attention in VARLEN_ATTENTION
        at_rows = not varlen or nodes.keys_are_rows or self.attention == "paged_fa4"
        with rng("attn_prep"):
            q, k, v, gate = self._ops.attn_prep(
                proj, layer, rope[0], rope[1], None if at_rows else nodes.key_rows, not varlen
            )
        with rng("attention"):
            if varlen:
                attn = self._node_core(q, k, v, keys, scale)  # [N, Hq, D]
            else:
                attn = _masked_sdpa(q, k, v, batch.attn_mask, scale)
        with rng("attn_gate"):
            y = self._ops.attention_gate(attn, gate)  # [N, Hq D]
        with rng("out_proj"):
            return self._gemm.project(y, layer.w_out, "out")  # [N, H] bf16, or split-K's [S, N, H] fp32


def eager_warm_requests() -> list[tuple[list[list[int]], list[int]]]:
    """Requests that take the eager paths of `graphs` (module docstring of engine/graphs.py), for `warm_up`: token
    ids from a fixed generator, at two lengths each (one 16-aligned, one not)."""
    rng = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 150_000, (n,), generator=rng).tolist()

    requests = []
    for extra in (0, 7):
        context = tokens(4096 + extra)  # one question over a long context: hand-off, two calls
        requests.append(([context + tokens(3) + [o + 1] for o in range(5)], [0] * 5))
        context = tokens(2048 + extra)  # several questions over a long context: hand-off, three calls
        question = [tokens(70) for _ in range(3)]
        requests.append(
            ([context + question[q] + [o + 1] for q in range(3) for o in range(3)], [0, 0, 0, 1, 1, 1, 2, 2, 2])
        )
        context = tokens(96 + extra)  # more candidates than any bucket: replicated, eager
        requests.append(([context + [o + 1, o + 2] for o in range(40)], [0] * 40))
        requests.append(([tokens(1600 + extra)], [0]))  # more rows than the largest bucket
    return requests


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention with an additive mask: q [Hq, N, D], k, v [Hkv, N, D] -> [N, Hq, D] bf16 (a strided view).

    k/v heads repeated to the query heads (head h reads kv head h // (Hq/Hkv)), one SDPA call with the mask
    [1, 1, N, N].
    """
    rep = q.shape[0] // k.shape[0]
    out = F.scaled_dot_product_attention(
        q[None],  # [1, Hq, N, D]
        k.repeat_interleave(rep, dim=0)[None],
        v.repeat_interleave(rep, dim=0)[None],
        attn_mask=mask,
        scale=scale,
    )
    return out[0].transpose(0, 1)
