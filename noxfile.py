"""Sessions of the lab. `nox -l` lists them; options after `--` pass through to the command each one runs.

Every session also works with `--no-venv` (nox's passthrough mode): it then runs in the current interpreter and
installs nothing. That is how the sessions run on the H200, whose image already has torch, triton and cupy and
reaches no package index (the missing wheels travel in `.whl/`, see README.md).
"""

from __future__ import annotations

import nox

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["tests", "lint"]
nox.options.reuse_venv = "yes"

PYPROJECT = nox.project.load_toml("pyproject.toml")


def _install(session: nox.Session, *groups: str) -> None:
    """Install the project and dependency groups into the session's venv; nothing with `--no-venv`."""
    if isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        return
    # The CPU torch wheel first and alone, so that resolving the rest never pulls a CUDA build.
    session.install(*nox.project.dependency_groups(PYPROJECT, "cpu"))
    session.install("-e", ".", *nox.project.dependency_groups(PYPROJECT, *groups))


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite (what CI runs): every test not marked `gpu`, Triton kernels under TRITON_INTERPRET=1."""
    _install(session, "dev")
    session.run("python", "-m", "pytest", *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """The GPU suite (`-m gpu`) on a CUDA machine, 27B shapes. On the H200: `nox --no-venv -s gpu_tests`."""
    _install(session, "dev")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def answer(session: nox.Session) -> None:
    """Answer a request file (default: the drone request): 27B shapes on a GPU, the tiny twin on the CPU."""
    _install(session)
    session.run("python", "-m", "reference.answer", *session.posargs)


@nox.session
def ablate(session: nox.Session) -> None:
    """The main job: gate, build and time every stage of the ladder, write a run record, regenerate the figures.

    27B plan where CUDA is present, the tiny plan on the CPU otherwise. Options: `-- --plan gpu-27b --stages ...
    --workloads ...` (see `python -m ablations.run --help`).
    """
    _install(session, "dev")
    session.run("python", "-m", "ablations.run", *session.posargs)
    session.run("python", "-m", "paper.figures")


@nox.session
def report(session: nox.Session) -> None:
    """Build results/report.pdf from results/ alone (figures, then typst). Needs no GPU."""
    _install(session, "report")
    session.run("python", "-m", "paper.figures", *session.posargs)
    session.run("python", "-m", "paper.build")


@nox.session
def serve(session: nox.Session) -> None:
    """The drop-in decision server on 127.0.0.1:8791 (`-- --backend hf_fla --host ... --port ...`)."""
    _install(session)
    session.run("python", "-m", "engine.server", *session.posargs)


@nox.session
def jevbench(session: nox.Session) -> None:
    """JevBench public tasks against a running server, both passes; records under results/jevbench/."""
    _install(session)
    session.run("python", "-m", "ablations.jevbench", *session.posargs)
