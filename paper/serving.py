"""The report's serving section from serving runs alone: per device the newest client sweep
(results/serving/*/summary.json of `python -m bench.concurrency`; a `--compare-batching` run has no
`per_clients` and is not one) with its table and figure (requests/s and client latency against clients), and the
newest JevBench run per backend and device (results/jevbench/*/summary.json). No torch, no GPU, no model code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

from ablations.records import DASH, sci  # noqa: E402
from paper.tables import machine, number, relative_path  # noqa: E402

JEVBENCH_HEADER = ["backend", "device", "run", "answered", "pass-2 client P50 / P95 / max ms", "argmax agreement",
                   "max |dp|", "reference"]  # fmt: skip


def _summaries(root: Path, kind: str) -> list[tuple[Path, dict]]:
    """Every `<root>/<kind>/*/summary.json`, oldest first (run folders are named by their UTC start)."""
    return [(path, json.loads(path.read_text())) for path in sorted((root / kind).glob("*/summary.json"))]


def clients_table(summary: dict) -> list[list[str]]:
    one = summary["per_clients"].get("1")
    table = [["clients", "requests", "requests/s", "x one client", "P50 ms", "P95 ms", "errors", "identical to alone",
              "requests per forward"]]  # fmt: skip
    for clients, row in sorted(summary["per_clients"].items(), key=lambda item: int(item[0])):
        table.append([clients, str(row["requests"]), number(row["requests_per_s"], ".1f"),
                      number(row["requests_per_s"] / one["requests_per_s"] if one else None, ".2f", "x"),
                      number(row["latency"]["p50_ms"], ".1f"), number(row["latency"]["p95_ms"], ".1f"),
                      str(row["errors"]), f"{row['identical_to_alone']}/{row['requests']}",
                      number(row.get("mean_requests_per_forward"), ".2f")])  # fmt: skip
    return table


def targets_text(summary: dict) -> str:
    if (result := summary.get("targets")) is None:
        return "Issue 15's targets need the 1- and 8-client passes; this run lacks one."
    met = lambda flag: "met" if flag else "missed"
    every = "every" if result["all_identical"] else "not every"
    return (f"At {result['clients']} clients: throughput {result['throughput_ratio']:.2f}x one client's (target >= 3x: "
            f"{met(result['throughput_met'])}), P50 {result['p50_ratio']:.2f}x one client's (target <= 2x: "
            f"{met(result['p50_met'])}), {result['errors']} errors, {every} answer bit-identical to the same task "
            "alone.")  # fmt: skip


def serving_figure(summary: dict, path: Path) -> None:
    rows = sorted(summary["per_clients"].items(), key=lambda item: int(item[0]))
    clients = [int(count) for count, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    left.plot(clients, [row["requests_per_s"] for _, row in rows], marker="o")
    left.set(xlabel="concurrent clients", ylabel="requests / s", xticks=clients, ylim=(0, None))
    for quantile in ("p50", "p95"):
        right.plot(clients, [row["latency"][f"{quantile}_ms"] for _, row in rows], marker="o", label=quantile.upper())
    right.set(xlabel="concurrent clients", ylabel="client latency, ms", xticks=clients, ylim=(0, None))
    right.legend()
    run, where = summary["run"], machine(summary["environment"])
    fig.suptitle(f"Serving JevBench ({run['tasks']} tasks per client), {run['label']}, {where}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def newest_sweeps(root: Path) -> dict[str, tuple[Path, dict]]:
    """Per device ("gpu" first, then "cpu") the newest client sweep's summary path and summary."""
    sweeps = sorted((item for item in _summaries(root, "serving") if "per_clients" in item[1]),
                    key=lambda item: item[1]["environment"]["utc"])  # fmt: skip
    newest = {"gpu" if summary["environment"].get("gpu") else "cpu": (path, summary) for path, summary in sweeps}
    return {device: newest[device] for device in ("gpu", "cpu") if device in newest}


def serving_figure_path(root: Path, device: str) -> Path:
    return root / "figures" / f"serving-{device}.png"


def draw_serving_figures(root: Path) -> list[Path]:
    """Draw the figure of each device's newest sweep (`serving_figure`) to `serving_figure_path`; returns the paths."""
    paths = []
    for device, (_, summary) in newest_sweeps(root).items():
        serving_figure(summary, path := serving_figure_path(root, device))
        paths.append(path)
    return paths


def serving_summary(root: Path) -> list[dict[str, Any]]:
    """Per device (GPU first) the newest client sweep: label, record, table, targets sentence and the path of its
    figure, which `draw_serving_figures` draws (this function reads only)."""
    out = []
    for device, (path, summary) in newest_sweeps(root).items():
        cpu = " [CPU: the tiny twin, says nothing about GPU throughput]" if device == "cpu" else ""
        out.append({"label": f"{summary['run']['label']} on {machine(summary['environment'])}{cpu}",
                    "record": relative_path(path.parent, root), "utc": summary["environment"]["utc"], "device": device,
                    "table": clients_table(summary), "targets": targets_text(summary),
                    "figure": "/" + relative_path(serving_figure_path(root, device), root)})  # fmt: skip
    return out


def jevbench_table(root: Path) -> list[list[str]]:
    """The newest JevBench run per backend and device: answered of tasks in pass 2, pass 2's client latency, and
    argmax agreement and max |dp| against the run's reference where it has one (dashes without a pass 2)."""
    newest = {(s["run"]["label"], machine(s["environment"])): (p, s) for p, s in _summaries(root, "jevbench")}
    table = [JEVBENCH_HEADER]
    for (backend, device), (path, summary) in newest.items():
        run, second = relative_path(path.parent, root), summary["passes"].get("2")
        if second is None:  # a run of one pass, or stopped before its second
            table.append([backend, device, run, "no pass 2", *[DASH] * 4])
            continue
        latency, agreement, reference = second["latency"], second.get("agreement"), summary["run"]["reference"]
        table.append([backend, device, run, f"{second['answered']} of {second['tasks']}",
                      " / ".join(number(latency[key], ".1f") for key in ("p50_ms", "p95_ms", "max_ms")),
                      f"{agreement['argmax_agreement']} of {agreement['compared']}" if agreement else DASH,
                      sci(agreement["max_abs_dp"] if agreement else None),
                      Path(reference).name if reference else DASH])  # fmt: skip
    return table
