"""Stage `graphs` on the GPU with the 27B shapes: CUDA-graph replay over bucketed plans against the eager `tree` stage.

    nox --no-venv -s gpu_tests -- tests/test_gpu_graphs.py -s

One `MergedWeights` (synthetic, seed 0) shared by a `tree` and a `graphs` engine; the graphs engine captures on a miss
here (the server and the runner capture the whole grid at start instead), so only the buckets the workloads need are
captured. Declared and checked, bit for bit:
* replay against the eager `tree` forward of the same request, on the ladder's workloads (those the grid holds are
  served by a graph: asserted; the others run eagerly and must still match);
* the padded plan run eagerly against the replay (capture changes nothing) and against the unpadded plan;
* two requests of one bucket replayed alternately through the same graph: each gets its own eager bits (no state
  leaks through the arena, the solve workspace or the shared pool);
* five replays of one request: identical;
* a dropped `graphs` engine (the tiny twin) is freed without the cycle collector (passed on an H100 at 6d8566e, and
  failed there with 83b70a4's graph cache, which held the forward strongly: results/gpu/20261205T1909Z-* and 1910Z-*);
* the arena hand-off: a bucketed plan is host-only (its arena on the CPU), a replay fills the captured arena from it
  through the pinned staging buffer; `TreePlan.to` gives the eager path the same arrays on the device; two
  requests of one bucket prepared before either runs (the second's host arrays must not reach the first's replay).
Every graph is captured on a placeholder request (one token, padded to the bucket), so every replay here serves a
request other than the one captured, whose real shape is smaller than its bucket.
Synthetic weights: the bits are what is compared; no probability here means anything for accuracy.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from ablations.workloads import get_workload, jevbench_panel
from engine.graphs import grid_bucket
from engine.plan import plan_tree, tree_layout
from engine.planner import EngineRows, RowBatch
from engine.stages import build_engine
from engine.weights import MergedWeights
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.shapes import TINY
from reference.weights import synthetic_weights

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
LADDER = ["drone", "customer_service", "context-128-choice-2", "context-512-choice-8", "long-10k-choice-5"]


def candidates_of(workload_id: str) -> tuple[list[list[int]], list[int]]:
    return request_candidates(get_workload(workload_id).request)


@pytest.fixture(scope="module")
def engines():
    weights = synthetic_weights(S, seed=0, device=DEVICE)
    merged = MergedWeights.from_decision_weights(weights)
    del weights
    tree, graphs = build_engine(merged, "tree"), build_engine(merged, "graphs")
    graphs.graphs.capture_on_miss = True
    yield tree, graphs
    del tree, graphs, merged
    gc.collect()
    torch.cuda.empty_cache()


def test_a_dropped_graphs_engine_is_freed_without_the_cycle_collector():
    """The tiny twin's `graphs` engine on CUDA (its backbone holds a `GraphCache`, which holds the backbone's forward
    weakly: `engine.graphs.weak_callable`) is freed by reference counting alone once dropped: no cycle keeps it and
    its weights waiting for the collector."""
    merged = MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=0, device=DEVICE))
    engine = build_engine(merged, "graphs")
    assert engine.graphs is not None
    alive = weakref.ref(engine)
    gc.collect()
    gc.disable()
    try:
        del engine
        assert alive() is None
    finally:
        gc.enable()


def eager_tree(tree, candidates, groups) -> torch.Tensor:
    return tree.forward(tree.prepare(candidates, groups)).clone()


@pytest.mark.parametrize("workload", LADDER + [w.id for w in jevbench_panel()])
def test_replay_matches_eager_on_the_ladder_workloads(engines, workload):
    tree, graphs = engines
    candidates, groups = candidates_of(workload)
    want = eager_tree(tree, candidates, groups)
    prepared = graphs.prepare(candidates, groups)
    got = graphs.forward(prepared)
    meta = graphs.graph_metadata(prepared)
    assert torch.equal(got, want), f"{workload}: graphs departs from tree ({meta})"
    for batch in prepared.batches:
        if batch.eager_reason is None:
            assert batch.graph_hit, f"{workload}: bucket {batch.plan.bucket.name} was not served by a graph"
            assert batch.plan.device.type == "cpu", "a bucketed plan is host-only on CUDA"
            on_device = dataclasses.replace(batch, plan=batch.plan.to(DEVICE))
            padded_eager = graphs._forward_batch(on_device, None)[: batch.plan.num_candidates]
            assert torch.equal(padded_eager, got[: batch.plan.num_candidates]), "replay departs from its eager run"
    if workload.startswith("jevbench/") or workload == "drone":
        assert meta["hit"], f"{workload} is within the grid and must be served by a graph: {meta}"


def test_two_requests_alternate_through_one_graph(engines):
    tree, graphs = engines
    first, second = candidates_of("jevbench/easy-intent-00"), candidates_of("jevbench/easy-intent-01")
    a, b = graphs.prepare(*first), graphs.prepare(*second)
    assert a.batches[0].plan.shape == b.batches[0].plan.shape, "the two requests were chosen to share a bucket"
    want_a, want_b = eager_tree(tree, *first), eager_tree(tree, *second)
    for _ in range(2):
        assert torch.equal(graphs.forward(a), want_a)
        assert torch.equal(graphs.forward(b), want_b)
    assert a.batches[0].graph_hit and b.batches[0].graph_hit


def test_five_replays_are_identical(engines):
    _, graphs = engines
    prepared = graphs.prepare(*candidates_of("drone"))
    outs = [graphs.forward(prepared) for _ in range(5)]
    assert prepared.batches[0].graph_hit
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_a_host_plan_moved_to_the_device_keeps_every_array(engines):
    _, graphs = engines
    plan = graphs.prepare(*candidates_of("jevbench/easy-fact-00")).batches[0].plan
    moved = plan.to(DEVICE)
    assert moved.arena.buffer.device.type == "cuda" and torch.equal(moved.arena.buffer.cpu(), plan.arena.buffer)
    assert all(torch.equal(moved.arena.int32[n].cpu(), t) for n, t in plan.arena.int32.items())
    assert torch.equal(moved.token_ids.cpu(), plan.token_ids) and moved.token_ids.data_ptr() != 0
    call, host_call = moved.gdn["replicated"].calls[0], plan.gdn["replicated"].calls[0]
    assert call.chunk_indices.is_cuda and torch.equal(call.chunk_indices.cpu(), host_call.chunk_indices)
    assert moved.attention.cu_seqlens_q.is_cuda and moved.conv_paths.spaced.is_cuda


def test_a_smaller_request_in_a_larger_bucket_gives_its_unpadded_bits(engines):
    """A bucket chosen larger than the request needs (the largest candidate class of its rows size): the replay gives
    the request's unpadded eager bits."""
    tree, graphs = engines
    candidates, groups = candidates_of("jevbench/easy-fact-00")
    layout = tree_layout(candidates, groups)
    large = grid_bucket(128, 5)  # 8 candidates, 5x slots: far more than one 90-row candidate needs
    assert large in graphs.graphs.grid and graphs.grid.smallest(layout) != large
    plan = plan_tree(candidates, groups, bucket=large, layout=layout)
    batch = RowBatch(plan, tuple(range(len(candidates))), "replicated", None)
    got = graphs.forward(EngineRows([batch], len(candidates), None))
    assert batch.graph_hit
    assert torch.equal(got, eager_tree(tree, candidates, groups))


def test_requests_prepared_before_either_runs_keep_their_own_arrays(engines):
    tree, graphs = engines
    first, second = candidates_of("jevbench/easy-intent-00"), candidates_of("jevbench/easy-intent-01")
    a, b = graphs.prepare(*first), graphs.prepare(*second)
    got_b, got_a = graphs.forward(b).clone(), graphs.forward(a).clone()
    assert torch.equal(got_a, eager_tree(tree, *first)) and torch.equal(got_b, eager_tree(tree, *second))
