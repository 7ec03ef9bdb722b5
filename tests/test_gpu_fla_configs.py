"""H200: pinned FLA configs make a second process choose the first one's kernels without autotuning any of them.

Process one (FLA autotuning on) builds and warms up the `graphs` backbone on the 27B shapes
(`ablations.dump_fla_configs.build_warm_backbone`), dumps its FLA configs into a temporary root, and saves its chosen
configs and the drone workload's forward. Process two pins that root before fla is imported, warms up the same
backbone and must report zero autotuned keys, hold the same chosen configs, and give the first forward bit for bit.
Each process is a fresh `python -c` (FLA reads its cache mode once per process); each warm-up costs what the
server's start does (README, "Serving")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_process(root: str, out: str, pin: bool) -> None:
    """One process: (pin), build and warm up `graphs`, (dump), save the chosen configs, the report and the forward."""
    from ablations.dump_fla_configs import build_warm_backbone
    from engine import fla_configs

    if pin:
        state = fla_configs.pin_fla_configs(root)
        assert state["pinned"], state
    backbone, weights, warm = build_warm_backbone("graphs")
    if not pin:
        fla_configs.dump_fla_configs(root, commit=None)
    from ablations.workloads import resolve
    from reference.service import DecisionModel

    plan = DecisionModel(backbone, weights).plan(resolve(["drone"])[0].request)
    hidden = backbone.forward(backbone.prepare(plan.candidates, plan.groups))
    torch.save(hidden.cpu(), Path(out) / "hidden.pt")
    (Path(out) / "configs.json").write_text(
        json.dumps({"chosen": fla_configs.chosen_configs(), "report": warm["fla_configs"]})
    )


def _process(root: Path, out: Path, pin: bool) -> dict:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    code = f"import tests.test_gpu_fla_configs as t; t.run_process({str(root)!r}, {str(out)!r}, {pin})"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "configs.json").read_text()) | {"hidden": torch.load(out / "hidden.pt")}


@pytest.mark.gpu
def test_pinned_configs_choose_the_same_kernels_without_autotuning(tmp_path):
    root = tmp_path / "fla-configs"
    first = _process(root, tmp_path / "first", pin=False)
    assert first["report"]["autotuned_keys"] > 0  # the first process tuned what it dumped
    second = _process(root, tmp_path / "second", pin=True)
    report = second["report"]
    assert report["pinned"] and report["autotuned_keys"] == 0, report["autotuned"]
    assert report["loaded_keys"] == first["report"]["autotuned_keys"]
    assert second["chosen"] == first["chosen"]
    assert torch.equal(second["hidden"], first["hidden"])
