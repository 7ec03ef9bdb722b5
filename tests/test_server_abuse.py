"""Issue 23, serving under abuse: each finding of the held-out campaign against the server at 2f9c178 as a test that
failed there (checked by running this file against that commit's engine/server.py) and passes now.

The queue bound with batching on, deadlines and closed connections that free the worker, every failure of the model as
that request's JSON 500, and the smaller framing items. Admission by cost is in tests/test_server_admission.py. The tiny
twin has synthetic weights: nothing here is about the decisions.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.fuzz_server import parse_answers
from engine.server import DecisionServer
from reference.service import ForwardAbandoned, default_model
from tests.server_client import TIMEOUT_S, address, call, exchange, post, short_request, wait_until


class GateModel:
    """A decide-only model: request {"n": k} waits until `open(k)`; `started` lists the k it began, in order."""

    weights = types.SimpleNamespace(model_id="gate", method="test")

    def __init__(self):
        self.started: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def gate(self, n: int) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(n, threading.Event())

    def open(self, n: int) -> None:
        self.gate(n).set()

    def decide(self, request):
        self.started.append(request["n"])
        if not self.gate(request["n"]).wait(TIMEOUT_S):
            raise TimeoutError("never opened")
        return {"echo": request}


def test_the_queue_bound_counts_jobs_taken_for_the_next_forward():
    """Before: with batching on, the worker moved every queued job into its own list before each forward, so the queue
    refilled behind them (`--queue-size 2` reached a depth of 21). Now the bound counts every job not yet taken into a
    forward: with 1 running and 2 waiting, one of them already taken off the queue, the next request is a 503 at
    once, and the depth never passes 2."""
    model = GateModel()
    with DecisionServer(model, port=0, queue_size=2) as gated, ThreadPoolExecutor(8) as pool:
        gated.start()
        depths: list[int] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                depths.append(gated.worker.depth())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            first = pool.submit(post, gated, {"n": 0})
            wait_until(lambda: model.started == [0])
            waiting = [pool.submit(post, gated, {"n": n}) for n in (1, 2)]
            wait_until(lambda: gated.worker.depth() == 2)
            assert post(gated, {"n": 9})[0] == 503
            model.open(0)  # the worker takes 1 to run and 2 off the queue, for the forward after
            wait_until(lambda: len(model.started) == 2)
            later = pool.submit(post, gated, {"n": 3})  # waits beside 2
            wait_until(lambda: gated.worker.depth() == 2)
            start = time.perf_counter()
            busy = pool.submit(post, gated, {"n": 4}).result(5.0)
            assert busy[0] == 503 and time.perf_counter() - start < 1.0
        finally:
            for n in range(5):
                model.open(n)
            sampling.set()
            sampler.join(TIMEOUT_S)
        assert first.result(TIMEOUT_S)[0] == 200
        assert [w.result(TIMEOUT_S)[0] for w in waiting] == [200, 200] and later.result(TIMEOUT_S)[0] == 200
        assert max(depths) <= 2


def test_a_burst_of_twice_the_queue_gets_503_for_every_extra_request():
    """8 requests at once against a held worker and a queue of 4: 4 wait, 4 are 503 at once; depth never above 4."""
    model = GateModel()
    with DecisionServer(model, port=0, queue_size=4) as gated, ThreadPoolExecutor(9) as pool:
        gated.start()
        running = pool.submit(post, gated, {"n": 0})
        wait_until(lambda: model.started == [0])
        try:
            burst = [pool.submit(post, gated, {"n": n}) for n in range(1, 9)]
            wait_until(lambda: sum(f.done() for f in burst) == 4)
            assert gated.worker.depth() == 4
            assert [f.result()[0] for f in burst if f.done()] == [503] * 4
        finally:
            for n in range(9):
                model.open(n)
        assert running.result(TIMEOUT_S)[0] == 200
        assert sorted(f.result(TIMEOUT_S)[0] for f in burst) == [200] * 4 + [503] * 4


# ---------------------------------------------------------------- deadlines and closed connections free the worker


def slow_request() -> dict:
    """Two candidates of about 13,000 tokens each (a choice of two over one long state): eight decoder layers of the
    tiny twin's hf_torch, 0.4-1.0 s each in a fresh process on a 2-core CPU and up to 6 s late in the CPU suite
    (`test_a_closed_connection_stops_the_forward` says why). One candidate took 2.2-2.4 s in all, too close to the
    2 s deadline below: it once answered 200 in CI (a clean clone of 846f747)."""
    state = ("The order arrived late and the customer asked for a refund. " * 1200)[:65200]
    question = {"type": "choice", "instructions": "Late?", "criteria": {"a": "A", "b": "B"}}
    return {"state": state, "questions": {"q": question}}


@dataclass
class Forward:
    """One `answer_many` call as `ForwardSpy` saw it: every ask of the server's abandon flag (time, answer), when each
    decoder layer began, and what the call returned."""

    asks: list[tuple[float, bool]] = field(default_factory=list)
    began: list[float] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)


class ForwardSpy:
    """`default_model()` (one shared instance: `reference.service.default_model` is cached) with its forwards watched,
    as the model a server is given: every attribute is the model's but `answer_many`, which wraps the flag the worker
    passes to note every ask (the backbone's layer check asks it once before each layer). Inside `with`, a pre-hook on
    every decoder layer, registered after the backbone's own (`HFBackbone.layer_check`), notes when each layer began:
    it runs only for a layer that check let through. The hooks are removed on exit; the shared model is left as it was.
    """

    def __init__(self):
        self.model = default_model()
        self.layers = len(self.model.backbone.model.layers)
        self.forwards: list[Forward] = []
        self._hooks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __enter__(self) -> ForwardSpy:
        for layer in self.model.backbone.model.layers:
            began = layer.register_forward_pre_hook(
                lambda module, args: self.forwards[-1].began.append(time.perf_counter())
            )
            self._hooks.append(began)
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def answer_many(self, compiled, *, abandoned=None):
        forward = Forward()
        self.forwards.append(forward)

        def asked() -> bool:
            at = time.perf_counter()
            forward.asks.append((at, answer := abandoned is not None and abandoned()))
            return answer

        forward.results = self.model.answer_many(compiled, abandoned=asked)
        forward.ended.set()
        return forward.results

    def assert_stopped_at_the_next_layer(self, forward: Forward, flag_set_by: float) -> None:
        """`forward` ended as abandoned, at the first layer boundary after the flag was set (by `flag_set_by` at the
        latest): its asks were no, then one yes that stopped it; no ask after `flag_set_by` was a no; no layer began
        after the yes, and the forward stopped before its last layer."""
        assert [type(result) for result in forward.results] == [ForwardAbandoned]
        answers = [answer for _, answer in forward.asks]
        assert answers == [False] * (len(answers) - 1) + [True], forward.asks
        assert all(answer for at, answer in forward.asks if at > flag_set_by), forward.asks
        assert max(forward.began) < forward.asks[-1][0] and len(forward.began) < self.layers


def test_a_passed_deadline_stops_the_forward_between_layers():
    """Before: with `--deadline 3`, a small request 6 s after a 504 still got its 504, as the abandoned forward ran on.
    Now the forward stops at the next decoder layer once its client's deadline passed, and the worker answers the next
    request. The server sets the flag before it sends the 504, so every ask after the client read the 504 must be yes.
    """
    with ForwardSpy() as spy, DecisionServer(spy, port=0, deadline_s=2.0, access_log=io.StringIO()) as slow:
        slow.start()
        assert post(slow, short_request(1))[0] == 200
        assert post(slow, slow_request())[0] == 504
        answered_504 = time.perf_counter()
        assert spy.forwards[1].ended.wait(TIMEOUT_S)
        assert post(slow, short_request(2))[0] == 200
    spy.assert_stopped_at_the_next_layer(spy.forwards[1], flag_set_by=answered_504)


def test_a_closed_connection_stops_the_forward():
    """A client that closes its connection while its forward runs: the server sees the close at once (the flag is set
    within 1 s) and the forward stops at the next layer boundary; the next request is answered.

    No wall-clock bound on the next answer: it waits for the layer that was running when the client left, and one
    layer of this request took 0.4-1.0 s in a fresh process but 3-6 s late in the CPU suite, which failed a 2.5 s
    bound in CI. Seen in two suite runs of 2026-12-05: the worker thread alone busy, on one core, in the first GDN
    layer; the time is the kernel's, faulting in fresh pages of large tensors (five elementwise ops on a 426 MB tensor
    on a new thread: 5.1 s, 4.8 of them system time, at the suite's start; 20.4 s, 25.4 system over both cores,
    before this file's tests)."""
    body = json.dumps(slow_request()).encode()
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    with ForwardSpy() as spy, DecisionServer(spy, port=0, access_log=io.StringIO()) as served:
        served.start()
        with socket.create_connection(address(served), timeout=TIMEOUT_S) as sock:
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: bool(spy.forwards) and bool(spy.forwards[0].began), TIMEOUT_S)  # the forward runs
        closed = time.perf_counter()
        assert post(served, short_request(3))[0] == 200
    spy.assert_stopped_at_the_next_layer(spy.forwards[0], flag_set_by=closed + 1.0)


# ---------------------------------------------------------------- every failure is that request's JSON 500


class RaisingModel:
    """A decide-only model raising the exception class its request names under "raise"."""

    weights = types.SimpleNamespace(model_id="raising", method="test")
    classes = {
        "StopIteration": StopIteration,
        "GeneratorExit": GeneratorExit,
        "CancelledError": asyncio.CancelledError,
        "StopAsyncIteration": StopAsyncIteration,
    }

    def decide(self, request):
        if "raise" in request:
            raise self.classes[request["raise"]]("from the model")
        return {"echo": request}


class RaisingCompiler(RaisingModel):
    """A model with `compile`, `batch_requests` and `answer_many`: `compile` raises what the request names."""

    def compile(self, request):
        if "raise" in request:
            raise self.classes[request["raise"]]("from compile")
        return request

    def batch_requests(self, queued) -> int:
        return 1

    def answer_many(self, compiled, *, abandoned=None):
        return [{"echo": request} for request in compiled]


@pytest.mark.parametrize("name", sorted(RaisingModel.classes))
def test_every_failure_of_the_forward_is_its_json_500(name):
    """Before: StopIteration waited for the deadline (504; asyncio refuses it as a future's exception), GeneratorExit
    got a plain-text 500, CancelledError none at all. Now each is that request's JSON 500 naming the class, and the
    next request is answered."""
    with DecisionServer(RaisingModel(), port=0, deadline_s=5.0, access_log=io.StringIO()) as raising:
        raising.start()
        start = time.perf_counter()
        assert post(raising, {"raise": name})[::2] == (500, {"error": "model inference failed", "error_type": name})
        assert time.perf_counter() - start < 2.0
        assert post(raising, {"n": 1})[::2] == (200, {"echo": {"n": 1}})


@pytest.mark.parametrize("name", sorted(RaisingModel.classes))
@pytest.mark.parametrize("padding", [0, 70 * 1024], ids=["inline", "over-64KiB"])
def test_every_failure_of_compiling_is_its_json_500(name, padding):
    """Before: a StopIteration while compiling a body over 64 KiB (on the thread pool) was never answered. Now compile's
    failures are that request's JSON 500 on the loop and on the pool alike."""
    with DecisionServer(RaisingCompiler(), port=0, deadline_s=5.0, access_log=io.StringIO()) as raising:
        raising.start()
        body = {"raise": name, "pad": "x" * padding}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, raising, body).result(5.0)
        assert answer[::2] == (500, {"error": "model inference failed", "error_type": name})
        assert post(raising, {"n": 1})[::2] == (200, {"echo": {"n": 1}})


# ---------------------------------------------------------------- framing


@pytest.fixture(scope="module")
def echo_server():
    with DecisionServer(RaisingModel(), port=0, access_log=io.StringIO()) as running:
        running.start()
        yield running


def test_two_origin_headers_are_refused(echo_server):
    """Before: the first Origin was used, so same-origin then foreign passed. Now more than one is a 400."""
    host, port = address(echo_server)
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    origins = b"Origin: http://localhost\r\nOrigin: http://evil.example\r\n"
    status, headers, body = exchange(echo_server, head + origins + b"Content-Length: 2\r\n\r\n{}")
    assert (status, body, headers["connection"]) == (
        400,
        {"error": "a request may carry at most one Origin header"},
        "close",
    )
    assert post(echo_server, {"n": 1}, Origin=f"http://{host}:{port}")[0] == 200


def test_an_http_2_request_line_is_505(echo_server):
    """Before: an HTTP/2.0 request line was answered as HTTP/1.1. Now 505; HTTP/1.0 still passes, and a request line
    without a version is a 400 (the parser refuses other versions, HTTP/1.2 among them, with its 400)."""
    status, headers, body = exchange(echo_server, b"GET /health HTTP/2.0\r\nHost: localhost\r\n\r\n")
    assert status == 505 and headers["connection"] == "close"
    assert body == {"error": "HTTP version not supported: HTTP/2.0 (this server speaks HTTP/1.1 and 1.0)"}
    assert exchange(echo_server, b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")[0] == 200
    assert exchange(echo_server, b"GET /health\r\n\r\n")[::2] == (
        400,
        {"error": "invalid request line: no HTTP version"},
    )
    assert call(echo_server, "GET", "/health")[0] == 200


@pytest.mark.parametrize("size", [b"ffffffffffffffff", b"400001", b"10;ext=1"], ids=["2^64-1", "4MiB+1", "extension"])
def test_a_chunk_over_the_body_limit_is_413_at_once(echo_server, size):
    """Before: a chunk size of 2^64-1 waited 30 s for the body timeout's 408. Now a chunk whose declared size takes the
    body over 4 MiB is a 413 as soon as its size line is read (a small chunk with an extension passes)."""
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    start = time.perf_counter()
    with socket.create_connection(address(echo_server), timeout=5.0) as sock:
        sock.sendall(head + size + b"\r\n" + b'{"n": 1}')
        if size.startswith(b"10;"):
            sock.sendall(b" " * 8 + b"\r\n0\r\n\r\n")
        answer = sock.recv(65536)
    status = int(answer.split(b" ", 2)[1])
    if size.startswith(b"10;"):
        assert status == 200
    else:
        assert status == 413 and b'{"error": "request body size is outside server limits"}' in answer
        assert time.perf_counter() - start < 1.0


def test_a_pipelined_get_after_a_large_post_is_answered(echo_server):
    """Before: a GET pipelined after a 300 KB POST got 431 when the read that held the end of the POST's body also held
    the start of the GET: all of that read was counted as the GET's head. The POST's last 70 KB and the GET's first
    bytes go in one write here, the rest of the GET after a pause."""
    body = json.dumps({"state": "x" * 300_000}).encode()
    post_raw = b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    post_raw += b"Content-Length: %d\r\n\r\n" % len(body) + body
    get = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.create_connection(address(echo_server), timeout=TIMEOUT_S) as sock:
        for part in (post_raw[: -70 * 1024], post_raw[-70 * 1024 :] + get[:20], get[20:]):
            sock.sendall(part)
            time.sleep(0.2)
        raw = b""
        while data := sock.recv(65536):
            raw += data
    answers, partial = parse_answers(raw, [], True)
    assert [answer.status for answer in answers] == [200, 200] and not partial


def test_an_over_length_body_gets_the_contracts_message(server):
    """Before: one candidate of a 4.1 MB state (under the 4 MiB body limit) got the token budget's message, since its
    byte bound (4.1 M tokens) is over the budget; the contract answers an over-length candidate with its length. Now
    that candidate is tokenized (about 0.1 s) and the answer is the contract's, in well under a second."""
    state = ("The order arrived late and the customer asked for a refund. " * 70000)[:4_100_000]
    body = json.dumps({"state": state, "questions": {"q": {"type": "noul", "instructions": "Late?"}}}).encode()
    assert len(body) <= 4 * 1024 * 1024
    start = time.perf_counter()
    status, _, answer = post(server, body)
    assert status == 422 and time.perf_counter() - start < 1.0
    assert answer["error"].startswith("Input length ")
    assert answer["error"].endswith(" exceeds max_length=16384; no silent truncation")
