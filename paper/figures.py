"""Figures and report tables from run records alone (results/runs/*.json); no GPU, no model code.

    python -m paper.figures [--results DIR] [--plan NAME] [--record PATH ...] [--svg]

Picks the newest complete record of each plan (or the records named with `--record`, or only `--plan`) and writes,
under `<results>/figures/`:

* `ladder-<plan>.png`: one bar per stage on the plan's headline workload, median ms with the p10-p90 range, the
  speed-up over the plan's baseline stage written on each bar, and the floor of each stage (the larger of the
  weight-streaming and compute floors for the rows that stage computes) drawn as a line across its bar;
  stages that were not timed appear as empty slots naming their status.
* `workloads-<plan>.png`: median ms of every stage on every workload (grouped bars, log scale).
* `kernels-<plan>.png`: kernels per forward and GPU-busy ms against wall ms per stage on the headline workload.
* `summary.json`: every number and table the report shows, already formatted, so `paper/report.typ` only lays
  them out (it reads this file and the PNGs, nothing else).

When the results folder is the checkout's own, the ladder table of each plan is also written into README.md between
the `<!-- results:ladder -->` and `<!-- /results:ladder -->` markers, so the README never carries a hand-typed figure.

`--results` defaults to `$JEVLAB_RESULTS` or `results/` of the checkout. Every figure names its plan and machine,
and the CPU plan is labelled as such; probabilities appear only in the correctness table, beside the
synthetic-weights statement of the record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

from ablations.records import newest_per_plan, read_record  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SUMMARY_SCHEMA = "jevlab-report-summary/1"
STATUS_TEXT = {"gate-red": "gate red", "unavailable": "unavailable", "error": "error", "pending": "not run"}
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


# ------------------------------------------------------------------------------------------------ tables
def ladder_rows(record: dict) -> list[dict[str, Any]]:
    """One row per stage on the headline workload, with the speed-up over the baseline stage where both ran."""
    headline, baseline_name = record["plan"]["headline"], record["plan"]["baseline"]
    baseline_stage = stage_by_name(record, baseline_name)
    baseline = measured(baseline_stage, headline) if baseline_stage else None
    rows = []
    for stage in record["stages"]:
        w = measured(stage, headline) if stage["status"] == "ok" else None
        rows.append(
            {
                "stage": stage["name"],
                "status": stage["status"],
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
                r["status"],
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
    """Median ms (p10–p90) per workload (rows) and stage (columns)."""
    timed = [s for s in record["stages"] if s["status"] == "ok"]
    table = [["workload", "candidates", "tokens", *(s["name"] for s in timed)]]
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
            table.append([stage["name"], w["id"], sci(w["max_abs_dp"]), sci(w["hidden_rel_rmse"]), flips])
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
    if result["interpreter"]:
        text += f" {result['note']}."
    table = [["layer", "kernel", "output", "elements", "bit-identical", "max ulp", "max |diff|", "expected", "met"]]
    for r in rows:
        diff = "NaN left" if r["max_abs_diff"] is None else sci(r["max_abs_diff"])
        table.append([str(r["layer"]), r["kernel"], r["output"], f"{r['elements']:,}",
                      share_text(r["bit_identical"], r["elements"]), str(r["max_ulp"]), diff, r["expected"],
                      "yes" if r["as_expected"] else "NO"])  # fmt: skip
    return {"measured": True, "text": text, "table": table}


def stage_table(record: dict) -> list[list[str]]:
    """The registry as the run saw it, with what happened to each stage in this run."""
    table = [["stage", "builds on", "switches", "exactness", "registry", "this run"]]
    for stage in record["stages"]:
        registry = stage["registry"]
        this_run = stage["status"] if stage["status"] == "ok" else f"{stage['status']}: {stage['reason']}"
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
    return f"{what}\n{plan_label(record)} · synthetic weights · {record['env']['utc']}"


def ladder_figure(record: dict, path: Path, svg: bool) -> None:
    rows = ladder_rows(record)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.6))
    top = max([r["p90_ms"] for r in rows if r["p90_ms"] is not None], default=1.0)
    floor_label = "floor: max(weight streaming, compute for the stage's rows)"
    for x, r in enumerate(rows):
        if r["median_ms"] is None:
            ax.bar(x, top * 0.15, color="none", edgecolor="0.6", hatch="//", linestyle="--")
            ax.text(x, top * 0.17, STATUS_TEXT.get(r["status"], r["status"]), ha="center", va="bottom", fontsize=8)
            continue
        errors = [[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]]
        ax.bar(x, r["median_ms"], color="#4C72B0", yerr=errors, capsize=4, error_kw={"elinewidth": 1})
        ax.hlines(r["floor_ms"], x - 0.45, x + 0.45, colors="#C44E52", linestyles="--", lw=1.5, label=floor_label)
        floor_label = None  # one legend entry
        speedup = DASH if r["speedup"] is None else f"{r['speedup']:.2f}×"
        ax.text(x, r["p90_ms"] + top * 0.02, f"{ms(r['median_ms'])} ms\n{speedup}", ha="center", va="bottom",
                fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), [r["stage"] for r in rows])
    ax.set_ylabel("median ms (p10–p90), forward + head")
    ax.set_ylim(0, top * 1.25)
    baseline = record["plan"]["baseline"]
    ax.set_title(_title(record, f"Latency ladder: {record['plan']['headline']} (× = speed-up over {baseline})"),
                 fontsize=9)  # fmt: skip
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    _save(fig, path, svg)


def workloads_figure(record: dict, path: Path, svg: bool) -> None:
    timed = [s for s in record["stages"] if s["status"] == "ok"]
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
        ax.bar(xs, heights, width=width, label=stage["name"])
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
        names = [r["stage"] for r in counted]
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


def _save(fig: plt.Figure, path: Path, svg: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    if svg:
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def plan_summary(record: dict, record_path: Path, root: Path, svg: bool) -> dict[str, Any]:
    name = record["plan"]["name"]
    figures = {kind: root / "figures" / f"{kind}-{name}.png" for kind in ("ladder", "workloads", "kernels")}
    ladder_figure(record, figures["ladder"], svg)
    workloads_figure(record, figures["workloads"], svg)
    kernels_figure(record, figures["kernels"], svg)
    return {
        "name": name,
        "label": plan_label(record),
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
        "stages": stage_table(record),
    }


def _relative(path: Path, root: Path) -> str:
    path, root = Path(path).resolve(), root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def select_records(root: Path, plan: str | None, record_paths: list[str]) -> list[tuple[Path, dict]]:
    if record_paths:
        chosen = [(Path(p), read_record(Path(p))) for p in record_paths]
    else:
        chosen = list(newest_per_plan(root / "runs").values())
    if plan:
        chosen = [(p, r) for p, r in chosen if r["plan"]["name"] == plan]
    # GPU plans first: the report leads with the measurements that matter.
    return sorted(chosen, key=lambda item: (item[1]["plan"]["device"] == "cpu", item[1]["plan"]["name"]))


def write_summary(root: Path, chosen: list[tuple[Path, dict]], svg: bool = False) -> Path:
    records = [record for _, record in chosen]
    summary = {
        "schema": SUMMARY_SCHEMA,
        "plans": [plan_summary(record, path, root, svg) for path, record in chosen],
        "attempts": attempt_table(records),
        "newest_utc": max((r["env"]["utc"] for r in records), default=None),
        "synthetic": any(r["weights"]["synthetic"] for r in records),
    }
    path = root / "figures" / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    return path


README_START, README_END = "<!-- results:ladder -->", "<!-- /results:ladder -->"


def readme_ladder(chosen: list[tuple[Path, dict]], root: Path) -> str:
    """Markdown: per plan, its label, the ladder figure and the ladder table (headline workload)."""
    parts = []
    for path, record in chosen:
        plan = record["plan"]
        parts.append(
            f"**{plan_label(record)}**, workload `{plan['headline']}` (record `{_relative(path, root)}`; "
            "synthetic weights):\n"
        )
        parts.append(f"![ladder](results/figures/ladder-{plan['name']}.png)\n")
        table = ladder_table(record)
        parts.append("| " + " | ".join(table[0]) + " |")
        parts.append("|" + "---|" * len(table[0]))
        parts += ["| " + " | ".join(row) + " |" for row in table[1:]]
        parts.append("")
    return "\n".join(parts) if parts else "No complete run record yet.\n"


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
        print(f"no complete run record under {root / 'runs'}; the report will say so", file=sys.stderr)
    for _, record in chosen:
        print(f"figures for {plan_label(record)}")
    print(f"summary: {path}")
    readme = REPO / "README.md"
    if root.resolve() == (REPO / "results").resolve() and readme.is_file():
        readme.write_text(replace_between_markers(readme.read_text(), readme_ladder(chosen, root)))
        print(f"ladder tables: {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
