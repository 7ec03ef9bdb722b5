"""CPU tests of stage `core` (`EngineConfig.gdn_core="chunk_fused"`, kernels/gdn_chunk.py; its FlashAttention-4
attention, `attention="varlen_fa4"`, runs the blockwise core on the CPU as `graphs`' FlashAttention-2 does) on the
tiny twin's first four layers, every kernel under the Triton interpreter: the gate (close to `graphs` within the
registry's bound), tree vs flat within the stage, the `handoff` schedule vs the `replicated` one, and the bucketed
(`graphs`) forward vs the unpadded one, each bit for bit. Synthetic weights: the figures are fidelity between code
paths, never accuracy.

On the CPU `graphs` runs HF's torch chunk rule (fp32 throughout, q/k normalised in fp32) where `core` runs the kernel
with FLA's bf16 rounding points: the same kind of GDN-core-only swap as hf_torch against hf_fla, the swap whose H200
figure is the registry's bound (engine/stages/core.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py)

from ablations.plans import load_plan  # noqa: E402
from engine.planner import EngineRows  # noqa: E402
from engine.stages import STAGES, build_engine, config_of, get_stage  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from reference.shapes import TINY  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CPU tests (the GPU gate is tests/test_gpu_gdn_chunk.py)", allow_module_level=True)


# The tiny twin's first four layers (three GDN, one attention): every kind of layer the stage changes, at half the
# interpreter's time of eight (the four forward-pair tests below took 187 s of the CPU suite's 555 with eight).
TINY_FOUR_LAYERS = dataclasses.replace(TINY, name="tiny-4-layers", num_layers=4)


@pytest.fixture(scope="module")
def merged_weights() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY_FOUR_LAYERS, seed=23))


class Forwards:
    """One request through each engine the tests compare, every forward run once for the module (the tests share
    them: tests/conftest.py keeps this module's tests on one pytest-xdist worker). The request: a shared root of 70
    tokens (past the first 64-row chunk boundary, so the tree walk publishes a state and the hand-off splits the root),
    two questions of 2 and 3 options (odd lengths)."""

    def __init__(self, weights: MergedWeights):
        rng = random.Random(1)
        root = [rng.randrange(100, 150_000) for _ in range(70)]
        self.candidates = [root + [q + 1] + [rng.randrange(100, 150_000) for _ in range(2 + q * 5)] + [o + 1]
                           for q, options in enumerate((2, 3)) for o in range(options)]  # fmt: skip
        self.groups = [0, 0, 1, 1, 1]
        self.weights, self.runs = weights, {}

    def __call__(self, stage: str, **options) -> tuple[EngineRows, torch.Tensor]:
        """(the prepared request, the forward's output) of `build_engine(weights, stage, **options)`."""
        key = (stage, *sorted(options.items()))
        if key not in self.runs:
            engine = build_engine(self.weights, stage, **options)
            prepared = engine.prepare(self.candidates, self.groups)
            self.runs[key] = prepared, engine.forward(prepared)
        return self.runs[key]


@pytest.fixture(scope="module")
def forwards(merged_weights) -> Forwards:
    return Forwards(merged_weights)


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt(float((x.double() - ref.double()).square().sum()) / float(ref.double().square().sum()))


def test_core_stage_is_registered_kept_on_gemm():
    stage = get_stage("core")
    delta = {"gdn_core": "chunk_fused", "attention": "varlen_fa4"}
    assert (stage.builds_on, stage.delta, stage.status) == ("gemm", delta, "kept")
    assert stage.exactness.describe() == "bounded: hidden_rel_rmse <= 0.031 vs graphs"
    assert config_of("core") == config_of("gemm").replace(**delta)
    assert config_of("core").on("cpu") == config_of("core")  # the kernel runs in the interpreter as it is
    assert stage.notes.is_file() and "core" in STAGES
    assert load_plan("gpu-27b").stages[-1] == "core" and "core" not in load_plan("cpu-tiny").stages


# The slow tests below share six forwards of four layers (`Forwards`: 20-30 s each under the interpreter on the 2-core
# CPU). UNPADDED: `core` without buckets, on the replicated schedule that the bucketed plan runs.
UNPADDED = {"graphs": False, "gdn_mode": "replicated"}


@pytest.mark.slow
def test_core_stage_close_to_graphs(forwards):
    """The stage's CPU gate: `core` against `graphs` on one request, candidate outputs within the registry's bound
    (the runner's hidden_rel_rmse: the head's input rows), every residual state finite."""
    (prepared, out), (_, ref) = forwards("core"), forwards("graphs")
    assert prepared.batches[0].plan.bucket is not None  # a bucketed plan, as `graphs` runs it
    error = rel_rmse(out, ref)
    print(f"core vs graphs: hidden_rel_rmse {error:.3e} (bound {get_stage('core').exactness.bound})")
    assert torch.isfinite(out).all() and error <= get_stage("core").exactness.bound


@pytest.mark.slow
def test_core_tree_matches_flat_bitwise(forwards):
    """Tree vs flat within the stage (graphs off: the flat layout has no buckets): the kernel is prefix-invariant, so
    the shared rows computed once (the root's first chunk by one program, its state handed to the others by the
    tree walk) give each candidate the bits of its unshared run."""
    (tree_prepared, tree), (flat_prepared, flat) = (
        forwards("core", **UNPADDED),
        forwards("core", **UNPADDED, layout="flat"),
    )
    assert tree_prepared.batches[0].plan.kind != "flat" and flat_prepared.batches[0].plan.kind == "flat"
    assert torch.equal(tree, flat)


@pytest.mark.slow
def test_core_handoff_matches_replicated_bitwise(forwards):
    """The `handoff` schedule (root once to its last 64-row boundary, fp32 state handed to the branches, through the
    same kernel) gives the `replicated` schedule's bits: the kernel's split at a multiple of 64 is exact."""
    (prepared, handoff), (_, replicated) = (
        forwards("core", graphs=False, gdn_mode="handoff"),
        forwards("core", **UNPADDED),
    )
    assert prepared.batches[0].gdn_mode == "handoff" and len(prepared.batches[0].plan.gdn["handoff"].calls) == 2
    assert torch.equal(handoff, replicated)


@pytest.mark.slow
def test_core_bucketed_forward_matches_unpadded_bitwise(forwards):
    """The bucketed plan (`graphs`: dummy rows, dummy and empty paths, trailing slots) gives the unpadded plan's bits:
    padding sequences of the kernel's launch change no real row (graph replay = eager on the GPU rests on it)."""
    (prepared, bucketed), (_, unpadded) = forwards("core"), forwards("core", **UNPADDED)
    plan = prepared.batches[0].plan
    assert plan.bucket is not None and plan.token_rows < plan.num_rows and plan.bucket.sequences > len(forwards.groups)
    assert torch.equal(bucketed, unpadded)


def test_paged_stage_is_registered_unmeasured_on_core():
    stage = get_stage("paged")
    assert (stage.builds_on, stage.delta, stage.status) == ("core", {"attention": "paged_fa4"}, "unmeasured")
    assert stage.exactness.describe() == "bitwise vs core"
    assert config_of("paged") == config_of("core").replace(attention="paged_fa4") and stage.notes.is_file()
    assert "paged" not in load_plan("gpu-27b").stages


@pytest.mark.slow
def test_paged_stage_matches_core_bitwise(forwards):
    """The stage's CPU gate: `paged` (attn_prep's k and v at the packed rows, the key rows gathered for the blockwise
    core) gives `core`'s bits (k and v prepared straight into the key layout) on a bucketed request: the prep writes a
    key row's values at its packed row bit for bit, whichever layout it writes."""
    (prepared, out), (_, want) = forwards("paged"), forwards("core")
    assert prepared.batches[0].plan.bucket is not None and not prepared.batches[0].plan.attention.keys_are_rows
    assert torch.isfinite(out).all() and torch.equal(out, want)


def test_flashinfer_gdn_stage_is_registered_unmeasured_on_core():
    stage = get_stage("flashinfer_gdn")
    assert (stage.builds_on, stage.delta, stage.status) == ("core", {"gdn_core": "flashinfer"}, "unmeasured")
    assert stage.exactness.describe() == get_stage("core").exactness.describe() and stage.notes.is_file()
    assert config_of("flashinfer_gdn").on("cpu") == config_of("flashinfer_gdn")  # the library's contract as reference
    assert "flashinfer_gdn" not in load_plan("gpu-27b").stages


@pytest.mark.slow
def test_flashinfer_gdn_stage_close_to_graphs(forwards):
    """The stage's CPU gate: its CPU form (FlashInfer's kernel needs sm_90, so `kernels.gdn_flashinfer.
    flashinfer_reference`, the library's contract computed by the fp32 oracle, stands in for it, through the same
    hand-off arena and two calls) against `graphs` within the registry's bound, every output finite. The kernel's own
    bound is checked on the GPU (tests/test_gpu_gdn_flashinfer.py)."""
    (prepared, out), (_, ref) = forwards("flashinfer_gdn"), forwards("graphs")
    assert prepared.batches[0].plan.bucket is not None and prepared.batches[0].gdn_mode == "replicated"
    error = rel_rmse(out, ref)
    assert torch.isfinite(out).all() and error <= get_stage("flashinfer_gdn").exactness.bound, error


@pytest.mark.slow
def test_flashinfer_gdn_bucketed_tree_matches_flat_bitwise(forwards):
    """The hand-off arena on the bucketed tree (root of 70 rows: its first 64 once, its state to every candidate;
    dummy rows and paths) gives the flat layout's bits (every candidate alone from position 0, no buckets): the
    reference hands a state over exactly, so this checks the arena's rows, bounds, pool rows and output slots through
    the whole forward. On the GPU the same comparison checks the kernel's hand-off (tests/test_gpu_gdn_flashinfer.py).
    """
    (prepared, tree), (flat_prepared, flat) = (
        forwards("flashinfer_gdn"),
        forwards("flashinfer_gdn", **UNPADDED, layout="flat"),
    )
    arena = prepared.batches[0].plan.gdn["replicated"].calls[0].arena
    assert int(arena.cu_seqlens[1]) == 64 and flat_prepared.batches[0].plan.kind == "flat"
    assert torch.equal(tree, flat)
