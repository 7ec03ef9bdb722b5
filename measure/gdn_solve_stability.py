"""The in-chunk solve of `kernels/gdn_chunk.py` on the CPU: recursive block inversion against a Neumann product.

    python -m measure.gdn_solve_stability          # writes results/gdn-chunk/solve-stability-cpu.json

Both compute T = (I + A)⁻¹ for one 64-row chunk's strictly lower A = strict_lower(diag(β) K Kᵀ ⊙ e^(γ_r − γ_s)) with
10 dense 64 x 64 x 64 products in fp32 (torch on the CPU, IEEE), exact in real arithmetic:
* recursive (the kernel's): D ← I − A on the 2 x 2 diagonal blocks, then D ← D − D (L_b D) for b = 2 ... 32;
* Neumann: N = −A, P = I + N; five times N ← N², P ← P + P N (P = I + N + ... + N⁶³).
Each is compared with the fp64 inverse (torch.linalg.inv): max |Δ| / max |T|, over seeded chunks of unit keys in two
regimes: "typical" (random keys with a mild shared component, β uniform, decay up to e^-0.3 per row) and
"correlated" (keys near one direction, β near 1, decay e^-0.01 at most per row: the delta rule's hard case).
The same fp32 figures as the kernel's fp32 mode, where the interpreter's dots are numpy's fp32 products.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results" / "gdn-chunk" / "solve-stability-cpu.json"
CHUNK, KEY_DIM, SEEDS = 64, 128, (0, 1, 2)


def chunk_matrix(regime: str, seed: int) -> torch.Tensor:
    """A [64, 64] fp32 strictly lower A of one chunk in `regime` (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(CHUNK, KEY_DIM, generator=gen)
    shared = torch.randn(1, KEY_DIM, generator=gen)
    if regime == "typical":
        k = F.normalize(noise + 0.5 * shared, dim=-1)
        beta, g = torch.rand(CHUNK, generator=gen), -0.3 * torch.rand(CHUNK, generator=gen)
    else:
        k = F.normalize(0.3 * noise + shared, dim=-1)
        beta, g = 0.9 + 0.1 * torch.rand(CHUNK, generator=gen), -0.01 * torch.rand(CHUNK, generator=gen)
    gamma = g.cumsum(0)
    return torch.tril((k @ k.T) * torch.exp(gamma[:, None] - gamma[None, :]) * beta[:, None], -1)


def recursive_inverse(a: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(CHUNK)
    first = (rows[:, None] // 2 == rows[None, :] // 2) & (rows[:, None] > rows[None, :])
    inverse = torch.eye(CHUNK) - torch.where(first, a, 0.0)
    block = 2
    while block < CHUNK:
        off = (rows[:, None] // (2 * block) == rows[None, :] // (2 * block)) & (
            rows[:, None] // block > rows[None, :] // block
        )
        inverse = inverse - inverse @ (torch.where(off, a, 0.0) @ inverse)
        block *= 2
    return inverse


def neumann_inverse(a: torch.Tensor) -> torch.Tensor:
    power = -a
    product = torch.eye(CHUNK) + power
    for _ in range(5):
        power = power @ power
        product = product + product @ power
    return product


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.gdn_solve_stability", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # no options: --help and a refusal of unknown ones
    cases = []
    for regime in ("typical", "correlated"):
        for seed in SEEDS:
            a = chunk_matrix(regime, seed)
            exact = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + a.double())
            scale = float(exact.abs().max())
            errors = {
                name: float((method(a).double() - exact).abs().max()) / scale
                for name, method in (("recursive", recursive_inverse), ("neumann", neumann_inverse))
            }
            cases.append({"regime": regime, "seed": seed, "max_abs_inverse": scale, "relative_error": errors})
            print(f"{regime:<10} seed {seed}: recursive {errors['recursive']:.2e}  neumann {errors['neumann']:.2e}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"torch": torch.__version__, "dtype": "float32", "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
