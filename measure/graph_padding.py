"""Where a graph stage's padding cost comes from (H200, about 3 minutes for the default workloads):

    python3 -m measure.graph_padding           # stage graphs: results/graphs/<utc>-<gpu>-<commit>-padding-graphs.json
    python3 -m measure.graph_padding --stage core --workloads drone,customer_service --kernels

One process, 27B synthetic weights (seed 0). Per workload, the request's own unpadded plan captured as one graph
(`exact_ms`), then the request laid out at seven buckets, each captured on the request's own padded plan and replayed
(median of 30 CUDA-event timings, output copied out): `grid` (the default grid's bucket, with its candidate classes),
`grid_to_1152` (the bucket of the grid it replaced, `measure.grid_coverage.grid_to_1152`: 1,152 rows after 1,024),
`previous_grid` (the bucket of the first grid, `measure.grid_coverage.previous_grid`: the one the first records
measured), `finer_rows_grid` (the bucket of `finer_rows_grid()`: the default grid's classes and slot factors over rows
every 16 to 512, 32 to 1,024, 64 to 1,280: what a finer rows grid would give the request), `grid_but_actual_max_qk` (the
grid's bucket with the attention maxima of the request), `grid_rows_minimal_rest` (the grid's rows, every other capacity
just what the request and one dummy node need) and `one_dummy_row_minimal_rest` (one dummy row); then `served`:
`engine.forward` of the prepared request through the graph cache (the host plan copied into the captured arena through
the pinned staging buffer, the replay, the output copied out). Each replay's output is compared bit for bit with the
exact-plan graph's.

`--kernels`: the exact-plan graph and the `grid` bucket's graph also run under torch.profiler (`--profile-calls`
replays each, `ablations.timing.profile_kernels`), and the record holds each one's GPU-busy time, kernel families and
per-kernel time, and per kernel name the bucket's time less the exact plan's (`kernel_padding_ms`, largest first):
which kernels carry the padding cost. The bucket's replays are timed in a separate window from the exact plan's, so
compare per-kernel differences against the spread of the ms columns.

The JSON holds the environment (commit, GPU, versions, time: `ablations.envinfo`) beside the workloads. Synthetic
weights: timings and bits only. Records before `--stage` (results/gpu/20261201T140700Z-nvidia-h200-padding-cost.json)
measured stage `graphs` and were written to $OUT.
"""

import argparse
import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import torch

from ablations import envinfo
from ablations.probes import cuda_time_ms
from ablations.timing import profile_kernels
from ablations.workloads import get_workload
from engine.graphs import capture_forward, default_grid, smallest_bucket
from engine.plan import Bucket, bucket_padding, plan_tree, tree_layout
from engine.stages import build_engine, config_of, prepare_process
from engine.weights import MergedWeights
from measure.grid_coverage import grid_to_1152, previous_grid
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights

REPO = Path(__file__).resolve().parents[1]


def timed(fn) -> float:
    """Median ms of 30 CUDA-event timings of one call each, after 3 warm-up calls."""
    return cuda_time_ms(fn, inner=1, rounds=30)


def minimal(lay, rows):
    """The smallest bucket of `rows` rows that holds `lay` (one dummy node, no other padding)."""
    dummy = rows - lay.rows
    c0 = math.ceil(dummy / 64)
    return Bucket(
        rows=rows,
        slots=lay.slots + dummy,
        sequences=len(lay.candidate_lens) + 1,
        chunks=lay.chunks + c0,
        nodes=lay.nodes + 1,
        keys=lay.keys + dummy,
        candidates=len(lay.candidate_lens),
        max_q=max(lay.max_q, dummy),
        max_k=max(lay.max_k, dummy),
    )


FINER_ROWS = (*range(64, 257, 16), *range(272, 513, 16), *range(544, 1025, 32), *range(1088, 1281, 64))


def finer_rows_grid() -> tuple[Bucket, ...]:
    """The default grid's classes and slot factors (engine/graphs.py) over `FINER_ROWS`: the step halved from 256 to
    1,024 rows (424 buckets against 280): a candidate, measured here before any change to the engine's grid."""
    return default_grid(FINER_ROWS)


WORKLOADS = (
    "drone",
    "jevbench/easy-fact-00",
    "context-512-choice-2",
    "jevbench/original-intent-01-0",
    "jevbench/easy-extraction-00",
)


def kernel_padding(exact, bucket) -> list[dict]:
    """Per kernel name (the union of both profiles' kernels): ms per forward in the exact plan and in the bucket, and
    the bucket's less the exact plan's, largest first."""
    exact_ms = {k["name"]: k["ms_per_forward"] for k in exact.top_kernels}
    bucket_ms = {k["name"]: k["ms_per_forward"] for k in bucket.top_kernels}
    rows = [
        {"name": name, "exact_ms": exact_ms.get(name, 0.0), "bucket_ms": bucket_ms.get(name, 0.0),
         "padding_ms": bucket_ms.get(name, 0.0) - exact_ms.get(name, 0.0)}
        for name in sorted(set(exact_ms) | set(bucket_ms))
    ]  # fmt: skip
    return sorted(rows, key=lambda row: -row["padding_ms"])


def profile_summary(stats) -> dict:
    """What the record keeps of a profile beside `kernel_padding`: busy and idle time, kernel count, families."""
    return {"gpu_busy_ms": stats.gpu_busy_ms, "idle_between_kernels_ms": stats.idle_ms,
            "kernels_per_forward": stats.kernels_per_forward, "families": stats.families}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.graph_padding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default="graphs", help="a stage with CUDA graphs (default: graphs)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--kernels", action="store_true", help="profile the exact plan and the grid bucket per kernel")
    parser.add_argument("--profile-calls", type=int, default=5, help="replays under the profiler (default: 5)")
    parser.add_argument("--out", type=Path, help="the JSON (default: results/graphs/<stem>-padding-<stage>.json)")
    args = parser.parse_args(argv)
    if not config_of(args.stage).graphs:
        parser.error(f"stage {args.stage} captures no CUDA graphs")
    if args.profile_calls < 1:
        parser.error("--profile-calls must be >= 1")
    workload_ids = args.workloads.split(",")
    for wid in workload_ids:
        get_workload(wid)  # an unknown id fails here, before the 27B build
    if not torch.cuda.is_available():
        raise SystemExit("graph_padding: needs a CUDA device (it captures CUDA graphs of the 27B forward)")
    prepare_process([args.stage], "cuda")
    merged = MergedWeights.from_decision_weights(synthetic_weights(S, seed=0, device="cuda"))
    engine = build_engine(merged, args.stage)
    engine.graphs.capture_on_miss = True  # `served`: only the buckets these workloads need are captured
    results = []
    for wid in workload_ids:
        cands, groups = request_candidates(get_workload(wid).request)
        lay = tree_layout(cands, groups)
        grid = smallest_bucket(lay, default_grid())
        previous = smallest_bucket(lay, previous_grid())
        finer = smallest_bucket(lay, finer_rows_grid())
        exact = engine.exact_graph(cands, groups)
        if grid is None or exact is None:  # outside the grid, or several batches: no bucketed graph to compare
            print(f"{wid}: skipped (grid bucket {grid}, exact-plan graph {'none' if exact is None else 'built'})")
            results.append({"id": wid, "rows": lay.rows, "skipped": "no grid bucket or no single-batch exact plan"})
            continue
        row = {"id": wid, "rows": lay.rows, "grid_bucket": grid.name, "exact_ms": timed(exact)}
        row["previous_grid_bucket"] = None if previous is None else previous.name
        variants = {
            "grid": grid,
            "grid_to_1152": smallest_bucket(lay, grid_to_1152()),
            "previous_grid": previous,
            "finer_rows_grid": finer,
            "grid_but_actual_max_qk": dataclasses.replace(
                grid, max_q=max(lay.max_q, grid.rows - lay.rows), max_k=max(lay.max_k, grid.rows - lay.rows)
            ),
            "grid_rows_minimal_rest": minimal(lay, grid.rows),
            "one_dummy_row_minimal_rest": minimal(lay, lay.rows + 1),
        }
        for name, bucket in variants.items():
            if bucket is None or bucket_padding(lay, bucket) is None:
                row[name] = None
                continue
            plan = plan_tree(cands, groups, device="cuda", bucket=bucket)
            graph, output = capture_forward(partial(engine._forward_plan, plan), plan.arena, engine.device)

            count = len(cands)

            def run(graph=graph, output=output, plan=plan, count=count):  # plan: the graph reads its arena
                graph.replay()
                return output[:count].clone()

            same = torch.equal(run(), exact()[: len(cands)])
            row[name] = {"bucket": bucket.__dict__, "ms": timed(run), "bitwise_vs_exact": same}
            if args.kernels and name == "grid":
                # every kernel (top=1000), so that the two profiles compare name by name
                exact_stats, grid_stats = (profile_kernels(fn, args.profile_calls, top=1000) for fn in (exact, run))
                row["kernel_padding_ms"] = kernel_padding(exact_stats, grid_stats)
                row["exact_profile"], row["grid_profile"] = profile_summary(exact_stats), profile_summary(grid_stats)
        prepared = engine.prepare(cands, groups)  # the served path: host plan, staging copy, the cache's graph
        served = partial(engine.forward, prepared)
        row["served"] = {"ms": timed(served), "bitwise_vs_exact": torch.equal(served(), exact()[: len(cands)])}
        row["served"]["graph_hit"] = bool(prepared.batches[0].graph_hit)
        results.append(row)
        print(
            json.dumps(
                {
                    k: (v if not isinstance(v, dict) else {"ms": round(v["ms"], 2), "bitwise": v["bitwise_vs_exact"]})
                    for k, v in row.items()
                    if k not in ("kernel_padding_ms", "exact_profile", "grid_profile")
                }
            )
        )
        for kernel in row.get("kernel_padding_ms", [])[:12]:
            print(f"  {kernel['padding_ms']:+8.3f} ms  {kernel['exact_ms']:8.3f} -> {kernel['bucket_ms']:8.3f}  "
                  f"{kernel['name'][:90]}")  # fmt: skip
    env = envinfo.collect("cuda")
    record = {"stage": args.stage, "env": env, "workloads": results}
    out = args.out or REPO / "results" / "graphs" / f"{envinfo.record_stem(env)}-padding-{args.stage}.json"
    envinfo.write_json(record, out)
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
