"""Per-layer GDN-core time on the GPU: FLA's five forward kernels against the chunk kernels of stage `core`.

    python -m measure.gdn_chunk_probe                 # writes results/gdn-chunk/<utc>-<gpu>-<commit>.json
    python -m measure.gdn_chunk_probe --calls 10 --rounds 20 --workloads drone
    python -m measure.gdn_chunk_probe --workloads drone --variants stage --calls 1 --rounds 1 --no-record  # profiled
    python -m measure.gdn_chunk_probe --variants stage --flashinfer   # and FlashInfer's sm_90 GDN kernel

What is timed: one GDN layer's core call as the `graphs` stage makes it, on the replicated schedule of the request's
bucketed plan (`engine.plan.plan_tree(..., bucket=...)`, the bucket `engine.graphs.default_grid` picks: drone
r352-s1074, jevbench/easy-intent-00 r208-s430, customer_service r1152-s5778): every candidate path and every dummy
path of the bucket, at the 27B head shapes, with random inputs as the engine hands them to the core (q/k
L2-normalised, `ablations.probes.engine_gdn_inputs`). Both cores run on the same tensors in one process:
* FLA: `kernels.gdn_core.FlaForwardCore` with the plan's chunk layout and a solve workspace already zeroed for the
  forward (the engine's steady state: one fill per forward, not per layer);
* ours: `kernels.gdn_chunk.GdnChunkCore` in the stage's configuration (with the plan's tree walk, reading each path slot
  at its packed row: `rows`) and in the variants of `VARIANTS` (on the inputs gathered to the slots, as FLA reads them;
  without the walk; each solve by name (`fla-blocks`, `doubling`, and `blocks-doubling`: fla-blocks with its diagonal
  blocks inverted by doubling, also on 2 and 4 warps); the walk on 8 warps, which spills 88 bytes where 4 warps spill
  408 on sm_90: 8 warps lost at c2ff2ee and again at 6683faa, attempts `gdn-chunk-walk-tilings-v3` and
  `gdn-chunk-walk-eight-warps-v3.3`; a value block of 32, alone and with a 168-register cap for three programs an SM,
  and of 16, the first without spills: the kernel refuses both on CUDA unless asked for as unverified); the solve launch
  is also timed alone. Records of c2ff2ee also have solve warps and walk tilings; the record of dce89ea the stage's walk
  capped at 168 and 128 registers (`walk-r168`, `walk-r128`, since removed: 1.7x and 2.6x slower on drone, attempt
  `gdn-chunk-walk-register-cap`); the record of d9de127 the walk with a root helper (`walk-root-helper`, since
  removed: slower on all three, attempt `gdn-chunk-walk-root-helper`); earlier records also have the walk on 1 and 3
  software-pipelining stages, dropped: with the publish inside the tree walk's chunk loop Triton pipelines nothing at
  any number of stages, so they timed the stage's code again (attempt `gdn-chunk-walk-segments-pipelined`; its record
  has them on that attempt's split loop).
Every slot holds its packed row's inputs (the prep kernel's layout, gathered by `kernels.gather_slots`, whose launch is
timed alone as `gather_us`: what a variant on gathered inputs needs in front of it), so a path's shared prefix is the
same data in every path, which the tree walk relies on. Records before gdn_chunk v3 have one-launch variants (the
solve inside the walk), the split schedule (8a0fb8c) and per-slot random inputs; records before the `rows` input
have no `stage-gathered` (their `stage` read gathered inputs).
Each is captured in one CUDA graph of `--calls` back-to-back calls (a forward's layers, without launch gaps) after two
warm-up calls; the per-call time is the median over `--rounds` replays of the replay's CUDA-event time / calls.
Errors per variant, where the engine reads (each real packed row at its representative slot): relative RMSE and the
share of bit-equal output elements against FLA, the share bit-equal to the stage's output (when `stage` ran first),
and the relative RMSE of both against the fp32 oracle
`reference.ops.gdn_recurrent` on the candidate paths. Synthetic
inputs: timings and numerics only.

`--flashinfer` adds FlashInfer's sm_90 GDN prefill kernel (`kernels.gdn_flashinfer`, flashinfer-python 0.7.4: one
warp-specialised CTA per sequence and value head) on the gathered slots, every path from position 0 as FLA runs them
(it has no tree walk): `flashinfer.us` as a core would call it (exp(g) and beta's fp32 copy inside the timed call),
`kernel_us` the library's kernel alone, and its errors where the engine reads, against the oracle, FLA and the stage.

`--flashinfer` also times the stage's way, the call's hand-off arena (`flashinfer_arena`: `FlashInferCore.arena` on
the packed rows, its gather with the gates FlashInfer takes, the root to its last 64-row boundary once, every
candidate from its fp32 state: `us` all three launches, `gather_us` and `kernel_us` apart), with its errors and the
share of its output bit-equal to the library's replicated call on the same gates.

`--schedules` (issue 22, item 1: the recurrence once per row) times FLA's core instead over the request's unpadded
tree plan in each GDN mode, as `engine.tree.tree_gdn_core` runs it (gathers, calls, state bank, scatter), both on the
same packed-row inputs: `replicated` (one call over every candidate's whole path: what the `graphs` buckets hold) and
`handoff` (the root once to its last 64-row boundary, each question node once, the leaves from their parent's fp32
state: what stage `tree` runs eagerly for long contexts). Each schedule is captured in one CUDA graph of `--calls`
layers; a schedule whose capture fails is timed eagerly (`ablations.probes.cuda_time_ms`: CUDA events over
`--calls` back-to-back layers, launch gaps included) and the error is recorded. Errors: the share of bit-equal output
elements and the relative RMSE of `handoff` against `replicated`. (Records of 8a0fb8c also have the two-launch
`split` variants, since removed: ablations/attempts.toml, `gdn-chunk-split-schedule`.)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("drone", "jevbench/easy-intent-00", "customer_service")
VARIANTS = {  # name -> (GdnChunkCore options, tree walk, reads the packed rows); "stage" is what stage `core` runs
    "stage": ({}, True, True),
    "stage-gathered": ({}, True, False),
    "stage-no-walk": ({}, False, False),
    "doubling": ({"solve": "doubling"}, True, True),
    "fla-blocks": ({"solve": "fla-blocks"}, True, True),
    "blocks-doubling": ({"solve": "blocks-doubling"}, True, True),
    "blocks-doubling-w2": ({"solve": "blocks-doubling", "solve_num_warps": 2}, True, True),
    "blocks-doubling-w4": ({"solve": "blocks-doubling", "solve_num_warps": 4}, True, True),
    "walk-w8": ({"num_warps": 8}, True, True),
    "walk-bv32": ({"value_block": 32, "unverified_value_block": True}, True, True),
    "walk-bv32-r168": ({"value_block": 32, "unverified_value_block": True, "max_registers": 168}, True, True),
    "walk-bv16": ({"value_block": 16, "unverified_value_block": True}, True, True),
}


def bucketed_plan(workload_id: str):
    """The workload's plan at its bucket (host) and its unpadded tree layout (the real slots and keys)."""
    from ablations.workloads import get_workload
    from engine.graphs import GridIndex, default_grid
    from engine.plan import plan_tree, tree_layout
    from reference.service import request_candidates

    candidates, groups = request_candidates(get_workload(workload_id).request)
    layout = tree_layout(candidates, groups)
    bucket = GridIndex(default_grid()).smallest(layout)
    if bucket is None:
        raise ValueError(f"{workload_id}: no bucket of the grid holds it")
    return plan_tree(candidates, groups, bucket=bucket), layout


def walked_chunks(call) -> int:
    """The chunks the tree walk of a replicated call computes: each sequence's from its start chunk (column 1 of its
    walk row, kernels/gdn_chunk.py), none of a dummy path's."""
    lens, starts = call.cu_seqlens_cpu.diff().tolist(), call.walk[:, 1].tolist()
    return sum(-(-n // 64) - start for n, start in zip(lens, starts) if start >= 0)


def graph_time_us(fn, calls: int, rounds: int) -> float:
    """Median per-call GPU time of `fn` captured `calls` times in one CUDA graph (two eager warm-up calls first)."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def layer_probe_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The options of every per-layer probe of `measure/` (this one, `prep_probe`): the workloads (default
    `WORKLOADS`), the calls per captured graph and the replays timed."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--calls", type=int, default=10, help="calls per captured graph (layers)")
    parser.add_argument("--rounds", type=int, default=20, help="graph replays timed")
    return parser


def cuda_or_refuse(name: str) -> bool:
    """Whether a GPU is there; if not, says so on stderr (the probe then exits with 2)."""
    import torch

    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
    return torch.cuda.is_available()


def bit_equal_share(x, ref) -> float:
    """The share of bf16 elements of x bit-equal to ref's, counted exactly (a float32 mean of millions of ones rounds
    to 0.99999994: records before 2026-12-06 show that for identical outputs)."""
    import torch

    return int((x.view(torch.int16) == ref.view(torch.int16)).sum()) / x.numel()


def rel_rmse(x, ref) -> float:
    return math.sqrt(float((x.double() - ref.double()).square().sum()) / float(ref.double().square().sum()))


def probe_flashinfer(q, k, v, g, beta, cu, read, oracle, fla_o, stage, calls: int, rounds: int) -> dict:
    """FlashInfer's sm_90 GDN kernel (`kernels.gdn_flashinfer.FlashInferCore`) on the gathered slots of the call, every
    path from position 0 (it has no tree walk): the adapter's call as a core would make it (exp(g) and beta in fp32
    made inside the timed call) and the library's kernel alone on those gates made before; errors where the engine
    reads."""
    import torch

    from kernels.gdn_flashinfer import FlashInferCore, flashinfer_gdn_function

    core, function = FlashInferCore(), flashinfer_gdn_function()
    o, _ = core(q, k, v, g, beta, cu_seqlens=cu)
    alpha, beta_f32 = g[0].float().exp(), beta[0].float()
    pool = torch.zeros((1, v.shape[2], v.shape[3], k.shape[3]), device=q.device)  # read and written by no sequence
    skip = torch.full((cu.shape[0] - 1,), -1, dtype=torch.int32, device=q.device)

    def kernel_alone():
        return function(q[0], k[0], v[0], alpha, beta_f32, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                        output_state=pool, state_indices=skip, output_state_indices=skip, use_cp=False,
                        backend="flashinfer")  # fmt: skip

    mine, theirs = o[0, read], fla_o[0, read]
    return {
        "us": graph_time_us(lambda: core(q, k, v, g, beta, cu_seqlens=cu), calls, rounds),
        "kernel_us": graph_time_us(kernel_alone, calls, rounds),
        "rel_rmse_vs_fla": rel_rmse(mine.float(), theirs.float()),
        "bit_equal_share_vs_fla": bit_equal_share(mine, theirs),
        "rel_rmse_vs_oracle": rel_rmse(mine.float(), oracle),
        "rel_rmse_vs_stage": None if stage is None else rel_rmse(mine.float(), stage.float()),
    }


def probe_flashinfer_arena(packed, call, rows, read, oracle, fla_o, stage, calls: int, rounds: int) -> dict:
    """FlashInfer's kernel through the call's hand-off arena as stage `flashinfer_gdn` runs it on a bucket
    (`FlashInferCore.arena`: the gather of the packed rows with exp(g) and fp32 beta, the root to A0, every candidate
    from its state): `us` the three launches, `gather_us` the gather alone, `kernel_us` the two kernel calls alone on
    the gathered arena (`FlashInferCore.arena_calls`). `call` is the plan's replicated call on the device
    (`TreePlan.to`). Errors where the engine reads (packed rows `rows`, at the replicated call's slots `read` for the
    others), and the share bit-equal to the library's replicated call on the same gates (every path from position 0:
    `bit_equal_share_vs_replicated`, 1.0 when the kernel's hand-off at a 64-row boundary is exact)."""
    import torch

    from kernels.gdn_flashinfer import FlashInferCore, flashinfer_gdn_function
    from kernels.gdn_prep import gather_slots

    device, arena = packed[0].device, call.arena
    core, function = FlashInferCore(), flashinfer_gdn_function()
    inputs = tuple(t[0] for t in packed)
    o = core.arena(*inputs, arena)
    mine = o[arena.out_slots[rows.to(device)]]
    gathered = tuple(t[0] for t in gather_slots(packed, arena.rows, count=arena.gathered, linear_gates=True))

    def kernel_alone():
        return core.arena_calls(*gathered, arena)

    slots = gather_slots(packed, call.rows, linear_gates=True)
    skip = torch.full((call.num_sequences,), -1, dtype=torch.int64, device=device)
    zero = torch.zeros((1, *gathered[2].shape[1:], gathered[1].shape[2]), device=device)
    replicated, _ = function(*(t[0] for t in slots), initial_state=zero, output_final_state=True,
                             cu_seqlens=call.cu_seqlens, output_state=zero, state_indices=skip,
                             output_state_indices=skip, use_cp=False, backend="flashinfer")  # fmt: skip
    cu = arena.cu_seqlens.cpu().tolist()
    return {
        "arena_rows": cu[-1],
        "root_rows": cu[1],
        "us": graph_time_us(lambda: core.arena(*inputs, arena), calls, rounds),
        "gather_us": graph_time_us(
            lambda: gather_slots(packed, arena.rows, count=arena.gathered, linear_gates=True), calls, rounds
        ),
        "kernel_us": graph_time_us(kernel_alone, calls, rounds),
        "rel_rmse_vs_fla": rel_rmse(mine.float(), fla_o[0, read].float()),
        "rel_rmse_vs_oracle": rel_rmse(mine.float(), oracle),
        "rel_rmse_vs_stage": None if stage is None else rel_rmse(mine.float(), stage.float()),
        "bit_equal_share_vs_replicated": bit_equal_share(mine, replicated[read]),
    }


def probe_workload(
    workload_id: str, calls: int, rounds: int, variants: tuple[str, ...] = tuple(VARIANTS), flashinfer: bool = False
) -> dict:
    import torch

    import kernels
    from ablations.probes import engine_gdn_inputs
    from engine.plan import SolveWorkspace
    from kernels.gdn_chunk import SOLVE, GdnChunkCore, gdn_chunk_solve
    from kernels.gdn_core import FlaForwardCore
    from reference import ops

    plan, tree = bucketed_plan(workload_id)
    call, num_real = plan.gdn["replicated"].calls[0], len(tree.candidate_lens)
    device = torch.device("cuda")
    path_rows = call.rows.to(device)  # each slot holds its packed row's inputs, as the prep kernel lays them out
    inputs = engine_gdn_inputs(plan.num_rows, seed=22, device="cuda")
    q, k, v, g, beta = (t[path_rows][None].contiguous() for t in inputs)
    packed = tuple(t[None] for t in inputs)
    cu, cu_cpu = call.cu_seqlens.to(device), call.cu_seqlens_cpu
    layout = {"cu_seqlens": cu, "chunk_indices": call.chunk_indices.to(device)}
    walk = call.walk.to(device)
    workspace = SolveWorkspace()
    fla = FlaForwardCore()
    fla_options = layout | {"chunk_offsets": call.chunk_offsets.to(device), "workspace": workspace}
    workspace.begin_forward()
    fla_o, _ = fla(q, k, v, g, beta, **fla_options)  # allocates and zeroes the solve buffer: fresh for the forward

    def run_fla():
        return fla(q, k, v, g, beta, **fla_options)

    result = {
        "workload": workload_id,
        "bucket": plan.bucket.name,
        "path_slots": len(call.rows),  # the bucket's, trailing slots (in no sequence) included, as the engine's
        "sequences": call.num_sequences,
        "chunks": call.chunks,
        "walked_chunks": walked_chunks(call),
        "fla_us": graph_time_us(run_fla, calls, rounds),
        "gather_us": graph_time_us(lambda: kernels.gather_slots(packed, path_rows), calls, rounds),
        "variants": {},
    }
    # compared where the engine reads: each real packed row at its representative slot (a walk skips the others)
    read = call.out_slots[call.out_rows < tree.rows].to(device)
    bounds = cu_cpu.tolist()
    oracle = torch.zeros_like(fla_o[0], dtype=torch.float32)
    for s, e in zip(bounds[:num_real], bounds[1 : num_real + 1]):
        oracle[s:e] = ops.gdn_recurrent(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e])[0]
    oracle = oracle[read]
    result["fla_vs_oracle_rel_rmse"] = rel_rmse(fla_o[0, read].float(), oracle)
    print(f"{workload_id:<24} gather_slots {result['gather_us']:7.1f} us (in front of every gathered variant)")
    outputs = {}  # the stage's output where it ran before the other variants: their bits against it
    for name in variants:
        options, tree_walk, direct = VARIANTS[name]
        core, walked = GdnChunkCore(**options), ({"walk": walk} if tree_walk else {})
        args, through = (packed, {"rows": path_rows}) if direct else ((q, k, v, g, beta), {})
        o, _ = core(*args, **layout, **walked, **through)
        us = graph_time_us(lambda c=core, a=args, w=walked, t=through: c(*a, **layout, **w, **t), calls, rounds)
        solve = {"solve": options.get("solve", SOLVE), "num_warps": options.get("solve_num_warps")}
        solve_us = graph_time_us(  # the solve launch alone, on the same inputs
            lambda solve=solve, a=args, w=walked, t=through: gdn_chunk_solve(
                a[1][0], a[3][0], a[4][0], cu, layout["chunk_indices"], walk=w.get("walk"), **t, **solve
            ),
            calls,
            rounds,
        )  # fmt: skip
        mine, theirs = o[0, read], fla_o[0, read]
        if name == "stage":
            outputs["stage"] = mine
        stage = outputs.get("stage")
        figures = {
            "options": options,
            "tree_walk": tree_walk,
            "reads_packed_rows": direct,
            "us": us,
            "solve_us": solve_us,
            "speedup_vs_fla": result["fla_us"] / us,
            "rel_rmse_vs_fla": rel_rmse(mine.float(), theirs.float()),
            "bit_equal_share_vs_fla": bit_equal_share(mine, theirs),
            "rel_rmse_vs_oracle": rel_rmse(mine.float(), oracle),
            "bit_equal_share_vs_stage": None if stage is None else bit_equal_share(mine, stage),
        }
        result["variants"][name] = figures
        speed, error, equal = figures["speedup_vs_fla"], figures["rel_rmse_vs_fla"], figures["bit_equal_share_vs_fla"]
        print(f"{workload_id:<24} {name:<14} {us:7.1f} us (solve {solve_us:6.1f})  FLA {result['fla_us']:7.1f} us  "
              f"x{speed:5.2f}  vs FLA {error:.2e}, bit-equal {equal:.4f}", flush=True)  # fmt: skip
    if flashinfer:
        figures = probe_flashinfer(q, k, v, g, beta, cu, read, oracle, fla_o, outputs.get("stage"), calls, rounds)
        result["flashinfer"] = figures
        print(f"{workload_id:<24} {'flashinfer':<14} {figures['us']:7.1f} us (kernel {figures['kernel_us']:6.1f})  "
              f"FLA {result['fla_us']:7.1f} us  vs oracle {figures['rel_rmse_vs_oracle']:.2e}, "
              f"FLA {figures['rel_rmse_vs_fla']:.2e}", flush=True)  # fmt: skip
        rows = call.out_rows[call.out_rows < tree.rows]
        on_device = plan.to(device).gdn["replicated"].calls[0]
        figures = probe_flashinfer_arena(
            packed, on_device, rows, read, oracle, fla_o, outputs.get("stage"), calls, rounds
        )
        result["flashinfer_arena"] = figures
        print(f"{workload_id:<24} {'fi-arena':<14} {figures['us']:7.1f} us (kernel {figures['kernel_us']:6.1f}, "
              f"gather {figures['gather_us']:5.1f}; {figures['arena_rows']} rows)  vs oracle "
              f"{figures['rel_rmse_vs_oracle']:.2e}, bit-equal to replicated "
              f"{figures['bit_equal_share_vs_replicated']:.6f}", flush=True)  # fmt: skip
    return result


def probe_schedules(workload_id: str, calls: int, rounds: int) -> dict:
    """FLA's core over the workload's unpadded tree plan in the `replicated` and `handoff` modes (module docstring)."""
    import torch

    from ablations.probes import ENGINE_CORE_OPTIONS, cuda_time_ms, engine_gdn_inputs
    from ablations.workloads import get_workload
    from engine.plan import plan_tree
    from engine.tree import tree_gdn_core
    from kernels.gdn_core import FlaForwardCore
    from reference.service import request_candidates

    plan = plan_tree(*request_candidates(get_workload(workload_id).request), device="cuda")
    q, k, v, g, beta = engine_gdn_inputs(plan.num_rows, seed=24, device="cuda")
    core, options = FlaForwardCore(), {"workspace": plan.arena.workspace, **ENGINE_CORE_OPTIONS}
    plan.arena.workspace.begin_forward()  # one zeroed solve buffer per call layout, as a forward starts
    result = {"workload": workload_id, "rows": plan.num_rows, "schedules": {}}
    outputs = {}
    for mode, schedule in plan.gdn.items():

        def run(mode=mode):
            return tree_gdn_core(q, k, v, g, beta, plan, mode=mode, core=core, chunk_offsets=True, **options)

        outputs[mode] = run().clone()
        figures = {"calls": len(schedule.calls), "chunks": schedule.chunks,
                   "tokens": sum(c.num_tokens for c in schedule.calls)}  # fmt: skip
        try:
            figures["us"], figures["timer"] = graph_time_us(run, calls, rounds), "cuda-graph"
        except Exception as error:  # a capture the eager schedule does not survive: say so, time it eagerly
            torch.cuda.synchronize()
            figures["capture_error"] = f"{type(error).__name__}: {error}"[:500]
            figures["us"], figures["timer"] = 1000.0 * cuda_time_ms(run, calls, rounds), "eager"
        result["schedules"][mode] = figures
        print(f"{workload_id:<24} {mode:<10} {figures['us']:8.1f} us ({figures['timer']}), {figures['calls']} calls, "
              f"{figures['tokens']} tokens, {figures['chunks']} chunks", flush=True)  # fmt: skip
    got, want = outputs["handoff"], outputs["replicated"]
    result["handoff_vs_replicated"] = {
        "bit_equal_share": bit_equal_share(got, want),
        "rel_rmse": rel_rmse(got.float(), want.float()),
        "time_ratio": result["schedules"]["handoff"]["us"] / result["schedules"]["replicated"]["us"],
    }
    print(f"{workload_id:<24} handoff / replicated {result['handoff_vs_replicated']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = layer_probe_parser("measure.gdn_chunk_probe", __doc__)
    parser.add_argument("--schedules", action="store_true", help="FLA's core in the replicated and handoff modes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--no-record", action="store_true", help="print only (a run under a profiler)")
    parser.add_argument(
        "--flashinfer", action="store_true", help="also FlashInfer's sm_90 GDN kernel on every path (flashinfer-python)"
    )
    args = parser.parse_args(argv)
    variants = tuple(args.variants.split(","))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's deterministic Triton path (reference-math.md §4.3)
    if not cuda_or_refuse("gdn_chunk_probe"):
        return 2
    import torch

    from ablations.envinfo import collect, record_stem, write_json
    from engine.fla_configs import pin_fla_configs

    pin_fla_configs()  # before fla is imported: the committed configs of this GPU, if any
    torch.manual_seed(0)
    env = collect("cuda")
    name = "gdn_tree_schedules" if args.schedules else "gdn_chunk"
    record = {"probe": name, "env": env, "calls": args.calls, "rounds": args.rounds, "workloads": []}
    for workload_id in args.workloads.split(","):
        with torch.no_grad():
            if args.schedules:
                record["workloads"].append(probe_schedules(workload_id, args.calls, args.rounds))
            else:
                record["workloads"].append(
                    probe_workload(workload_id, args.calls, args.rounds, variants, flashinfer=args.flashinfer)
                )
    if not args.no_record:
        suffix = "-schedules" if args.schedules else ""
        write_json(record, REPO / "results" / "gdn-chunk" / f"{record_stem(env)}{suffix}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
