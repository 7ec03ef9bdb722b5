"""Where the padding cost of the `graphs` stage comes from (H200, about 3 minutes):

    python3 -m measure.graph_padding          # JSON to $OUT/padding-cost.json (or the current folder)

One process, 27B synthetic weights (seed 0). Per workload, the request's own unpadded plan captured as one graph
(`exact_ms`), then the request laid out at five buckets, each captured on the request's own padded plan and replayed
(median of 30 CUDA-event timings, output copied out): `grid` (the default grid's bucket, with its candidate classes),
`previous_grid` (the bucket of the grid it replaced, `measure.grid_coverage.previous_grid`: the one the first
records measured), `grid_but_actual_max_qk` (the grid's bucket with the attention maxima of the request),
`grid_rows_minimal_rest` (the grid's rows, every other capacity just what the request and one dummy node need) and
`one_dummy_row_minimal_rest` (one dummy row); then `served`: `engine.forward` of the prepared request through the
graph cache (the host plan copied into the captured arena through the pinned staging buffer, the replay, the output
copied out). Each
replay's output is compared bit for bit with the exact-plan graph's. The JSON holds the environment (commit, GPU,
versions, time: `ablations.envinfo`) beside the workloads.
"""

import argparse
import dataclasses
import json
import math
import os
from functools import partial

import torch

from ablations import envinfo
from ablations.probes import cuda_time_ms
from ablations.workloads import get_workload
from engine.graphs import capture_forward, default_grid, smallest_bucket
from engine.plan import Bucket, bucket_padding, plan_tree, tree_layout
from engine.stages import build_engine, prepare_process
from engine.weights import MergedWeights
from measure.grid_coverage import previous_grid
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights


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


WORKLOADS = (
    "drone",
    "jevbench/easy-fact-00",
    "context-512-choice-2",
    "jevbench/original-intent-01-0",
    "jevbench/easy-extraction-00",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.graph_padding", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # no options: --help and a refusal of unknown ones
    prepare_process(["graphs"], "cuda")
    merged = MergedWeights.from_decision_weights(synthetic_weights(S, seed=0, device="cuda"))
    engine = build_engine(merged, "graphs")
    engine.graphs.capture_on_miss = True  # `served`: only the buckets these workloads need are captured
    results = []
    for wid in WORKLOADS:
        cands, groups = request_candidates(get_workload(wid).request)
        lay = tree_layout(cands, groups)
        grid = smallest_bucket(lay, default_grid())
        previous = smallest_bucket(lay, previous_grid())
        exact = engine.exact_graph(cands, groups)
        row = {"id": wid, "rows": lay.rows, "grid_bucket": grid.name, "exact_ms": timed(exact)}
        row["previous_grid_bucket"] = previous.name
        variants = {
            "grid": grid,
            "previous_grid": previous,
            "grid_but_actual_max_qk": dataclasses.replace(
                grid, max_q=max(lay.max_q, grid.rows - lay.rows), max_k=max(lay.max_k, grid.rows - lay.rows)
            ),
            "grid_rows_minimal_rest": minimal(lay, grid.rows),
            "one_dummy_row_minimal_rest": minimal(lay, lay.rows + 1),
        }
        for name, bucket in variants.items():
            if bucket_padding(lay, bucket) is None:
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
                }
            )
        )
    record = {"env": envinfo.collect("cuda"), "workloads": results}
    with open(os.path.join(os.environ.get("OUT", "."), "padding-cost.json"), "w") as out:
        json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
