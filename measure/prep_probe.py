"""The GDN and attention prep kernels on a bucketed tree plan: every path slot prepared, or each packed row once and
gathered (issue 22, item 3).

    python -m measure.prep_probe                 # writes results/prep-kernels/<utc>-<gpu>-<commit>.json
    python -m measure.prep_probe --workloads drone --calls 10 --rounds 20

What is timed, per workload, on the plan the `graphs` stage replays (`engine.plan.plan_tree(..., bucket=...)`, the
bucket `engine.graphs.default_grid` picks) at the 27B shapes, with seeded random projections (synthetic: timings and
numerics only), each way captured in one CUDA graph of `--calls` back-to-back calls (a forward's layers), the
per-call time the median over `--rounds` replays:
* `gdn_prep` "paths": `kernels.gdn_prep` over every path slot of the replicated call (`conv_paths`, read through its
  row index), what the engine ran before gdn_prep v4; "packed": the same kernel at each packed row's representative
  slot (`slots=plan.row_slot`), then q, k, v, g, beta laid out on the path slots (`kernels.gather_slots` by
  `conv_paths.rows`, one launch), what `engine.backbone` ran with gdn_prep v4 (the record of f9b30ea gathered with
  five `index_select` calls instead); "taps": each packed row once from its conv window on its path (`plan.conv_taps`,
  gdn_prep v5: no search for the row's sequence, no index read before the conv's own), then the same gather: what
  `engine.backbone` runs since v5 (stage `core` runs the prep alone and reads the packed rows through `rows`).
* `attn_prep` "key_rows": `kernels.attn_prep` with the tree's key rows (k and v prepared at every key entry, each
  node's whole path); "packed": over the packed rows, then k and v gathered at the key rows.
Every way must be bit-equal to the first over the real candidates' slots and keys (`bit_equal_share`, the smallest
share, 1.0 expected: the same kernel math per row). Floors: bytes read and written once (`ablations.kernel_bytes`)
over the copy rate this process measures as the runner does (`copy_tbps`; the record of f9b30ea used a copy inside a
CUDA graph, 2.76 TB/s, which understates each floor's multiple by 4.11 / 2.76: engine/stages/core.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ablations.probes import equal_share
from measure.gdn_chunk_probe import bucketed_plan, cuda_or_refuse, graph_time_us, layer_probe_parser

REPO = Path(__file__).resolve().parents[1]


def copy_tbps() -> float:
    """The copy rate as the runner's ceilings measure it (`ablations.timing.measure_ceilings`: an eager 1 GiB
    device-to-device copy, reads and writes counted). Not inside a CUDA graph: captured there, the same copy measured
    2.76 TB/s in this probe's record of f9b30ea against the runner's 4.11 in the same campaign (cause not
    established; a captured copy is a memcpy node, which may run on the copy engines)."""
    import torch

    from ablations.timing import time_calls

    source = torch.randint(0, 256, (2**30,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    timed = time_calls(lambda: target.copy_(source), device="cuda", warmup=3, runs=20)
    return 2 * source.numel() / (timed.median_ms * 1e-3) / 1e12


def attn_prep_inputs(plan, s, normal) -> tuple[tuple, dict]:
    """`kernels.attn_prep`'s positional arguments (a random projection and norm weights from `normal(*shape, std=)`,
    the plan's RoPE tables, eps) and its head dimensions, at the shapes `s`."""
    from reference import ops

    cos, sin = ops.rope_cos_sin(plan.positions, s.rotary_dim, s.rope_theta)
    attn_proj = normal(plan.num_rows, s.attn_in_width)
    attn_args = (attn_proj, normal(s.head_dim, std=0.1), normal(s.head_dim, std=0.1), cos, sin, s.rms_norm_eps)
    attn_dims = {"num_heads": s.num_attention_heads, "num_kv_heads": s.num_key_value_heads, "head_dim": s.head_dim}
    return attn_args, attn_dims


def prep_ways(plan, layout, shapes, seed: int = 22) -> dict:
    """Per kernel: its ways (name -> a function returning its outputs) on seeded random inputs at `shapes` on the
    plan's device, and a function that pairs two ways' outputs over the real slots / keys for the bit comparison."""
    import torch

    import kernels

    s, n, conv, nodes = shapes, plan.num_rows, plan.conv_paths, plan.attention
    device = plan.device
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0):
        return (torch.randn(shape, generator=gen, device=device) * std + mean).bfloat16()

    hv = s.linear_num_value_heads
    gdn_proj = normal(n, s.gdn_in_width)
    a_log = torch.log(1 + 15 * torch.rand(hv, generator=gen, device=device))
    gdn_weights = (normal(s.conv_dim, s.linear_conv_kernel_dim, std=0.5), a_log, normal(hv, std=0.1, mean=1.0))
    gdn_dims = {"num_k_heads": s.linear_num_key_heads, "num_v_heads": hv, "head_k_dim": s.linear_key_head_dim,
                "head_v_dim": s.linear_value_head_dim}  # fmt: skip
    attn_args, attn_dims = attn_prep_inputs(plan, s, normal)

    def gdn_paths():
        return kernels.gdn_prep(gdn_proj, *gdn_weights, conv.cu_seqlens_i32, rows=conv.rows, **gdn_dims)

    def gdn_packed():
        packed = kernels.gdn_prep(gdn_proj, *gdn_weights, conv.cu_seqlens_i32, rows=conv.rows, slots=plan.row_slot,
                                  **gdn_dims)  # fmt: skip
        return kernels.gather_slots(packed, conv.rows)

    def gdn_taps():
        packed = kernels.gdn_prep(gdn_proj, *gdn_weights, None, taps=plan.conv_taps, **gdn_dims)
        return kernels.gather_slots(packed, conv.rows)

    def attn_key_rows():
        return kernels.attn_prep(*attn_args, key_rows=nodes.key_rows, **attn_dims)

    def attn_packed():
        q, k, v = kernels.attn_prep(*attn_args, **attn_dims)
        return q, k.index_select(0, nodes.key_rows), v.index_select(0, nodes.key_rows)

    def real_slots(a, b):
        return [(x[:, : layout.slots], y[:, : layout.slots]) for x, y in zip(a, b)]

    def real_keys(a, b):  # q over every row; k and v over the real nodes' keys (the dummy node's come after)
        return [(a[0], b[0])] + [(x[: layout.keys], y[: layout.keys]) for x, y in zip(a[1:], b[1:])]

    return {
        "gdn_prep": ({"paths": gdn_paths, "packed": gdn_packed, "taps": gdn_taps}, real_slots),
        "attn_prep": ({"key_rows": attn_key_rows, "packed": attn_packed}, real_keys),
    }


def probe_workload(workload_id: str, calls: int, rounds: int, tbps: float) -> dict:
    import torch

    from ablations.kernel_bytes import attn_prep_bytes, gdn_prep_bytes
    from reference.shapes import QWEN38_27B

    host, layout = bucketed_plan(workload_id)
    plan = host.to("cuda")
    n, slots, keys = plan.num_rows, len(plan.conv_paths.rows), plan.attention.num_keys
    floors = {"gdn_prep": (gdn_prep_bytes(n, slots), gdn_prep_bytes(n, n)),
              "attn_prep": (attn_prep_bytes(n, keys), attn_prep_bytes(n, n))}  # fmt: skip
    result = {"workload": workload_id, "bucket": plan.bucket.name, "rows": n, "path_slots": slots, "keys": keys,
              "real_slots": layout.slots, "real_keys": layout.keys, "kernels": {}}  # fmt: skip
    for kernel, (ways, pairs) in prep_ways(plan, layout, QWEN38_27B).items():
        first, *others = (fn() for fn in ways.values())
        nbytes, nbytes_once = floors[kernel]
        equal = min(equal_share(a, b) for other in others for a, b in pairs(first, other))
        figures = {"bytes": nbytes, "floor_us": nbytes / tbps / 1e6, "bytes_once_per_row": nbytes_once,
                   "floor_us_once_per_row": nbytes_once / tbps / 1e6, "bit_equal_share": equal, "ways": {}}  # fmt: skip
        for name, fn in ways.items():
            us = graph_time_us(fn, calls, rounds)
            figures["ways"][name] = {"us": us, "x_floor": us / figures["floor_us"]}
            print(f"{workload_id:<24} {kernel:<9} {name:<8} {us:8.1f} us  floor {figures['floor_us']:6.1f} us  "
                  f"x{us / figures['floor_us']:5.2f}", flush=True)  # fmt: skip
        print(f"{workload_id:<24} {kernel:<9} bit-equal share {figures['bit_equal_share']}", flush=True)
        result["kernels"][kernel] = figures
        torch.cuda.synchronize()
    return result


def main(argv: list[str] | None = None) -> int:
    args = layer_probe_parser("measure.prep_probe", __doc__).parse_args(argv)
    if not cuda_or_refuse("prep_probe"):
        return 2
    import torch

    from ablations.envinfo import collect, record_stem, write_json

    env = collect("cuda")
    tbps = copy_tbps()
    print(f"copy rate {tbps:.3f} TB/s", flush=True)
    record = {"probe": "prep_kernels", "env": env, "calls": args.calls, "rounds": args.rounds, "copy_tbps": tbps,
              "workloads": []}  # fmt: skip
    for workload_id in args.workloads.split(","):
        with torch.no_grad():
            record["workloads"].append(probe_workload(workload_id, args.calls, args.rounds, tbps))
    write_json(record, REPO / "results" / "prep-kernels" / f"{record_stem(env)}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
