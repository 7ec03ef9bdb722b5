"""Programmatic dependent launch (PDL) in the forward: one engine, each workload's bucket captured with the engine's
kernels launched with PDL and without, the two graphs replayed alternately in one process on the same request.

    python -m measure.pdl_probe                      # stage core, drone, customer_service, jevbench/easy-intent-00
    python -m measure.pdl_probe --stage graphs --workloads drone --rounds 50

What PDL changes (`kernels.numerics.PDL`, `grid_dependency`): every program of this lab's kernels first lets the next
kernel in the stream launch (`griddepcontrol.launch_dependents`) and then waits for the previous kernel to finish and
its writes to be visible (`griddepcontrol.wait`), and the kernels are launched with the programmatic stream
serialization attribute, which a CUDA graph keeps as a programmatic edge. The next kernel's programs are then placed
on the SMs as this kernel's last programs retire, instead of after the whole grid has drained and the next launch
has been processed. No arithmetic changes: the two graphs must give the same bits (checked on every replay pair's
first; the probe exits 1 otherwise). cuBLAS's GEMMs and FlashAttention are launched as before, so only the
boundaries in front of this lab's kernels can gain.

Timed per workload: `--rounds` pairs of replays through `engine.graphs.CapturedGraph.run` (the arena refill, the
replay, the output copy), CUDA events around each, the order within a pair alternating; the medians, their ratio and
the per-pair differences' median. Synthetic 27B weights (`gpu-27b`'s seed): timings and bits only, never accuracy.
Writes results/pdl/<utc>-<gpu>-<commit>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("drone", "customer_service", "jevbench/easy-intent-00")


def time_pair(entries: dict, plan, staging, rounds: int) -> dict[bool, list[float]]:
    """`rounds` replays of each graph (keyed by PDL on), alternating which goes first; ms per replay."""
    import torch

    samples: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for pdl in (False, True) if r % 2 == 0 else (True, False):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entries[pdl].run(plan, staging)
            end.record()
            end.synchronize()
            samples[pdl].append(start.elapsed_time(end))
    return samples


def probe_workload(engine, workload_id: str, rounds: int) -> dict:
    import torch

    from ablations.workloads import get_workload
    from kernels import numerics
    from reference.service import request_candidates

    prepared = engine.prepare(*request_candidates(get_workload(workload_id).request))
    if len(prepared.batches) != 1 or prepared.batches[0].plan.bucket is None:
        raise ValueError(f"{workload_id}: not one bucketed batch (a graph serves only those)")
    plan = prepared.batches[0].plan
    entries = {}
    try:
        for pdl in (False, True):
            numerics.PDL = pdl
            entries[pdl] = engine.graphs.capture(plan.bucket)
    finally:
        numerics.PDL = True
    staging = engine.graphs.staging
    with torch.inference_mode():  # as the runner replays (its captures, like these, are made outside)
        outputs = {pdl: entries[pdl].run(plan, staging) for pdl in (False, True)}
        torch.cuda.synchronize()
        same = torch.equal(outputs[False], outputs[True])
        time_pair(entries, plan, staging, 6)  # warm replays
        samples = time_pair(entries, plan, staging, rounds)
    off, on = (statistics.median(samples[p]) for p in (False, True))
    deltas = [b - a for a, b in zip(samples[False], samples[True])]
    result = {
        "workload": workload_id,
        "bucket": plan.bucket.name,
        "rows": plan.num_rows,
        "bit_identical": same,
        "median_ms": {"off": off, "on": on},
        "p10_p90_ms": {
            "off": statistics.quantiles(samples[False], n=10)[::8],
            "on": statistics.quantiles(samples[True], n=10)[::8],
        },
        "on_over_off": on / off,
        "median_pair_delta_ms": statistics.median(deltas),
        "samples_ms": {"off": samples[False], "on": samples[True]},
    }
    print(f"{workload_id:<24} {plan.bucket.name:<16} PDL off {off:7.3f} ms  on {on:7.3f} ms  x{on / off:.4f}  "
          f"pair delta {result['median_pair_delta_ms']:+.3f} ms  bit-identical {same}", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.pdl_probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", default="core", help="a registry stage with CUDA graphs (default core)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=30, help="replay pairs timed per workload")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    import torch

    if not torch.cuda.is_available():
        print("pdl_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from ablations.envinfo import collect, record_stem, write_json
    from ablations.plans import load_plan
    from engine.fla_configs import pin_fla_configs
    from engine.stages import BuildContext, build_backbone, config_of, prepare_process
    from reference.shapes import get_shapes
    from reference.weights import synthetic_weights

    if not config_of(args.stage).graphs:
        parser.error(f"stage {args.stage} has no CUDA graphs")
    prepare_process([args.stage], "cuda")  # before CUDA is initialised (cuBLAS's workspace setting)
    pin_fla_configs()  # before fla is imported: the committed configs of this GPU, if any
    plan = load_plan("gpu-27b")
    weights = synthetic_weights(get_shapes(plan.shapes), seed=plan.weights_seed, device=torch.device("cuda"))
    engine = build_backbone(args.stage, BuildContext(weights))
    env = collect("cuda")
    record = {"probe": "pdl", "env": env, "stage": args.stage, "rounds": args.rounds, "workloads": []}
    for workload_id in args.workloads.split(","):
        record["workloads"].append(probe_workload(engine, workload_id, args.rounds))
    write_json(record, REPO / "results" / "pdl" / f"{record_stem(env)}.json")
    return 0 if all(w["bit_identical"] for w in record["workloads"]) else 1


if __name__ == "__main__":
    sys.exit(main())
