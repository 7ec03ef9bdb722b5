"""Strict JSON parsing and validation of an Open-Jev decision request (contract §2).

A request is `{"state": ..., "questions": {id: {"type", "instructions", "criteria"?}}, "model"?: str}`. Everything a
client can get wrong is answered with `RequestError` (HTTP 422) and a message naming the field; nothing is repaired,
dropped or truncated.

Decisions where the contract is silent (they follow the original server, `jev/serving.py` and `jev/api.py`):
* Unknown keys, at the top level and inside a question definition, are ignored, as the original does, so clients that
  send extra fields keep working (JSON strictness still covers them: duplicate keys and NaN are rejected anywhere).
* `"model": null` counts as absent; `"criteria": null` on a noul question counts as absent.
* Every JSON value that reaches a prompt or the response is round-tripped through `json.dumps`/`json.loads`, so a
  Python caller's nested tuples and non-string keys become exactly what a wire client would have sent.
* Strings must be valid Unicode: a lone surrogate (`"\\ud800"` in the JSON text) is rejected here rather than failing
  later in the tokenizer.
* Numbers that overflow a float (`1e400`) are rejected at parse time like the NaN and Infinity literals.
* Counts before contents: the candidate count is taken from the question definitions as sent
  (`declared_candidate_count`) and checked against the contract's limit, and a caller's budget (`admit`), before any
  question is validated, so a body asking for 65,535 candidates is refused at the cost of counting them instead of
  validating each option (about 0.1 ms instead of about 100 ms on a CPU core). The original validates every question
  first; a body with a fault in a question and too many candidates is therefore answered with the count's message
  here and with the question's there (both 422).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODEL_ALIASES = ("open-jev", "jev-latest")
QUESTION_TYPES = ("choice", "score", "noul")
MAX_QUESTIONS = 4096
MAX_CANDIDATES = 65_536
MAX_CHOICE_OPTIONS = 255
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10
MODEL_NOT_LOADED = "requested model is not loaded; see /v1/models"


class RequestError(Exception):
    """A request the server refuses, with the HTTP status it maps to (422 for anything about the request body)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Question:
    """One validated question. Values are plain JSON (round-tripped), in the order the client sent them.

    criteria: choice - dict option key -> description (str, dict, list or None), in criteria order;
              score  - list of levels, lowest first;
              noul   - {"true": ..., "false": ...} or None.
    """

    id: str
    type: str
    instructions: Any
    criteria: Any

    @property
    def candidate_count(self) -> int:
        return 1 if self.type == "noul" else len(self.criteria)


@dataclass(frozen=True)
class Request:
    state: Any  # str, dict or list (round-tripped JSON)
    questions: tuple[Question, ...]  # request order
    model: str | None

    @property
    def candidate_count(self) -> int:
        return sum(q.candidate_count for q in self.questions)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestError(422, f"invalid JSON: duplicate key {key!r} in an object")
            seen.add(key)
    return obj


def _reject_constant(name: str) -> float:
    raise RequestError(422, f"invalid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(422, f"invalid JSON: number {text} is out of the float range")
    return value


def parse_json_strict(body: bytes | bytearray | str) -> Any:
    """Parse a request body as strict JSON: no duplicate keys, no NaN/Infinity, no overflowing floats.

    Bytes must be UTF-8 (an optional leading BOM is dropped). The original server's `json.loads(bytes)` would also
    detect UTF-16 and UTF-32 bodies; JSON over HTTP is UTF-8 (RFC 8259 §8.1), so those are refused here.
    """
    if isinstance(body, (bytes, bytearray)):
        try:
            text = bytes(body).decode("utf-8-sig")  # a leading BOM is dropped, as the original's json.loads(bytes) does
        except UnicodeDecodeError as error:
            raise RequestError(422, f"request body is not valid UTF-8 (byte {error.start}: {error.reason})") from None
    elif isinstance(body, str):
        text = body
    else:
        raise TypeError(f"body must be bytes or str, not {type(body).__name__}")
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except json.JSONDecodeError as error:
        raise RequestError(422, f"invalid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise RequestError(422, "invalid JSON: nested too deeply") from None
    except ValueError as error:  # e.g. an integer literal longer than Python's 4300-digit conversion limit
        raise RequestError(422, f"invalid JSON: {error}") from None


def _json_value(value: Any, what: str) -> Any:
    """The value after a JSON round trip; 422 if it holds NaN/Infinity, a non-JSON type or a lone surrogate.

    A `str` (not a subclass) round-trips to itself unless it holds a lone surrogate, so it is only checked for one:
    the same answer at a tenth of the cost, which keeps validating 65,536 options well under a second."""
    if type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(422, f"{what} contains a lone surrogate; text must be valid Unicode") from None
        return value
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(422, f"{what} contains a lone surrogate; text must be valid Unicode") from None
    except RecursionError:
        raise RequestError(422, f"{what} is nested too deeply") from None
    except (TypeError, ValueError) as error:
        raise RequestError(422, f"{what} must be JSON data without NaN or Infinity ({error})") from None
    return json.loads(text)


def _is_text_object_or_array(value: Any) -> bool:
    return isinstance(value, (str, dict, list))


def _validate_question(question_id: Any, definition: Any) -> Question:
    if not isinstance(question_id, str):
        raise RequestError(422, f"question ids must be strings, got {type(question_id).__name__}")
    _json_value(question_id, "a question id")
    where = f"question {question_id!r}"
    if not isinstance(definition, dict):
        raise RequestError(422, f"{where}: the definition must be a JSON object")
    kind = definition.get("type")
    if not isinstance(kind, str) or kind not in QUESTION_TYPES:
        raise RequestError(422, f"{where}: type must be one of choice, score, noul (got {kind!r})")
    if "instructions" not in definition:
        raise RequestError(422, f"{where}: instructions are required")
    instructions = definition["instructions"]
    if not _is_text_object_or_array(instructions):
        raise RequestError(422, f"{where}: instructions must be a string, a JSON object or an array")
    instructions = _json_value(instructions, f"{where}: instructions")
    criteria = definition.get("criteria")

    if kind == "choice":
        if not isinstance(criteria, dict):
            raise RequestError(422, f"{where}: choice criteria must be a JSON object of option key -> description")
        if not 1 <= len(criteria) <= MAX_CHOICE_OPTIONS:
            raise RequestError(
                422, f"{where}: choice criteria must have 1 to {MAX_CHOICE_OPTIONS} options (got {len(criteria)})"
            )
        options = {}
        for key, description in criteria.items():
            if not isinstance(key, str):
                raise RequestError(422, f"{where}: choice option keys must be strings, got {type(key).__name__}")
            _json_value(key, f"{where}: an option key")
            if description is not None and not _is_text_object_or_array(description):
                raise RequestError(
                    422, f"{where}: option {key!r}: the description must be a string, a JSON object, an array or null"
                )
            options[key] = None if description is None else _json_value(description, f"{where}: option {key!r}")
        return Question(question_id, kind, instructions, options)

    if kind == "score":
        if not isinstance(criteria, list):
            raise RequestError(422, f"{where}: score criteria must be an array of levels, lowest first")
        if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
            raise RequestError(
                422,
                f"{where}: score criteria must have {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} levels "
                f"(got {len(criteria)})",
            )
        levels = []
        for index, level in enumerate(criteria):
            if not _is_text_object_or_array(level):
                raise RequestError(422, f"{where}: level {index} must be a string, a JSON object or an array")
            levels.append(_json_value(level, f"{where}: level {index}"))
        return Question(question_id, kind, instructions, levels)

    if criteria is None:
        return Question(question_id, kind, instructions, None)
    if not isinstance(criteria, dict) or set(criteria) != {"true", "false"}:
        got = sorted(map(str, criteria)) if isinstance(criteria, dict) else type(criteria).__name__
        message = f'{where}: noul criteria must be an object with exactly the keys "true" and "false" (got {got})'
        raise RequestError(422, message)
    meanings = {}
    for key in ("true", "false"):
        if not _is_text_object_or_array(criteria[key]):
            raise RequestError(422, f"{where}: noul criteria {key!r} must be a string, a JSON object or an array")
        meanings[key] = _json_value(criteria[key], f"{where}: noul criteria {key!r}")
    return Question(question_id, kind, instructions, meanings)


def declared_candidate_count(questions: dict) -> int:
    """The candidate sequences that parsed question definitions ask for, counted without validating them: 1 per noul
    question, the criteria's entries for a choice question whose criteria is an object and for a score question whose
    criteria is an array, 0 for any other definition (validation refuses it). Equal to `Request.candidate_count` for
    every request that validates (tests/test_request.py, hypothesis over valid requests)."""
    count = 0
    for definition in questions.values():
        if not isinstance(definition, dict):
            continue
        kind, criteria = definition.get("type"), definition.get("criteria")
        if kind == "noul":
            count += 1
        elif (kind == "choice" and isinstance(criteria, dict)) or (kind == "score" and isinstance(criteria, list)):
            count += len(criteria)
    return count


def validate_request(
    obj: Any,
    *,
    model_id: str,
    max_questions: int = MAX_QUESTIONS,
    max_candidates: int = MAX_CANDIDATES,
    admit: Callable[[int], None] | None = None,
) -> Request:
    """Check a parsed request against every rule of the contract (§2) and return it normalised.

    Checks run in this order: shape, model, question count, the candidate count (1 per noul question, 1 per choice
    option or score level, as declared: `declared_candidate_count`) against `max_candidates`, then `admit(count)`
    (a caller's budget: it raises RequestError to refuse), state, each question in request order. The original server
    checks the candidate count last (module docstring, "Counts before contents").
    """
    if not isinstance(obj, dict):
        raise RequestError(422, "the request must be a JSON object with state and questions")
    missing = [key for key in ("state", "questions") if key not in obj]
    if missing:
        raise RequestError(422, f"the request is missing {' and '.join(missing)}")
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or model not in (*MODEL_ALIASES, model_id)):
        raise RequestError(422, MODEL_NOT_LOADED)
    questions = obj["questions"]
    if not isinstance(questions, dict):
        raise RequestError(422, "questions must be a JSON object of question id -> definition")
    if not questions:
        raise RequestError(422, "questions must not be empty")
    if len(questions) > max_questions:
        raise RequestError(422, f"too many questions: {len(questions)} (the limit is {max_questions})")
    candidates = declared_candidate_count(questions)
    if candidates > max_candidates:
        raise RequestError(422, f"too many candidate sequences: {candidates} (the limit is {max_candidates})")
    if admit is not None:
        admit(candidates)
    state = obj["state"]
    if not _is_text_object_or_array(state):
        raise RequestError(422, "state must be a string, a JSON object or an array")
    state = _json_value(state, "state")
    validated = tuple(_validate_question(question_id, definition) for question_id, definition in questions.items())
    return Request(state=state, questions=validated, model=model)
