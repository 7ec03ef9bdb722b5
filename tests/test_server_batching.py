"""Batching through the server (engine/serve/worker.py, `DecisionWorker`): requests that queue while a forward runs are
answered by one forward, each answer the same as the request's answer alone; a request that breaks the batch's forward
fails alone; a lone request is never held back. CPU tiny twin, the engine's tree over the reference compositions with
varlen attention (`batch_invariant`; tests/test_batching.py proves the model side, here the worker's). Synthetic
weights: only equality of probabilities is tested."""

from __future__ import annotations

import copy
import http.client
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.serve.worker import MAX_BATCH_REQUESTS
from engine.server import DecisionServer, app_options, parse_arguments
from engine.stages import build_engine, config_of
from engine.weights import MergedWeights
from reference.service import DecisionModel
from reference.shapes import TINY
from reference.weights import synthetic_weights

TIMEOUT_S = 120.0
BATCH_DESCRIBING = ("inference_seconds", "prefix_cache", "graph", "batch")  # the forward's, not the request's


@pytest.fixture(scope="module")
def model() -> DecisionModel:
    weights = synthetic_weights(TINY, seed=3)
    merged = MergedWeights.from_decision_weights(weights)
    engine = build_engine(merged, config_of("merged", layout="tree", attention="varlen"))
    assert engine.batch_invariant
    return DecisionModel(engine, weights, code_commit="test")


def body(state: str, options: int) -> dict:
    criteria = {f"option {k}": None for k in range(options)}
    return {"state": state, "questions": {"q": {"type": "choice", "instructions": "Which fits?", "criteria": criteria}}}


BODIES = [body(f"Report {n}: the pump {'hums' if n % 2 else 'rattles'} at {n * 7} hertz.", 2 + n % 3) for n in range(6)]


def post(server: DecisionServer, payload: dict) -> tuple[int, dict]:
    host, port = server.server_address
    connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        connection.request("POST", "/v1/systemone", json.dumps(payload), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def own_part(response: dict) -> dict:
    out = copy.deepcopy(response)
    for key in BATCH_DESCRIBING:
        out["metadata"].pop(key, None)
    return out


class HeldForward:
    """Wraps the backbone's `prepare` so the first call waits for `release`: the worker is busy, the others queue.
    `poison`: candidates whose presence in a batch makes `prepare` raise (a request that breaks any forward it is in).
    Records each call's candidate count."""

    def __init__(self, model: DecisionModel, poison: list[list[int]] | None = None):
        self.model, self.original = model, model.backbone.prepare
        self.started, self.release = threading.Event(), threading.Event()
        self.poison = poison or []
        self.calls: list[int] = []

    def __call__(self, candidates, groups):
        self.calls.append(len(candidates))
        if len(self.calls) == 1:
            self.started.set()
            assert self.release.wait(TIMEOUT_S)
        if any(ids in candidates for ids in self.poison):
            raise RuntimeError("poisoned batch")
        return self.original(candidates, groups)


def queue_behind_a_held_forward(server, held, first, queued) -> tuple[tuple[int, dict], list[tuple[int, dict]]]:
    with ThreadPoolExecutor(1 + len(queued)) as pool:
        running = pool.submit(post, server, first)
        assert held.started.wait(TIMEOUT_S)
        waiting = [pool.submit(post, server, payload) for payload in queued]
        deadline = threading.Event()
        while server.worker.depth() < len(queued) and not deadline.wait(0.01):
            pass
        held.release.set()
        return running.result(TIMEOUT_S), [future.result(TIMEOUT_S) for future in waiting]


def test_requests_queued_behind_a_forward_share_the_next_and_answer_as_alone(model, monkeypatch):
    alone = [model.decide(payload) for payload in BODIES]
    held = HeldForward(model)
    monkeypatch.setattr(model.backbone, "prepare", held)
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server:
        server.start()
        first, rest = queue_behind_a_held_forward(server, held, BODIES[0], BODIES[1:])
        metrics = server.decisions.metrics.text().decode()
    assert first[0] == 200 and own_part(first[1]) == own_part(alone[0]) and "batch" not in first[1]["metadata"]
    for (status, answer), expected in zip(rest, alone[1:]):
        assert status == 200 and own_part(answer) == own_part(expected)
        assert answer["metadata"]["batch"] == {"requests": 5, "candidate_sequences": held.calls[1]}
    # one forward for the first request, one for the five queued behind it
    assert held.calls == [len(first[1]["answers"]["q"]["probabilities"]), sum(2 + n % 3 for n in range(1, 6))]
    assert "jev_batch_requests_sum 6.0" in metrics and "jev_batch_requests_count 2.0" in metrics


def test_a_request_that_breaks_the_forward_fails_alone(model, monkeypatch):
    poison_body = body("This report breaks every forward it is in.", 3)
    poison = model.compile(poison_body).candidates
    alone = {n: model.decide(BODIES[n]) for n in (1, 2)}
    held = HeldForward(model, poison=poison)
    monkeypatch.setattr(model.backbone, "prepare", held)
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server:
        server.start()
        first, rest = queue_behind_a_held_forward(server, held, BODIES[0], [BODIES[1], poison_body, BODIES[2]])
    assert first[0] == 200
    (ok_before, broken, ok_after) = rest
    assert broken == (500, {"error": "model inference failed", "error_type": "RuntimeError"})
    assert ok_before[0] == ok_after[0] == 200
    assert own_part(ok_before[1]) == own_part(alone[1]) and own_part(ok_after[1]) == own_part(alone[2])
    assert "batch" not in ok_before[1]["metadata"]  # answered alone after the batch failed
    assert len(held.calls) == 1 + 1 + 3  # the held one, the failed batch of three, each of the three alone


def test_a_lone_request_is_answered_by_its_own_forward(model, monkeypatch):
    held = HeldForward(model)
    held.release.set()
    monkeypatch.setattr(model.backbone, "prepare", held)
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server:
        server.start()
        answers = [post(server, payload) for payload in BODIES[:3]]
    assert [status for status, _ in answers] == [200] * 3
    assert all("batch" not in answer["metadata"] for _, answer in answers)
    assert len(held.calls) == 3


def test_a_forward_takes_at_most_max_batch_requests(model, monkeypatch):
    queued = [body(f"Log line {n}.", 2) for n in range(MAX_BATCH_REQUESTS + 3)]
    held = HeldForward(model)
    monkeypatch.setattr(model.backbone, "prepare", held)
    with DecisionServer(model, port=0, queue_size=64, access_log=io.StringIO()) as server:
        server.start()
        _, rest = queue_behind_a_held_forward(server, held, BODIES[0], queued)
    assert [status for status, _ in rest] == [200] * len(queued)
    sizes = sorted(answer["metadata"].get("batch", {"requests": 1})["requests"] for _, answer in rest)
    assert max(sizes) == MAX_BATCH_REQUESTS and len(held.calls) >= 3


def test_batching_off_gives_each_request_its_own_forward_and_the_same_answers(model, monkeypatch):
    """The same six requests, five of them queued behind a held forward: with batching on the five share one forward;
    with it off each has its own (the worker never asks `batch_requests`), and every answer is bit-identical to the
    batching server's and to the request's answer alone."""
    alone = [model.decide(payload) for payload in BODIES]
    answers, forwards, metrics = {}, {}, {}
    for batching in ("on", "off"):
        with monkeypatch.context() as patch:
            held = HeldForward(model)
            patch.setattr(model.backbone, "prepare", held)
            with DecisionServer(model, port=0, access_log=io.StringIO(), batching=batching == "on") as server:
                if batching == "off":
                    patch.setattr(server.decisions.calls, "batch_size", never_called)
                server.start()
                first, rest = queue_behind_a_held_forward(server, held, BODIES[0], BODIES[1:])
                metrics[batching] = server.decisions.metrics.text().decode()
        answers[batching], forwards[batching] = [first, *rest], held.calls
    assert all(status == 200 for mode in answers.values() for status, _ in mode)
    assert [answer["metadata"].get("batch", {}).get("requests") for _, answer in answers["on"]] == [None] + [5] * 5
    assert all("batch" not in answer["metadata"] for _, answer in answers["off"])
    candidates = [len(model.compile(payload).candidates) for payload in BODIES]  # the queued ones in any order
    assert forwards["off"][0] == candidates[0] and sorted(forwards["off"][1:]) == sorted(candidates[1:])
    assert "jev_batch_requests_sum 6.0" in metrics["off"] and "jev_batch_requests_count 6.0" in metrics["off"]
    for (_, on), (_, off), expected in zip(answers["on"], answers["off"], alone):
        assert own_part(off) == own_part(on) == own_part(expected)
        assert without_inference_seconds(off) == without_inference_seconds(expected)  # its forward is its own


def never_called(queued):
    raise AssertionError("batch_requests was asked with batching off")


def without_inference_seconds(response: dict) -> dict:
    out = copy.deepcopy(response)
    del out["metadata"]["inference_seconds"]
    return out


def test_the_batching_option_reaches_the_app():
    assert app_options(parse_arguments([]))["batching"] is True
    assert app_options(parse_arguments(["--batching", "off"]))["batching"] is False
    assert app_options(parse_arguments(["--batching", "on"]))["batching"] is True
    with pytest.raises(SystemExit):
        parse_arguments(["--batching", "maybe"])
