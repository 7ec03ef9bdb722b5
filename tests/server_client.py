"""Client helpers of the server tests: one request per connection over http.client or raw sockets."""

from __future__ import annotations

import copy
import http.client
import json
import socket
import time
import types

from engine.server import DecisionServer

TIMEOUT_S = 60.0
INFERENCE_FAILED = {"error": "model inference failed", "error_type": "RuntimeError"}
INVALID_SCHEMA = {"state": "s"}  # valid JSON, fails validation before any forward


def address(server: DecisionServer) -> tuple[str, int]:
    host, port = server.server_address
    return host, port


def call(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One request on its own connection: (status, lower-cased headers, parsed JSON body)."""
    connection = http.client.HTTPConnection(*address(server), timeout=TIMEOUT_S)
    try:
        connection.request(method, path, body, headers or {})
        response = connection.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data)
    finally:
        connection.close()


def post(server, body: bytes | dict, path: str = "/v1/systemone", **headers):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return call(server, "POST", path, body, {"Content-Type": "application/json", **headers})


def exchange(server, raw: bytes):
    """Send raw bytes, read one response: (status, lower-cased headers, parsed JSON body)."""
    with socket.create_connection(address(server), timeout=TIMEOUT_S) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data)


def raw_exchange(server, raw: bytes) -> bytes:
    """Send raw bytes, read until the server closes: the bytes it answered."""
    with socket.create_connection(address(server), timeout=TIMEOUT_S) as sock:
        sock.sendall(raw)
        out = b""
        while data := sock.recv(65536):
            out += data
        return out


def short_request(i: int) -> dict:
    """A request cheap for the tiny twin: one noul question, 1 candidate of about 40 tokens."""
    return {
        "state": f"Order {i} arrived {i + 2} days late.",
        "questions": {"late": {"type": "noul", "instructions": "Late?"}},
    }


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def without_timing(response: dict) -> dict:
    out = copy.deepcopy(response)
    del out["metadata"]["inference_seconds"]
    return out


class Panic(BaseException):
    """What a panicking native extension raises (pyo3's PanicException derives from BaseException)."""


class FailingModel:
    """Echoes a request, or raises the BaseException class named by its `raise` key."""

    weights = types.SimpleNamespace(model_id="failing", method="test")
    raises = {"Panic": Panic, "KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}

    def decide(self, request):
        if "raise" in request:
            raise self.raises[request["raise"]]("from the model")
        return {"echo": request}
