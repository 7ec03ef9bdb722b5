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

`prompt_bytes` sizes every candidate prompt of a request without building one: the UTF-8 bytes of each prompt's NFC
form, summed from the parts (the shared state measured once), so a request that would take gigabytes of prompt text
can be refused before any of it exists (`reference.service`'s token budget).
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

from reference.request import Request

CONTEXT_HEAD = "Context:\n"
QUESTION_HEAD = "\n\nQuestion: "
OPTION_HEAD = "\nProposed answer: "
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
    head = f"{CONTEXT_HEAD}{record.state_text}{QUESTION_HEAD}{record.question_text}"
    if record.kind == "noul":
        return [f"{head}\n{NOUL_ENDING}"]
    return [f"{head}{OPTION_HEAD}{option}{OPTION_ENDING}" for option in record.options]


def longest_prompt(records: list[Record]) -> tuple[int, str]:
    """The candidate prompt of the most NFC UTF-8 bytes (the first of equals, request order) and its bytes, built alone:
    the parts are measured as `prompt_bytes` measures them, and only the winner's text is joined."""
    best_bytes, best = -1, (records[0], None)
    measured: dict[str, int] = {}
    for record in records:
        if record.state_text not in measured:
            measured[record.state_text] = nfc_bytes(record.state_text)
        head = len(CONTEXT_HEAD) + measured[record.state_text] + len(QUESTION_HEAD) + nfc_bytes(record.question_text)
        if record.kind == "noul":
            size, option = head + len("\n") + len(NOUL_ENDING), None
        else:
            option = max(record.options, key=nfc_bytes)
            size = head + len(OPTION_HEAD) + nfc_bytes(option) + len(OPTION_ENDING)
        if size > best_bytes:
            best_bytes, best = size, (record, option)
    record, option = best
    head = f"{CONTEXT_HEAD}{record.state_text}{QUESTION_HEAD}{record.question_text}"
    text = f"{head}\n{NOUL_ENDING}" if option is None else f"{head}{OPTION_HEAD}{option}{OPTION_ENDING}"
    return best_bytes, text


def nfc_bytes(text: str) -> int:
    """UTF-8 bytes of the NFC form of `text` (the form the tokenizer encodes)."""
    return len(unicodedata.normalize("NFC", text).encode("utf-8"))


def prompt_bytes(records: list[Record]) -> int:
    """`sum(nfc_bytes(p) for r in records for p in candidate_prompts(r))`, computed from the parts without building a
    prompt: the state text is measured once per distinct text (`compile_records` shares one), each question and option
    text once. Exact, because every part is joined by a separator that starts and ends with an ASCII character that no
    combining mark composes with or reorders across, so NFC of the whole is the NFC of the parts joined."""
    measured: dict[str, int] = {}
    total = 0
    for record in records:
        if record.state_text not in measured:
            measured[record.state_text] = nfc_bytes(record.state_text)
        head = len(CONTEXT_HEAD) + measured[record.state_text] + len(QUESTION_HEAD) + nfc_bytes(record.question_text)
        if record.kind == "noul":
            total += head + len("\n") + len(NOUL_ENDING)
        else:
            per_option = head + len(OPTION_HEAD) + len(OPTION_ENDING)
            total += per_option * len(record.options) + sum(nfc_bytes(option) for option in record.options)
    return total
