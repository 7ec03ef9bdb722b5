"""Stage `gemm` on the GPU, 27B shapes (issue 14): the kernel families of `engine.gemm.GemmDispatch` against
`F.linear`, their row-count invariance, the split-K norm variant, and the stage against `graphs` and flat.

    nox --no-venv -s gpu_tests -- tests/test_gpu_gemm_tuned.py -s

Declared and checked (the process has no cuBLAS workspace: tests/conftest.py prepares it for every stage):
* every family per shape and bucket within the bf16 output bound of an fp64 reference (|y - y64| <= 2^-8 |y64| +
  gamma_K |x||w|), with the share of rows bit-identical to `F.linear` printed (`-s`);
* row-count invariance: the first ROWS_GRID[0] rows of a call of every bucket size equal the ROWS_GRID[0]-row call bit
  for bit, for cuBLAS, the heuristic's first cuBLASLt algorithm without split-K (asked for with reduction scheme NONE,
  as the tuner asks: at limit 8 with every scheme it offered only split-K for down on the H200), and every fixed
  split-K S that cuts K;
* a cuBLASLt choice through the dispatcher replays inside a CUDA graph as it ran eagerly (operands repointed under
  capture, two weights);
* `kernels.residual_rmsnorm_splitk` bitwise against `reference.ops.splitk_delta` + `kernels.residual_rmsnorm`;
* the stage with this GPU's committed table (`engine.gemm.default_table_path`; none yet: these fail until
  `nox -s tune_gemm` has written one) bitwise against `graphs` (its declared exactness), and its tree against the
  flat layout of the same config on drone, customer_service and long-10k-choice-5.
Synthetic weights and random inputs: only bits and bounds are compared.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from ablations.workloads import get_workload, jevbench_panel
from engine import gemm
from engine.gemm_table import GEMM_SHAPES, SPLITK_SHAPES, load_gemm_table
from engine.graphs import ROWS_GRID
from engine.stages import build_engine, config_of
from engine.weights import MergedWeights, Weight
from measure.tune_gemm import NON_SPLIT_LIMIT
from reference.ops import splitk_delta
from reference.service import request_candidates
from reference.shapes import QWEN38_27B as S
from reference.weights import synthetic_weights

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
FIRST = ROWS_GRID[0]


def operands(shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = GEMM_SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(ROWS_GRID[-1], k, generator=gen, device=DEVICE).bfloat16()
    return x, (torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5).bfloat16()


def within_bf16_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    exact = x.double() @ w.double().T
    gamma = x.shape[1] * 2.0**-24 / (1 - x.shape[1] * 2.0**-24)
    bound = 2.0**-8 * exact.abs() + gamma * (x.double().abs() @ w.double().abs().T)
    return bool(((y.double() - exact).abs() <= bound).all())


def first_lt_config(x: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    """The first algorithm cuBLASLt's heuristic offers without split-K, asked as the tuner asks it (reduction scheme
    NONE, up to `NON_SPLIT_LIMIT`: `engine.gemm.offered_algorithms`)."""
    from nvmath.linalg.advanced import Matmul

    matmul = Matmul(x, w.t(), stream=torch.cuda.current_stream())
    offered = gemm.offered_algorithms(matmul, NON_SPLIT_LIMIT, allow_split_k=False)
    assert offered, f"cuBLASLt's heuristic offered no algorithm without split-K (reduction scheme NONE) at {x.shape}"
    return gemm.cublaslt_config(offered[0])


def family_outputs(shape: str, x: torch.Tensor, w: torch.Tensor, lt_config: dict) -> dict[str, torch.Tensor]:
    """bf16 outputs of each family on x: cuBLAS, one cuBLASLt algorithm, and split-K's rounded sum per S."""
    out = {"cublas": F.linear(x, w)}
    matmul = gemm.plan_cublaslt(x, w, lt_config)
    if matmul is not None:
        out["cublaslt"] = gemm._run_cublaslt(matmul, x, w, DEVICE).clone()
    for split in (2, 3, 4) if shape in SPLITK_SHAPES else ():
        if x.shape[1] % split == 0:
            out[f"splitk{split}"] = splitk_delta(gemm.splitk_partials(x, w, split))
    return out


@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
def test_each_family_is_within_the_bf16_bound_of_f_linear(shape):
    x_all, w = operands(shape, 1)
    lt_config = first_lt_config(x_all[:FIRST], w)
    lines = [f"\n{shape}: rows, then per family the share of rows bit-identical to F.linear"]
    for rows in ROWS_GRID:
        x = x_all[:rows]
        outputs = family_outputs(shape, x, w, lt_config)
        want = outputs["cublas"]
        shares = {name: (y == want).all(dim=1).float().mean().item() for name, y in outputs.items()}
        lines.append(f"{rows:>5} " + " ".join(f"{name}={share:.3f}" for name, share in shares.items()))
        for name, y in outputs.items():
            assert within_bf16_bound(y, x, w), f"{shape} {name} at {rows} rows outside the bf16 bound"
    print("\n".join(lines))


@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
def test_every_family_is_row_count_invariant(shape):
    x_all, w = operands(shape, 2)
    lt_config = first_lt_config(x_all[:FIRST], w)
    anchor = family_outputs(shape, x_all[:FIRST], w, lt_config)
    for rows in ROWS_GRID[1:]:
        outputs = family_outputs(shape, x_all[:rows], w, lt_config)
        for name, y in outputs.items():
            if name in anchor:
                assert torch.equal(y[:FIRST], anchor[name]), f"{shape} {name}: rows depend on the call's {rows} rows"


def test_a_cublaslt_choice_replays_in_a_graph_as_it_ran_eagerly():
    """The dispatcher's planned Matmul is repointed at each call's operands, also under capture."""
    from tests.test_gemm_stage import table_data  # the CPU tests' table builder

    x_all, w1 = operands("gate_up", 3)
    _, w2 = operands("gate_up", 4)
    rows = 96
    lt_config = first_lt_config(x_all[:rows], w1)
    data = table_data({"gate_up": {"family": "cublaslt", "algorithm": lt_config}}, gpu=torch.cuda.get_device_name())
    table = load_from_dict(data, torch.cuda.get_device_name())
    dispatch = gemm.GemmDispatch(table, DEVICE, {"gate_up": [w1]}, "test")
    x = x_all[:rows].clone()
    eager = [dispatch.linear(x, Weight(w), "gate_up").clone() for w in (w1, w2)]
    assert within_bf16_bound(eager[0], x, w1) and within_bf16_bound(eager[1], x, w2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dispatch.linear(x, Weight(w1), "gate_up")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [dispatch.linear(x, Weight(w), "gate_up") for w in (w1, w2)]
    outs[0].fill_(float("nan"))
    outs[1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))


def load_from_dict(data: dict, device_name: str):
    """The engine's loader on a table held in memory (written to a temporary file, never under results/)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "table.json"
        path.write_text(json.dumps(data))
        return load_gemm_table(path, device_name=device_name)


@pytest.mark.parametrize("rows", [64, 90, 337, 1032])
@pytest.mark.parametrize("split", [2, 3, 4])
def test_split_k_norm_is_the_fp32_sum_rounded_then_residual_rmsnorm(rows, split):
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 10 + split)
    hidden = S.hidden_size
    partials = torch.randn(split, rows, hidden, generator=gen, device=DEVICE) * 0.3
    residual = torch.randn(rows, hidden, generator=gen, device=DEVICE).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEVICE)).bfloat16()
    out_residual = torch.full_like(residual, float("nan"))
    out_normed = torch.full_like(residual, float("nan"))
    got = kernels.residual_rmsnorm_splitk(
        residual, partials, weight, S.rms_norm_eps, out_residual=out_residual, out_normed=out_normed
    )
    want = kernels.residual_rmsnorm(residual, splitk_delta(partials), weight, S.rms_norm_eps)
    assert all(torch.equal(g, h) for g, h in zip(got, want, strict=True))


# ---------------------------------------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def engines():
    path = gemm.default_table_path(torch.cuda.get_device_name())
    assert path is not None, "no GEMM table for this GPU under results/gemm/: run `nox --no-venv -s tune_gemm` first"
    table = load_gemm_table(path, device_name=torch.cuda.get_device_name())
    weights = synthetic_weights(S, seed=0, device="cuda")
    merged = MergedWeights.from_decision_weights(weights)
    del weights
    built = {
        "graphs": build_engine(merged, "graphs"),
        "gemm": build_engine(merged, "gemm", gemm_table=table),
        "gemm flat": build_engine(merged, config_of("gemm", graphs=False, layout="flat"), gemm_table=table),
    }
    for name in ("graphs", "gemm"):
        built[name].graphs.capture_on_miss = True
    assert built["gemm"]._gemm.table is table
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
def test_gemm_stage_matches_graphs_bitwise(engines, workload):
    """The stage's GPU gate: its declared exactness (bitwise vs graphs) with this GPU's committed table."""
    assert torch.equal(answer(engines["gemm"], workload), answer(engines["graphs"], workload)), workload


@pytest.mark.parametrize("workload", ["drone", "customer_service", "long-10k-choice-5"])
def test_gemm_stage_tree_matches_flat_bitwise(engines, workload):
    assert torch.equal(answer(engines["gemm"], workload), answer(engines["gemm flat"], workload)), workload
