"""Server overhead: everything the decision server adds around the forward, measured in-process.

The model behind the server is a `DecisionModel` whose backbone returns precomputed hidden states
(`PrecomputedBackbone`), so a request's time is HTTP (a new loopback connection per request, as JevBench connects),
JSON parsing, validation, prompt building, tokenization, the fp32 head and softmax, response encoding and the
worker hand-off, and no forward. Target: at most 2 ms at P50 over the JevBench public tasks.

`measure_overhead` reports, per request body, the client's wall clock over HTTP and, beside it, `decide` called
directly (no HTTP, no queue) so the HTTP share can be read off. `python -m ablations.jevbench --overhead` runs it over
the JevBench tasks and writes `results/server/overhead.json`.

The precomputed hidden states are seeded random bf16 and the head is synthetic: the answers are meaningless, only the
time is measured.
"""

from __future__ import annotations

import http.client
import io
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.server import DecisionServer
from reference.service import DecisionModel
from reference.shapes import ModelShapes
from reference.weights import SYNTHETIC_MAX_LENGTH, SYNTHETIC_MODEL_IDS, SYNTHETIC_TEMPERATURE, DecisionWeights

TARGET_P50_MS = 2.0


class PrecomputedBackbone:
    """A `Backbone` without a forward: `forward` returns the first C rows of a fixed [max_candidates, hidden] bf16
    tensor (seeded N(0, 1)), so timing a request through it times everything but the model."""

    name = "precomputed"

    def __init__(self, shapes: ModelShapes, *, max_candidates: int = 256, seed: int = 0):
        self.shapes = shapes
        self.device = torch.device("cpu")
        generator = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(max_candidates, shapes.hidden_size, generator=generator).to(torch.bfloat16)

    def prepare(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> int:
        if len(candidates) > self.hidden.shape[0]:
            raise ValueError(f"{len(candidates)} candidates, more than the {self.hidden.shape[0]} precomputed rows")
        return len(candidates)

    def forward(self, prepared: int) -> torch.Tensor:
        return self.hidden[:prepared]  # [C, hidden] bf16


def head_only_weights(shapes: ModelShapes, *, seed: int = 0) -> DecisionWeights:
    """Synthetic decision weights with a head and no backbone tensors (the precomputed backbone needs none)."""
    generator = torch.Generator().manual_seed(seed)
    return DecisionWeights(
        shapes=shapes,
        backbone={},
        head_weight=torch.randn(shapes.hidden_size, generator=generator) / shapes.hidden_size**0.5,  # fp32 [hidden]
        head_bias=torch.zeros(()),
        temperature=SYNTHETIC_TEMPERATURE,
        model_id=SYNTHETIC_MODEL_IDS[shapes.name],
        revision=None,
        max_length=SYNTHETIC_MAX_LENGTH,
        checkpoint_sha256=None,
        method="synthetic_weights",
        synthetic=True,
    )


def overhead_model(shapes: ModelShapes, *, seed: int = 0) -> DecisionModel:
    weights = head_only_weights(shapes, seed=seed)
    return DecisionModel(PrecomputedBackbone(shapes, seed=seed), weights)


def latency_stats(values_ms: Sequence[float]) -> dict | None:
    """n, mean, P50, P95 (numpy's linear interpolation) and max of times in ms; None for no samples."""
    if len(values_ms) == 0:
        return None
    values = np.asarray(values_ms, dtype=np.float64)
    return {
        "n": int(values.size),
        "mean_ms": float(values.mean()),
        "p50_ms": float(np.percentile(values, 50)),
        "p95_ms": float(np.percentile(values, 95)),
        "max_ms": float(values.max()),
    }


def _post(host: str, port: int, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def measure_overhead(bodies: Sequence[Any], *, shapes: ModelShapes, rounds: int = 5, seed: int = 0) -> dict[str, Any]:
    """Time each request body `rounds` times over HTTP and through `decide`, after one warm-up each.

    Returns P50/P95/mean/max in ms for `http` (client wall clock: connect, send, server, read, JSON decode; the client
    shares the server's interpreter and GIL, which can only add to the figure), `decide`
    (parse + `DecisionModel.decide` + encode, in-process) and `server_inference` (the response's inference_seconds:
    tokenization + stub forward + readout), and whether the HTTP P50 meets the 2 ms target.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    model = overhead_model(shapes, seed=seed)
    encoded = [json.dumps(body).encode("utf-8") for body in bodies]
    http_ms: list[float] = []
    decide_ms: list[float] = []
    inference_ms: list[float] = []
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server:
        server.start()
        host, port = server.server_address
        for body in encoded:
            status, data = _post(host, port, body)  # warm-up
            if status != 200:
                raise RuntimeError(f"overhead request answered {status}: {data[:200]!r}")
        for _ in range(rounds):
            for body in encoded:
                start = time.perf_counter()
                status, data = _post(host, port, body)
                response = json.loads(data)
                http_ms.append(1e3 * (time.perf_counter() - start))
                if status != 200:
                    raise RuntimeError(f"overhead request answered {status}: {response}")
                inference_ms.append(1e3 * response["metadata"]["inference_seconds"])
                start = time.perf_counter()
                json.dumps(model.decide_json(body), ensure_ascii=False).encode("utf-8")
                decide_ms.append(1e3 * (time.perf_counter() - start))
    http_stats = latency_stats(http_ms)
    return {
        "what": "server overhead without a forward: precomputed hidden states behind the full request path",
        "shapes": shapes.name,
        "requests": len(encoded),
        "rounds": rounds,
        "http": http_stats,
        "decide": latency_stats(decide_ms),
        "server_inference": latency_stats(inference_ms),
        "target_p50_ms": TARGET_P50_MS,
        "meets_target": http_stats["p50_ms"] <= TARGET_P50_MS,
    }
