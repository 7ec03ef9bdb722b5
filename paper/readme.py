"""The README's generated blocks from the report summary (paper/figures.py), so the README carries no hand-typed
figure: between `<!-- results:ladder -->` and `<!-- /results:ladder -->` the records of `shown_plans`, each with its
ladder, later runs' stages and (GPU) targets, then the gemm/graphs GEMM-time table; between `<!-- results:serving -->`
and `<!-- /results:serving -->` the JevBench runs and the newest GPU client sweep."""

from __future__ import annotations

from typing import Any

from ablations.records import README_BLOCK, SERVING_BLOCK

README_START, README_END = README_BLOCK
SYNTHETIC = "synthetic weights: latency and agreement, not accuracy"


def shown_plans(plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every complete record, and a partial one only when it timed, on the headline, a stage that the newest complete
    record of its plan has not timed (or its plan has none): a run cut before anything new stays in the report only."""
    complete = {p["name"]: set(p["headline_stages"]) for p in reversed(plans) if not p["partial"]}  # newest last
    return [p for p in plans if not p["partial"] or not set(p["headline_stages"]) <= complete.get(p["name"], set())]


def ladder(summary: dict[str, Any]) -> str:
    parts = []
    for plan in shown_plans(summary["plans"]):
        parts += [f"**{plan['label']}**, workload `{plan['headline']}`, {plan['timing']} (record `{plan['record']}`, "
                  f"{plan['completeness']}; synthetic weights):\n", f"![ladder](results{plan['figures']['ladder']})\n",
                  markdown_table(plan["ladder"]), ""]  # fmt: skip
        for later in plan["later_ladders"]:
            stages = ", ".join(f"`{name}`" for name in later["stages"])
            parts += [f"{stages} timed in a later run of the plan (record `{later['record']}`, its own workloads and "
                      "baseline: compare within its table):\n", markdown_table(later["table"]), ""]  # fmt: skip
        if not plan["is_cpu"]:
            issues = sorted({row[0] for row in plan["targets"][1:]}, key=int)
            parts += [f"Targets of issues {', '.join(issues)} (synthetic weights: |dp| is fidelity, not accuracy):\n",
                      markdown_table(plan["targets"]), ""]  # fmt: skip
    if (gemm := summary["gemm_over_graphs"]) is not None:
        parts += [f"GEMM kernel time per forward of `gemm` against `graphs` per workload (record `{gemm['record']}`, "
                  "synthetic weights):\n", markdown_table(gemm["table"]), ""]  # fmt: skip
    return "\n".join(parts) if parts else "No run record yet.\n"


def serving(summary: dict[str, Any]) -> str:
    jevbench = summary["jevbench"]
    parts = [f"JevBench public tiers, the newest run per backend and device ({SYNTHETIC}):\n",
             markdown_table(jevbench) if len(jevbench) > 1 else "No JevBench run yet.", ""]  # fmt: skip
    for sweep in (s for s in summary["serving"] if s["device"] == "gpu"):
        parts += [f"Client sweep, {sweep['label']} (run `{sweep['record']}`, {SYNTHETIC}): {sweep['targets']}\n",
                  markdown_table(sweep["table"]), ""]  # fmt: skip
    return "\n".join(parts)


def markdown_table(table: list[list[str]]) -> str:
    """A header row and data rows as a Markdown table (a `|` inside a cell escaped)."""
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table]
    return "\n".join([lines[0], "|" + "---|" * len(table[0]), *lines[1:]])


def replace_between_markers(text: str, block: str, markers: tuple[str, str] = README_BLOCK) -> str:
    """`text` with everything between the two `markers` replaced by `block`; each marker must occur once."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"README needs exactly one {start} and one {end}")
    head, rest = text.split(start)
    return f"{head}{start}\n{block.rstrip()}\n{end}{rest.split(end)[1]}"


def rewrite(text: str, summary: dict[str, Any]) -> str:
    return replace_between_markers(replace_between_markers(text, ladder(summary)), serving(summary), SERVING_BLOCK)
