"""GPU: tile shapes of the three costliest fused kernels (per the drone profile: silu_mul, residual_rmsnorm, gdn_prep)
and of the gated norm and attn_prep (1.5-2.2x their floors in stage `core`, issue 22) at the 27B widths and the
drone's 971 packed rows, timed against the shipped shape, outputs compared bit for bit.

A tile shape is a kernel's (rows per program, columns per program, warps). The shipped shape comes from the widths
alone (`kernels.numerics.tile_elements`), which keeps a row's bits independent of the batch; a candidate must do
the same, so only width-derived shapes are tried. Each candidate launches the kernel's own Triton function on fresh
random inputs (never zeros) with NaN-poisoned outputs. Asserted: silu_mul candidates are bitwise equal to the shipped
shape (element-wise: the tile cannot change a bit); the others are compared and their bit-equal share printed (a
reduction's order can follow the warp count). Times: the kernel's mean CUPTI duration over launches captured in one
CUDA graph, L2 flushed before each (`probes.graph_kernel_us`).
Effective bandwidth counts each input read once and each output written once. The measurement is the runner's
`kernel_tiles` probe (ablations/probes.py, recorded in every GPU run record).
"""

from __future__ import annotations

import pytest

from ablations import probes

pytestmark = pytest.mark.gpu
COPY_TBPS = 4.17  # the H200's measured copy rate (results/runs/20261130T131815Z-nvidia-h200-89aea6c.json)


def test_gpu_kernel_tile_sweep_27b():
    rows = probes.kernel_tiles()["cases"]
    lines = [f"\n{'kernel':<18} {'tile':<24} {'us':>8} {'TB/s':>6} {'of copy':>8} {'bit-equal':>10}"]
    for r in rows:
        lines.append(f"{r['kernel']:<18} {r['tile']:<24} {r['us']:8.1f} {r['tbps']:6.2f} "
                     f"{r['tbps'] / COPY_TBPS:8.0%} {r['equal_share']:10.6f}")  # fmt: skip
    print("\n".join(lines) + "\n(first row of each kernel: the shipped tile; synthetic random inputs)")
    assert all(r["nan_free"] for r in rows), [r for r in rows if not r["nan_free"]]  # every output element written
    assert all(r["equal_share"] == 1.0 for r in rows if r["kernel"] == "silu_mul")
