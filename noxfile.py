"""Sessions of the lab. `nox -l` lists them; options after `--` pass through to the command each one runs.

Every session that needs torch shares one venv, `.nox/lab` (the project with the CPU torch wheel and the `dev`,
`report` and `notebooks` groups: tests, gpu_tests, tune_gemm, answer, ablate, report, notebooks, serve, jevbench),
so one copy of torch (about 2.5 GB) is on disk. `replicas` keeps its own, `.nox/lab-replicas` (Ray Serve 2.58 and
its dependencies beside the server's pinned stack are not installed into the shared venv). nox itself gives every
session a venv of its own and has no option to share one (wntrblm/nox#167), so these sessions are declared without one
(`python=False`) and build theirs in `_lab_python`. A venv is created on first use and updated by pip on every run;
delete its folder to rebuild it. `lint` needs only ruff and keeps nox's own venv, `.nox/lint`.

The lab's caches stay inside the checkout, in the ignored `.cache/`: every session runs with `TRITON_CACHE_DIR`
(Triton's compiled kernels) and `MPLCONFIGDIR` (matplotlib's font cache) there (`LAB_ENV`; tests/conftest.py sets the
same defaults for a plain `pytest`).

Every session also works with `--no-venv` (nox's passthrough mode): it then runs in the current interpreter and
installs nothing (`tests` runs in one process where pytest-xdist is missing). That is how the sessions run on the
H200, whose image already has torch, triton and cupy and reaches no package index (the missing wheels travel in
`.whl/`, see README.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["tests", "lint"]
nox.options.reuse_venv = "yes"

PYPROJECT = nox.project.load_toml("pyproject.toml")
CACHE = Path(__file__).resolve().parent / ".cache"
LAB_ENV = {"TRITON_CACHE_DIR": str(CACHE / "triton"), "MPLCONFIGDIR": str(CACHE / "matplotlib")}
LAB_GROUPS = ("dev", "notebooks")  # dev includes report


def _lab_python(session: nox.Session, *groups: str) -> str:
    """The interpreter to run a session's commands with: the shared venv `.nox/lab` (no `groups`: `LAB_GROUPS`) or,
    for other groups, `.nox/lab-<groups>`, created if missing and brought up to date (the project in editable mode,
    the CPU torch wheel, the groups), or the current interpreter, untouched, when nox runs with `--no-venv` /
    `--force-venv-backend none`. Sets `LAB_ENV` for the session's commands either way."""
    session.env.update(LAB_ENV)
    # From nox's configuration: these sessions declare no venv, so `session.virtualenv` is a passthrough either way.
    if session._runner.global_config.force_venv_backend == "none":
        return "python"
    venv = session.env_dir.parent / "-".join(("lab", *groups))
    groups = groups or LAB_GROUPS
    python = str(venv / "bin" / "python")
    if not Path(python).exists():
        session.run_install(sys.executable, "-m", "venv", str(venv))
    pip = (python, "-m", "pip", "install", "-q")
    # The CPU torch wheel first and alone, so that resolving the rest never pulls a CUDA build.
    session.run_install(*pip, *nox.project.dependency_groups(PYPROJECT, "cpu"))
    session.run_install(*pip, "-e", ".", *nox.project.dependency_groups(PYPROJECT, *groups))
    return python


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The CPU suite (what CI runs): every test not marked `gpu`, Triton kernels under TRITON_INTERPRET=1, on two
    pytest-xdist workers (`-n 2`: CI has two cores; tests/conftest.py gives each worker one OpenMP thread and sends
    the compile targets to one worker). `-- -n 0` runs it in one process, and so does an interpreter without
    pytest-xdist (`--no-venv`), saying so."""
    python = _lab_python(session)
    probe = "import importlib.util; print(importlib.util.find_spec('xdist') is not None)"
    workers = ["-n", "2"]
    if session.run(python, "-c", probe, silent=True, log=False).strip() != "True":
        session.warn(f"pytest-xdist is not installed in {python}: the suite runs in one process")
        workers = []
    session.run(python, "-m", "pytest", *workers, *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session(python=False)
def gpu_tests(session: nox.Session) -> None:
    """The GPU suite (`-m gpu`) on a CUDA machine, 27B shapes, in one process (one GPU). On the H200:
    `nox --no-venv -s gpu_tests`."""
    python = _lab_python(session)
    session.run(python, "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session(python=False)
def tune_gemm(session: nox.Session) -> None:
    """The GEMM tuner of stage `gemm` on a CUDA GPU: candidates record and table under results/gemm/. On the H200:
    `nox --no-venv -s tune_gemm -- --shapes gdn_in,attn_in` (options: `python -m measure.tune_gemm --help`)."""
    python = _lab_python(session)
    session.run(python, "-m", "measure.tune_gemm", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def answer(session: nox.Session) -> None:
    """Answer a request file (default: the drone request): 27B shapes on a GPU, the tiny twin on the CPU."""
    python = _lab_python(session)
    session.run(python, "-m", "reference.answer", *session.posargs)


@nox.session(python=False)
def ablate(session: nox.Session) -> None:
    """The main job: gate, build and time every stage of the ladder, write a run record, regenerate the figures.

    27B plan where CUDA is present, the tiny plan on the CPU otherwise. Options: `-- --plan gpu-27b --stages ...
    --workloads ...` (see `python -m ablations.run --help`).
    """
    python = _lab_python(session)
    session.run(python, "-m", "ablations.run", *session.posargs)
    session.run(python, "-m", "paper.figures")


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Build results/report.pdf from results/ alone (figures, then typst). Needs no GPU."""
    python = _lab_python(session)
    session.run(python, "-m", "paper.figures", *session.posargs)
    session.run(python, "-m", "paper.build")


@nox.session(python=False)
def notebooks(session: nox.Session) -> None:
    """Execute every notebook headless in a Jupyter kernel (`jupytext --execute`), outputs to the session's tmp folder.

    The kernel runs in notebooks/ and defines no `__file__`, as when a user runs `jupytext --execute` on a fresh clone.
    """
    python = _lab_python(session)
    out = Path(session.create_tmp())
    for path in sorted(Path("notebooks").glob("*.py")):
        session.run(python, "-m", "jupytext", "--execute", "--to", "ipynb", "-o", str(out / f"{path.stem}.ipynb"), path)


@nox.session(python=False)
def serve(session: nox.Session) -> None:
    """The drop-in decision server on 127.0.0.1:8791 (`-- --backend hf_fla --host ... --port ...`)."""
    python = _lab_python(session)
    session.run(python, "-m", "engine.server", *session.posargs)


@nox.session(python=False)
def replicas(session: nox.Session) -> None:
    """Ray Serve replicas on the CPU: the tiny twin behind Ray Serve's proxy, one replica (tests/test_replicas.py).
    To serve N replicas instead: `nox -s replicas -- serve --replicas N [engine.server flags]`."""
    python = _lab_python(session, "replicas")
    if session.posargs[:1] == ["serve"]:
        session.run(python, "-m", "engine.replicas", *session.posargs[1:])
    else:
        session.run(python, "-m", "pytest", "-m", "replicas", "tests/test_replicas.py", *session.posargs)


@nox.session(python=False)
def jevbench(session: nox.Session) -> None:
    """JevBench public tasks against a running server, both passes; records under results/jevbench/."""
    python = _lab_python(session)
    session.run(python, "-m", "bench.jevbench", *session.posargs)
