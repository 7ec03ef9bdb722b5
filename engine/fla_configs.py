"""FLA's autotune choices pinned per GPU model, through FLA 0.6.0's own config cache (`fla/ops/utils/cache.py`).

FLA's Triton kernels autotune on the first call of every autotune key, so two processes can choose different
kernels (timing noise picks the winner) and a server's start pays the tuning. FLA can instead load the chosen configs
from `{kernel_name}.json` files: `FLA_CACHE_MODE=strict` looks each key up by its exact hash and autotunes only keys
the files lack, `FLA_CONFIG_DIR` names the folder. FLA reads `FLA_CACHE_MODE` once, when `fla.ops.utils.cache` is
first imported, so the pin must come before any import of fla (`reference.model`, `kernels.gdn_core`,
`engine.backbone` import it at the top).

* `pin_fla_configs(root)`: on CUDA, before fla is imported, sets `FLA_CACHE_MODE=strict` and
  `FLA_CONFIG_DIR=root/<GPU>` when that folder holds a pinned set (its `manifest.json`), `<GPU>` being the device
  name sanitized as FLA sanitizes it (`FLA_GPU_NAME` wins, as in FLA). Without a pinned set it leaves autotuning on
  and logs that once. Without CUDA it does nothing (the CPU never runs FLA: the engine's configs use the torch GDN
  core there). Called after FLA's config cache was imported, it raises (the mode would be ignored), unless that
  cache already runs with exactly the state the call would set. The runner (`ablations.run`), the server's model
  builder (`engine.server.build_decision_model`) and the GPU tests (`tests/conftest.py`) call it with `PINNED_ROOT`.
* `dump_fla_configs(root)`: after a warm-up, every FLA autotuner with a non-empty tuning cache (found by walking the
  imported `fla` modules' attributes through `triton.heuristics` wrappers, not by kernel names) is written as
  `root/<GPU>/{kernel_name}.json` in FLA's format (`autotune_entries`: md5 of the serialized key -> `autotune_key`
  and `config`: kwargs, num_warps, num_stages, num_ctas, maxnreg, ir_override), beside `manifest.json` (triton, FLA
  and torch versions, the GPU's name, this lab's commit, the entries per kernel). `<GPU>` here is FLA's own
  `get_gpu_info()`. A config with a pre-hook cannot be written (FLA's loader drops hooks) and is refused.
* `autotune_report()`: after a warm-up, which keys of the used autotuners FLA did not load from the pinned files
  (autotuned, or taken from Triton's own disk cache): `{pinned, mode, dir, files, kernels, loaded_keys,
  autotuned_keys, autotuned}`. A key counts as loaded when the pinned file has an exact entry for it with the config
  the autotuner holds. `EngineBackbone.warm_up` (`graphs`) returns it as `fla_configs`, so the run record's
  `graph_cache` and the server's `/health` show it. Plain `triton.autotune` kernels of FLA cannot be pinned; their
  keys always count as autotuned.

The command that writes a set is a lab tool, `python -m measure.dump_fla_configs results/fla-configs` (on the GPU:
build `graphs` on the 27B shapes with synthetic weights as the runner does, autotune afresh, warm up, dump). The
committed sets live in `results/fla-configs/<GPU>/`.

Tests: tests/test_fla_configs.py (CPU: the files round-trip through FLA's loader in a strict-mode subprocess, the
report counts loaded and autotuned keys, the pin's refusal and its no-set and no-CUDA paths, the GPU-name
sanitizer matches FLA's); tests/test_gpu_fla_configs.py (H200: a second process with the dumped set autotunes
nothing, chooses the same configs and gives the first process's forward bit for bit).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch

LOG = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
PINNED_ROOT = REPO / "results" / "fla-configs"
MANIFEST = "manifest.json"
FLA_CACHE_MODULE = "fla.ops.utils.cache"  # reads FLA_CACHE_MODE when first imported
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")

_told_unpinned = False  # the "autotuning stays on" line is logged once per process


def sanitize_gpu_name(gpu_name: str) -> str:
    """The folder name FLA uses for a GPU (`fla.ops.utils.cache.sanitize_gpu_name`), computable before fla is
    imported; tests/test_fla_configs.py checks that both agree."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu"


def pin_fla_configs(root: str | os.PathLike = PINNED_ROOT, *, gpu_name: str | None = None) -> dict:
    """Point FLA's config cache at `root/<GPU>` in strict mode when a pinned set for this GPU exists.

    `gpu_name`: the device name (default: `FLA_GPU_NAME`, else CUDA device 0's; without CUDA and without a name
    this does nothing). Must run before FLA's config cache is imported, else RuntimeError, unless the imported cache
    already holds exactly what this call would set (a second call in a process, or a child started with the pinned
    environment). Returns `{pinned, dir, reason}`."""
    global _told_unpinned
    if gpu_name is None:
        if not torch.cuda.is_available():
            return {"pinned": False, "dir": None, "reason": "no CUDA device: FLA does not run here"}
        gpu_name = os.environ.get("FLA_GPU_NAME") or torch.cuda.get_device_name(0)
    directory = Path(root).resolve() / sanitize_gpu_name(gpu_name)
    has_set = (directory / MANIFEST).is_file()
    if FLA_CACHE_MODULE in sys.modules and _in_force() != (has_set, directory if has_set else None):
        raise RuntimeError(
            f"pin_fla_configs must run before fla is imported: FLA read FLA_CACHE_MODE="
            f"{sys.modules[FLA_CACHE_MODULE].FLA_CACHE_MODE.value} at its import, and pinning "
            f"{directory} now would be ignored; call it first thing in the process"
        )
    if not has_set:
        reason = f"no pinned FLA configs for {gpu_name} ({directory / MANIFEST} missing): FLA autotunes"
        if not _told_unpinned:
            LOG.warning("%s; write them with `python -m measure.dump_fla_configs %s`", reason, root)
            _told_unpinned = True
        return {"pinned": False, "dir": str(directory), "reason": reason}
    os.environ["FLA_CACHE_MODE"] = "strict"
    os.environ["FLA_CONFIG_DIR"] = str(directory)
    LOG.info("FLA configs pinned: FLA_CACHE_MODE=strict, FLA_CONFIG_DIR=%s", directory)
    return {"pinned": True, "dir": str(directory), "reason": None}


def _in_force() -> tuple[bool, Path | None]:
    """(strict mode, its folder) as the imported FLA config cache holds them; (False, None) when not strict."""
    cache = sys.modules[FLA_CACHE_MODULE]
    if cache.FLA_CACHE_MODE is not cache.FlaCacheMode.STRICT:
        return False, None
    return True, Path(cache.get_fla_config_dir()).resolve()


def fla_autotuners(modules: Iterable[ModuleType] | None = None) -> list:
    """Every triton `Autotuner` (FLA's `CachedAutotuner` included) reachable from the attributes of `modules`
    (default: every imported `fla` module), unwrapping `triton.heuristics`; each once, in discovery order."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    if modules is None:
        modules = [m for name, m in list(sys.modules.items()) if name == "fla" or name.startswith("fla.")]
    found: dict[int, Autotuner] = {}
    for module in modules:
        for value in list(vars(module).values()):
            while isinstance(value, (Autotuner, Heuristics)):
                if isinstance(value, Autotuner):
                    found.setdefault(id(value), value)
                value = value.fn
    return list(found.values())


def kernel_name(tuner) -> str:
    """The name FLA files a kernel's configs under (`CachedAutotuner.kernel_name`; the jitted function's name)."""
    return getattr(tuner, "kernel_name", None) or tuner.base_fn.__name__


def config_entry(config) -> dict:
    """A `triton.Config` as FLA's loader reads it (`CachedAutotuner.maybe_load_cached_config`)."""
    if config.pre_hook is not None:
        raise ValueError(f"config {config} has a pre-hook, which FLA's config files cannot hold")
    return {field: getattr(config, field, None) for field in CONFIG_FIELDS} | {"kwargs": dict(config.kwargs)}


def kernel_config_files(tuners: Iterable) -> dict[str, dict]:
    """FLA config-file contents (`{kernel_name: {kernel_name, triton_version, autotune_entries}}`) of the tuning
    caches of `tuners` (FLA `CachedAutotuner`s; empty caches skipped). Two autotuners of one name share a file, as
    they do in FLA; the same key tuned to two configs under one name raises ValueError."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    files: dict[str, dict] = {}
    for tuner in tuners:
        if not tuner.cache:
            continue
        name = kernel_name(tuner)
        if not isinstance(tuner, CachedAutotuner):
            raise ValueError(f"{name} is a plain triton.autotune kernel: FLA does not load configs for it")
        entries = files.setdefault(
            name, {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": {}}
        )["autotune_entries"]
        for key, config in tuner.cache.items():
            digest = AutotuneKey.key_hash(key)
            entry = {"autotune_key": AutotuneKey.normalize_autotune_key(key), "config": config_entry(config)}
            if entries.get(digest, entry) != entry:
                raise ValueError(f"two autotuners named {name} chose different configs for key {list(key)}")
            entries[digest] = entry
    return files


def dump_fla_configs(
    root: str | os.PathLike = PINNED_ROOT, *, modules: Iterable[ModuleType] | None = None, commit: dict | None = None
) -> dict:
    """Write the used FLA autotuners' caches (of `modules`, default every imported fla module) to `root/<GPU>/`
    (FLA's `get_gpu_info()`), replacing the `*.json` files there, with `manifest.json` (`commit`: this lab's git
    state, e.g. `ablations.envinfo.git_state()`). Returns the manifest. ValueError when nothing was tuned."""
    import triton
    from fla.ops.utils.cache import CachedAutotuner, get_gpu_info

    tuners = fla_autotuners(modules)
    unpinnable = sorted({kernel_name(t) for t in tuners if t.cache and not isinstance(t, CachedAutotuner)})
    files = kernel_config_files(t for t in tuners if isinstance(t, CachedAutotuner))
    if not files:
        raise ValueError("no FLA autotuner has a tuned key: run a warm-up on CUDA before dumping")
    directory = Path(root) / get_gpu_info()
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.json"):
        old.unlink()
    for name, content in sorted(files.items()):
        (directory / f"{name}.json").write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
    manifest = {
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_dir": directory.name,
        "triton_version": triton.__version__,
        "fla_version": importlib.metadata.version("fla-core"),  # the distribution of the fla package
        "torch_version": torch.__version__,
        "commit": commit,
        "kernels": {name: len(content["autotune_entries"]) for name, content in sorted(files.items())},
        "unpinnable_kernels": unpinnable,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def autotune_report(modules: Iterable[ModuleType] | None = None) -> dict:
    """What FLA's config cache did in this process: its mode and folder, and per used autotuner key whether it came
    from the pinned files (`loaded_keys`) or not (`autotuned_keys`, listed in `autotuned` as {kernel, key}).
    Empty-handed (`kernels: 0`) where fla was never imported."""
    if FLA_CACHE_MODULE not in sys.modules:
        return {"pinned": False, "mode": None, "dir": None, "files": 0, "kernels": 0, "loaded_keys": 0,
                "autotuned_keys": 0, "autotuned": []}  # fmt: skip
    import triton
    from fla.ops.utils import cache as fla_cache

    pinned = fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.STRICT
    directory = fla_cache.get_fla_config_dir()
    used = [t for t in fla_autotuners(modules) if t.cache]
    loaded, autotuned = 0, []
    for tuner in used:
        name = kernel_name(tuner)
        pinned_file = None
        if pinned and isinstance(tuner, fla_cache.CachedAutotuner):
            pinned_file = fla_cache.KernelConfigFile.from_file(directory / f"{name}.json")
        for key, config in tuner.cache.items():
            entry = None if pinned_file is None else pinned_file.lookup_exact(fla_cache.AutotuneKey(key))
            if entry is not None and _config_of(entry["config"], triton) == config:
                loaded += 1
            else:
                autotuned.append({"kernel": name, "key": fla_cache.AutotuneKey.normalize_autotune_key(key)})
    files = sorted(p.name for p in directory.glob("*.json") if p.name != MANIFEST) if directory.is_dir() else []
    return {
        "pinned": pinned,
        "mode": fla_cache.FLA_CACHE_MODE.value,
        "dir": str(directory),
        "files": len(files),
        "kernels": len(used),
        "loaded_keys": loaded,
        "autotuned_keys": len(autotuned),
        "autotuned": autotuned,
    }


def _config_of(entry: dict, triton):
    """The `triton.Config` FLA builds from a file entry (no pre-hook), for comparison with a cached one."""
    extra = {k: entry.get(k) for k in ("maxnreg", "ir_override")}
    return triton.Config(
        entry["kwargs"], num_warps=entry["num_warps"], num_stages=entry["num_stages"], num_ctas=entry["num_ctas"],
        **extra,
    )  # fmt: skip


def chosen_configs(modules: Iterable[ModuleType] | None = None) -> dict[str, dict]:
    """Every used FLA autotuner's choices as `{kernel_name: {key hash: config entry}}` (what two processes compare)."""
    from fla.ops.utils.cache import AutotuneKey

    chosen: dict[str, dict] = {}
    for tuner in fla_autotuners(modules):
        for key, config in tuner.cache.items():
            chosen.setdefault(kernel_name(tuner), {})[AutotuneKey.key_hash(key)] = config_entry(config)
    return chosen
