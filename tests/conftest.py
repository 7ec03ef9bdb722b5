"""Shared test setup: GPU tests are skipped where no CUDA device is present; paths to the shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run through the interpreter where no GPU is present; it must be chosen before triton is imported.
# With a GPU, the GEMMs run as the runner runs them: row-count invariant (engine.backbone.use_row_invariant_gemms).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    from engine.backbone import use_row_invariant_gemms  # imports FLA through reference/model.py, in its order

    use_row_invariant_gemms()

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("JEVLAB_SHARED", REPO.parent / "shared"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"shared data folder not found at {SHARED} (set JEVLAB_SHARED)")
    return SHARED
