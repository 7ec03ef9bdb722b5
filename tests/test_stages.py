"""The stage registry and the engine config on the CPU: every stage is a legal config derived from its parent's by a
delta, illegal combinations are refused where a config is built, everything derived from the deltas (switches, the
README's stage table, the ablations) is what the registry says, and one builder serves every caller."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine import gemm
from engine.config import FIELD_VALUES, EngineConfig, describe_value
from engine.stages import (
    EXACTNESS_LEVELS,
    METRICS,
    README_MARKERS,
    REGISTRY_STATUSES,
    REQUIRES,
    STAGE_LIST,
    STAGES,
    BuildContext,
    build_backbone,
    config_of,
    everything_but,
    get_stage,
    in_ladder_order,
    prepare_process,
    readme_table,
    replace_readme_block,
    switches,
    top_stage,
)

REPO = Path(__file__).resolve().parents[1]


def test_stage_names_are_unique_and_the_ladder_has_one_root():
    assert len(STAGES) == len(STAGE_LIST)
    roots = [s for s in STAGE_LIST if s.builds_on is None]
    assert [s.name for s in roots] == ["hf_torch"]
    assert roots[0].exactness.level == "reference"
    assert [s.name for s in STAGE_LIST[:4]] == ["hf_torch", "hf_fla", "merged", "fused"]


def test_every_stage_builds_on_an_earlier_known_stage():
    seen = set()
    for stage in STAGE_LIST:
        assert stage.builds_on is None or stage.builds_on in seen, f"{stage.name} builds on {stage.builds_on!r}"
        seen.add(stage.name)


def test_exactness_levels_and_bounds_are_well_formed():
    for stage in STAGE_LIST:
        e = stage.exactness
        assert e.level in EXACTNESS_LEVELS, stage.name
        if e.level == "reference":
            assert stage.builds_on is None and e.against is None and e.metric is None and e.bound is None
            continue
        assert e.against in STAGES and e.against != stage.name, stage.name
        if e.level == "bitwise":
            assert e.metric is None and e.bound is None, stage.name
        else:
            assert e.metric in METRICS and e.bound is not None and 0 < e.bound < 1, stage.name
        if e.level == "decisions":
            assert e.metric == "max_abs_dp", stage.name


def test_statuses_and_failure_records():
    for stage in STAGE_LIST:
        assert stage.status in REGISTRY_STATUSES, stage.name
        failed = stage.status == "failed"
        assert bool(stage.reason) == failed and bool(stage.numbers) == failed, stage.name
        assert set(stage.devices) <= {"cuda", "cpu"} and stage.devices, stage.name


def test_hf_stages_come_before_the_stages_that_consume_the_weights():
    consumes = [stage.consumes_weights for stage in STAGE_LIST]
    assert consumes == sorted(consumes), "an HF stage after an engine stage could not be built in one run"


def _test_function(node: str) -> tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef, ast.Module]:
    """The test function a node id `path::[Class::]name[params]` names, parsed from its file."""
    path, *parts = node.split("::")
    file = REPO / path
    assert file.is_file(), f"{node}: no file {path}"
    tree = ast.parse(file.read_text())
    scope: list[ast.stmt] = tree.body
    for part in parts[:-1]:
        classes = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == part]
        assert classes, f"{node}: no class {part}"
        scope = classes[0].body
    name = parts[-1].split("[")[0]
    functions = [n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    assert functions, f"{node}: no test function {name} in {path}"
    return file, functions[0], tree


def _marked_gpu(function: ast.FunctionDef | ast.AsyncFunctionDef, module: ast.Module) -> bool:
    decorators = [ast.unparse(d) for d in function.decorator_list]
    module_marks = [ast.unparse(n.value) for n in module.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]  # fmt: skip
    return any("mark.gpu" in text for text in decorators + module_marks)


@pytest.mark.parametrize("stage", STAGE_LIST, ids=lambda s: s.name)
def test_gate_nodes_exist(stage):
    """Each gate names an existing test function; the GPU gate is marked `gpu` (the runner selects it with -m gpu)."""
    assert stage.gate != stage.gpu_gate
    _, function, module = _test_function(stage.gate)
    assert not _marked_gpu(function, module), f"{stage.gate} is a GPU test: the CPU plan would deselect it"
    _, function, module = _test_function(stage.gpu_gate)
    assert _marked_gpu(function, module), f"{stage.gpu_gate} is not marked gpu: `-m gpu` would deselect it"


def test_requires_name_importable_attributes_or_explain_why_not(monkeypatch):
    for stage in STAGE_LIST:
        assert stage.missing_code() is None, stage.name  # this machine has every stage's code
    stage = STAGES["hf_torch"]
    monkeypatch.setitem(REQUIRES, "hf", ("engine.no_such_module:Thing",))
    assert "engine.no_such_module cannot be imported" in stage.missing_code()
    monkeypatch.setitem(REQUIRES, "hf", ("reference.shapes:NO_SUCH_SHAPES",))
    assert "no attribute 'NO_SUCH_SHAPES'" in stage.missing_code()


def test_ladder_order_and_unknown_names():
    assert [s.name for s in in_ladder_order(["fused", "hf_torch", "hf_torch"])] == ["hf_torch", "fused"]
    with pytest.raises(ValueError, match="unknown stage 'turbo'"):
        in_ladder_order(["turbo"])
    with pytest.raises(ValueError, match="known:"):
        get_stage("nope")


@pytest.mark.slow
def test_build_context_refuses_hf_after_the_engine_consumed_the_weights():
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    ctx = BuildContext(synthetic_weights(TINY, seed=5))
    model = ctx.hf_model()
    assert ctx.hf_model() is model  # shared by every HF stage
    ctx.merged_weights()
    assert ctx.consumed and ctx.weights.backbone == {}
    with pytest.raises(RuntimeError, match="build every HF stage before the engine"):
        ctx.hf_model()


# ---------------------------------------------------------------------------------------------------------- config
def test_every_stage_is_its_parents_config_with_its_delta():
    for stage in STAGE_LIST:
        config = config_of(stage.name)
        assert isinstance(config, EngineConfig)
        if stage.builds_on is not None:
            assert config.delta(config_of(stage.builds_on)) == stage.delta, f"{stage.name}: a delta field is a no-op"
        assert stage.describe()["config"] == config.as_dict()


def test_the_ladder_configs_are_todays_backbones():
    """The configs reproduce what each stage ran before the config existed (the stage table of the README)."""
    assert config_of("hf_torch").on("cpu") == config_of("hf_torch")
    assert (config_of("hf_fla").backbone, config_of("hf_fla").gdn_core) == ("hf", "fla")
    merged, fused, tree = (config_of(name) for name in ("merged", "fused", "tree"))
    assert (merged.layout, merged.elementwise, merged.attention, merged.gdn_core) == ("flat", "torch", "mask", "fla")
    assert (fused.layout, fused.elementwise, fused.attention, fused.gdn_core) == (
        "flat", "triton", "varlen", "fla_forward",
    )  # fmt: skip
    assert tree == fused.replace(layout="tree")
    assert {config_of(n).gemm for n in ("merged", "fused", "tree")} == {"cublas_row_invariant"}
    assert fused.on("cpu").gdn_core == "torch" and fused.on("cuda") == fused


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"backbone": "jax"}, "backbone='jax' is not one of"),
        ({"layout": "padded"}, "the engine runs packed rows"),
        ({"attention": "sdpa_padded"}, "the engine runs packed rows"),
        ({"graphs": "yes"}, "graphs='yes' is not one of"),
        ({"graphs": True, "layout": "flat"}, "graphs=True replays bucketed tree plans"),
        ({"graphs": True, "elementwise": "torch"}, "graphs=True replays bucketed tree plans"),
        ({"graphs": True, "gdn_core": "fla"}, "graphs=True replays bucketed tree plans"),
        ({"weight_format": "fp8"}, "weight_format='fp8' is not one of"),
        ({"max_batch_rows": 0}, "max_batch_rows must be an int >= 1"),
        ({"max_batch_rows": 8.5}, "max_batch_rows must be an int >= 1"),
        ({"gemm": "cutlass"}, "gemm='cutlass' is not one of"),
        ({"gdn_mode": None}, "gdn_mode=None is not one of"),
        ({"gdn_core": "chunk_fused", "elementwise": "torch"}, "needs elementwise='triton'"),
    ],
)
def test_illegal_engine_configs_are_refused_where_built(changes, message):
    with pytest.raises(ValueError, match=message):
        config_of("tree", **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layout": "tree"}, "the hf backbone runs transformers' own layout"),
        ({"elementwise": "triton"}, "the hf backbone runs transformers' own layout"),
        ({"gdn_mode": "handoff"}, "the hf backbone runs transformers' own layout"),
        ({"gdn_core": "fla_forward"}, "the engine's direct launch"),
        ({"gdn_core": "chunk_fused"}, "the engine's direct launch"),
    ],
)
def test_illegal_hf_configs_are_refused_where_built(changes, message):
    with pytest.raises(ValueError, match=message):
        config_of("hf_torch", **changes)


def test_the_cpu_form_of_a_config():
    assert config_of("merged").on("cpu").gdn_core == "torch"  # the CPU runs no FLA
    assert config_of("tree", gdn_core="chunk_fused").on("cpu").gdn_core == "chunk_fused"  # runs in the interpreter
    with pytest.raises(ValueError, match="needs CUDA"):
        config_of("hf_fla").on("cpu")
    assert [s.name for s in STAGE_LIST if "cpu" not in s.devices] == ["hf_fla"]


def test_every_field_value_has_a_description():
    for field, values in FIELD_VALUES.items():
        for value in values:
            assert describe_value(field, value), (field, value)
    assert describe_value("max_batch_rows", 8192) == "at most 8,192 rows per forward"


# ---------------------------------------------------------------------------------------------------------- derived
def test_switches_are_derived_from_the_deltas():
    assert switches("tree") == describe_value("layout", "tree")
    assert switches("hf_torch").startswith("the original: ")
    for stage in STAGE_LIST:
        for field, value in stage.delta.items():
            assert describe_value(field, value) in stage.switches, (stage.name, field)


def test_everything_but_sets_a_stages_delta_back_on_the_top_stage():
    top = top_stage().config
    assert top_stage().name == "core"
    assert everything_but("core") == config_of("gemm")
    core = {"gdn_core": "chunk_fused", "attention": "varlen_fa4"}
    assert everything_but("gemm") == config_of("graphs").replace(**core)
    assert everything_but("gemm").delta(top) == {"gemm": "cublas_row_invariant"}
    assert everything_but("graphs") == config_of("tree").replace(gemm="tuned", **core)
    assert everything_but("graphs").delta(top) == {"graphs": False}
    for name in ("tree", "fused"):  # the graphs replay bucketed tree plans over the fused kernels only
        with pytest.raises(ValueError, match="graphs=True replays bucketed tree plans"):
            everything_but(name)
    with pytest.raises(ValueError, match="reference"):
        everything_but("hf_torch")
    with pytest.raises(ValueError, match="hf backbone"):
        everything_but("merged")  # the engine's kernels have no HF backbone to run on


def test_readme_stage_table_is_the_generated_one():
    """README.md's stage block is what `python -m engine.stages --readme` writes (regenerate it after a registry
    change)."""
    readme = (REPO / "README.md").read_text()
    assert replace_readme_block(readme) == readme, "README stage table is stale: run python -m engine.stages --readme"
    assert all(f"`{stage.name}`" in readme_table() for stage in STAGE_LIST)
    with pytest.raises(ValueError, match="no <!-- stages -->"):
        replace_readme_block("no markers here")
    assert README_MARKERS[0] in readme


def test_every_stage_has_a_notes_file_with_its_sections():
    for stage in STAGE_LIST:
        assert stage.notes.is_file(), f"{stage.name}: no {stage.notes}"
        text = stage.notes.read_text()
        for heading in ("## Idea", "## What it switches", "## Code", "## Exactness", "## Evidence"):
            assert heading in text, f"{stage.notes.name} lacks {heading!r}"


def test_no_second_stage_list():
    """The server, the runner and the JevBench runner take stage names from the registry; no module lists them."""
    names = {stage.name for stage in STAGE_LIST}
    for path in [*REPO.glob("engine/*.py"), *REPO.glob("ablations/*.py"), *REPO.glob("reference/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                assert len(strings & names) < 3, f"{path.name}:{node.lineno} lists stage names {sorted(strings)}"


# ---------------------------------------------------------------------------------------------------------- build
@pytest.mark.slow
def test_one_builder_builds_every_cpu_stage():
    from engine.backbone import EngineBackbone
    from reference.model import HFBackbone
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    ctx = BuildContext(synthetic_weights(TINY, seed=5))
    built = {stage.name: build_backbone(stage.name, ctx) for stage in STAGE_LIST if "cpu" in stage.devices}
    assert isinstance(built["hf_torch"], HFBackbone)
    for name in ("merged", "fused", "tree", "graphs"):
        assert isinstance(built[name], EngineBackbone) and built[name].config == config_of(name).on("cpu")
        assert built[name].name == name
    assert built["graphs"].grid and built["graphs"].graphs is None  # bucketed plans, run eagerly on the CPU
    assert build_backbone(everything_but("core"), ctx).name == "gemm"
    assert build_backbone(everything_but("gemm"), ctx).name == "core[gemm=cublas_row_invariant]"  # the nearest stage,
    assert build_backbone(everything_but("graphs"), ctx).name == "core[graphs=False]"  # and its delta
    nearest = build_backbone(config_of("merged", layout="tree"), ctx)
    assert nearest.name == "merged[layout=tree]"  # the nearest stage, and what differs


def test_gemm_state_is_checked_against_the_config(monkeypatch):
    row_invariant = config_of("tree")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert gemm.prepare_process([config_of("hf_torch")]) == {}  # nothing asked for
    with pytest.raises(RuntimeError, match="needs"):
        gemm.check_process(row_invariant, torch.device("cuda"))
    assert gemm.prepare_process([row_invariant]) == gemm.ROW_INVARIANT_CUBLAS
    gemm.check_process(row_invariant, torch.device("cuda"))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert gemm.prepare_process([row_invariant]) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # the user's value stands
    with pytest.raises(RuntimeError, match="row-count invariance"):
        gemm.check_process(row_invariant, torch.device("cuda"))  # ... and is judged
    gemm.check_process(row_invariant, torch.device("cpu"))  # no cuBLAS on the CPU
    gemm.check_process(config_of("hf_torch"), torch.device("cuda"))  # cublas: no claim to check


def test_gemm_state_cannot_be_set_after_cuda_started(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA is initialised"):
        gemm.prepare_process([config_of("tree")])


def test_prepare_process_on_the_cpu_switches_the_interpreter_on():
    """The suite runs with TRITON_INTERPRET=1 (kernels interpreted): preparing a kernel stage keeps it and passes; and
    oneDNN is off (tests/conftest.py prepared the process so), which makes the CPU's bf16 GEMMs row-count invariant."""
    assert prepare_process(["tree"], "cpu") == {"TRITON_INTERPRET": "1"}
    assert not torch.backends.mkldnn.enabled


@pytest.mark.parametrize(("in_features", "out_features"), [(128, 768), (384, 128), (128, 1024), (1024, 128)])
def test_cpu_gemm_rows_do_not_depend_on_the_rows_beside_them(in_features, out_features):
    """With `engine.gemm.cpu_row_invariant` in force, each row of a bf16 `F.linear` on the CPU has the same bits at
    every row count (1 to 300 rows; the tiny twin's shapes, where oneDNN's bf16 GEMM departed at 9 of 172 pairs)."""
    gen = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(300, in_features, generator=gen).bfloat16()
    whole = torch.nn.functional.linear(x, weight)
    for rows in range(1, 300, 7):
        assert torch.equal(torch.nn.functional.linear(x[:rows], weight), whole[:rows]), rows
