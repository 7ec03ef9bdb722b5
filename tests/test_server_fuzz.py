"""Generated request bodies against the decision server (never a crash, never a 500 for a bad request) and a soak of
8 concurrent clients whose every answer equals the request answered alone. Tiny twin, synthetic weights.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_client import (
    call,
    post,
    short_request,
    without_timing,
)

# ---------------------------------------------------------------- fuzz

# Bodies: shaped requests whose fields are mostly well typed (so the fuzz reaches every rule of the schema and some
# requests are valid and answered), loose requests of arbitrary JSON, and spoiled or raw bytes.
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
texty = (
    st.text(max_size=16) | st.lists(json_leaf, max_size=2) | st.dictionaries(st.text(max_size=6), json_leaf, max_size=2)
)
CRITERIA = {
    "choice": st.dictionaries(st.text(max_size=8), st.none() | texty | json_leaf, max_size=4),  # 0 options: invalid
    "score": st.lists(texty | json_leaf, min_size=1, max_size=5),  # 1 level: invalid
    "noul": st.none() | st.fixed_dictionaries({"true": texty, "false": texty}) | json_value,
}
shaped_question = st.sampled_from(sorted(CRITERIA)).flatmap(
    lambda kind: st.fixed_dictionaries(
        {"type": st.just(kind), "instructions": st.one_of(texty, texty, texty, st.sampled_from([None, 0]))},
        optional={"criteria": CRITERIA[kind], "extra": json_value},
    )
)
shaped_request = st.fixed_dictionaries(
    {
        "state": st.one_of(texty, texty, texty, st.sampled_from([None, 1.5])),
        "questions": st.dictionaries(st.text(max_size=6), shaped_question, min_size=1, max_size=3),
    },
    optional={"model": st.sampled_from(["open-jev", "jev-latest", "jevlab/tiny-twin", None, "gpt-x"])},
)
loose_question = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["choice", "score", "noul", "Choice", "", "rank"]) | json_leaf,
        "instructions": texty | json_leaf,
        "criteria": json_value,
    },
)
loose_request = st.fixed_dictionaries(
    {},
    optional={
        "state": json_value,
        "questions": st.dictionaries(st.text(max_size=6), loose_question | json_value, max_size=3) | json_value,
        "model": json_leaf,
    },
)


def _spoil(text: str, how: str) -> str:
    if how == "duplicate" and text.startswith("{") and len(text) > 2:
        return '{"k": 1, "k": 2, ' + text[1:]
    if how == "nan":
        return text.replace("null", "NaN", 1) if "null" in text else "[NaN]"
    if how == "surrogate":
        return '{"state": "\\ud800", ' + text[1:] if text.startswith("{") and len(text) > 2 else '"\\udc00"'
    return text[: max(len(text) - 1, 0)]  # truncated


bodies = st.one_of(
    shaped_request.map(json.dumps),
    shaped_request.map(json.dumps),
    loose_request.map(json.dumps),
    json_value.map(json.dumps),
    st.tuples(shaped_request.map(json.dumps), st.sampled_from(["duplicate", "nan", "surrogate", "truncate"])).map(
        lambda pair: _spoil(*pair)
    ),
).map(str.encode) | st.binary(max_size=48)


@pytest.mark.slow
@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=bodies)
def test_fuzz_never_crashes_never_500(server, body):
    status, headers, answer = post(server, body)
    assert headers["content-type"] == "application/json"
    if status == 200:
        sent = json.loads(body)
        assert list(answer["answers"]) == list(sent["questions"])
        return
    assert status == (413 if body == b"" else 422), (status, answer)
    assert list(answer) == ["error"] and isinstance(answer["error"], str) and answer["error"]


def test_server_alive_after_fuzz(server):
    assert call(server, "GET", "/health")[0] == 200
    assert post(server, short_request(7))[0] == 200


# ---------------------------------------------------------------- soak


@pytest.mark.slow
def test_soak_8_clients_50_requests_each_identical_to_alone(server):
    variants = [short_request(i) for i in range(8)]
    alone = []
    for request in variants:
        status, _, body = post(server, request)
        assert status == 200
        alone.append(without_timing(body))
    assert len({json.dumps(a["answers"]) for a in alone}) == len(variants)  # distinct answers, so a mix-up shows

    def client(index: int) -> list[tuple[int, int, dict]]:
        out = []
        for n in range(50):
            variant = (index + n) % len(variants)
            status, _, body = post(server, variants[variant])
            out.append((variant, status, body))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for future in [pool.submit(client, i) for i in range(8)] for r in future.result(600)]
    assert len(results) == 400
    assert [status for _, status, _ in results] == [200] * 400
    for variant, _, body in results:
        assert without_timing(body) == alone[variant]
