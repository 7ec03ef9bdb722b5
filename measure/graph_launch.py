"""Does a forward's CUDA-graph launch delay its first kernel? One graph against the same forward cut into consecutive
graphs (`engine.graphs.capture_segments`), in one process, on the same plans (H100/H200, about 3 minutes):

    python3 -m measure.graph_launch                       # stage core: results/graphs/<stem>-launch-core.json
    python3 -m measure.graph_launch --stage paged --cuts 1 3 7 3,15

Why. A forward's timed latency (`ablations.timing`: one call from an idle GPU, CUDA events around it) exceeds the
GPU-busy time of its kernels plus the time between them by 0.6-1.6 ms on graph-replayed workloads (engine/stages/
core.md, "The time outside the kernels"), and torch's `CUDAGraph.replay` took 0.44-0.78 ms of host time for a 700-node
graph in the profiled calls of campaign 74's record. If the first kernel waits for the whole graph's launch, a short
first graph hides the rest's launch behind its own kernels.

How. 27B synthetic weights (seed 0). Per workload, its plan at the default grid's bucket is captured once as one graph
(`whole`) and once per `--cuts` variant (graphs ending after the listed layers), all in one memory pool; then
`--rounds` rounds time every variant once each, in turn (so drift hits all alike): a replay from an idle GPU between
CUDA events (`ms`, what the runner's samples are), and the host time of the replay call alone (`host_launch_ms`,
perf_counter, no synchronisation). Medians, p10 and p90 per variant, and each variant's output against `whole`'s bit
for bit (the same kernels in the same order: any difference is a defect).

The JSON holds the environment (`ablations.envinfo`) beside the workloads. Synthetic weights: timings and bits only.
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ablations import envinfo
from ablations.workloads import get_workload
from engine.graphs import capture_forward, capture_segments, default_grid, smallest_bucket
from engine.plan import plan_tree, tree_layout
from engine.stages import build_engine, config_of, prepare_process
from engine.weights import MergedWeights
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("jevbench/easy-intent-00", "drone", "customer_service")
CUTS = ("1", "3", "7", "3,15")


def parse_cuts(text: str) -> tuple[int, ...]:
    """ "3,15" -> (3, 15): the layers after which a graph ends, ascending, each within the 27B model's layers."""
    try:
        cuts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices separated by commas, e.g. 3,15") from None
    if list(cuts) != sorted(set(cuts)) or not all(0 <= i < S.num_layers - 1 for i in cuts):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct ascending layers in 0..{S.num_layers - 2}")
    return cuts


def summary(samples: list[float]) -> dict:
    values = np.asarray(samples, dtype=np.float64)
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90))}  # fmt: skip


def replayer(graph, output: torch.Tensor, count: int):
    """A call that replays `graph` (one graph or a `SegmentedGraph`) and returns its first `count` output rows (a
    view of the static output)."""

    def replay() -> torch.Tensor:
        graph.replay()
        return output[:count]

    return replay


def timed_rounds(variants: dict, rounds: int) -> dict[str, dict]:
    """Per variant: `rounds` event-timed replays from an idle GPU and the host time of each replay call, the variants
    in turn each round, after 3 warm-up replays each."""
    for replay in variants.values():
        for _ in range(3):
            replay()
    torch.cuda.synchronize()
    ms, host = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(rounds):
        for name, replay in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            began = time.perf_counter()
            replay()
            host[name].append((time.perf_counter() - began) * 1e3)
            end.record()
            torch.cuda.synchronize()
            ms[name].append(start.elapsed_time(end))
    return {name: {"ms": summary(ms[name]), "host_launch_ms": summary(host[name]), "samples_ms": ms[name]}
            for name in variants}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.graph_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default="core", help="a stage with CUDA graphs (default: core)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--cuts", nargs="+", type=parse_cuts, default=[parse_cuts(c) for c in CUTS],
                        help="a variant per argument: the layers a graph ends after (default: 1 3 7 3,15)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=40, help="timed replays of each variant (default: 40)")
    parser.add_argument("--out", type=Path, help="the JSON (default: results/graphs/<stem>-launch-<stage>.json)")
    args = parser.parse_args(argv)
    if not config_of(args.stage).graphs:
        parser.error(f"stage {args.stage} captures no CUDA graphs")
    if args.rounds < 5:
        parser.error("--rounds must be >= 5")
    workload_ids = args.workloads.split(",")
    for wid in workload_ids:
        get_workload(wid)  # an unknown id fails here, before the 27B build
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch: needs a CUDA device (it captures CUDA graphs of the 27B forward)")
    prepare_process([args.stage], "cuda")
    merged = MergedWeights.from_decision_weights(synthetic_weights(S, seed=0, device="cuda"))
    engine = build_engine(merged, args.stage)
    results = []
    for wid in workload_ids:
        cands, groups = request_candidates(get_workload(wid).request)
        bucket = smallest_bucket(tree_layout(cands, groups), default_grid())
        if bucket is None:
            print(f"{wid}: skipped (no grid bucket holds it)")
            results.append({"id": wid, "skipped": "no grid bucket"})
            continue
        plan = plan_tree(cands, groups, device="cuda", bucket=bucket)
        pool = torch.cuda.graph_pool_handle()  # one per workload: a pool whose graphs were all freed is not reused

        def forward(plan=plan):
            return engine._forward_plan(plan)

        captured = {"whole": capture_forward(forward, plan.arena, engine.device, pool=pool)}
        for cuts in args.cuts:
            name = "cut after " + ",".join(map(str, cuts))
            captured[name] = capture_segments(forward, plan.arena, engine.device, engine, cuts, pool=pool)

        variants = {name: replayer(graph, output, len(cands)) for name, (graph, output) in captured.items()}
        want = variants["whole"]().clone()
        bitwise = {name: torch.equal(replay(), want) for name, replay in variants.items()}
        timings = timed_rounds(variants, args.rounds)
        row = {"id": wid, "bucket": bucket.name, "variants": {}}
        for name, timing in timings.items():
            row["variants"][name] = {**timing, "bitwise_vs_whole": bitwise[name]}
            gain = timings["whole"]["ms"]["median"] - timing["ms"]["median"]
            print(f"{wid:<26} {name:<16} {timing['ms']['median']:8.3f} ms (p10 {timing['ms']['p10']:.3f}, p90 "
                  f"{timing['ms']['p90']:.3f})  host launch {timing['host_launch_ms']['median']:.3f} ms  "
                  f"vs whole {gain:+.3f} ms  bitwise {bitwise[name]}")  # fmt: skip
        row["paired_gain_ms"] = {
            name: statistics.median(w - v for w, v in zip(timings["whole"]["samples_ms"], timing["samples_ms"]))
            for name, timing in timings.items() if name != "whole"
        }  # fmt: skip
        results.append(row)
        del captured, variants
        torch.cuda.synchronize()
    env = envinfo.collect("cuda")
    record = {"stage": args.stage, "rounds": args.rounds, "env": env, "workloads": results}
    out = args.out or REPO / "results" / "graphs" / f"{envinfo.record_stem(env)}-launch-{args.stage}.json"
    envinfo.write_json(record, out)
    return 0 if all(v["bitwise_vs_whole"] for r in results for v in r.get("variants", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
