"""How `reference.service.DecisionModel.batch_requests` packs a queue of requests into forwards (host only, no forward).

    python -m measure.batch_packing [--out results/batching/batch-packing.json]

Queues: the public JevBench tiers (every task, one question each, in task order) and the six Open-Jev requests. Each
request is compiled as the server does (`DecisionModel.compile`, tiny twin: the rows depend on the tokens and the config
alone), then the queue is drained front first, `batch_requests` deciding each forward's requests at its default budget
(`batch_max_rows`: the config's 8,192 rows on `tree`, the largest bucket's 1,280 on `graphs`). Per stage and queue:
forwards, requests per forward (median, max), and the rows those forwards compute (`batch_rows`: packed tree rows;
bucket rows on `graphs`, a tree's own rows where it runs eagerly) against the rows of every request alone. Prints the
table and writes it as JSON with the environment (`ablations.envinfo`).

Timing (`timing` in the JSON): the host time of one `batch_requests` call at 1, 4, 8 and 16 queued JevBench requests
(windows of consecutive public tasks, each window timed `--repeats` times; median and max over all calls; the
backbone's `queue_rows`, which weighs the prefixes of the queue, is inside it). CPU only, about 30 s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ablations import envinfo
from ablations.workloads import resolve
from engine.plan import tree_layout
from reference.service import DecisionModel, batch_inputs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "batching" / "batch-packing.json"
STAGES = ("tree", "graphs")


def pack(model: DecisionModel, bodies: Sequence[dict]) -> dict:
    """Drain a queue of request bodies as a server's worker would; what the forwards hold."""
    queue = [model.compile(body) for body in bodies]

    def rows(batch) -> int:  # a batch outside the grid runs eagerly over its unpadded tree
        candidates, groups = batch_inputs(batch)
        padded = model.backbone.batch_rows(candidates, groups)
        return tree_layout(candidates, groups).rows if padded is None else padded

    alone = [rows([one]) for one in queue]
    eager = sum(model.backbone.batch_rows(*batch_inputs([one])) is None for one in queue)
    sizes, forwards, start = [], [], 0
    while start < len(queue):
        n = model.batch_requests(queue[start:])
        sizes.append(n)
        forwards.append(rows(queue[start : start + n]))
        start += n
    return {
        "requests": len(queue),
        "forwards": len(sizes),
        "requests_per_forward_median": statistics.median(sizes),
        "requests_per_forward_max": max(sizes),
        "rows_batched": sum(forwards),
        "rows_alone": sum(alone),
        "requests_eager_alone": eager,
        "max_rows_per_forward": max(forwards),
    }


QUEUE_DEPTHS = (1, 4, 8, 16)


def time_batch_requests(model: DecisionModel, bodies: Sequence[dict], depth: int, repeats: int) -> dict:
    """Host time of `batch_requests` over windows of `depth` consecutive compiled requests."""
    queue = [model.compile(body) for body in bodies]
    if len(queue) < depth:
        raise ValueError(f"{len(queue)} requests cannot fill a queue of {depth}")
    calls, taken = [], []
    for first in range(0, len(queue) - depth + 1, depth):
        window = queue[first : first + depth]
        for _ in range(repeats):
            start = time.perf_counter()
            taken.append(model.batch_requests(window))
            calls.append(time.perf_counter() - start)
    return {
        "queued": depth,
        "calls": len(calls),
        "median_ms": statistics.median(calls) * 1e3,
        "max_ms": max(calls) * 1e3,
        "admitted_median": statistics.median(taken),
    }


def tiny_models() -> dict[str, DecisionModel]:
    from engine.stages import build_engine
    from engine.weights import MergedWeights
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=0)
    merged = MergedWeights.from_decision_weights(weights)
    return {stage: DecisionModel(build_engine(merged, stage), weights, code_commit="none") for stage in STAGES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.batch_packing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per queue window")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    queues = {name: [w.request for w in resolve([name])] for name in ("jevbench-all", "open-jev")}
    table, timing = [], []
    for stage, model in tiny_models().items():
        for name, bodies in queues.items():
            table.append({"stage": stage, "queue": name, **pack(model, bodies)})
        for depth in QUEUE_DEPTHS:
            timing.append({"stage": stage, **time_batch_requests(model, queues["jevbench-all"], depth, args.repeats)})
    print(f"{'stage':<7} {'queue':<13} {'requests':>8} {'forwards':>8} {'per forward':>11} {'rows batched/alone':>19}")
    for row in table:
        per = f"{row['requests_per_forward_median']:g}/{row['requests_per_forward_max']}"
        print(
            f"{row['stage']:<7} {row['queue']:<13} {row['requests']:>8} {row['forwards']:>8} {per:>11} "
            f"{row['rows_batched']:>9}/{row['rows_alone']:<9}"
        )
    print(f"\n{'stage':<7} {'queued':>6} {'batch_requests ms (median/max)':>31} {'admitted':>8}")
    for row in timing:
        print(
            f"{row['stage']:<7} {row['queued']:>6} {row['median_ms']:>20.2f}/{row['max_ms']:<10.2f} "
            f"{row['admitted_median']:>8g}"
        )
    envinfo.write_json({"env": envinfo.collect("cpu"), "table": table, "timing": timing}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
