"""The README's generated blocks, laid out from the report summary (paper/figures.py), so they show the report's own
tables and the README carries no hand-typed figure. Between `<!-- results:ladder -->` and `<!-- /results:ladder -->`:
per record, the ladder figure and table and (GPU plans) the targets table, then the gemm/graphs GEMM-time table.
Between `<!-- results:serving -->` and `<!-- /results:serving -->`: the JevBench runs and the newest GPU client
sweep."""

from __future__ import annotations

from typing import Any

from ablations import records
from ablations.records import README_BLOCK

README_START, README_END = README_BLOCK
SERVING_BLOCK = records.SERVING_BLOCK  # the serving block paper.figures writes
SYNTHETIC = "synthetic weights: latency and agreement, not accuracy"


def ladder(plans: list[dict[str, Any]], gemm: dict[str, Any] | None = None) -> str:
    """Markdown: per plan summary, its label and completeness, the ladder figure and the ladder table (headline
    workload), and on GPU plans the targets table; then `gemm` (tables.gemm_over_graphs) when a record has it."""
    parts = []
    for plan in plans:
        parts += [f"**{plan['label']}**, workload `{plan['headline']}` (record `{plan['record']}`, "
                  f"{plan['completeness']}; synthetic weights):\n", f"![ladder](results{plan['figures']['ladder']})\n",
                  _markdown_table(plan["ladder"]), ""]  # fmt: skip
        for later in plan.get("later_ladders", []):
            stages = ", ".join(f"`{name}`" for name in later["stages"])
            parts += [f"{stages} timed in a later run of the plan (record `{later['record']}`, its own workloads and "
                      "baseline: compare within its table):\n", _markdown_table(later["table"]), ""]  # fmt: skip
        if not plan["is_cpu"]:
            issues = sorted({row[0] for row in plan["targets"]["table"][1:]}, key=int)
            parts += [f"Targets of issues {', '.join(issues)} (synthetic weights: |dp| is fidelity, not accuracy):\n",
                      _markdown_table(plan["targets"]["table"]), ""]  # fmt: skip
    if gemm is not None:
        parts += [f"GEMM kernel time per forward of `gemm` against `graphs` per workload (record `{gemm['record']}`, "
                  "synthetic weights):\n", _markdown_table(gemm["table"]), ""]  # fmt: skip
    return "\n".join(parts) if parts else "No run record yet.\n"


def serving(jevbench: list[list[str]], sweeps: list[dict[str, Any]]) -> str:
    """Markdown: the JevBench table (serving.jevbench_table) and the newest GPU client sweep (serving_summary)."""
    parts = [f"JevBench public tiers, the newest run per backend and device ({SYNTHETIC}):\n", _markdown_table(jevbench)
             if len(jevbench) > 1 else "No JevBench run yet.", ""]  # fmt: skip
    for sweep in (s for s in sweeps if s["device"] == "gpu"):
        parts += [f"Client sweep, {sweep['label']} (run `{sweep['record']}`, {SYNTHETIC}): {sweep['targets']}\n",
                  _markdown_table(sweep["table"]), ""]  # fmt: skip
    return "\n".join(parts)


def _markdown_table(table: list[list[str]]) -> str:
    """A header row and data rows as a Markdown table (a `|` inside a cell escaped)."""
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table]
    return "\n".join([lines[0], "|" + "---|" * len(table[0]), *lines[1:]])


def replace_between_markers(text: str, block: str, markers: tuple[str, str] = README_BLOCK) -> str:
    """`text` with everything between the two `markers` replaced by `block`; each marker must occur once."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"README needs exactly one {start} and one {end}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{block.rstrip()}\n{end}{tail}"
