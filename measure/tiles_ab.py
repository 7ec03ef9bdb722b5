"""An A/B of the `kernel_tiles` probe read from its log: one table of each tile's time in every run, and the change
of each candidate run against the baseline runs beside it.

    python -m measure.tiles_ab results/gpu/<stamp>-kernel-tiles-ab.log            # prints the table
    python -m measure.tiles_ab LOG --json results/kernel-tiles/<stamp>-ab.json     # and writes it

The log is what a campaign step writes: the probe (`python -m ablations.probes kernel_tiles`, ablations/probes.py) run
several times back to back on one card, each run under a header line `== old <commit>` or `== new <commit>` and ending
in the probe's JSON line ({"rows": R, "cases": [{kernel, tile, us, tbps, equal_share, nan_free}, ...]}), usually old,
new, old again. A run with no JSON line (a probe that failed) is an error here, with its header.

Per (kernel, tile) the table lists the us of every run in log order, then for each `new` run its change against the
mean of the `old` runs next to it (the one before and the one after; a single neighbour where only one exists), so a
card that drifts over the A/B shows as the two baselines disagreeing (`old_spread`: the largest relative difference
between the old runs). `shipped` marks the first case of each kernel, the probe's shipped tile. `equal_share` and
`nan_free` are every new run's (the share of output elements bit-equal to the same run's shipped tile, and whether every
element was written). Runs of trees that swept different tiles (an older tree lacks the tiles added since) compare
where both swept a tile; a tile missing from a run shows `-` there. Nothing runs on a GPU here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ablations.envinfo import write_json
from paper.readme import markdown_table


class TilesLogError(ValueError):
    """A kernel_tiles A/B log this tool cannot read: the message says where and why."""


def parse_runs(text: str, source: str = "log") -> list[dict[str, Any]]:
    """The runs of an A/B log in order: [{"label": "old 012b775", "role": "old" | "new", "result": probe JSON}]."""
    runs: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("=="):
            label = line.strip("= \n")
            role = label.split()[0] if label else ""
            if role not in ("old", "new"):
                raise TilesLogError(
                    f"{source}:{number}: a run header must start with '== old' or '== new', got {line!r}"
                )
            runs.append({"label": label, "role": role, "result": None, "line": number})
        elif line.startswith("{") and runs:
            try:
                result = json.loads(line)
            except json.JSONDecodeError as error:
                raise TilesLogError(f"{source}:{number}: the probe's JSON line does not parse ({error})") from error
            if "cases" not in result:
                raise TilesLogError(f"{source}:{number}: a JSON line without 'cases' (not the kernel_tiles probe)")
            runs[-1]["result"] = result
    if not runs:
        raise TilesLogError(f"{source}: no '== old' / '== new' run headers")
    for run in runs:
        if run["result"] is None:
            raise TilesLogError(f"{source}:{run['line']}: run '{run['label']}' has no probe JSON line (did it fail?)")
    if not any(run["role"] == "new" for run in runs) or not any(run["role"] == "old" for run in runs):
        raise TilesLogError(
            f"{source}: an A/B needs at least one old and one new run, got {[r['label'] for r in runs]}"
        )
    return [{key: run[key] for key in ("label", "role", "result")} for run in runs]


def _neighbour_olds(runs: list[dict[str, Any]], index: int) -> list[int]:
    """The old runs next to run `index`: the nearest before and the nearest after, where they exist."""
    before = [i for i in range(index - 1, -1, -1) if runs[i]["role"] == "old"][:1]
    after = [i for i in range(index + 1, len(runs)) if runs[i]["role"] == "old"][:1]
    return before + after


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kernel, tile) swept by any run, in the order they first appear (a kernel's tiles together, its
    first one the shipped tile), with every run's us (None where a run did not sweep it: an older tree's sweep) and
    one entry per new run, in log order: its change against the old runs beside it that swept the tile (None where
    none did), and its bits (None where the new run did not sweep it)."""
    keyed = [{(case["kernel"], case["tile"]): case for case in run["result"]["cases"]} for run in runs]
    first_seen = list(dict.fromkeys(key for cases in keyed for key in cases))
    kernels = list(dict.fromkeys(kernel for kernel, _ in first_seen))
    rows, seen_kernels = [], set()
    for key in sorted(first_seen, key=lambda key: kernels.index(key[0])):  # stable: each kernel's tiles in order
        us = [cases[key]["us"] if key in cases else None for cases in keyed]
        olds = [u for u, run in zip(us, runs) if run["role"] == "old" and u is not None]
        changes = []
        for index, run in enumerate(runs):
            if run["role"] != "new":
                continue
            case = keyed[index].get(key)
            olds_beside = [i for i in _neighbour_olds(runs, index) if us[i] is not None]
            baseline = sum(us[i] for i in olds_beside) / len(olds_beside) if olds_beside else None
            changes.append({"run": run["label"], "us": us[index], "baseline_us": baseline,
                            "change": None if case is None or baseline is None else us[index] / baseline - 1.0,
                            "equal_share": None if case is None else case["equal_share"],
                            "nan_free": None if case is None else case["nan_free"]})  # fmt: skip
        rows.append({"kernel": key[0], "tile": key[1], "shipped": key[0] not in seen_kernels, "us": us,
                     "old_spread": max(olds) / min(olds) - 1.0 if olds else None, "changes": changes})  # fmt: skip
        seen_kernels.add(key[0])
    return rows


def table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table: kernel, tile (shipped marked), us per run, each new run's change and bits."""
    header = ["kernel", "tile", *(f"{run['label']} us" for run in runs), "old spread"]
    for run in runs:
        if run["role"] == "new":
            header += [f"{run['label']} change", "bit-equal, NaN-free"]
    cells_of_rows = []
    for row in rows:
        cells = [row["kernel"], row["tile"] + (" (shipped)" if row["shipped"] else "")]
        cells += ["-" if u is None else f"{u:.2f}" for u in row["us"]]
        cells += ["-" if row["old_spread"] is None else f"{100 * row['old_spread']:.1f} %"]
        for change in row["changes"]:
            swept = change["us"] is not None
            bits = f"{change['equal_share']:.6f}, {'yes' if change['nan_free'] else 'NO'}" if swept else "-"
            cells += ["-" if change["change"] is None else f"{100 * change['change']:+.1f} %", bits]
        cells_of_rows.append(cells)
    return markdown_table([header, *cells_of_rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.tiles_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a kernel_tiles A/B log (results/gpu/*-kernel-tiles-ab.log)")
    parser.add_argument("--json", help="also write the runs' labels and the table's rows to this JSON file")
    args = parser.parse_args(argv)
    path = Path(args.log)
    try:
        runs = parse_runs(path.read_text(), str(path))
        rows = compare(runs)
    except (OSError, TilesLogError) as error:
        print(f"tiles_ab: {error}", file=sys.stderr)
        return 2
    rows_per_run = {run["result"]["rows"] for run in runs}
    print(f"{path}: {len(runs)} runs of the kernel_tiles probe at {sorted(rows_per_run)} rows\n")
    print(table(runs, rows))
    if args.json:
        record = {"log": str(path), "runs": [run["label"] for run in runs], "rows": rows}
        write_json(record, Path(args.json), allow_nan=False)  # a timing that is not a number is not written
    return 0


if __name__ == "__main__":
    sys.exit(main())
