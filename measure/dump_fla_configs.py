"""Write a pinned set of FLA autotune configs for this GPU (`engine.fla_configs`: the pin, the file format).

    python -m measure.dump_fla_configs results/fla-configs   # on the GPU

`build_warm_backbone` builds a registry stage (default `graphs`) on CUDA as the runner does (plan `gpu-27b`'s shapes
and weight seed, `prepare_process`) and warms it up; the command first switches FLA's config cache off (whatever the
environment pinned), so every key tunes afresh, then writes the autotuners' choices with
`engine.fla_configs.dump_fla_configs` and the lab's commit (`ablations.envinfo.git_state`) into the manifest.
Tests: tests/test_gpu_fla_configs.py (a second process with the dumped set autotunes nothing, chooses the same
configs and gives the same forward bits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ablations.envinfo import git_state
from ablations.plans import load_plan
from engine.fla_configs import FLA_CACHE_MODULE, dump_fla_configs


def build_warm_backbone(stage: str = "graphs"):
    """`stage` built on CUDA as the runner builds it and warmed up; returns (backbone, weights, warm-up dict)."""
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA device (FLA's kernels tune on the GPU)")
    from tqdm import tqdm

    from engine.stages import BuildContext, build_backbone, prepare_process
    from reference.shapes import get_shapes
    from reference.weights import synthetic_weights

    plan = load_plan("gpu-27b")
    prepare_process([stage], "cuda")
    weights = synthetic_weights(get_shapes(plan.shapes), seed=plan.weights_seed, device=torch.device("cuda"))
    backbone = build_backbone(stage, BuildContext(weights))
    warm = backbone.warm_up(lambda items: tqdm(items, desc=f"{stage}: capture", unit="graph", file=sys.stderr))
    if not warm:
        raise RuntimeError(f"stage {stage} has no warm-up (use a graphs stage)")
    return backbone, weights, warm


def dump_command(root: Path, stage: str) -> dict:
    """Autotune afresh, warm `stage` up and dump its FLA configs under `root`; returns the manifest."""
    if FLA_CACHE_MODULE in sys.modules:
        raise RuntimeError("FLA was imported before the dump could switch autotuning on")
    os.environ["FLA_CACHE_MODE"] = "disabled"
    os.environ.pop("FLA_CONFIG_DIR", None)
    build_warm_backbone(stage)
    return dump_fla_configs(root, commit=git_state())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.dump_fla_configs", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="folder of pinned sets, one sub-folder per GPU (results/fla-configs)")
    parser.add_argument("--stage", default="graphs", help="the registry stage to warm up (default graphs)")
    args = parser.parse_args(argv)
    try:
        manifest = dump_command(args.root, args.stage)
    except RuntimeError as error:  # no CUDA, fla imported too early, a stage without a warm-up: say why
        print(f"measure.dump_fla_configs: {error}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
