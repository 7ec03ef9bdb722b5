"""Cross-request batching on the GPU with the 27B shapes: requests answered by one forward against each alone.

    nox --no-venv -s gpu_tests -- tests/test_gpu_batching.py -s

One `MergedWeights` (synthetic, seed 0) behind a `tree`, a `graphs`, a `core` and a `paged` `DecisionModel` (the process
prepared as the runner prepares it: row-count-invariant cuBLAS, tests/conftest.py). The JevBench panel (the first task
of each family of each tier) is answered alone, request by request, and then in consecutive batches of 2, 4 and 8
through `answer_many`: every response must equal its alone response, bit for bit on every probability, timing and the
forward-describing metadata (`prefix_cache`, `graph`, `batch`) aside. On `graphs` the batches are padded to larger
buckets than the requests alone and replayed through captured graphs (captured on a miss here); `core` adds its own
GDN kernels and FlashAttention-4 to that, `paged` FlashAttention-4 reading k and v at the packed rows through a page
table. The CPU twin of this test is tests/test_batching.py; the server's worker is tested in
tests/test_server_batching.py.
Synthetic weights: the bits are what is compared; no probability here means anything for accuracy.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from ablations.workloads import jevbench_panel
from engine.stages import build_engine
from engine.weights import MergedWeights
from reference.service import DecisionModel
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
FORWARD_DESCRIBING = ("inference_seconds", "prefix_cache", "graph", "batch")


@pytest.fixture(scope="module")
def models():
    weights = synthetic_weights(S, seed=0, device=DEVICE)
    merged = MergedWeights.from_decision_weights(weights)
    tree, graphs, core, paged = (build_engine(merged, name) for name in ("tree", "graphs", "core", "paged"))
    graphs.graphs.capture_on_miss = core.graphs.capture_on_miss = paged.graphs.capture_on_miss = True
    yield {
        name: DecisionModel(engine, weights, code_commit="test")
        for name, engine in (("tree", tree), ("graphs", graphs), ("core", core), ("paged", paged))
    }
    del tree, graphs, core, paged, merged, weights
    gc.collect()
    torch.cuda.empty_cache()


def own_part(response: dict) -> dict:
    out = copy.deepcopy(response)
    for key in FORWARD_DESCRIBING:
        out["metadata"].pop(key, None)
    return out


@pytest.mark.parametrize("stage", ["tree", "graphs", "core", "paged"])
@pytest.mark.parametrize("batch_size", [2, 4, 8])
def test_batched_answers_equal_answers_alone_on_the_jevbench_panel(models, stage, batch_size):
    model = models[stage]
    assert model.batch_invariant
    compiled = [model.compile(workload.request) for workload in jevbench_panel()]
    alone = [model.answer_many([one])[0] for one in compiled]
    assert not any(isinstance(result, BaseException) for result in alone), alone
    for start in range(0, len(compiled), batch_size):
        batch = compiled[start : start + batch_size]
        results = model.answer_many(batch)
        for offset, result in enumerate(results):
            assert not isinstance(result, BaseException), result
            assert own_part(result) == own_part(alone[start + offset]), (stage, start + offset)
            if len(batch) > 1:
                assert result["metadata"]["batch"]["requests"] == len(batch)
