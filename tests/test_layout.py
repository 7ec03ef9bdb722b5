"""The repository layout: our `kernels/` package must not shadow, or be shadowed by, Hugging Face's hub package that
is also named `kernels`, and transformers must keep working beside it."""

from __future__ import annotations

import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_kernels_import_resolves_inside_the_repo():
    kernels = importlib.import_module("kernels")
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"


def test_transformers_does_not_mistake_our_kernels_for_the_hub_package():
    from transformers.utils.import_utils import is_kernels_available

    # transformers would import hub-kernel functions from `kernels` if it thought the hub package were installed;
    # with only ours on the path it must say no, and the Qwen3.5 model must still build.
    assert not is_kernels_available()
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    from reference.shapes import TINY

    config = TINY.to_hf_config()
    config.num_hidden_layers = 4
    config.layer_types = TINY.layer_types[:4]
    import torch

    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_required_top_level_folders_exist():
    for name in [
        "reference",
        "kernels",
        "engine",
        "ablations",
        "bench",
        "measure",
        "paper",
        "notebooks",
        "tests",
        "results",
    ]:
        assert (REPO / name).is_dir(), name
    for name in ["noxfile.py", "README.md", "pyproject.toml", ".ci/run"]:
        assert (REPO / name).is_file(), name


def test_ablations_holds_the_ladder_and_nothing_else():
    """The runner and what it needs (`bit_identity.py` is the runner's step 7: the per-kernel table of every record
    whose plan runs `fused`; `clocks.py` the card's clocks beside each timing; `kernel_bytes.py` the bytes per call of
    the engine's own kernels, which the probes' tile sweeps and `measure.kernel_floors` both read); the measurement
    tools are `bench/` (the server from outside) and `measure/` (the engine and kernels)."""
    ladder = set(
        "__init__ run plans records targets probes timing clocks kernel_bytes workloads envinfo bit_identity".split()
    )
    assert {path.stem for path in (REPO / "ablations").glob("*.py")} == ladder
