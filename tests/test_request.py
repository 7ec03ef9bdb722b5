"""Strict JSON parsing and request validation: every contract limit with its neighbour, every field's wrong types."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.request import (
    MODEL_NOT_LOADED,
    Question,
    Request,
    RequestError,
    parse_json_strict,
    validate_request,
)

MODEL_ID = "Qwen/Qwen3.8-27B"


def good_request() -> dict:
    return {
        "state": {"ticket": "refund please", "amount": 12.5},
        "questions": {
            "route": {
                "type": "choice",
                "instructions": "Who handles it?",
                "criteria": {"billing": "Money", "tech": None},
            },
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
            "refund": {"type": "noul", "instructions": "Refund?", "criteria": {"true": "refund", "false": "no refund"}},
        },
    }


def validate(obj, **limits) -> Request:
    return validate_request(obj, model_id=MODEL_ID, **limits)


def rejected(obj, message: str | None = None, **limits) -> str:
    with pytest.raises(RequestError) as caught:
        validate(obj, **limits)
    assert caught.value.status == 422
    assert str(caught.value) == caught.value.message
    if message is not None:
        assert caught.value.message == message
    return caught.value.message


def with_question(definition, qid: str = "q") -> dict:
    return {"state": "s", "questions": {qid: definition}}


def noul_questions(count: int) -> dict:
    return {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(count)}


# ---------------------------------------------------------------- strict JSON


def test_parse_keeps_order_and_values():
    body = '{"b": 1, "a": [1.5, -2, true, null, "é"], "c": {"z": 0, "y": 1}}'
    parsed = parse_json_strict(body.encode())
    assert list(parsed) == ["b", "a", "c"]
    assert list(parsed["c"]) == ["z", "y"]
    assert parsed["a"] == [1.5, -2, True, None, "é"]
    assert parse_json_strict(body) == parsed


@pytest.mark.parametrize("body", ['{"a": 1, "a": 2}', '{"x": [{"k": 1, "j": 2, "k": 3}]}', '{"q": {"a": {}, "a": {}}}'])
def test_duplicate_keys_rejected_at_any_depth(body):
    with pytest.raises(RequestError, match="duplicate key") as caught:
        parse_json_strict(body.encode())
    assert caught.value.status == 422


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_rejected(literal):
    with pytest.raises(RequestError) as caught:
        parse_json_strict(f'{{"state": {{"x": [1, {literal}]}}, "questions": {{}}}}'.encode())
    assert caught.value.status == 422
    assert caught.value.message == f"invalid JSON: {literal} is not a JSON number"


def test_overflowing_number_rejected():
    with pytest.raises(RequestError, match="out of the float range"):
        parse_json_strict(b'{"state": 1e400}')


@pytest.mark.parametrize("body", [b'{"state": "\xff"}', b'{"state": "\xc3"}', b"\xed\xa0\x80"])
def test_bad_utf8_rejected(body):
    with pytest.raises(RequestError, match="not valid UTF-8") as caught:
        parse_json_strict(body)
    assert caught.value.status == 422


def test_utf8_bom_is_dropped():
    assert parse_json_strict(b'\xef\xbb\xbf{"a": "\xc3\xa9"}') == {"a": "é"}


def test_utf16_body_rejected():
    with pytest.raises(RequestError) as caught:
        parse_json_strict('{"a": 1}'.encode("utf-16"))
    assert caught.value.status == 422


@pytest.mark.parametrize("body", [b"", b"{", b'{"a": 1,}', b"{'a': 1}", b'{"a": 1} x', "\ufeff{}"])
def test_malformed_json_rejected(body):
    with pytest.raises(RequestError, match="^invalid JSON: ") as caught:
        parse_json_strict(body)
    assert caught.value.status == 422


def test_deep_nesting_rejected_cleanly():
    with pytest.raises(RequestError, match="invalid JSON"):
        parse_json_strict(b"[" * 200_000 + b"]" * 200_000)


def test_parse_rejects_non_text_body():
    with pytest.raises(TypeError):
        parse_json_strict({"state": "s"})


# ---------------------------------------------------------------- a good request


def test_good_request_is_normalised():
    request = validate(good_request())
    assert request.state == {"ticket": "refund please", "amount": 12.5}
    assert [q.id for q in request.questions] == ["route", "urgency", "refund"]
    assert request.questions[0] == Question("route", "choice", "Who handles it?", {"billing": "Money", "tech": None})
    assert list(request.questions[0].criteria) == ["billing", "tech"]
    assert request.questions[1].criteria == ["low", "medium", "high"]
    assert request.questions[2].criteria == {"true": "refund", "false": "no refund"}
    assert request.model is None
    assert request.candidate_count == 2 + 3 + 1


def test_python_values_are_round_tripped_to_json():
    obj = good_request()
    obj["state"] = {"pair": (1, 2), 3: "three"}
    obj["questions"]["route"]["criteria"]["billing"] = {"ids": (4,)}
    request = validate(obj)
    assert request.state == {"pair": [1, 2], "3": "three"}
    assert request.questions[0].criteria["billing"] == {"ids": [4]}


def test_unknown_keys_are_ignored():
    obj = good_request()
    obj["stream"] = True
    obj["questions"]["route"]["description"] = "extra"
    assert validate(obj) == validate(good_request())


def test_validation_does_not_mutate_input():
    obj = good_request()
    before = copy.deepcopy(obj)
    validate(obj)
    assert obj == before


# ---------------------------------------------------------------- top level


@pytest.mark.parametrize("obj", [[], "request", None, 3, [good_request()]])
def test_request_must_be_an_object(obj):
    rejected(obj, "the request must be a JSON object with state and questions")


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (["state"], "the request is missing state"),
        (["questions"], "the request is missing questions"),
        (["state", "questions"], "the request is missing state and questions"),
    ],
)
def test_state_and_questions_required(drop, message):
    obj = good_request()
    for key in drop:
        del obj[key]
    rejected(obj, message)


@pytest.mark.parametrize("model", [None, "open-jev", "jev-latest", MODEL_ID])
def test_accepted_models(model):
    obj = good_request() | {"model": model}
    assert validate(obj).model == model


@pytest.mark.parametrize(
    "model", ["Qwen/Qwen3.5-2B", "open-jev-27b", "", "OPEN-JEV", 5, ["open-jev"], {"id": MODEL_ID}]
)
def test_unknown_model_rejected(model):
    rejected(good_request() | {"model": model}, MODEL_NOT_LOADED)
    assert MODEL_NOT_LOADED == "requested model is not loaded; see /v1/models"


@pytest.mark.parametrize("state", ["", "text", {"a": [1, {"b": None}]}, [], [1, "two"], {}])
def test_state_types_accepted(state):
    assert validate(good_request() | {"state": state}).state == state


@pytest.mark.parametrize("state", [None, 1, 1.5, True, False, ("tuple",)])
def test_state_wrong_types_rejected(state):
    rejected(good_request() | {"state": state}, "state must be a string, a JSON object or an array")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_state_must_round_trip_through_json(bad):
    message = rejected(good_request() | {"state": {"deep": [1, {"x": bad}]}})
    assert message.startswith("state must be JSON data without NaN or Infinity")


def test_state_with_non_json_type_rejected():
    message = rejected(good_request() | {"state": {"when": object()}})
    assert message.startswith("state must be JSON data without NaN or Infinity")


def test_lone_surrogate_rejected():
    obj = parse_json_strict(b'{"state": "bad \\ud800 text", "questions": {"q": {"type": "noul", "instructions": "?"}}}')
    rejected(obj, "state contains a lone surrogate; text must be valid Unicode")
    paired = parse_json_strict(
        b'{"state": "ok \\ud83d\\ude00", "questions": {"q": {"type": "noul", "instructions": "?"}}}'
    )
    assert validate(paired).state == "ok \U0001f600"


@settings(max_examples=300)
@given(st.lists(st.text(max_size=4) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)).map("".join))
def test_string_fast_path_gives_what_the_json_round_trip_gives(text):
    """Strings skip the JSON round trip: the same value back, or the same refusal for a lone surrogate."""
    obj = {"state": text, "questions": {text: {"type": "noul", "instructions": text}}}
    try:
        json.dumps(text, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        rejected(obj, "state contains a lone surrogate; text must be valid Unicode")
        return
    request = validate(obj)
    assert request.state == json.loads(json.dumps(text)) and request.questions[0].instructions == text


def test_string_subclasses_come_back_as_plain_strings():
    class Text(str):
        pass

    request = validate({"state": Text("s"), "questions": {"q": {"type": "noul", "instructions": Text("?")}}})
    assert type(request.state) is str and type(request.questions[0].instructions) is str


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("questions", [[], ["q"], "q", None, 1])
def test_questions_must_be_an_object(questions):
    rejected({"state": "s", "questions": questions}, "questions must be a JSON object of question id -> definition")


def test_questions_must_not_be_empty():
    rejected({"state": "s", "questions": {}}, "questions must not be empty")


def test_question_limit_4096():
    assert len(validate({"state": "s", "questions": noul_questions(4096)}).questions) == 4096
    rejected({"state": "s", "questions": noul_questions(4097)}, "too many questions: 4097 (the limit is 4096)")


def test_question_limit_is_configurable():
    assert len(validate({"state": "s", "questions": noul_questions(3)}, max_questions=3).questions) == 3
    rejected({"state": "s", "questions": noul_questions(4)}, "too many questions: 4 (the limit is 3)", max_questions=3)


def test_candidate_limit_65536():
    # 257 choice questions of 255 options = 65,535 candidates; each noul question adds one.
    options = {f"o{i}": None for i in range(255)}
    questions = {f"c{i}": {"type": "choice", "instructions": "?", "criteria": options} for i in range(257)}
    at_limit = {"state": "s", "questions": questions | noul_questions(1)}
    assert validate(at_limit).candidate_count == 65_536
    over = {"state": "s", "questions": questions | noul_questions(2)}
    rejected(over, "too many candidate sequences: 65537 (the limit is 65536)")


def test_candidate_limit_counts_every_type():
    obj = good_request()  # 2 + 3 + 1 candidates
    assert validate(obj, max_candidates=6).candidate_count == 6
    rejected(obj, "too many candidate sequences: 6 (the limit is 5)", max_candidates=5)


def test_question_id_must_be_a_string():
    rejected(
        {"state": "s", "questions": {1: {"type": "noul", "instructions": "?"}}}, "question ids must be strings, got int"
    )


@pytest.mark.parametrize("definition", [None, "noul", ["noul"], 1])
def test_definition_must_be_an_object(definition):
    rejected(with_question(definition), "question 'q': the definition must be a JSON object")


@pytest.mark.parametrize("kind", [None, "Choice", "yesno", "bool", 1, ["noul"], ""])
def test_type_must_be_known(kind):
    definition = {"instructions": "?"} if kind is None else {"type": kind, "instructions": "?"}
    rejected(with_question(definition), f"question 'q': type must be one of choice, score, noul (got {kind!r})")


@pytest.mark.parametrize("kind", ["choice", "score", "noul"])
def test_instructions_required(kind):
    rejected(with_question({"type": kind, "criteria": None}), "question 'q': instructions are required")


@pytest.mark.parametrize("instructions", [None, 1, 2.5, True])
def test_instructions_wrong_types(instructions):
    message = "question 'q': instructions must be a string, a JSON object or an array"
    rejected(with_question({"type": "noul", "instructions": instructions}), message)


@pytest.mark.parametrize("instructions", ["", "Is it?", {"ask": "x", "rules": [1, 2]}, ["a", {"b": None}]])
def test_instructions_types_accepted(instructions):
    assert (
        validate(with_question({"type": "noul", "instructions": instructions})).questions[0].instructions
        == instructions
    )


def test_instructions_with_nan_rejected():
    message = rejected(with_question({"type": "noul", "instructions": {"x": float("nan")}}))
    assert message.startswith("question 'q': instructions must be JSON data without NaN or Infinity")


# ---------------------------------------------------------------- choice


def choice(criteria) -> dict:
    return with_question({"type": "choice", "instructions": "?", "criteria": criteria})


@pytest.mark.parametrize("criteria", [None, ["a", "b"], "a", 3])
def test_choice_criteria_must_be_an_object(criteria):
    rejected(choice(criteria), "question 'q': choice criteria must be a JSON object of option key -> description")


def test_choice_criteria_required():
    message = "question 'q': choice criteria must be a JSON object of option key -> description"
    rejected(with_question({"type": "choice", "instructions": "?"}), message)


def test_choice_option_count_limits():
    rejected(choice({}), "question 'q': choice criteria must have 1 to 255 options (got 0)")
    assert validate(choice({"only": None})).candidate_count == 1
    assert validate(choice({f"o{i}": f"d{i}" for i in range(255)})).candidate_count == 255
    rejected(
        choice({f"o{i}": f"d{i}" for i in range(256)}),
        "question 'q': choice criteria must have 1 to 255 options (got 256)",
    )


@pytest.mark.parametrize("description", [None, "", "text", {"k": [1, 2]}, ["x"]])
def test_choice_description_types_accepted(description):
    assert validate(choice({"a": description})).questions[0].criteria == {"a": description}


@pytest.mark.parametrize("description", [1, 0.5, True, False])
def test_choice_description_wrong_types(description):
    message = "question 'q': option 'a': the description must be a string, a JSON object, an array or null"
    rejected(choice({"a": description}), message)


def test_choice_keys_keep_criteria_order():
    keys = ["zeta", "alpha", "mid", "Beta"]
    assert list(validate(choice({k: None for k in keys})).questions[0].criteria) == keys


def test_choice_key_must_be_a_string():
    rejected(choice({1: "x"}), "question 'q': choice option keys must be strings, got int")


# ---------------------------------------------------------------- score


def score(criteria) -> dict:
    return with_question({"type": "score", "instructions": "?", "criteria": criteria})


@pytest.mark.parametrize("criteria", [None, {"0": "low", "1": "high"}, "low,high", 3])
def test_score_criteria_must_be_an_array(criteria):
    rejected(score(criteria), "question 'q': score criteria must be an array of levels, lowest first")


def test_score_level_count_limits():
    rejected(score(["only"]), "question 'q': score criteria must have 2 to 10 levels (got 1)")
    rejected(score([]), "question 'q': score criteria must have 2 to 10 levels (got 0)")
    assert validate(score(["low", "high"])).candidate_count == 2
    assert validate(score([f"l{i}" for i in range(10)])).candidate_count == 10
    rejected(score([f"l{i}" for i in range(11)]), "question 'q': score criteria must have 2 to 10 levels (got 11)")


@pytest.mark.parametrize("level", [None, 1, 2.5, True])
def test_score_level_wrong_types(level):
    rejected(score(["low", level]), "question 'q': level 1 must be a string, a JSON object or an array")


def test_score_level_types_accepted():
    levels = ["low", {"label": "mid", "min": 3}, ["high", 9]]
    assert validate(score(levels)).questions[0].criteria == levels


# ---------------------------------------------------------------- noul


def noul(**criteria) -> dict:
    return with_question({"type": "noul", "instructions": "?"} | criteria)


def test_noul_criteria_optional():
    assert validate(noul()).questions[0].criteria is None
    assert validate(noul(criteria=None)).questions[0].criteria is None


@pytest.mark.parametrize(
    ("criteria", "got"),
    [
        ({"true": "yes"}, "['true']"),
        ({"false": "no"}, "['false']"),
        ({}, "[]"),
        ({"true": "y", "false": "n", "maybe": "m"}, "['false', 'maybe', 'true']"),
        ({"True": "y", "False": "n"}, "['False', 'True']"),
        ({"yes": "y", "no": "n"}, "['no', 'yes']"),
        (["true", "false"], "list"),
        ("true", "str"),
    ],
)
def test_noul_criteria_keys_must_be_exactly_true_false(criteria, got):
    message = f'question \'q\': noul criteria must be an object with exactly the keys "true" and "false" (got {got})'
    rejected(noul(criteria=criteria), message)


@pytest.mark.parametrize("key", ["true", "false"])
@pytest.mark.parametrize("value", [None, 1, False])
def test_noul_criteria_value_types(key, value):
    criteria = {"true": "y", "false": "n"} | {key: value}
    rejected(
        noul(criteria=criteria), f"question 'q': noul criteria {key!r} must be a string, a JSON object or an array"
    )


def test_noul_criteria_values_accepted():
    criteria = {"false": ["n", 1], "true": {"means": "y"}}
    assert validate(noul(criteria=criteria)).questions[0].criteria == {"true": {"means": "y"}, "false": ["n", 1]}


# ---------------------------------------------------------------- the wire path


def test_wire_body_validates_like_the_object():
    body = json.dumps(good_request()).encode()
    assert validate(parse_json_strict(body)) == validate(good_request())
