"""Figures and report tables from run records alone (results/runs/*.json); no GPU, no model code.

    python -m paper.figures [--results DIR] [--plan NAME] [--record PATH ...] [--svg]

Picks, per plan, the newest complete record and, when a partial record (`complete: false`: the run stopped or is
still running) is newer than it, that partial record too (or the records named with `--record`, or only `--plan`).
A partial record is labelled as such wherever it appears (figure titles, summary, README block, report), with what
it holds, and its figure files end in `-partial`. For each record it writes, under `<results>/figures/`:

* `ladder-<plan>.png`: one bar per stage on the plan's headline workload, median ms with the p10-p90 range, the
  speed-up over the plan's baseline stage written on each bar, and the floor of each stage (the larger of the
  weight-streaming and compute floors for the rows that stage computes) drawn as a line across its bar;
  stages that were not timed appear as empty slots naming their status (a partial record's stage that was still
  pending draws its bar where the headline was timed, else "not reached (run stopped)").
* `workloads-<plan>.png`: median ms of every stage on every workload (grouped bars, log scale).
* `kernels-<plan>.png`: kernels per forward and GPU-busy ms against wall ms per stage on the headline workload.
* `time-<plan>.png`: where the time of one headline forward goes, per stage: summed kernel ms per family (GEMM, GDN
  core, attention core, our kernels, other) stacked, the rest of the median as GPU idle, and the host's launch time
  marked (records without per-family kernel times get a figure that says so).
* `states-<plan>.png`: where each path departs from the plan's reference on the headline workload: the relative
  RMSE of every residual state (embedding, the output of each layer, the final norm) per stage, log scale, with
  bit-identical states on a labelled floor band and each stage's first departing state starred; full-attention
  layers shaded (records older than the per-state comparison get a figure that says so).
* `summary.json`: every number and table the report shows, already formatted, so `paper/report.typ` only lays
  them out (it reads this file and the PNGs, nothing else); among them the targets of issues 4 and 5 (`TARGETS`) on
  the headline workload, each met, missed or not measured (issue 5's hand-off target from the newest
  `gpu/*-gdn-handoff.json` of tests/test_gpu_tree.py, on GPU plans).

When the results folder is the checkout's own, the ladder table of each plan is also written into README.md between
the `<!-- results:ladder -->` and `<!-- /results:ladder -->` markers, so the README never carries a hand-typed figure.

`--results` defaults to `$JEVLAB_RESULTS` or `results/` of the checkout. Every figure names its plan and machine,
and the CPU plan is labelled as such; probabilities appear only in the correctness table, beside the
synthetic-weights statement of the record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)
from matplotlib.ticker import NullLocator  # noqa: E402

from ablations.records import all_records, newest_records, read_record  # noqa: E402
from reference.shapes import get_shapes  # noqa: E402  (dataclasses only: no torch)

REPO = Path(__file__).resolve().parents[1]
SUMMARY_SCHEMA = "jevlab-report-summary/1"
STATUS_TEXT = {"gate-red": "gate red", "unavailable": "unavailable", "error": "error",
               "pending": "not reached (run stopped)"}  # fmt: skip
DASH = "–"


def results_dir(value: str | None) -> Path:
    return Path(value or os.environ.get("JEVLAB_RESULTS") or REPO / "results")


# ------------------------------------------------------------------------------------------------ formatting
def ms(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def sci(value: float | None) -> str:
    return DASH if value is None else "0" if value == 0 else f"{value:.2e}"


def machine(env: dict) -> str:
    return env["gpu"] if env.get("gpu") else f"CPU only ({env.get('cpu') or 'unknown CPU'})"


def plan_label(record: dict) -> str:
    plan = record["plan"]
    label = f"{plan['name']} on {machine(record['env'])}"
    return label + " [CPU plan: tiny shapes, says nothing about GPU latency]" if plan["device"] == "cpu" else label


def measured(stage: dict, workload_id: str) -> dict | None:
    return next((w for w in stage["workloads"] if w["id"] == workload_id), None)


def stage_by_name(record: dict, name: str) -> dict | None:
    return next((s for s in record["stages"] if s["name"] == name), None)


def is_partial(record: dict) -> bool:
    return not record["complete"]


def completeness(record: dict) -> str:
    """What the record holds: a complete run, or (partial) how many workloads each pending stage timed."""
    omitted = record["plan"].get("omitted_workloads") or []
    without = f" (without {', '.join(omitted)}: not requested)" if omitted else ""
    if not is_partial(record):
        return "complete run" + without
    total = len(record["workloads"])
    parts = ["partial run: stopped before completion" + without]
    for stage in record["stages"]:
        if stage["status"] == "pending":
            done = len(stage["workloads"])
            parts.append(
                f"{stage['name']} timed on {done} of {total} workloads" if done else f"{stage['name']} not reached"
            )
    return "; ".join(parts)


def record_label(record: dict) -> str:
    """The plan label, marked when the record is partial."""
    return f"{plan_label(record)} — partial run" if is_partial(record) else plan_label(record)


def has_timings(stage: dict) -> bool:
    """Timed stages: `ok`, or `pending` with workloads (a partial record's stage that was cut short)."""
    return stage["status"] == "ok" or (stage["status"] == "pending" and bool(stage["workloads"]))


def stage_heading(stage: dict, record: dict) -> str:
    """The stage's name, with how far it got when it was still pending."""
    if stage["status"] != "pending":
        return stage["name"]
    return f"{stage['name']} (partial: {len(stage['workloads'])} of {len(record['workloads'])})"


def status_text(stage: dict, record: dict) -> str:
    if stage["status"] != "pending":
        return stage["status"]
    if not stage["workloads"]:
        return STATUS_TEXT["pending"]
    return f"pending: timed on {len(stage['workloads'])} of {len(record['workloads'])} workloads"


# ------------------------------------------------------------------------------------------------ tables
def ladder_rows(record: dict) -> list[dict[str, Any]]:
    """One row per stage on the headline workload, with the speed-up over the baseline stage where both ran."""
    headline, baseline_name = record["plan"]["headline"], record["plan"]["baseline"]
    baseline_stage = stage_by_name(record, baseline_name)
    baseline = measured(baseline_stage, headline) if baseline_stage else None
    rows = []
    for stage in record["stages"]:
        w = measured(stage, headline) if has_timings(stage) else None
        rows.append(
            {
                "stage": stage["name"],
                "status": stage["status"],
                "status_text": status_text(stage, record),
                "heading": stage_heading(stage, record) if w else stage["name"],
                "reason": stage["reason"],
                "gate": stage["gate"]["outcome"] if stage["gate"] else DASH,
                "median_ms": w["median_ms"] if w else None,
                "p10_ms": w["p10_ms"] if w else None,
                "p90_ms": w["p90_ms"] if w else None,
                "speedup": baseline["median_ms"] / w["median_ms"] if w and baseline else None,
                "floor_ms": w["floor_ms"] if w else None,
                "floor_multiple": w["median_ms"] / w["floor_ms"] if w else None,
                "kernels": w["kernels_per_forward"] if w else None,
                "gpu_busy_ms": w["gpu_busy_ms"] if w else None,
                "rows": w["rows"] if w else None,
            }
        )
    return rows


def ladder_table(record: dict) -> list[list[str]]:
    baseline = record["plan"]["baseline"]
    header = ["stage", "status", "gate", "rows", "median ms", "p10–p90 ms", f"× vs {baseline}", "floor ms",
              "× floor", "kernels", "GPU busy ms"]  # fmt: skip
    table = [header]
    for r in ladder_rows(record):
        spread = f"{ms(r['p10_ms'])}–{ms(r['p90_ms'])}" if r["median_ms"] is not None else DASH
        table.append(
            [
                r["stage"],
                r["status_text"],
                r["gate"],
                DASH if r["rows"] is None else f"{r['rows']:,}",
                ms(r["median_ms"]),
                spread,
                DASH if r["speedup"] is None else f"{r['speedup']:.2f}×",
                ms(r["floor_ms"]),
                DASH if r["floor_multiple"] is None else f"{r['floor_multiple']:.1f}",
                DASH if r["kernels"] is None else f"{r['kernels']:,.0f}",
                ms(r["gpu_busy_ms"]),
            ]
        )
    return table


def workload_table(record: dict) -> list[list[str]]:
    """Median ms (p10–p90) per workload (rows) and stage (columns); a stage cut short by a partial run says so."""
    timed = [s for s in record["stages"] if has_timings(s)]
    table = [["workload", "candidates", "tokens", *(stage_heading(s, record) for s in timed)]]
    for workload in record["workloads"]:
        cells = []
        for stage in timed:
            w = measured(stage, workload["id"])
            cells.append(DASH if w is None else f"{ms(w['median_ms'])} ({ms(w['p10_ms'])}–{ms(w['p90_ms'])})")
        table.append([workload["id"], str(workload["candidates"]), f"{workload['tokens']:,}", *cells])
    return table


def correctness_table(record: dict) -> list[list[str]]:
    reference = record["plan"]["reference"]
    table = [["stage", "workload", f"max |dp| vs {reference}", "hidden rel RMSE", "argmax flips"]]
    for stage in record["stages"]:
        for w in stage["workloads"]:
            flips = DASH if w.get("argmax_flips") is None else str(w["argmax_flips"])
            name = stage_heading(stage, record)
            table.append([name, w["id"], sci(w["max_abs_dp"]), sci(w["hidden_rel_rmse"]), flips])
    return table


NOT_MEASURED = "Not measured in this record"
LAYER_KIND = {"linear_attention": "GDN", "full_attention": "attention"}


def share_text(identical: int, elements: int) -> str:
    """Percent bit-identical, never rounded up to 100 % unless every element is identical."""
    if identical == elements:
        return "100 %"
    return f"{int(1_000_000 * identical / max(1, elements)) / 10_000:.4f} %"


def bit_identity_summary(record: dict) -> dict[str, Any]:
    """The per-kernel bit-identity table of a record (`record["bit_identity"]`) with the sentence that introduces it;
    `measured` false (and the sentence says why) when the record has no such table or the step failed."""
    result = record.get("bit_identity")
    if result is None:
        text = f"{NOT_MEASURED} (it predates the bit-identity step, or its plan has no fused stage)."
        return {"measured": False, "text": text, "table": []}
    if result["error"]:
        return {"measured": False, "text": f"{NOT_MEASURED}: the step failed ({result['error']}).", "table": []}
    layers = ", ".join(f"{one['index']} ({LAYER_KIND.get(one['type'], one['type'])})" for one in result["layers"])
    rows = result["rows"]
    as_expected = sum(1 for r in rows if r["as_expected"])
    text = (
        f"Inputs captured from the {result['reference']} forward of the {result['workload']} request "
        f"({result.get('candidates')} candidates, {result.get('tokens')} real tokens) at layers {layers}; each kernel "
        f"wrote NaN-poisoned outputs and was compared with its reference composition (reference/ops.py) on the same "
        f"inputs. {as_expected} of {len(rows)} outputs meet their declared exactness."
    )
    missed = [f"layer {r['layer']} {r['kernel']}.{r['output']}" for r in rows if not r["as_expected"]]
    if missed:
        text += f" NOT as declared ({len(missed)}, marked NO below): {', '.join(missed)}."
    if result["interpreter"]:
        text += f" {result['note']}."
    table = [["layer", "kernel", "output", "elements", "bit-identical", "max ulp", "max |diff|", "unexplained",
              "expected", "met"]]  # fmt: skip
    for r in rows:
        diff = "NaN left" if r["max_abs_diff"] is None else sci(r["max_abs_diff"])
        unexplained = DASH if r.get("unexplained") is None else f"{r['unexplained']:,}"  # flip-model outputs only
        table.append([str(r["layer"]), r["kernel"], r["output"], f"{r['elements']:,}",
                      share_text(r["bit_identical"], r["elements"]), str(r["max_ulp"]), diff, unexplained,
                      r["expected"], "yes" if r["as_expected"] else "NO"])  # fmt: skip
    return {"measured": True, "text": text, "table": table}


NO_STATES = (
    "Not measured in this record: the runner compares every residual state of the headline with the reference "
    "from commit 8eaec7d on (older records have only the final hidden states)."
)


def state_name(index: int, count: int) -> str:
    """Residual state `index` of `count` (num_layers + 2): "embedding", "layer k" (the stream after the k-th layer,
    counted from 1) or "final norm"."""
    if index == 0:
        return "embedding"
    return "final norm" if index == count - 1 else f"layer {index}"


def layer_types_of(record: dict) -> list[str] | None:
    """The record's layer pattern from reference/shapes.py (its shapes name), or None for shapes not known here."""
    name = record["weights"].get("shapes") or record["plan"]["shapes"]
    try:
        return get_shapes(name).layer_types
    except ValueError:
        return None


def departure_rows(record: dict) -> list[dict[str, Any]]:
    """Per stage other than the reference, on the headline: the relative RMSE of every residual state and the first
    state that is not bit-identical (`states` None when the record does not carry them), and why when not timed."""
    headline, reference = record["plan"]["headline"], record["plan"]["reference"]
    rows = []
    for stage in record["stages"]:
        if stage["name"] == reference:
            continue
        w = measured(stage, headline) if has_timings(stage) else None
        rows.append(
            {
                "stage": stage["name"],
                "heading": stage_heading(stage, record) if w else stage["name"],
                "timed": w is not None,
                "status_text": STATUS_TEXT.get(stage["status"], stage["status"]),
                "states": _field(w, "state_rel_rmse"),
                "first": _field(w, "first_departing_state"),
                "max_abs_dp": _field(w, "max_abs_dp"),
            }
        )
    return rows


def departure_text(row: dict[str, Any]) -> str:
    """The first departing state of a row as the table shows it."""
    if not row["timed"]:
        return f"not timed: {row['status_text']}"
    if row["states"] is None:
        return "not measured"
    if row["first"] is None:
        return "none: bitwise"
    return state_name(row["first"], len(row["states"]))


def departures_summary(record: dict) -> dict[str, Any]:
    """The table beside the states figure and the sentence that introduces it; `measured` false (and the sentence
    says why) when no stage carries the per-state comparison."""
    rows = departure_rows(record)
    headline, reference = record["plan"]["headline"], record["plan"]["reference"]
    statement = record["weights"].get("statement") or "Synthetic weights."
    if not any(r["states"] is not None for r in rows):
        return {"measured": False, "text": f"{NO_STATES} {statement}", "table": []}
    count = len(next(r["states"] for r in rows if r["states"] is not None))
    last = count - 2
    workload = next(w for w in record["workloads"] if w["id"] == headline)
    types = layer_types_of(record)
    text = (
        f"Against {reference} (the plan's reference), on the {headline} request: the relative RMSE "
        f"||h − h_ref|| / ||h_ref|| of every residual state over all real tokens of all {workload['candidates']} "
        f"candidates ({workload['tokens']:,} tokens), and the first state that is not bit-identical to the "
        f"reference's. Layers count from 1: layer k is the residual stream after the k-th of {last} layers."
    )
    if types is not None and len(types) == last:
        attention = [str(i + 1) for i, t in enumerate(types) if t == "full_attention"]
        text += f" Full-attention layers: {', '.join(attention)}; the others are Gated DeltaNet."
    text += f" {statement} The states measure how far two code paths drift apart, not decision accuracy."
    header = ["stage", "first departing state", "rel RMSE layer 1", f"rel RMSE layer {last}",
              "rel RMSE final norm", "largest rel RMSE (state)", f"max |dp| vs {reference}"]  # fmt: skip
    table = [header]
    for r in rows:
        states = r["states"]
        if states is None:
            table.append([r["heading"], departure_text(r), DASH, DASH, DASH, DASH, sci(r["max_abs_dp"])])
            continue
        largest = max(range(len(states)), key=states.__getitem__)
        largest_text = "0" if states[largest] == 0 else f"{sci(states[largest])} ({state_name(largest, len(states))})"
        table.append([r["heading"], departure_text(r), sci(states[1]), sci(states[-2]), sci(states[-1]),
                      largest_text, sci(r["max_abs_dp"])])  # fmt: skip
    missing = [r["stage"] for r in rows if r["timed"] and r["states"] is None]
    if missing:
        text += f" No per-state comparison for: {', '.join(missing)}."
    return {"measured": True, "text": text, "table": table}


# Kernel families in drawing order (the runner's ablations.timing.FAMILIES; a test checks the two agree).
FAMILY_ORDER = ("gemm", "gdn_core", "attention_core", "ours", "other")
FAMILY_TEXT = {"gemm": "GEMM", "gdn_core": "GDN core", "attention_core": "attention core", "ours": "our",
               "other": "other"}  # fmt: skip
NO_FAMILIES_SHORT = "no per-family kernel times in this record (older runner or CPU run)"
NO_FAMILIES = (
    "No per-family kernel times in this record: the runner records them on the GPU only, from commit a12d567 on "
    "(older records and CPU runs have none)."
)


def time_rows(record: dict) -> list[dict[str, Any]]:
    """Per stage timed on the headline with per-family kernel times: family ms and calls per forward, GPU idle =
    median minus the summed kernel ms (clipped at 0), and the host's launch time."""
    headline = record["plan"]["headline"]
    rows = []
    for stage in record["stages"]:
        w = measured(stage, headline) if has_timings(stage) else None
        families = w.get("kernel_families") if w else None
        if not families:
            continue
        names = [f for f in FAMILY_ORDER if f in families] + sorted(set(families) - set(FAMILY_ORDER))
        kernel_ms = sum(families[f]["ms_per_forward"] for f in names)
        rows.append(
            {
                "stage": stage["name"],
                "heading": stage_heading(stage, record),
                "median_ms": w["median_ms"],
                "families": {f: families[f] for f in names},
                "kernel_ms": kernel_ms,
                "idle_ms": max(0.0, w["median_ms"] - kernel_ms),
                "host_median_ms": w.get("host_median_ms"),
                "core_multiple": w.get("core_multiple"),
                "gemm_multiple": w.get("gemm_multiple"),
            }
        )
    return rows


def time_summary(record: dict) -> dict[str, Any]:
    """The table beside the time figure; `measured` false (with the reason) when the record has no families."""
    rows = time_rows(record)
    if not rows:
        return {"measured": False, "text": NO_FAMILIES, "table": []}
    families = list(dict.fromkeys(f for r in rows for f in r["families"]))
    header = ["stage", "median ms", *(f"{FAMILY_TEXT.get(f, f)} ms (calls)" for f in families), "GPU idle ms",
              "host launch ms", "host / median", "× core", "× GEMM"]  # fmt: skip
    table = [header]
    for r in rows:
        cells = []
        for f in families:
            family = r["families"].get(f)
            cells.append(
                DASH if family is None else f"{ms(family['ms_per_forward'])} ({family['calls_per_forward']:,.0f})"
            )
        host = r["host_median_ms"]
        table.append([r["heading"], ms(r["median_ms"]), *cells, ms(r["idle_ms"]), ms(host),
                      DASH if host is None else f"{host / r['median_ms']:.0%}",
                      DASH if r["core_multiple"] is None else f"{r['core_multiple']:.2f}×",
                      DASH if r["gemm_multiple"] is None else f"{r['gemm_multiple']:.2f}×"])  # fmt: skip
    missing = [s["name"] for s in record["stages"] if has_timings(s) and s["name"] not in {r["stage"] for r in rows}]
    text = (
        f"Kernel time per family of one profiled {record['plan']['headline']} forward (torch profiler; kernels that "
        "overlap are each counted), GPU idle = median minus those kernels (launch gaps and host waits), and the "
        "median host time until the timed call returned (close to the median: the forward is launch-bound). "
        "× core = median / (GEMM + GDN core + attention core); × GEMM = median / GEMM."
    )
    if missing:
        text += f" No per-family times for: {', '.join(missing)}."
    return {"measured": True, "text": text, "table": table}


# The targets of the issues, on the headline workload. `limit` None: the limit is another measurement (see `what`).
TARGETS: dict[str, dict[str, Any]] = {
    "fused_kernels": {"issue": 4, "stage": "fused", "limit": 700, "what": "kernels per fused forward <= 700"},
    "fused_core_multiple": {"issue": 4, "stage": "fused", "limit": 1.10,
                            "what": "fused median <= 1.10 × its core kernel time (GEMM + GDN core + attention core)"},
    "fused_fidelity": {"issue": 4, "stage": "fused", "limit": None,
                       "what": "fused max |dp| vs the reference <= hf_torch's max |dp| in the same record"},
    "tree_gemm_multiple": {"issue": 5, "stage": "tree", "limit": 1.25,
                           "what": "tree median <= 1.25 × its GEMM kernel time"},
    "tree_rows_share": {"issue": 5, "stage": "tree", "limit": 0.45,
                        "what": "tree rows <= 45 % of the unshared packed rows"},
    "tree_bitwise_vs_fused": {"issue": 5, "stage": "tree", "limit": 0,
                              "what": "tree answers bit-identical to fused (tree off) on every workload of the record"},
    "tree_handoff_core_time": {"issue": 5, "stage": "tree", "limit": 1.30,
                               "what": "GDN-core kernel time with state hand-off <= 1.3 × prefilling the context "
                                       "once (4k-token single question, 5 candidates; GPU test, not the run record)"},
}  # fmt: skip
MET, MISSED, NOT_MEASURED_TARGET = "met", "missed", "not measured"


def _headline_of(record: dict, name: str) -> tuple[dict | None, str]:
    """The headline measurement of stage `name`, or None and why it is missing."""
    stage = stage_by_name(record, name)
    if stage is None:
        return None, f"{name} is not in this plan"
    w = measured(stage, record["plan"]["headline"]) if has_timings(stage) else None
    if w is None:
        status = STATUS_TEXT.get(stage["status"], stage["status"])
        return None, f"{name} not timed on {record['plan']['headline']}: {status}"
    return w, ""


def _field(w: dict | None, name: str) -> Any:
    return None if w is None else w.get(name)


def _target(target_id: str, value: float | None, limit: float | None, shown: str, limit_shown: str,
            note: str) -> dict[str, Any]:  # fmt: skip
    if value is None or limit is None:
        outcome = NOT_MEASURED_TARGET
    else:
        outcome = MET if value <= limit else MISSED
    spec = TARGETS[target_id]
    return {"id": target_id, "issue": spec["issue"], "what": spec["what"], "value": value, "limit": limit,
            "measured": shown if value is not None else DASH, "limit_text": limit_shown, "outcome": outcome,
            "note": note}  # fmt: skip


def _multiple_target(key: str, workload: dict | None, why: str, kind: str) -> dict[str, Any]:
    """A "median <= limit x kernel time" target: kind "core" (GEMM + GDN core + attention core) or "gemm"."""
    multiple = _field(workload, f"{kind}_multiple")
    note = why or ("" if multiple is not None else NO_FAMILIES_SHORT)
    if multiple is not None:
        label = "core kernels" if kind == "core" else "GEMM kernels"
        kernel_ms = workload[f"{kind}_ms"]
        note = f"median {ms(workload['median_ms'])} ms, {label} {ms(kernel_ms)} ms"
        busy = workload.get("gpu_busy_ms")
        if busy is not None and kernel_ms:  # what the multiple would be with no host time in the way
            note += f"; GPU busy {ms(busy)} ms = {busy / kernel_ms:.2f}× (the multiple if launches cost nothing)"
    limit = TARGETS[key]["limit"]
    shown = DASH if multiple is None else f"{multiple:.2f}×"
    return _target(key, multiple, limit, shown, f"{limit:.2f}×", note)


def _state_tally(fused: dict | None, torch_w: dict | None) -> str:
    """ ", hidden states: fused no farther than hf_torch at k of n residual states" from the headline's per-state
    relative RMSE (records that have it), or ""."""
    mine, theirs = _field(fused, "state_rel_rmse"), _field(torch_w, "state_rel_rmse")
    if not mine or not theirs or len(mine) != len(theirs):
        return ""
    closer = sum(a <= b for a, b in zip(mine, theirs))
    return f", hidden states: fused no farther than hf_torch at {closer} of {len(mine)} residual states"


def _fidelity_tally(record: dict) -> str:
    """ ", fused <= hf_torch on k of n workloads" over every workload where both have a max |dp|, or ""."""
    fused, torch_stage = stage_by_name(record, "fused"), stage_by_name(record, "hf_torch")
    if fused is None or torch_stage is None:
        return ""
    pairs = []
    for w in fused["workloads"]:
        t = measured(torch_stage, w["id"])
        if t is not None and w.get("max_abs_dp") is not None and t.get("max_abs_dp") is not None:
            pairs.append(w["max_abs_dp"] <= t["max_abs_dp"])
    return f", fused <= hf_torch on {sum(pairs)} of {len(pairs)} workloads" if pairs else ""


def _followup_comparison(followups: Sequence[tuple[Path, dict]], workload_id: str) -> tuple[Path, dict] | None:
    """The first follow-up record whose tree stage compared `workload_id` with fused: (its path, vs_builds_on)."""
    for path, other in followups:
        tree = stage_by_name(other, "tree")
        for w in tree["workloads"] if tree else []:
            versus = w.get("vs_builds_on") or {}
            if w["id"] == workload_id and versus.get("bitwise") is not None:
                return path, versus
    return None


def _tree_identity_target(record: dict, followups: Sequence[tuple[Path, dict]] = ()) -> dict[str, Any]:
    """Workloads where tree's answers are not bit-identical to fused's: from `vs_builds_on` (hidden bits and
    probabilities), or, in records older than it, from equal probabilities. A workload on which tree errored in this
    record is taken from the first of `followups` (newer records of the plan, e.g. a rerun of the fixed stage) that
    compares it, and named in the note; without one it counts as not bit-identical."""
    tree, fused = stage_by_name(record, "tree"), stage_by_name(record, "fused")
    compared, differing, worst, from_probabilities = 0, [], 0.0, False
    for w in tree["workloads"] if tree else []:
        base = measured(fused, w["id"]) if fused else None
        versus = w.get("vs_builds_on")
        if versus is not None and versus.get("bitwise") is not None:
            same, dp = versus["bitwise"], versus["max_abs_dp"]
        elif base is not None and w.get("probabilities") is not None and base.get("probabilities") is not None:
            pairs = [(a, b) for mine, theirs in zip(w["probabilities"], base["probabilities"])
                     for a, b in zip(mine, theirs)]  # fmt: skip
            same, dp, from_probabilities = all(a == b for a, b in pairs), max(abs(a - b) for a, b in pairs), True
        else:
            continue
        compared += 1
        if not same:
            differing.append(w["id"])
            worst = max(worst, dp)
    errored, errored_notes = 0, []
    for error in tree.get("workload_errors", []) if tree else []:
        later = _followup_comparison(followups, error["id"])
        if later is None:
            errored += 1
            errored_notes.append(f"tree errored on {error['id']} ({error['error']}), not compared")
            continue
        path, versus = later
        compared += 1
        if versus["bitwise"]:
            errored_notes.append(f"tree errored on {error['id']} here ({error['error']}); bitwise in runs/{path.name}")
        else:
            differing.append(error["id"])
            worst = max(worst, versus["max_abs_dp"])
            errored_notes.append(f"tree errored on {error['id']} here ({error['error']}); compared in runs/{path.name}")
    if not compared and not errored:
        return _target("tree_bitwise_vs_fused", None, 0, DASH, "0 differing", "tree or fused not timed here")
    shown = f"{compared - len(differing)} of {compared + errored} workloads"
    note = f"differ: {', '.join(differing)} (max |dp| {sci(worst)})" if differing else "every workload compared"
    if from_probabilities:
        note += "; from equal probabilities (record older than vs_builds_on)"
    note = "; ".join([note, *errored_notes])
    return _target("tree_bitwise_vs_fused", len(differing) + errored, 0, shown, "0 differing", note)


def target_rows(record: dict, followups: Sequence[tuple[Path, dict]] = ()) -> list[dict[str, Any]]:
    """Each TARGETS entry on the headline workload: measured value, limit, met / missed / not measured, and a note."""
    fused, fused_why = _headline_of(record, "fused")
    tree, tree_why = _headline_of(record, "tree")
    rows = []

    kernels = _field(fused, "kernels_per_forward")
    note = fused_why or ("" if kernels is not None else "no CUDA kernels counted (CPU run)")
    limit = TARGETS["fused_kernels"]["limit"]
    shown = DASH if kernels is None else f"{kernels:,.0f}"
    rows.append(_target("fused_kernels", kernels, limit, shown, f"{limit}", note))

    rows.append(_multiple_target("fused_core_multiple", fused, fused_why, "core"))

    reference = record["plan"]["reference"]
    torch_w, torch_why = _headline_of(record, "hf_torch")
    dp, torch_dp = _field(fused, "max_abs_dp"), _field(torch_w, "max_abs_dp")
    if reference == "hf_torch":
        note, torch_dp = "hf_torch is this plan's reference: its own max |dp| is 0 by construction", None
    else:
        note = fused_why or torch_why or ("" if dp is not None and torch_dp is not None else "max |dp| not recorded")
        if dp is not None and torch_dp is not None:
            note = (
                f"against {reference}{_fidelity_tally(record)}{_state_tally(fused, torch_w)}; synthetic weights: "
                "fidelity only, not accuracy"
            )
    limit_shown = f"{sci(torch_dp)} (hf_torch)" if torch_dp is not None else DASH
    rows.append(_target("fused_fidelity", dp, torch_dp, sci(dp), limit_shown, note))

    rows.append(_multiple_target("tree_gemm_multiple", tree, tree_why, "gemm"))

    unshared, basis = None, ""
    for name in ("merged", "fused"):
        w, _ = _headline_of(record, name)
        if w is not None:
            unshared, basis = w["rows"], f"{name}'s packed rows"
            break
    if unshared is None:
        headline = record["plan"]["headline"]
        unshared = next(w["tokens"] for w in record["workloads"] if w["id"] == headline)
        basis = f"the {headline} request's tokens"
    share = tree["rows"] / unshared if tree else None
    limit = TARGETS["tree_rows_share"]["limit"]
    shown = DASH if share is None else f"{share:.1%} ({tree['rows']:,} of {unshared:,} rows)"
    note = tree_why or f"unshared rows: {basis}"
    rows.append(_target("tree_rows_share", share, limit, shown, f"{limit:.0%}", note))
    rows.append(_tree_identity_target(record, followups))
    return rows


def _gpu_results(root: Path, suffix: str) -> list[tuple[Path, dict]]:
    """Every `gpu/*-<suffix>.json` a GPU test wrote, with its data, oldest first (the names start with UTC time)."""
    return [(path, json.loads(path.read_text())) for path in sorted((root / "gpu").glob(f"*-{suffix}.json"))]


def handoff_target(root: Path) -> dict[str, Any] | None:
    """Issue 5's hand-off target from the newest `gpu/*-gdn-handoff.json` (tests/test_gpu_tree.py) that records GPU
    kernel time, or None when there is none."""
    found = [
        (path, data) for path, data in _gpu_results(root, "gdn-handoff") if "gpu_busy_handoff_over_prefill" in data
    ]
    if not found:
        return None
    path, data = found[-1]
    ratio, busy = data["gpu_busy_handoff_over_prefill"], data["gpu_busy_ms"]
    note = (
        f"gpu/{path.name}: kernel ms per call {busy['handoff']:.3f} vs {busy['prefill']:.3f}; wall time of "
        f"back-to-back calls {data['handoff_over_prefill']:.2f}× (host launch time dominates at this size)"
    )
    limit = TARGETS["tree_handoff_core_time"]["limit"]
    return _target("tree_handoff_core_time", ratio, limit, f"{ratio:.2f}×", f"{limit:.2f}×", note)


def _newest_gpu_file(root: Path, suffix: str) -> tuple[Path, dict] | None:
    results = _gpu_results(root, suffix)
    return results[-1] if results else None


def gpu_test_tables(root: Path) -> list[dict[str, Any]]:
    """The newest result of each GPU test that writes one under `gpu/` and that the run record does not hold: the
    engine's whole-model checks, cuBLAS row-count invariance, the kernel tile sweep. Each: title, source, table."""
    tables = []
    found = _newest_gpu_file(root, "engine-checks")
    if found:
        path, data = found
        table = [["comparison (drone)", "first departing state", "last-token rel RMSE", "max |dp|"]]
        for name, c in data["comparisons"].items():
            first = "none" if c["first_departing_state"] is None else str(c["first_departing_state"])
            table.append([name, first, sci(c["last_rel_rmse"]), sci(c["max_dp"])])
        core = "bit-identical" if data["fla_forward_core_bitwise"] else "NOT bit-identical"
        text = (
            f"`fused` with FLA's kernels launched directly against `fused` on FLA's function: {core} at every state; "
            f"NVTX ranges on: {'bit-identical' if data['nvtx_ranges_bitwise'] else 'NOT bit-identical'}; peak GPU "
            f"memory {data['peak_gib']['engine']:.1f} GiB (engine phase). Synthetic weights."
        )
        tables.append({"title": "Whole-model checks of the engine", "source": f"gpu/{path.name}", "text": text,
                       "table": table})  # fmt: skip
    found = _newest_gpu_file(root, "gemm-rows")
    if found:
        path, data = found
        table = [["GEMM (out × in)", "row pairs", "row-invariant (default)", "row-invariant (no workspace)",
                  "small-call µs default → no workspace"]]  # fmt: skip
        for name in dict.fromkeys(c["gemm"] for c in data["default"]):
            default = [c for c in data["default"] if c["gemm"] == name]
            bare = [c for c in data["no_workspace"] if c["gemm"] == name]
            share = [sum(c["equal_row_share"] == 1.0 for c in cases) for cases in (default, bare)]
            timing = f"{statistics.median(c['tree_us'] for c in default):.1f} → " + (
                f"{statistics.median(c['tree_us'] for c in bare):.1f}"
            )
            table.append([f"{name} ({default[0]['n']} × {default[0]['k']})", str(len(default)),
                          f"{share[0]} of {len(default)}", f"{share[1]} of {len(bare)}", timing])  # fmt: skip
        text = "Each row pair: a GEMM over the tree's row count inside one over the flat row count (medians of µs)."
        tables.append({"title": "cuBLAS row-count invariance (27B GEMM shapes)", "source": f"gpu/{path.name}",
                       "text": text, "table": table})  # fmt: skip
    found = _newest_gpu_file(root, "kernel-tiles")
    if found:
        path, data = found
        table = [["kernel", "tile", "µs", "TB/s", "bit-equal to the shipped tile"]]
        for c in data["cases"]:
            table.append([c["kernel"], c["tile"], f"{c['us']:.1f}", f"{c['tbps']:.2f}", f"{c['equal_share']:.6f}"])
        text = f"{data['rows']} rows at the 27B widths; the first row of each kernel is the shipped tile."
        tables.append({"title": "Tile shapes of the costliest fused kernels", "source": f"gpu/{path.name}",
                       "text": text, "table": table})  # fmt: skip
    return tables


def plan_target_rows(record: dict, root: Path) -> list[dict[str, Any]]:
    """`target_rows` of the record (with the plan's newer records under root/runs as follow-ups), and on a GPU plan
    the hand-off target of the newest GPU test file."""
    followups = [
        (path, other)
        for path, other in all_records(root / "runs")
        if other["plan"]["name"] == record["plan"]["name"] and other["env"]["utc"] > record["env"]["utc"]
    ]
    rows = target_rows(record, followups)
    handoff = handoff_target(root) if record["plan"]["device"] == "cuda" else None
    return rows + ([handoff] if handoff else [])


def targets_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    table = [["issue", "target", "measured", "limit", "outcome", "note"]]
    for r in rows:
        table.append([str(r["issue"]), r["what"], r["measured"], r["limit_text"], r["outcome"], r["note"] or DASH])
    return table


def stage_table(record: dict) -> list[list[str]]:
    """The registry as the run saw it, with what happened to each stage in this run."""
    table = [["stage", "builds on", "switches", "exactness", "registry", "this run"]]
    for stage in record["stages"]:
        registry = stage["registry"]
        if stage["status"] in ("ok", "pending"):
            this_run = status_text(stage, record)
        else:
            this_run = f"{stage['status']}: {stage['reason']}"
        table.append(
            [
                stage["name"],
                registry["builds_on"] or DASH,
                registry["switches"],
                registry["exactness"]["text"],
                registry["registry_status"],
                this_run,
            ]  # fmt: skip
        )
    return table


def env_table(record: dict) -> list[list[str]]:
    env, ceilings, weights = record["env"], record["ceilings"], record["weights"]
    dirty = " (uncommitted changes)" if env["git_dirty"] else ""
    rows = [
        ["machine", machine(env)],
        ["driver", env.get("driver") or DASH],
        ["CUDA", env.get("cuda") or DASH],
        ["torch", env["torch"]],
        ["triton", env.get("triton") or DASH],
        ["transformers", env.get("transformers") or DASH],
        ["FLA", env.get("fla") or DASH],
        ["python", env.get("python") or DASH],
        ["CPU", f"{env.get('cpu') or DASH} ({env.get('cpu_count') or DASH} cores)"],
        ["commit", f"{env['git_commit'][:12]}{dirty}"],
        ["run (UTC)", env["utc"]],
        ["copy rate", f"{ceilings['copy_tbps']:.3g} TB/s (bytes read + written)"],
        ["bf16 matmul rate", f"{ceilings['bf16_tflops']:.4g} TFLOP/s ({ceilings.get('gemm_n', '?')}³)"],
        ["weights", f"{weights.get('shapes', DASH)}, {weights['method']}, seed {weights.get('seed', DASH)}"],
        ["linear parameters", f"{weights['linear_params']:,}"],
    ]
    return rows


def method_table(record: dict) -> list[list[str]]:
    plan = record["plan"]
    timer = (
        "CUDA events, device synchronized before and after each call"
        if plan["timer"] == "cuda-events"
        else "time.perf_counter around each call (CPU plan)"
    )
    return [
        ["plan", f"{plan['name']}: {plan.get('description', '')}"],
        ["timed call", "forward + fp32 head, inputs tokenized and on the device"],
        ["timer", timer],
        ["per workload", f"{plan['warmup']} warm-up, {plan['runs']} timed runs; median, p10, p90"],
        ["reference", f"{plan['reference']} (max |dp| and hidden-state rel RMSE against it)"],
        ["speed-up over", plan["baseline"]],
        ["headline workload", plan["headline"]],
    ]


def attempt_table(records: list[dict]) -> list[list[str]]:
    """Failed attempts (the attempts record copied into each run record) and registry stages marked failed."""
    table = [["attempt", "stage", "what", "outcome", "why", "numbers", "evidence", "date"]]
    seen = set()
    for record in records:
        for a in record["attempts"]:
            if a["id"] not in seen:
                seen.add(a["id"])
                numbers = ", ".join(f"{k} {v}" for k, v in a["numbers"].items())
                table.append([a["id"], a["stage"], a["title"], a["outcome"], a["reason"], numbers, a["evidence"],
                              a["date"]])  # fmt: skip
        for stage in record.get("registry", []):
            if stage["registry_status"] == "failed" and f"stage:{stage['name']}" not in seen:
                seen.add(f"stage:{stage['name']}")
                numbers = ", ".join(f"{k} {v}" for k, v in (stage["numbers"] or {}).items())
                table.append([stage["name"], stage["name"], stage["switches"], "failed", stage["reason"] or DASH,
                              numbers or DASH, "registry", DASH])  # fmt: skip
    return table


# ------------------------------------------------------------------------------------------------ figures
def _title(record: dict, what: str) -> str:
    title = f"{what}\n{plan_label(record)} · synthetic weights · {record['env']['utc']}"
    return f"{title}\n{completeness(record).upper()}" if is_partial(record) else title


def ladder_figure(record: dict, path: Path, svg: bool) -> None:
    rows = ladder_rows(record)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.6))
    top = max([r["p90_ms"] for r in rows if r["p90_ms"] is not None], default=1.0)
    floor_label = "floor: max(weight streaming, compute for the stage's rows)"
    for x, r in enumerate(rows):
        if r["median_ms"] is None:
            ax.bar(x, top * 0.15, color="none", edgecolor="0.6", hatch="//", linestyle="--")
            ax.text(x, top * 0.17, STATUS_TEXT.get(r["status"], r["status"]).replace(" (", "\n("), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
            continue
        errors = [[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]]
        ax.bar(x, r["median_ms"], color="#4C72B0", yerr=errors, capsize=4, error_kw={"elinewidth": 1})
        ax.hlines(r["floor_ms"], x - 0.45, x + 0.45, colors="#C44E52", linestyles="--", lw=1.5, label=floor_label)
        floor_label = None  # one legend entry
        speedup = DASH if r["speedup"] is None else f"{r['speedup']:.2f}×"
        ax.text(x, r["p90_ms"] + top * 0.02, f"{ms(r['median_ms'])} ms\n{speedup}", ha="center", va="bottom",
                fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), [r["heading"].replace(" (", "\n(") for r in rows])
    ax.set_ylabel("median ms (p10–p90), forward + head")
    ax.set_ylim(0, top * 1.25)
    baseline = record["plan"]["baseline"]
    ax.set_title(_title(record, f"Latency ladder: {record['plan']['headline']} (× = speed-up over {baseline})"),
                 fontsize=9)  # fmt: skip
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    _save(fig, path, svg)


def workloads_figure(record: dict, path: Path, svg: bool) -> None:
    timed = [s for s in record["stages"] if has_timings(s)]
    ids = [w["id"] for w in record["workloads"]]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(ids) + 3), 4.8))
    width = 0.8 / max(1, len(timed))
    for i, stage in enumerate(timed):
        xs, heights = [], []
        for x, workload_id in enumerate(ids):
            w = measured(stage, workload_id)
            if w is not None:
                xs.append(x - 0.4 + width * (i + 0.5))
                heights.append(w["median_ms"])
        ax.bar(xs, heights, width=width, label=stage_heading(stage, record))
    ax.set_yscale("log")
    ax.set_xticks(range(len(ids)), [i.removeprefix("jevbench/") for i in ids], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("median ms, forward + head (log)")
    ax.set_title(_title(record, "Every workload"), fontsize=9)
    if timed:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, svg)


def kernels_figure(record: dict, path: Path, svg: bool) -> None:
    rows = [r for r in ladder_rows(record) if r["median_ms"] is not None]
    counted = [r for r in rows if r["kernels"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2 if counted else 1.6))
    if not counted:
        for ax in (left, right):
            ax.axis("off")
        left.text(0.5, 0.5, "no CUDA kernels counted (no GPU in this run)", ha="center", va="center")
    else:
        names = [r["heading"].replace(" (", "\n(") for r in counted]
        left.bar(names, [r["kernels"] for r in counted], color="#55A868")
        for x, r in enumerate(counted):
            left.text(x, r["kernels"], f"{r['kernels']:,.0f}", ha="center", va="bottom", fontsize=8)
        left.set_ylabel("kernels per forward")
        xs = range(len(counted))
        right.bar([x - 0.2 for x in xs], [r["median_ms"] for r in counted], width=0.4, label="wall (median)")
        right.bar([x + 0.2 for x in xs], [r["gpu_busy_ms"] for r in counted], width=0.4, label="GPU busy")
        right.set_xticks(list(xs), names)
        right.set_ylabel("ms per forward")
        right.legend(fontsize=8)
    fig.suptitle(_title(record, f"Kernels per forward and GPU-busy time: {record['plan']['headline']}"), fontsize=9)
    fig.tight_layout()
    _save(fig, path, svg)


FAMILY_COLOURS = {"gemm": "#4C72B0", "gdn_core": "#55A868", "attention_core": "#8172B2", "ours": "#DD8452",
                  "other": "#937860"}  # fmt: skip


def time_figure(record: dict, path: Path, svg: bool) -> None:
    """Stacked kernel ms per family + GPU idle up to the median, per stage on the headline; host launch time marked."""
    rows = time_rows(record)
    headline = record["plan"]["headline"]
    if not rows:
        fig, ax = plt.subplots(figsize=(9, 1.8))
        ax.axis("off")
        ax.text(0.5, 0.5, NO_FAMILIES.replace(": ", ":\n", 1), ha="center", va="center", fontsize=9, wrap=True)
        fig.suptitle(_title(record, f"Where the time goes: {headline}"), fontsize=9)
        _save(fig, path, svg)
        return
    families = list(dict.fromkeys(f for r in rows for f in r["families"]))
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(rows) + 3.5), 4.8))
    xs = range(len(rows))
    bottoms = [0.0] * len(rows)
    for family in families:
        heights = [r["families"].get(family, {}).get("ms_per_forward", 0.0) for r in rows]
        label = f"{FAMILY_TEXT.get(family, family)} kernels"
        ax.bar(xs, heights, bottom=bottoms, width=0.6, color=FAMILY_COLOURS.get(family), label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    idle = [r["idle_ms"] for r in rows]
    ax.bar(xs, idle, bottom=bottoms, width=0.6, color="white", edgecolor="0.5", hatch="..",
           label="GPU idle (median − kernel ms)")  # fmt: skip
    host_label = "host launch time (median host ms until the call returned)"
    top = max(max(r["median_ms"], r["kernel_ms"]) for r in rows)
    for x, r in enumerate(rows):
        if r["host_median_ms"] is not None:
            ax.hlines(r["host_median_ms"], x - 0.38, x + 0.38, colors="black", lw=2, label=host_label)
            ax.plot([x + 0.38], [r["host_median_ms"]], "o", color="black", ms=4)
            host_label = None  # one legend entry
        core = DASH if r["core_multiple"] is None else f"{r['core_multiple']:.2f}× core"
        ax.text(x, max(r["median_ms"], r["kernel_ms"]) + top * 0.02, f"{ms(r['median_ms'])} ms\n{core}",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), [r["heading"].replace(" (", "\n(") for r in rows])
    ax.set_ylabel("ms per forward (bar height = median)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title(_title(record, f"Where the time goes: {headline} (kernel ms per family from one profiled call)"),
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    _save(fig, path, svg)


STAGE_MARKERS = ("o", "s", "^", "D", "v", "P")
STAGE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860")


def state_ticks(count: int) -> tuple[list[int], list[str]]:
    """Tick positions and labels for `count` residual states: every one for up to 16 layers, else the embedding,
    layer 1, every 4th layer and the final norm."""
    layers = count - 2
    shown = range(1, layers + 1) if layers <= 16 else [1, *range(4, layers + 1, 4)]
    positions = [0, *shown, count - 1]
    labels = ["embedding", *(str(i) for i in shown), "final norm"]
    return positions, labels


def states_figure(record: dict, path: Path, svg: bool) -> None:
    """Relative RMSE against the reference per residual state and stage (log scale); zeros (bit-identical states)
    sit on a labelled floor band below the smallest non-zero value; each stage's first departing state starred."""
    rows = [r for r in departure_rows(record) if r["states"] is not None]
    headline, reference = record["plan"]["headline"], record["plan"]["reference"]
    title = _title(record, f"Where each path departs from {reference}: every residual state, {headline}")
    if not rows:
        fig, ax = plt.subplots(figsize=(9, 1.8))
        ax.axis("off")
        ax.text(0.5, 0.5, NO_STATES.replace(": ", ":\n", 1), ha="center", va="center", fontsize=9, wrap=True)
        fig.suptitle(title, fontsize=9)
        _save(fig, path, svg)
        return
    count = len(rows[0]["states"])
    positive = [v for r in rows for v in r["states"] if v > 0]
    floor = min(positive) / 30 if positive else 1e-6  # where zeros are drawn: a decade and a half below the data
    top = max(positive) if positive else floor * 100
    fig, ax = plt.subplots(figsize=(max(9.0, 0.16 * count + 4), 4.6))
    types = layer_types_of(record)
    if types is not None and len(types) == count - 2:
        attention_label = "full-attention layer (others Gated DeltaNet)"
        for i, kind in enumerate(types):
            if kind == "full_attention":
                ax.axvspan(i + 0.5, i + 1.5, color="#E8E0F4", lw=0, zorder=0, label=attention_label)
                attention_label = None  # one legend entry
    ax.axhspan(floor / 2.5, floor * 2.5, color="0.9", lw=0, zorder=0)
    xs = list(range(count))
    for i, r in enumerate(rows):
        colour, marker = STAGE_COLOURS[i % len(STAGE_COLOURS)], STAGE_MARKERS[i % len(STAGE_MARKERS)]
        ys = [v if v > 0 else floor for v in r["states"]]
        departs = departure_text(r)
        label = (
            f"{r['heading']}: bit-identical throughout"
            if r["first"] is None
            else f"{r['heading']}: departs at {departs}"
        )
        size = 7 - 1.2 * (i % 4)  # later stages smaller, so markers on the same point stay visible
        ax.plot(xs, ys, color=colour, marker=marker, ms=size, mfc="none", lw=1.2, label=label, zorder=2 + i)
        if r["first"] is not None:
            ax.plot([r["first"]], [ys[r["first"]]], marker="*", ms=15, color=colour, mec="black", mew=0.6,
                    ls="none", zorder=10)  # fmt: skip
    ax.plot([], [], marker="*", ms=11, color="0.6", mec="black", mew=0.6, ls="none", label="first departing state")
    ax.set_yscale("log")
    ax.set_ylim(floor / 4, top * 4)
    # The floor band gets its own tick label; decades inside the band are not labelled (the band is not a value).
    decades = [10.0**k for k in range(math.floor(math.log10(floor * 2.5)) + 1, math.ceil(math.log10(top * 4)))]
    ax.set_yticks([floor, *decades], ["0: bit-identical", *(f"$10^{{{round(math.log10(d))}}}$" for d in decades)])
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlim(-0.6, count - 0.4)
    positions, labels = state_ticks(count)
    ax.set_xticks(positions, labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("residual state (layer k = the stream after the k-th layer)")
    ax.set_ylabel(f"relative RMSE vs {reference} (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    missing = [r["stage"] for r in departure_rows(record) if r["timed"] and r["states"] is None]
    if missing:
        ax.text(1.01, 0.0, f"not measured: {', '.join(missing)}", transform=ax.transAxes, fontsize=7, va="bottom")
    fig.tight_layout()
    _save(fig, path, svg)


def _save(fig: plt.Figure, path: Path, svg: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    if svg:
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
FIGURES = {"ladder": ladder_figure, "workloads": workloads_figure, "kernels": kernels_figure, "time": time_figure,
           "states": states_figure}  # fmt: skip


def figure_path(root: Path, kind: str, record: dict) -> Path:
    """`<root>/figures/<kind>-<plan>[-partial].png`."""
    suffix = "-partial" if is_partial(record) else ""
    return root / "figures" / f"{kind}-{record['plan']['name']}{suffix}.png"


def plan_summary(record: dict, record_path: Path, root: Path, svg: bool) -> dict[str, Any]:
    figures = {kind: figure_path(root, kind, record) for kind in FIGURES}
    for kind, draw in FIGURES.items():
        draw(record, figures[kind], svg)
    targets = plan_target_rows(record, root)
    return {
        "name": record["plan"]["name"],
        "label": record_label(record),
        "partial": is_partial(record),
        "completeness": completeness(record),
        "is_cpu": record["plan"]["device"] == "cpu",
        "record": _relative(record_path, root),
        "utc": record["env"]["utc"],
        "headline": record["plan"]["headline"],
        "baseline": record["plan"]["baseline"],
        "reference": record["plan"]["reference"],
        "notes": record["plan"].get("notes", ""),
        "synthetic": bool(record["weights"]["synthetic"]),
        "statement": record["weights"].get("statement") or "",
        "figures": {kind: "/" + _relative(path, root) for kind, path in figures.items()},
        "method": method_table(record),
        "environment": env_table(record),
        "ladder": ladder_table(record),
        "workloads": workload_table(record),
        "correctness": correctness_table(record),
        "bit_identity": bit_identity_summary(record),
        "departures": departures_summary(record),
        "time": time_summary(record),
        "targets": {"table": targets_table(targets), "outcomes": {r["id"]: r["outcome"] for r in targets}},
        "stages": stage_table(record),
    }


def _relative(path: Path, root: Path) -> str:
    path, root = Path(path).resolve(), root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def select_records(root: Path, plan: str | None, record_paths: list[str]) -> list[tuple[Path, dict]]:
    if record_paths:
        chosen = [(Path(p), read_record(Path(p))) for p in record_paths]
    else:
        chosen = newest_records(root / "runs")
    if plan:
        chosen = [(p, r) for p, r in chosen if r["plan"]["name"] == plan]
    # GPU plans first: the report leads with the measurements that matter; within a plan the newest record first.
    newest_first = sorted(chosen, key=lambda item: item[1]["env"]["utc"], reverse=True)
    return sorted(newest_first, key=lambda item: (item[1]["plan"]["device"] == "cpu", item[1]["plan"]["name"]))


def write_summary(root: Path, chosen: list[tuple[Path, dict]], svg: bool = False) -> Path:
    records = [record for _, record in chosen]
    summary = {
        "schema": SUMMARY_SCHEMA,
        "plans": [plan_summary(record, path, root, svg) for path, record in chosen],
        "attempts": attempt_table(records),
        "gpu_tests": gpu_test_tables(root),
        "newest_utc": max((r["env"]["utc"] for r in records), default=None),
        "synthetic": any(r["weights"]["synthetic"] for r in records),
    }
    path = root / "figures" / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    return path


README_START, README_END = "<!-- results:ladder -->", "<!-- /results:ladder -->"


def readme_ladder(chosen: list[tuple[Path, dict]], root: Path) -> str:
    """Markdown: per record, its label and completeness, the ladder figure and the ladder table (headline workload)."""
    parts = []
    for path, record in chosen:
        plan = record["plan"]
        parts.append(
            f"**{record_label(record)}**, workload `{plan['headline']}` (record `{_relative(path, root)}`, "
            f"{completeness(record)}; synthetic weights):\n"
        )
        figure = figure_path(root, "ladder", record).name
        parts.append(f"![ladder](results/figures/{figure})\n")
        parts += [_markdown_table(ladder_table(record)), ""]
        if plan["device"] == "cuda":
            parts.append(
                "Targets of issues 4 and 5 in this record (synthetic weights: |dp| is fidelity, not accuracy):\n"
            )
            parts += [_markdown_table(targets_table(plan_target_rows(record, root))), ""]
    return "\n".join(parts) if parts else "No run record yet.\n"


def _markdown_table(table: list[list[str]]) -> str:
    """A header row and data rows as a Markdown table (a `|` inside a cell escaped)."""
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table]
    return "\n".join([lines[0], "|" + "---|" * len(table[0]), *lines[1:]])


def replace_between_markers(text: str, block: str) -> str:
    """`text` with everything between the README markers replaced by `block`; the markers must each occur once."""
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"README needs exactly one {README_START} and one {README_END}")
    head, rest = text.split(README_START)
    _, tail = rest.split(README_END)
    return f"{head}{README_START}\n{block.rstrip()}\n{README_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paper.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results folder (default: $JEVLAB_RESULTS or results/)")
    parser.add_argument("--plan", help="only this plan")
    parser.add_argument("--record", action="append", default=[], help="use this record (repeatable)")
    parser.add_argument("--svg", action="store_true", help="also write SVG beside each PNG")
    args = parser.parse_args(argv)
    root = results_dir(args.results)
    chosen = select_records(root, args.plan, args.record)
    path = write_summary(root, chosen, args.svg)
    if not chosen:
        print(f"no run record under {root / 'runs'}; the report will say so", file=sys.stderr)
    for _, record in chosen:
        print(f"figures for {record_label(record)} ({completeness(record)})")
    print(f"summary: {path}")
    readme = REPO / "README.md"
    if root.resolve() == (REPO / "results").resolve() and readme.is_file():
        readme.write_text(replace_between_markers(readme.read_text(), readme_ladder(chosen, root)))
        print(f"ladder tables: {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
