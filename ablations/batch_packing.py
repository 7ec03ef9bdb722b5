"""How `reference.service.DecisionModel.batch_requests` packs a queue of requests into forwards (host only, no forward).

    python -m ablations.batch_packing [--out results/batching/batch-packing.json]

Queues: the public JevBench tiers (every task, one question each, in task order) and the six Open-Jev requests. Each
request is compiled as the server does (`DecisionModel.compile`, tiny twin: the rows depend on the tokens and the config
alone), then the queue is drained front first, `batch_requests` deciding each forward's requests at its default budget
(`batch_max_rows`: the config's 8,192 rows on `tree`, the largest bucket's 1,280 on `graphs`). Per stage and queue:
forwards, requests per forward (median, max), and the rows those forwards compute (`batch_rows`: packed tree rows;
bucket rows on `graphs`, a tree's own rows where it runs eagerly) against the rows of every request alone. Prints the
table and writes it as JSON with the environment (`ablations.envinfo`). CPU only, about 20 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def tiny_models() -> dict[str, DecisionModel]:
    from engine.stages import build_engine
    from engine.weights import MergedWeights
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=0)
    merged = MergedWeights.from_decision_weights(weights)
    return {stage: DecisionModel(build_engine(merged, stage), weights, code_commit="none") for stage in STAGES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    queues = {name: [w.request for w in resolve([name])] for name in ("jevbench-all", "open-jev")}
    table = []
    for stage, model in tiny_models().items():
        for name, bodies in queues.items():
            table.append({"stage": stage, "queue": name, **pack(model, bodies)})
    print(f"{'stage':<7} {'queue':<13} {'requests':>8} {'forwards':>8} {'per forward':>11} {'rows batched/alone':>19}")
    for row in table:
        per = f"{row['requests_per_forward_median']:g}/{row['requests_per_forward_max']}"
        print(
            f"{row['stage']:<7} {row['queue']:<13} {row['requests']:>8} {row['forwards']:>8} {per:>11} "
            f"{row['rows_batched']:>9}/{row['rows_alone']:<9}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": envinfo.collect("cpu"), "table": table}, indent=1) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
