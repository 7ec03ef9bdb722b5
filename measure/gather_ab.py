"""`kernels.gather_slots` against another version of kernels/gdn_prep.py, in one process, on the same inputs.

    git show REV:kernels/gdn_prep.py > .device/ab/gdn_prep_REV.py     # here: the old version, carried to the device
    python -m measure.gather_ab .device/ab/gdn_prep_REV.py            # results/gather-ab/<utc>-<gpu>-<commit>.json

Per workload (default drone, jevbench/easy-intent-00, customer_service), on the bucketed plan the engine replays
(`measure.gdn_chunk_probe.bucketed_plan`), with the packed rows of `ablations.probes.engine_gdn_inputs`:
* `replicated`: every path slot of the replicated call (`call.rows`), what stage `graphs` gathers in front of FLA;
* `arena`: the hand-off arena's slots up to its device count (`arena.rows`, `arena.gathered`) with FlashInfer's
  gates (`linear_gates`), what stage `flashinfer_gdn` gathers.
Each way and version is captured in one CUDA graph of `--calls` launches (`graph_time_us`) and timed `--repeats` times,
the versions alternated (old, new, old, new, ...), so a card that drifts shows in both; the figure per version is the
median of its repeats. The two versions' outputs must be bit-equal on the slots they write (`bit_equal`): the kernel
is a copy, so its grid may change its speed, never its bits. Synthetic inputs: timings only.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

from measure.gdn_chunk_probe import bucketed_plan, cuda_or_refuse, graph_time_us, layer_probe_parser

REPO = Path(__file__).resolve().parents[1]


def load_version(path: Path):
    """The module at `path` (a copy of kernels/gdn_prep.py of another commit), imported under its own name."""
    spec = importlib.util.spec_from_file_location(f"gdn_prep_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "gather_slots"):
        raise ValueError(f"{path}: has no gather_slots (not a kernels/gdn_prep.py)")
    return module


def probe_workload(workload_id: str, versions: dict, calls: int, rounds: int, repeats: int) -> dict:
    """The two ways of one workload: per version the us a call (median of the repeats, and each repeat), and whether
    the versions' outputs are bit-equal on the written slots."""
    import torch

    from ablations.probes import engine_gdn_inputs

    plan, _ = bucketed_plan(workload_id)
    call = plan.to(torch.device("cuda")).gdn["replicated"].calls[0]
    packed = tuple(t[None] for t in engine_gdn_inputs(plan.num_rows, seed=22, device="cuda"))
    arena = call.arena
    arena_slots = int(arena.gathered)  # at most the bucket's path slots (engine.plan_arrays._handoff_arena)
    ways = {
        "replicated": (lambda module: module.gather_slots(packed, call.rows), len(call.rows)),
        "arena": (
            lambda module: module.gather_slots(packed, arena.rows, count=arena.gathered, linear_gates=True),
            arena_slots,
        ),
    }
    result = {"workload": workload_id, "bucket": plan.bucket.name, "path_slots": len(call.rows),
              "arena_slots": arena_slots, "ways": {}}  # fmt: skip

    def bits(t: torch.Tensor, slots: int) -> torch.Tensor:  # the written slots as integers: NaNs compare too
        return t[:, :slots].view(torch.int16 if t.element_size() == 2 else torch.int32)

    for way, (launch, slots) in ways.items():
        old, new = (launch(module) for module in versions.values())
        bit_equal = all(torch.equal(bits(a, slots), bits(b, slots)) for a, b in zip(old, new, strict=True))
        samples = {name: [] for name in versions}
        for _ in range(repeats):
            for name, module in versions.items():
                samples[name].append(graph_time_us(lambda m=module, f=launch: f(m), calls, rounds))
        figures = {name: statistics.median(times) for name, times in samples.items()}
        (old_name, old_us), (new_name, new_us) = figures.items()
        result["ways"][way] = {"slots": slots, "us": figures, "samples_us": samples, "bit_equal": bit_equal,
                               "change": new_us / old_us - 1.0}  # fmt: skip
        print(f"{workload_id:<24} {way:<10} {slots:6d} slots  {old_name} {old_us:6.1f} us  {new_name} {new_us:6.1f} us"
              f"  {100 * (new_us / old_us - 1):+5.1f} %  bit-equal {bit_equal}", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = layer_probe_parser("measure.gather_ab", __doc__)
    parser.add_argument("old", type=Path, help="a copy of kernels/gdn_prep.py of another commit")
    parser.add_argument("--repeats", type=int, default=5, help="timings of each version, alternated")
    args = parser.parse_args(argv)
    if not args.old.is_file():
        parser.error(f"{args.old}: no such file")
    if not cuda_or_refuse("gather_ab"):
        return 2
    import torch

    from ablations.envinfo import collect, record_stem, write_json

    # the module, not `kernels.gdn_prep`: the package exports the function of that name
    versions = {f"old {args.old.stem}": load_version(args.old), "new": importlib.import_module("kernels.gdn_prep")}
    env = collect("cuda")
    record = {"probe": "gather_ab", "env": env, "old": args.old.name, "calls": args.calls, "rounds": args.rounds,
              "repeats": args.repeats, "workloads": []}  # fmt: skip
    for workload_id in args.workloads.split(","):
        with torch.no_grad():
            record["workloads"].append(probe_workload(workload_id, versions, args.calls, args.rounds, args.repeats))
    write_json(record, REPO / "results" / "gather-ab" / f"{record_stem(env)}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
