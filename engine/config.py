"""The engine config: one frozen value that decides what a backbone runs (nano-vllm's `Config` is the model).

A registry stage (`engine/stages`) is a delta of its parent's config; `engine.stages.build_backbone` turns a stage
name (or a config) into a backbone for the runner, the server, the JevBench runner and the tests alike. Every field
is one choice; `FIELD_VALUES` lists what each may be and `describe_value` what each value means, so the registry's
"switches" text and the README's stage table are derived from the deltas, not written twice.

Fields (values; what each picks):
* `backbone` (`hf`, `engine`): transformers' `Qwen3_5TextModel` over padded per-candidate batches, or our backbone
  over packed rows with merged GEMM weights (`engine/backbone.py`).
* `layout` (`padded`, `flat`, `tree`): HF's padded batches; candidates back to back; the two-level prefix tree
  (`engine/plan.py`).
* `elementwise` (`torch`, `triton`): element-wise ops as torch compositions at HF's rounding points
  (`reference/ops.py`), or the fused Triton kernels of `kernels/`.
* `attention` (`sdpa_padded`, `mask`, `varlen`, `varlen_fa4`, `paged_fa4`): HF's SDPA per padded batch; one SDPA call
  with an additive mask over the packed rows; one varlen causal call over the plan's nodes with FlashAttention-2
  (torch's build) or FlashAttention-4 (`flash-attn-4`, the `gpu` dependency group) on CUDA over keys laid out per
  node, or FlashAttention-4 reading each node's path from the packed rows through a page table of one-row pages (k and
  v prepared once per row); blockwise fp32 on the CPU for all three (`engine.tree.node_core`).
* `gdn_core` (`torch`, `fla`, `fla_forward`, `chunk_fused`, `flashinfer`): HF's torch chunk rule; FLA 0.6.0's
  `chunk_gated_delta_rule`; the same FLA kernels launched directly (`kernels/gdn_core.py`); our chunked
  gated-delta-rule forward, a solve launch and a walk per call (`kernels/gdn_chunk.py`; needs q/k normalised by the
  Triton prep kernel, so `elementwise="triton"`); FlashInfer's sm_90 GDN prefill kernel, the replicated call through the
  plan's hand-off arena (the root once, every candidate from its state; `kernels/gdn_flashinfer.py`, flashinfer-python
  in the `gpu` dependency group; on the CPU its contract computed by the fp32 oracle).
* `gdn_mode` (`cost`, `replicated`, `handoff`): how a tree's GDN layers run: chosen per batch by the cost rule, or
  forced.
* `gemm` (`cublas`, `cublas_row_invariant`, `tuned`): `F.linear` with cuBLAS's default workspace; without a workspace
  (no split-K: a row's bits do not depend on the row count); or the kernel a GEMM tuning table picks per shape and row
  bucket (`engine/gemm_table.py`), in the same workspace-free process (its `cublas` choices and its fallback);
  `engine/gemm.py`.
* `graphs` (`False`, `True`): eager launches, or each batch padded to a bucket of the grid and replayed as one CUDA
  graph captured for that bucket (`engine/graphs.py`; on the CPU the padded plans run eagerly; needs the `tree` layout,
  the Triton element-wise kernels, varlen attention and the direct FLA core, whose launches read only the plan's
  shape).
* `weight_format` (`bf16`): GEMM weight storage (`engine.weights.Weight`; FP8 later).
* `max_batch_rows` (int >= 1): rows one forward may hold; larger requests run as several batches.

Device rule (`EngineConfig.on`): the CPU runs no FLA (the Triton interpreter computes bf16 `tl.dot` wrongly,
reference-math.md §6), so an engine config's FLA core becomes `torch` there (`chunk_fused` stays: it hands the
interpreter its bf16 operands as fp32; `flashinfer` stays, its sm_90 kernel replaced by the library's contract computed
by the fp32 oracle, `kernels.gdn_flashinfer.flashinfer_reference`) (a `graphs` config keeps its
bucketed plans on the CPU and runs them eagerly: there are no CUDA graphs to replay); an HF config with `gdn_core="fla"`
(stage `hf_fla`) has no CPU form and is refused. The varlen attentions run `engine.tree.blockwise_node_core` on the
CPU (the config keeps its value: FlashAttention has no CPU form and the blockwise core stands in for either). Illegal
combinations are refused in `__post_init__`, where a config is built, with the reason; tests/test_stages.py tries
every one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FIELD_VALUES: dict[str, tuple[Any, ...]] = {
    "backbone": ("hf", "engine"),
    "layout": ("padded", "flat", "tree"),
    "elementwise": ("torch", "triton"),
    "attention": ("sdpa_padded", "mask", "varlen", "varlen_fa4", "paged_fa4"),
    "gdn_core": ("torch", "fla", "fla_forward", "chunk_fused", "flashinfer"),
    "gdn_mode": ("cost", "replicated", "handoff"),
    "gemm": ("cublas", "cublas_row_invariant", "tuned"),
    "graphs": (False, True),
    "weight_format": ("bf16",),
}

VALUE_TEXT: dict[tuple[str, Any], str] = {
    ("backbone", "hf"): "transformers 5.23 Qwen3_5TextModel, eager",
    ("backbone", "engine"): "our backbone over packed rows with merged GEMM weights (4 GEMMs per layer)",
    ("layout", "padded"): "padded per-candidate batches",
    ("layout", "flat"): "candidates back to back (no padding)",
    ("layout", "tree"): "two-level prefix tree: shared text computed once",
    ("elementwise", "torch"): "element-wise ops as torch compositions at HF's rounding points",
    ("elementwise", "triton"): "fused Triton kernels for the element-wise ops at the reference rounding points",
    ("attention", "sdpa_padded"): "SDPA per padded batch",
    ("attention", "mask"): "one masked SDPA call over the packed rows",
    ("attention", "varlen"): "one varlen causal call per layer over the plan's nodes (FlashAttention-2 on CUDA)",
    ("attention", "varlen_fa4"): "one varlen causal call per layer over the plan's nodes (FlashAttention-4 on CUDA: "
    "warpgroup MMA, one split, query heads packed per key/value head)",
    ("attention", "paged_fa4"): "the same FlashAttention-4 call reading each node's path from the packed rows through "
    "a page table of one-row pages: k and v prepared once per row, no key layout",
    ("gdn_core", "torch"): "GDN core through transformers' torch chunk rule",
    ("gdn_core", "fla"): "GDN core through FLA 0.6.0 chunk_gated_delta_rule (backend dispatch off)",
    ("gdn_core", "fla_forward"): "FLA's GDN forward kernels launched directly (no autograd wrapper)",
    ("gdn_core", "chunk_fused"): "GDN core through our chunked gated-delta-rule kernels: the solve, then a walk with "
    "the state on chip across a sequence's chunks that computes a shared prefix once (the plan's tree walk)",
    ("gdn_core", "flashinfer"): "GDN core through FlashInfer 0.7.4's sm_90 prefill kernel (one warp-specialised CTA "
    "per sequence and value head): the shared root once, then every candidate from its fp32 state (the hand-off arena)",
    ("gdn_mode", "cost"): "GDN mode per batch by the cost rule (replicated paths or fp32 state hand-off)",
    ("gdn_mode", "replicated"): "GDN over replicated candidate paths",
    ("gdn_mode", "handoff"): "GDN by fp32 state hand-off at 64-token chunk boundaries",
    ("gemm", "cublas"): "GEMMs through cuBLAS with its default workspace",
    ("gemm", "cublas_row_invariant"): "GEMMs through cuBLAS without a workspace (row-count invariant)",
    ("gemm", "tuned"): "GEMMs by a tuning table per shape and row bucket (cuBLAS, cuBLASLt algorithm or fixed split-K "
    "with fp32 partials reduced in residual_rmsnorm)",
    ("graphs", False): "eager launches",
    ("graphs", True): "each batch padded to a bucket and replayed as one pre-captured CUDA graph",
    ("weight_format", "bf16"): "bf16 GEMM weights",
}

# the node-wise cores: prefix-invariant, batch-invariant (engine/tree.py)
VARLEN_ATTENTION = ("varlen", "varlen_fa4", "paged_fa4")
CPU_GDN_CORE = "torch"
CPU_RUNNABLE_GDN_CORES = (CPU_GDN_CORE, "chunk_fused", "flashinfer")  # run on the CPU as they are (FlashInfer's as
# its contract computed by the fp32 oracle: kernels.gdn_flashinfer.flashinfer_reference)


def describe_value(field: str, value: Any) -> str:
    """What one field value means, in a few words (`max_batch_rows` is a number)."""
    if field == "max_batch_rows":
        return f"at most {value:,} rows per forward"
    return VALUE_TEXT[(field, value)]


@dataclass(frozen=True)
class EngineConfig:
    """What a backbone runs; every field is one choice (module docstring). Built only in legal combinations."""

    backbone: str
    layout: str
    elementwise: str
    attention: str
    gdn_core: str
    gdn_mode: str = "cost"
    gemm: str = "cublas"
    graphs: bool = False
    weight_format: str = "bf16"
    max_batch_rows: int = 8192

    def __post_init__(self) -> None:
        for name, allowed in FIELD_VALUES.items():
            value = getattr(self, name)
            if value not in allowed or type(value) is not type(allowed[0]):
                raise ValueError(f"{name}={value!r} is not one of {allowed}")
        if not isinstance(self.max_batch_rows, int) or self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be an int >= 1, got {self.max_batch_rows!r}")
        if self.backbone == "hf":
            hf = {"layout": "padded", "elementwise": "torch", "attention": "sdpa_padded", "gdn_mode": "cost"}
            wrong = {name: getattr(self, name) for name, value in hf.items() if getattr(self, name) != value}
            if wrong:
                raise ValueError(f"the hf backbone runs transformers' own layout and ops; it cannot take {wrong}")
            if self.gdn_core in ("fla_forward", "chunk_fused", "flashinfer"):
                raise ValueError(
                    f"gdn_core={self.gdn_core!r} is one of the engine's direct launches; the hf backbone calls FLA's "
                    "fla or the torch rule"
                )
        else:
            if self.layout == "padded" or self.attention == "sdpa_padded":
                raise ValueError(
                    f"the engine runs packed rows: layout 'flat' or 'tree', attention 'mask' or one of "
                    f"{VARLEN_ATTENTION}"
                )
            if self.gdn_core == "chunk_fused" and self.elementwise != "triton":
                raise ValueError(
                    "gdn_core='chunk_fused' takes q/k L2-normalised by the Triton prep kernel: it needs "
                    "elementwise='triton'"
                )
        if self.graphs:
            needs = {"backbone": "engine", "layout": "tree", "elementwise": "triton"}
            wrong = {name: getattr(self, name) for name, value in needs.items() if getattr(self, name) != value}
            if self.attention not in VARLEN_ATTENTION:
                wrong["attention"] = self.attention
            if wrong or self.gdn_core == "fla":
                raise ValueError(
                    f"graphs=True replays bucketed tree plans: it needs {needs}, attention one of {VARLEN_ATTENTION} "
                    f"and gdn_core 'fla_forward' (or its CPU form), got {wrong or {'gdn_core': self.gdn_core}}"
                )

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` applied (validated like any config)."""
        return dataclasses.replace(self, **changes)

    def on(self, device_type: str) -> EngineConfig:
        """This config as it runs on `device_type` ("cuda" or "cpu"): the device rule of the module docstring."""
        if device_type == "cuda":
            return self
        cpu = {} if self.gdn_core in CPU_RUNNABLE_GDN_CORES else {"gdn_core": CPU_GDN_CORE}
        if cpu and self.backbone == "hf":
            raise ValueError(f"the hf backbone with gdn_core={self.gdn_core!r} needs CUDA (FLA cannot run on the CPU)")
        return self.replace(**cpu) if cpu else self

    def delta(self, parent: EngineConfig) -> dict[str, Any]:
        """The fields where this config differs from `parent`, in field order."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(parent, f.name)
        }

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
