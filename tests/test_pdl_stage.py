"""CPU tests of stage `pdl` (`EngineConfig.dependent_launch=True`): every Triton kernel of `core`'s forward launched as
a programmatic dependent launch (engine/stages/pdl.md).

The Triton interpreter has no dependent launch: it runs every launch as an ordinary one
(`kernels.numerics.dependent_options`), so on the CPU the stage's bits equal `core`'s by construction. What the CPU
can check is the rest of the claim: that the stage asks every kernel call of its forward for a dependent launch (and
`core` none), and (tests/test_kernels.py, `kernels.compile_check`) that each such kernel, compiled for sm_90 and the
Blackwell targets, waits (`griddepcontrol.wait`) before its first global memory access. The bitwise claim itself is
the GPU gate's: tests/test_gpu_pdl_stage.py. Synthetic weights: fidelity between code paths, never accuracy.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py)

import kernels  # noqa: E402
from engine.stages import build_engine, config_of, get_stage  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from kernels.numerics import dependent_options  # noqa: E402
from reference.shapes import TINY  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CPU tests (the GPU gate is tests/test_gpu_pdl_stage.py)", allow_module_level=True)

TINY_FOUR_LAYERS = dataclasses.replace(TINY, name="tiny-4-layers", num_layers=4)  # three GDN layers, one attention
# the kernel wrappers the engine's forward calls (`kernels.<name>`), and the GDN core's (`kernels.gdn_chunk`)
WRAPPERS = ("residual_rmsnorm", "residual_rmsnorm_splitk", "silu_mul", "gdn_prep", "gather_slots", "gated_rmsnorm",
            "attn_prep", "attention_gate")  # fmt: skip


def request(seed: int, root_len: int) -> tuple[list[list[int]], list[int]]:
    """A shared root of `root_len` tokens, two questions of 2 and 3 options (odd lengths)."""
    rng = random.Random(seed)
    root = [rng.randrange(100, 150_000) for _ in range(root_len)]
    candidates = [root + [q + 1] + [rng.randrange(100, 150_000) for _ in range(2 + q * 5)] + [o + 1]
                  for q, options in enumerate((2, 3)) for o in range(options)]  # fmt: skip
    return candidates, [0, 0, 1, 1, 1]


def test_pdl_stage_is_registered_unmeasured_on_core():
    stage = get_stage("pdl")
    assert (stage.builds_on, stage.delta, stage.status) == ("core", {"dependent_launch": True}, "unmeasured")
    assert stage.exactness.describe() == "bitwise vs core" and stage.notes.is_file()
    assert config_of("pdl") == config_of("core").replace(dependent_launch=True)
    assert config_of("pdl").on("cpu") == config_of("pdl")
    with pytest.raises(ValueError, match="dependent_launch=True"):
        config_of("merged", dependent_launch=True)  # the torch element-wise ops have no kernels to launch so
    with pytest.raises(ValueError, match="dependent_launch=True"):
        config_of("hf_torch", dependent_launch=True)


def test_dependent_options_are_ordinary_launches_in_the_interpreter():
    assert dependent_options(torch_cpu=False, dependent=True) == {"DEPENDENT": True, "launch_pdl": True}
    assert dependent_options(torch_cpu=True, dependent=True) == {"DEPENDENT": False}
    assert dependent_options(torch_cpu=False, dependent=False) == {"DEPENDENT": False}


@pytest.mark.slow  # two forwards of four layers under the interpreter: about 25 s on the 2-core CPU
def test_pdl_stage_matches_core_bitwise(monkeypatch):
    """The stage's CPU gate: on a bucketed plan (the plan `graphs` replays) `pdl` asks every kernel call of its forward
    for a dependent launch and `core` asks none, and the two forwards agree bit for bit (by construction under the
    interpreter: module docstring)."""
    calls: list[tuple[str, bool]] = []

    def recorded(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            calls.append((name, kwargs.get("dependent_launch", False)))
            return function(*args, **kwargs)

        return call

    for name in WRAPPERS:
        monkeypatch.setattr(kernels, name, recorded(name, getattr(kernels, name)))
    gdn_chunk = importlib.import_module("kernels.gdn_chunk")
    monkeypatch.setattr(gdn_chunk, "gdn_chunk_forward", recorded("gdn_chunk_forward", gdn_chunk.gdn_chunk_forward))

    merged = MergedWeights.from_decision_weights(synthetic_weights(TINY_FOUR_LAYERS, seed=29))
    candidates, groups = request(5, root_len=70)
    outputs, asked = {}, {}
    for name in ("core", "pdl"):
        engine = build_engine(merged, name)
        prepared = engine.prepare(candidates, groups)
        assert prepared.batches[0].plan.bucket is not None
        calls.clear()
        outputs[name] = engine.forward(prepared)
        asked[name] = list(calls)
    kinds = {name for name, _ in asked["pdl"]}
    assert {"residual_rmsnorm", "silu_mul", "gdn_prep", "gated_rmsnorm", "attn_prep", "attention_gate",
            "gdn_chunk_forward"} <= kinds  # fmt: skip
    assert all(dependent for _, dependent in asked["pdl"]), asked["pdl"]
    assert not any(dependent for _, dependent in asked["core"]), asked["core"]
    assert [name for name, _ in asked["pdl"]] == [name for name, _ in asked["core"]]
    assert torch.isfinite(outputs["pdl"]).all() and torch.equal(outputs["pdl"], outputs["core"])
