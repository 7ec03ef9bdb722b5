"""Compare two run records of one plan for a refactor that must change no bit (results/equivalence/README.md).

    python -m measure.equivalence BEFORE.json AFTER.json [--out results/equivalence]

Per stage and workload of either record: whether both timed it, and whether the numerics are equal: the
probabilities, the row count, the fidelity against the plan's reference (`max_abs_dp`, `hidden_rel_rmse`,
`argmax_flips`, every residual state's `state_rel_rmse`, `first_departing_state`) and `vs_builds_on`. Timings are
not compared (the records run while other jobs share the machine). Exit status 0 when every pair is bit-identical,
1 otherwise. `--out` copies both records there (the record files keep their names).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ablations.records import read_record

COMPARED = ("probabilities", "rows", "max_abs_dp", "hidden_rel_rmse", "argmax_flips", "state_rel_rmse",
            "first_departing_state", "vs_builds_on")  # fmt: skip


def compare(before: dict, after: dict) -> list[dict]:
    """One row per (stage, workload) of either record: `status` "identical", "differs" (with the differing fields)
    or "missing" (with the record that lacks it); stages in `before`'s order, then those only `after` has."""
    if before["plan"]["name"] != after["plan"]["name"]:
        raise ValueError(f"records of two plans: {before['plan']['name']} and {after['plan']['name']}")
    timed = [{(s["name"], w["id"]): w for s in r["stages"] for w in s["workloads"]} for r in (before, after)]
    rows = []
    for stage, workload in dict.fromkeys([*timed[0], *timed[1]]):
        pair = [t.get((stage, workload)) for t in timed]
        row = {"stage": stage, "workload": workload}
        if None in pair:
            row |= {"status": "missing", "missing_in": "before" if pair[0] is None else "after"}
        else:
            differing = [key for key in COMPARED if pair[0].get(key) != pair[1].get(key)]
            row |= {"status": "differs" if differing else "identical", "differing": differing}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.equivalence", description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, help="copy both records into this folder")
    args = parser.parse_args(argv)
    before, after = read_record(args.before), read_record(args.after)
    rows = compare(before, after)
    commits = [r["env"]["git_commit"][:7] for r in (before, after)]
    print(
        json.dumps({"plan": before["plan"]["name"], "before": commits[0], "after": commits[1], "rows": rows}, indent=1)
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in (args.before, args.after):
            if not (args.out / path.name).exists() or not (args.out / path.name).samefile(path):  # a kept one stays
                shutil.copy2(path, args.out / path.name)
    return 0 if rows and all(r["status"] == "identical" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
