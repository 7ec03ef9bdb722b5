"""The `kernel_tiles` probe's launches (ablations/probes.py) under the Triton interpreter: every tile of every sweep
launches the kernel with its current signature and gives the public wrapper's outputs bit for bit.

The probe launches the kernels' Triton functions directly (a tile is a launch parameter the wrappers derive from the
widths), so a kernel whose signature changes breaks the probe without any GPU test noticing on a CPU machine: that
happened to residual_rmsnorm (v3's split-K arguments) and gdn_prep (v4's slots, v5's taps) until this test. On the
CPU the bits cannot depend on the tile (numpy's reductions run per row), so every tile must equal the wrapper; on the
GPU the probe records each tile's bit-equal share against the shipped one instead.
"""

from __future__ import annotations

import pytest
import torch

from ablations import probes

ROWS = 13  # four packed sequences of gdn_prep's sweep: 4, 0, 3 and 6 rows


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(probes.TILE_SWEEPS))
def test_every_tile_launches_and_equals_the_wrapper(kernel):
    sweep = probes.TILE_SWEEPS[kernel]("cpu", ROWS)
    want = sweep["wrapper"]()
    assert len(sweep["tiles"]) > 1
    for name, launch in sweep["tiles"]:
        outs = sweep["outputs"]()
        launch(outs)
        for got, expected in zip(outs, want, strict=True):
            assert not got.isnan().any(), f"{kernel} {name}: output elements not written"
            assert torch.equal(got.view(expected.shape), expected), f"{kernel} {name}: differs from the wrapper"
