"""The server's Prometheus metrics and its CUDA memory figures.

`/metrics` (a registry per app, `prometheus_client`): `jev_queue_depth`, `jev_requests_total` by `status`,
`jev_request_seconds` (request to answer), per forward `jev_batch_requests` (requests it answered),
`jev_batch_candidates` and `jev_batch_input_tokens` (candidate sequences and input tokens, as `usage` counts them; a
prefix tree packs fewer rows), and with a graph cache `jev_graphs_captured`, `jev_graph_hits_total` and
`jev_graph_misses_total` by `reason`.
 With the model on CUDA also the caching allocator's `jev_cuda_allocated_bytes`,
`jev_cuda_max_allocated_bytes` and `jev_cuda_reserved_bytes`, and with a costed backbone the admission bound
`jev_activation_bound_bytes` (engine/serve/admission.py); `/health`'s `memory` (`cuda_memory`) has the same figures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.serve.admission import AdmissionBound

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = tuple(4**k for k in range(11))  # 1 .. 1,048,576


class ServerMetrics:
    """The app's Prometheus metrics, in a registry of its own (several servers may share a process)."""

    def __init__(self, queue_depth: Callable[[], int], graphs: Any | None):
        self.registry = CollectorRegistry()
        depth = Gauge("jev_queue_depth", "requests waiting for the model worker", registry=self.registry)
        depth.set_function(queue_depth)
        self.requests = Counter("jev_requests", "requests answered, by status", ["status"], registry=self.registry)
        self.latency = Histogram(
            "jev_request_seconds", "request to answer, seconds", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.batch_requests = Histogram(
            "jev_batch_requests", "requests answered by one forward", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.batch_candidates = Histogram(
            "jev_batch_candidates", "candidate sequences of one forward", buckets=ROW_BUCKETS, registry=self.registry
        )
        self.batch_input_tokens = Histogram(
            "jev_batch_input_tokens", "input tokens of one forward (usage)", buckets=ROW_BUCKETS, registry=self.registry
        )
        if graphs is not None:
            self.registry.register(_GraphCollector(graphs))

    def memory(self, cuda_device: torch.device | None, admission: AdmissionBound | None) -> None:
        """Gauges of the admission bound (`jev_activation_bound_bytes`) and, on CUDA, of the caching allocator
        (`jev_cuda_allocated_bytes`, `jev_cuda_max_allocated_bytes`, `jev_cuda_reserved_bytes`), read at each scrape."""
        if admission is not None:
            bound = Gauge("jev_activation_bound_bytes", "admission bound of one forward", registry=self.registry)
            bound.set(admission.bound_bytes)
        if cuda_device is None:
            return
        for name, key in (
            ("allocated", "allocated_bytes.all.current"),
            ("max_allocated", "allocated_bytes.all.peak"),
            ("reserved", "reserved_bytes.all.current"),
        ):
            gauge = Gauge(f"jev_cuda_{name}_bytes", f"CUDA caching allocator: {key}", registry=self.registry)
            gauge.set_function(functools.partial(_cuda_stat, cuda_device, key))

    def answered(self, status: int, elapsed_s: float | None) -> None:
        self.requests.labels(str(status)).inc()
        if elapsed_s is not None:
            self.latency.observe(elapsed_s)

    def batch(self, answers: list[dict]) -> None:
        """One forward's answers (a model other than `DecisionModel` may answer without `usage` and `metadata`)."""
        self.batch_requests.observe(len(answers))
        candidates = [
            a["metadata"]["candidate_sequences"] for a in answers if "candidate_sequences" in a.get("metadata", {})
        ]
        tokens = [a["usage"]["input_tokens"] for a in answers if "input_tokens" in a.get("usage", {})]
        if candidates:
            self.batch_candidates.observe(sum(candidates))
        if tokens:
            self.batch_input_tokens.observe(sum(tokens))

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _cuda_stat(device: torch.device, key: str) -> float:
    return float(torch.cuda.memory_stats(device).get(key, 0))


class _GraphCollector:
    """The graph cache's figures (`engine.graphs.GraphCache.describe`), read at each scrape."""

    def __init__(self, graphs: Any):
        self._graphs = graphs

    def collect(self) -> Iterable[Any]:
        described = self._graphs.describe()
        yield GaugeMetricFamily("jev_graphs_captured", "CUDA graphs held by the cache", value=described["graphs"])
        yield CounterMetricFamily("jev_graph_hits", "forwards replayed from a graph", value=described["hits"])
        misses = CounterMetricFamily("jev_graph_misses", "forwards run eagerly, by reason", labels=["reason"])
        for reason, count in described["misses"].items():
            misses.add_metric([reason], count)
        yield misses


def cuda_memory(device: torch.device, admission: AdmissionBound | None) -> dict[str, int]:
    """`/health`'s `memory` on CUDA: the caching allocator's allocated, peak allocated and reserved bytes
    (`torch.cuda.memory_stats`), the device's free bytes, and the admission bound."""
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
        "max_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "max_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
        "free_bytes": torch.cuda.mem_get_info(device)[0],
        "activation_bound_bytes": admission.bound_bytes if admission is not None else 0,
    }
