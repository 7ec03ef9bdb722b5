"""Report tables from run records alone: every table and sentence of `summary.json` (paper/figures.py writes it),
already formatted (a table: a header row and data rows of text), so `paper/report.typ` only lays them out. No
torch, no GPU, no model code."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from ablations import targets
from ablations.records import DASH, STATUS_TEXT, all_records, has_timings, measured, ms, sci, stage_by_name

REPO = Path(__file__).resolve().parents[1]
Table = list[list[str]]
# Kernel families (the runner's ablations.timing.FAMILIES; a test checks the two agree) in drawing order: label, colour.
FAMILIES = {"gemm": ("GEMM", "#4C72B0"), "gdn_core": ("GDN core", "#55A868"), "attention_core": ("attention core",
            "#8172B2"), "ours": ("our", "#DD8452"), "other": ("other", "#937860")}  # fmt: skip
NO_FAMILIES = "No per-family kernel times in this record (the runner records them on the GPU only, from a12d567 on)."


def results_dir(value: str | None) -> Path:
    return Path(value or os.environ.get("JEVLAB_RESULTS") or REPO / "results")


def relative_path(path: Path, root: Path) -> str:
    path, root = Path(path).resolve(), root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def figure_path(root: Path, kind: str, record: dict) -> Path:
    return root / "figures" / f"{kind}-{record['plan']['name']}{'' if record['complete'] else '-partial'}.png"


def number(value: float | None, spec: str, unit: str = "") -> str:
    """`value` in the format `spec`, followed by `unit`, or a dash when it is absent."""
    return DASH if value is None else f"{value:{spec}}{unit}"


def machine(env: dict) -> str:
    return env["gpu"] if env.get("gpu") else f"CPU only ({env.get('cpu') or 'unknown CPU'})"


def plan_label(record: dict) -> str:
    """Plan and machine; CPU plans say they are tiny, partial runs say so."""
    label = f"{record['plan']['name']} on {machine(record['env'])}"
    if record["plan"]["device"] == "cpu":
        label += " [CPU plan: tiny shapes, says nothing about GPU latency]"
    return label if record["complete"] else f"{label} — partial run"


def completeness(record: dict) -> str:
    """A complete run, or (partial) how many workloads each pending stage timed; plan workloads left out named."""
    omitted = record["plan"].get("omitted_workloads") or []
    without = f" (without {', '.join(omitted)}: not requested)" if omitted else ""
    if record["complete"]:
        return "complete run" + without
    pending = [f"{s['name']} {status_text(s, record)}" for s in record["stages"] if s["status"] == "pending"]
    return "; ".join(["partial run: stopped before completion" + without, *pending])


def status_text(stage: dict, record: dict) -> str:
    if stage["status"] != "pending":
        return stage["status"]
    done = len(stage["workloads"])
    return f"pending: timed on {done} of {len(record['workloads'])} workloads" if done else STATUS_TEXT["pending"]


def stage_heading(stage: dict, record: dict) -> str:
    """The stage's name, with how far it got when it was still pending."""
    if stage["status"] != "pending":
        return stage["name"]
    return f"{stage['name']} (partial: {len(stage['workloads'])} of {len(record['workloads'])})"


def ladder_rows(record: dict) -> list[dict[str, Any]]:
    """One row per stage on the headline workload: its measurement's fields, the speed-up over the baseline stage
    where both ran and the median's multiple of the floor (None where the stage was not timed on it)."""
    headline = record["plan"]["headline"]
    baseline_stage = stage_by_name(record, record["plan"]["baseline"])
    baseline = measured(baseline_stage, headline) if baseline_stage else None
    fields = ("rows", "median_ms", "p10_ms", "p90_ms", "floor_ms", "kernels_per_forward", "gpu_busy_ms")
    rows = []
    for stage in record["stages"]:
        w = measured(stage, headline)
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


def run_line(record: dict) -> str:
    """How and on what the record was measured: timing, machine, versions, commit, ceilings, weights."""
    plan, env, ceilings, weights = record["plan"], record["env"], record["ceilings"], record["weights"]
    versions = ", ".join(f"{key} {env[key]}" for key in ("driver", "cuda", "torch", "triton", "transformers", "fla",
                                                        "python") if env.get(key))  # fmt: skip
    return (f"{plan['warmup']} warm-up and {plan['runs']} timed runs ({plan['timer']}) per workload of forward + fp32 "
            f"head, inputs on the device; {machine(env)}, CPU {env.get('cpu')} ({env.get('cpu_count')} cores); "
            f"{versions}; commit {env['git_commit'][:12]}{' (uncommitted changes)' if env['git_dirty'] else ''}; "
            f"copy {ceilings['copy_tbps']:.3g} TB/s, bf16 matmul {ceilings['bf16_tflops']:.4g} TFLOP/s; weights "
            f"{weights.get('shapes')}, {weights['method']}, seed {weights.get('seed')}.")  # fmt: skip


def exactness_table(record: dict) -> Table:
    """Per stage: its declared exactness; the largest max |dp| and hidden rel RMSE against the reference over every
    workload; on how many workloads it was bit-identical to its builds-on stage (`vs_builds_on`); and on the headline
    the first residual state (0 the embedding, k after the k-th layer) not bit-identical to the reference's."""
    reference, headline = record["plan"]["reference"], record["plan"]["headline"]
    table = [["stage", "declared", f"largest max |dp| vs {reference}", "largest hidden rel RMSE",
              "bit-identical to builds-on", f"first state departing from {reference}"]]  # fmt: skip
    for stage in record["stages"]:
        timed, on_headline = stage["workloads"], measured(stage, headline) or {}
        dps, rmses = ([w[k] for w in timed if w.get(k) is not None] for k in ("max_abs_dp", "hidden_rel_rmse"))
        versus = [w["vs_builds_on"] for w in timed if (w.get("vs_builds_on") or {}).get("bitwise") is not None]
        same = f"{sum(v['bitwise'] for v in versus)} of {len(versus)} vs {versus[0]['stage']}" if versus else DASH
        states, first = on_headline.get("state_rel_rmse"), on_headline.get("first_departing_state")
        departs = DASH if states is None else "none: bitwise" if first is None else f"{first} of {len(states) - 1}"
        table.append([stage_heading(stage, record) if timed else f"{stage['name']} ({status_text(stage, record)})",
                      stage["registry"]["exactness"]["text"], sci(max(dps, default=None)),
                      sci(max(rmses, default=None)), same, departs])  # fmt: skip
    return table


def class_speedups(record: dict) -> Table:
    """Per stage timed (rows) and workload class (columns, ablations/workloads.py's groups): the geometric mean over
    the class's workloads of the baseline stage's median over the stage's, with how many workloads both timed."""
    baseline = stage_by_name(record, record["plan"]["baseline"])
    group_of = pd.Series({w["id"]: w.get("group", "ungrouped") for w in record["workloads"]})  # older: no groups
    table = [["stage", *(f"{group} ({count})" for group, count in group_of.value_counts(sort=False).items())]]
    for stage in (s for s in record["stages"] if has_timings(s) and baseline is not None):
        cells = []
        for group in group_of.unique():
            pairs = [(measured(stage, i), measured(baseline, i)) for i in group_of.index[group_of == group]]
            ratios = [theirs["median_ms"] / mine["median_ms"] for mine, theirs in pairs if mine and theirs]
            cells.append(f"{statistics.geometric_mean(ratios):.2f}× ({len(ratios)})" if ratios else DASH)
        table.append([stage_heading(stage, record), *cells])
    return table


def still_missing(record: dict, target_rows: list[dict[str, Any]]) -> list[str]:
    """Targets missed or not measured, stages not timed, registered stages never measured."""
    items = [f"issue {r['issue']} target {r['outcome']}: {r['what']} ({r['measured']})"
             for r in target_rows if r["outcome"] != targets.MET]  # fmt: skip
    items += [f"stage {s['name']}: {status_text(s, record)}" for s in record["stages"] if not has_timings(s)]
    timed = {s["name"] for s in record["stages"] if has_timings(s)}
    unmeasured = [s["name"] for s in record.get("registry", []) if s["registry_status"] == "unmeasured"
                  and s["name"] not in timed]  # fmt: skip
    return items + ([f"stages registered but never measured: {', '.join(unmeasured)}"] if unmeasured else [])


def targets_table(rows: list[dict[str, Any]]) -> Table:
    return [["issue", "target", "measured", "limit", "outcome", "note"]] + [
        [str(r["issue"]), r["what"], r["measured"], r["limit_text"], r["outcome"], r["note"] or DASH] for r in rows
    ]


def bit_identity(record: dict) -> dict[str, Any]:
    """{measured, text, table}: each fused kernel's output against its reference composition on activations captured
    from the reference forward (`record["bit_identity"]`), or only the text when the record has none."""
    result = record.get("bit_identity")
    if result is None or result["error"]:
        why = "it predates the step, or its plan has no fused stage" if result is None else result["error"]
        return {"measured": False, "text": f"Not measured in this record ({why}).", "table": []}
    kinds = {"linear_attention": "GDN", "full_attention": "attention"}
    layers = ", ".join(f"{one['index']} ({kinds.get(one['type'], one['type'])})" for one in result["layers"])
    rows = result["rows"]
    missed = [f"layer {r['layer']} {r['kernel']}.{r['output']}" for r in rows if not r["as_expected"]]
    text = (f"Inputs from the {result['reference']} forward of {result['workload']} ({result.get('candidates')} "
            f"candidates, {result.get('tokens')} tokens) at layers {layers}: {len(rows) - len(missed)} of {len(rows)} "
            "outputs meet their declared exactness" + (f"; NOT as declared: {', '.join(missed)}." if missed else ".")
            + (f" {result['note']}." if result["interpreter"] else ""))  # fmt: skip
    share = lambda r: "100 %" if r["bit_identical"] == r["elements"] else (  # never rounded up to 100 %
        f"{int(1_000_000 * r['bit_identical'] / max(1, r['elements'])) / 10_000:.4f} %")  # fmt: skip
    table = [["layer", "kernel", "output", "elements", "bit-identical", "max ulp", "max |diff|", "unexplained",
              "expected", "met"]]  # fmt: skip
    table += [[str(r["layer"]), r["kernel"], r["output"], f"{r['elements']:,}", share(r), str(r["max_ulp"]),
               "NaN left" if r["max_abs_diff"] is None else sci(r["max_abs_diff"]), number(r.get("unexplained"), ","),
               r["expected"], "yes" if r["as_expected"] else "NO"] for r in rows]  # fmt: skip
    return {"measured": True, "text": text, "table": table}


def time_rows(record: dict) -> list[dict[str, Any]]:
    """Per stage timed on the headline with per-family kernel times: family ms and calls per forward, GPU idle =
    median minus the summed kernel ms (clipped at 0), and the host's launch time."""
    rows = []
    for stage in record["stages"]:
        w = measured(stage, record["plan"]["headline"])
        families = w.get("kernel_families") if w else None
        if families:
            names = [f for f in FAMILIES if f in families] + sorted(set(families) - set(FAMILIES))
            kernel_ms = sum(families[f]["ms_per_forward"] for f in names)
            rows.append({"heading": stage_heading(stage, record), "median_ms": w["median_ms"], "kernel_ms": kernel_ms,
                         "families": {f: families[f] for f in names}, "idle_ms": max(0.0, w["median_ms"] - kernel_ms),
                         **{k: w.get(k) for k in ("host_median_ms", "core_multiple")}})  # fmt: skip
    return rows


def attempt_table(records: list[dict], current: list[dict] | None = None) -> Table:
    """Failed attempts (the attempts record copied into each run record, then `current`: the attempts record as it
    stands, for attempts recorded after the newest run) and registry stages marked failed; each attempt id once."""
    table, seen = [["attempt", "stage", "what", "outcome", "why", "numbers", "evidence", "date"]], set()
    joined = lambda numbers: ", ".join(f"{k} {v}" for k, v in (numbers or {}).items()) or DASH
    for record in [*records, {"attempts": current or []}]:
        for a in (a for a in record["attempts"] if a["id"] not in seen):
            seen.add(a["id"])
            table.append([a["id"], a["stage"], a["title"], a["outcome"], a["reason"], joined(a["numbers"]),
                          a["evidence"], a["date"]])  # fmt: skip
        for stage in (s for s in record.get("registry", []) if s["registry_status"] == "failed"):
            if f"stage:{stage['name']}" not in seen:
                seen.add(f"stage:{stage['name']}")
                table.append([stage["name"], stage["name"], stage["switches"], "failed", stage["reason"] or DASH,
                              joined(stage["numbers"]), "registry", DASH])  # fmt: skip
    return table


def followups(record: dict, root: Path) -> list[tuple[Path, dict]]:
    """The plan's records under root/runs newer than `record` (reruns and probe runs that settle what it lacks)."""
    plan, utc = record["plan"]["name"], record["env"]["utc"]
    return [(p, r) for p, r in all_records(root / "runs") if r["plan"]["name"] == plan and r["env"]["utc"] > utc]


def later_stage_ladders(record: dict, later: list[tuple[Path, dict]], root: Path) -> list[dict]:
    """Stages of the registry that the record did not time and a later run of the plan did (newest run first, each
    stage once; a stage since dropped from the registry is history, kept in the attempts record): per such run its
    record path, the stages it adds and its own ladder table (ratios within that run, against its baseline)."""
    from engine.stages import STAGES

    timed = {s["name"] for s in record["stages"] if s["status"] == "ok"}
    out = []
    for path, other in sorted(later, key=lambda f: f[1]["env"]["utc"], reverse=True):
        new = [
            s["name"] for s in other["stages"] if s["status"] == "ok" and s["name"] in STAGES and s["name"] not in timed
        ]
        if new:
            out.append({"record": relative_path(path, root), "stages": new, "table": ladder_table(other)})
            timed.update(new)
    return out


def gemm_over_graphs(root: Path) -> dict[str, Any] | None:
    """The newest GPU record under `root/runs` in which `graphs` and `gemm` are both `ok`: per workload both timed,
    the GEMM kernel ms per forward of each (`gemm_ms`, from the profiler) and their medians, each pair with its ratio
    gemm / graphs; None when no record has both."""
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
