"""Run-to-run determinism: the same inputs give the same bits, five runs in a row, for every kernel of `kernels/` and
for the engine forward. CUDA graphs (replay against eager) and split-K GEMMs (fixed splits, reduced in a fixed order)
lean on this: a stage can only be bitwise against another if each is bitwise against itself.

* Kernels: residual_rmsnorm, rmsnorm_1p, gated_rmsnorm, silu_mul, attention_gate, gdn_prep, attn_prep, each on one
  set of seeded random inputs (`tests.cases.random_activations`: not zeros, saturating gates, odd and packed row
  counts), five launches into freshly NaN-poisoned `out=` buffers; every output of every run is written (no NaN
  left) and `torch.equal` to the first run's, and the inputs are unchanged. CPU: the tiny twin under the Triton
  interpreter; GPU twin (`-m gpu`): the 27B shapes, compiled kernels.
* Engine: `engine.stages.build_engine(merged, stage)`, one prepared request whose candidates share a prefix, five
  forwards with identical bits. CPU: the tiny twin, stages `merged` and `tree` (which runs every fused kernel);
  GPU twin: the 27B shapes, `merged`, `fused` and `tree`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported

import kernels  # noqa: E402
from engine.stages import build_engine  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from reference.shapes import QWEN38_27B, TINY, ModelShapes  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402
from tests.cases import gdn_dims, random_activations  # noqa: E402

RUNS = 5
KERNEL_NAMES = (
    "residual_rmsnorm",
    "rmsnorm_1p",
    "gated_rmsnorm",
    "silu_mul",
    "attention_gate",
    "gdn_prep",
    "attn_prep",
)
CPU_SEQ_LENS = (5, 1, 7)  # 13 packed rows: odd, a one-token sequence, small enough for the interpreter
GPU_SEQ_LENS = (1, 277, 63, 1000)  # 1341 packed rows
CPU_ENGINE_STAGES = ("merged", "tree")  # tree runs every fused kernel; the interpreter makes ~6 s of each forward
GPU_ENGINE_STAGES = ("merged", "fused", "tree")


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def kernel_runs(name: str, act: dict[str, torch.Tensor], shapes: ModelShapes) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One launch of kernel `name` on `act` into new NaN-poisoned outputs (shaped as a first plain launch returns
    them), as a function of nothing that returns its outputs."""
    eps = shapes.rms_norm_eps
    if name == "residual_rmsnorm":
        args = (act["residual"], act["delta"], act["norm_weight"], eps)
        shape = kernels.residual_rmsnorm(*args)
        return lambda: kernels.residual_rmsnorm(*args, out_residual=_poisoned(shape[0]), out_normed=_poisoned(shape[1]))
    if name == "rmsnorm_1p":
        args = (act["residual"], act["norm_weight"], eps)
        shape = kernels.rmsnorm_1p(*args)
        return lambda: (kernels.rmsnorm_1p(*args, out=_poisoned(shape)),)
    if name == "gated_rmsnorm":
        o = act["gdn_core_out"]
        z = act["gdn_proj"][:, shapes.conv_dim : shapes.conv_dim + o.shape[1] * o.shape[2]]  # row-strided slice
        args = (o, z, act["gdn_norm_weight"], eps)
        shape = kernels.gated_rmsnorm(*args)
        return lambda: (kernels.gated_rmsnorm(*args, out=_poisoned(shape)),)
    if name == "silu_mul":
        gate_up = act["mlp_gate_up"]
        shape = kernels.silu_mul(gate_up)
        return lambda: (kernels.silu_mul(gate_up, out=_poisoned(shape)),)
    if name == "attention_gate":
        attn = act["attn_core_out"]
        gate = kernels.attention_gate_view(act["attn_proj"], num_heads=attn.shape[1], head_dim=attn.shape[2])
        shape = kernels.attention_gate(attn, gate)
        return lambda: (kernels.attention_gate(attn, gate, out=_poisoned(shape)),)
    if name == "gdn_prep":
        args = (act["gdn_proj"], act["conv_weight"], act["A_log"], act["dt_bias"], act["gdn_cu_seqlens"])
        shapes_of = kernels.gdn_prep(*args, **gdn_dims(shapes))
        return lambda: kernels.gdn_prep(*args, out=tuple(_poisoned(t) for t in shapes_of), **gdn_dims(shapes))
    if name == "attn_prep":
        args = (act["attn_proj"], act["q_norm_weight"], act["k_norm_weight"], act["cos"], act["sin"], eps)
        dims = {
            "num_heads": shapes.num_attention_heads,
            "num_kv_heads": shapes.num_key_value_heads,
            "head_dim": shapes.head_dim,
        }
        shapes_of = kernels.attn_prep(*args, **dims)
        return lambda: kernels.attn_prep(*args, out=tuple(_poisoned(t) for t in shapes_of), **dims)
    raise ValueError(f"unknown kernel {name}")


def check_kernel_determinism(name: str, shapes: ModelShapes, seq_lens: tuple[int, ...], device: str) -> None:
    act = random_activations(shapes, list(seq_lens), device, seed=sum(seq_lens))
    inputs = {key: value.clone() for key, value in act.items()}
    launch = kernel_runs(name, act, shapes)
    first = launch()
    assert not any(t.isnan().any() for t in first), f"{name}: an output left unwritten"
    for run in range(1, RUNS):
        again = launch()
        for i, (got, want) in enumerate(zip(again, first, strict=True)):
            assert not got.isnan().any(), f"{name}: output {i} left unwritten in run {run}"
            assert torch.equal(got, want), f"{name}: output {i} of run {run} differs from run 0"
    for key, value in act.items():
        assert torch.equal(value, inputs[key]), f"{name}: input {key} changed"


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernel_is_deterministic_tiny(name: str) -> None:
    import triton

    if isinstance(kernels.activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were compiled for CUDA; this CPU test needs TRITON_INTERPRET=1 before `kernels` imports")
    check_kernel_determinism(name, TINY, CPU_SEQ_LENS, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_gpu_kernel_is_deterministic_27b(name: str) -> None:
    check_kernel_determinism(name, QWEN38_27B, GPU_SEQ_LENS, "cuda")


# ---------------------------------------------------------------------------------------------------------------------
# Engine


def shared_prefix_request(vocab_size: int, root: int, questions: int, options: int, seed: int):
    """Candidates root | question | option (every question `options` candidates), the prefix tree's shape; groups."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=generator).tolist()

    prefix, candidates, groups = tokens(root), [], []
    for q in range(questions):
        question = tokens(3 + 2 * q)
        for o in range(options):
            candidates.append(prefix + question + tokens(1 + o))
            groups.append(q)
    return candidates, groups


def check_engine_determinism(merged: MergedWeights, stage: str, candidates, groups) -> None:
    engine = build_engine(merged, stage)
    prepared = engine.prepare(candidates, groups)
    with torch.inference_mode():
        first = engine.forward(prepared)
        assert first.shape == (len(candidates), merged.shapes.hidden_size) and torch.isfinite(first).all()
        for run in range(1, RUNS):
            again = engine.forward(prepared)
            assert torch.equal(again, first), f"{stage}: forward {run} differs from forward 0"


@pytest.fixture(scope="module")
def tiny_merged() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=7))


@pytest.mark.parametrize("stage", CPU_ENGINE_STAGES)
def test_engine_forward_is_deterministic_tiny(tiny_merged: MergedWeights, stage: str) -> None:
    candidates, groups = shared_prefix_request(TINY.vocab_size, root=5, questions=1, options=2, seed=1)
    check_engine_determinism(tiny_merged, stage, candidates, groups)


@pytest.fixture(scope="module")
def merged_27b() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(QWEN38_27B, seed=7, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("stage", GPU_ENGINE_STAGES)
def test_gpu_engine_forward_is_deterministic_27b(merged_27b: MergedWeights, stage: str) -> None:
    candidates, groups = shared_prefix_request(QWEN38_27B.vocab_size, root=400, questions=3, options=4, seed=1)
    check_engine_determinism(merged_27b, stage, candidates, groups)
