"""Where the shared evaluation data lives, and readers for it.

The data (JevBench public tasks, Open-Jev latency requests) is evaluation-only and is not part of this repository:
it is read from `../shared/data` beside the checkout, or from the folder named by `JEVLAB_SHARED` (the device machine
gets a copy carried in an ignored folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    path = Path(os.environ.get("JEVLAB_SHARED", REPO.parent / "shared"))
    if not (path / "data").is_dir():
        raise FileNotFoundError(f"shared data not found under {path} (set JEVLAB_SHARED to the folder holding data/)")
    return path


def open_jev_workloads() -> dict[str, dict]:
    """The Open-Jev latency workloads by id (drone, customer_service, context-*): request plus recorded token counts."""
    path = shared_dir() / "data" / "open-jev-requests" / "requests.json"
    return {w["id"]: w for w in json.loads(path.read_text())["workloads"]}


def jevbench_tasks(tiers: tuple[str, ...] = ("easy", "original")) -> list[dict]:
    """JevBench public task rows, tier by tier, in file order."""
    rows = []
    for tier in tiers:
        path = shared_dir() / "data" / "jevbench" / f"{tier}.jsonl"
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows
