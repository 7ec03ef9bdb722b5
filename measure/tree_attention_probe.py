"""Stage `core`'s attention on a bucketed tree plan: FlashAttention-2 over the key layout against the tree attention
kernel over the packed rows (issue 22, item 2).

    python -m measure.tree_attention_probe        # writes results/tree-attention/<utc>-<gpu>-<commit>.json
    python -m measure.tree_attention_probe --workloads drone --calls 10 --rounds 20

What is timed, per workload, on the plan the `graphs` stage replays (`engine.plan.plan_tree(..., bucket=...)`, the
bucket `engine.graphs.default_grid` picks) at the 27B shapes, with seeded random projections (synthetic: timings and
numerics only), each captured in one CUDA graph of `--calls` back-to-back calls (a forward's attention layers), the
per-call time the median over `--rounds` replays:
* "flash": `kernels.attn_prep` with the plan's key rows (k and v written at every key entry: each node's whole path),
  then `engine.tree.flash_node_core` (FlashAttention-2's varlen forward): what stage `core` runs;
* "nodes" and "row-blocks": `kernels.attn_prep` over the N packed rows, then `kernels.tree_attention.tree_attention`
  reading each node's path through the key rows, in each of its schedules.
Each way whole (prep and attention) and its attention call alone, on the same prepared inputs; beside them the
key-block steps each schedule takes (`key_block_steps`, host arithmetic on the plan). Errors: max |Δ| of the tree
kernel's output against FlashAttention-2's over the real rows, beside the kernels' bound against the fp32 blockwise
reference (3 · 2^-8 · max |v| each, kernels/tree_attention.py), so |Δ| <= 6 · 2^-8 · max |v| is expected; and whether
the two schedules' outputs are bit-equal (they must be).
"""

from __future__ import annotations

import sys
from pathlib import Path

from measure.gdn_chunk_probe import bucketed_plan, cuda_or_refuse, graph_time_us, layer_probe_parser
from measure.prep_probe import attn_prep_inputs

REPO = Path(__file__).resolve().parents[1]


def key_block_steps(nodes, schedule: str) -> int:
    """Key-block steps (one dot pair of a 64-row query block with a 64-key block) a schedule takes over the plan's
    nodes: "nodes", each node's query blocks times its key blocks; "row-blocks", as its kernel walks them: for each
    64-row block and key block, the runs of adjacent nodes with the same key rows there, counted when a row of the run
    reaches the key block."""
    from kernels.tree_attention import BLOCK_M, BLOCK_N  # rows per program on the GPU, keys per block

    bq, bk, key_rows = nodes.cu_seqlens_q_cpu.tolist(), nodes.cu_seqlens_k_cpu.tolist(), nodes.key_rows.cpu().tolist()
    if schedule == "nodes":
        return sum(-(-(bq[i + 1] - bq[i]) // BLOCK_M) * -(-(bk[i + 1] - bk[i]) // BLOCK_N)
                   for i in range(len(bq) - 1) if bq[i + 1] > bq[i])  # fmt: skip
    steps = 0
    for first in range(0, bq[-1], BLOCK_M):
        last = min(first + BLOCK_M, bq[-1]) - 1
        present = [i for i in range(len(bq) - 1) if bq[i] <= last and bq[i + 1] > first]
        # the key position of each present node's last row in this block
        reach = {i: (bk[i + 1] - bk[i]) - (bq[i + 1] - bq[i]) + min(last, bq[i + 1] - 1) - bq[i] for i in present}
        for block in range(max(reach.values()) // BLOCK_N + 1):
            runs: list[tuple[tuple, int]] = []  # (key rows at the block, the run's furthest position)
            for i in present:
                keys = tuple(key_rows[bk[i] + block * BLOCK_N : min(bk[i] + (block + 1) * BLOCK_N, bk[i + 1])])
                if runs and runs[-1][0] == keys:
                    runs[-1] = (keys, max(runs[-1][1], reach[i]))
                else:
                    runs.append((keys, reach[i]))
            steps += sum(furthest >= block * BLOCK_N for _, furthest in runs)
    return steps


def probe_workload(workload_id: str, calls: int, rounds: int, seed: int = 22) -> dict:
    import torch

    import kernels
    from engine.tree import flash_node_core
    from kernels.tree_attention import SCHEDULES, tree_attention
    from reference.shapes import QWEN38_27B as s

    host, layout = bucketed_plan(workload_id)
    plan = host.to("cuda")
    nodes, scale = plan.attention, s.head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape, std=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * std).bfloat16()

    attn_args, attn_dims = attn_prep_inputs(plan, s, normal)
    key_layout = kernels.attn_prep(*attn_args, key_rows=nodes.key_rows, **attn_dims)
    packed = kernels.attn_prep(*attn_args, **attn_dims)

    def flash_attention():
        return flash_node_core(*key_layout, nodes, scale)

    bounds = (nodes.key_rows, nodes.cu_seqlens_q, nodes.cu_seqlens_k, nodes.max_q, scale)

    def flash():
        q, k, v = kernels.attn_prep(*attn_args, key_rows=nodes.key_rows, **attn_dims)
        return flash_node_core(q, k, v, nodes, scale)

    ways = {"flash": (flash, flash_attention)}
    for schedule in SCHEDULES:

        def attention(schedule=schedule):
            return tree_attention(*packed, *bounds, schedule=schedule)

        def whole(schedule=schedule):
            return tree_attention(*kernels.attn_prep(*attn_args, **attn_dims), *bounds, schedule=schedule)

        ways[schedule] = (whole, attention)

    real = slice(0, layout.rows)
    theirs, mine = flash_attention()[real].float(), ways["nodes"][1]()[real].float()
    by_rows = ways["row-blocks"][1]()[real].float()
    v_max = float(packed[2].float().abs().max())
    result = {
        "workload": workload_id,
        "bucket": plan.bucket.name,
        "rows": plan.num_rows,
        "keys": nodes.num_keys,
        "nodes": len(nodes.cu_seqlens_q_cpu) - 1,
        "max_abs_diff": float((mine - theirs).abs().max()),
        "bound_vs_flash": 6 * 2**-8 * v_max,
        "bit_equal_share": float((mine == theirs).float().mean()),
        "schedules_bit_equal": bool(torch.equal(mine, by_rows)),
        "key_block_steps": {schedule: key_block_steps(host.attention, schedule) for schedule in SCHEDULES},
        "ways": {},
    }
    for name, (whole, attention) in ways.items():
        figures = {"us": graph_time_us(whole, calls, rounds), "attention_us": graph_time_us(attention, calls, rounds)}
        result["ways"][name] = figures
        steps = result["key_block_steps"].get(name, "-")
        print(f"{workload_id:<24} {name:<10} {figures['us']:8.1f} us (attention {figures['attention_us']:7.1f} us), "
              f"key-block steps {steps}", flush=True)  # fmt: skip
    print(f"{workload_id:<24} nodes vs flash: max |diff| {result['max_abs_diff']:.3e} (bound "
          f"{result['bound_vs_flash']:.3e}), bit-equal {result['bit_equal_share']:.4f}; row-blocks = nodes bit for "
          f"bit: {result['schedules_bit_equal']}", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    args = layer_probe_parser("measure.tree_attention_probe", __doc__).parse_args(argv)
    if not cuda_or_refuse("tree_attention_probe"):
        return 2
    import torch

    from ablations.envinfo import collect, record_stem, write_json

    env = collect("cuda")
    record = {"probe": "tree_attention", "env": env, "calls": args.calls, "rounds": args.rounds, "workloads": []}
    for workload_id in args.workloads.split(","):
        with torch.no_grad():
            record["workloads"].append(probe_workload(workload_id, args.calls, args.rounds))
    write_json(record, REPO / "results" / "tree-attention" / f"{record_stem(env)}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
