"""The README's results block: per record, the ladder figure and table and (GPU plans) the targets table, written
between the `<!-- results:ladder -->` and `<!-- /results:ladder -->` markers so the README carries no hand-typed
figure. It is laid out from the report summary's plans (paper/figures.py), so it shows the report's own tables."""

from __future__ import annotations

from typing import Any

from ablations.records import README_BLOCK

README_START, README_END = README_BLOCK


def ladder(plans: list[dict[str, Any]]) -> str:
    """Markdown: per plan summary, its label and completeness, the ladder figure and the ladder table (headline
    workload), and on GPU plans the targets table."""
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
    return "\n".join(parts) if parts else "No run record yet.\n"


def _markdown_table(table: list[list[str]]) -> str:
    """A header row and data rows as a Markdown table (a `|` inside a cell escaped)."""
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table]
    return "\n".join([lines[0], "|" + "---|" * len(table[0]), *lines[1:]])


def replace_between_markers(text: str, block: str) -> str:
    """`text` with everything between the README markers replaced by `block`; the markers must each occur once."""
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"README needs exactly one {README_START} and one {README_END}")
    head, rest = text.split(README_START)
    _, tail = rest.split(README_END)
    return f"{head}{README_START}\n{block.rstrip()}\n{README_END}{tail}"
