"""The machine and code a run measured: read at run time, never typed in.

GPU name and driver come from torch and `nvidia-smi`; versions from the imported packages; the commit and dirty flag
from `git` in the checkout. A copy of the tree without `.git` (as on a lent GPU machine) falls back to the
`JEVLAB_GIT_COMMIT` / `JEVLAB_GIT_DIRTY` variables set by whoever sent the copy, and says so in `git_source`;
without either the commit is "unknown".
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> str | None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state() -> dict[str, object]:
    commit = _run(["git", "rev-parse", "HEAD"])
    if commit:
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        return {"git_commit": commit, "git_dirty": bool(status), "git_source": "git"}
    if os.environ.get("JEVLAB_GIT_COMMIT"):
        dirty = os.environ.get("JEVLAB_GIT_DIRTY", "").lower() in ("1", "true", "yes")
        return {"git_commit": os.environ["JEVLAB_GIT_COMMIT"], "git_dirty": dirty, "git_source": "env"}
    return {"git_commit": "unknown", "git_dirty": True, "git_source": "none"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def collect(device: str) -> dict[str, object]:
    """Environment of a run on `device` ("cuda" or "cpu")."""
    env: dict[str, object] = {
        "device": device,
        "gpu": None,
        "gpu_count": 0,
        "gpu_memory_gib": None,
        "driver": None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "fla": _version("fla-core"),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "utc": utc_now(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),  # ":0:0": row-invariant GEMMs
        **git_state(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["sm_count"] = props.multi_processor_count
        env["compute_capability"] = f"{props.major}.{props.minor}"
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
        env["driver"] = smi or None
    return env


def slug(text: str) -> str:
    """Lower-case letters, digits and single dashes (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def record_stem(env: dict[str, object]) -> str:
    """`<utc yyyymmddThhmmssZ>-<gpu or cpu>-<commit7>`: the run record's file name without `.json`."""
    stamp = str(env["utc"]).replace("-", "").replace(":", "")
    machine = slug(str(env["gpu"])) if env["gpu"] else "cpu"
    return f"{stamp}-{machine}-{str(env['git_commit'])[:7]}"
