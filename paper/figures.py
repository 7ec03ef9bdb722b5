"""Figures and the report summary from run records alone (results/runs/*.json); no GPU, no model code.

    python -m paper.figures [--results DIR] [--plan NAME] [--record PATH ...]

Records: `ablations.records.newest_records` (per plan the newest complete one and a newer partial one) or those named
with `--record`. Per record, under `<results>/figures/` (`-partial` for a partial record): `ladder-<plan>.png`
(median and p10-p90 per stage on the headline, speed-up over the baseline, floors; untimed stages as slots naming
their status) and `time-<plan>.png`, the kernel profile (kernel ms per family stacked, GPU idle, host launch time).
Then `serving-<gpu|cpu>.png` (paper/serving.py) and `summary.json`, every table of the report (paper/tables.py); on
the checkout's own results, the README's generated blocks (paper/readme.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

from ablations import targets  # noqa: E402
from ablations.records import STATUS_TEXT, load_attempts, measured, ms, newest_records, read_record  # noqa: E402
from paper import readme, serving, tables  # noqa: E402

SUMMARY_FILE = "figures/summary.json"  # under the results folder


def _title(record: dict, what: str) -> str:
    title = f"{what}\n{tables.plan_label(record)} · synthetic weights · {record['env']['utc']}"
    return title if record["complete"] else f"{title}\n{tables.completeness(record).upper()}"


def _ticks(labels: list[str]) -> list[str]:
    return [label.replace(" (", "\n(") for label in labels]


def ladder_figure(record: dict) -> plt.Figure:
    rows = tables.ladder_rows(record)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.6))
    top = max([r["p90_ms"] for r in rows if r["p90_ms"] is not None], default=1.0)
    floor_label = "floor: max(weight streaming, compute for the stage's rows)"
    for x, r in enumerate(rows):
        if r["median_ms"] is None:
            ax.bar(x, top * 0.15, color="none", edgecolor="0.6", hatch="//", linestyle="--")
            text, y = _ticks([STATUS_TEXT.get(r["status"], r["status"])])[0], top * 0.17
        else:
            errors = [[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]]
            ax.bar(x, r["median_ms"], color="#4C72B0", yerr=errors, capsize=4, error_kw={"elinewidth": 1})
            ax.hlines(r["floor_ms"], x - 0.45, x + 0.45, colors="#C44E52", linestyles="--", lw=1.5, label=floor_label)
            floor_label = None  # one legend entry
            text, y = f"{ms(r['median_ms'])} ms\n{tables.number(r['speedup'], '.2f', '×')}", r["p90_ms"] + top * 0.02
        ax.text(x, y, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), _ticks([r["heading"] for r in rows]))
    ax.set(ylabel="median ms (p10–p90), forward + head", ylim=(0, top * 1.25))
    plan = record["plan"]
    ax.set_title(_title(record, f"Latency ladder: {plan['headline']} (× = over {plan['baseline']})"), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    return fig


def time_figure(record: dict) -> plt.Figure:
    """The kernel profile: stacked kernel ms per family + GPU idle up to the median, per stage on the headline; host
    launch time marked."""
    rows, headline = tables.time_rows(record), record["plan"]["headline"]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(rows) + 3.5), 4.8) if rows else (9, 1.8))
    if not rows:  # a figure that says why there is nothing to draw
        ax.axis("off")
        fig.suptitle(_title(record, f"Where the time goes: {headline}\n\n{tables.NO_FAMILIES}"), fontsize=9)
        return fig
    xs, bottoms = range(len(rows)), [0.0] * len(rows)
    for family in dict.fromkeys(f for r in rows for f in r["families"]):
        heights = [r["families"].get(family, {}).get("ms_per_forward", 0.0) for r in rows]
        label, colour = tables.FAMILIES.get(family, (family, "#8C8C8C"))
        ax.bar(xs, heights, bottom=bottoms, width=0.6, color=colour, label=f"{label} kernels")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.bar(xs, [r["idle_ms"] for r in rows], bottom=bottoms, width=0.6, color="white", edgecolor="0.5", hatch="..",
           label="GPU idle (median − kernel ms)")  # fmt: skip
    host_label = "host launch time (median host ms until the call returned)"
    top = max(max(r["median_ms"], r["kernel_ms"]) for r in rows)
    for x, r in enumerate(rows):
        if r["host_median_ms"] is not None:
            ax.hlines(r["host_median_ms"], x - 0.38, x + 0.38, colors="black", lw=2, label=host_label)
            host_label = None  # one legend entry
        core = tables.number(r["core_multiple"], ".2f", "× core")
        ax.text(x, max(r["median_ms"], r["kernel_ms"]) + top * 0.02, f"{ms(r['median_ms'])} ms\n{core}", ha="center",
                va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(xs), _ticks([r["heading"] for r in rows]))
    ax.set(ylabel="ms per forward (bar height = median)", ylim=(0, top * 1.2))
    ax.set_title(_title(record, f"Where the time goes: {headline} (kernel ms per family, one call)"), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


FIGURES = {"ladder": ladder_figure, "time": time_figure}


def _save(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def plan_summary(record: dict, record_path: Path, root: Path) -> dict[str, Any]:
    """Every table and sentence the report (and the README block) shows for one record; its figures' paths."""
    plan, later = record["plan"], tables.followups(record, root)
    target_rows = targets.evaluate(record, later)
    timer = "CUDA-event" if plan["timer"] == "cuda-events" else "perf_counter"
    return {
        "name": plan["name"], "label": tables.plan_label(record), "partial": not record["complete"],
        "completeness": tables.completeness(record), "is_cpu": plan["device"] == "cpu",
        "record": tables.relative_path(record_path, root), "utc": record["env"]["utc"],
        **{key: plan[key] for key in ("headline", "baseline", "reference")}, "notes": plan.get("notes", ""),
        "timing": f"median of {plan['runs']} {timer} timings",
        "headline_stages": [stage["name"] for stage in record["stages"] if measured(stage, plan["headline"])],
        "figures": {kind: "/" + tables.relative_path(tables.figure_path(root, kind, record), root) for kind in FIGURES},
        "run": tables.run_line(record), "ladder": tables.ladder_table(record),
        "later_ladders": tables.later_stage_ladders(record, later, root),
        "speedups": tables.class_speedups(record), "exactness": tables.exactness_table(record),
        "missing": tables.still_missing(record, target_rows), "targets": tables.targets_table(target_rows),
        "bit_identity": tables.bit_identity(record),
    }  # fmt: skip


def select_records(root: Path, plan: str | None, record_paths: list[str]) -> list[tuple[Path, dict]]:
    """The records named, else `newest_records` of root/runs; only `plan`'s if given; GPU plans first, and within a
    plan the newest record first."""
    chosen = [(Path(p), read_record(Path(p))) for p in record_paths] if record_paths else newest_records(root / "runs")
    chosen = [(p, r) for p, r in chosen if not plan or r["plan"]["name"] == plan]
    newest_first = sorted(chosen, key=lambda item: item[1]["env"]["utc"], reverse=True)
    return sorted(newest_first, key=lambda item: (item[1]["plan"]["device"] == "cpu", item[1]["plan"]["name"]))


def write_summary(root: Path, chosen: list[tuple[Path, dict]]) -> dict[str, Any]:
    """Every figure and `<root>/figures/summary.json` for the chosen records; returns the summary."""
    for _, record in chosen:
        for kind, draw in FIGURES.items():
            _save(draw(record), tables.figure_path(root, kind, record))
    serving.draw_serving_figures(root)
    records = [record for _, record in chosen]
    summary = {
        "plans": [plan_summary(record, path, root) for path, record in chosen],
        "attempts": tables.attempt_table(records, load_attempts()),
        "serving": serving.serving_summary(root), "jevbench": serving.jevbench_table(root),
        "gemm_over_graphs": tables.gemm_over_graphs(root),
        "newest_utc": max((r["env"]["utc"] for r in records), default=None),
    }  # fmt: skip
    path = root / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paper.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results folder (default: $JEVLAB_RESULTS or results/)")
    parser.add_argument("--plan", help="only this plan")
    parser.add_argument("--record", action="append", default=[], help="use this record (repeatable)")
    args = parser.parse_args(argv)
    root = tables.results_dir(args.results)
    chosen = select_records(root, args.plan, args.record)
    summary = write_summary(root, chosen)
    print(f"{len(chosen)} records drawn from {root / 'runs'}; summary: {root / SUMMARY_FILE}")
    readme_path = tables.REPO / "README.md"
    if root.resolve() == (tables.REPO / "results").resolve() and readme_path.is_file():
        readme_path.write_text(readme.rewrite(readme_path.read_text(), summary))
        print(f"README blocks: {readme_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
