"""The stage registry: every rung of the latency ladder, in ladder order.

A stage (ARCHITECTURE.md, "The stage contract") has a name, what it switches, the stage it builds on, its exactness
level and bound, the pytest node that gates it, and its status:

* `kept`: part of the ladder; `opt-in`: measured and available, off by default; `failed`: tried and rejected, kept
  here with the reason and the numbers that decided it (so the report's failed-attempts table can show it).

The ladder is cumulative, `hf_torch` -> `hf_fla` -> `merged` -> `fused` (later: `tree`, `gemm`, `graphs`).

Exactness levels (ARCHITECTURE.md): `bitwise` (identical bits to `against` on the same inputs), `bounded` (a metric
against `against` stays under `bound`), `decisions` (max |dp| of the end-to-end probabilities within `bound`, no argmax
flip outside near-ties). `reference` marks the root of the ladder: it is what the others are measured against and has
no bound of its own. The bound is declared here; the stage's gate test is what enforces it.

Gates: `gate` is a node of the CPU suite (tiny shapes) and `gpu_gate` a node of the GPU suite (`@pytest.mark.gpu`,
27B shapes); the runner runs the one for the plan's device. Code a stage needs is named in `requires` as
`module:attribute` and imported only when the stage is built, so a stage whose code does not exist yet is recorded
as `unavailable` (with the import error) rather than failing the registry. `devices` lists where a stage can run
(the FLA stage cannot run bf16 on the CPU: the Triton interpreter computes bf16 `tl.dot` wrongly).

Building: the HF stages share one transformers model built on the run's weights; the engine stages consume the
weights (`MergedWeights.from_decision_weights` pops the HF originals so the 27B is held once), so a run builds every
HF stage before the first engine stage. `BuildContext` holds what stages share and enforces that order.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

EXACTNESS_LEVELS = ("reference", "bitwise", "bounded", "decisions")
REGISTRY_STATUSES = ("kept", "opt-in", "failed")
METRICS = ("hidden_rel_rmse", "max_abs_dp")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Exactness:
    """What a stage promises against the stage it replaces; the gate test enforces it."""

    level: str  # one of EXACTNESS_LEVELS
    against: str | None = None  # the stage it is compared with (None only for the reference)
    metric: str | None = None  # one of METRICS, for bounded / decisions
    bound: float | None = None  # the metric's largest allowed value

    def describe(self) -> str:
        if self.level == "reference":
            return "reference (the original every stage is compared with)"
        if self.level == "bitwise":
            return f"bitwise vs {self.against}"
        return f"{self.level}: {self.metric} <= {self.bound:g} vs {self.against}"


class BuildContext:
    """The run's weights and what stages share: one HF model for the HF stages, one set of merged weights after.

    `merged_weights()` consumes the weights: it drops the HF model and pops the HF tensors, so no HF stage can be
    built afterwards (`hf_model()` then raises).
    """

    def __init__(self, weights: Any, *, nvtx: bool = False) -> None:  # weights: reference.weights.DecisionWeights
        self.weights = weights
        self.nvtx = nvtx  # engine stages put NVTX ranges around every layer and op family
        self._hf_model = None
        self._merged = None

    @property
    def consumed(self) -> bool:
        return self._merged is not None

    def hf_model(self):
        if self.consumed:
            raise RuntimeError("the weights were consumed by an engine stage; build every HF stage before the engine")
        if self._hf_model is None:
            from reference.model import build_hf_model

            self._hf_model = build_hf_model(self.weights)
        return self._hf_model

    def merged_weights(self):
        if self._merged is None:
            from engine.weights import MergedWeights

            self._hf_model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._merged = MergedWeights.from_decision_weights(self.weights)
        return self._merged


def _hf_stage(backend: str) -> Callable[[BuildContext], Any]:
    def build(ctx: BuildContext):
        from reference.model import HFBackbone

        return HFBackbone(ctx.weights, backend, model=ctx.hf_model())

    return build


def _engine_stage(*, fused: bool, tree: bool = False) -> Callable[[BuildContext], Any]:
    def build(ctx: BuildContext):
        from engine.backbone import EngineBackbone

        return EngineBackbone(ctx.merged_weights(), fused=fused, tree=tree, nvtx_ranges=ctx.nvtx)

    return build


@dataclass(frozen=True)
class Stage:
    name: str
    switches: str  # what the stage changes relative to `builds_on`
    builds_on: str | None
    exactness: Exactness
    gate: str  # pytest node id, CPU suite
    gpu_gate: str  # pytest node id, GPU suite (-m gpu)
    status: str  # one of REGISTRY_STATUSES
    build: Callable[[BuildContext], Any] = field(repr=False, compare=False)
    requires: tuple[str, ...] = ()  # "module:attribute" the build needs
    devices: tuple[str, ...] = DEVICES
    consumes_weights: bool = False  # an engine stage: built after every HF stage
    reason: str | None = None  # failed: why it was rejected
    numbers: dict[str, float | str] | None = None  # failed: the measured numbers behind the decision

    def gate_for(self, device: str) -> str:
        return self.gpu_gate if device == "cuda" else self.gate

    def missing_code(self) -> str | None:
        """Why the stage's code cannot be imported, or None when everything in `requires` is there."""
        for requirement in self.requires:
            module_name, _, attribute = requirement.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                return f"{module_name} cannot be imported: {error}"
            if attribute and not hasattr(module, attribute):
                return f"{module_name} has no attribute {attribute!r}"
        return None

    def describe(self) -> dict[str, Any]:
        """The registry entry as plain data (for run records and the report)."""
        return {
            "name": self.name,
            "switches": self.switches,
            "builds_on": self.builds_on,
            "exactness": {
                "level": self.exactness.level,
                "against": self.exactness.against,
                "metric": self.exactness.metric,
                "bound": self.exactness.bound,
                "text": self.exactness.describe(),
            },
            "gate": self.gate,
            "gpu_gate": self.gpu_gate,
            "registry_status": self.status,
            "devices": list(self.devices),
            "reason": self.reason,
            "numbers": self.numbers,
        }


HF_REQUIRES = ("reference.model:HFBackbone", "reference.model:build_hf_model")
ENGINE_REQUIRES = ("engine.weights:MergedWeights", "engine.backbone:EngineBackbone")

STAGE_LIST: tuple[Stage, ...] = (
    Stage(
        name="hf_torch",
        switches="the original: transformers Qwen3_5TextModel, eager, SDPA attention, padded per-candidate batches; "
        "GDN through transformers' torch fallbacks (torch_chunk_gated_delta_rule, torch causal conv)",
        builds_on=None,
        exactness=Exactness("reference"),
        gate="tests/test_model.py::test_torch_backend_runs_the_torch_functions",
        gpu_gate="tests/test_gpu_reference.py::test_27b_answers_the_drone_request_with_both_backends",
        status="kept",
        build=_hf_stage("torch"),
        requires=HF_REQUIRES,
    ),
    Stage(
        name="hf_fla",
        switches="the GDN core through flash-linear-attention 0.6.0 (chunk_gated_delta_rule, backend dispatch off); "
        "conv, gated norm and everything else as hf_torch",
        builds_on="hf_torch",
        exactness=Exactness("bounded", against="hf_torch", metric="hidden_rel_rmse", bound=0.1),
        gate="tests/test_model.py::test_fla_backend_calls_fla_with_torch_conv",
        gpu_gate="tests/test_gpu_reference.py::test_27b_answers_the_drone_request_with_both_backends",
        status="kept",
        build=_hf_stage("fla"),
        requires=HF_REQUIRES,
        devices=("cuda",),
    ),
    Stage(
        name="merged",
        switches="the engine backbone over packed rows (no padding) with merged GEMM weights: 4 GEMMs per layer "
        "(in-projection, out-projection, gate|up, down) instead of 7-8; element-wise ops as the reference "
        "(GDN core: FLA on the GPU, HF's torch rule on the CPU, where the CPU gate compares with hf_torch)",
        builds_on="hf_fla",
        exactness=Exactness("bounded", against="hf_fla", metric="hidden_rel_rmse", bound=5e-2),
        gate="tests/test_engine.py::test_merged_matches_hf_torch",
        gpu_gate="tests/test_gpu_engine.py::test_engine_close_to_the_reference[merged vs hf_fla]",
        status="kept",
        build=_engine_stage(fused=False),
        requires=ENGINE_REQUIRES,
        consumes_weights=True,
    ),
    Stage(
        name="fused",
        switches="fused Triton kernels for the element-wise ops (residual add + RMSNorm, SiLU-mul, GDN input prep, "
        "gated RMSNorm, attention prep and output gate) at the reference rounding points; not bitwise against "
        "merged (exp/log1p and the norms' summation order differ by a few fp32 ulps; on the GPU the prep kernel "
        "also L2-normalises q/k, which merged leaves to FLA); attention through one FlashAttention-2 varlen call per "
        "layer reading GQA natively (no k/v repeat, no mask; blockwise fp32 core on the CPU), so that a row's bits do "
        "not depend on the other rows of its batch; on the GPU the GDN core is FLA's forward kernels launched "
        "directly (engine.gdn_core, bitwise to FLA's function, one zero fill of its solve buffer per forward "
        "instead of one per layer)",
        builds_on="merged",
        exactness=Exactness("bounded", against="merged", metric="hidden_rel_rmse", bound=5e-2),
        gate="tests/test_engine.py::test_fused_close_to_merged_under_the_interpreter",
        gpu_gate="tests/test_gpu_engine.py::test_fused_close_to_merged",
        status="kept",
        build=_engine_stage(fused=True),
        requires=ENGINE_REQUIRES,
        consumes_weights=True,
    ),
    Stage(
        name="tree",
        switches="the two-level prefix tree: shared text computed once (root | one node per question | one leaf per "
        "candidate); GDN over replicated candidate paths or by fp32 state hand-off at 64-token chunk boundaries "
        "(chosen by cost); attention per node over its ancestors with the same FlashAttention-2 core as fused. "
        "Bitwise needs row-count-invariant GEMMs: on the GPU the runner disables cuBLAS's workspace "
        "(engine.backbone.use_row_invariant_gemms), without which the split-K down projection at 150-199 rows made "
        "5 of 17 workloads of run 89aea6c differ from fused (max |dp| 4.0e-3)",
        builds_on="fused",
        exactness=Exactness("bitwise", against="fused"),
        gate="tests/test_engine_tree.py::test_tree_matches_flat_bitwise",
        gpu_gate="tests/test_gpu_tree.py::test_gpu_model_tree_matches_fused",
        status="kept",
        build=_engine_stage(fused=True, tree=True),
        requires=ENGINE_REQUIRES,
        consumes_weights=True,
    ),
)

STAGES: dict[str, Stage] = {stage.name: stage for stage in STAGE_LIST}


def get_stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; known: {list(STAGES)}") from None


def in_ladder_order(names: list[str] | tuple[str, ...]) -> list[Stage]:
    """The named stages in registry order (HF stages before engine stages), each once; unknown names raise."""
    wanted = {get_stage(name).name for name in names}
    return [stage for stage in STAGE_LIST if stage.name in wanted]
