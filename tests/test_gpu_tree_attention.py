"""The tree attention kernel compiled on the GPU at the 27B attention widths (kernels/tree_attention.py; the CPU tests
are tests/test_tree_attention.py), both schedules: drone's and customer_service's bucketed plans against the fp32
blockwise reference within the kernel's bound, the two schedules bit-equal, and the bitwise prefix invariance (a node's
rows equal the same rows of its whole path run as one sequence) and batch invariance (a sequence alone equals it in
the batch).

    nox --no-venv -s gpu_tests -- tests/test_gpu_tree_attention.py -s

Synthetic projections: only bits and bounds are compared, never accuracy.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.tree import blockwise_node_core
from kernels.tree_attention import SCHEDULES, tree_attention
from reference.shapes import QWEN38_27B as S
from tests.cases import bucketed_attention_inputs

pytestmark = pytest.mark.gpu
SCALE = S.head_dim**-0.5


@pytest.mark.parametrize("workload", ["drone", "customer_service"])
def test_gpu_tree_attention_within_the_bound_27b(workload):
    """Both schedules within the bound of the fp32 reference on the real rows, and bit-equal in every element."""
    plan, layout, args, dims = bucketed_attention_inputs(workload, S, seed=41, device="cuda")
    nodes = plan.attention
    want = blockwise_node_core(*kernels.attn_prep(*args, key_rows=nodes.key_rows, **dims), nodes, SCALE)
    q, k, v = kernels.attn_prep(*args, **dims)
    bounds = (nodes.key_rows, nodes.cu_seqlens_q, nodes.cu_seqlens_k, nodes.max_q, SCALE)
    got = {s: tree_attention(q, k, v, *bounds, schedule=s, out=torch.full_like(q, float("nan"))) for s in SCHEDULES}
    real = slice(0, layout.rows)
    error = (got["nodes"][real].float() - want[real].float()).abs().max().item()
    bound = 3 * 2**-8 * v.float().abs().max().item()
    print(f"{workload}: max |diff| {error:.3e}, bound {bound:.3e}")
    assert torch.isfinite(got["nodes"][real]).all() and error <= bound
    assert torch.equal(got["nodes"].view(torch.int16), got["row-blocks"].view(torch.int16))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_tree_attention_prefix_and_batch_invariant_27b(schedule):
    """Every real node of drone's bucket: its rows bit-equal to the same rows of its whole path run as one sequence
    (tree vs flat), and to the node run alone (batch invariance)."""
    plan, layout, args, dims = bucketed_attention_inputs("drone", S, seed=42, device="cuda")
    nodes = plan.attention
    q, k, v = kernels.attn_prep(*args, **dims)
    bounds = (nodes.key_rows, nodes.cu_seqlens_q, nodes.cu_seqlens_k, nodes.max_q, SCALE)
    tree = tree_attention(q, k, v, *bounds, schedule=schedule)
    bounds_q, bounds_k = nodes.cu_seqlens_q_cpu.tolist(), nodes.cu_seqlens_k_cpu.tolist()
    checked = 0
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0 or q0 >= layout.rows:
            continue
        path = nodes.key_rows[k0:k1]
        whole = torch.tensor([0, k1 - k0], dtype=torch.int32, device="cuda")
        flat = tree_attention(q[path].contiguous(), k, v, path, whole, whole, k1 - k0, SCALE, schedule=schedule)
        assert torch.equal(tree[q0:q1], flat[k1 - k0 - (q1 - q0) :])
        alone_q = torch.tensor([0, q1 - q0], dtype=torch.int32, device="cuda")
        alone = tree_attention(q[q0:q1].contiguous(), k, v, path, alone_q, whole, q1 - q0, SCALE, schedule=schedule)
        assert torch.equal(tree[q0:q1], alone)
        checked += 1
    assert checked >= 2
