"""CPU tests of the tree attention kernel (`kernels/tree_attention.py`, Triton interpreter): against the fp32 blockwise
reference `engine.tree.blockwise_node_core` within the derived bound, and its bitwise prefix and batch invariance.

Inputs: fresh seeded random bf16 q, k, v (never zeros) at odd sizes, GQA 4 -> 2 heads, D = 48 (a masked head
width); a tree of packed rows: a 150-row root, children of 40, 7 and 1 rows, a grandchild of 29 under the 40; every
node one sequence whose keys are its path (read through `key_rows`, k and v once per packed row); outputs
NaN-poisoned; and drone's bucketed plan (`plan.attention`) at the tiny twin's widths. The bound
|Δo| <= 3 · 2^-8 · max |v| is the kernel docstring's (bf16's unit roundoff for one rounding of each softmax weight in
P·V and for the output's rounding here and in the reference), not fitted; measured 2^-6 (one bf16 ulp of an output in
[2, 4)).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py)

import triton  # noqa: E402

from engine.tree import blockwise_causal_attention  # noqa: E402
from kernels import tree_attention as module  # noqa: E402
from kernels.tree_attention import SCHEDULES, tree_attention  # noqa: E402
from reference.shapes import TINY  # noqa: E402
from tests.cases import bucketed_attention_inputs  # noqa: E402

if isinstance(module._tree_attention_kernel, triton.runtime.JITFunction):
    pytest.skip("kernels were compiled, not interpreted (TRITON_INTERPRET=1 unset)", allow_module_level=True)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 48
SCALE = HEAD_DIM**-0.5
NODES = {"root": (0, 150, None), "a": (150, 190, "root"), "b": (190, 197, "root"), "c": (197, 198, "root"),
         "d": (198, 227, "a")}  # fmt: skip  # name -> (first row, end row, parent)
ROWS = 227


def path_rows(name: str) -> list[int]:
    first, end, parent = NODES[name]
    return (path_rows(parent) if parent else []) + list(range(first, end))


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(ROWS, HEADS, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(ROWS, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(ROWS, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    return q, k, v


def layout(names: list[str]):
    """Node sequences in packed order: (key_rows, cu_seqlens_q, cu_seqlens_k, max_q) with queries the node's rows."""
    key_rows, cu_q, cu_k = [], [0], [0]
    for name in names:
        first, end, _ = NODES[name]
        key_rows += path_rows(name)
        cu_q.append(cu_q[-1] + end - first)
        cu_k.append(len(key_rows))
    max_q = max(NODES[n][1] - NODES[n][0] for n in names)
    return torch.tensor(key_rows), torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max_q


def poisoned(rows: int) -> torch.Tensor:
    return torch.full((rows, HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_within_the_bound_of_the_blockwise_reference(schedule):
    q, k, v = inputs(seed=1)
    names = list(NODES)
    key_rows, cu_q, cu_k, max_q = layout(names)
    got = tree_attention(q, k, v, key_rows, cu_q, cu_k, max_q, SCALE, schedule=schedule, out=poisoned(ROWS))
    want = blockwise_causal_attention(q, k[key_rows], v[key_rows], cu_q.long(), SCALE, cu_seqlens_k_cpu=cu_k.long())
    assert torch.isfinite(got).all()
    error = (got.float() - want.float()).abs().max().item()
    bound = 3 * 2**-8 * v.float().abs().max().item()
    assert 0 < error <= bound, (error, bound)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_node_equals_its_rows_of_the_whole_path(schedule):
    """Prefix invariance (tree vs flat): node d's rows (keys: its 219-row path) are bit-equal to the last 29 rows of
    the same path run as one sequence of 219 queries, and node c's one row to the last row of its path's run."""
    q, k, v = inputs(seed=2)
    key_rows, cu_q, cu_k, max_q = layout(list(NODES))
    tree = tree_attention(q, k, v, key_rows, cu_q, cu_k, max_q, SCALE, schedule=schedule, out=poisoned(ROWS))
    for name in ("d", "c"):
        path = torch.tensor(path_rows(name))
        cu = torch.tensor([0, len(path)], dtype=torch.int32)
        flat = tree_attention(q[path].contiguous(), k, v, path, cu, cu, len(path), SCALE, out=poisoned(len(path)))
        first, end, _ = NODES[name]
        assert torch.equal(tree[first:end], flat[len(path) - (end - first) :])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_sequence_alone_equals_it_in_a_batch(schedule):
    """Batch invariance: node d alone (one sequence, its own query blocks) and inside the whole tree's launch."""
    q, k, v = inputs(seed=3)
    key_rows, cu_q, cu_k, max_q = layout(list(NODES))
    batch = tree_attention(q, k, v, key_rows, cu_q, cu_k, max_q, SCALE, schedule=schedule, out=poisoned(ROWS))
    first, end, _ = NODES["d"]
    alone_rows, alone_q, alone_k, alone_max = layout(["d"])
    alone = tree_attention(q[first:end].contiguous(), k, v, alone_rows, alone_q, alone_k, alone_max, SCALE)
    assert torch.equal(batch[first:end], alone)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rows_outside_every_sequence_are_not_written(schedule):
    q, k, v = inputs(seed=4)
    key_rows, cu_q, cu_k, max_q = layout(["root", "a"])
    out = tree_attention(q, k, v, key_rows, cu_q, cu_k, max_q, SCALE, schedule=schedule, out=poisoned(ROWS))
    assert torch.isfinite(out[:190]).all() and torch.isnan(out[190:]).all()


def test_bad_inputs_are_refused():
    q, k, v = inputs(seed=5)
    key_rows, cu_q, cu_k, max_q = layout(["root"])
    with pytest.raises(ValueError, match="must divide"):
        tree_attention(q[:, :3].contiguous(), k, v, key_rows, cu_q, cu_k, max_q, SCALE)
    with pytest.raises(ValueError, match="k: dtype"):
        tree_attention(q, k.float(), v, key_rows, cu_q, cu_k, max_q, SCALE)
    with pytest.raises(ValueError, match="cu_seqlens_k: dtype"):
        tree_attention(q, k, v, key_rows, cu_q, cu_k.long(), max_q, SCALE)
    with pytest.raises(ValueError, match=r"both be \[S \+ 1\]"):
        tree_attention(q, k, v, key_rows, cu_q, cu_k[:1], max_q, SCALE)
    with pytest.raises(ValueError, match="schedule 'cascade'"):
        tree_attention(q, k, v, key_rows, cu_q, cu_k, max_q, SCALE, schedule="cascade")


def test_a_bucketed_plan_within_the_bound():
    """The layout stage `core` runs: drone's bucketed plan (`plan.attention`, dummy nodes included), the tiny twin's
    attention widths, k and v prepared once per packed row by `kernels.attn_prep`: within the bound of the blockwise
    reference over the key layout (`attn_prep` with the key rows) on the real rows."""
    import kernels
    from engine.tree import blockwise_node_core

    plan, layout, args, dims = bucketed_attention_inputs("drone", TINY, seed=6)
    nodes, scale = plan.attention, TINY.head_dim**-0.5
    want = blockwise_node_core(*kernels.attn_prep(*args, key_rows=nodes.key_rows, **dims), nodes, scale)
    q, k, v = kernels.attn_prep(*args, **dims)
    out = torch.full_like(q, float("nan"))
    got = tree_attention(q, k, v, nodes.key_rows, nodes.cu_seqlens_q, nodes.cu_seqlens_k, nodes.max_q, scale, out=out)
    real = slice(0, layout.rows)
    assert torch.isfinite(got[real]).all()
    error = (got[real].float() - want[real].float()).abs().max().item()
    assert 0 < error <= 3 * 2**-8 * v.float().abs().max().item()


@pytest.mark.parametrize("workload", ["drone", "customer_service"])
def test_row_blocks_give_the_nodes_bits_on_a_bucketed_plan(workload):
    """Schedule "row-blocks" (programs over consecutive query rows, a shared prefix's key blocks attended once for the
    rows of several nodes) against schedule "nodes" on the workload's bucketed plan at the tiny twin's head width (two
    query heads on one kv head): every element of the output bit-equal (NaN-poisoned alike)."""
    import kernels

    plan, _, args, dims = bucketed_attention_inputs(workload, TINY, seed=7)
    nodes, scale = plan.attention, TINY.head_dim**-0.5
    q, k, v = kernels.attn_prep(*args, **dims)
    q, k, v = q[:, :2].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous()  # two heads: interpreter time
    bounds = (nodes.key_rows, nodes.cu_seqlens_q, nodes.cu_seqlens_k, nodes.max_q, scale)
    by_nodes = tree_attention(q, k, v, *bounds, out=torch.full_like(q, float("nan")))
    by_rows = tree_attention(q, k, v, *bounds, schedule="row-blocks", out=torch.full_like(q, float("nan")))
    assert torch.equal(by_nodes.view(torch.int16), by_rows.view(torch.int16))


def test_key_block_steps_of_the_bucketed_plans():
    """The step counts the kernel docstring and engine/stages/core.md quote (`measure.tree_attention_probe`'s host
    count of 64-row x 64-key dot pairs): nodes -> row-blocks on the buckets `graphs` replays."""
    from measure.gdn_chunk_probe import bucketed_plan
    from measure.tree_attention_probe import key_block_steps

    expected = {"drone": (33, 32), "customer_service": (268, 145), "context-512-choice-8": (162, 95),
                "jevbench/easy-intent-00": (12, 17)}  # fmt: skip
    for workload, steps in expected.items():
        nodes = bucketed_plan(workload)[0].attention
        assert (key_block_steps(nodes, "nodes"), key_block_steps(nodes, "row-blocks")) == steps, workload
