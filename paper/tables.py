"""Report tables from run records alone: every table and sentence of `summary.json` (paper/figures.py writes it),
already formatted, so `paper/report.typ` only lays them out. No torch, no GPU, no model code."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from ablations import targets
from ablations.records import DASH, STATUS_TEXT, all_records, has_timings, measured, ms, sci, stage_by_name
from reference.shapes import get_shapes  # dataclasses only: no torch

REPO = Path(__file__).resolve().parents[1]
Table = list[list[str]]


def results_dir(value: str | None) -> Path:
    return Path(value or os.environ.get("JEVLAB_RESULTS") or REPO / "results")


def machine(env: dict) -> str:
    return env["gpu"] if env.get("gpu") else f"CPU only ({env.get('cpu') or 'unknown CPU'})"


def plan_label(record: dict) -> str:
    label = f"{record['plan']['name']} on {machine(record['env'])}"
    cpu = record["plan"]["device"] == "cpu"
    return label + " [CPU plan: tiny shapes, says nothing about GPU latency]" if cpu else label


def completeness(record: dict) -> str:
    """What the record holds: a complete run, or (partial) how many workloads each pending stage timed."""
    omitted = record["plan"].get("omitted_workloads") or []
    without = f" (without {', '.join(omitted)}: not requested)" if omitted else ""
    if record["complete"]:
        return "complete run" + without
    parts = ["partial run: stopped before completion" + without]
    for stage in (s for s in record["stages"] if s["status"] == "pending"):
        done = len(stage["workloads"])
        parts.append(f"{stage['name']} timed on {done} of {len(record['workloads'])} workloads" if done
                     else f"{stage['name']} not reached")  # fmt: skip
    return "; ".join(parts)


def record_label(record: dict) -> str:
    return plan_label(record) if record["complete"] else f"{plan_label(record)} — partial run"


def stage_heading(stage: dict, record: dict) -> str:
    """The stage's name, with how far it got when it was still pending."""
    if stage["status"] != "pending":
        return stage["name"]
    return f"{stage['name']} (partial: {len(stage['workloads'])} of {len(record['workloads'])})"


def status_text(stage: dict, record: dict) -> str:
    if stage["status"] != "pending":
        return stage["status"]
    done = len(stage["workloads"])
    return f"pending: timed on {done} of {len(record['workloads'])} workloads" if done else STATUS_TEXT["pending"]


def number(value: float | None, spec: str, unit: str = "") -> str:
    """`value` in the format `spec`, followed by `unit`, or a dash when it is absent."""
    return DASH if value is None else f"{value:{spec}}{unit}"


def ladder_rows(record: dict) -> list[dict[str, Any]]:
    """One row per stage on the headline workload: its measurement's fields, the speed-up over the baseline stage
    where both ran and the median's multiple of the floor (None where the stage was not timed on it)."""
    headline = record["plan"]["headline"]
    baseline_stage = stage_by_name(record, record["plan"]["baseline"])
    baseline = measured(baseline_stage, headline) if baseline_stage else None
    fields = ("rows", "median_ms", "p10_ms", "p90_ms", "floor_ms", "kernels_per_forward", "gpu_busy_ms")
    rows = []
    for stage in record["stages"]:
        w = measured(stage, headline)  # None where not timed: only ok and pending stages have workloads
        rows.append({
            "stage": stage["name"], "status": stage["status"], "status_text": status_text(stage, record),
            "heading": stage_heading(stage, record) if w else stage["name"],
            "gate": stage["gate"]["outcome"] if stage["gate"] else DASH, **{f: w[f] if w else None for f in fields},
            "speedup": baseline["median_ms"] / w["median_ms"] if w and baseline else None,
            "floor_multiple": w["median_ms"] / w["floor_ms"] if w else None,
        })  # fmt: skip
    return rows


def ladder_table(record: dict) -> Table:
    table = [["stage", "status", "gate", "rows", "median ms", "p10–p90 ms", f"× vs {record['plan']['baseline']}",
              "floor ms", "× floor", "kernels", "GPU busy ms"]]  # fmt: skip
    for r in ladder_rows(record):
        spread = f"{ms(r['p10_ms'])}–{ms(r['p90_ms'])}" if r["median_ms"] is not None else DASH
        table.append([r["stage"], r["status_text"], r["gate"], number(r["rows"], ","), ms(r["median_ms"]), spread,
                      number(r["speedup"], ".2f", "×"), ms(r["floor_ms"]), number(r["floor_multiple"], ".1f"),
                      number(r["kernels_per_forward"], ",.0f"), ms(r["gpu_busy_ms"])])  # fmt: skip
    return table


def workload_table(record: dict) -> Table:
    """Median ms (p10–p90) per workload (rows) and stage (columns); a stage cut short by a partial run says so."""
    timed = [s for s in record["stages"] if has_timings(s)]
    table = [["workload", "candidates", "tokens", *(stage_heading(s, record) for s in timed)]]
    for workload in record["workloads"]:
        cells = [measured(stage, workload["id"]) for stage in timed]
        cells = [DASH if w is None else f"{ms(w['median_ms'])} ({ms(w['p10_ms'])}–{ms(w['p90_ms'])})" for w in cells]
        table.append([workload["id"], str(workload["candidates"]), f"{workload['tokens']:,}", *cells])
    return table


def correctness_table(record: dict) -> Table:
    table = [["stage", "workload", f"max |dp| vs {record['plan']['reference']}", "hidden rel RMSE", "argmax flips"]]
    for stage in record["stages"]:
        table += [[stage_heading(stage, record), w["id"], sci(w["max_abs_dp"]), sci(w["hidden_rel_rmse"]),
                   number(w.get("argmax_flips"), "")] for w in stage["workloads"]]  # fmt: skip
    return table


NOT_MEASURED = "Not measured in this record"


def part(text: str, table: Table | None = None) -> dict[str, Any]:
    """A report part: its sentence and table, `measured` false (the sentence says why) when there is no table."""
    return {"measured": table is not None, "text": text, "table": table or []}


def share_text(identical: int, elements: int) -> str:
    """Percent bit-identical, never rounded up to 100 % unless every element is identical."""
    return "100 %" if identical == elements else f"{int(1_000_000 * identical / max(1, elements)) / 10_000:.4f} %"


def bit_identity_summary(record: dict) -> dict[str, Any]:
    """The per-kernel bit-identity table of a record (`record["bit_identity"]`) with the sentence that introduces it;
    `measured` false (and the sentence says why) when the record has no such table or the step failed."""
    result = record.get("bit_identity")
    if result is None:
        text = f"{NOT_MEASURED} (it predates the bit-identity step, or its plan has no fused stage)."
        return part(text)
    if result["error"]:
        return part(f"{NOT_MEASURED}: the step failed ({result['error']}).")
    kinds = {"linear_attention": "GDN", "full_attention": "attention"}
    layers = ", ".join(f"{one['index']} ({kinds.get(one['type'], one['type'])})" for one in result["layers"])
    rows = result["rows"]
    text = (
        f"Inputs captured from the {result['reference']} forward of the {result['workload']} request "
        f"({result.get('candidates')} candidates, {result.get('tokens')} real tokens) at layers {layers}; each kernel "
        f"wrote NaN-poisoned outputs and was compared with its reference composition (reference/ops.py) on the same "
        f"inputs. {sum(1 for r in rows if r['as_expected'])} of {len(rows)} outputs meet their declared exactness."
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
        table.append([str(r["layer"]), r["kernel"], r["output"], f"{r['elements']:,}",
                      share_text(r["bit_identical"], r["elements"]), str(r["max_ulp"]), diff,
                      number(r.get("unexplained"), ","), r["expected"],
                      "yes" if r["as_expected"] else "NO"])  # fmt: skip
    return part(text, table)


NO_STATES = (
    "Not measured in this record: the runner compares every residual state of the headline with the reference "
    "from commit 8eaec7d on (older records have only the final hidden states)."
)


def state_name(index: int, count: int) -> str:
    """Residual state `index` of `count` (num_layers + 2): "embedding", "layer k" (the stream after the k-th layer,
    counted from 1) or "final norm"."""
    return "embedding" if index == 0 else "final norm" if index == count - 1 else f"layer {index}"


def layer_types_of(record: dict) -> list[str] | None:
    """The record's layer pattern from reference/shapes.py (its shapes name), or None for shapes not known here."""
    try:
        return get_shapes(record["weights"].get("shapes") or record["plan"]["shapes"]).layer_types
    except ValueError:
        return None


def departure_rows(record: dict) -> list[dict[str, Any]]:
    """Per stage other than the reference, on the headline: the relative RMSE of every residual state and the first
    state that is not bit-identical (`states` None when the record does not carry them), and why when not timed."""
    rows = []
    for stage in (s for s in record["stages"] if s["name"] != record["plan"]["reference"]):
        w = measured(stage, record["plan"]["headline"]) or {}
        rows.append({"stage": stage["name"], "heading": stage_heading(stage, record) if w else stage["name"],
                     "timed": bool(w), "status_text": STATUS_TEXT.get(stage["status"], stage["status"]),
                     "states": w.get("state_rel_rmse"), "first": w.get("first_departing_state"),
                     "max_abs_dp": w.get("max_abs_dp")})  # fmt: skip
    return rows


def departure_text(row: dict[str, Any]) -> str:
    """The first departing state of a row as the table shows it."""
    if not row["timed"]:
        return f"not timed: {row['status_text']}"
    if row["states"] is None:
        return "not measured"
    return "none: bitwise" if row["first"] is None else state_name(row["first"], len(row["states"]))


def departures_summary(record: dict) -> dict[str, Any]:
    """The table beside the states figure and the sentence that introduces it; `measured` false (and the sentence
    says why) when no stage carries the per-state comparison."""
    rows = departure_rows(record)
    headline, reference = record["plan"]["headline"], record["plan"]["reference"]
    statement = record["weights"].get("statement") or "Synthetic weights."
    if not any(r["states"] is not None for r in rows):
        return part(f"{NO_STATES} {statement}")
    last = len(next(r["states"] for r in rows if r["states"] is not None)) - 2
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
    table = [["stage", "first departing state", "rel RMSE layer 1", f"rel RMSE layer {last}", "rel RMSE final norm",
              "largest rel RMSE (state)", f"max |dp| vs {reference}"]]  # fmt: skip
    for r in rows:
        states, cells = r["states"], [DASH] * 4
        if states is not None:
            i = max(range(len(states)), key=states.__getitem__)
            largest = "0" if states[i] == 0 else f"{sci(states[i])} ({state_name(i, len(states))})"
            cells = [sci(states[1]), sci(states[-2]), sci(states[-1]), largest]
        table.append([r["heading"], departure_text(r), *cells, sci(r["max_abs_dp"])])
    missing = [r["stage"] for r in rows if r["timed"] and r["states"] is None]
    if missing:
        text += f" No per-state comparison for: {', '.join(missing)}."
    return part(text, table)


# Kernel families in drawing order (the runner's ablations.timing.FAMILIES; a test checks the two agree).
FAMILY_ORDER = ("gemm", "gdn_core", "attention_core", "ours", "other")
FAMILY_TEXT = {"gemm": "GEMM", "gdn_core": "GDN core", "attention_core": "attention core", "ours": "our",
               "other": "other"}  # fmt: skip
NO_FAMILIES = (
    "No per-family kernel times in this record: the runner records them on the GPU only, from commit a12d567 on "
    "(older records and CPU runs have none)."
)


def time_rows(record: dict) -> list[dict[str, Any]]:
    """Per stage timed on the headline with per-family kernel times: family ms and calls per forward, GPU idle =
    median minus the summed kernel ms (clipped at 0), and the host's launch time."""
    rows = []
    for stage in record["stages"]:
        w = measured(stage, record["plan"]["headline"])
        families = w.get("kernel_families") if w else None
        if not families:
            continue
        names = [f for f in FAMILY_ORDER if f in families] + sorted(set(families) - set(FAMILY_ORDER))
        kernel_ms = sum(families[f]["ms_per_forward"] for f in names)
        rows.append({"stage": stage["name"], "heading": stage_heading(stage, record), "median_ms": w["median_ms"],
                     "families": {f: families[f] for f in names}, "kernel_ms": kernel_ms,
                     "idle_ms": max(0.0, w["median_ms"] - kernel_ms), "host_median_ms": w.get("host_median_ms"),
                     "core_multiple": w.get("core_multiple"), "gemm_multiple": w.get("gemm_multiple")})  # fmt: skip
    return rows


def time_summary(record: dict) -> dict[str, Any]:
    """The table beside the time figure; `measured` false (with the reason) when the record has no families."""
    rows = time_rows(record)
    if not rows:
        return part(NO_FAMILIES)
    families = list(dict.fromkeys(f for r in rows for f in r["families"]))
    table = [["stage", "median ms", *(f"{FAMILY_TEXT.get(f, f)} ms (calls)" for f in families), "GPU idle ms",
              "host launch ms", "host / median", "× core", "× GEMM"]]  # fmt: skip
    for r in rows:
        cells = [r["families"].get(f) for f in families]
        cells = [DASH if c is None else f"{ms(c['ms_per_forward'])} ({c['calls_per_forward']:,.0f})" for c in cells]
        host = r["host_median_ms"]
        table.append([r["heading"], ms(r["median_ms"]), *cells, ms(r["idle_ms"]), ms(host),
                      DASH if host is None else f"{host / r['median_ms']:.0%}",
                      number(r["core_multiple"], ".2f", "×"), number(r["gemm_multiple"], ".2f", "×")])  # fmt: skip
    missing = [s["name"] for s in record["stages"] if has_timings(s) and s["name"] not in {r["stage"] for r in rows}]
    text = (
        f"Kernel time per family of one profiled {record['plan']['headline']} forward (torch profiler; kernels that "
        "overlap are each counted), GPU idle = median minus those kernels (launch gaps and host waits), and the "
        "median host time until the timed call returned (close to the median: the forward is launch-bound). "
        "× core = median / (GEMM + GDN core + attention core); × GEMM = median / GEMM."
    )
    if missing:
        text += f" No per-family times for: {', '.join(missing)}."
    return part(text, table)


def targets_table(rows: list[dict[str, Any]]) -> Table:
    return [["issue", "target", "measured", "limit", "outcome", "note"]] + [
        [str(r["issue"]), r["what"], r["measured"], r["limit_text"], r["outcome"], r["note"] or DASH] for r in rows
    ]


def stage_table(record: dict) -> Table:
    """The registry as the run saw it, with what happened to each stage in this run."""
    table = [["stage", "builds on", "switches", "exactness", "registry", "this run"]]
    for stage in record["stages"]:
        registry = stage["registry"]
        timed = stage["status"] in ("ok", "pending")
        this_run = status_text(stage, record) if timed else f"{stage['status']}: {stage['reason']}"
        table.append([stage["name"], registry["builds_on"] or DASH, registry["switches"], registry["exactness"]["text"],
                      registry["registry_status"], this_run])  # fmt: skip
    return table


def env_table(record: dict) -> Table:
    env, ceilings, weights = record["env"], record["ceilings"], record["weights"]
    versions = {"driver": "driver", "CUDA": "cuda", "torch": "torch", "triton": "triton",
                "transformers": "transformers", "FLA": "fla", "python": "python"}  # fmt: skip
    return [
        ["machine", machine(env)],
        *([label, env.get(key) or DASH] for label, key in versions.items()),
        ["CPU", f"{env.get('cpu') or DASH} ({env.get('cpu_count') or DASH} cores)"],
        ["commit", f"{env['git_commit'][:12]}{' (uncommitted changes)' if env['git_dirty'] else ''}"],
        ["run (UTC)", env["utc"]],
        ["copy rate", f"{ceilings['copy_tbps']:.3g} TB/s (bytes read + written)"],
        ["bf16 matmul rate", f"{ceilings['bf16_tflops']:.4g} TFLOP/s ({ceilings.get('gemm_n', '?')}³)"],
        ["weights", f"{weights.get('shapes', DASH)}, {weights['method']}, seed {weights.get('seed', DASH)}"],
        ["linear parameters", f"{weights['linear_params']:,}"],
    ]


def method_table(record: dict) -> Table:
    plan = record["plan"]
    timer = "time.perf_counter around each call (CPU plan)"
    if plan["timer"] == "cuda-events":
        timer = "CUDA events, device synchronized before and after each call"
    return [
        ["plan", f"{plan['name']}: {plan.get('description', '')}"],
        ["timed call", "forward + fp32 head, inputs tokenized and on the device"],
        ["timer", timer],
        ["per workload", f"{plan['warmup']} warm-up, {plan['runs']} timed runs; median, p10, p90"],
        ["reference", f"{plan['reference']} (max |dp| and hidden-state rel RMSE against it)"],
        ["speed-up over", plan["baseline"]],
        ["headline workload", plan["headline"]],
    ]


def attempt_table(records: list[dict], current: list[dict] | None = None) -> Table:
    """Failed attempts (the attempts record copied into each run record, then `current`: the attempts record as it
    stands, for attempts recorded after the newest run) and registry stages marked failed; each attempt id once."""
    table = [["attempt", "stage", "what", "outcome", "why", "numbers", "evidence", "date"]]
    seen = set()
    joined = lambda numbers: ", ".join(f"{k} {v}" for k, v in (numbers or {}).items())
    for record in [*records, {"attempts": current or []}]:
        for a in (a for a in record["attempts"] if a["id"] not in seen):
            seen.add(a["id"])
            table.append([a["id"], a["stage"], a["title"], a["outcome"], a["reason"], joined(a["numbers"]),
                          a["evidence"], a["date"]])  # fmt: skip
        for stage in record.get("registry", []):
            if stage["registry_status"] == "failed" and f"stage:{stage['name']}" not in seen:
                seen.add(f"stage:{stage['name']}")
                table.append([stage["name"], stage["name"], stage["switches"], "failed", stage["reason"] or DASH,
                              joined(stage["numbers"]) or DASH, "registry", DASH])  # fmt: skip
    return table


def later_stage_ladders(record: dict, later: list[tuple[Path, dict]], root: Path) -> list[dict]:
    """Stages the record did not time that a later run of the plan did (newest run first, each stage once): per such
    run its record path, the stages it adds and its own ladder table (ratios within that run, against its baseline)."""
    timed = {s["name"] for s in record["stages"] if s.get("status") == "ok"}
    out = []
    for path, other in sorted(later, key=lambda f: f[1]["env"]["utc"], reverse=True):
        new = [s["name"] for s in other["stages"] if s.get("status") == "ok" and s["name"] not in timed]
        if new:
            out.append({"record": relative_path(path, root), "stages": new, "table": ladder_table(other)})
            timed.update(new)
    return out


def followups(record: dict, root: Path) -> list[tuple[Path, dict]]:
    """The plan's records under root/runs newer than `record` (reruns and probe runs that settle what it lacks)."""
    plan, utc = record["plan"]["name"], record["env"]["utc"]
    return [
        (p, other)
        for p, other in all_records(root / "runs")
        if other["plan"]["name"] == plan and other["env"]["utc"] > utc
    ]


def _gemm_rows_table(probe: dict) -> tuple[str, Table]:
    table = [["GEMM (out × in)", "row pairs", "row-invariant (default)", "row-invariant (no workspace)",
              "small-call µs default → no workspace"]]  # fmt: skip
    for name in dict.fromkeys(c["gemm"] for c in probe["default"]):
        default, bare = ([c for c in probe[setting] if c["gemm"] == name] for setting in ("default", "no_workspace"))
        invariant = [sum(c["equal_row_share"] == 1.0 for c in cases) for cases in (default, bare)]
        timing = " → ".join(f"{statistics.median(c['tree_us'] for c in cases):.1f}" for cases in (default, bare))
        table.append([f"{name} ({default[0]['n']} × {default[0]['k']})", str(len(default)),
                      f"{invariant[0]} of {len(default)}", f"{invariant[1]} of {len(bare)}", timing])  # fmt: skip
    return "Each row pair: a GEMM over the tree's row count inside one over the flat row count (medians of µs).", table


def _handoff_table(probe: dict) -> tuple[str, Table]:
    busy = probe["gpu_busy_ms"]
    table = [["call", "wall ms (back-to-back)", "GPU kernel ms"],
             ["prefill the context once", ms(probe["prefill_context_ms"]), ms(busy["prefill"])],
             ["hand-off schedule", ms(probe["handoff_ms"]), ms(busy["handoff"])],
             ["replicated schedule", ms(probe["replicated_ms"]), ms(busy["replicated"])]]  # fmt: skip
    text = (
        f"One GDN layer's core as the tree engine calls it on the {probe['workload']} request ({probe['rows']:,} "
        f"rows, {probe['context_rows']:,} shared); hand-off over prefill: {probe['gpu_busy_handoff_over_prefill']:.2f}×"
        f" kernel time, {probe['handoff_over_prefill']:.2f}× wall time; the cost rule picks {probe['chosen_mode']}."
    )
    return text, table


def _tiles_table(probe: dict) -> tuple[str, Table]:
    table = [["kernel", "tile", "µs", "TB/s", "bit-equal to the shipped tile"]]
    table += [[c["kernel"], c["tile"], f"{c['us']:.1f}", f"{c['tbps']:.2f}", f"{c['equal_share']:.6f}"]
              for c in probe["cases"]]  # fmt: skip
    return f"{probe['rows']} rows at the 27B widths; the first row of each kernel is the shipped tile.", table


def _engine_table(probe: dict) -> tuple[str, Table]:
    table = [[f"comparison ({probe['workload']})", "first departing state", "last-token rel RMSE", "max |dp|"]]
    for name, c in probe["comparisons"].items():
        first = "none" if c["first_departing_state"] is None else str(c["first_departing_state"])
        table.append([name, first, sci(c["last_rel_rmse"]), sci(c["max_dp"])])
    core, nvtx = ("bit-identical" if probe[k] else "NOT bit-identical"
                  for k in ("fla_forward_core_bitwise", "nvtx_ranges_bitwise"))  # fmt: skip
    text = (
        f"fused with FLA's kernels launched directly against fused on FLA's function: {core} at every state; NVTX "
        f"ranges on: {nvtx}; peak GPU memory {probe['peak_gib']['engine']:.1f} GiB (engine phase). Synthetic weights."
    )
    return text, table


PROBE_TABLES = {
    "engine_checks": ("Whole-model checks of the engine", _engine_table),
    "gemm_rows": ("cuBLAS row-count invariance (27B GEMM shapes)", _gemm_rows_table),
    "gdn_handoff": ("GDN state hand-off against prefilling once", _handoff_table),
    "kernel_tiles": ("Tile shapes of the costliest fused kernels", _tiles_table),
}


def probe_tables(record: dict, later: list[tuple[Path, dict]]) -> list[dict[str, Any]]:
    """One {title, text, table} per probe of `PROBE_TABLES`: its table from the record's `probes` (or, where it has
    none, the newest later record's that has: `targets.probes_of`, named in the text), or a sentence that the runner
    has not measured it (older records, CPU plans, --no-probes) or that it failed."""
    found, source = targets.probes_of(record, later)
    where = "" if source is None else f"; from {source.parent.name}/{source.name}"
    tables = []
    for name, (title, tabulate) in PROBE_TABLES.items():
        probe = found.get(name)
        if probe is None:
            text, table = f"Not measured by the runner yet: this record has no {name} probe.", []
        elif probe["error"]:
            text, table = f"The {name} probe failed: {probe['error']}", []
        else:
            text, table = tabulate(probe)
            text = f"{text} ({probe['seconds']:.0f} s{where})"
        tables.append({"title": title, "text": text, "table": table})
    return tables


def class_speedups(record: dict) -> Table:
    """Per stage timed (rows) and workload class (columns, ablations/workloads.py's groups): the geometric mean over
    the class's workloads of the baseline stage's median over the stage's, with how many workloads both timed."""
    baseline = stage_by_name(record, record["plan"]["baseline"])
    group_of = {w["id"]: w.get("group", "ungrouped") for w in record["workloads"]}  # older records: no groups
    groups = list(dict.fromkeys(group_of.values()))
    table = [["stage", *(f"{group} ({list(group_of.values()).count(group)})" for group in groups)]]
    for stage in (s for s in record["stages"] if has_timings(s) and baseline is not None):
        cells = []
        for group in groups:
            pairs = [(measured(stage, i), measured(baseline, i)) for i, g in group_of.items() if g == group]
            ratios = [theirs["median_ms"] / mine["median_ms"] for mine, theirs in pairs if mine and theirs]
            cells.append(f"{statistics.geometric_mean(ratios):.2f}× ({len(ratios)})" if ratios else DASH)
        table.append([stage_heading(stage, record), *cells])
    return table


def measured_exactness(record: dict) -> Table:
    """Per stage: its declared exactness, and what the record measured: the largest max |dp| and hidden rel RMSE
    against the reference over every workload, and on how many workloads it was bit-identical to its builds-on
    stage (`vs_builds_on`)."""
    table = [["stage", "declared", f"largest max |dp| vs {record['plan']['reference']}", "largest hidden rel RMSE",
              "bit-identical to builds-on"]]  # fmt: skip
    for stage in record["stages"]:
        timed = stage["workloads"]
        dps, rmses = ([w[k] for w in timed if w.get(k) is not None] for k in ("max_abs_dp", "hidden_rel_rmse"))
        versus = [w["vs_builds_on"] for w in timed if (w.get("vs_builds_on") or {}).get("bitwise") is not None]
        same = f"{sum(v['bitwise'] for v in versus)} of {len(versus)} vs {versus[0]['stage']}" if versus else DASH
        table.append([stage_heading(stage, record) if timed else f"{stage['name']} ({status_text(stage, record)})",
                      stage["registry"]["exactness"]["text"], sci(max(dps, default=None)),
                      sci(max(rmses, default=None)), same])  # fmt: skip
    return table


def still_missing(record: dict, target_rows: list[dict[str, Any]]) -> list[str]:
    """What the record does not show yet: targets missed or not measured, stages not timed, planned stages absent
    from the registry, registered stages never measured (`unmeasured` and not timed here), probes not run."""
    items = [f"issue {r['issue']} target {r['outcome']}: {r['what']} ({r['measured']})"
             for r in target_rows if r["outcome"] != targets.MET]  # fmt: skip
    items += [f"stage {s['name']}: {status_text(s, record)}" for s in record["stages"] if not has_timings(s)]
    registered = {s["name"] for s in record.get("registry", [])} | {s["name"] for s in record["stages"]}
    planned = [name for name in targets.NOT_YET_BUILT if name not in registered]
    timed = {s["name"] for s in record["stages"] if has_timings(s)}
    unmeasured = [s["name"] for s in record.get("registry", [])
                  if s["registry_status"] == "unmeasured" and s["name"] not in timed]  # fmt: skip
    items += [f"stages not built yet: {', '.join(planned)}"] if planned else []
    items += [f"stages registered but never measured: {', '.join(unmeasured)}"] if unmeasured else []
    if record["plan"]["device"] == "cuda" and "probes" not in record:
        items.append("probes (engine checks, GEMM rows, hand-off, tiles): not measured by the runner yet")
    return items


def gemm_over_graphs(root: Path) -> dict[str, Any] | None:
    """The newest GPU record under `root/runs` in which `graphs` and `gemm` are both `ok`: per workload both timed,
    the GEMM kernel ms per forward of each (`gemm_ms`, from the profiler) and their medians, each pair with its ratio
    gemm / graphs; None (no table) when no record has both."""
    both = [(path, r) for path, r in all_records(root / "runs") if r["plan"]["device"] == "cuda"
            and all((stage_by_name(r, name) or {}).get("status") == "ok" for name in ("graphs", "gemm"))]  # fmt: skip
    if not both:
        return None
    path, record = both[-1]
    graphs, gemm = stage_by_name(record, "graphs"), stage_by_name(record, "gemm")
    ratio = lambda old, new: number(None if old is None or new is None else new / old, ".3f", "×")
    table = [["workload", "graphs GEMM ms", "gemm GEMM ms", "GEMM gemm / graphs", "graphs median ms",
              "gemm median ms", "median gemm / graphs"]]  # fmt: skip
    for workload in record["workloads"]:
        old, new = measured(graphs, workload["id"]), measured(gemm, workload["id"])
        if old and new:
            table.append([workload["id"], ms(old.get("gemm_ms")), ms(new.get("gemm_ms")),
                          ratio(old.get("gemm_ms"), new.get("gemm_ms")), ms(old["median_ms"]), ms(new["median_ms"]),
                          ratio(old["median_ms"], new["median_ms"])])  # fmt: skip
    return {"record": relative_path(path, root), "label": plan_label(record), "table": table}


def figure_path(root: Path, kind: str, record: dict) -> Path:
    """`<root>/figures/<kind>-<plan>[-partial].png`."""
    return root / "figures" / f"{kind}-{record['plan']['name']}{'' if record['complete'] else '-partial'}.png"


def relative_path(path: Path, root: Path) -> str:
    path, root = Path(path).resolve(), root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
