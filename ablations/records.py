"""Run records: the schema, the validator, the writer and the readers of results/runs/*.json.

One JSON file per run of `python -m ablations.run`, named `<utc>-<gpu or cpu>-<commit7>.json`. The names the figures
and the report read (nesting as shown; a record may hold more):

    schema        "jevlab-run/1"
    complete      false while the run is in progress (the runner rewrites the file after every workload)
    plan          {name, device, shapes, reference, baseline, headline, timer, warmup, runs, ...}
    env           {gpu, driver, torch, triton, cuda, git_commit, git_dirty, utc, device, ...}
    weights       {synthetic, method, model_id, seed, linear_params, ...}
    ceilings      {copy_tbps, bf16_tflops, ...}
    workloads     [{id, group, description, questions, candidates, tokens, max_candidate_tokens}]
    stages        [{name, status, reason, gate, registry, build_s, workloads: [
                      {id, rows, median_ms, p10_ms, p90_ms, samples_ms, kernels_per_forward, gpu_busy_ms,
                       floor_ms, weight_floor_ms, compute_floor_ms, max_abs_dp, hidden_rel_rmse, argmax_flips,
                       probabilities, top_kernels, kernel_families, core_ms, core_multiple, gemm_ms,
                       gemm_multiple, host_median_ms, state_rel_rmse, first_departing_state, vs_builds_on,
                       ...}]}]
    attempts      the record of failed attempts (ablations/attempts.toml) as it stood at the run
    bit_identity  (only when the plan includes the fused stage) {workload, reference, layers: [{index, type}],
                  candidates, tokens, interpreter, note, error, seconds, rows: [
                      {layer, kernel, output, elements, bit_identical, share, max_ulp, max_abs_diff, unwritten,
                       expected, as_expected, and for the flip-model outputs unexplained (absent in older
                       records)}]}: every fused kernel against its reference composition on activations
                  captured from the reference forward (ablations/bit_identity.py); `error` (and no rows) when that
                  step failed; `interpreter` true on the CPU (Triton interpreter numerics, explained in `note`)
    probes        (CUDA plans, from the runner that added them on; absent in older records and with --no-probes)
                  {name: {error, seconds, ...fields}}: the measurements of ablations/probes.py (GEMM row-count
                  invariance, GDN hand-off timing, kernel tiles, whole-model engine checks); validated there

Stage `status`: `ok` (gate green, built, timed), `gate-red` (its gate failed: not timed), `unavailable` (its code is
missing or it cannot run on this device, with the reason), `error` (building or running it raised, with the reason),
`pending` (not finished yet, in an incomplete record). Only `ok` and `pending` stages have workloads.
Nullable by design: `kernels_per_forward` and `gpu_busy_ms` on the CPU (no CUDA kernels); `max_abs_dp` /
`hidden_rel_rmse` until the reference outputs exist (a complete record has them for every timed workload); env `gpu`,
`driver`, `cuda` on the CPU. From the profiled call (GPU only, null on the CPU and absent in records older than
them): `kernel_families` {family: {calls_per_forward, ms_per_forward}} over ablations.timing.FAMILIES; `core_ms` the
summed kernel time of GEMMs + GDN core + attention core per forward and `core_multiple` = median_ms / core_ms;
`gemm_ms` and `gemm_multiple` the same for the GEMMs alone; `idle_between_kernels_ms` and `top_gaps` the time
between kernels in the profiled window and the kernel pairs with the most of it (ablations.timing.kernel_gaps), and
`gpu_non_kernel` the memsets and copies that lie in it (ablations.timing.non_kernel_activity; records after a25795f);
records of 9a6886e also hold `lead_to_first_kernel_ms`, the profiled call's first host event to its first kernel,
since dropped: under the profiler it was 0.9-5.0 ms where the timed medians' excess over busy + idle was 1.2-4.9
(engine/stages/core.md, "Campaign 37");
`host_median_ms` the median host time until a timed call returned (GPU only); `host_profile` (GPU, headline
workload only) cProfile's top functions of one call.
Headline workload only, once the reference states exist: `state_rel_rmse` (relative RMSE against the reference per
residual state: embedding, each layer's output, final norm) and `first_departing_state` (index of the first state
that is not bit-identical, null when none). Every workload of a stage whose `builds_on` stage ran in the same record
(absent in older records): `vs_builds_on` {stage, bitwise, max_abs_dp, hidden_rel_rmse, argmax_flips}: the stage
against the one it replaces (`bitwise` null, and no figures, where the two lay rows out differently).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tomllib
from pathlib import Path
from typing import Any

from ablations.probes import validate_probes

SCHEMA = "jevlab-run/1"
ATTEMPTS_SCHEMA = "jevlab-attempts/1"
RUN_STATUSES = ("ok", "gate-red", "unavailable", "error", "pending")
GATE_OUTCOMES = ("green", "red")
ATTEMPT_OUTCOMES = ("failed", "rejected", "superseded")
ATTEMPTS_FILE = Path(__file__).resolve().parent / "attempts.toml"

STR, BOOL, NUM, INT, LIST, DICT = "str", "bool", "number", "int", "list", "dict"

TOP = {"schema": STR, "complete": BOOL, "plan": DICT, "env": DICT, "weights": DICT, "ceilings": DICT,
       "workloads": LIST, "stages": LIST, "attempts": LIST}  # fmt: skip
PLAN = {"name": STR, "device": STR, "shapes": STR, "reference": STR, "baseline": STR, "headline": STR, "timer": STR,
        "warmup": INT, "runs": INT}  # fmt: skip
ENV = {"gpu": (STR, None), "driver": (STR, None), "torch": STR, "triton": (STR, None), "cuda": (STR, None),
       "git_commit": STR, "git_dirty": BOOL, "utc": STR, "device": STR}  # fmt: skip
WEIGHTS = {"synthetic": BOOL, "method": STR, "linear_params": INT}
CEILINGS = {"copy_tbps": NUM, "bf16_tflops": NUM}
WORKLOAD_DEF = {"id": STR, "questions": INT, "candidates": INT, "tokens": INT}
STAGE = {"name": STR, "status": STR, "reason": (STR, None), "gate": (DICT, None), "workloads": LIST}
GATE = {"node": STR, "outcome": STR, "exit_code": INT}
MEASURED = {"id": STR, "rows": INT, "median_ms": NUM, "p10_ms": NUM, "p90_ms": NUM, "samples_ms": LIST,
            "kernels_per_forward": (NUM, None), "gpu_busy_ms": (NUM, None), "floor_ms": NUM,
            "max_abs_dp": (NUM, None), "hidden_rel_rmse": (NUM, None)}  # fmt: skip
BIT_IDENTITY = {"workload": STR, "reference": STR, "layers": LIST, "rows": LIST, "interpreter": BOOL,
                "note": (STR, None), "error": (STR, None)}  # fmt: skip
BIT_LAYER = {"index": INT, "type": STR}
BIT_ROW = {"layer": INT, "kernel": STR, "output": STR, "elements": INT, "bit_identical": INT, "share": NUM,
           "max_ulp": INT, "max_abs_diff": (NUM, None), "unwritten": INT, "expected": STR,
           "as_expected": BOOL}  # fmt: skip
ATTEMPT = {"id": STR, "stage": STR, "title": STR, "outcome": STR, "reason": STR, "numbers": DICT, "evidence": STR,
           "date": STR}  # fmt: skip


class RecordError(ValueError):
    """A run record (or attempts record) that does not meet the schema; the message lists every problem."""


def _is(value: Any, kind: str) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUM:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind == LIST:
        return isinstance(value, list)
    if kind == DICT:
        return isinstance(value, dict)
    raise AssertionError(kind)


def _check_fields(obj: Any, spec: dict[str, Any], where: str, problems: list[str]) -> bool:
    """Append a problem for each missing or mistyped name; a spec value (KIND, None) allows null."""
    if not isinstance(obj, dict):
        problems.append(f"{where}: expected an object, got {type(obj).__name__}")
        return False
    for name, kind in spec.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if name not in obj:
            problems.append(f"{where}.{name}: missing")
        elif not any(obj[name] is None if k is None else _is(obj[name], k) for k in kinds):
            allowed = " or ".join("null" if k is None else k for k in kinds)
            problems.append(f"{where}.{name}: expected {allowed}, got {obj[name]!r:.80}")
    return True


def _check_measured(workload: dict, where: str, complete: bool, problems: list[str]) -> None:
    if not _check_fields(workload, MEASURED, where, problems):
        return
    samples = workload.get("samples_ms")
    if not isinstance(samples, list) or not samples or not all(_is(s, NUM) and s > 0 for s in samples):
        problems.append(f"{where}.samples_ms: expected a non-empty list of positive numbers")
        return
    if not all(_is(workload.get(k), NUM) for k in ("median_ms", "p10_ms", "p90_ms")):
        return
    if not math.isclose(workload["median_ms"], statistics.median(samples), rel_tol=1e-9):
        problems.append(f"{where}.median_ms: {workload['median_ms']} is not the median of samples_ms")
    if not workload["p10_ms"] <= workload["median_ms"] <= workload["p90_ms"]:
        problems.append(f"{where}: expected p10_ms <= median_ms <= p90_ms")
    if complete and (workload.get("max_abs_dp") is None or workload.get("hidden_rel_rmse") is None):
        problems.append(f"{where}: a complete record compares every timed workload with the reference")


def validate_record(record: Any) -> None:
    """Raise RecordError listing every problem, or return None for a record that meets the schema."""
    problems: list[str] = []
    if not _check_fields(record, TOP, "record", problems):
        raise RecordError("; ".join(problems))
    if record.get("schema") != SCHEMA:
        problems.append(f"record.schema: expected {SCHEMA!r}, got {record.get('schema')!r}")
    for name, spec in (("plan", PLAN), ("env", ENV), ("weights", WEIGHTS), ("ceilings", CEILINGS)):
        if isinstance(record.get(name), dict):
            _check_fields(record[name], spec, name, problems)
    for i, workload in enumerate(record.get("workloads") or []):
        _check_fields(workload, WORKLOAD_DEF, f"workloads[{i}]", problems)
    complete = record.get("complete") is True
    for i, stage in enumerate(record.get("stages") or []):
        where = f"stages[{i}]"
        if not _check_fields(stage, STAGE, where, problems):
            continue
        status = stage.get("status")
        if status not in RUN_STATUSES:
            problems.append(f"{where}.status: {status!r} is not one of {RUN_STATUSES}")
        if complete and status == "pending":
            problems.append(f"{where}.status: a complete record has no pending stage")
        if status in ("gate-red", "unavailable", "error") and not stage.get("reason"):
            problems.append(f"{where}.reason: a {status} stage says why")
        gate = stage.get("gate")
        if isinstance(gate, dict) and _check_fields(gate, GATE, f"{where}.gate", problems):
            if gate.get("outcome") not in GATE_OUTCOMES:
                problems.append(f"{where}.gate.outcome: {gate.get('outcome')!r} is not one of {GATE_OUTCOMES}")
            elif status == "ok" and gate["outcome"] != "green":
                problems.append(f"{where}: timed although its gate is {gate['outcome']}")
        if status == "ok" and gate is None:
            problems.append(f"{where}: timed without a gate")
        workloads = stage.get("workloads") or []
        if status not in ("ok", "pending") and workloads:
            problems.append(f"{where}.workloads: only an ok (or, while running, pending) stage has timings")
        for j, workload in enumerate(workloads):
            _check_measured(workload, f"{where}.workloads[{j}]", complete, problems)
    for i, attempt in enumerate(record.get("attempts") or []):
        _check_attempt(attempt, f"attempts[{i}]", problems)
    if "bit_identity" in record:
        _check_bit_identity(record["bit_identity"], problems)
    if "probes" in record:
        problems += validate_probes(record["probes"])
    if problems:
        raise RecordError("; ".join(problems))


def _check_bit_identity(result: Any, problems: list[str]) -> None:
    """The optional per-kernel bit-identity table: rows on the listed layers with consistent counts, and either
    rows or an error."""
    where = "bit_identity"
    if not _check_fields(result, BIT_IDENTITY, where, problems):
        return
    layers = set()
    for i, layer in enumerate(result.get("layers") or []):
        if _check_fields(layer, BIT_LAYER, f"{where}.layers[{i}]", problems) and _is(layer.get("index"), INT):
            layers.add(layer["index"])
    rows = result.get("rows") if isinstance(result.get("rows"), list) else []
    if not result.get("error") and not rows:
        problems.append(f"{where}: no rows and no error")
    if result.get("error") and rows:
        problems.append(f"{where}: rows and an error at once")
    for i, row in enumerate(rows):
        at = f"{where}.rows[{i}]"
        if not _check_fields(row, BIT_ROW, at, problems):
            continue
        if "unexplained" in row and not (_is(row["unexplained"], INT) and row["unexplained"] >= 0):
            problems.append(f"{at}.unexplained: expected an int >= 0, got {row['unexplained']!r:.80}")
        if not all(_is(row.get(k), kind) for k, kind in (("elements", INT), ("bit_identical", INT), ("share", NUM))):
            continue
        if row.get("layer") not in layers:
            problems.append(f"{at}.layer: {row.get('layer')!r} is not one of the listed layers")
        if not 0 <= row["bit_identical"] <= row["elements"]:
            problems.append(f"{at}: expected 0 <= bit_identical <= elements")
        elif not math.isclose(row["share"], row["bit_identical"] / max(1, row["elements"]), rel_tol=1e-12):
            problems.append(f"{at}.share: {row['share']} is not bit_identical / elements")


def _check_attempt(attempt: Any, where: str, problems: list[str]) -> None:
    if _check_fields(attempt, ATTEMPT, where, problems) and attempt.get("outcome") not in ATTEMPT_OUTCOMES:
        problems.append(f"{where}.outcome: {attempt.get('outcome')!r} is not one of {ATTEMPT_OUTCOMES}")


def load_attempts(path: Path = ATTEMPTS_FILE) -> list[dict]:
    """The record of failed attempts, validated."""
    data = tomllib.loads(path.read_text())
    problems: list[str] = []
    if data.get("schema") != ATTEMPTS_SCHEMA:
        problems.append(f"{path.name}: schema must be {ATTEMPTS_SCHEMA!r}")
    attempts = data.get("attempts")
    if not isinstance(attempts, list):
        problems.append(f"{path.name}: attempts must be a list")
        attempts = []
    for i, attempt in enumerate(attempts):
        _check_attempt(attempt, f"{path.name} attempts[{i}]", problems)
    ids = [a.get("id") for a in attempts if isinstance(a, dict)]
    if len(ids) != len(set(ids)):
        problems.append(f"{path.name}: attempt ids must be unique")
    if problems:
        raise RecordError("; ".join(problems))
    return attempts


def write_record(record: dict, path: Path) -> Path:
    """Validate, then write atomically (a reader never sees half a file)."""
    validate_record(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    os.replace(partial, path)
    return path


def read_record(path: Path) -> dict:
    record = json.loads(Path(path).read_text())
    try:
        validate_record(record)
    except RecordError as error:
        raise RecordError(f"{path}: {error}") from None
    return record


def all_records(runs_dir: Path) -> list[tuple[Path, dict]]:
    """Every record under `runs_dir`, complete or partial, each validated; oldest first (by env.utc, then file name)."""
    found = [(path, read_record(path)) for path in Path(runs_dir).glob("*.json")]
    return sorted(found, key=lambda item: (item[1]["env"]["utc"], item[0].name))


def whole_ladder(plan: dict) -> bool:
    """Whether a run took its plan's headline workload and every stage of the plan (`--workloads` and `--stages` can
    leave them out; older records, without `requested_stages`, took every stage)."""
    took_every_stage = set(plan.get("requested_stages", plan.get("stages", []))) >= set(plan.get("stages", []))
    return took_every_stage and plan["headline"] not in plan.get("omitted_workloads", [])


def newest_records(runs_dir: Path) -> list[tuple[Path, dict]]:
    """The records that stand for their plans (figures, report, notebooks): per plan, the newest complete record, and
    the newest partial record when it is newer than that one (or the plan has no complete record). Every record is
    validated (a partial one too); newest by env.utc, then file name. Only `whole_ladder` records are chosen: every
    figure leads with the headline and shows the whole ladder. The others stay in results/runs/ and are cited where
    they are used (the report's targets)."""
    complete: dict[str, tuple[Path, dict]] = {}
    partial: dict[str, tuple[Path, dict]] = {}
    for path, record in all_records(runs_dir):
        if whole_ladder(record["plan"]):
            (complete if record["complete"] else partial)[record["plan"]["name"]] = (path, record)
    chosen = list(complete.values())
    for name, (path, record) in partial.items():
        if name not in complete or record["env"]["utc"] > complete[name][1]["env"]["utc"]:
            chosen.append((path, record))
    return chosen


def newest_per_plan(runs_dir: Path) -> dict[str, tuple[Path, dict]]:
    """The newest complete record of each plan among `newest_records`."""
    return {r["plan"]["name"]: (path, r) for path, r in newest_records(runs_dir) if r["complete"]}


def notebook_record(runs_dir: Path, plan: str) -> dict:
    """The record a notebook reads: the newest complete whole-ladder record of `plan`, else the newest complete one of
    any plan (a checkout with CPU records only). Raises SystemExit with the folder when there is none."""
    newest = newest_per_plan(runs_dir)
    chosen = [newest[plan][1]] if plan in newest else [record for _, record in newest.values()]
    if not chosen:
        raise SystemExit(f"no complete run record under {runs_dir}")
    return max(chosen, key=lambda r: r["env"]["utc"])


# ---------------------------------------------------------------------------------------------- reading a record
STATUS_TEXT = {"gate-red": "gate red", "unavailable": "unavailable", "error": "error",
               "pending": "not reached (run stopped)"}  # fmt: skip
# The README block that `paper.figures` rewrites from the records (a run's dirty flag ignores it, ablations/envinfo.py).
README_BLOCK = ("<!-- results:ladder -->", "<!-- /results:ladder -->")
SERVING_BLOCK = ("<!-- results:serving -->", "<!-- /results:serving -->")
GENERATED_BLOCKS = (README_BLOCK, SERVING_BLOCK)  # the README's parts paper.figures writes
DASH = "–"  # a number that is absent


def ms(value: float | None) -> str:
    """Milliseconds with 3-4 significant digits (1 decimal from 100 ms, 2 from 1 ms, else 3), or a dash."""
    if value is None:
        return DASH
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def sci(value: float | None) -> str:
    """A small quantity (|dp|, relative RMSE) in scientific notation, exact 0 as "0", or a dash."""
    return DASH if value is None else "0" if value == 0 else f"{value:.2e}"


def stage_by_name(record: dict, name: str) -> dict | None:
    return next((s for s in record["stages"] if s["name"] == name), None)


def measured(stage: dict, workload_id: str) -> dict | None:
    """The stage's measurement of one workload, or None."""
    return next((w for w in stage["workloads"] if w["id"] == workload_id), None)


def has_timings(stage: dict) -> bool:
    """Timed stages: `ok`, or `pending` with workloads (a partial record's stage that was cut short)."""
    return stage["status"] == "ok" or (stage["status"] == "pending" and bool(stage["workloads"]))


def headline_of(record: dict, name: str) -> tuple[dict | None, str]:
    """The headline measurement of stage `name`, or None and why it is missing."""
    stage = stage_by_name(record, name)
    if stage is None:
        return None, f"{name} is not in this plan"
    w = measured(stage, record["plan"]["headline"]) if has_timings(stage) else None
    if w is None:
        status = STATUS_TEXT.get(stage["status"], stage["status"])
        return None, f"{name} not timed on {record['plan']['headline']}: {status}"
    return w, ""
