"""Shared test setup: the lab's caches inside the checkout; GPU tests are skipped where no CUDA device is present;
paths to the shared data."""

from __future__ import annotations

import gc
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Triton's compiled kernels and matplotlib's font cache in the ignored .cache/ of the checkout, not under ~ (the same
# defaults as noxfile.py's LAB_ENV), before either package is imported; subprocesses of the tests inherit them.
os.environ.setdefault("TRITON_CACHE_DIR", str(REPO / ".cache" / "triton"))
os.environ.setdefault("MPLCONFIGDIR", str(REPO / ".cache" / "matplotlib"))
if "PYTEST_XDIST_WORKER" in os.environ:
    # A pytest-xdist worker (`pytest -n N`): one OpenMP thread (torch's intra-op threads, MKL, numpy's BLAS), set
    # before torch or numpy is imported; the workers are the parallelism. With two threads each, `-n 2` on the 2-core
    # dev machine took 1,157 s (2,238 s of CPU); with one, 769 s (1,470 s of CPU), at 607dd64.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The process as the runner prepares it for every stage (engine.stages.prepare_process): Triton kernels through the
# interpreter and row-count-invariant CPU GEMMs where no GPU is present (chosen before triton is imported),
# row-count-invariant cuBLAS with a GPU.
from engine.stages import STAGE_LIST, prepare_process  # noqa: E402

if not torch.cuda.is_available():
    prepare_process([stage.name for stage in STAGE_LIST], "cpu")
else:
    from engine.fla_configs import pin_fla_configs

    prepare_process([stage.name for stage in STAGE_LIST], "cuda")
    pin_fla_configs()  # the committed FLA configs of this GPU, before any test module imports fla

SHARED = Path(os.environ.get("JEVLAB_SHARED", REPO.parent / "shared"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


COMPILE_TARGETS = "tests/test_kernels.py::test_kernels_compile_for["
SHARED_FORWARDS = "tests/test_core_stage.py::"  # the module's tests share its forwards (`Forwards`)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`pytest -n N` (pytest-xdist; `nox -s tests` runs `-n 2`): xdist's `load` distribution, each test to whichever
    worker is free, except that the compile targets (`test_kernels_compile_for`, tests/test_kernels.py) go to one
    worker together and first, so that their compiles start once, at the start of the run, and tests/test_core_stage.py
    goes to one worker whole, where its tests share their forwards. xdist's own way to keep
    tests together (`--dist loadgroup`) appends the group to the test ids, which pytest 9.2 no longer lets it change
    (pytest-dev/pytest-xdist#1386): the targets would be spread, and every worker that ran one would start all three."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CompileTargetsTogether(LoadScopeScheduling):
        """A unit for each test, one for the compile targets and one for the core-stage module; units of more tests
        are handed out first (xdist's `--loadscope-reorder`, on by default)."""

        def _split_scope(self, nodeid: str) -> str:
            return next((unit for unit in (COMPILE_TARGETS, SHARED_FORWARDS) if nodeid.startswith(unit)), nodeid)

    return CompileTargetsTogether(config, log)


@pytest.fixture(scope="module", autouse=True)
def earlier_modules_cuda_memory_released():
    """Before each test module on a GPU: collect the reference cycles earlier modules left and return the blocks they
    freed to the driver, so that a module's 27B fixture does not meet the previous module's model. A module fixture's
    own teardown cannot do it: pytest still holds the fixture's value while the teardown runs and drops it after, and
    a value caught in a reference cycle waits for the cycle collector. Until the graph cache held its backbone's
    forward weakly (`engine.graphs.weak_callable`) every engine with graphs was such a cycle, and on an 80 GB H100 the
    runner's gate process ran out of memory in tests/test_gpu_gdn_chunk.py's fixture with 77.4 GB still allocated after
    tests/test_gpu_graphs.py (33f9910, 450783f, af0f763; `ablations.run.run_gates` reran it alone). One cycle is left,
    found on the CPU: the first import of engine.backbone inside `build_engine` runs torch.fx's `wrap`, whose frame
    keeps itself (`inspect.currentframe()`) and every frame above it, `build_engine`'s `merged` included."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"shared data folder not found at {SHARED} (set JEVLAB_SHARED)")
    return SHARED


# ---- the server tests' model and server (tests/test_server*.py)


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny twin on hf_torch with seeded synthetic weights (`reference.service.default_model`)."""
    from reference.service import default_model

    return default_model()


@pytest.fixture(scope="module")
def server(tiny_model):
    """A `DecisionServer` of the tiny twin on a free loopback port, serving on a background thread."""
    import io

    from engine.server import DecisionServer

    with DecisionServer(tiny_model, port=0, access_log=io.StringIO()) as running:
        running.start()
        yield running


@pytest.fixture(scope="module")
def drone() -> dict:
    """Open-Jev's drone request."""
    from reference.data import open_jev_workloads

    return open_jev_workloads()["drone"]["request"]
