"""Figures and the report summary from run records alone (results/runs/*.json); no GPU, no model code.

    python -m paper.figures [--results DIR] [--plan NAME] [--record PATH ...] [--svg]

Per plan the newest complete record and a newer partial one (labelled partial, drawn into `-partial` files), or the
records named with `--record`. Per record, under `<results>/figures/`: `ladder-<plan>.png` (median and p10-p90 per
stage on the headline, speed-up over the baseline, floors; untimed stages as slots naming their status),
`workloads-` (every stage on every workload, log scale), `kernels-` (kernels per forward, GPU busy against wall ms),
`time-` (kernel ms per family stacked, GPU idle, host launch time), `states-` (relative RMSE of every residual state
against the reference, bit-identical states on a floor band, first departures starred); a figure with nothing to draw
says why. Then `serving-<gpu|cpu>.png` (paper/serving.py) and `summary.json`: every table and sentence of the report,
formatted (paper/tables.py). On the checkout's own results the README blocks (paper/readme.py) are rewritten too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)
from matplotlib.ticker import NullLocator  # noqa: E402

from ablations import targets  # noqa: E402
from ablations.records import (  # noqa: E402
    STATUS_TEXT,
    has_timings,
    load_attempts,
    measured,
    ms,
    newest_records,
    read_record,
)
from paper import readme, serving, tables  # noqa: E402

SUMMARY_SCHEMA = "jevlab-report-summary/1"
SUMMARY_FILE = "figures/summary.json"  # under the results folder


def _title(record: dict, what: str) -> str:
    title = f"{what}\n{tables.plan_label(record)} · synthetic weights · {record['env']['utc']}"
    return title if record["complete"] else f"{title}\n{tables.completeness(record).upper()}"


def _lines(label: str) -> str:
    """A stage label broken before its bracket, for a tick or a bar."""
    return label.replace(" (", "\n(")


def _label_above(ax: plt.Axes, x: float, y: float, text: str) -> None:
    """A small centred label whose bottom sits at (x, y), above a bar."""
    ax.text(x, y, text, ha="center", va="bottom", fontsize=8)


def _message_figure(text: str, title: str) -> plt.Figure:
    """A figure that only says why there is nothing to draw."""
    fig, ax = plt.subplots(figsize=(9, 1.8))
    ax.axis("off")
    ax.text(0.5, 0.5, text.replace(": ", ":\n", 1), ha="center", va="center", fontsize=9, wrap=True)
    fig.suptitle(title, fontsize=9)
    return fig


def ladder_figure(record: dict) -> plt.Figure:
    rows = tables.ladder_rows(record)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.6))
    top = max([r["p90_ms"] for r in rows if r["p90_ms"] is not None], default=1.0)
    floor_label = "floor: max(weight streaming, compute for the stage's rows)"
    for x, r in enumerate(rows):
        if r["median_ms"] is None:
            ax.bar(x, top * 0.15, color="none", edgecolor="0.6", hatch="//", linestyle="--")
            _label_above(ax, x, top * 0.17, _lines(STATUS_TEXT.get(r["status"], r["status"])))
            continue
        errors = [[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]]
        ax.bar(x, r["median_ms"], color="#4C72B0", yerr=errors, capsize=4, error_kw={"elinewidth": 1})
        ax.hlines(r["floor_ms"], x - 0.45, x + 0.45, colors="#C44E52", linestyles="--", lw=1.5, label=floor_label)
        floor_label = None  # one legend entry
        speedup = tables.number(r["speedup"], ".2f", "×")
        _label_above(ax, x, r["p90_ms"] + top * 0.02, f"{ms(r['median_ms'])} ms\n{speedup}")
    ax.set_xticks(range(len(rows)), [_lines(r["heading"]) for r in rows])
    ax.set_ylabel("median ms (p10–p90), forward + head")
    ax.set_ylim(0, top * 1.25)
    baseline = record["plan"]["baseline"]
    ax.set_title(_title(record, f"Latency ladder: {record['plan']['headline']} (× = speed-up over {baseline})"),
                 fontsize=9)  # fmt: skip
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    return fig


def workloads_figure(record: dict) -> plt.Figure:
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
        ax.bar(xs, heights, width=width, label=tables.stage_heading(stage, record))
    ax.set_yscale("log")
    ax.set_xticks(range(len(ids)), [i.removeprefix("jevbench/") for i in ids], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("median ms, forward + head (log)")
    ax.set_title(_title(record, "Every workload"), fontsize=9)
    if timed:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def kernels_figure(record: dict) -> plt.Figure:
    rows = [r for r in tables.ladder_rows(record) if r["median_ms"] is not None]
    counted = [r for r in rows if r["kernels_per_forward"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2 if counted else 1.6))
    if not counted:
        for ax in (left, right):
            ax.axis("off")
        left.text(0.5, 0.5, "no CUDA kernels counted (no GPU in this run)", ha="center", va="center")
    else:
        names = [_lines(r["heading"]) for r in counted]
        left.bar(names, [r["kernels_per_forward"] for r in counted], color="#55A868")
        for x, r in enumerate(counted):
            kernels = r["kernels_per_forward"]
            _label_above(left, x, kernels, f"{kernels:,.0f}")
        left.set_ylabel("kernels per forward")
        xs = range(len(counted))
        right.bar([x - 0.2 for x in xs], [r["median_ms"] for r in counted], width=0.4, label="wall (median)")
        right.bar([x + 0.2 for x in xs], [r["gpu_busy_ms"] for r in counted], width=0.4, label="GPU busy")
        right.set_xticks(list(xs), names)
        right.set_ylabel("ms per forward")
        right.legend(fontsize=8)
    fig.suptitle(_title(record, f"Kernels per forward and GPU-busy time: {record['plan']['headline']}"), fontsize=9)
    fig.tight_layout()
    return fig


FAMILY_COLOURS = {"gemm": "#4C72B0", "gdn_core": "#55A868", "attention_core": "#8172B2", "ours": "#DD8452",
                  "other": "#937860"}  # fmt: skip


def time_figure(record: dict) -> plt.Figure:
    """Stacked kernel ms per family + GPU idle up to the median, per stage on the headline; host launch time marked."""
    rows = tables.time_rows(record)
    headline = record["plan"]["headline"]
    if not rows:
        return _message_figure(tables.NO_FAMILIES, _title(record, f"Where the time goes: {headline}"))
    families = list(dict.fromkeys(f for r in rows for f in r["families"]))
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(rows) + 3.5), 4.8))
    xs = range(len(rows))
    bottoms = [0.0] * len(rows)
    for family in families:
        heights = [r["families"].get(family, {}).get("ms_per_forward", 0.0) for r in rows]
        label = f"{tables.FAMILY_TEXT.get(family, family)} kernels"
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
        core = tables.number(r["core_multiple"], ".2f", "× core")
        _label_above(ax, x, max(r["median_ms"], r["kernel_ms"]) + top * 0.02, f"{ms(r['median_ms'])} ms\n{core}")
    ax.set_xticks(list(xs), [_lines(r["heading"]) for r in rows])
    ax.set_ylabel("ms per forward (bar height = median)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title(_title(record, f"Where the time goes: {headline} (kernel ms per family from one profiled call)"),
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


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


def states_figure(record: dict) -> plt.Figure:
    """Relative RMSE against the reference per residual state and stage (log scale); zeros (bit-identical states)
    sit on a labelled floor band below the smallest non-zero value; each stage's first departing state starred."""
    departures = tables.departure_rows(record)
    rows = [r for r in departures if r["states"] is not None]
    headline, reference = record["plan"]["headline"], record["plan"]["reference"]
    title = _title(record, f"Where each path departs from {reference}: every residual state, {headline}")
    if not rows:
        return _message_figure(tables.NO_STATES, title)
    count = len(rows[0]["states"])
    positive = [v for r in rows for v in r["states"] if v > 0]
    floor = min(positive) / 30 if positive else 1e-6  # where zeros are drawn: a decade and a half below the data
    top = max(positive) if positive else floor * 100
    fig, ax = plt.subplots(figsize=(max(9.0, 0.16 * count + 4), 4.6))
    types = tables.layer_types_of(record)
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
        departs = tables.departure_text(r)
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
    missing = [r["stage"] for r in departures if r["timed"] and r["states"] is None]
    if missing:
        ax.text(1.01, 0.0, f"not measured: {', '.join(missing)}", transform=ax.transAxes, fontsize=7, va="bottom")
    fig.tight_layout()
    return fig


def _save(fig: plt.Figure, path: Path, svg: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    if svg:
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


FIGURES = {"ladder": ladder_figure, "workloads": workloads_figure, "kernels": kernels_figure, "time": time_figure,
           "states": states_figure}  # fmt: skip


# Summary keys filled by a function of the record alone, in the order summary.json lists them after the plan's fields.
RECORD_PARTS = {"method": tables.method_table, "environment": tables.env_table, "ladder": tables.ladder_table}
LATER_PARTS = {"workloads": tables.workload_table, "correctness": tables.correctness_table,
               "bit_identity": tables.bit_identity_summary, "departures": tables.departures_summary,
               "time": tables.time_summary}  # fmt: skip


def plan_summary(record: dict, record_path: Path, root: Path) -> dict[str, Any]:
    """Every table and sentence the report (and the README block) shows for one record; its figures' paths."""
    plan, later = record["plan"], tables.followups(record, root)
    target_rows = targets.evaluate(record, later)
    return {
        "name": plan["name"], "label": tables.record_label(record), "partial": not record["complete"],
        "completeness": tables.completeness(record), "is_cpu": plan["device"] == "cpu",
        "record": tables.relative_path(record_path, root), "utc": record["env"]["utc"],
        **{key: plan[key] for key in ("headline", "baseline", "reference")}, "notes": plan.get("notes", ""),
        "synthetic": bool(record["weights"]["synthetic"]), "statement": record["weights"].get("statement") or "",
        "figures": {kind: "/" + tables.relative_path(tables.figure_path(root, kind, record), root) for kind in FIGURES},
        "overview": {"speedups": tables.class_speedups(record), "exactness": tables.measured_exactness(record),
                     "missing": tables.still_missing(record, target_rows)},
        **{key: tabulate(record) for key, tabulate in RECORD_PARTS.items()},
        "later_ladders": tables.later_stage_ladders(record, later, root),
        **{key: tabulate(record) for key, tabulate in LATER_PARTS.items()},
        "targets": {"table": tables.targets_table(target_rows),
                    "outcomes": {row["id"]: row["outcome"] for row in target_rows}},
        "probes": tables.probe_tables(record, later),
        "stages": tables.stage_table(record),
    }  # fmt: skip


def select_records(root: Path, plan: str | None, record_paths: list[str]) -> list[tuple[Path, dict]]:
    """The records named, else `newest_records` of root/runs; only `plan`'s if given; GPU plans first."""
    if record_paths:
        chosen = [(Path(p), read_record(Path(p))) for p in record_paths]
    else:
        chosen = newest_records(root / "runs")
    if plan:
        chosen = [(p, r) for p, r in chosen if r["plan"]["name"] == plan]
    # GPU plans first: the report leads with the measurements that matter; within a plan the newest record first.
    newest_first = sorted(chosen, key=lambda item: item[1]["env"]["utc"], reverse=True)
    return sorted(newest_first, key=lambda item: (item[1]["plan"]["device"] == "cpu", item[1]["plan"]["name"]))


def write_summary(root: Path, chosen: list[tuple[Path, dict]], svg: bool = False) -> dict[str, Any]:
    """Every figure and `<root>/figures/summary.json` for the chosen records; returns the summary."""
    for _, record in chosen:
        for kind, draw in FIGURES.items():
            _save(draw(record), tables.figure_path(root, kind, record), svg)
    records = [record for _, record in chosen]
    summary = {
        "schema": SUMMARY_SCHEMA,
        "plans": [plan_summary(record, path, root) for path, record in chosen],
        "attempts": tables.attempt_table(records, load_attempts()),
        "serving": serving.serving_summary(root),
        "jevbench": serving.jevbench_table(root),
        "gemm_over_graphs": tables.gemm_over_graphs(root),
        "newest_utc": max((r["env"]["utc"] for r in records), default=None),
        "synthetic": any(r["weights"]["synthetic"] for r in records),
    }
    path = root / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paper.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results folder (default: $JEVLAB_RESULTS or results/)")
    parser.add_argument("--plan", help="only this plan")
    parser.add_argument("--record", action="append", default=[], help="use this record (repeatable)")
    parser.add_argument("--svg", action="store_true", help="also write SVG beside each PNG")
    args = parser.parse_args(argv)
    root = tables.results_dir(args.results)
    chosen = select_records(root, args.plan, args.record)
    summary = write_summary(root, chosen, args.svg)
    if not chosen:
        print(f"no run record under {root / 'runs'}; the report will say so", file=sys.stderr)
    for _, record in chosen:
        print(f"figures for {tables.record_label(record)} ({tables.completeness(record)})")
    print(f"summary: {root / SUMMARY_FILE}")
    readme_path = tables.REPO / "README.md"
    if root.resolve() == (tables.REPO / "results").resolve() and readme_path.is_file():
        text = readme.replace_between_markers(readme_path.read_text(), readme.ladder(summary["plans"],
                                              summary["gemm_over_graphs"]))  # fmt: skip
        text = readme.replace_between_markers(text, readme.serving(summary["jevbench"], summary["serving"]),
                                              readme.SERVING_BLOCK)  # fmt: skip
        readme_path.write_text(text)
        print(f"ladder and serving blocks: {readme_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
