"""Bytes-moved floors of the prep and element-wise kernels, against their measured time in a run record (issue 22).

    python -m measure.kernel_floors RECORD.json                # the `graphs` stage: results/kernel-floors/<stem>.json
    python -m measure.kernel_floors RECORD.json --stage core   # results/kernel-floors/<stem>-core.json
    python -m measure.kernel_floors RECORD.json --stage core --budget drone=5,customer_service=15   # and the budgets
    python -m measure.kernel_floors RECORD.json --stage core --forward drone=31   # what a forward target leaves

A kernel that streams its operands once can take no less than (bytes read + bytes written) / the copy ceiling the
record measured (`ceilings.copy_tbps`, which counts a copy's reads and writes). The kernels (KERNELS) and their
bytes per call at a bucket's N packed rows, L path slots and K attention keys are `ablations.kernel_bytes`'s (K = N
for a stage whose attention pages the keys from the rows, `paged_fa4`; for a stage whose GDN core is FlashInfer's,
`flashinfer`, L is the workload's hand-off arena at its bucket, `arena_slots`, and the gather writes fp32 gates).
`per_row_floor_us` is the same model at L = K = N: the floor if the GDN core and the attention read packed rows
instead of the replicated paths and keys (prefix-once attention, issue 22, item 2).

`--budget drone=5,customer_service=15` (issue 22's non-GEMM targets, ms a forward): what the GDN core may take in
each named workload for its target, `gdn_core_budget`: the target less the stage's other non-GEMM kernel families
(attention, the rest) as measured and this lab's kernels (`ours`) three ways: as measured, each kernel of KERNELS
capped at `CAP` x its floor (issue 22, item 3), and each at its floor; as ms a forward, us a GDN layer, and the
speed-up it asks of the stage's GDN core and of `graphs`' (FLA's) where the record timed `graphs` too.
The measured time per call is the record's `top_kernels` entry of the stage (ms per forward / calls per forward: an
average over the calls of a forward) where the kernel is among the workload's top kernels (10 in records before
2026-12-04, 24 since), else None. Synthetic weights do not change bytes.

`--forward drone=31` (issue 22's forward target, ms): what it leaves the non-GEMM kernels, `forward_budget`: the
target less the stage's GEMMs and its time between kernels (the median forward less the GPU-busy time of the
profiled calls), both as measured, against the non-GEMM kernel time measured (busy less GEMMs), and against this
lab's kernels at their floors with attention and the rest as measured (the least the GDN core shares the budget with).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ablations.kernel_bytes import KERNELS, call_bytes
from reference.shapes import QWEN38_27B, ModelShapes

REPO = Path(__file__).resolve().parents[1]


def grid_bucket(name: str):
    """The bucket of the `graphs` grid named `name` (e.g. r352-s1074-c8); ValueError if the grid has none."""
    from engine.graphs import default_grid

    for bucket in default_grid():
        if bucket.name == name:
            return bucket
    raise ValueError(f"no bucket {name!r} in the graphs grid")


def bucket_sizes(name: str) -> dict[str, int]:
    """Rows, path slots and attention keys of a bucket of the `graphs` grid, by its name."""
    bucket = grid_bucket(name)
    return {"rows": bucket.rows, "slots": bucket.slots, "keys": bucket.keys}


@functools.cache
def arena_slots(workload_id: str, bucket: str) -> int:
    """The slots stage `flashinfer_gdn`'s gather writes for a workload at its bucket: its plan's hand-off arena's
    `gathered` (engine/plan.py, `GdnArena`; at most the bucket's path slots), the plan built here on the CPU as the
    engine builds it (once per workload and bucket: `floors` runs for each table)."""
    from ablations.workloads import get_workload
    from engine.plan import plan_tree
    from reference.service import request_candidates

    candidates, groups = request_candidates(get_workload(workload_id).request)
    return int(plan_tree(candidates, groups, bucket=grid_bucket(bucket)).gdn["replicated"].calls[0].arena.gathered)


def timed_workload(record: dict, stage: str, workload_id: str | None = None) -> dict:
    """The record's stage named `stage`, or with `workload_id` that stage's workload of that id; ValueError without."""
    timed = next((st for st in record["stages"] if st["name"] == stage), None)
    if timed is None:
        raise ValueError(f"the record has no stage {stage!r}")
    if workload_id is None:
        return timed
    workload = next((w for w in timed["workloads"] if w["id"] == workload_id), None)
    if workload is None:
        raise ValueError(f"the record's {stage!r} has no workload {workload_id!r}")
    return workload


def floors(record: dict, stage: str = "graphs") -> list[dict]:
    """One row per (workload served by a bucket, kernel of KERNELS): bytes, floor us, per-row floor us, measured us
    per call and the multiple (None where the kernel is not among the workload's top kernels)."""
    tbps = record["ceilings"]["copy_tbps"]
    timed = timed_workload(record, stage)
    config = timed.get("registry", {}).get("config", {})
    attention, arena = config.get("attention"), config.get("gdn_core") == "flashinfer"
    rows = []
    for workload in timed["workloads"]:
        bucket = (workload.get("graph") or {}).get("bucket")
        if not isinstance(bucket, str):  # eager (None), or several batches (a list)
            continue
        size = bucket_sizes(bucket)
        n, slots, keys = size["rows"], size["slots"], size["keys"]
        if attention == "paged_fa4":  # stage `paged`: the prep writes k and v at the rows, the attention pages them
            keys = n
        if arena:  # stage `flashinfer_gdn`: the gather fills the hand-off arena, not the bucket's path slots
            slots = arena_slots(workload["id"], bucket)
        measured = {k["name"]: k["ms_per_forward"] / k["calls_per_forward"] for k in workload.get("top_kernels", [])}
        per_row = call_bytes(n, n, n, linear_gates=arena)
        for kernel, nbytes in call_bytes(n, slots, keys, linear_gates=arena).items():
            floor_us = nbytes / (tbps * 1e12) * 1e6
            call_ms = measured.get(kernel)
            rows.append({
                "workload": workload["id"], "bucket": bucket, "slots": slots, "kernel": kernel, "bytes": nbytes,
                "floor_us": floor_us, "per_row_floor_us": per_row[kernel] / (tbps * 1e12) * 1e6,
                "measured_us": None if call_ms is None else 1000.0 * call_ms,
                "multiple": None if call_ms is None else 1000.0 * call_ms / floor_us,
            })  # fmt: skip
    return rows


CAP = 1.5  # issue 22, item 3: each prep and element-wise kernel within 1.5x its floor


def gdn_core_budget(record: dict, stage: str, targets: dict[str, float], s: ModelShapes = QWEN38_27B) -> list[dict]:
    """One row per workload of `targets` (id -> non-GEMM target, ms a forward) and way of counting this lab's other
    kernels ("measured", "capped": each of KERNELS at most CAP x its floor, "floor"): their ms a forward and the GDN
    core's budget (ms a forward, us a GDN layer, and the speed-up over the stage's GDN core and `graphs`' it asks; a
    budget <= 0 asks the impossible and has no speed-up). Families and kernel times from the record's stage."""
    gdn_layers = s.layer_types.count("linear_attention")
    table = {(row["workload"], row["kernel"]): row for row in floors(record, stage)}  # raises without the stage
    graphs = {w["id"]: w for st in record["stages"] if st["name"] == "graphs" for w in st["workloads"]}  # optional
    out = []
    for workload_id, target in targets.items():
        workload = timed_workload(record, stage, workload_id)
        families = {name: f["ms_per_forward"] for name, f in workload["kernel_families"].items()}
        gdn, ours = families["gdn_core"], families["ours"]
        others = sum(ms for name, ms in families.items() if name not in ("gemm", "gdn_core", "ours"))
        fla = graphs.get(workload_id, {}).get("kernel_families", {}).get("gdn_core", {})
        calls = {k["name"]: k["calls_per_forward"] for k in workload.get("top_kernels", [])}
        saved = {"measured": 0.0, "capped": 0.0, "floor": 0.0}
        for kernel in KERNELS:
            row = table.get((workload_id, kernel))
            if row is None or row["measured_us"] is None:
                continue
            per_forward = calls[kernel] / 1000.0
            saved["capped"] += per_forward * max(0.0, row["measured_us"] - CAP * row["floor_us"])
            saved["floor"] += per_forward * (row["measured_us"] - row["floor_us"])
        for way, less in saved.items():
            budget = target - others - (ours - less)
            out.append({
                "workload": workload_id, "target_ms": target, "ours": way, "ours_ms": ours - less,
                "others_ms": others, "gdn_core_ms": gdn, "budget_ms": budget,
                "budget_us_a_layer": 1000.0 * budget / gdn_layers,
                "speedup_asked": gdn / budget if budget > 0 else None,
                "graphs_gdn_core_ms": fla.get("ms_per_forward"),
                "speedup_over_graphs": fla["ms_per_forward"] / budget if budget > 0 and fla else None,
            })  # fmt: skip
    return out


def forward_budget(record: dict, stage: str, targets: dict[str, float]) -> list[dict]:
    """One row per workload of `targets` (id -> forward target, ms): the stage's median forward, GPU-busy time, time
    between kernels, GEMMs, non-GEMM kernel time, and the non-GEMM budget the target leaves (module docstring), with
    what of it the GDN core would have with the other non-GEMM kernels at their floors (`gdn_core_budget`'s "floor")."""
    out = []
    for workload_id, target in targets.items():
        workload = timed_workload(record, stage, workload_id)
        busy, median = workload["gpu_busy_ms"], workload["median_ms"]
        gemm = workload["kernel_families"]["gemm"]["ms_per_forward"]
        budget = target - gemm - (median - busy)
        floor = gdn_core_budget(record, stage, {workload_id: budget})[-1]  # the other kernels at their floors
        out.append({
            "workload": workload_id, "target_ms": target, "median_ms": median, "gpu_busy_ms": busy,
            "between_kernels_ms": median - busy, "gemm_ms": gemm, "non_gemm_ms": busy - gemm,
            "non_gemm_budget_ms": budget, "gdn_core_ms": floor["gdn_core_ms"],
            "gdn_core_budget_ms_others_at_floor": floor["budget_ms"],
        })  # fmt: skip
    return out


def _targets(text: str) -> dict[str, float]:
    """`drone=5,customer_service=15` -> {"drone": 5.0, "customer_service": 15.0}."""
    try:
        return {name: float(ms) for name, ms in (pair.split("=") for pair in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WORKLOAD=MS[,WORKLOAD=MS...], got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.kernel_floors", description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="a run record with a timed `graphs` or `core` stage")
    parser.add_argument("--stage", default="graphs", help="the bucketed stage whose kernel times are read")
    parser.add_argument(
        "--budget",
        type=_targets,
        default={},
        metavar="WORKLOAD=MS,...",
        help="non-GEMM targets (ms a forward): the GDN core's budget for each (module docstring)",
    )
    parser.add_argument(
        "--forward",
        type=_targets,
        default={},
        metavar="WORKLOAD=MS,...",
        help="forward targets (ms): the non-GEMM budget each leaves (module docstring)",
    )
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    table = floors(record, args.stage)
    print(f"{'workload':<32} {'kernel':<24} {'MB':>8} {'floor us':>9} {'per-row':>8} {'measured':>9} {'x floor':>8}")
    for row in table:
        measured = "-" if row["measured_us"] is None else f"{row['measured_us']:.1f}"
        multiple = "-" if row["multiple"] is None else f"{row['multiple']:.2f}"
        print(f"{row['workload']:<32} {row['kernel']:<24} {row['bytes'] / 1e6:8.2f} {row['floor_us']:9.2f} "
              f"{row['per_row_floor_us']:8.2f} {measured:>9} {multiple:>8}")  # fmt: skip
    budgets = gdn_core_budget(record, args.stage, args.budget) if args.budget else []
    if budgets:
        print(f"\n{'workload':<32} {'target':>7} {'ours':<9} {'ours ms':>8} {'others':>7} {'GDN core':>9} "
              f"{'budget':>7} {'us/layer':>9} {'faster':>7} {'vs graphs':>10}")  # fmt: skip
    for row in budgets:
        asked = "-" if row["speedup_asked"] is None else f"{row['speedup_asked']:.2f}x"
        graphs = "-" if row["speedup_over_graphs"] is None else f"{row['speedup_over_graphs']:.2f}x"
        print(f"{row['workload']:<32} {row['target_ms']:7.2f} {row['ours']:<9} {row['ours_ms']:8.3f} "
              f"{row['others_ms']:7.3f} {row['gdn_core_ms']:9.3f} {row['budget_ms']:7.3f} "
              f"{row['budget_us_a_layer']:9.1f} {asked:>7} {graphs:>10}")  # fmt: skip
    forwards = forward_budget(record, args.stage, args.forward) if args.forward else []
    if forwards:
        print(f"\n{'workload':<32} {'target':>7} {'median':>7} {'busy':>7} {'between':>8} {'GEMMs':>7} {'non-GEMM':>9} "
              f"{'budget':>7} {'GDN core':>9} {'its budget':>11}")  # fmt: skip
    for row in forwards:
        print(f"{row['workload']:<32} {row['target_ms']:7.2f} {row['median_ms']:7.2f} {row['gpu_busy_ms']:7.2f} "
              f"{row['between_kernels_ms']:8.2f} {row['gemm_ms']:7.2f} {row['non_gemm_ms']:9.2f} "
              f"{row['non_gemm_budget_ms']:7.2f} {row['gdn_core_ms']:9.2f} "
              f"{row['gdn_core_budget_ms_others_at_floor']:11.2f}")  # fmt: skip
    suffix = "" if args.stage == "graphs" else f"-{args.stage}"
    out = REPO / "results" / "kernel-floors" / f"{args.record.stem}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"record": args.record.name, "stage": args.stage, "copy_tbps": record["ceilings"]["copy_tbps"],
            "rows": table}  # fmt: skip
    if budgets:
        body["gdn_core_budget"] = budgets
    if forwards:
        body["forward_budget"] = forwards
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
