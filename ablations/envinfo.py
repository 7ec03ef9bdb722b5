"""The machine and code a run measured: read at run time, never typed in.

GPU name and driver come from torch and `nvidia-smi`; versions from the imported packages; the commit and dirty flag
from `git`, only where the project root is itself the top level of a git checkout. A copy of the tree without its own
`.git` (an exported copy placed inside another repository, whose commit is not this code's) has no commit of its own.
The `JEVLAB_GIT_COMMIT` / `JEVLAB_GIT_DIRTY` variables, set by whoever sent a copy (a lent GPU machine's), take
precedence over git when set; `git_source` says which answered; without either the commit is "unknown".

The dirty flag describes the code, not what the runs write: a tracked file that differs from HEAD makes the checkout
dirty, except files under `results/` (run records, figures, logs, the report) and README.md when everything outside its
generated block (between the `<!-- results:ladder -->` markers that `paper.figures` rewrites) is as committed. So a
second `nox -s ablate` on a clean clone is still clean. Untracked files never count.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from ablations.records import GENERATED_BLOCKS, README_BLOCK

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = "results/"  # every tracked file under it is written by runs
README = "README.md"


def _run(args: list[str], cwd: Path = REPO) -> str | None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _outside_readme_block(text: str | None) -> str | None:
    """README text with the generated blocks (`GENERATED_BLOCKS`) cut out (markers kept) and the ends stripped (as
    `_run` strips git's output); None unless the ladder block's markers occur once each, in order, and every other
    block's occur so too or not at all."""
    if text is None:
        return None
    for start, end in GENERATED_BLOCKS:
        if (start, end) != README_BLOCK and text.count(start) == text.count(end) == 0:
            continue
        if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
            return None
        text = text[: text.index(start) + len(start)] + text[text.index(end) :]
    return text.strip()


def code_dirty(root: Path = REPO) -> bool:
    """Whether the code at `root` differs from HEAD: tracked files only, outputs excepted (see the module docstring)."""
    changed = _run(["git", "diff", "--name-only", "--no-renames", "HEAD"], cwd=root)
    if changed is None:
        return True
    for path in changed.splitlines():
        if path.startswith(OUTPUTS):
            continue
        if path == README:
            committed = _outside_readme_block(_run(["git", "show", f"HEAD:{README}"], cwd=root))
            here = root / README
            if committed is not None and here.is_file() and _outside_readme_block(here.read_text()) == committed:
                continue
        return True
    return False


def git_state(root: Path = REPO) -> dict[str, object]:
    """Commit, dirty flag and their source for the project at `root`: git when `root` is a checkout's top level."""
    if os.environ.get("JEVLAB_GIT_COMMIT"):  # the sender of a copy says what it is: a lent GPU machine's copy may
        # carry a stale `.git` of its own (seen on the H200: it named the session's first commit)
        dirty = os.environ.get("JEVLAB_GIT_DIRTY", "").lower() in ("1", "true", "yes")
        return {"git_commit": os.environ["JEVLAB_GIT_COMMIT"], "git_dirty": dirty, "git_source": "env"}
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=root)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root) if top and Path(top).resolve() == root.resolve() else None
    if commit:
        return {"git_commit": commit, "git_dirty": code_dirty(root), "git_source": "git"}
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


def write_json(record: dict, path: Path, *, allow_nan: bool = True) -> None:
    """Write a measurement record (one JSON object, its `env` from `collect`) to `path`, its folder made if needed,
    and say where: what the CPU measurement tools (batch packing, grid coverage, prepare time) end with. With
    `allow_nan=False` a NaN or infinity in the record raises ValueError instead of being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, allow_nan=allow_nan) + "\n")
    print(f"written: {path}")
