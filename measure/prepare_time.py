"""Host time of the `graphs` stage's `prepare` on the tiny twin (CPU, about 25 s):

    python -m measure.prepare_time [--out results/graphs/prepare-time.json] [--calls 200]

The engine `engine.stages.build_engine(MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=1)),
"graphs")`; per workload of `WORKLOADS` (the ladder's `graphs` workloads: drone, context-128-choice-2 / -8,
context-512-choice-2 and the JevBench panel) the request's candidates (`reference.service.request_candidates`), 20
untimed calls, then `--calls` timed calls of `prepare` (perf_counter around each), interleaved with the same count of
its parts: `tree_layout`, the bucket search over the engine's grid (`engine.graphs.smallest_bucket`, on a fresh layout
built outside the timer) and `plan_tree` at that bucket on the host. Writes the medians and p10 / p90 in microseconds
with the environment (commit, versions, CPU, time: `ablations.envinfo`); prints a table. The prepare of a CPU engine
builds the host plan that the CUDA form builds too (a bucketed plan is host-only on either device), so the figure is
the stage's host planning time on this CPU; the H200 host is another CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path

from ablations import envinfo
from ablations.workloads import resolve
from engine.graphs import smallest_bucket
from engine.plan import plan_tree, tree_layout
from engine.stages import build_engine
from engine.weights import MergedWeights
from reference.service import request_candidates
from reference.shapes import TINY
from reference.weights import synthetic_weights

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "graphs" / "prepare-time.json"
WARMUP_CALLS = 20
WORKLOADS = ("drone", "context-128-choice-2", "context-128-choice-8", "context-512-choice-2", "jevbench")


def summary_us(seconds: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of `seconds`, in microseconds."""
    deciles = statistics.quantiles(seconds, n=10)
    return {
        "median_us": round(statistics.median(seconds) * 1e6, 1),
        "p10_us": round(deciles[0] * 1e6, 1),
        "p90_us": round(deciles[-1] * 1e6, 1),
    }


def elapsed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_calls(calls: dict, count: int) -> dict[str, dict[str, float]]:
    """Each function of `calls` (returning its own elapsed seconds) called `count` times after `WARMUP_CALLS`,
    round-robin (so that load on the machine spreads evenly over them)."""
    for fn in calls.values():
        for _ in range(WARMUP_CALLS):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(count):
        for name, fn in calls.items():
            times[name].append(fn())
    return {name: summary_us(t) for name, t in times.items()}


def search_time(candidates, groups, grid) -> float:
    """Seconds of one bucket search on a layout built (untimed) just before: its sizes not yet computed."""
    layout = tree_layout(candidates, groups)
    return elapsed(lambda: smallest_bucket(layout, grid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.prepare_time", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if args.calls < 10:
        parser.error("--calls must be at least 10 (p10 and p90 need ten samples)")
    engine = build_engine(MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=1)), "graphs")
    rows = []
    print(f"{'workload':<36} {'rows':>5} {'bucket':>16} {'prepare':>8} {'layout':>7} {'search':>7} {'plan':>7}  (us)")
    for workload in resolve(WORKLOADS):
        candidates, groups = request_candidates(workload.request)
        layout = tree_layout(candidates, groups)
        bucket = smallest_bucket(layout, engine.grid)
        calls = {
            "prepare": partial(elapsed, partial(engine.prepare, candidates, groups)),
            "tree_layout": partial(elapsed, partial(tree_layout, candidates, groups)),
            "bucket_search": partial(search_time, candidates, groups, engine.grid),
            "plan_tree": partial(elapsed, partial(plan_tree, candidates, groups, bucket=bucket)),
        }
        timings = time_calls(calls, args.calls)
        rows.append({"id": workload.id, "rows": layout.rows, "bucket": bucket and bucket.name, **timings})
        print(f"{workload.id:<36} {layout.rows:>5} {bucket and bucket.name:>16} "
              + " ".join(f"{timings[k]['median_us']:>7.0f}" for k in calls))  # fmt: skip
    record = {
        "env": envinfo.collect("cpu"),
        "load_average_1min": os.getloadavg()[0],  # other processes on the CPU stretch every figure
        "calls": args.calls,
        "grid_buckets": len(engine.grid),
        "workloads": rows,
    }
    envinfo.write_json(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
