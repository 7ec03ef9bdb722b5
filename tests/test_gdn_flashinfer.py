"""The FlashInfer GDN core on the CPU (kernels/gdn_flashinfer.py). FlashInfer's kernel needs sm_90, so the module's
naive reference (`flashinfer_reference`: the library's documented contract, computed by the fp32 oracle token by
token) stands in for it, and the tests check what the lab builds around it against the oracle itself:
* the adapter, called as FLA's core is (states [N, Hv, K, V], log decay, bf16 beta), gives the oracle's outputs and
  final states. A transpose left out, a head grouping other than FLA's or the decay passed in the wrong domain moves the
  outputs by their own size; the only difference allowed is the rounding of log(exp(g)) in fp32;
* the hand-off arena (`FlashInferCore.arena` over a plan's `GdnArena`): each candidate's rows equal the oracle over its
  whole path from position 0, on a tree and a bucketed plan, and equal the flat plan's bit for bit (the reference hands
  a state over exactly, so any misplaced row, bound or pool row shows as a difference).
The reference against the kernel and the kernel's own bounds are checked on the GPU (tests/test_gpu_gdn_flashinfer.py).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.graphs import default_grid, smallest_bucket
from engine.plan import plan_flat, plan_tree, tree_layout
from kernels.gdn_flashinfer import FLASHINFER, FlashInferCore
from reference import ops
from tests.cases import gdn_chunk_inputs, gdn_chunk_oracle

LENGTHS = (37, 1, 70, 129)  # odd lengths, one row, across 64-row chunk edges
DIMS = (2, 6, 16, 16)  # Hk, Hv, K, V: three value heads a key head, as 16 and 48 in the 27B


def test_adapter_gives_the_oracle_through_the_library_contract():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=5)
    core = FlashInferCore(device="cpu")
    o, final = core(*(t[None].contiguous() for t in (q, k, v, g, beta)), cu_seqlens=cu, initial_state=h0,
                    output_final_state=True, chunk_indices=None, workspace=None)  # fmt: skip
    ref_o, ref_final = gdn_chunk_oracle(q, k, v, g, beta, cu, h0)
    assert o.shape == (1, *v.shape) and o.dtype == torch.bfloat16 and final.shape == h0.shape
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-5)


def test_adapter_without_states_returns_none():
    q, k, v, g, beta, cu, _ = gdn_chunk_inputs(LENGTHS, DIMS, seed=6)
    o, final = FlashInferCore(device="cpu")(*(t[None].contiguous() for t in (q, k, v, g, beta)),
                                                             cu_seqlens=cu)  # fmt: skip
    ref_o, _ = gdn_chunk_oracle(q, k, v, g, beta, cu, torch.zeros(len(LENGTHS), *DIMS[1:2], *DIMS[2:]))
    assert final is None
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_adapter_with_initial_states_and_no_final_state_leaves_them_alone():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=8)
    before = h0.clone()
    o, final = FlashInferCore(device="cpu")(*(t[None].contiguous() for t in (q, k, v, g, beta)),
                                                             cu_seqlens=cu, initial_state=h0)  # fmt: skip
    ref_o, _ = gdn_chunk_oracle(q, k, v, g, beta, cu, h0)
    assert final is None and torch.equal(h0, before)
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_adapter_refuses_bad_input():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=7)
    core = FlashInferCore(device="cpu")
    packed = [t[None].contiguous() for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="q must be contiguous"):
        core(q, *packed[1:], cu_seqlens=cu)  # no batch dim
    with pytest.raises(ValueError, match="3 initial states for 4 sequences"):
        core(*packed, cu_seqlens=cu, initial_state=h0[:3])


def test_missing_library_names_the_package():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=FLASHINFER.replace(".", r"\.")):
            FlashInferCore()
    else:
        pytest.skip("flashinfer is installed here")


def arena_request(seed: int) -> tuple[list[list[int]], list[int]]:
    """A root of 70 tokens (A0 = 64 splits it), two questions of 2 and 3 options of odd lengths."""
    rng = random.Random(seed)
    root = [rng.randrange(100, 150_000) for _ in range(70)]
    candidates = [root + [r + 1] * (3 + 4 * r) + [rng.randrange(100, 150_000) for _ in range(1 + 5 * o)]
                  for r, options in enumerate((2, 3)) for o in range(options)]  # fmt: skip
    return candidates, [0, 0, 1, 1, 1]


def arena_output(plan, inputs) -> torch.Tensor:
    """FlashInferCore.arena on the plan's packed-row inputs: each packed row's output [N, Hv, V] (bf16)."""
    arena = plan.gdn["replicated"].calls[0].arena
    o = FlashInferCore(device="cpu").arena(*inputs, arena)
    assert o.shape == (len(arena.rows), *inputs[2].shape[1:]) and o.dtype == torch.bfloat16
    return o[arena.out_slots]


@pytest.mark.parametrize("bucketed", [False, True], ids=["tree", "bucketed"])
def test_arena_gives_each_candidate_its_whole_path(bucketed):
    """Every packed row through the arena (root to A0 once, every candidate from its state) against the oracle over
    its representative path from position 0, and the real rows against the flat plan's (every candidate alone, from
    position 0) bit for bit. Inputs: random per packed row; the flat plan's are the tree's at each real path slot."""
    candidates, groups = arena_request(seed=11)
    bucket = smallest_bucket(tree_layout(candidates, groups), default_grid()) if bucketed else None
    tree = plan_tree(candidates, groups, bucket=bucket)
    arena = tree.gdn["replicated"].calls[0].arena
    assert int(arena.cu_seqlens[1]) == 64 and (arena.states[2:7] == 0).all()  # the root's state to the candidates
    q, k, v, g, beta, _, _ = gdn_chunk_inputs([tree.num_rows], DIMS, seed=12)
    got = arena_output(tree, (q, k, v, g, beta))
    path_cu, path_rows = tree.path_cu_seqlens_cpu.tolist(), tree.path_rows
    by_slot = torch.full((len(path_rows), *v.shape[1:]), float("nan"))
    for start, end in zip(path_cu[:-1], path_cu[1:]):  # every path from position 0, dummy paths included
        rows = path_rows[start:end]
        by_slot[start:end] = ops.gdn_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows])[0]
    want = by_slot[tree.row_slot]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2**-7, atol=1e-5)

    real = path_rows[: sum(len(c) for c in candidates)]  # the flat plan's packed rows: the candidates back to back
    flat = plan_flat(candidates, groups)
    assert flat.num_rows == len(real)
    assert torch.equal(arena_output(flat, tuple(t[real] for t in (q, k, v, g, beta))), got[real])


def test_arena_refuses_bad_input():
    candidates, groups = arena_request(seed=13)
    plan = plan_tree(candidates, groups)
    arena = plan.gdn["replicated"].calls[0].arena
    q, k, v, g, beta, _, _ = gdn_chunk_inputs([plan.num_rows], DIMS, seed=14)
    core = FlashInferCore(device="cpu")
    with pytest.raises(ValueError, match="L2-normalised"):
        core.arena(q, k, v, g, beta, arena, use_qk_l2norm_in_kernel=True)
    with pytest.raises(ValueError, match="state rows for"):
        core.arena(q, k, v, g, beta, dataclasses.replace(arena, states=arena.states[:-1]))
