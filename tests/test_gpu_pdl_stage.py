"""Stage `pdl` on the GPU, 27B shapes: every Triton kernel of `core`'s forward as a programmatic dependent launch.

    nox --no-venv -s gpu_tests -- tests/test_gpu_pdl_stage.py -s

Declared and checked (engine/stages/pdl.md): bitwise against `core`, since a dependent launch changes when a kernel
starts, never what it computes, provided it reads nothing before `griddepcontrol.wait` (checked in the PTX by
`kernels.compile_check`). A kernel that read its predecessor's output early would read stale or half-written rows,
which shows as bits that differ from `core`'s or from one replay to the next:
* the gate: the head's rows of `pdl` equal `core`'s, bit for bit, on drone, customer_service, long-10k-choice-5 and the
  JevBench panel (each served from its bucket's CUDA graph, captured on first use);
* five replays of drone's graph identical, and equal to the stage's eager forward of the same bucketed plan.
Synthetic weights: only bits are compared, never accuracy.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from ablations.workloads import get_workload, jevbench_panel
from engine.stages import build_engine
from engine.weights import MergedWeights
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def engines():
    weights = synthetic_weights(S, seed=0, device="cuda")
    merged = MergedWeights.from_decision_weights(weights)
    del weights
    built = {name: build_engine(merged, name) for name in ("core", "pdl")}
    for engine in built.values():
        engine.graphs.capture_on_miss = True
    yield built
    del built, merged
    gc.collect()
    torch.cuda.empty_cache()


def answer(engine, workload: str) -> torch.Tensor:
    candidates, groups = request_candidates(get_workload(workload).request)
    return engine.forward(engine.prepare(candidates, groups)).clone()


@pytest.mark.parametrize(
    "workload", ["drone", "customer_service", "long-10k-choice-5"] + [w.id for w in jevbench_panel()]
)
def test_pdl_stage_matches_core_bitwise(engines, workload):
    """The stage's GPU gate: `pdl`'s head rows equal `core`'s, bit for bit."""
    got, want = answer(engines["pdl"], workload), answer(engines["core"], workload)
    differ = int((got != want).sum())
    print(f"{workload}: pdl vs core, {differ} of {want.numel()} elements differ")
    assert torch.isfinite(got).all() and torch.equal(got, want), (workload, differ)


def test_pdl_replays_are_identical_and_equal_its_eager_forward(engines):
    engine = engines["pdl"]
    candidates, groups = request_candidates(get_workload("drone").request)
    prepared = engine.prepare(candidates, groups)
    replays = [engine.forward(prepared).clone() for _ in range(5)]
    assert prepared.batches[0].graph_hit, "drone must be served by its bucket's graph"
    assert all(torch.equal(replay, replays[0]) for replay in replays[1:])
    batch = prepared.batches[0]
    on_device = dataclasses.replace(batch, plan=batch.plan.to(DEVICE))
    eager = engine._forward_batch(on_device, None)[: batch.plan.num_candidates]
    assert torch.equal(eager, replays[0][: batch.plan.num_candidates])
