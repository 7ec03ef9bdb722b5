"""FlashInfer's Hopper GDN kernel as a GDN core (kernels/gdn_flashinfer.py) on the GPU, 27B head shapes (Hk 16, Hv 48,
K = V = 128): what a stage built on it would rest on.

    nox --no-venv -s gpu_tests -- tests/test_gpu_gdn_flashinfer.py -s

* within `tests.cases.gdn_chunk_bounds`' bf16 bound of the fp32 oracle (outputs and final states, nonzero initial
  states), and within twice that bound of FLA's `FlaForwardCore` on the same inputs, as the stage's own core is held
  (tests/test_gpu_gdn_chunk.py); the share bit-equal to FLA printed (`-s`);
* bitwise: each sequence alone equals its rows in the whole launch (drone's bucketed paths, empty sequences included),
  two runs are identical, and a CUDA-graph replay equals the eager call;
* the hand-off arena (`FlashInferCore.arena`, what the stage runs on a bucket) equals the library's replicated call
  bit for bit on drone's and customer_service's bucketed plans, and the CPU's stand-in (`flashinfer_reference`) within
  the bf16 bound;
* stage `flashinfer_gdn` (its GPU gate): the head's rows against `graphs` within the registry's bound (core's) on
  drone, customer_service, long-10k-choice-5 and the JevBench panel, each in its bucket's graph replay (long-10k:
  eager, on the hand-off schedule), and its tree against its flat layout bitwise (drone).
Random inputs: bounds and bits only, never accuracy. FlashInfer's kernel compiles on its first call (CUTLASS's Python
DSL), which the first test pays.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from ablations.workloads import jevbench_panel
from engine.stages import config_of, get_stage
from kernels.gdn_flashinfer import FlashInferCore
from reference.ops import GDN_CHUNK_SIZE
from reference.shapes import QWEN38_27B as S
from tests.cases import (
    DRONE_BUCKET_PATHS,
    GDN_LENGTH_SETS,
    engines_27b,
    gdn_chunk_bounds,
    gdn_chunk_inputs,
    gdn_chunk_oracle,
    workload_answer,
)

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
DIMS = (S.linear_num_key_heads, S.linear_num_value_heads, S.linear_key_head_dim, S.linear_value_head_dim)


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt(float((x.double() - ref.double()).square().sum()) / float(ref.double().square().sum()))


def call(core, q, k, v, g, beta, cu, h0):
    return core(*(t[None] for t in (q, k, v, g, beta)), cu_seqlens=cu, initial_state=h0, output_final_state=True)


@pytest.mark.parametrize("lengths", list(GDN_LENGTH_SETS.values()), ids=list(GDN_LENGTH_SETS))
def test_flashinfer_core_within_the_bound_of_the_oracle_and_fla(lengths):
    from fla.ops.utils.index import prepare_chunk_indices

    from kernels.gdn_core import FlaForwardCore

    inputs = gdn_chunk_inputs(lengths, DIMS, seed=21, device=DEVICE)
    q, k, v, g, beta, cu, h0 = inputs
    o, final = call(FlashInferCore(), *inputs)
    ref_o, ref_final = gdn_chunk_oracle(*inputs)
    fla_o, fla_final = FlaForwardCore()(
        *(t[None] for t in (q, k, v, g, beta)),
        cu_seqlens=cu,
        chunk_indices=prepare_chunk_indices(cu, GDN_CHUNK_SIZE),
        initial_state=h0,
        output_final_state=True,
    )
    bound = gdn_chunk_bounds(DIMS[2], max(-(-n // GDN_CHUNK_SIZE) for n in lengths))["bf16"]
    figures = {
        "o vs oracle": rel_rmse(o[0].float(), ref_o),
        "final vs oracle": rel_rmse(final, ref_final),
        "FLA o vs oracle": rel_rmse(fla_o[0].float(), ref_o),
        "o vs FLA": rel_rmse(o[0].float(), fla_o[0].float()),
        "final vs FLA": rel_rmse(final, fla_final),
        "o bit-equal to FLA": float((o.view(torch.int16) == fla_o.view(torch.int16)).float().mean()),
    }
    print(f"flashinfer bound {bound:.3g}", {name: f"{value:.3e}" for name, value in figures.items()})
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    for name in ("o vs oracle", "final vs oracle"):
        assert figures[name] <= bound, (name, figures[name], bound)
    for name in ("o vs FLA", "final vs FLA"):
        assert figures[name] <= 2 * bound, (name, figures[name], bound)


def test_flashinfer_core_sequence_alone_equals_its_rows_in_the_launch():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(DRONE_BUCKET_PATHS, DIMS, seed=22, device=DEVICE)
    core = FlashInferCore()
    o, final = call(core, q, k, v, g, beta, cu, h0)
    again, final_again = call(core, q, k, v, g, beta, cu, h0)
    assert torch.equal(o, again) and torch.equal(final, final_again)
    bounds = cu.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e == s:
            continue
        alone, alone_final = call(
            core, q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], cu.new_tensor([0, e - s]), h0[i : i + 1]
        )
        assert torch.equal(alone[0], o[0, s:e]), i
        assert torch.equal(alone_final[0], final[i]), i


def test_flashinfer_core_replays_in_a_cuda_graph_as_it_runs_eagerly():
    inputs = gdn_chunk_inputs(DRONE_BUCKET_PATHS, DIMS, seed=23, device=DEVICE)
    core = FlashInferCore()
    eager, eager_final = call(core, *inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed, replayed_final = call(core, *inputs)
    replayed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager) and torch.equal(replayed_final, eager_final)


# ------------------------------------------------------------------------------------------------- the hand-off arena


@pytest.mark.parametrize("workload", ["drone", "customer_service"])
def test_flashinfer_arena_equals_the_replicated_call_and_the_reference(workload):
    """`FlashInferCore.arena` on the workload's bucketed plan (the root to A0 in one call, its fp32 state from a pool
    row to every candidate in a second) against the library's replicated call (every path from position 0) on the
    same gates (the gather's exp(g) and fp32 beta), each packed row at its representative slot: bit for bit, which
    holds exactly when the kernel's state after a chunk is the same stored as kept. And against the CPU's stand-in,
    `flashinfer_reference` (the fp32 oracle through the same arena), within the bf16 bound: the reference the CPU tests
    rest on follows the kernel's contract (non-zero first bound, pools, rows outside every sequence left alone)."""
    from ablations.probes import engine_gdn_inputs
    from kernels.gdn_flashinfer import flashinfer_gdn_function, flashinfer_reference
    from kernels.gdn_prep import gather_slots
    from measure.gdn_chunk_probe import bucketed_plan

    plan = bucketed_plan(workload)[0].to(DEVICE)
    call = plan.gdn["replicated"].calls[0]
    arena = call.arena
    inputs = engine_gdn_inputs(plan.num_rows, seed=25, device="cuda")
    got = FlashInferCore().arena(*inputs, arena)[arena.out_slots]
    q, k, v, alpha, beta = (t[0] for t in gather_slots(tuple(t[None] for t in inputs), call.rows, linear_gates=True))
    pool = torch.zeros((1, *v.shape[1:], k.shape[2]), device=DEVICE)
    skip = torch.full((call.num_sequences,), -1, dtype=torch.int64, device=DEVICE)
    replicated, _ = flashinfer_gdn_function()(q, k, v, alpha, beta, initial_state=pool, output_final_state=True,
                                              cu_seqlens=call.cu_seqlens, output_state=pool, state_indices=skip,
                                              output_state_indices=skip, use_cp=False,
                                              backend="flashinfer")  # fmt: skip
    want = replicated[plan.row_slot]
    reference = FlashInferCore(function=flashinfer_reference).arena(*inputs, arena)[arena.out_slots]
    bound = gdn_chunk_bounds(S.linear_key_head_dim, max(-(-n // GDN_CHUNK_SIZE) for n in plan.candidate_lens))["bf16"]
    error, equal = (
        rel_rmse(got.float(), reference.float()),
        float((got.view(torch.int16) == want.view(torch.int16)).double().mean()),
    )
    print(f"{workload}: arena vs reference {error:.3e} (bound {bound:.3e}); arena bit-equal to replicated {equal:.6f}")
    assert torch.isfinite(got).all() and error <= bound
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def engines():
    flat = config_of("flashinfer_gdn", graphs=False, layout="flat")
    built = engines_27b({"graphs": "graphs", "flashinfer_gdn": "flashinfer_gdn", "flashinfer_gdn flat": flat})
    yield built
    del built
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "workload", ["drone", "customer_service", "long-10k-choice-5"] + [w.id for w in jevbench_panel()]
)
def test_flashinfer_gdn_stage_close_to_graphs(engines, workload):
    """Stage `flashinfer_gdn`'s GPU gate: hidden_rel_rmse of the head's rows against `graphs` within the registry's
    bound."""
    got = workload_answer(engines["flashinfer_gdn"], workload)
    error = rel_rmse(got, workload_answer(engines["graphs"], workload))
    print(f"{workload}: flashinfer_gdn vs graphs hidden_rel_rmse {error:.4e}")
    assert torch.isfinite(got).all() and error <= get_stage("flashinfer_gdn").exactness.bound, (workload, error)


def test_flashinfer_gdn_stage_tree_matches_flat_bitwise(engines):
    tree, flat = (workload_answer(engines[name], "drone") for name in ("flashinfer_gdn", "flashinfer_gdn flat"))
    assert torch.equal(tree, flat)
