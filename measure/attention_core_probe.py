"""Stage `core`'s attention core on a bucketed tree plan: FlashAttention-2's varlen forward against FlashAttention-4's.

    python -m measure.attention_core_probe        # writes results/attention-core/<utc>-<gpu>-<commit>.json
    python -m measure.attention_core_probe --workloads drone --calls 10 --rounds 20 --ways fa4

Why. In `core` on the H200 (results/runs/20261206T083908Z-nvidia-h200-8edfe66.json) FlashAttention-2's varlen kernel
takes 2.00 ms of customer_service's forward (125 us a layer over 16 layers) and 0.46 ms of drone's, at head dim 256,
where torch's build runs FlashAttention-2's 64 x 64 tiles on mma.sync: about 90 TFLOP/s on customer_service's 11
GFLOP a layer, on a card whose dense bf16 rate the runner measures at 767. cuDNN's ragged attention failed (attempt
`attention-core-cudnn-ragged`). FlashAttention-4 (`flash-attn-4`, kernels in CUTLASS's Python DSL, compiled on first
call) has warpgroup-MMA (wgmma) forward kernels for sm_90 up to head dim 256 and the Blackwell kernels of the design
target. This probe asks, before any engine change, whether it runs these shapes (head dim 256, 24 query and 4
key/value heads, varlen causal with fewer queries than keys, aligned at the bottom right as FlashAttention-2),
inside CUDA graphs, with what error and how fast. The device image lacks the package: a campaign carries its wheels.

What is timed, per workload, on the plan the `graphs` stage replays (`engine.plan.plan_tree(..., bucket=...)`, the
bucket `engine.graphs.default_grid` picks) at the 27B shapes, with seeded random projections (synthetic: timings and
numerics only): `kernels.attn_prep` with the plan's key rows (what stage `core` runs), then each attention core on the
same q, k, v, captured in one CUDA graph of `--calls` back-to-back calls (a forward's attention layers), the per-call
time the median over `--rounds` replays (a way whose capture fails is timed eagerly over the same calls and the error
kept):
* "flash": `engine.tree.flash_node_core` (FlashAttention-2's varlen forward, the stage's);
* "flash4": `engine.tree.flash4_node_core` (stage `core`'s: FlashAttention-4's `flash_attn_varlen_func` with the same
  cumulative lengths and maxima, causal, one split, query heads packed per key/value head);
* "fa4", "fa4-no-pack": the same call with GQA packing left to the package's heuristic, and forced off;
* "flash4-paged" (stage `paged`, issue 22, item 2: attention without replicated prefixes): `attn_prep` writes k and v
  once per packed row (no key layout), and FlashAttention-4 reads each node's path through a page table of one-row
  pages (`engine.tree.flash4_paged_node_core` on `engine.tree.page_keys`: its cp.async paged path), with `core`'s
  pins. Its output is compared bit for bit with "flash4"'s (the flat and alone checks, which build other
  layouts, are not run for it), and the prep is timed in both layouts (`prep_us`: with the key rows, and rows only).
Errors over the real rows, against the fp32 node-wise reference (`engine.tree.blockwise_node_core` on fp32 copies of
the same bf16 q, k, v): max |diff| and relative RMSE per way; the share of elements bit-equal to "flash"; whether two
calls give the same bits; whether each real leaf's rows are bit-equal to one launch over the flat plan's sequences
(each leaf's whole path as queries and keys: the tree-against-flat law of the stage); and whether each real sequence's
output is bit-equal when the sequence runs alone (its own lengths as the maxima: batching and bucketing; on sm_90 at
head dim 256 FlashAttention-4 picks its kernel without looking at the lengths, so the alone launches reuse the compiled
kernel). A one-row node alone takes another kernel path in FlashAttention-2 (attempt `attention-core-cudnn-ragged`), so
"flash" fails that check on drone and customer_service by construction.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from ablations.probes import cuda_time_ms
from measure.gdn_chunk_probe import bucketed_plan, cuda_or_refuse, graph_time_us, layer_probe_parser
from measure.prep_probe import attn_prep_inputs

REPO = Path(__file__).resolve().parents[1]
FA4_WAYS = {"flash4": True, "fa4": None, "fa4-no-pack": False}  # way -> pack_gqa (None: its heuristic)
PAGED = "flash4-paged"  # FlashAttention-4 reading each node's keys from the packed rows through a page table


def attention_ways(nodes, scale: float, paged: dict | None = None) -> dict:
    """name -> f(q, k, v) of each attention core probed, over the sequences of `nodes` (anything with the
    `NodeAttention` fields cu_seqlens_q, cu_seqlens_k, max_q, max_k); with `paged` (k and v [rows, Hkv, D] at the
    packed rows and their `engine.tree.PagedKeys`) also PAGED, stage `paged`'s core, which reads those instead."""
    from engine.tree import flash4_node_core, flash4_paged_node_core, flash4_varlen, flash_node_core

    def fa4(pack_gqa):
        return lambda q, k, v: flash4_varlen(q, k, v, nodes, scale, pack_gqa=pack_gqa)

    ways = {
        "flash": lambda q, k, v: flash_node_core(q, k, v, nodes, scale),
        "flash4": lambda q, k, v: flash4_node_core(q, k, v, nodes, scale),
    }
    if paged:
        ways[PAGED] = lambda q, k, v: flash4_paged_node_core(q, paged["k"], paged["v"], paged["keys"], scale)
    return ways | {name: fa4(pack_gqa) for name, pack_gqa in FA4_WAYS.items() if name not in ways}


def sequences(q_lens: list[int], k_lens: list[int], device):
    """A varlen layout (the `NodeAttention` fields the attention cores read) of sequences of these lengths."""
    from types import SimpleNamespace

    import torch

    def bounds(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

    return SimpleNamespace(
        cu_seqlens_q=bounds(q_lens), cu_seqlens_k=bounds(k_lens), max_q=max(q_lens), max_k=max(k_lens)
    )


def alone_bitwise(name: str, q, k, v, out, nodes, real_rows: int, scale: float) -> bool:
    """Whether every sequence with real rows gets the bits of `out` (the whole launch) when it runs alone."""
    import torch

    cq, ck = nodes.cu_seqlens_q_cpu.tolist(), nodes.cu_seqlens_k_cpu.tolist()
    for i in range(len(cq) - 1):
        nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if nq == 0 or cq[i] >= real_rows:
            continue
        way = attention_ways(sequences([nq], [nk], q.device), scale)[name]
        if not torch.equal(
            way(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]]), out[cq[i] : cq[i + 1]]
        ):
            return False
    return True


def flat_bitwise(name: str, q, k, v, out, nodes, real_rows: int, scale: float) -> bool:
    """Whether every real leaf's rows (a node with fewer queries than keys) get the bits of `out` (the tree launch)
    in one launch over the flat plan's sequences: each leaf's whole path as queries and keys (the queries of the path
    rows are their rows' q, gathered through the key rows), as stage `core` must for its tree-against-flat law."""
    import torch

    cq, ck = nodes.cu_seqlens_q_cpu.tolist(), nodes.cu_seqlens_k_cpu.tolist()
    leaves = [i for i in range(len(cq) - 1) if 0 < cq[i + 1] - cq[i] < ck[i + 1] - ck[i] and cq[i] < real_rows]
    if not leaves:
        return True
    keys = torch.cat([torch.arange(ck[i], ck[i + 1]) for i in leaves]).to(q.device)
    lens = [ck[i + 1] - ck[i] for i in leaves]
    o_flat = attention_ways(sequences(lens, lens, q.device), scale)[name](q[nodes.key_rows[keys]], k[keys], v[keys])
    for i, end in zip(leaves, itertools.accumulate(lens)):
        nq = cq[i + 1] - cq[i]
        if not torch.equal(o_flat[end - nq : end], out[cq[i] : cq[i + 1]]):
            return False
    return True


def probe_workload(workload_id: str, calls: int, rounds: int, ways: list[str], seed: int = 22) -> dict:
    import torch

    import kernels
    from engine.tree import blockwise_node_core, page_keys
    from reference.shapes import QWEN38_27B as s

    host, layout = bucketed_plan(workload_id)
    plan = host.to("cuda")
    nodes, scale = plan.attention, s.head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * std).bfloat16()

    attn_args, attn_dims = attn_prep_inputs(plan, s, normal)
    q, k, v = kernels.attn_prep(*attn_args, key_rows=nodes.key_rows, **attn_dims)
    paged = {}  # PAGED's inputs: k and v once per packed row, and the page table of stage `paged`
    if PAGED in ways:
        q_rows, k_rows, v_rows = kernels.attn_prep(*attn_args, **attn_dims)
        assert torch.equal(q_rows, q), "the prep's q does not depend on the key layout"
        paged = {"k": k_rows, "v": v_rows, "keys": page_keys(nodes)}
    real = slice(0, layout.rows)
    reference = blockwise_node_core(q.float(), k.float(), v.float(), nodes, scale)[real]
    result = {
        "workload": workload_id,
        "bucket": plan.bucket.name,
        "rows": plan.num_rows,
        "real_rows": layout.rows,
        "keys": nodes.num_keys,
        "sequences": len(nodes.cu_seqlens_q_cpu) - 1,
        "max_q": nodes.max_q,
        "max_k": nodes.max_k,
        "ways": {},
    }
    if PAGED in ways:

        def prep(key_rows):
            return lambda: kernels.attn_prep(*attn_args, key_rows=key_rows, **attn_dims)

        layouts = {"key rows": nodes.key_rows, "rows only": None}
        result["prep_us"] = {layout: graph_time_us(prep(rows), calls, rounds) for layout, rows in layouts.items()}
        print(f"{workload_id:<24} attn_prep {result['prep_us']['key rows']:.1f} us with the key rows, "
              f"{result['prep_us']['rows only']:.1f} us rows only", flush=True)  # fmt: skip
    outputs, whole = {}, {}  # per way: the real rows in fp32, and the whole output
    chosen = {name: way for name, way in attention_ways(nodes, scale, paged).items() if name in ways}
    for name, way in chosen.items():
        figures: dict = {}
        try:
            out = way(q, k, v)
            again = way(q, k, v)
            torch.cuda.synchronize()
        except Exception as error:  # a way that does not run these shapes is a finding, recorded
            figures["error"] = f"{type(error).__name__}: {error}"[:2000]
            result["ways"][name] = figures
            print(f"{workload_id:<24} {name:<12} does not run: {figures['error'][:300]}", flush=True)
            continue
        mine = out[real].float()
        diff = mine - reference
        figures["max_abs_diff_vs_fp32"] = float(diff.abs().max())
        figures["rel_rmse_vs_fp32"] = float(diff.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())
        figures["repeatable"] = bool(torch.equal(out, again))
        outputs[name], whole[name] = mine, out

        def call(way=way):
            return way(q, k, v)

        try:
            figures["us"] = graph_time_us(call, calls, rounds)
            figures["timed"] = "cuda-graph"
        except Exception as error:
            figures["graph_error"] = f"{type(error).__name__}: {error}"[:2000]
            torch.cuda.synchronize()
            figures["us"] = 1000.0 * cuda_time_ms(call, inner=calls, rounds=rounds)
            figures["timed"] = "eager"
        result["ways"][name] = figures
        print(f"{workload_id:<24} {name:<12} {figures['us']:8.1f} us ({figures['timed']}), max |diff| vs fp32 "
              f"{figures['max_abs_diff_vs_fp32']:.3e}, rel RMSE {figures['rel_rmse_vs_fp32']:.3e}, repeatable "
              f"{figures['repeatable']}", flush=True)  # fmt: skip
    for name, out in whole.items():  # last: flat and alone, a way may compile other specialisations
        if name == PAGED:
            if "flash4" in whole:
                result["ways"][name]["bitwise_vs_flash4"] = bool(torch.equal(out[real], whole["flash4"][real]))
                print(f"{workload_id:<24} {name:<12} bit-equal to flash4 on the real rows: "
                      f"{result['ways'][name]['bitwise_vs_flash4']}", flush=True)  # fmt: skip
            continue
        checks = {}
        for check, function in (("flat_bitwise", flat_bitwise), ("alone_bitwise", alone_bitwise)):
            try:
                checks[check] = function(name, q, k, v, out, nodes, layout.rows, scale)
            except Exception as error:
                checks[check] = f"{type(error).__name__}: {error}"[:2000]
        result["ways"][name] |= checks
        print(f"{workload_id:<24} {name:<12} leaves bit-equal to the flat plan: {checks['flat_bitwise']}; each real "
              f"node alone: {checks['alone_bitwise']}", flush=True)  # fmt: skip
    if "flash" in outputs:
        for name, mine in outputs.items():
            result["ways"][name]["bit_equal_share_vs_flash"] = float((mine == outputs["flash"]).float().mean())
    return result


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = layer_probe_parser("measure.attention_core_probe", __doc__)
    parser.add_argument("--ways", type=lambda s: s.split(","), default=list(FA4_WAYS), help="FlashAttention-4 ways")
    args = parser.parse_args(argv)
    if not set(args.ways) <= {*FA4_WAYS, PAGED}:
        parser.error(f"--ways: each of {', '.join([*FA4_WAYS, PAGED])}")
    if not cuda_or_refuse("attention_core_probe"):
        return 2
    import torch

    from ablations.envinfo import collect, record_stem, write_json

    env = collect("cuda")
    record = {
        "probe": "attention_core",
        "env": env,
        "flash_attn_4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl-libs-base"),
        "calls": args.calls,
        "rounds": args.rounds,
        "workloads": [],
    }
    print(f"flash-attn-4 {record['flash_attn_4']}, CUTLASS DSL {record['cutlass_dsl']}", flush=True)
    path = REPO / "results" / "attention-core" / f"{record_stem(env)}.json"
    for workload_id in args.workloads.split(","):
        with torch.no_grad():
            record["workloads"].append(probe_workload(workload_id, args.calls, args.rounds, ["flash", *args.ways]))
        write_json(record, path)  # after each workload: a step cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
