"""The engine's one GEMM seam: every projection of the backbone goes through the op the config's `gemm` picks.

    y [N, out] bf16 = x [N, in] bf16 @ weight.dataᵀ          (fp32 accumulation inside the library; one rounding)

Choices (`EngineConfig.gemm`):
* `cublas`: `torch.nn.functional.linear`, with whatever cuBLAS workspace the process has. No row-count invariance
  is claimed: on the H200 cuBLAS's default heuristics pick a split-K kernel for the down projection (K = 17,408) at
  150-199 rows, so a row's bits there depend on how many rows share the call (the attempts record and `tree` notes).
* `cublas_row_invariant`: the same call in a process whose cuBLAS has no workspace (`CUBLAS_WORKSPACE_CONFIG=:0:0`),
  which rules out the split-K kernels: every GEMM shape of the 27B was row-count invariant on the H200 at the row
  counts requests have (tests/test_gpu_gemm_rows.py). The tree is bitwise against the flat layout only because of
  this, so a stage that claims it (`tree` and after) must run in such a process.

cuBLAS reads the variable once per process, when it first sizes a workspace, so the setting is process state, not a
call argument: `prepare_process` sets it before the first CUDA GEMM for the configs a process will build (the runner,
the server and the GPU tests' conftest call it), and `check_process` (called by `EngineBackbone` at build time) fails
loudly when a config's GEMM choice does not match the process. On the CPU there is no cuBLAS; both choices are
`F.linear` on torch's CPU kernels, which are row-count invariant (tests/test_engine_tree.py).

Tuned GEMMs (issue 14) will pick a kernel per shape and row bucket from a tuning table; `engine/gemm_table.py` holds its
schema and loader, `kernels.residual_rmsnorm_splitk` the split-K reduction. The tuner, the table and a `gemm` stage
that reads it come with a GPU session; no choice here reads a table yet.

Weights are `engine.weights.Weight` (data, format, optional scale): only `bf16` exists today; formats with a scale
(FP8, split-K layouts) add a branch here and nothing to the layer types.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import EngineConfig
from engine.weights import Weight

ROW_INVARIANT_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}  # no workspace: no split-K kernels
NEEDS_ROW_INVARIANT = "cublas_row_invariant"


def linear(x: Tensor, weight: Weight) -> Tensor:
    """x [N, in] bf16 @ weight.dataᵀ -> [N, out] bf16 (the bf16 format; the only one so far)."""
    return F.linear(x, weight.data)


def prepare_process(configs: Iterable[EngineConfig]) -> dict[str, str]:
    """Put the process in the GEMM state the configs need, before its first CUDA GEMM; returns what is in force.

    Sets `ROW_INVARIANT_CUBLAS` when any config asks for `cublas_row_invariant` and the variable is unset (a user's
    own value stands, and `check_process` then judges it). Raises when it would have to set the variable after CUDA
    was initialised in this process, since cuBLAS may already have read it.
    """
    if any(c.gemm == NEEDS_ROW_INVARIANT for c in configs):
        for name, value in ROW_INVARIANT_CUBLAS.items():
            if name not in os.environ:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    raise RuntimeError(
                        f"{name} must be set before CUDA is initialised (cuBLAS reads it once per process); "
                        f"call engine.gemm.prepare_process first, or start the process with {name}={value}"
                    )
                os.environ[name] = value
    return {name: os.environ[name] for name in ROW_INVARIANT_CUBLAS if name in os.environ}


def check_process(config: EngineConfig, device: torch.device) -> None:
    """Raise unless this process can run `config`'s GEMM choice on `device` as the config claims."""
    if device.type != "cuda" or config.gemm != NEEDS_ROW_INVARIANT:
        return
    wrong = {
        name: os.environ.get(name) for name, value in ROW_INVARIANT_CUBLAS.items() if os.environ.get(name) != value
    }
    if wrong:
        raise RuntimeError(
            f"gemm={config.gemm!r} needs {ROW_INVARIANT_CUBLAS} in this process before its first GEMM, but it has "
            f"{wrong}: call engine.gemm.prepare_process([config]) at start-up (row-count invariance is what makes "
            "the tree bitwise against the flat layout)"
        )
