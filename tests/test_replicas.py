"""Ray Serve replicas (engine/replicas.py) on the CPU: one replica of the tiny twin behind Ray Serve's proxy answers
exactly what the server alone answers. Needs Ray Serve: `nox -s replicas` installs it and runs this file; elsewhere
(the CPU suite, which has no Ray) the module is skipped with that reason."""

from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: `nox -s replicas` runs these tests")

from bench.jevbench import post_json, request_body  # noqa: E402
from engine import replicas  # noqa: E402
from reference.data import jevbench_tasks  # noqa: E402
from reference.service import default_model  # noqa: E402

pytestmark = pytest.mark.replicas
TIMING = ("inference_seconds",)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def proxy():
    url = replicas.start(
        ["--backend", "hf_torch", "--shapes", "tiny", "--seed", "0"],
        replicas=1,
        gpus_per_replica=0,
        proxy_port=free_port(),
        num_cpus=2,
    )
    yield url
    replicas.stop()


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def without_timing(response: dict) -> dict:
    return {**response, "metadata": {k: v for k, v in response["metadata"].items() if k not in TIMING}}


def test_a_replica_answers_what_the_server_alone_answers(proxy):
    for task in jevbench_tasks()[:3]:
        body = request_body(task, "open-jev")
        status, answer = post_json(proxy, body)
        assert status == 200, answer
        assert without_timing(answer) == without_timing(default_model().decide(body))


def test_health_models_and_refusals_pass_the_proxy_unchanged(proxy):
    status, health = get(proxy, "/health")
    assert status == 200 and health["status"] == "ready" and health["method"] == "synthetic_weights"
    status, models = get(proxy, "/v1/models")
    assert status == 200 and models["models"][0]["id"] == default_model().weights.model_id
    status, refusal = post_json(proxy, {"model": "open-jev", "state": "s"})
    assert status == 422 and refusal["error"]
    status, refusal = get(proxy, "/health", {"Host": "evil.example"})
    assert status == 403 and "Host is not allowed" in refusal["error"]
