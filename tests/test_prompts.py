"""Prompt construction: rendering rules, records, and golden prompt texts for each question type (written literally)."""

from __future__ import annotations

import pytest

from reference.data import jevbench_tasks, open_jev_workloads
from reference.prompts import Record, candidate_prompts, compile_records, render
from reference.request import validate_request

MODEL_ID = "Qwen/Qwen3.8-27B"


def records_of(obj: dict) -> list[Record]:
    return compile_records(validate_request(obj, model_id=MODEL_ID))


def all_prompts(obj: dict) -> list[str]:
    return [prompt for record in records_of(obj) for prompt in candidate_prompts(record)]


# ---------------------------------------------------------------- rendering


def test_strings_pass_through_unchanged():
    for text in ["", "plain", '{"looks": "like json"}', "  spaced \n\t", "ünïcödé 日本", "a\\nb"]:
        assert render(text) is text


def test_objects_render_sorted_with_default_separators_and_non_ascii_kept():
    assert render({"b": 1, "a": {"d": [1, 2.5, None], "c": True}}) == '{"a": {"c": true, "d": [1, 2.5, null]}, "b": 1}'
    assert render({"name": "Zoë", "city": "東京"}) == '{"city": "東京", "name": "Zoë"}'
    assert render(["x", {"z": "\n", "y": '"'}]) == '["x", {"y": "\\"", "z": "\\n"}]'
    assert render([]) == "[]" and render({}) == "{}"


# ---------------------------------------------------------------- golden prompts (the drone request)

DRONE_CONTEXT = (
    'Context:\n{"adapter": "drone", "observation": {"flight": {"altitude_m": 1.5, "climb_clearance_verified": false}, '
    '"observation_id": "sim-frame-30", "obstacles": [{"ahead_m": 2, "left_gap_open": false, "right_gap_open": true}], '
    '"target": {"seconds_unseen": 0, "visible": true}}}\n\n'
)


def test_drone_golden_prompts():
    prompts = all_prompts(open_jev_workloads()["drone"]["request"])
    assert len(prompts) == 7
    maneuver = (
        "Question: Choose one permitted tactical maneuver using the measured scene. The simulator retains its "
        "collision reflex and flight controller.\n"
    )
    risk = "Question: How immediate is the collision risk in this measured scene?\n"
    assert prompts == [
        DRONE_CONTEXT + maneuver + "Proposed answer: gap_right: Use the observed safe gap on the right\n"
        "Is this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT + maneuver + "Proposed answer: brake: Slow down or stop forward travel\n"
        "Is this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT + maneuver + "Proposed answer: hold_course: Continue along the current clear course\n"
        "Is this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT + risk + "Proposed answer: Clear open course\nIs this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT + risk + "Proposed answer: Tight clearance or approaching obstacle\n"
        "Is this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT
        + risk
        + "Proposed answer: Imminent collision\nIs this proposed answer correct? Answer Yes or No.",
        DRONE_CONTEXT + "Question: Do the observations support loss of the tracked target rather than a brief "
        "occlusion?\nIs the answer to this question yes? Answer Yes or No.",
    ]


def test_noul_with_criteria_golden_prompt():
    obj = {
        "state": "The customer asks for a refund.",
        "questions": {
            "refund": {
                "type": "noul",
                "instructions": "Should we refund?",
                "criteria": {"true": "Issue the refund now", "false": {"action": "escalate", "to": "billing"}},
            }
        },
    }
    assert all_prompts(obj) == [
        "Context:\nThe customer asks for a refund.\n\nQuestion: Should we refund?\nYes means: Issue the refund now\n"
        'No means: {"action": "escalate", "to": "billing"}\nIs the answer to this question yes? Answer Yes or No.'
    ]


def test_choice_with_null_and_object_descriptions_golden_prompts():
    obj = {
        "state": ["turn 1", {"role": "user", "text": "Où est ma commande?"}],
        "questions": {
            "route": {
                "type": "choice",
                "instructions": {"task": "route", "allowed": ["b", "a"]},
                "criteria": {"shipping": None, "billing": {"team": "€ payments", "sla": 2}},
            }
        },
    }
    context = (
        'Context:\n["turn 1", {"role": "user", "text": "Où est ma commande?"}]\n\n'
        'Question: {"allowed": ["b", "a"], "task": "route"}\n'
    )
    assert all_prompts(obj) == [
        context + "Proposed answer: shipping\nIs this proposed answer correct? Answer Yes or No.",
        context + 'Proposed answer: billing: {"sla": 2, "team": "€ payments"}\n'
        "Is this proposed answer correct? Answer Yes or No.",
    ]


def test_score_golden_prompts_and_legend():
    obj = {
        "state": "Server load is 97%.",
        "questions": {"sev": {"type": "score", "instructions": "Severity?", "criteria": ["none", {"level": "high"}]}},
    }
    (record,) = records_of(obj)
    assert record == Record(
        id="sev",
        kind="score",
        state_text="Server load is 97%.",
        question_text="Severity?",
        options=("none", '{"level": "high"}'),
        answer_keys=("0", "1"),
        legend={"0": "none", "1": {"level": "high"}},
    )
    assert candidate_prompts(record) == [
        "Context:\nServer load is 97%.\n\nQuestion: Severity?\nProposed answer: none\n"
        "Is this proposed answer correct? Answer Yes or No.",
        'Context:\nServer load is 97%.\n\nQuestion: Severity?\nProposed answer: {"level": "high"}\n'
        "Is this proposed answer correct? Answer Yes or No.",
    ]


# ---------------------------------------------------------------- records


def test_records_per_type():
    choice, score, noul = records_of(open_jev_workloads()["drone"]["request"])
    assert (choice.id, choice.kind, choice.answer_keys) == ("maneuver", "choice", ("gap_right", "brake", "hold_course"))
    assert choice.options[1] == "brake: Slow down or stop forward travel" and choice.legend is None
    assert (score.kind, score.answer_keys, score.candidate_count) == ("score", ("0", "1", "2"), 3)
    assert score.legend == {
        "0": "Clear open course",
        "1": "Tight clearance or approaching obstacle",
        "2": "Imminent collision",
    }
    assert (noul.kind, noul.options, noul.answer_keys, noul.legend) == ("noul", ("no", "yes"), ("false", "true"), None)
    assert noul.candidate_count == 1 and len(candidate_prompts(noul)) == 1
    assert choice.state_text == score.state_text == noul.state_text


def test_string_state_that_looks_like_json_is_not_reparsed():
    obj = {"state": '{"b": 1, "a": 2}', "questions": {"q": {"type": "noul", "instructions": "?"}}}
    assert all_prompts(obj)[0].startswith('Context:\n{"b": 1, "a": 2}\n\nQuestion: ?\n')


def test_question_ids_and_positions_never_enter_prompts():
    obj = {
        "state": "s",
        "questions": {
            "QID_SENTINEL_1": {"type": "choice", "instructions": "?", "criteria": {"x": "ex", "y": "why"}},
            "QID_SENTINEL_2": {"type": "score", "instructions": "?", "criteria": ["lo", "hi"]},
        },
    }
    for prompt in all_prompts(obj):
        assert "QID_SENTINEL" not in prompt
        assert "Proposed answer: 0" not in prompt and "Proposed answer: 1" not in prompt


@pytest.mark.parametrize("order", [["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"]])
def test_each_option_prompt_is_independent_of_option_order(order):
    descriptions = {"a": "first", "b": None, "c": ["third"]}
    obj = {"state": "s", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": {}}}}
    obj["questions"]["q"]["criteria"] = {key: descriptions[key] for key in order}
    (record,) = records_of(obj)
    by_key = dict(zip(record.answer_keys, candidate_prompts(record)))
    ending = "\nIs this proposed answer correct? Answer Yes or No."
    assert by_key == {
        "a": "Context:\ns\n\nQuestion: ?\nProposed answer: a: first" + ending,
        "b": "Context:\ns\n\nQuestion: ?\nProposed answer: b" + ending,
        "c": 'Context:\ns\n\nQuestion: ?\nProposed answer: c: ["third"]' + ending,
    }
    assert record.answer_keys == tuple(order)


def test_every_public_jevbench_task_compiles():
    """JevBench's adapter sends {type, instructions, criteria if not None}: every easy/original task must pass and give
    one candidate per label (noul: one), with answer keys equal to the label set."""
    tasks = jevbench_tasks(("easy", "original"))
    assert len(tasks) == 120
    for task in tasks:
        question = {key: value for key, value in task["question"].items() if value is not None}
        (record,) = records_of({"state": task["state"], "questions": {"decision": question}})
        assert record.kind == task["question"]["type"]
        if record.kind == "noul":
            assert task["labels"] == ["no", "yes"] and len(candidate_prompts(record)) == 1
        else:
            assert sorted(record.answer_keys) == sorted(task["labels"])
            assert len(candidate_prompts(record)) == len(task["labels"])
