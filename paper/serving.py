"""The report's serving section from concurrency runs alone (results/serving/*/summary.json, written by
`python -m bench.concurrency`): per device the newest run, its table and its figure (requests/s and client
latency against clients); and the JevBench runs' table (results/jevbench/*/summary.json, `python -m
bench.jevbench`). No torch, no GPU, no model code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

from paper import tables  # noqa: E402

HEADER = ["clients", "requests", "requests/s", "x one client", "P50 ms", "P95 ms", "errors", "identical to alone",
          "requests per forward"]  # fmt: skip


def device_of(summary: dict) -> str:
    return "gpu" if summary["environment"].get("gpu") else "cpu"


def newest_runs(root: Path) -> list[tuple[Path, dict]]:
    """The newest client sweep per device under `<root>/serving/`, GPU first (a `--compare-batching` run has no
    `per_clients` and is not one)."""
    newest: dict[str, tuple[Path, dict]] = {}
    for path in sorted((root / "serving").glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if "per_clients" not in summary:
            continue
        device = device_of(summary)
        if device not in newest or summary["environment"]["utc"] > newest[device][1]["environment"]["utc"]:
            newest[device] = (path, summary)
    return [newest[device] for device in ("gpu", "cpu") if device in newest]


def clients_table(summary: dict) -> list[list[str]]:
    rows = summary["per_clients"]
    one = rows.get("1")
    table = [HEADER]
    for clients, row in sorted(rows.items(), key=lambda item: int(item[0])):
        ratio = row["requests_per_s"] / one["requests_per_s"] if one else None
        table.append([clients, str(row["requests"]), tables.number(row["requests_per_s"], ".1f"),
                      tables.number(ratio, ".2f", "x"), tables.number(row["latency"]["p50_ms"], ".1f"),
                      tables.number(row["latency"]["p95_ms"], ".1f"), str(row["errors"]),
                      f"{row['identical_to_alone']}/{row['requests']}",
                      tables.number(row.get("mean_requests_per_forward"), ".2f")])  # fmt: skip
    return table


def targets_text(summary: dict) -> str:
    result = summary.get("targets")
    if result is None:
        return "Issue 15's targets need the 1- and 8-client passes; this run lacks one."
    met = lambda flag: "met" if flag else "missed"
    return (
        f"At {result['clients']} clients: throughput {result['throughput_ratio']:.2f}x one client's "
        f"(target >= 3x: {met(result['throughput_met'])}), P50 {result['p50_ratio']:.2f}x one client's "
        f"(target <= 2x: {met(result['p50_met'])}), {result['errors']} errors, "
        f"{'every' if result['all_identical'] else 'not every'} answer bit-identical to the same task alone."
    )


def serving_figure(summary: dict, path: Path) -> None:
    rows = sorted(summary["per_clients"].items(), key=lambda item: int(item[0]))
    clients = [int(count) for count, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    left.plot(clients, [row["requests_per_s"] for _, row in rows], marker="o")
    left.set(xlabel="concurrent clients", ylabel="requests / s", xticks=clients)
    left.set_ylim(bottom=0)
    for quantile, key in (("P50", "p50_ms"), ("P95", "p95_ms")):
        right.plot(clients, [row["latency"][key] for _, row in rows], marker="o", label=quantile)
    right.set(xlabel="concurrent clients", ylabel="client latency, ms", xticks=clients)
    right.set_ylim(bottom=0)
    right.legend()
    machine = tables.machine(summary["environment"])
    fig.suptitle(f"Serving JevBench ({summary['run']['tasks']} tasks per client), {summary['run']['label']}, {machine}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


JEVBENCH_HEADER = ["backend", "device", "run", "answered", "pass-2 client P50 / P95 / max ms", "argmax agreement",
                   "max |dp|", "reference"]  # fmt: skip


def jevbench_table(root: Path) -> list[list[str]]:
    """The newest JevBench run per backend and device under `<root>/jevbench/` (run folders are named by their UTC
    start, so the last in name order is the newest): answered of tasks in pass 2, pass 2's client latency, and argmax
    agreement and max |dp| against the run's reference where it has one (dashes for a run without pass 2). A header
    only when there is no run."""
    newest: dict[tuple[str, str], tuple[Path, dict]] = {}
    for path in sorted((root / "jevbench").glob("*/summary.json")):
        summary = json.loads(path.read_text())
        newest[summary["run"]["label"], tables.machine(summary["environment"])] = (path, summary)
    table = [JEVBENCH_HEADER]
    for (backend, device), (path, summary) in newest.items():
        second = summary["passes"].get("2")
        if second is None:  # a run of one pass, or stopped before its second
            table.append([backend, device, tables.relative_path(path.parent, root), "no pass 2", *[tables.DASH] * 4])
            continue
        latency, agreement, reference = second["latency"], second.get("agreement"), summary["run"]["reference"]
        client = " / ".join(tables.number(latency[key], ".1f") for key in ("p50_ms", "p95_ms", "max_ms"))
        agrees, dp = tables.DASH, None
        if agreement is not None:
            agrees, dp = f"{agreement['argmax_agreement']} of {agreement['compared']}", agreement["max_abs_dp"]
        table.append([backend, device, tables.relative_path(path.parent, root),
                      f"{second['answered']} of {second['tasks']}", client, agrees, tables.sci(dp),
                      Path(reference).name if reference else tables.DASH])  # fmt: skip
    return table


def serving_summary(root: Path) -> list[dict[str, Any]]:
    """Per device (GPU first) the newest concurrency run: label, record, table, targets sentence, figure (drawn)."""
    out = []
    for path, summary in newest_runs(root):
        figure = root / "figures" / f"serving-{device_of(summary)}.png"
        serving_figure(summary, figure)
        cpu = " [CPU: the tiny twin, says nothing about GPU throughput]" if device_of(summary) == "cpu" else ""
        out.append({"label": f"{summary['run']['label']} on {tables.machine(summary['environment'])}{cpu}",
                    "record": tables.relative_path(path.parent, root), "utc": summary["environment"]["utc"],
                    "table": clients_table(summary), "targets": targets_text(summary),
                    "figure": "/" + tables.relative_path(figure, root), "note": summary.get("note", ""),
                    "device": device_of(summary)})  # fmt: skip
    return out
