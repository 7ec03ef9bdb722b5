"""engine/fla_configs.py on the CPU: dumped files load through FLA's own config cache, the miss report, the pin.

FLA reads FLA_CACHE_MODE once, at import, so every check that needs a mode of its own (or a fresh import) runs in a
subprocess (`_side` below); this process's fla stays as it was. The subprocesses execute FLA's `fla/ops/utils/cache.py`
alone (the parent packages `fla`, `fla.ops`, `fla.ops.utils` are bare package objects over FLA's real folders):
importing all of fla takes about 15 s on the 2-core CI machine, and the config cache imports nothing else of it.
The kernels are tiny `fla_cache_autotune` kernels run by the Triton interpreter; their tuning caches hold real
`triton.Config` objects, filled by hand (what a warm-up's autotuning would leave there)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine import fla_configs

REPO = Path(__file__).resolve().parents[1]
GPU = "Fake GPU 80GB HBM3"  # sanitized by FLA to Fake_GPU_80GB_HBM3
FILL_KEY = (24, "torch.float32")  # triton's key of fill[(1,)](out fp32, N=24): the key args, then tensor dtypes
EVEN_KEY = (24, "torch.float32")


def make_kernels() -> types.ModuleType:
    """A module holding two FLA-autotuned kernels (one under `triton.heuristics`) and a plain triton.autotune one."""
    import triton
    import triton.language as tl
    from fla.ops.utils.cache import fla_cache_autotune

    configs = [triton.Config({"BLOCK": 16}, num_warps=1, num_stages=1), triton.Config({"BLOCK": 32}, num_warps=2)]

    @fla_cache_autotune(configs=configs, key=["N"])
    @triton.jit
    def fill_kernel(out, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out + offs, offs.to(tl.float32), mask=offs < N)

    @triton.heuristics({"EVEN": lambda args: args["N"] % 2 == 0})
    @fla_cache_autotune(configs=configs, key=["N"])
    @triton.jit
    def even_kernel(out, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out + offs, offs.to(tl.float32) + EVEN, mask=offs < N)

    @triton.autotune(configs=configs, key=["N"])
    @triton.jit
    def plain_kernel(out, N, BLOCK: tl.constexpr):
        tl.store(out + tl.arange(0, BLOCK), 0.0)

    module = types.ModuleType("fake_fla_kernels")
    module.fill, module.even, module.plain, module.configs = fill_kernel, even_kernel, plain_kernel, configs
    return module


def bare_fla_packages() -> None:
    """Let `import fla.ops.utils.cache` execute only that module (see the module docstring); before any fla import."""
    import importlib.util

    folder = Path(importlib.util.find_spec("fla").origin).parent
    for name, path in (("fla", folder), ("fla.ops", folder / "ops"), ("fla.ops.utils", folder / "ops" / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package


def dump_side(root: str) -> dict:
    """Subprocess, no FLA environment: the pin without a set, then a dump of hand-filled caches, then the refusal."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("engine.fla_configs").addHandler(handler)
    no_set = [fla_configs.pin_fla_configs(root, gpu_name=GPU) for _ in range(2)]
    module = make_kernels()
    from fla.ops.utils import cache as fla_cache

    module.fill.cache[FILL_KEY] = module.configs[1]
    module.even.fn.cache[EVEN_KEY] = module.configs[0]
    manifest = fla_configs.dump_fla_configs(root, modules=[module], commit={"git_commit": "abc"})
    try:
        fla_configs.pin_fla_configs(root, gpu_name=GPU)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return {
        "no_set": no_set,
        "env_after_no_set": [os.environ.get("FLA_CACHE_MODE"), os.environ.get("FLA_CONFIG_DIR")],
        "logged": [r.getMessage() for r in records],
        "mode": fla_cache.FLA_CACHE_MODE.value,
        "manifest": manifest,
        "refused_after_import": refused,
    }


def load_side(root: str) -> dict:
    """Subprocess: pin first, then FLA's strict mode loads the dumped configs for the kernels' calls."""
    pinned = fla_configs.pin_fla_configs(root, gpu_name=GPU)
    module = make_kernels()
    from fla.ops.utils import cache as fla_cache

    out = torch.full((64,), -1.0)
    module.fill[(1,)](out, 24)  # strict mode: the file's BLOCK=32 config, no benchmark (the interpreter can't time)
    filled = int((out >= 0).sum())
    module.even[(1,)](torch.zeros(64), 24)
    loaded = fla_cache.load_cached_config("fill_kernel", fla_cache.AutotuneKey(FILL_KEY))
    report = fla_configs.autotune_report(modules=[module])
    module.fill.cache[(8, "torch.float32")] = module.configs[0]  # a key the files lack: what FLA would autotune
    module.even.fn.cache[EVEN_KEY] = module.configs[1]  # a cached choice other than the file's
    report_with_misses = fla_configs.autotune_report(modules=[module])
    return {
        "pinned": pinned,
        "mode": fla_cache.FLA_CACHE_MODE.value,
        "filled": filled,
        "fill_config_is_file_config": module.fill.cache[FILL_KEY] == module.configs[1],
        "load_cached_config": loaded,
        "report": report,
        "report_with_misses": report_with_misses,
        "second_pin": fla_configs.pin_fla_configs(root, gpu_name=GPU),  # already in force: no refusal
    }


def _side(name: str, root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_GPU_NAME")}
    env |= {"TRITON_INTERPRET": "1", "FLA_GPU_NAME": GPU}  # FLA's get_gpu_info() names the dump's folder from it
    call = f"print(json.dumps(t.{name}({str(root)!r})))"
    code = f"import json, tests.test_fla_configs as t; t.bare_fla_packages(); {call}"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("fla-configs")
    return root, _side("dump_side", root)


def test_dump_writes_fla_files_and_a_manifest(dumped):
    from fla.ops.utils.cache import AutotuneKey, KernelConfigFile

    root, side = dumped
    directory = root / "Fake_GPU_80GB_HBM3"
    assert sorted(p.name for p in directory.iterdir()) == ["even_kernel.json", "fill_kernel.json", "manifest.json"]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest == side["manifest"]
    assert manifest["kernels"] == {"even_kernel": 1, "fill_kernel": 1}
    assert manifest["unpinnable_kernels"] == []  # the plain kernel's cache is empty: nothing of it was used
    assert manifest["commit"] == {"git_commit": "abc"} and manifest["fla_version"] == "0.6.0"
    path = directory / "fill_kernel.json"
    parsed = KernelConfigFile.from_dict(path, json.loads(path.read_text()))
    assert parsed is not None and parsed.kernel_name == "fill_kernel"
    entry = parsed.lookup_exact(AutotuneKey(FILL_KEY))
    assert entry["autotune_key"] == list(FILL_KEY)
    assert entry["config"] == {
        "kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None, "ir_override": None
    }  # fmt: skip
    assert parsed.lookup_exact(AutotuneKey((8, "torch.float32"))) is None


def test_no_pinned_set_leaves_autotuning_on_and_says_so_once(dumped):
    root, side = dumped
    first, second = side["no_set"]
    assert first["pinned"] is False and "manifest.json missing" in first["reason"] and first == second
    assert side["env_after_no_set"] == [None, None]
    assert side["mode"] == "disabled"
    assert len(side["logged"]) == 1 and "FLA autotunes" in side["logged"][0]


def test_pin_refuses_after_fla_was_imported(dumped):
    root, side = dumped
    assert "must run before fla is imported" in side["refused_after_import"]
    assert "FLA_CACHE_MODE=disabled" in side["refused_after_import"]


def test_pinned_process_loads_the_dumped_configs_and_reports_misses(dumped):
    root, _ = dumped
    side = _side("load_side", root)
    directory = str((root / "Fake_GPU_80GB_HBM3").resolve())
    assert side["pinned"] == {"pinned": True, "dir": directory, "reason": None}
    assert side["mode"] == "strict"
    assert side["filled"] == 24 and side["fill_config_is_file_config"]  # BLOCK=16 (the first config) fills 16
    assert side["load_cached_config"]["kwargs"] == {"BLOCK": 32}
    report = side["report"]
    assert report["pinned"] and report["dir"] == directory and report["files"] == 2
    assert (report["kernels"], report["loaded_keys"], report["autotuned_keys"], report["autotuned"]) == (2, 2, 0, [])
    misses = side["report_with_misses"]
    assert (misses["loaded_keys"], misses["autotuned_keys"]) == (1, 2)
    assert sorted(m["kernel"] for m in misses["autotuned"]) == ["even_kernel", "fill_kernel"]
    assert {"kernel": "fill_kernel", "key": [8, "torch.float32"]} in misses["autotuned"]
    assert side["second_pin"]["pinned"] is True


def test_dump_refuses_what_fla_cannot_load(tmp_path):
    import triton

    module = make_kernels()
    with pytest.raises(ValueError, match="no FLA autotuner has a tuned key"):
        fla_configs.dump_fla_configs(tmp_path, modules=[module])
    module.plain.cache[FILL_KEY] = module.configs[0]
    with pytest.raises(ValueError, match="plain triton.autotune kernel"):
        fla_configs.kernel_config_files([module.plain])
    module.fill.cache[FILL_KEY] = triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: None)
    with pytest.raises(ValueError, match="pre-hook"):
        fla_configs.kernel_config_files([module.fill])
    other = make_kernels()  # a second kernel named fill_kernel, as two FLA modules may define
    module.fill.cache[FILL_KEY], other.fill.cache[FILL_KEY] = module.configs[0], module.configs[1]
    with pytest.raises(ValueError, match="two autotuners named fill_kernel"):
        fla_configs.kernel_config_files([module.fill, other.fill])
    assert list(tmp_path.iterdir()) == []


def test_autotuners_found_through_heuristics():
    module = make_kernels()
    assert [fla_configs.kernel_name(t) for t in fla_configs.fla_autotuners([module])] == [
        "fill_kernel", "even_kernel", "plain_kernel"
    ]  # fmt: skip
    assert fla_configs.fla_autotuners([module])[1] is module.even.fn


def test_fla_modules_in_this_process_hold_the_gdn_forward_autotuners():
    import fla.ops.common.chunk_delta_h  # noqa: F401  the engine's GDN forward modules (kernels/gdn_core.py)
    import fla.ops.common.chunk_o  # noqa: F401
    import fla.ops.gated_delta_rule.chunk_fwd  # noqa: F401
    import fla.ops.gated_delta_rule.wy_fast  # noqa: F401

    names = {fla_configs.kernel_name(t) for t in fla_configs.fla_autotuners()}
    assert {"chunk_fwd_kernel_o", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "recompute_w_u_fwd_kernel"} <= names
    assert "chunk_gated_delta_rule_fwd_kkt_solve_kernel" in names


def test_gpu_folder_name_matches_fla():
    from fla.ops.utils.cache import sanitize_gpu_name

    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X", "__", ""):
        assert fla_configs.sanitize_gpu_name(name) == sanitize_gpu_name(name)


def test_pin_is_a_no_op_without_cuda(tmp_path, monkeypatch):
    (tmp_path / "Fake_GPU_80GB_HBM3").mkdir()
    (tmp_path / "Fake_GPU_80GB_HBM3" / "manifest.json").write_text("{}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = (os.environ.get("FLA_CACHE_MODE"), os.environ.get("FLA_CONFIG_DIR"))
    state = fla_configs.pin_fla_configs(tmp_path)
    assert state == {"pinned": False, "dir": None, "reason": "no CUDA device: FLA does not run here"}
    assert (os.environ.get("FLA_CACHE_MODE"), os.environ.get("FLA_CONFIG_DIR")) == before
