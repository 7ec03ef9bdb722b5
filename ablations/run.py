"""The ablation runner: gate, build and time every stage of a plan on every workload, in one run, into one record.

    python -m ablations.run [--plan gpu-27b | cpu-tiny] [--stages hf_torch,hf_fla] [--workloads drone,jevbench]
                            [--runs N] [--warmup N] [--results DIR] [--nvtx] [--no-probes] [--list]

Default plan: `gpu-27b` where CUDA is present, `cpu-tiny` otherwise. Steps:

0. Probes, on a CUDA plan unless `--no-probes`: before anything else touches the GPU, each probe of
   ablations/probes.py runs in its own fresh process (GEMM row-count invariance, GDN hand-off timing, kernel tiles,
   whole-model engine checks) into `record["probes"]`; a failed probe is recorded with its error.
1. Stages are taken in registry order (HF stages before engine stages). A stage whose code is missing, or which
   cannot run on this device, is recorded `unavailable` with the reason.
2. Gates: the remaining stages' gate nodes run first, all in one fresh `python -m pytest -q <nodes>` process (`-m gpu`
   on a GPU plan, `TRITON_INTERPRET=1` on the CPU; each node alone if that process stops on a usage error), and each
   node is judged from the junit report: green = at least one of its tests passed and none failed (all skipped,
   deselected or not found is red). A red stage is recorded `gate-red` with the failures and is not built or timed.
3. Ceilings of this device (streaming and bf16 rates, each the best of its probes, the model's GEMM shapes at the
   largest bucket among them; ablations/timing.py), then the synthetic weights of the
   plan's shapes, then every workload planned once through `reference.service.DecisionModel.plan` (validation,
   prompts, chat template, token ids), so every stage sees the same tokens.
4. Per stage: build once (a `graphs` stage on CUDA then captures its bucket grid, or with `--capture workloads` only
   the buckets the run's workloads take: `graph_cache`, `capture_s`; the
   `gemm` stage records its tuned kernels: `gemm_table`); per
   workload `prepare` (host work and copies; timed apart from the forward, `PREPARE_RUNS` times: `prepare_ms` is the
   first call, `prepare_median_ms` the median), one call whose outputs are kept
   (hidden states at the read positions and the head's scores; it is also the first warm-up), the other warm-up
   calls, then `runs` timed calls of forward + fp32 head (reference/readout.py's `head_scores`; on CUDA the card's
   clocks, temperature and power sampled meanwhile: `clocks`, ablations/clocks.py), then `profile_runs` calls under
   torch.profiler for kernels per forward and GPU-busy time (GPU only). A `graphs` stage
   also records each workload's bucket and graph hit, its padded / real rows and, on CUDA, the replay time of the
   request's own unpadded plan captured as one graph (`exact_graph_ms`, the yardstick of its padding cost) with
   whether that graph's output is bit-identical to the stage's. Wall-clock seconds per workload (`wall_s`: prepare,
   outputs, warm-up, timed and profiled calls, the exact-plan graph) and per stage (build, capture, workloads), so a
   device campaign can be planned from the record.
5. Correctness against the plan's reference stage, per workload: max |dp| over every candidate probability (the
   service's readout: per-question softmax of score / T), the relative RMSE ||h - h_ref|| / ||h_ref|| of the
   final-norm hidden states at the read positions (fp64 over all candidates), and the number of questions whose
   argmax differs. The reference outputs come from the reference stage's own timed run when it runs, otherwise from
   one untimed pass; either way they exist before the first engine stage consumes the weights. On the headline
   workload also every residual state (embedding, each layer's output, the final norm; all real tokens,
   `backbone.hidden_states`): the relative RMSE per state and the first state that is not bit-identical, so a record
   says where each path departs from the reference, not only how far it ends up.
6. Floors per workload from the measured ceilings (weight streaming; compute for the rows the stage computes:
   `backbone.rows_computed(prepared)` where the backbone has it, else the candidates' real tokens). A median under
   its floor is flagged in `below_floor` (a ceiling was low) and printed as a finding; the run goes on.
7. Per-kernel bit identity, when the plan includes the `fused` stage: right after the reference outputs exist and
   before any engine stage consumes the weights, the reference stage's HF model runs the headline workload with
   hooks on a few representative layers (the first GDN and attention layers; on a GPU plan also the last of each),
   and every fused kernel runs on the captured inputs against its reference composition (ablations/bit_identity.py):
   `record["bit_identity"]`, one row per layer, kernel and output. On the CPU the kernels run under the Triton
   interpreter (noted in the record). A failure there is recorded in `bit_identity.error`; the run goes on.

The record (ablations/records.py) is rewritten after every workload with `complete: false`, and a last time with
`complete: true`; a run that dies leaves what it measured. Everything in it comes from this run.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ablations import envinfo, probes, records, timing
from ablations.clocks import sample_clocks
from ablations.plans import Plan, load_plan, plan_names
from ablations.workloads import Workload, resolve
from engine.fla_configs import pin_fla_configs
from engine.gemm_table import gemm_shapes
from engine.graphs import ROWS_GRID
from engine.stages import STAGE_LIST, BuildContext, Stage, build_backbone, get_stage, in_ladder_order, prepare_process
from reference.readout import head_scores, record_probabilities

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "results"
OUTPUT_TAIL_CHARS = 3000
PREPARE_RUNS = 5  # prepare is timed this many times per workload (host time: its median is the figure)
SYNTHETIC_STATEMENT = (
    "Synthetic weights: seeded random tensors of the exact shapes. Timings and engine-vs-reference fidelity are real; "
    "the probabilities carry no meaning for accuracy."
)


# ---------------------------------------------------------------------------------------------------------- gates
def junit_cases(path: Path) -> list[ET.Element]:
    """Every <testcase> of a pytest junit XML file."""
    return list(ET.parse(path).getroot().iter("testcase"))


def node_key(node: str) -> tuple[str, str, str | None]:
    """(junit classname, test function, exact test name or None) of a node id `path.py::[Class::]test[params]`."""
    path, _, rest = node.partition("::")
    classname = path.removesuffix(".py").replace("/", ".")
    *classes, test = rest.split("::")
    classname = ".".join([classname, *classes])
    function, bracket, _ = test.partition("[")
    return classname, function, test if bracket else None


def case_outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if case.find("skipped") is not None else "passed"


def _pytest(nodes: list[str], device: str, timeout_s: float, cwd: Path) -> dict[str, Any]:
    """One fresh pytest process over `nodes` (`-m gpu` on a GPU plan, TRITON_INTERPRET=1 on the CPU)."""
    selection = ["-m", "gpu", *nodes] if device == "cuda" else list(nodes)
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "gates.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selection]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
            exit_code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as error:
            exit_code = -1
            output = f"{error.stdout or ''}{error.stderr or ''}\ngates timed out after {timeout_s:g} s"
        seconds = time.perf_counter() - start
        cases = junit_cases(junit) if junit.is_file() else []
    return {"exit_code": exit_code, "output": output, "cases": cases, "seconds": round(seconds, 2),
            "command": " ".join(["python -m pytest -q", *selection])}  # fmt: skip


def node_cases(node: str, run: dict[str, Any]) -> list[ET.Element]:
    """The junit test cases of `run` that belong to `node` (all its parametrisations, or the one it names)."""
    classname, function, exact = node_key(node)
    return [
        case
        for case in run["cases"]
        if case.get("classname") == classname
        and (case.get("name") == exact if exact else case.get("name", "").partition("[")[0] == function)
    ]


def gate_result(node: str, run: dict[str, Any]) -> dict[str, Any]:
    """A node's gate from a pytest run that may have covered other nodes too: green iff the run completed, at least
    one of the node's tests passed and none failed (all skipped, deselected or not collected is red)."""
    mine = node_cases(node, run)
    outcomes = [case_outcome(case) for case in mine]
    passed, failed = outcomes.count("passed"), outcomes.count("failed")
    failures = [
        f"{case.get('name')}: {(problem.get('message') or '')[:300]}\n{(problem.text or '')[-800:]}"
        for case in mine
        for problem in (*case.findall("failure"), *case.findall("error"))
    ]
    return {
        "node": node,
        "outcome": "green" if run["exit_code"] in (0, 1) and passed >= 1 and failed == 0 else "red",
        "exit_code": run["exit_code"],
        "passed": passed,
        "failed": failed,
        "skipped": outcomes.count("skipped"),
        "seconds": run["seconds"],
        "command": run["command"],
        "output_tail": ("\n".join(failures) or run["output"])[-OUTPUT_TAIL_CHARS:],
    }


def run_gates(nodes: list[str], device: str, timeout_s: float, cwd: Path = REPO) -> dict[str, dict[str, Any]]:
    """Gate results by node. All nodes run in one pytest process (module fixtures, such as a 27B model, are built
    once); when that process stops before running tests (an unknown node is a usage error for the whole
    invocation), each node runs alone. A node that ran no test of its own because CUDA ran out of memory while
    setting it up (`out_of_memory_in_setup`: on an H100's 80 GB the 27B model of an earlier node's module was not
    released in time, 33f9910 to af0f763: a reference cycle, which tests/conftest.py now collects before each module)
    runs again alone, and its gate says so (`alone`); a red test result never reruns."""
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        return {}
    run = _pytest(nodes, device, timeout_s * len(nodes), cwd)
    if run["exit_code"] not in (0, 1, 5) and len(nodes) > 1:
        return {node: gate_result(node, _pytest([node], device, timeout_s, cwd)) for node in nodes}
    gates = {node: gate_result(node, run) for node in nodes}
    alone = "CUDA ran out of memory setting up its tests in the shared process"
    for node in [node for node in nodes if len(nodes) > 1 and out_of_memory_in_setup(node, run)]:
        gates[node] = gate_result(node, _pytest([node], device, timeout_s, cwd)) | {"alone": alone}
    return gates


def out_of_memory_in_setup(node: str, run: dict[str, Any]) -> bool:
    """True iff the node has cases in `run` and every one of them is a setup error of CUDA running out of memory
    (pytest's junit: an <error> element "failed on setup with ... CUDA out of memory"), none passed or failed."""
    mine = node_cases(node, run)

    def oom_setup_error(case: ET.Element) -> bool:
        errors = case.findall("error")
        return (
            case.find("failure") is None
            and bool(errors)
            and all("on setup" in (e.get("message") or "") and "CUDA out of memory" in (e.get("message") or "")
                    for e in errors)
        )  # fmt: skip

    return bool(mine) and all(oom_setup_error(case) for case in mine)


def gate_reason(gate: dict[str, Any]) -> str:
    if gate["passed"] == 0 and gate["failed"] == 0:
        return f"gate {gate['node']} ran no test (exit code {gate['exit_code']}: skipped, deselected or not found)"
    counts = f"exit code {gate['exit_code']}, {gate['failed']} failed, {gate['passed']} passed"
    return f"gate {gate['node']} is red: {counts}"


# ---------------------------------------------------------------------------------------------- measuring
@dataclass
class Outputs:
    """What a stage answered for one workload: compared with the reference's."""

    hidden: torch.Tensor  # [C, hidden] fp32 on the CPU (exact copy of the bf16 forward output)
    probabilities: list[list[float]]  # per question, over its answer keys


def probabilities_of(decision_plan: Any, scores: list[float], temperature: float) -> list[list[float]]:
    """Per-question probabilities through the service's readout (reference/readout.py)."""
    result, offset = [], 0
    for record in decision_plan.records:
        own = scores[offset : offset + record.candidate_count]
        offset += record.candidate_count
        result.append(record_probabilities(record, own, temperature))
    return result


def compare_with_base(outputs: Outputs, base: Outputs, base_name: str) -> dict[str, Any]:
    """A stage against the stage it builds on, on one workload: `bitwise` (same hidden bits and probabilities) and
    `compare`'s figures (None where the two lay rows out differently, e.g. HF's padded batch)."""
    if outputs.hidden.shape != base.hidden.shape:
        return {"stage": base_name, "bitwise": None}
    bitwise = torch.equal(outputs.hidden, base.hidden) and outputs.probabilities == base.probabilities
    return {"stage": base_name, "bitwise": bitwise, **compare(outputs, base)}


def compare(outputs: Outputs, reference: Outputs) -> dict[str, float | int]:
    """max |dp| over all probabilities, relative RMSE of the hidden states, questions whose argmax differs."""
    if outputs.hidden.shape != reference.hidden.shape:
        raise ValueError(f"hidden shapes differ: {tuple(outputs.hidden.shape)} vs {tuple(reference.hidden.shape)}")
    diff = (outputs.hidden.double() - reference.hidden.double()).square().sum()
    rel_rmse = math.sqrt(float(diff) / float(reference.hidden.double().square().sum()))
    max_dp, flips = 0.0, 0
    for mine, theirs in zip(outputs.probabilities, reference.probabilities, strict=True):
        max_dp = max(max_dp, *(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
        flips += max(range(len(mine)), key=mine.__getitem__) != max(range(len(theirs)), key=theirs.__getitem__)
    return {"max_abs_dp": max_dp, "hidden_rel_rmse": rel_rmse, "argmax_flips": flips}


def compare_states(states: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, Any]:
    """Per residual state (embedding, each layer's output, final norm): relative RMSE against the reference (fp64),
    and the first state that is not bit-identical (None when all are)."""
    if len(states) != len(reference):
        raise ValueError(f"{len(states)} states against the reference's {len(reference)}")
    errors, first = [], None
    for i, (mine, theirs) in enumerate(zip(states, reference)):
        if mine.shape != theirs.shape:
            raise ValueError(f"state {i}: shape {tuple(mine.shape)} against the reference's {tuple(theirs.shape)}")
        ref = theirs.double()
        errors.append(math.sqrt(float((mine.double() - ref).square().sum()) / float(ref.square().sum())))
        if first is None and not torch.equal(mine, theirs):
            first = i
    return {"state_rel_rmse": errors, "first_departing_state": first}


def rows_computed(backbone: Any, prepared: Any, candidates: list[list[int]]) -> int:
    counter = getattr(backbone, "rows_computed", None)
    return int(counter(prepared)) if counter is not None else sum(len(ids) for ids in candidates)


# ---------------------------------------------------------------------------------------------- the run
class Run:
    def __init__(self, plan: Plan, stages: list[Stage], workloads: list[Workload], args: argparse.Namespace) -> None:
        self.plan = plan
        self.stages = stages
        self.workloads = workloads
        self.device = plan.device
        self.runs = args.runs if args.runs is not None else plan.timing.runs
        self.warmup = args.warmup if args.warmup is not None else plan.timing.warmup
        if self.runs < plan.timing.min_runs:
            raise SystemExit(f"--runs {self.runs}: plan {plan.name} times at least {plan.timing.min_runs} runs")
        if self.warmup < 1:
            raise SystemExit("--warmup must be >= 1 (the first call gives the compared outputs)")
        self.nvtx_timing = args.nvtx and self.device == "cuda"
        self.gate_timeout = args.gate_timeout
        self.capture = args.capture
        self.progress = not args.no_progress
        self.env = envinfo.collect(self.device)
        self.path = Path(args.results) / "runs" / f"{envinfo.record_stem(self.env)}.json"
        self.reference_outputs: dict[str, Outputs] = {}
        self.outputs: dict[tuple[str, str], Outputs] = {}
        self.headline_states: dict[str, list[torch.Tensor]] = {}  # stage -> host copies, until compared
        self.reference_states: list[torch.Tensor] | None = None
        self.decision_plans: dict[str, Any] = {}
        plan_info = plan.describe() | {"runs": self.runs, "warmup": self.warmup}
        plan_info["requested_stages"] = [s.name for s in stages]
        plan_info["requested_workloads"] = [w.id for w in workloads]
        # the plan's workloads this run leaves out (--workloads): the record is complete for what it requested only
        plan_info["omitted_workloads"] = [
            w.id for w in resolve(plan.workloads) if w.id not in plan_info["requested_workloads"]
        ]
        self.record: dict[str, Any] = {
            "schema": records.SCHEMA,
            "complete": False,
            "plan": plan_info,
            "env": self.env,
            "weights": {},
            "ceilings": {},
            "reference": {"stage": plan.reference, "source": None},
            "workloads": [],
            "stages": [self._stage_entry(stage) for stage in stages],
            "registry": [stage.describe() for stage in STAGE_LIST],
            "attempts": records.load_attempts(),
            "nvtx": {"timed_calls": self.nvtx_timing, "profiled_calls": self.device == "cuda"},
            "capture": self.capture,
            "timeline_s": {},  # seconds of the start: probes, gates, ceilings, weights (per stage: build, capture)
        }

    def _stage_entry(self, stage: Stage) -> dict[str, Any]:
        return {"name": stage.name, "status": "pending", "reason": None, "gate": None, "registry": stage.describe(),
                "build_s": None, "peak_memory_gib": None, "workloads": [], "workload_errors": []}  # fmt: skip

    def entry(self, name: str) -> dict[str, Any]:
        return next(e for e in self.record["stages"] if e["name"] == name)

    def write(self) -> None:
        records.write_record(self.record, self.path)

    # -- step 1 and 2
    def check_availability_and_gates(self) -> None:
        todo = []
        for stage in self.stages:
            entry = self.entry(stage.name)
            if self.device not in stage.devices:
                entry["status"] = "unavailable"
                entry["reason"] = f"{stage.name} runs on {', '.join(stage.devices)} only, not on {self.device}"
                continue
            missing = stage.missing_code()
            if missing:
                entry["status"], entry["reason"] = "unavailable", missing
                continue
            todo.append(stage)
        nodes = [stage.gate_for(self.device) for stage in todo]
        if nodes and self.progress:
            print(f"gates: {len(nodes)} node(s) in one pytest process ({', '.join(nodes)})", file=sys.stderr)
        start = time.perf_counter()
        gates = run_gates(nodes, self.device, self.gate_timeout)
        self.record["timeline_s"]["gates"] = time.perf_counter() - start
        for node, gate in gates.items():
            if "alone" in gate and self.progress:
                print(f"gates: {node} ran again alone ({gate['alone']}): {gate['outcome']}", file=sys.stderr)
        for stage in todo:
            entry = self.entry(stage.name)
            entry["gate"] = gates[stage.gate_for(self.device)]
            if entry["gate"]["outcome"] != "green":
                entry["status"], entry["reason"] = "gate-red", gate_reason(entry["gate"])

    # -- step 3
    def prepare_inputs(self) -> None:
        from reference.service import DecisionModel
        from reference.shapes import get_shapes
        from reference.weights import synthetic_weights

        ceilings = self.plan.ceilings
        shapes = get_shapes(self.plan.shapes)
        start = time.perf_counter()
        self.record["ceilings"] = timing.measure_ceilings(
            self.device, copy_bytes=ceilings.copy_bytes, gemm_n=ceilings.gemm_n, runs=ceilings.runs,
            gemm_shapes=gemm_shapes(shapes), shape_rows=max(ROWS_GRID),
        )  # fmt: skip
        self.record["timeline_s"]["ceilings"] = time.perf_counter() - start
        start = time.perf_counter()
        self.weights = synthetic_weights(shapes, seed=self.plan.weights_seed, device=self.device)
        self.record["timeline_s"]["weights"] = time.perf_counter() - start
        self.linear_params = shapes.linear_params()
        self.record["weights"] = {
            "synthetic": bool(self.weights.synthetic),
            "method": self.weights.method,
            "model_id": self.weights.model_id,
            "shapes": shapes.name,
            "seed": self.plan.weights_seed,
            "linear_params": self.linear_params,
            "linear_weight_bytes": 2 * self.linear_params,
            "temperature": self.weights.temperature,
            "statement": SYNTHETIC_STATEMENT if self.weights.synthetic else None,
        }
        self.ctx = BuildContext(self.weights, nvtx=self.nvtx_timing)
        self.head_weight = self.weights.head_weight.to(self.device)
        self.head_bias = self.weights.head_bias.to(self.device)
        planner = DecisionModel(build_backbone(self.plan.reference, self.ctx), self.weights)
        for workload in self.workloads:
            decision_plan = planner.plan(workload.request)
            self.decision_plans[workload.id] = decision_plan
            lengths = [len(ids) for ids in decision_plan.candidates]
            self.record["workloads"].append(
                {
                    "id": workload.id,
                    "group": workload.group,
                    "description": workload.description,
                    "questions": len(decision_plan.records),
                    "candidates": len(lengths),
                    "tokens": sum(lengths),
                    "max_candidate_tokens": max(lengths),
                }
            )
        self.write()

    # -- step 4
    def outputs_of(self, backbone: Any, prepared: Any, decision_plan: Any) -> Outputs:
        """One forward + head, kept for the comparisons: hidden states and per-question probabilities."""
        hidden = backbone.forward(prepared)  # [C, hidden] bf16
        scores = head_scores(hidden, self.head_weight, self.head_bias).cpu().tolist()
        return Outputs(hidden.float().cpu(), probabilities_of(decision_plan, scores, self.weights.temperature))

    def workload_buckets(self, backbone: Any) -> set:
        """`--capture workloads`: the grid buckets this run's workloads are padded to (host planning only)."""
        return {
            batch.plan.bucket
            for plan in self.decision_plans.values()
            for batch in backbone.prepare(plan.candidates, plan.groups).batches
            if batch.plan.bucket is not None
        }

    def measure(self, stage: Stage, backbone: Any, workload: Workload) -> tuple[dict[str, Any], Outputs]:
        started = time.perf_counter()
        decision_plan = self.decision_plans[workload.id]
        label = f"{stage.name}/{workload.id}"
        cuda = self.device == "cuda"
        prepare_samples = []
        for _ in range(PREPARE_RUNS):  # host planning and copies; the last one's batches are timed
            start = time.perf_counter()
            prepared = backbone.prepare(decision_plan.candidates, decision_plan.groups)
            if cuda:
                torch.cuda.synchronize()
            prepare_samples.append((time.perf_counter() - start) * 1e3)
        prepare_ms = prepare_samples[0]

        def step() -> torch.Tensor:
            return head_scores(backbone.forward(prepared), self.head_weight, self.head_bias)

        with torch.inference_mode():
            with timing.nvtx_range(f"{label} outputs", cuda):
                outputs = self.outputs_of(backbone, prepared, decision_plan)
                if workload.id == self.plan.headline:
                    self.keep_states(stage.name, backbone, prepared)
            with (
                timing.nvtx_range(f"{label} timed", cuda),
                timing.layer_ranges(backbone, self.nvtx_timing),
                sample_clocks(self.device) as clocks,
            ):
                samples = timing.time_calls(step, device=self.device, warmup=self.warmup - 1, runs=self.runs)
            kernels = host = None
            if cuda:
                with timing.nvtx_range(f"{label} profiled", True), timing.layer_ranges(backbone, True):
                    kernels = timing.profile_kernels(step, self.plan.timing.profile_runs)
                if workload.id == self.plan.headline:
                    host = timing.host_profile(lambda: (step(), torch.cuda.synchronize()))
        rows = rows_computed(backbone, prepared, decision_plan.candidates)
        result = {"id": workload.id, "rows": rows, "prepare_ms": prepare_ms, **samples.summary()}
        result["prepare_median_ms"] = statistics.median(prepare_samples)
        result["clocks"] = clocks if cuda else None  # the card during the timed calls (ablations.clocks)
        if stage.config.graphs:
            result |= self.graph_facts(backbone, prepared, decision_plan, outputs)
        result["warmup"] = self.warmup
        result["kernels_per_forward"] = kernels.kernels_per_forward if kernels else None
        result["gpu_busy_ms"] = kernels.gpu_busy_ms if kernels else None
        result["idle_between_kernels_ms"] = kernels.idle_ms if kernels else None
        result["top_gaps"] = kernels.top_gaps if kernels else []
        result["gpu_non_kernel"] = kernels.non_kernel if kernels else {}
        result["top_kernels"] = kernels.top_kernels if kernels else []
        result["kernel_families"] = kernels.families if kernels else None
        result["host_profile"] = host
        core_ms = kernels.core_ms if kernels else 0.0
        gemm_ms = kernels.families["gemm"]["ms_per_forward"] if kernels else 0.0
        result["core_ms"] = core_ms if core_ms > 0 else None
        result["core_multiple"] = result["median_ms"] / core_ms if core_ms > 0 else None
        result["gemm_ms"] = gemm_ms if gemm_ms > 0 else None
        result["gemm_multiple"] = result["median_ms"] / gemm_ms if gemm_ms > 0 else None
        # the engine's typed weights know their bytes; the HF stages hold bf16 (2 bytes a parameter)
        weight_bytes = backbone.gemm_weight_bytes() if stage.consumes_weights else 2 * self.linear_params
        ceilings, weight_format = self.record["ceilings"], stage.config.weight_format
        result |= timing.floors(weight_bytes, self.linear_params, rows, ceilings, weight_format)
        result["floor_multiple"] = result["median_ms"] / result["floor_ms"]
        result["below_floor"] = timing.below_floor(result["median_ms"], result["floor_ms"], ceilings)
        if result["below_floor"]:
            print(f"finding: {stage.name} / {workload.id}: {result['below_floor']}", file=sys.stderr)
        result |= {"max_abs_dp": None, "hidden_rel_rmse": None, "argmax_flips": None}
        result["probabilities"] = outputs.probabilities
        result["wall_s"] = time.perf_counter() - started
        return result, outputs

    def graph_facts(self, backbone: Any, prepared: Any, decision_plan: Any, outputs: Outputs) -> dict[str, Any]:
        """`graphs`: the batches' buckets and hits, the padding (padded rows / real rows), and on CUDA the exact-plan
        graph (the request's own unpadded plan captured as one graph): its replay time and whether its output is
        bit-identical to this stage's."""
        real = sum(b.plan.num_rows - sum(b.plan.padding_lens) for b in prepared.batches)
        facts = {
            "graph": backbone.graph_metadata(prepared),
            "padding": {
                "rows_real": real,
                "rows_padded": prepared.rows_computed,
                "padded_per_real": prepared.rows_computed / real,
            },  # fmt: skip
            "exact_graph_ms": None,
            "exact_graph_bitwise": None,
        }
        replay = backbone.exact_graph(decision_plan.candidates, decision_plan.groups)
        if replay is not None:
            facts["exact_graph_bitwise"] = torch.equal(replay().float().cpu(), outputs.hidden)
            samples = timing.time_calls(
                lambda: head_scores(replay(), self.head_weight, self.head_bias),
                device=self.device, warmup=self.warmup - 1, runs=self.runs,
            )  # fmt: skip
            facts["exact_graph_ms"] = samples.summary()["median_ms"]
        return facts

    def ensure_reference(self) -> None:
        """Reference outputs for every workload, from one untimed pass of the reference stage where still missing."""
        missing = [w for w in self.workloads if w.id not in self.reference_outputs]
        if not missing:
            return
        stage = get_stage(self.plan.reference)
        backbone = build_backbone(stage.name, self.ctx)
        with torch.inference_mode():
            for workload in missing:
                decision_plan = self.decision_plans[workload.id]
                prepared = backbone.prepare(decision_plan.candidates, decision_plan.groups)
                self.reference_outputs[workload.id] = self.outputs_of(backbone, prepared, decision_plan)
                if workload.id == self.plan.headline:
                    self.keep_states(stage.name, backbone, prepared)
        del backbone
        source = self.record["reference"]["source"]
        self.record["reference"]["source"] = "untimed pass" if source is None else f"{source} + untimed pass"
        self._release()

    def measure_bit_identity(self) -> None:
        """Step 7: `record["bit_identity"]` from activations captured on the reference stage's HF model (once, while
        the HF weights still exist; only when the plan includes the fused stage). Errors are recorded, not raised."""
        if "bit_identity" in self.record or "fused" not in {s.name for s in self.stages}:
            return
        from ablations import bit_identity

        shapes = self.weights.shapes
        headline = self.plan.headline
        layers = bit_identity.representative_layers(shapes, late=self.device == "cuda")
        relaxed = bit_identity.CPU_RELAXED if self.device == "cpu" else None
        result: dict[str, Any] = {
            "workload": headline,
            "reference": self.plan.reference,
            "layers": [{"index": i, "type": shapes.layer_types[i]} for i in layers],
            "candidates": None,
            "tokens": None,
            "interpreter": self.device == "cpu",
            "note": bit_identity.INTERPRETER_NOTE if self.device == "cpu" else None,
            "rows": [],
            "error": None,
            "seconds": None,
        }
        start = time.perf_counter()
        try:
            backbone = build_backbone(self.plan.reference, self.ctx)
            decision_plan = self.decision_plans.get(headline)
            if decision_plan is None:  # the headline is not among this run's workloads: planned here
                from reference.service import DecisionModel

                decision_plan = DecisionModel(backbone, self.weights).plan(resolve([headline])[0].request)
            result["candidates"] = len(decision_plan.candidates)
            result["tokens"] = sum(len(ids) for ids in decision_plan.candidates)
            with torch.inference_mode():
                captured = bit_identity.capture_activations(
                    backbone, decision_plan.candidates, decision_plan.groups, layers=layers
                )
                rows = bit_identity.captured_table(captured, shapes)
            for row in rows:
                row["expected"] = bit_identity.expectation(row["kernel"], row["output"], relaxed)
                row["as_expected"] = bit_identity.meets_expectation(row, relaxed)
            result["rows"] = rows
            del backbone, captured
        except Exception as error:  # recorded; the timings do not depend on it
            result["error"] = f"{type(error).__name__}: {error}"
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.record["bit_identity"] = result
        self._release()
        self.write()

    def keep_states(self, stage_name: str, backbone: Any, prepared: Any) -> None:
        """Host copies of every residual state of the headline workload (one extra untimed forward)."""
        states = [state.cpu() for state in backbone.hidden_states(prepared)]
        if stage_name == self.plan.reference:
            self.reference_states = states
        else:
            self.headline_states[stage_name] = states

    def update_comparisons(self) -> None:
        for entry in self.record["stages"]:
            for result in entry["workloads"]:
                reference = self.reference_outputs.get(result["id"])
                if reference is not None:
                    result.update(compare(self.outputs[(entry["name"], result["id"])], reference))
                base = get_stage(entry["name"]).builds_on
                if base is not None and (base, result["id"]) in self.outputs and "vs_builds_on" not in result:
                    mine = self.outputs[(entry["name"], result["id"])]
                    result["vs_builds_on"] = compare_with_base(mine, self.outputs[(base, result["id"])], base)
                if result["id"] != self.plan.headline or self.reference_states is None or "state_rel_rmse" in result:
                    continue  # each stage's states are compared once (runs after every workload)
                if entry["name"] == self.plan.reference:
                    result.update(compare_states(self.reference_states, self.reference_states))
                elif entry["name"] in self.headline_states:
                    result.update(compare_states(self.headline_states.pop(entry["name"]), self.reference_states))

    def _release(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def time_stages(self) -> None:
        runnable = [s for s in self.stages if self.entry(s.name)["status"] == "pending"]
        bar = tqdm(
            total=len(runnable) * len(self.workloads),
            desc="stages",
            unit="workload",
            disable=not self.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        for stage in runnable:
            entry = self.entry(stage.name)
            if stage.consumes_weights and not self.ctx.consumed:
                self.ensure_reference()
                self.measure_bit_identity()
            if self.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = stage_start = time.perf_counter()
            try:
                with timing.nvtx_range(f"{stage.name} build", self.device == "cuda"):
                    backbone = build_backbone(stage.name, self.ctx)
            except Exception as error:  # recorded with the reason; the run goes on with the next stage
                if isinstance(error, NotImplementedError):  # the stage's code is not written yet
                    entry["status"], entry["reason"] = "unavailable", f"not implemented: {error}"
                else:
                    entry["status"], entry["reason"] = "error", f"build failed: {type(error).__name__}: {error}"
                bar.update(len(self.workloads))
                self._release()
                self.write()
                continue
            entry["build_s"] = time.perf_counter() - start
            gemm_table = getattr(backbone, "gemm_table", lambda: None)()
            if gemm_table is not None:
                entry["gemm_table"] = gemm_table  # stage `gemm`: the kernel per shape and bucket it ran (or no table)
            if stage.config.graphs and self.device == "cuda":
                start = time.perf_counter()
                entry["graph_cache"] = backbone.warm_up(partial(
                    tqdm, desc=f"{stage.name}: capture", disable=not self.progress, file=sys.stderr, dynamic_ncols=True
                ), buckets=self.workload_buckets(backbone) if self.capture == "workloads" else None)  # fmt: skip
                entry["capture_s"] = time.perf_counter() - start
            for workload in self.workloads:
                bar.set_postfix_str(f"{stage.name} / {workload.id}")
                try:
                    result, outputs = self.measure(stage, backbone, workload)
                except Exception as error:  # e.g. out of memory on one workload: recorded, the others still run
                    entry["workload_errors"].append({"id": workload.id, "error": f"{type(error).__name__}: {error}"})
                    self._release()
                else:
                    entry["workloads"].append(result)
                    self.outputs[(stage.name, workload.id)] = outputs
                    if stage.name == self.plan.reference:
                        self.reference_outputs[workload.id] = outputs
                        self.record["reference"]["source"] = "timed stage"
                    self.update_comparisons()
                bar.update(1)
                self.write()
            entry["status"] = "ok" if entry["workloads"] else "error"
            entry["wall_s"] = time.perf_counter() - stage_start  # build, capture and every workload
            if not entry["workloads"]:
                entry["reason"] = "every workload failed: " + "; ".join(e["error"] for e in entry["workload_errors"])
            if self.device == "cuda":
                entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if getattr(backbone, "graphs", None) is not None:
                entry["graph_cache"] |= backbone.graphs.describe()  # this run's hits and misses; eager_warm_s stays
            del backbone
            self._release()
        bar.close()

    def run(self) -> Path:
        if get_stage(self.plan.reference).missing_code():
            raise SystemExit(f"the reference stage {self.plan.reference} is unavailable: cannot compare anything")
        self.check_availability_and_gates()
        self.prepare_inputs()
        self.time_stages()
        if not self.ctx.consumed:
            self.ensure_reference()
            self.measure_bit_identity()
        self.update_comparisons()
        self.record["complete"] = True
        self.record["finished_utc"] = envinfo.utc_now()
        self.write()
        return self.path


def summary_lines(record: dict[str, Any]) -> list[str]:
    """A short table of the run: one line per stage and workload."""
    plan, env = record["plan"], record["env"]
    machine = env["gpu"] or f"CPU ({env.get('cpu') or 'unknown CPU'})"
    lines = [f"plan {plan['name']} on {machine}; reference {plan['reference']}; synthetic weights", ""]
    header = f"{'stage':<10} {'status':<12} {'workload':<34} {'rows':>7} {'median ms':>10} {'p10-p90':>17} "
    lines.append(header + f"{'kernels':>8} {'busy ms':>8} {'x floor':>8} {'max|dp|':>9} {'rel rmse':>9} {'SM MHz':>7}")

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def sm_clock(w: dict[str, Any]) -> str:  # median SM clock of the timed calls (records before it: none)
        return number((w.get("clocks") or {}).get("sm_mhz_median"), ".0f")

    for stage in record["stages"]:
        if stage["status"] != "ok":
            lines.append(f"{stage['name']:<10} {stage['status']:<12} {stage['reason']}")
            continue
        for w in stage["workloads"]:
            spread = f"{w['p10_ms']:.2f}-{w['p90_ms']:.2f}"
            lines.append(
                f"{stage['name']:<10} {'ok':<12} {w['id']:<34} {w['rows']:>7} {w['median_ms']:>10.2f} {spread:>17} "
                f"{number(w['kernels_per_forward'], '.0f'):>8} {number(w['gpu_busy_ms'], '.2f'):>8} "
                f"{w['floor_multiple']:>8.2f} {number(w['max_abs_dp'], '.2e'):>9} "
                f"{number(w['hidden_rel_rmse'], '.2e'):>9} {sm_clock(w):>7}"
            )
        for error in stage["workload_errors"]:
            lines.append(f"{stage['name']:<10} {'error':<12} {error['id']:<34} {error['error']}")
    lines += bit_identity_lines(record.get("bit_identity"))
    return lines


def bit_identity_lines(result: dict[str, Any] | None) -> list[str]:
    """One summary line for the bit-identity step (none when the run did not take it)."""
    if result is None:
        return []
    layers = ", ".join(str(layer["index"]) for layer in result["layers"])
    head = f"bit identity of the fused kernels on {result['workload']} (layers {layers})"
    if result["error"]:
        return ["", f"{head}: failed: {result['error']}"]
    rows = result["rows"]
    if not rows:
        return ["", f"{head}: no kernel ran"]
    missed = [f"{r['layer']}:{r['kernel']}.{r['output']}" for r in rows if not r["as_expected"]]
    lowest = min(rows, key=lambda r: r["share"])
    line = f"{head}: {len(rows) - len(missed)}/{len(rows)} outputs as expected, lowest share "
    line += f"{100 * lowest['share']:.4f}% ({lowest['kernel']}.{lowest['output']})"
    if missed:
        line += f"; not as expected: {', '.join(missed)}"
    return ["", line + (" [Triton interpreter]" if result["interpreter"] else "")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ablations.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=plan_names(), help="default: gpu-27b with CUDA, else cpu-tiny")
    parser.add_argument("--stages", help="comma-separated stage names (default: the plan's)")
    parser.add_argument("--workloads", help="comma-separated workload ids or groups (default: the plan's)")
    parser.add_argument("--runs", type=int, help="timed runs per workload (default: the plan's; not below min_runs)")
    parser.add_argument("--warmup", type=int, help="warm-up calls per workload (default: the plan's)")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS), help="results folder (records go to runs/)")
    parser.add_argument("--nvtx", action="store_true", help="keep per-layer NVTX ranges on during timed calls too")
    parser.add_argument("--gate-timeout", type=float, default=900.0, help="seconds per gate test (default 900)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-probes", action="store_true", help="skip the probes (ablations/probes.py) of a CUDA plan")
    parser.add_argument(
        "--capture", choices=("grid", "workloads"), default="grid",
        help="graphs stages on CUDA capture the whole grid (default: the server's start) or only the buckets of the "
        "run's workloads (a shorter run; the record says which)",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the plan's stages and workloads, then exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    plan = load_plan(args.plan or ("gpu-27b" if has_cuda else "cpu-tiny"))
    if plan.device == "cuda" and not has_cuda:
        print(f"plan {plan.name} needs a CUDA device and none is present; use --plan cpu-tiny", file=sys.stderr)
        return 2
    stages = in_ladder_order(args.stages.split(",") if args.stages else plan.stages)
    # before anything imports a Triton kernel or runs a GEMM; the gates' pytest process inherits the environment
    prepare_process([s.name for s in stages if plan.device in s.devices], plan.device)
    fla_pin = pin_fla_configs()  # before anything imports fla; the probes and the gates' pytest inherit the pin
    workloads = resolve(args.workloads.split(",") if args.workloads else plan.workloads)
    if args.list:
        print(f"plan {plan.name}: {plan.description}")
        for stage in stages:
            print(f"  stage {stage.name:<10} {stage.exactness.describe()}; gate {stage.gate_for(plan.device)}")
        for workload in workloads:
            print(f"  workload {workload.id:<34} {workload.description}")
        return 0
    run = Run(plan, stages, workloads, args)
    run.record["fla_configs"] = fla_pin  # each graphs stage's warm-up adds its autotuned keys (graph_cache)
    if plan.device == "cuda" and not args.no_probes:  # before the stages, on an empty GPU; written with the record
        start = time.perf_counter()
        run.record["probes"] = probes.run_probes()
        run.record["timeline_s"]["probes"] = time.perf_counter() - start
    path = run.run()
    print("\n".join(summary_lines(run.record)))
    print(f"\nrun record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
