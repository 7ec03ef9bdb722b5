"""From a validated request to candidate prompts (contract §5.1-5.3): one record per question, one prompt per candidate.

Rendering: strings pass through unchanged; objects and arrays become JSON text with sorted keys, non-ASCII kept and
the default `", "` / `": "` separators. Each candidate is its own user message:

    Context:\\n{state}\\n\\nQuestion: {question}\\n  +  one ending
    noul:          "Is the answer to this question yes? Answer Yes or No."
    choice/score:  "Proposed answer: {option}\\nIs this proposed answer correct? Answer Yes or No."

choice options are "<key>: <description>" (or "<key>" for a null description), in criteria order; score options are
the rendered levels; a noul question with criteria gets "\\nYes means: <true>\\nNo means: <false>" appended to its
question text. Question ids, answer keys, candidate positions and other options never enter a prompt, so each
candidate's score is independent of the rest of the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from reference.request import Request

NOUL_ENDING = "Is the answer to this question yes? Answer Yes or No."
OPTION_ENDING = "\nIs this proposed answer correct? Answer Yes or No."
NOUL_OPTIONS = ("no", "yes")
NOUL_ANSWER_KEYS = ("false", "true")


def render(value: Any) -> str:
    """Prompt text of a JSON value: a string unchanged, anything else as sorted-key JSON with non-ASCII kept."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class Record:
    """One question compiled for the model. `answer_keys[i]` names the probability of `options[i]`."""

    id: str
    kind: str  # "choice" | "score" | "noul"
    state_text: str
    question_text: str
    options: tuple[str, ...]  # noul: ("no", "yes"); never rendered for noul (one candidate)
    answer_keys: tuple[str, ...]  # choice: option keys; score: "0".."n-1"; noul: ("false", "true")
    legend: dict[str, Any] | None  # score only: "0".. -> the level as sent

    @property
    def candidate_count(self) -> int:
        return 1 if self.kind == "noul" else len(self.options)


def compile_records(request: Request) -> list[Record]:
    """One record per question, in request order; the state is rendered once and shared."""
    state_text = render(request.state)
    records = []
    for question in request.questions:
        question_text = render(question.instructions)
        legend = None
        if question.type == "choice":
            keys = tuple(question.criteria)
            options = tuple(
                key if description is None else f"{key}: {render(description)}"
                for key, description in question.criteria.items()
            )
        elif question.type == "score":
            keys = tuple(str(index) for index in range(len(question.criteria)))
            options = tuple(render(level) for level in question.criteria)
            legend = dict(zip(keys, question.criteria))
        else:
            if question.criteria is not None:
                yes, no = render(question.criteria["true"]), render(question.criteria["false"])
                question_text += f"\nYes means: {yes}\nNo means: {no}"
            keys, options = NOUL_ANSWER_KEYS, NOUL_OPTIONS
        records.append(Record(question.id, question.type, state_text, question_text, options, keys, legend))
    return records


def candidate_prompts(record: Record) -> list[str]:
    """The user-message contents of a record's candidates: 1 for noul, one per option otherwise, in option order."""
    head = f"Context:\n{record.state_text}\n\nQuestion: {record.question_text}\n"
    if record.kind == "noul":
        return [head + NOUL_ENDING]
    return [f"{head}Proposed answer: {option}{OPTION_ENDING}" for option in record.options]
