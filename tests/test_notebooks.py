"""Every notebook runs headless on the committed results (they are jupytext percent-format scripts), as a Jupyter
kernel runs it: without `__file__`, from the repository root or from notebooks/ (where `jupytext --execute` starts the
kernel). The `notebooks` nox session executes them in a real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.py"))
# What a kernel does with a cell: exec the source in a namespace that has no __file__.
KERNEL_LIKE = "import sys; source = open(sys.argv[1]).read(); exec(compile(source, sys.argv[1], 'exec'), {})"


def test_there_is_a_notebook():
    assert NOTEBOOKS


@pytest.mark.parametrize("cwd", [REPO, REPO / "notebooks"], ids=["repo", "notebooks"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_headless(path, cwd):
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_LIKE, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "record:" in done.stdout


def test_a_notebook_outside_the_checkout_says_so(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_LIKE, str(NOTEBOOKS[0])], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1 and "run from inside the jevlab checkout" in done.stderr, done.stderr[-2000:]
