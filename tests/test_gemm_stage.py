"""CPU tests of stage `gemm` (`EngineConfig.gemm="tuned"`, engine/gemm.py): the dispatcher on tables built here (the
tiny twin, whose GEMMs share the 27B's shape names), the stage against `graphs` with a table without split-K, tree
against flat within the stage with a split-K table, the split-K reduction against its reference, and the cuBLAS
fallback on a missing, foreign or broken table (one warning, no crash)."""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ablations.plans import load_plan
from engine import gemm
from engine.gemm_table import (
    CUBLASLT_ALGORITHM_KEYS,
    GEMM_SHAPES,
    GemmChoice,
    GemmTableError,
    load_gemm_table,
    table_or_fallback,
)
from engine.graphs import ROWS_GRID
from engine.stages import build_engine, config_of, get_stage
from engine.weights import MergedWeights, Weight
from measure.grid_coverage import ROWS_TO_1152
from reference import ops
from reference.shapes import TINY
from reference.weights import synthetic_weights

CPU = torch.device("cpu")
ALGORITHM = dict.fromkeys(CUBLASLT_ALGORITHM_KEYS, 0) | {"id": 66, "tile_id": 20, "splitk_num": 1, "stages_id": 8}


def table_data(kernels_by_shape: dict[str, dict], gpu: str = "cpu") -> dict:
    """A schema-v1 table with one kernel per shape at every bucket (times made up, floors below them)."""
    shapes = {
        name: {"n": n, "k": k, "buckets": [
            {"rows": rows, "kernel": kernels_by_shape.get(name, {"family": "cublas"}), "time_us": 30.0 + rows,
             "floor_us": 20.0 + rows, "bitwise_f_linear": kernels_by_shape.get(name, {}).get("family") != "splitk",
             "row_invariant": True}
            for rows in ROWS_GRID]}
        for name, (n, k) in GEMM_SHAPES.items()
    }  # fmt: skip
    versions = {"torch": "2.13.0", "cuda": "13.0", "cublas": "13.1.0", "cublaslt": "13.1.0", "nvmath": None,
                "triton": "3.9.0"}  # fmt: skip
    return {"schema_version": 1, "gpu": {"name": gpu, "capability": [9, 0]}, "versions": versions,
            "commit": "abc1234", "created_utc": "2026-12-01T10:00:00Z", "shapes": shapes}  # fmt: skip


def write_table(tmp_path: Path, data: dict | str, name: str = "table.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def load(tmp_path: Path, kernels_by_shape: dict[str, dict]):
    return load_gemm_table(write_table(tmp_path, table_data(kernels_by_shape)), device_name="cpu")


SPLIT = {"out": {"family": "splitk", "split": 3}, "down": {"family": "splitk", "split": 2}}


@pytest.fixture(scope="module")
def merged_weights() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=17))


def request(seed: int, root_len: int = 70) -> tuple[list[list[int]], list[int]]:
    """A shared root of `root_len` tokens, two questions, three options each (odd lengths)."""
    rng = random.Random(seed)
    root = [rng.randrange(100, 150_000) for _ in range(root_len)]
    candidates = [root + [q + 1] + [rng.randrange(100, 150_000) for _ in range(3 + q * 5)] + [o + 1]
                  for q in range(2) for o in range(3)]  # fmt: skip
    return candidates, [0, 0, 0, 1, 1, 1]


def test_gemm_stage_is_a_kept_rung_on_graphs_in_the_gpu_plan():
    """Kept since the H200 record 20261203T090047Z timed it with its gate green: the GPU plan's seventh rung. The CPU
    plan leaves it out: the committed tables are the H200's, so on the CPU every call is the fallback (= graphs)."""
    stage = get_stage("gemm")
    assert (stage.builds_on, stage.delta, stage.status) == ("graphs", {"gemm": "tuned"}, "kept")
    assert stage.exactness.describe() == "bitwise vs graphs"
    assert config_of("gemm") == config_of("graphs").replace(gemm="tuned")
    assert gemm.needs_row_invariant(config_of("gemm"))  # its cublas choices and its fallback need no workspace
    assert load_plan("gpu-27b").stages[-3:-1] == ("graphs", "gemm")  # then core, built on it
    assert "gemm" not in load_plan("cpu-tiny").stages


def test_gemm_stage_matches_graphs_bitwise_without_split(merged_weights, tmp_path):
    """The stage's CPU gate: with a table without split-K (every choice `cublas`, what the CPU runs) the `gemm`
    stage's forward and hidden states are bit-identical to `graphs` on the same request."""
    table = load(tmp_path, {})
    tuned = build_engine(merged_weights, "gemm", gemm_table=table)
    graphs = build_engine(merged_weights, "graphs")
    assert tuned._gemm.table is table and tuned._gemm.kernel("down", 100).family == "cublas"
    described = tuned.gemm_table()  # what the runner records for the stage
    assert graphs.gemm_table() is None and described["commit"] == table.commit
    assert [row[0] for row in described["kernels"]["down"]] == list(ROWS_GRID)
    candidates, groups = request(3, root_len=9)
    got, want = tuned.prepare(candidates, groups), graphs.prepare(candidates, groups)
    assert got.batches[0].plan.bucket is not None  # a bucketed plan: the calls have the bucket's rows
    assert torch.equal(tuned.forward(got), graphs.forward(want))


def test_split_k_tree_matches_flat_bitwise(merged_weights, tmp_path, monkeypatch):
    """Row-count invariance of the tuned GEMMs: with fixed split-K for out (S=3) and down (S=2) the tree and the flat
    layout give the same candidate outputs and the same hidden states bit for bit, though their calls have different
    row counts; every out and down projection went through the split. (The reference ops and varlen attention: the
    stage's own kernels under the interpreter take minutes here; the bucketed tree with them is the GPU test's.)"""
    table = load(tmp_path, SPLIT)
    calls = []

    def counted(x, weight, split):
        calls.append((x.shape[0], split))
        return splitk_partials(x, weight, split)

    splitk_partials = gemm.splitk_partials
    monkeypatch.setattr(gemm, "splitk_partials", counted)
    flat_config = config_of("merged", gemm="tuned", attention="varlen")
    tree = build_engine(merged_weights, flat_config.replace(layout="tree"), gemm_table=table)
    flat = build_engine(merged_weights, flat_config, gemm_table=table)
    candidates, groups = request(8)
    tree_rows, flat_rows = tree.prepare(candidates, groups), flat.prepare(candidates, groups)
    assert tree_rows.rows_computed != flat_rows.rows_computed
    assert torch.equal(tree.forward(tree_rows), flat.forward(flat_rows))
    per_forward = 2 * TINY.num_layers
    assert sorted({split for _, split in calls}) == [2, 3] and len(calls) == 2 * per_forward
    assert {rows for rows, _ in calls} == {tree_rows.rows_computed, flat_rows.rows_computed}
    tree_states, flat_states = tree.hidden_states(tree_rows), flat.hidden_states(flat_rows)
    assert all(torch.equal(a, b) for a, b in zip(tree_states, flat_states, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["reference ops", "kernels"])
def test_split_k_projection_is_the_reference_reduction(fused):
    """`project` + `residual_rmsnorm` with split-K at 37 rows (odd): the partials against fp64 within the fp32
    accumulation bound (K/S terms, each product exact in fp32), and the norm bitwise against
    `reference.ops.splitk_delta` composed with the ops' own `residual_rmsnorm`."""
    from engine.backbone import _FusedOps, _ReferenceOps

    norms = _FusedOps(TINY, "torch") if fused else _ReferenceOps(TINY)
    gen = torch.Generator().manual_seed(29)
    rows, k, n, split = 37, 384, TINY.hidden_size, 3
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(n, generator=gen)).bfloat16()
    dispatch = gemm.GemmDispatch(None, CPU, {}, "test")
    dispatch._choice[("down", rows)] = GemmChoice(rows, gemm.GemmKernel("splitk", split), 1.0, 1.0, False)
    partials = dispatch.project(x, Weight(w), "down")
    assert partials.shape == (split, rows, n) and partials.dtype == torch.float32
    slices = [slice(s * k // split, (s + 1) * k // split) for s in range(split)]
    exact = torch.stack([x[:, sl].double() @ w[:, sl].double().T for sl in slices])
    magnitude = torch.stack([x[:, sl].double().abs() @ w[:, sl].double().abs().T for sl in slices])
    bound = (k // split) * 2.0**-24 / (1 - (k // split) * 2.0**-24) * magnitude  # gamma_{K/S} of fp32
    assert ((partials.double() - exact).abs() <= bound).all()
    got = dispatch.residual_rmsnorm(norms, residual, partials, norm_weight)
    want = norms.residual_rmsnorm(residual, ops.splitk_delta(partials), norm_weight)
    assert all(torch.equal(g, h) for g, h in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="call project"):
        dispatch.linear(x, Weight(w), "down")


def test_dispatch_runs_the_tables_cublas_choice_as_f_linear(tmp_path):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(50, 128, generator=gen).bfloat16(), torch.randn(96, 128, generator=gen).bfloat16()
    dispatch = gemm.GemmDispatch(load(tmp_path, {}), CPU, {}, "test")
    assert torch.equal(dispatch.linear(x, Weight(w), "gate_up"), F.linear(x, w))
    assert torch.equal(dispatch.project(x, Weight(w), "out"), F.linear(x, w))
    assert dispatch.kernel("no_such_gemm", 50) == gemm.CUBLAS  # a shape the table lacks: cuBLAS
    assert dispatch.describe()["kernels"]["down"][0] == [ROWS_GRID[0], "cublas", 1]


def test_split_k_must_cut_k_equally():
    with pytest.raises(ValueError, match="not 5 equal slices"):
        gemm.splitk_partials(torch.zeros(4, 384, dtype=torch.bfloat16), torch.zeros(8, 384, dtype=torch.bfloat16), 5)


def test_tables_the_cpu_cannot_run_fall_back_with_one_warning(merged_weights, tmp_path):
    """A cuBLASLt choice (CUDA only), split-K of an uneven K, a foreign GPU's table, a corrupt file and no table at
    all: each is one warning and cuBLAS, and the stage still answers (merged's fast ops with `gemm="tuned"`)."""
    config = config_of("merged", gemm="tuned")
    by_shape = gemm.gemm_weights_by_shape(merged_weights.layers)
    cases = {
        "needs CUDA": load(tmp_path, {"gate_up": {"family": "cublaslt", "algorithm": ALGORITHM}}),
        "not 5 equal slices": load(tmp_path, {"down": {"family": "splitk", "split": 5}}),
        "tuned on 'NVIDIA H200'": write_table(tmp_path, table_data({}, gpu="NVIDIA H200"), "h200.json"),
        "not valid JSON": write_table(tmp_path, '{"schema_version": 1,', "corrupt.json"),
        "cannot read it": tmp_path / "absent.json",
    }
    for message, table in cases.items():
        warnings: list[str] = []
        dispatch = gemm.build_dispatch(config, CPU, by_shape, table, warnings.append)
        assert dispatch.table is None and len(warnings) == 1 and message in warnings[0], (message, warnings)
        assert "fall back to cuBLAS" in warnings[0]
    engine = build_engine(merged_weights, config, gemm_table=tmp_path / "absent.json")
    assert engine._gemm.table is None and "refused" in engine._gemm.source
    candidates, groups = request(1)
    plain = build_engine(merged_weights, "merged")
    assert torch.equal(
        engine.forward(engine.prepare(candidates, groups)), plain.forward(plain.prepare(candidates, groups))
    )


def test_a_table_of_the_grid_before_serves_its_missing_rows_from_the_next_bucket(tmp_path):
    """A table tuned on the 264-bucket grid (1,152 after 1,024) is taken after one warning: 1,088 rows run the
    1,152-row bucket's kernel, 1,216 the 1,280's; rows outside the grid, out of order or unequal across shapes are
    refused (engine/gemm_table.py, `shapes`)."""
    data = table_data({"gate_up": {"family": "cublaslt", "algorithm": ALGORITHM}})
    for shape in data["shapes"].values():
        shape["buckets"] = [b for b in shape["buckets"] if b["rows"] in ROWS_TO_1152]
    warnings: list[str] = []
    table = table_or_fallback(write_table(tmp_path, data), "cpu", warnings.append)
    assert table.untuned_rows == (1088, 1216) and len(warnings) == 1 and "[1088, 1216]" in warnings[0]
    assert [table.choice("gate_up", rows).rows for rows in (1025, 1088, 1152, 1153, 1216, 5000)] == [
        1152, 1152, 1152, 1280, 1280, 1280]  # fmt: skip
    assert load(tmp_path, {}).untuned_rows == ()
    broken = {
        "not in the grid [1100]": lambda buckets: buckets.append(dict(buckets[-1], rows=1100)),
        "out of order or repeated": lambda buckets: buckets.reverse(),
    }
    for message, damage in broken.items():
        bad = json.loads(json.dumps(data))
        damage(bad["shapes"]["down"]["buckets"])
        with pytest.raises(GemmTableError, match=re.escape(message)):
            load_gemm_table(write_table(tmp_path, bad, "bad.json"), device_name="cpu")
    unequal = json.loads(json.dumps(data))
    unequal["shapes"]["down"]["buckets"].pop(0)
    with pytest.raises(GemmTableError, match="the same bucket rows"):
        load_gemm_table(write_table(tmp_path, unequal, "unequal.json"), device_name="cpu")


def test_split_k_is_refused_outside_the_norm_fed_projections(tmp_path):
    with pytest.raises(GemmTableError, match="split-K only for"):
        load(tmp_path, {"gate_up": {"family": "splitk", "split": 2}})


def test_the_default_table_is_the_newest_of_this_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv(gemm.TABLE_ENV, raising=False)
    assert gemm.default_table_path("NVIDIA H200", tmp_path) is None
    names = ("20261201T100000Z-nvidia-h200-abc1234-table.json", "20261202T100000Z-nvidia-h200-def5678-table.json",
             "20261203T100000Z-nvidia-h200-nvl-0123abc-table.json", "20261204T100000Z-nvidia-h200-aaa1111-records.json",
             "20261205T100000Z-nvidia-b200-bbb2222-table.json")  # fmt: skip
    for name in names:
        (tmp_path / name).write_text("{}")
    assert gemm.default_table_path("NVIDIA H200", tmp_path).name.startswith("20261202T100000Z-nvidia-h200-")
    assert gemm.default_table_path("NVIDIA H200 NVL", tmp_path).name.startswith("20261203T")
    monkeypatch.setenv(gemm.TABLE_ENV, str(tmp_path / "mine.json"))
    assert gemm.default_table_path("NVIDIA H200", tmp_path) == tmp_path / "mine.json"


def test_no_table_is_one_warning_and_cublas(tmp_path, monkeypatch):
    monkeypatch.delenv(gemm.TABLE_ENV, raising=False)
    monkeypatch.setattr(gemm, "TABLE_DIR", tmp_path)
    warnings: list[str] = []
    table, source = gemm.resolve_table(None, CPU, warnings.append)
    assert table is None and source == "none found: cuBLAS" and len(warnings) == 1 and "tune_gemm" in warnings[0]


def test_committed_tables_match_the_declared_exactness():
    """A table under results/gemm/ with split-K (or a choice not bitwise with F.linear) makes the stage bounded: the
    registry entry must say so (engine/stages/gemm.md, Exactness)."""
    tables = sorted(gemm.TABLE_DIR.glob("*-table.json"))
    if not tables:
        pytest.skip("no tuning table committed yet (the tuner has not run on a GPU)")
    level = get_stage("gemm").exactness.level
    for path in tables:
        data = json.loads(path.read_text())
        table = load_gemm_table(path, device_name=data["gpu"]["name"])
        bitwise = all(c.kernel.split == 1 and c.bitwise_f_linear for s in table.shapes for c in s.choices)
        assert bitwise or level == "bounded", f"{path.name} has split-K or non-bitwise choices; the stage says {level}"


GEMM_CODE = ("engine/gemm.py", "engine/weights.py")  # what decides how each GEMM of a forward is called
# A table re-checked on the GPU after a change to GEMM_CODE that keeps every bucket's call as tuned: the commit of
# the check and its log (the stage's GPU gate, bitwise vs graphs on every gate workload, and tree vs flat).
REVALIDATED = {
    "20261202T060138Z-nvidia-h200-2f9c178-table.json": (
        "8a0fb8cd3ac317f460624b42c74678fda0cbb388",  # off-bucket calls of a bitwise choice run F.linear
        "results/gpu/20261203T1321Z-nvidia-h200-8a0fb8c-gemm-stage-tests.log",
    ),
}


def code_of(source: str) -> str:
    """A Python source's code without its comments and docstrings (the AST with every leading string statement of
    the module, a class or a function removed): what the interpreter runs, whatever the prose says."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_committed_tables_were_tuned_on_todays_gemm_code():
    """A table holds for code whose GEMM calls are those it was tuned with: the code (not the comments or docstrings:
    `code_of`) of the seam that runs each choice (engine/gemm.py) and of the merged weights it runs them on
    (engine/weights.py) must be unchanged since the table's commit, or since the commit of its GPU re-check
    (`REVALIDATED`, with the log that must exist); the tree here is compared, uncommitted edits included. A change
    there means tuning (or re-checking) again on the GPU (engine/stages/gemm.md, "Validity"). Shapes are checked by
    the loader."""
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout (a device copy): the commit check runs in CI")
    tables = sorted(gemm.TABLE_DIR.glob("*-table.json"))
    assert tables, "no tuning table committed under results/gemm/"
    for path in tables:
        commit = json.loads(path.read_text())["commit"]
        if path.name in REVALIDATED:
            commit, log = REVALIDATED[path.name]
            assert " passed" in (repo / log).read_text() and " failed" not in (repo / log).read_text(), log
        known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True)
        assert known.returncode == 0, f"{path.name}: commit {commit} is not in this clone's history"
        for name in GEMM_CODE:
            then = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=repo, capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
            changed = code_of(then) != code_of((repo / name).read_text())
            assert not changed, f"{path.name}: checked at {commit[:7]}; the code of {name} changed since"


def test_the_table_check_sees_code_and_not_prose():
    source = '"""Doc."""\n\ndef f(x):\n    """Doc."""\n    return x + 1  # note\n'
    assert code_of(source) == code_of(source.replace("Doc.", "Other words.").replace("# note", ""))
    assert code_of(source) != code_of(source.replace("x + 1", "x + 2"))


class FakeMatmul:
    """Stands in for a planned nvmath Matmul: it keeps the planned rows M, as the real one does
    (`reset_operands_unchecked` repoints, it does not reshape), and returns F.linear of the first M rows only."""

    planned: list[tuple[int, int]] = []
    executed: list[int] = []

    def __init__(self, x: torch.Tensor, weight: torch.Tensor):
        self.rows, self.a, self.b = x.shape[0], x, weight.t()
        FakeMatmul.planned.append(tuple(x.shape))

    def reset_operands_unchecked(self, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.shape[0] >= self.rows, "the real Matmul would read past the operand"
        self.a, self.b = a, b

    def execute(self, stream=None) -> torch.Tensor:
        FakeMatmul.executed.append(self.rows)
        return F.linear(self.a[: self.rows], self.b.t())


@pytest.mark.parametrize("bitwise", [True, False])
@pytest.mark.parametrize("rows", [2167, ROWS_GRID[-1], 700, 50])
def test_cublaslt_choice_returns_every_row_at_any_row_count(tmp_path, monkeypatch, rows, bitwise):
    """A cuBLASLt plan has its bucket's rows; a call above the largest bucket (2,167 rows failed on the H200 with
    1,280 rows back) or off the grid (eager) must still return its own rows, each the plan's bits (F.linear here).
    A call of its bucket's rows runs the plan once; any other call runs F.linear when the choice was measured
    bitwise with it (no plan runs), else the plan in slices of its rows."""
    monkeypatch.setattr(gemm, "plan_cublaslt", lambda x, weight, wanted: FakeMatmul(x, weight))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    FakeMatmul.planned, FakeMatmul.executed = [], []
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(rows, 64, generator=gen).bfloat16(), torch.randn(48, 64, generator=gen).bfloat16()
    data = table_data({"gate_up": {"family": "cublaslt", "algorithm": ALGORITHM}})
    for bucket in data["shapes"]["gate_up"]["buckets"]:
        bucket["bitwise_f_linear"] = bitwise
    table = load_gemm_table(write_table(tmp_path, data), device_name="cpu")
    dispatch = gemm.GemmDispatch(table, torch.device("cuda"), {"gate_up": [w]}, "test")
    assert sorted(r for r, _ in FakeMatmul.planned) == list(ROWS_GRID)  # one plan per bucket, at build time
    got = dispatch.linear(x, Weight(w), "gate_up")
    assert got.shape == (rows, 48) and torch.equal(got, F.linear(x, w))
    bucket = table.choice("gate_up", rows).rows
    if rows == bucket:
        assert FakeMatmul.executed == [bucket]
    else:
        assert FakeMatmul.executed == ([] if bitwise else [bucket] * -(-rows // bucket))
