"""The decision server over real HTTP on free local ports, with the tiny twin (synthetic weights: the probabilities
are meaningless for accuracy; these tests check the contract, not the decisions): every endpoint and status code with
its body, the check order (400/403 Host -> 404 -> 403 -> 415 -> 413 -> 422), the Host check against DNS rebinding,
body framing (Content-Length and chunked), HTTP answers identical to `decide()`, the candidate and token budgets
(issue 15's amplification bodies refused in well under a second). The other server tests: test_server_failures.py
(forced failures, the queue, deadlines, shutdown, the worker thread, the access log), test_server_stack.py (the ASGI
stack: fuzz findings, framing limits, metrics, another ASGI server, the overhead, the command line, the engine
backends), test_server_fuzz.py (generated bodies, the 8-client soak), test_server_abuse.py and
test_server_admission.py (issue 23).
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from bench.amplification import amplification_body, many_candidates_body
from engine.serve.app import MAX_BODY_BYTES
from engine.server import DecisionServer, model_from_arguments, parse_arguments
from reference.request import MODEL_NOT_LOADED, RequestError, parse_json_strict
from reference.service import DecisionModel
from tests.server_client import (
    INVALID_SCHEMA,
    TIMEOUT_S,
    address,
    call,
    exchange,
    post,
    short_request,
    without_timing,
)

# ---------------------------------------------------------------- GET endpoints


def test_health_and_models(server):
    status, headers, body = call(server, "GET", "/health")
    assert status == 200 and headers["content-type"] == "application/json"
    assert body == {"status": "ready", "model": "jevlab/tiny-twin", "method": "synthetic_weights"}
    assert list(body) == ["status", "model", "method"]
    status, _, body = call(server, "GET", "/v1/models")
    assert status == 200
    assert body == {
        "models": [
            {
                "id": "jevlab/tiny-twin",
                "name": "jevlab/tiny-twin",
                "description": "Open-Jev local synthetic_weights",
                "release_date": "2026-09-19",
                "method": "synthetic_weights",
            }
        ],
        "aliases": ["open-jev", "jev-latest"],
    }


def test_unknown_paths_and_methods(server):
    assert call(server, "GET", "/v1/systemone")[::2] == (404, {"error": "not found"})
    assert call(server, "GET", "/nope?x=1")[::2] == (404, {"error": "not found"})
    assert post(server, INVALID_SCHEMA, path="/v1/decide")[::2] == (404, {"error": "not found"})
    status, headers, body = call(server, "PUT", "/v1/systemone", b"{}", {"Content-Type": "application/json"})
    assert status == 501 and headers["connection"] == "close" and isinstance(body["error"], str)


# ---------------------------------------------------------------- POST: answers


def test_drone_over_http_equals_decide(server, tiny_model, drone):
    status, headers, body = post(server, drone)
    assert status == 200 and headers["content-type"] == "application/json"
    assert without_timing(body) == without_timing(tiny_model.decide(drone))
    assert list(body) == ["answers", "model", "usage", "metadata"]
    assert list(body["answers"]) == list(drone["questions"])
    assert list(body["answers"]["maneuver"]["probabilities"]) == list(drone["questions"]["maneuver"]["criteria"])


def test_every_alias_answers_the_same(server, tiny_model):
    expected = without_timing(tiny_model.decide(short_request(2)))
    for path in ("/v1/systemone", "/v1/inference", "/api/jev"):
        status, _, body = post(server, short_request(2), path=path)
        assert status == 200 and without_timing(body) == expected


def test_keep_alive_and_model_aliases(server):
    connection = http.client.HTTPConnection(*address(server), timeout=TIMEOUT_S)
    try:
        answers = []
        for model in ("open-jev", "jev-latest", "jevlab/tiny-twin", None):
            request = {**short_request(1), **({"model": model} if model else {})}
            connection.request("POST", "/api/jev", json.dumps(request), {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200 and response.getheader("connection") is None
            answers.append(json.loads(response.read())["answers"])
        assert all(answer == answers[0] for answer in answers)
    finally:
        connection.close()


# ---------------------------------------------------------------- POST: rejections and their order


def test_cross_origin(server, tiny_model):
    host, port = address(server)
    foreign = post(server, INVALID_SCHEMA, Origin="http://evil.example")
    assert foreign[0] == 403 and foreign[2] == {"error": "cross-origin requests are disabled"}
    assert foreign[1]["connection"] == "close"
    assert post(server, INVALID_SCHEMA, Origin="null")[0] == 403
    assert post(server, INVALID_SCHEMA, Origin=f"http://{host}:{port + 1}")[0] == 403
    assert post(server, INVALID_SCHEMA, Origin=f"http://{host}:{port}")[0] == 422  # same origin: past the check
    with DecisionServer(tiny_model, port=0, allow_cross_origin=True) as allowing:
        allowing.start()
        assert post(allowing, INVALID_SCHEMA, Origin="http://evil.example")[0] == 422


def test_cross_origin_flag_and_environment(monkeypatch):
    monkeypatch.delenv("JEV_ALLOW_CROSS_ORIGIN", raising=False)
    assert parse_arguments([]).allow_cross_origin is False
    assert parse_arguments(["--allow-cross-origin"]).allow_cross_origin is True
    monkeypatch.setenv("JEV_ALLOW_CROSS_ORIGIN", "1")
    assert parse_arguments([]).allow_cross_origin is True
    defaults = parse_arguments([])
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8791)


HOST_NOT_ALLOWED = {
    "error": "Host is not allowed: this server answers localhost, 127.0.0.1, [::1] and --allow-host names"
}
BAD_HOST = {"error": "a request needs exactly one valid Host header"}


def test_dns_rebinding_host_is_403_even_with_a_matching_origin(server):
    """A rebinding page's request: its own name in Host and Origin. Refused on every path, before the path check."""
    port = address(server)[1]
    for name in ("evil.example", "localhost.evil.example", "127.0.0.1.nip.io", "[::2]"):
        headers = {"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}"}
        status, response_headers, body = post(server, short_request(0), **headers)
        assert (status, body, response_headers["connection"]) == (403, HOST_NOT_ALLOWED, "close")
        assert call(server, "GET", "/health", headers=headers)[::2] == (403, HOST_NOT_ALLOWED)
        assert post(server, INVALID_SCHEMA, path="/x", **headers)[::2] == (403, HOST_NOT_ALLOWED)


def test_loopback_host_names_pass_with_or_without_the_port(server, tiny_model):
    port = address(server)[1]
    expected = without_timing(tiny_model.decide(short_request(7)))
    for host in ("localhost", "LocalHost", "127.0.0.1", "[::1]", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:1"):
        status, _, body = post(server, short_request(7), Host=host, Origin=f"http://{host}")
        assert status == 200 and without_timing(body) == expected
        assert call(server, "GET", "/health", headers={"Host": host})[0] == 200


def test_missing_duplicate_or_malformed_host_is_400(server):
    tail = b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    for hosts in (b"", b"Host: localhost\r\nHost: localhost\r\n", b"Host: \r\n", b"Host: a b\r\n", b"Host: [::1\r\n"):
        raw = b"POST /v1/systemone HTTP/1.1\r\n" + hosts + tail
        status, headers, body = exchange(server, raw)
        assert (status, body, headers["connection"]) == (400, BAD_HOST, "close"), hosts
    assert exchange(server, b"GET /health HTTP/1.0\r\n\r\n")[::2] == (400, BAD_HOST)
    assert exchange(server, b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")[0] == 200


def test_allowed_hosts_and_non_loopback_binding(tiny_model):
    with DecisionServer(tiny_model, port=0, allowed_hosts=["Jev.Internal"]) as allowing:
        allowing.start()
        assert post(allowing, INVALID_SCHEMA, Host="jev.internal:8791")[0] == 422  # past the Host check
        assert post(allowing, INVALID_SCHEMA, Host="evil.example")[::2] == (403, HOST_NOT_ALLOWED)
    with DecisionServer(tiny_model, host="0.0.0.0", port=0) as public:  # bound to every address: any name passes
        public.start()
        connection = http.client.HTTPConnection("127.0.0.1", address(public)[1], timeout=TIMEOUT_S)
        try:
            connection.request("GET", "/health", headers={"Host": "jev.example.org"})
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ready"
            connection.request("GET", "/health", headers={"Host": "a b"})
            assert connection.getresponse().status == 400  # still exactly one well-formed Host
        finally:
            connection.close()
    assert parse_arguments([]).allow_host == []
    assert parse_arguments(["--allow-host", "a.lan", "--allow-host", "b.lan"]).allow_host == ["a.lan", "b.lan"]


def test_content_type(server):
    json_body = json.dumps(INVALID_SCHEMA).encode()
    unsupported = {"error": "Content-Type must be application/json"}
    assert call(server, "POST", "/v1/systemone", json_body, {})[::2] == (415, unsupported)
    assert call(server, "POST", "/v1/systemone", json_body, {"Content-Type": "text/plain"})[::2] == (415, unsupported)
    assert call(server, "POST", "/v1/systemone", json_body, {"Content-Type": "application/jsonx"})[0] == 415
    for accepted in ("application/json; charset=utf-8", "Application/JSON"):
        assert call(server, "POST", "/v1/systemone", json_body, {"Content-Type": accepted})[0] == 422


def test_body_size_limits(server):
    too_large = {"error": "request body size is outside server limits"}
    assert post(server, b"")[::2] == (413, too_large)
    # Exactly 4 MiB is accepted (a schema error proves it was parsed); one byte more is refused.
    prefix = b'{"state": "'
    at_limit = prefix + b"x" * (MAX_BODY_BYTES - len(prefix) - 2) + b'"}'
    assert len(at_limit) == MAX_BODY_BYTES
    assert post(server, at_limit)[::2] == (422, {"error": "the request is missing questions"})
    over = at_limit[:-2] + b'x"}'
    status, headers, body = post(server, over)
    assert (status, body, headers["connection"]) == (413, too_large, "close")
    # A declared length over the limit is refused before the body is read.
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    assert exchange(server, head + f"Content-Length: {10 * MAX_BODY_BYTES}\r\n\r\n".encode())[::2] == (413, too_large)


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, start = b"", 0
    for size in sizes:
        out += f"{size:x};ext=1\r\n".encode() + body[start : start + size] + b"\r\n"
        start += size
    assert start == len(body)
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def test_chunked_bodies(server, tiny_model):
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\n"
    body = json.dumps(short_request(4)).encode()
    status, _, answer = exchange(server, head + b"\r\n" + chunked(body, [7, 30, len(body) - 37]))
    assert status == 200 and without_timing(answer) == without_timing(tiny_model.decide(short_request(4)))
    # With both framings, chunked wins and the connection is not reused.
    schema_error = json.dumps(INVALID_SCHEMA).encode()
    both = head + b"Content-Length: 3\r\n\r\n" + chunked(schema_error, [len(schema_error)])
    status, headers, answer = exchange(server, both)
    assert (status, answer, headers["connection"]) == (422, {"error": "the request is missing questions"}, "close")
    assert exchange(server, head + b"\r\n" + b"0\r\n\r\n")[::2] == (
        413,
        {"error": "request body size is outside server limits"},
    )
    big_chunk = b"x" * (1 << 20)
    over = b"".join(f"{len(big_chunk):x}\r\n".encode() + big_chunk + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    assert exchange(server, head + b"\r\n" + over)[0] == 413
    for size in (b"zz", b"-1", b"+2", b"0x2"):
        assert exchange(server, head + b"\r\n" + size + b"\r\n{}\r\n0\r\n\r\n")[0] == 400
    plain = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    for length in (b"-1", b"1e3", b"\xb2", b"3, 4"):
        assert exchange(server, plain + b"Content-Length: " + length + b"\r\n\r\n{}")[::2] == (
            400,
            {"error": "invalid Content-Length"},
        )
    expect = plain + f"Expect: 100-continue\r\nContent-Length: {len(schema_error)}\r\n\r\n".encode()
    assert exchange(server, expect + schema_error)[::2] == (422, {"error": "the request is missing questions"})
    gzip = head.replace(b"chunked", b"gzip")
    assert exchange(server, gzip + b"\r\n" + schema_error)[0] == 400


def test_check_order(server):
    """400 Host before 403 Host before 404 before 403 before 415 before 413 before 422."""
    empty = b""
    no_host = b"POST /x HTTP/1.1\r\nOrigin: http://evil.example\r\nContent-Type: text/plain\r\n\r\n"
    assert exchange(server, no_host)[0] == 400
    assert call(server, "POST", "/x", empty, {"Host": "evil.example", "Origin": "http://evil.example"})[0] == 403
    assert call(server, "POST", "/x", empty, {"Origin": "http://evil.example"})[0] == 404
    assert call(server, "POST", "/v1/systemone", empty, {"Origin": "http://evil.example"})[0] == 403
    assert call(server, "POST", "/v1/systemone", empty, {"Content-Type": "text/plain"})[0] == 415
    assert call(server, "POST", "/v1/systemone", empty, {"Content-Type": "application/json"})[0] == 413
    assert post(server, b"{")[0] == 422


@pytest.mark.parametrize(
    "body",
    [
        b'{"state": "s", "state": "t", "questions": {}}',
        b'{"state": NaN, "questions": {}}',
        b'{"state": "s", "questions": {"q": {"type": "noul", "instructions": -Infinity}}}',
        b'{"state": "s", "questions": ',
        b"\xff\xfe{}",
    ],
)
def test_strict_json_is_422_with_the_pipeline_message(server, body):
    with pytest.raises(RequestError) as caught:
        parse_json_strict(body)
    assert post(server, body)[::2] == (422, {"error": caught.value.message})


def test_schema_model_and_length_errors(server, tiny_model, drone):
    assert post(server, {"state": "s", "questions": {}})[::2] == (422, {"error": "questions must not be empty"})
    not_object = {"error": "the request must be a JSON object with state and questions"}
    assert post(server, b"[]")[::2] == (422, not_object)
    assert post(server, {**drone, "model": "gpt-x"})[::2] == (422, {"error": MODEL_NOT_LOADED})
    bad_type = {"state": "s", "questions": {"q": {"type": "rank", "instructions": "?"}}}
    status, _, answer = post(server, bad_type)
    assert status == 422 and "type must be one of choice, score, noul" in answer["error"]
    # Over-length: the drone's longest candidate has 149 tokens (recorded with the Qwen tokenizer).
    short = DecisionModel(tiny_model.backbone, tiny_model.weights, max_length=148)
    with DecisionServer(short, port=0) as limited:
        limited.start()
        assert post(limited, drone)[::2] == (
            422,
            {"error": "Input length 149 exceeds max_length=148; no silent truncation"},
        )
        assert post(limited, short_request(0))[0] == 200  # per candidate, not per request


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (amplification_body, "too many input tokens for the token budget: up to "),
        (many_candidates_body, "too many candidate sequences for the candidate budget: 65535 (the budget is 4096 "),
    ],
)
def test_amplification_bodies_are_422_in_well_under_a_second(server, body, message):
    """Issue 15's bodies over HTTP: 11-14 s and 4.6 GB, or past 9 GB until killed, before admission; now a 422 naming
    the budget and the numbers, and the server answers the next request as usual."""
    data = body()
    start = time.perf_counter()
    status, _, answer = post(server, data)
    elapsed = time.perf_counter() - start
    assert status == 422 and answer["error"].startswith(message) and elapsed < 1.0
    assert post(server, short_request(8))[0] == 200


def test_budgets_on_the_command_line():
    defaults = parse_arguments([])
    assert (defaults.candidate_budget, defaults.token_budget) == (4096, 1 << 20)
    args = parse_arguments(
        ["--shapes", "tiny", "--backend", "hf_torch", "--candidate-budget", "5", "--token-budget", "9"]
    )
    model = model_from_arguments(args)
    assert (model.candidate_budget, model.token_budget) == (5, 9)


def test_errors_never_stop_the_server(server, drone):
    bad = [b"", b"{", json.dumps({**drone, "model": "gpt-x"}).encode(), b'{"a": 1, "a": 2}']
    connection = http.client.HTTPConnection(*address(server), timeout=TIMEOUT_S)
    try:
        for body in bad * 3:
            connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status in (413, 422)
            response.read()
            if response.getheader("connection") == "close":
                connection.close()
    finally:
        connection.close()
    assert call(server, "GET", "/health")[0] == 200
    assert post(server, short_request(3))[0] == 200
