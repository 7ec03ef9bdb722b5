"""CPU tests of the memset hoist (engine/graph_memsets.py): which edges `memset_moves` removes and adds on made-up
graphs; the hoist itself runs on the GPU (measure.gemm_gap_probe's `table-hoisted`, bitwise against `table`, and every
GPU test that replays an engine graph)."""

from __future__ import annotations

from engine.graph_memsets import KERNEL, MEMSET, memset_moves

NAMES = {
    1: "nvjet_sm90_tst_128x120_64x6_4x1_v_bz_TNT",
    2: "_residual_rmsnorm_kernel",
    4: "nvjet_gate_up",
    5: "_silu_mul_kernel",
}


def moves(edges, kinds, names=NAMES):
    nodes = sorted({n for edge in edges for n in edge})
    return memset_moves(nodes, edges, lambda n: kinds.get(n, KERNEL), names.get)


def test_a_memset_after_a_lab_kernel_moves_beside_it():
    """out GEMM 1 -> norm 2 -> memset 3 -> gate_up 4 -> silu_mul 5: the memset waits for the GEMM before the norm, runs
    beside the norm, and the gate_up GEMM waits for both."""
    removed, added = moves([(1, 2), (2, 3), (3, 4), (4, 5)], {3: MEMSET})
    assert removed == [(2, 3)]
    assert added == [(1, 3), (2, 4)]


def test_a_lab_kernel_at_the_root_leaves_the_memset_a_root():
    removed, added = moves([(2, 3), (3, 4)], {3: MEMSET})
    assert (removed, added) == ([(2, 3)], [(2, 4)])


def test_a_memset_after_a_library_kernel_or_an_unknown_name_stays():
    """After a GEMM (it may use the workspace the memset clears) or a kernel whose name cannot be read: no move."""
    assert moves([(1, 3), (3, 4)], {3: MEMSET}) == ([], [])
    assert moves([(1, 2), (2, 3), (3, 4)], {3: MEMSET}, names={}) == ([], [])


def test_only_a_memset_between_two_kernels_in_a_chain_moves():
    assert moves([(1, 2), (2, 3), (3, 4), (3, 5)], {3: MEMSET}) == ([], [])  # two successors
    assert moves([(1, 3), (2, 3), (3, 4)], {3: MEMSET}) == ([], [])  # two predecessors
    assert moves([(1, 2), (2, 3), (3, 4)], {3: MEMSET, 4: MEMSET}) == ([], [])  # a memset after it, not a kernel
    assert moves([(1, 2), (2, 3)], {3: MEMSET}) == ([], [])  # no successor


def test_every_memset_of_a_forward_moves_and_nothing_else():
    """Two layers' MLP halves: each memset before a gate_up moves; the kernels' own chain is untouched."""
    edges = [(1, 2), (2, 3), (3, 4), (4, 5), (5, 11), (11, 12), (12, 13), (13, 14)]
    kinds = {3: MEMSET, 13: MEMSET}
    names = NAMES | {11: "nvjet_down", 12: "_residual_rmsnorm_kernel", 14: "nvjet_gate_up"}
    removed, added = moves(edges, kinds, names)
    assert removed == [(2, 3), (12, 13)]
    assert added == [(1, 3), (2, 4), (11, 13), (12, 14)]
