"""GPU: are cuBLAS's bf16 GEMMs row-count invariant at the 27B widths (a row's output bits independent of how many
other rows share the call)? The `tree` stage is bitwise against `fused` only where they are: it runs the same GEMMs
over fewer rows. Run 89aea6c found 5 of 17 workloads (JevBench, 150-199 tree rows against 277-359 flat rows) where
tree and fused answers differ, all else being prefix-invariant.

For each of the engine's six GEMM shapes and each (flat rows, tree rows) pair of those workloads, the first
`tree rows` rows of one random input are multiplied alone and inside the larger call; the share of bit-equal output
rows and the time of both calls are recorded. The same measurement runs twice in fresh processes: with torch's
defaults and with `CUBLAS_WORKSPACE_CONFIG=:0:0` (no cuBLAS workspace, which rules out the split-K variants that need
one). Measured on 2026-11-30 (results/gpu/20261130T135022Z-nvidia-h200-b388a0d-gemm-rows.json): by default the down
projection (K = 17408) is not row-count invariant at 150-199 rows (no equal row), every other case is; without the
workspace every case is, at 5-15 us more per small down GEMM. The engine runs without it
(`engine.gemm.prepare_process`). The measurement is the runner's `gemm_rows` probe (ablations/probes.py,
recorded in every GPU run record); asserts that both processes measured every case and that without the workspace
every GEMM is row-count invariant.
"""

from __future__ import annotations

import pytest

from ablations import probes


@pytest.mark.gpu
def test_gpu_gemm_row_count_invariance_27b():
    runs = probes.gemm_rows()
    lines = [f"\n{'gemm':<9} {'rows':>9}   " + "   ".join(f"{lab:>34}" for lab in runs)]
    lines.append(f"{'':<9} {'':>9}   " + "   ".join(f"{'equal rows  flat us  tree us':>34}" for _ in runs))
    for i, case in enumerate(runs["default"]):
        cells = []
        for lab in runs:
            c = runs[lab][i]
            cells.append(f"{c['equal_row_share']:>10.3f} {c['flat_us']:>8.1f} {c['tree_us']:>8.1f}".rjust(34))
        lines.append(f"{case['gemm']:<9} {case['flat_rows']:>4}>{case['tree_rows']:<4}   " + "   ".join(cells))
    print("\n".join(lines))
    expected = len(probes.gemm_shapes()) * len(probes.ROW_PAIRS)
    assert all(len(cases) == expected for cases in runs.values())
    assert all(c["equal_row_share"] == 1.0 for c in runs["no_workspace"])
