"""Ladder plans: which stages, on which workloads, at which shapes, timed how (TOML files in ablations/plans/).

A plan file holds `name`, `description`, `device` ("cuda" | "cpu"), `shapes` (reference.shapes), `weights_seed`,
`reference` (the stage whose outputs every stage is compared with), `baseline` (speed-ups are over it), `headline`
(the workload of the ladder figure), `stages`, `workloads` (ids or groups, ablations/workloads.py), a `[timing]`
table (`timer` "cuda-events" | "perf-counter", `warmup`, `runs`, `min_runs`, `profile_runs`) and a `[ceilings]`
table (`copy_bytes`, `gemm_n`, `runs`). `notes` says what the plan leaves out and why.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from engine.stages import get_stage
from reference.shapes import get_shapes

PLANS_DIR = Path(__file__).resolve().parent / "plans"
TIMERS = {"cuda": "cuda-events", "cpu": "perf-counter"}


@dataclass(frozen=True)
class Timing:
    timer: str
    warmup: int  # untimed calls before the samples (the first one also gives the outputs compared)
    runs: int  # timed samples per workload
    min_runs: int  # the fewest `--runs` may ask for
    profile_runs: int  # forwards under the profiler, for kernel counts and GPU-busy time


@dataclass(frozen=True)
class CeilingSpec:
    copy_bytes: int  # bytes of the device-to-device copy
    gemm_n: int  # the bf16 GEMM is gemm_n x gemm_n x gemm_n
    runs: int


@dataclass(frozen=True)
class Plan:
    name: str
    description: str
    device: str
    shapes: str
    weights_seed: int
    reference: str
    baseline: str
    headline: str
    stages: tuple[str, ...]
    workloads: tuple[str, ...]
    timing: Timing
    ceilings: CeilingSpec
    notes: str
    path: Path

    def describe(self) -> dict:
        """The plan as plain data (for run records)."""
        return {
            "name": self.name,
            "description": self.description,
            "device": self.device,
            "shapes": self.shapes,
            "weights_seed": self.weights_seed,
            "reference": self.reference,
            "baseline": self.baseline,
            "headline": self.headline,
            "stages": list(self.stages),
            "workloads": list(self.workloads),
            "timer": self.timing.timer,
            "warmup": self.timing.warmup,
            "runs": self.timing.runs,
            "min_runs": self.timing.min_runs,
            "profile_runs": self.timing.profile_runs,
            "notes": self.notes,
            "file": f"ablations/plans/{self.path.name}",
        }


def plan_names() -> list[str]:
    return sorted(path.stem for path in PLANS_DIR.glob("*.toml"))


def load_plan(name: str) -> Plan:
    path = PLANS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown plan {name!r}; known: {plan_names()}")
    data = tomllib.loads(path.read_text())
    try:
        timing = Timing(**data["timing"])
        ceilings = CeilingSpec(**data["ceilings"])
        plan = Plan(
            name=data["name"],
            description=data["description"],
            device=data["device"],
            shapes=data["shapes"],
            weights_seed=int(data["weights_seed"]),
            reference=data["reference"],
            baseline=data["baseline"],
            headline=data["headline"],
            stages=tuple(data["stages"]),
            workloads=tuple(data["workloads"]),
            timing=timing,
            ceilings=ceilings,
            notes=data.get("notes", ""),
            path=path,
        )
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: malformed plan ({error!r})") from None
    check_plan(plan)
    return plan


def check_plan(plan: Plan) -> None:
    """Raise ValueError on anything inconsistent in a plan."""
    problems = []
    if plan.name != plan.path.stem:
        problems.append(f"name {plan.name!r} differs from the file name")
    if plan.device not in TIMERS:
        problems.append(f"device {plan.device!r} is not one of {list(TIMERS)}")
    elif plan.timing.timer != TIMERS[plan.device]:
        problems.append(f"a {plan.device} plan times with {TIMERS[plan.device]!r}, not {plan.timing.timer!r}")
    get_shapes(plan.shapes)
    for name in (*plan.stages, plan.reference, plan.baseline):
        get_stage(name)
    if get_stage(plan.reference).consumes_weights:
        problems.append("the reference must be an HF stage (its outputs are taken before the engine consumes weights)")
    if plan.device not in get_stage(plan.reference).devices:
        problems.append(f"the reference {plan.reference} cannot run on {plan.device}")
    if not 1 <= plan.timing.min_runs <= plan.timing.runs:
        problems.append("timing needs 1 <= min_runs <= runs")
    if plan.device == "cuda" and plan.timing.min_runs < 30:
        problems.append("a GPU plan times at least 30 runs per workload (ARCHITECTURE.md, Measuring)")
    if plan.timing.warmup < 1 or plan.timing.profile_runs < 1:
        problems.append("timing needs warmup >= 1 and profile_runs >= 1")
    if plan.ceilings.copy_bytes < 1 << 20 or plan.ceilings.gemm_n < 256 or plan.ceilings.runs < 3:
        problems.append("ceilings need copy_bytes >= 1 MiB, gemm_n >= 256, runs >= 3")
    if problems:
        raise ValueError(f"plan {plan.name}: " + "; ".join(problems))
