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
(`engine.gemm.prepare_process`). Writes $OUT/gpu_gemm_rows.json; asserts that both processes measured
every case and that without the workspace every GEMM is row-count invariant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROW_PAIRS = [(359, 199), (330, 190), (347, 179), (277, 160), (294, 150), (971, 337)]  # last: drone (bitwise there)


def gemm_shapes() -> dict[str, tuple[int, int]]:
    """(out features, in features) of the engine's GEMMs at the 27B shapes."""
    from reference.shapes import QWEN38_27B as S

    hidden, hq, hkv, d = S.hidden_size, S.num_attention_heads, S.num_key_value_heads, S.head_dim
    return {
        "gdn_in": (S.conv_dim + S.linear_value_dim + 2 * S.linear_num_value_heads, hidden),
        "gdn_out": (hidden, S.linear_value_dim),
        "attn_in": (2 * hq * d + 2 * hkv * d, hidden),
        "attn_out": (hidden, hq * d),
        "gate_up": (2 * S.intermediate_size, hidden),
        "down": (hidden, S.intermediate_size),
    }


def measure() -> list[dict]:
    import torch
    import torch.nn.functional as F
    import triton

    gen = torch.Generator(device="cuda").manual_seed(21)
    cases = []
    for name, (n, k) in gemm_shapes().items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
        for flat_rows, tree_rows in ROW_PAIRS:
            x = torch.randn(flat_rows, k, generator=gen, device="cuda").bfloat16()
            big, small = F.linear(x, w), F.linear(x[:tree_rows], w)
            equal_rows = (big[:tree_rows] == small).all(dim=1).float().mean().item()
            cases.append({
                "gemm": name, "n": n, "k": k, "flat_rows": flat_rows, "tree_rows": tree_rows,
                "equal_row_share": equal_rows,
                "flat_us": 1000 * triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w), return_mode="median"),
                "tree_us": 1000 * triton.testing.do_bench(
                    lambda x=x, w=w, m=tree_rows: F.linear(x[:m], w), return_mode="median"
                ),
            })  # fmt: skip
    return cases


@pytest.mark.gpu
def test_gpu_gemm_row_count_invariance_27b():
    from engine.gemm import ROW_INVARIANT_CUBLAS

    runs = {}
    default_env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}  # conftest sets it
    for label, env in (("default", default_env), ("no_workspace", default_env | ROW_INVARIANT_CUBLAS)):
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [f"\n{'gemm':<9} {'rows':>9}   " + "   ".join(f"{lab:>34}" for lab in runs)]
    lines.append(f"{'':<9} {'':>9}   " + "   ".join(f"{'equal rows  flat us  tree us':>34}" for _ in runs))
    for i, case in enumerate(runs["default"]):
        cells = []
        for lab in runs:
            c = runs[lab][i]
            cells.append(f"{c['equal_row_share']:>10.3f} {c['flat_us']:>8.1f} {c['tree_us']:>8.1f}".rjust(34))
        lines.append(f"{case['gemm']:<9} {case['flat_rows']:>4}>{case['tree_rows']:<4}   " + "   ".join(cells))
    print("\n".join(lines))
    if os.environ.get("OUT"):
        from ablations import envinfo

        written = runs | {"env": envinfo.collect("cuda")}  # commit, GPU, versions, time
        Path(os.environ["OUT"], "gpu_gemm_rows.json").write_text(json.dumps(written, indent=1))
    expected = len(gemm_shapes()) * len(ROW_PAIRS)
    assert all(len(cases) == expected for cases in runs.values())
    assert all(c["equal_row_share"] == 1.0 for c in runs["no_workspace"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(measure()))
