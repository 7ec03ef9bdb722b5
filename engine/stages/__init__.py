"""The stage registry: every rung of the latency ladder, in ladder order, and the one builder of backbones.

A stage (ARCHITECTURE.md, "The stage contract") is one declared unit: a name, the stage it builds on, its `delta`
(the `engine.config.EngineConfig` fields it changes; the root, `hf_torch`, holds a whole config), its exactness level
and bound, the pytest nodes that gate it, and its status:

* `kept`: part of the ladder; `opt-in`: measured and available, off by default; `failed`: tried and rejected, kept
  here with the reason and the numbers that decided it (so the report's failed-attempts table can show it);
  `unmeasured`: built and gated on the CPU, not yet timed on the H200 (a run on another card is in its notes): off by
  default, in no plan's stage list (the runner times it only when asked by name), never a ladder rung; an H200 record
  promotes it to `kept` or `opt-in`, or records it `failed`.

Everything else is derived from the deltas, never written twice: a stage's config (`config_of`: its parent's config
with its delta applied), its "switches" text (`switches`), the README's stage table (`readme_table`, written between
the `<!-- stages -->` markers by `python -m engine.stages --readme`, checked by tests/test_stages.py), the devices it
runs on, the code it needs, whether it consumes the run's HF weights, and the "everything but X" ablations
(`everything_but`: the top stage's config with X's delta set back to X's parent's values). Each stage has a notes
file beside this module (`<name>.md`: idea, what it switches, where the code is, exactness, evidence).

Exactness levels (ARCHITECTURE.md): `bitwise` (identical bits to `against` on the same inputs), `bounded` (a metric
against `against` stays under `bound`), `decisions` (max |dp| of the end-to-end probabilities within `bound`, no argmax
flip outside near-ties). `reference` marks the root of the ladder. The bound is declared here; the gate enforces it.

Gates: `gate` is a node of the CPU suite (tiny shapes) and `gpu_gate` a node of the GPU suite (`@pytest.mark.gpu`,
27B shapes); the runner runs the one for the plan's device. A stage whose code cannot be imported is recorded as
`unavailable` (with the import error) rather than failing the registry.

Building: `build_backbone(stage or config, ctx)` serves the runner, the server, the JevBench runner and the tests.
The HF stages share one transformers model built on the run's weights; the engine stages consume the weights
(`MergedWeights.from_decision_weights` pops the HF originals so the 27B is held once), so a run builds every HF
stage before the first engine stage. `BuildContext` holds what stages share and enforces that order.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, describe_value

EXACTNESS_LEVELS = ("reference", "bitwise", "bounded", "decisions")
REGISTRY_STATUSES = ("kept", "opt-in", "failed", "unmeasured")
METRICS = ("hidden_rel_rmse", "max_abs_dp")
DEVICES = ("cuda", "cpu")
NOTES_DIR = Path(__file__).resolve().parent
README_MARKERS = ("<!-- stages -->", "<!-- /stages -->")
REQUIRES = {
    "hf": ("reference.model:HFBackbone", "reference.model:build_hf_model"),
    "engine": ("engine.weights:MergedWeights", "engine.backbone:EngineBackbone"),
}


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


@dataclass(frozen=True)
class Stage:
    name: str
    builds_on: str | None
    delta: dict[str, Any]  # the config fields this stage changes; the root's is a whole config
    exactness: Exactness
    gate: str  # pytest node id, CPU suite
    gpu_gate: str  # pytest node id, GPU suite (-m gpu)
    status: str  # one of REGISTRY_STATUSES
    reason: str | None = None  # failed: why it was rejected
    numbers: dict[str, float | str] | None = None  # failed: the measured numbers behind the decision

    @property
    def config(self) -> EngineConfig:
        return config_of(self.name)

    @property
    def switches(self) -> str:
        return switches(self.name)

    @property
    def devices(self) -> tuple[str, ...]:
        """Where the stage can run: every device whose form of the config exists (`EngineConfig.on`)."""
        return tuple(device for device in DEVICES if _runs_on(self.config, device))

    @property
    def consumes_weights(self) -> bool:
        """An engine stage: it merges (consumes) the run's weights, so it is built after every HF stage."""
        return self.config.backbone == "engine"

    @property
    def notes(self) -> Path:
        return NOTES_DIR / f"{self.name}.md"

    def gate_for(self, device: str) -> str:
        return self.gpu_gate if device == "cuda" else self.gate

    def missing_code(self) -> str | None:
        """Why the stage's code cannot be imported, or None when everything it needs is there."""
        for requirement in REQUIRES[self.config.backbone]:
            module_name, _, attribute = requirement.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                return f"{module_name} cannot be imported: {error}"
            if not hasattr(module, attribute):
                return f"{module_name} has no attribute {attribute!r}"
        return None

    def describe(self) -> dict[str, Any]:
        """The registry entry as plain data (for run records and the report)."""
        return {
            "name": self.name,
            "switches": self.switches,
            "builds_on": self.builds_on,
            "delta": dict(self.delta),
            "config": self.config.as_dict(),
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


STAGE_LIST: tuple[Stage, ...] = (
    Stage(
        name="hf_torch",
        builds_on=None,
        delta={
            "backbone": "hf",
            "layout": "padded",
            "elementwise": "torch",
            "attention": "sdpa_padded",
            "gdn_core": "torch",
            "gemm": "cublas",
        },
        exactness=Exactness("reference"),
        gate="tests/test_model.py::test_torch_backend_runs_the_torch_functions",
        gpu_gate="tests/test_gpu_reference.py::test_27b_answers_the_drone_request_with_both_backends",
        status="kept",
    ),
    Stage(
        name="hf_fla",
        builds_on="hf_torch",
        delta={"gdn_core": "fla"},
        exactness=Exactness("bounded", against="hf_torch", metric="hidden_rel_rmse", bound=0.1),
        gate="tests/test_model.py::test_fla_backend_calls_fla_with_torch_conv",
        gpu_gate="tests/test_gpu_reference.py::test_27b_answers_the_drone_request_with_both_backends",
        status="kept",
    ),
    Stage(
        name="merged",
        builds_on="hf_fla",
        delta={"backbone": "engine", "layout": "flat", "attention": "mask", "gemm": "cublas_row_invariant"},
        exactness=Exactness("bounded", against="hf_fla", metric="hidden_rel_rmse", bound=5e-2),
        gate="tests/test_engine.py::test_merged_matches_hf_torch",
        gpu_gate="tests/test_gpu_engine.py::test_engine_close_to_the_reference[merged vs hf_fla]",
        status="kept",
    ),
    Stage(
        name="fused",
        builds_on="merged",
        delta={"elementwise": "triton", "attention": "varlen", "gdn_core": "fla_forward"},
        exactness=Exactness("bounded", against="merged", metric="hidden_rel_rmse", bound=5e-2),
        gate="tests/test_engine.py::test_fused_close_to_merged_under_the_interpreter",
        gpu_gate="tests/test_gpu_engine.py::test_fused_close_to_merged",
        status="kept",
    ),
    Stage(
        name="tree",
        builds_on="fused",
        delta={"layout": "tree"},
        exactness=Exactness("bitwise", against="fused"),
        gate="tests/test_engine_tree.py::test_tree_matches_flat_bitwise",
        gpu_gate="tests/test_gpu_tree.py::test_gpu_model_tree_matches_fused",
        status="kept",
    ),
    Stage(
        name="graphs",
        builds_on="tree",
        delta={"graphs": True},
        exactness=Exactness("bitwise", against="tree"),
        gate="tests/test_plan_padding.py::test_bucketed_forward_matches_unpadded_bitwise",
        gpu_gate="tests/test_gpu_graphs.py::test_replay_matches_eager_on_the_ladder_workloads",
        status="kept",
    ),
    Stage(
        name="gemm",
        builds_on="graphs",
        delta={"gemm": "tuned"},
        exactness=Exactness("bitwise", against="graphs"),  # a split-K table makes it bounded: engine/stages/gemm.md
        gate="tests/test_gemm_stage.py::test_gemm_stage_matches_graphs_bitwise_without_split",
        gpu_gate="tests/test_gpu_gemm_tuned.py::test_gemm_stage_matches_graphs_bitwise",
        status="kept",  # H200 record 20261203T090047Z: bitwise vs graphs on 14 of 14 workloads (engine/stages/gemm.md)
    ),
    Stage(
        name="core",
        builds_on="gemm",
        delta={"gdn_core": "chunk_fused", "attention": "varlen_fa4"},
        # the bound: the one GDN-core-only swap of the H200 record e0c0b5d (hf_torch against hf_fla), its largest
        # hidden_rel_rmse over 17 workloads, 0.0308 (engine/stages/core.md, "Exactness")
        exactness=Exactness("bounded", against="graphs", metric="hidden_rel_rmse", bound=0.031),
        gate="tests/test_core_stage.py::test_core_stage_close_to_graphs",
        gpu_gate="tests/test_gpu_gdn_chunk.py::test_core_stage_close_to_graphs",
        status="kept",  # H200 ladder record 20261204T205232Z: gates green, the fastest rung on its four workloads
        # (drone 37.55 against graphs' 40.02 ms, customer_service 105.0 against 120.7: engine/stages/core.md)
    ),
    Stage(
        name="paged",
        builds_on="core",
        delta={"attention": "paged_fa4"},
        exactness=Exactness("bitwise", against="core"),
        gate="tests/test_core_stage.py::test_paged_stage_matches_core_bitwise",
        gpu_gate="tests/test_gpu_gdn_chunk.py::test_paged_stage_matches_core_bitwise",
        status="unmeasured",  # H100 records 20261207T005156Z, 20261208T004845Z: gate green, core's bits; no H200 yet
    ),
    Stage(
        name="flashinfer_gdn",
        builds_on="core",
        delta={"gdn_core": "flashinfer"},
        # core's bound: a GDN core in the stage's place is held to what core is held to (flashinfer_gdn.md)
        exactness=Exactness("bounded", against="graphs", metric="hidden_rel_rmse", bound=0.031),
        gate="tests/test_core_stage.py::test_flashinfer_gdn_stage_close_to_graphs",
        gpu_gate="tests/test_gpu_gdn_flashinfer.py::test_flashinfer_gdn_stage_close_to_graphs",
        status="unmeasured",  # H100 record 20261208T004845Z: gate green, -2.8 to -3.1 % against core; no H200 record
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


def config_of(name: str, **changes: Any) -> EngineConfig:
    """The stage's config: the root's config with every delta down to `name` applied; then `changes` (ablations and
    tests: e.g. `config_of("tree", gdn_mode="handoff")`). Validated like any config."""
    stage = get_stage(name)
    if stage.builds_on is None:
        config = EngineConfig(**stage.delta)
    else:
        config = config_of(stage.builds_on).replace(**stage.delta)
    return config.replace(**changes) if changes else config


def switches(name: str) -> str:
    """What the stage switches relative to the stage it builds on, from its delta."""
    stage = get_stage(name)
    text = "; ".join(describe_value(field, value) for field, value in stage.delta.items())
    return text if stage.builds_on is not None else f"the original: {text}"


def top_stage() -> Stage:
    """The last kept stage of the ladder (the one every "everything but X" ablation starts from)."""
    return [stage for stage in STAGE_LIST if stage.status == "kept"][-1]


def everything_but(name: str) -> EngineConfig:
    """The top stage's config with `name`'s delta set back to its parent's values: the ladder without that stage.

    Raises ValueError for the root (there is nothing to go back to) and for combinations `EngineConfig` refuses
    (without `merged` the engine's own stages have no backbone to run on), and for a stage that is not `kept`."""
    stage = get_stage(name)
    if stage.builds_on is None:
        raise ValueError(f"{name} is the reference; there is no ladder without it")
    if stage.status != "kept":
        raise ValueError(f"{name} is not a ladder rung (status {stage.status}); the ladder has nothing to leave out")
    parent = config_of(stage.builds_on)
    return top_stage().config.replace(**{field: getattr(parent, field) for field in stage.delta})


def _runs_on(config: EngineConfig, device: str) -> bool:
    try:
        config.on(device)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------- build


class BuildContext:
    """The run's weights and what stages share: one HF model for the HF stages, one set of merged weights after.

    `merged_weights()` consumes the weights: it drops the HF model and pops the HF tensors, so no HF stage can be
    built afterwards (`hf_model()` then raises).
    """

    def __init__(self, weights: Any, *, nvtx: bool = False, gemm_table: Any = None) -> None:
        self.weights = weights  # reference.weights.DecisionWeights
        self.nvtx = nvtx  # engine stages put NVTX ranges around every layer and op family
        self.gemm_table = gemm_table  # `gemm="tuned"`: a GemmTable or its path; None: engine.gemm.default_table_path
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


def prepare_process(stages: list[str | EngineConfig], device_type: str) -> dict[str, str]:
    """Put this process in the state the stages need before anything runs; call it first (runner, server, tests).

    CPU: the Triton kernels run in the interpreter, which must be chosen before `kernels` is imported
    (TRITON_INTERPRET=1, set unless the user set it); a process that already compiled them raises here with the fix,
    instead of answering every request with an error later; and oneDNN off (`torch.backends.mkldnn.enabled`), whose
    bf16 matmul blocks by the row count on some CPUs, so that a GEMM row's bits do not depend on the rows beside it
    (engine/gemm.py's docstring). CUDA: the GEMM choices' cuBLAS state (`engine.gemm.prepare_process`). Returns the
    settings in force."""
    configs = [config_of(s) if isinstance(s, str) else s for s in stages]
    if device_type == "cpu":
        torch.backends.mkldnn.enabled = False
        if any(c.elementwise == "triton" for c in configs):
            os.environ.setdefault("TRITON_INTERPRET", "1")
            if os.environ["TRITON_INTERPRET"] != "1" or _kernels_compiled():
                raise RuntimeError(
                    "the Triton kernels run on the CPU only in the interpreter: start the process with "
                    "TRITON_INTERPRET=1 (it must be set before `kernels` is first imported)"
                )
        return {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    from engine import gemm

    return gemm.prepare_process(configs)


def _kernels_compiled() -> bool:
    """Whether this process already defined the kernels compiled (not under the interpreter)."""
    if "kernels.norms" not in sys.modules:
        return False
    import triton

    return isinstance(sys.modules["kernels.norms"]._residual_rmsnorm_kernel, triton.runtime.JITFunction)


def build_backbone(stage: str | EngineConfig, ctx: BuildContext) -> Any:
    """The backbone of a stage name or a config, on the weights' device (the config's device form, `.on`).

    Raises when the process cannot run it as declared (`prepare_process`: interpreter on the CPU, cuBLAS state on
    CUDA), before anything is built."""
    config = config_of(stage) if isinstance(stage, str) else stage
    device = ctx.weights.head_weight.device
    config = config.on(device.type)
    if config.backbone == "hf":
        from reference.model import HFBackbone

        return HFBackbone(ctx.weights, config.gdn_core, model=ctx.hf_model())
    prepare_process([config], device.type)  # a no-op when the caller prepared the process; raises when too late
    return build_engine(ctx.merged_weights(), config, nvtx_ranges=ctx.nvtx, gemm_table=ctx.gemm_table)


def build_engine(
    merged: Any, stage: str | EngineConfig, *, nvtx_ranges: bool = False, gemm_table: Any = None, **changes: Any
) -> Any:
    """An `EngineBackbone` on already merged weights (`engine.weights.MergedWeights`) for an engine stage name or
    config, with `changes` to its fields (tests and ablations: `build_engine(merged, "tree", gdn_mode="handoff")`),
    in the config's form on the weights' device; `gemm_table` (a `GemmTable` or a path) for `gemm="tuned"`, else
    the default location. `build_backbone` ends here for every engine stage."""
    from engine.backbone import EngineBackbone

    config = config_of(stage) if isinstance(stage, str) else stage
    config = (config.replace(**changes) if changes else config).on(merged.device.type)
    name = stage_name(config, merged.device.type)
    return EngineBackbone(merged, config, nvtx_ranges=nvtx_ranges, gemm_table=gemm_table, name=name)


def stage_name(config: EngineConfig, device_type: str) -> str:
    """The name of the nearest engine stage (fewest differing fields, in its form on `device_type`), with the
    differences in brackets: `tree`, or `tree[elementwise=torch]`. `gdn_mode` and `max_batch_rows` (ablation and
    batching switches) are not part of the name."""
    plain = config.replace(gdn_mode="cost", max_batch_rows=EngineConfig.max_batch_rows)
    best = None
    for stage in STAGE_LIST:
        if stage.consumes_weights:
            delta = plain.delta(stage.config.on(device_type))
            if best is None or len(delta) < len(best[1]):
                best = (stage.name, delta)
    name, delta = best
    return name + ("[" + ",".join(f"{k}={v}" for k, v in delta.items()) + "]" if delta else "")


# ---------------------------------------------------------------------------------------------------------- README


def readme_table() -> str:
    """The README's stage table (Markdown), from the registry."""
    rows = [
        "| stage | builds on | what it switches | exactness | gates (CPU / GPU) | status | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage in STAGE_LIST:
        gates = f"`{stage.gate.split('::')[-1]}` / `{stage.gpu_gate.split('::')[-1]}`"
        rows.append(
            f"| `{stage.name}` | {stage.builds_on or '—'} | {stage.switches} | {stage.exactness.describe()} | "
            f"{gates} | {stage.status} | [{stage.name}.md](engine/stages/{stage.name}.md) |"
        )
    ablations = []
    for stage in [s for s in STAGE_LIST[1:] if s.status == "kept"]:
        try:
            delta = everything_but(stage.name).delta(top_stage().config)
            text = f"`{top_stage().name}` with " + ", ".join(f"`{field}={value}`" for field, value in delta.items())
        except ValueError as error:
            text = f"not buildable: {error}"
        ablations.append(f"- everything but `{stage.name}`: {text}")
    return "\n".join(rows) + "\n\nDerived ablations (`engine.stages.everything_but`):\n\n" + "\n".join(ablations)


def replace_readme_block(text: str) -> str:
    start, end = README_MARKERS
    if start not in text or end not in text:
        raise ValueError(f"README has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{readme_table()}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The stage registry: list it, or rewrite the README's stage table.")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md between the stage markers")
    args = parser.parse_args(argv)
    if args.readme:
        path = NOTES_DIR.parents[1] / "README.md"
        path.write_text(replace_readme_block(path.read_text()))
        return 0
    print(readme_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
