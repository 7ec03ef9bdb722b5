"""The drop-in decision server: the Open-Jev HTTP contract in front of any backbone, as one ASGI app.

    python -m engine.server [--backend STAGE] [--shapes qwen3.8-27b|tiny] [--checkpoint PKG --base DIR]
                            [--host 127.0.0.1] [--port 8791] [--max-length N] [--queue-size N] [--allow-cross-origin]
                            [--candidate-budget N] [--token-budget N] [--allow-host NAME ...] [--deadline S]
                            [--batching on|off]

The wire contract is `shared/research/open-jev-server-contract.md` §1-§4. The stack is Starlette on uvicorn
(httptools parses HTTP/1.1, uvloop runs the event loop when installed): `build_app(model, ...)` returns the Starlette
app, the one object a replica manager (Ray Serve's `@serve.ingress`) wraps; `DecisionServer` binds a socket for it and
runs uvicorn, on a background thread after `start()` or on the calling thread in `serve_forever()`.

Routes: `POST /v1/systemone` (aliases `/v1/inference`, `/api/jev`) answers a decision request; `GET /health` and
`GET /v1/models` describe the loaded model; `GET /metrics` is Prometheus text (below); `GET /examples.json` lists the
JSON files under the repository's `examples/` that validate as requests (the repository has no such folder: `[]`);
`GET /` redirects (302) to `/examples/workbench/index.html`, the contract's workbench (not served here: 404). A HEAD
is answered as its GET without a body. The model is built before the port binds, so a server that answers `/health`
is ready; once bound it prints one JSON line with `url`, `model` and `method`. With `--backend graphs` (the default on
CUDA) building includes compiling the eager paths' kernels and capturing the whole bucket grid (a progress bar on
stderr); `/health` then also reports the graph cache (graphs, capture seconds, reserved CUDA bytes, hits, misses) and
every response's `metadata.graph` says which bucket served it and whether a graph did.

Every request first has its `Host` checked, against DNS rebinding (a page of a foreign site whose name resolves to
127.0.0.1 would otherwise drive the server from a browser, with an `Origin` matching its own `Host`): 400 no `Host`,
several, or one that is not `name[:port]` (HTTP/1.1 requires exactly one; HTTP/1.0 requests are held to it too) -> 403 a
name this server does not answer: a loopback-bound server answers only `localhost`, `127.0.0.1` and `[::1]` (any port,
any case) and the names given with `--allow-host`, as Jupyter does; bound to any other address, every name passes. Then
501 a method other than GET, HEAD and POST, and 404 an unknown path (or a known one with the other method). Then a POST
is checked in the contract's order, and the first failing check answers: 400 more than one `Origin` field -> 403 an
`Origin` that is not `http://` plus this request's `Host` (unless cross origins are allowed; an `https://` origin on the
same host and port is another origin, and so is one that does not parse) -> 415 media type not `application/json` -> 413
body empty or over 4 MiB (Content-Length or chunked) -> 422 not strict JSON (duplicate keys, NaN/Infinity) or a schema
violation, an unknown model, a request over the candidate or the token budget (`--candidate-budget`, `--token-budget`:
candidates counted from the question definitions before any is validated, tokens bounded from the validated request
before any prompt is built, see `reference.service`), an over-length candidate, a request whose largest forward needs
more activation memory than the bound (`--activation-memory`, default derived from the device's memory:
engine/serve/admission.py) -> 503 the model queue is full (with `Retry-After: 1`) -> 504 the request's deadline passed
(`--deadline`, default 60 s from the hand-off to the model worker: queue wait and inference) -> 500 inference failed
(`error_type` names the exception class; never a fallback answer): any exception of compiling or of the forward, every
`BaseException` included (StopIteration, GeneratorExit, CancelledError: the worker hands a failure over as its future's
value, never as its exception).

Framing the contract does not name, each a JSON answer on a closed connection: 400 a Content-Length that is not one
decimal number (or two that differ), a bad chunk, a Transfer-Encoding other than one `chunked` (two fields included), a
request target that does not parse; 413 a chunk whose declared size takes the body over 4 MiB, as soon as its size line
is read; 431 a head over 64 KiB or over 100 fields; 501 a method the parser does not know; 505 an HTTP version other
than 1.0 and 1.1; 408 a head not complete 30 s after its first byte, or a declared body not complete 30 s after the
head. These come from `DecisionProtocol`, uvicorn's httptools protocol with these answers (a replica manager that runs
its own uvicorn answers the parser's refusals with uvicorn's plain-text 400). A request with both Content-Length and
chunked is read as chunked and answered on a closed connection (RFC 9112 §6.3). A connection idle for 30 s (before its
first request or between requests) is closed. An answer given before the body was read (403, 415, 413, 408 ...) closes
the connection after reading and dropping what the client still sends (at most 8 MiB, 2 s), so the client reads the
answer instead of a connection reset. Pipelined requests before a refused one are answered first, in order, then the
refusal (reading stops meanwhile). The server keeps serving after every one of these.

Concurrency: the HTTP side is one event loop (no thread per connection: idle connections cost a socket each). It frames
the body, then parses the JSON and compiles the request (`DecisionModel.compile`: validation, admission budgets,
prompts, tokens and the length check): on the loop itself for bodies up to 64 KiB (every JevBench and Open-Jev request;
well under a millisecond, and a hop to a thread costs about 0.1 ms of the 2 ms overhead budget), both on the loop's
thread pool above that, so that a large request does not hold up other connections (parsing a 970 KB body alone
takes 15-30 ms on a loaded CPU core; refusing its 65,535 candidates then takes 0.1 ms, as they are counted before any
question is validated). The forwards run on one `DecisionWorker` thread fed by a bounded FIFO of compiled requests,
which the handler awaits without blocking the loop: the GPU thread does nothing but plan, run and read out forwards,
back to back (on the CPU with `CPU_WORKER_THREADS` torch intra-op threads: on a thread other than the main one, more
made the tiny twin's forwards 3-5x slower, see that constant). (Off the loop is not off the GIL: while a large request
parses and compiles, the worker's forwards and the loop share the interpreter with it; results/server/fuzz.json,
"amplification", has what that costs the clients.)

Batching: each forward takes the oldest queued request and, of those queued behind it (at most 16 in all), as many as
`DecisionModel.batch_requests` admits (in queue order, within the backbone's row budget: the grid's largest bucket on
`graphs`; only on a batch-invariant backbone). A lone request never waits for company: there is no gathering window;
requests queue while a forward runs, and the next forward takes them together. Every answer is bit-identical to the
same request answered alone (`reference.service`, "Batching"; tests/test_batching.py, and tests/test_server.py through
the server). Should the batched forward fail, each request is answered alone, so only a bad request gets its 500.
`--batching off` turns batching across requests off: the worker takes one request at a time from the queue and answers
it with its own forward (`answer_many` of that request alone, the path `decide` takes), without looking at the queue
behind it or asking `batch_requests`; validation, the queue, deadlines, 503s and metrics are unchanged. It is the
server without the batcher that issue 15's one-client target compares with (`ablations/concurrency.py
--compare-batching`).

Each request carries its own future, so an answer can only go back to the request it came from. The queue bound
(`--queue-size`) counts every request handed to the worker and not yet taken into a forward, the ones the worker took
off the queue for its next forward included; one more is answered 503 at once instead of waiting. A request whose
deadline passes (queue wait and forward; compiling comes before it) is answered 504; if it was still queued it is
dropped from the queue; if its forward had started, the forward is told to stop once no request of it has a waiting
client (`DecisionWorker`): a forward on `hf_torch` / `hf_fla` stops before its next decoder layer, an engine forward at
its end (the admission bound keeps it short). A client that closes its connection while its request waits is the
same, answered 499 to nobody.

The worker survives any failure of one request: whatever answering it raises, a `BaseException` that is not an
`Exception` included (a panicking native extension raises one), is that request's 500 with `error_type`, and the next
request is answered as usual. KeyboardInterrupt and SystemExit are no exception to this, on purpose: Python delivers
signals to the main thread only (where Ctrl-C still ends `serve_forever` and SIGTERM stops it gracefully), so in the
worker they can only come from model code, and a `sys.exit()` there would end just that thread, the silent death this
rule prevents. Should the worker's own loop ever fail, outside any request, the worker stops for good: it writes one
line naming the error (to the access log, or stderr when that is off), answers every queued and later request 503, and
`/health` answers 503 with `status` "stopped" instead of "ready", so a supervisor's health check sees the truth.

Deviation from the original server, on purpose: it maps any ValueError/KeyError/TypeError/UnicodeError to 422 by class.
Here a request is answered 422 only through `RequestError`, which the request pipeline raises with the contract's
messages for every fault of the body (not UTF-8, not strict JSON, schema, model, length); any other exception inside
the model is a 500, so a bug in a forward cannot pass for a client error.

`/metrics` (a registry per app, `prometheus_client`): `jev_queue_depth`, `jev_requests_total` by `status`,
`jev_request_seconds` (request to answer), per forward `jev_batch_requests` (requests it answered),
`jev_batch_candidates` and `jev_batch_input_tokens` (candidate sequences and input tokens, as `usage` counts them; a
prefix tree packs fewer rows), and with a graph cache `jev_graphs_captured`, `jev_graph_hits_total` and
`jev_graph_misses_total` by `reason`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import httptools
import torch
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from tqdm import tqdm
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.fla_configs import pin_fla_configs
from engine.serve.admission import AdmissionBound
from engine.stages import STAGES, BuildContext, build_backbone, get_stage, prepare_process
from reference.request import MODEL_ALIASES, RequestError, parse_json_strict, validate_request
from reference.service import DEFAULT_CANDIDATE_BUDGET, DEFAULT_TOKEN_BUDGET, DecisionModel, ForwardAbandoned
from reference.shapes import QWEN38_27B, SHAPES, TINY, get_shapes
from reference.weights import load_package, synthetic_weights

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8791
MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_SIZE = 64
DEFAULT_DEADLINE_S = 60.0  # a request's queue wait and inference
IDLE_TIMEOUT_S = 30.0  # a connection without a request in progress (the contract's socket timeout)
HEAD_TIMEOUT_S = 30.0  # from a request's first byte to the end of its head
BODY_TIMEOUT_S = 30.0  # from the end of the head to the end of a declared body
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100
CHUNK_LINE_BYTES = 4096  # bytes kept to read a chunk's size line (a longer line, extensions included, is not read)
LISTEN_BACKLOG = 1024  # many clients may connect at once
POST_PATHS = ("/v1/systemone", "/v1/inference", "/api/jev")
RELEASE_DATE = "2026-09-19"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
WORKBENCH = "/examples/workbench/index.html"

# After an answer sent before the body was read, the rest of the body is read and dropped (at most this many bytes,
# for at most this long) before the connection closes, so the client reads the answer instead of a connection reset.
LINGER_BYTES = 2 * MAX_BODY_BYTES
LINGER_S = 2.0
DECIMAL = re.compile(r"[0-9]{1,19}")  # a Content-Length value (no sign, no spaces, no other digits)

INFERENCE_FAILED = "model inference failed"
# A forward takes at most this many queued requests: deciding how many costs the worker thread a pass over the queue
# as far as the batch reaches (`DecisionModel.batch_requests`, linear in the queue; its time at 1, 4, 8 and 16 queued
# JevBench requests: `timing` in results/batching/batch-packing.json, from ablations/batch_packing.py).
MAX_BATCH_REQUESTS = 16
INLINE_COMPILE_BYTES = 64 * 1024  # bodies up to this size are compiled on the event loop (module docstring)
WORKER_STOPPED = "the model worker stopped; see /health"
# torch intra-op threads of the worker thread when the model runs on the CPU (`DecisionWorker`). Once the main thread
# has run an OpenMP region (loading the model does), a second thread's parallel regions cost about 0.1 ms more each
# (an elementwise op of 64k floats: 10 us on the main thread, 120 us on another). Tiny twin, 2-core development
# machine, per request: a one-question request through the server 278-437 ms with two threads, 66-78 ms with one
# (62-77 ms in-process on the main thread); JevBench tasks 0.67-1.15 s on a second thread with two, 0.29-0.41 s with
# one (0.20-0.27 s on the main thread with two, 0.31 s with one). Neither OMP_WAIT_POLICY=ACTIVE nor GOMP_SPINCOUNT
# brought a second thread's two to the main thread's time (0.54-0.73 s). The `tree` stage under the Triton
# interpreter barely depends on it (9.1-9.7 s per JevBench task with one, 9.3-10.0 s with two).
CPU_WORKER_THREADS = 1


class ServerBusy(Exception):
    """The model queue is full: answered 503 at once."""


class ServerClosing(Exception):
    """The server is shutting down: queued requests are answered 503."""


class WorkerStopped(Exception):
    """The model worker stopped after a failure of its own loop: every request is answered 503."""


class HTTPError(Exception):
    """An HTTP-level rejection (framing, size, time) raised while reading a request."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Job:
    request: Any  # what `compile` made of the parsed request (a `reference.service.CompiledRequest`)
    future: Future  # its result: the answer, or the exception answering it raised (never set as the exception)
    abandoned: threading.Event  # set by the server: no client waits for the answer any more
    waiting: bool = True  # counted by `DecisionWorker.depth` (queued, not yet taken into a forward or answered)


def _answer_each(
    decide: Callable[[Any], dict], requests: Sequence[Any], *, abandoned: Callable[[], bool] = lambda: False
) -> list[Any]:
    """`decide` per request, each request's exception (any BaseException) in its own slot; once `abandoned()` says no
    client waits any more, the rest are `ForwardAbandoned` without a call."""
    results: list[Any] = []
    for request in requests:
        if abandoned():
            results.append(ForwardAbandoned())
            continue
        try:
            results.append(decide(request))
        except BaseException as error:  # noqa: BLE001 - one request's failure is its own (module docstring)
            results.append(error)
    return results


class ModelCalls:
    """What the server calls on its model. A `reference.service.DecisionModel`: `compile(obj)` (validation, prompts,
    tokens: CPU only, off the worker thread: see the module docstring), `batch_requests(queued)` (how many queued
    requests one forward takes) and `answer_many(compiled)` (one forward for them, on the worker thread). Any other
    model needs only `decide(obj) -> dict`: it is then called once per request, on the worker thread, with the
    parsed request. `on_cpu`: whether the model's backbone runs on the CPU (False for a model without a backbone)."""

    def __init__(self, model: Any):
        device = getattr(getattr(model, "backbone", None), "device", None)
        self.on_cpu = isinstance(device, torch.device) and device.type == "cpu"
        if hasattr(model, "answer_many"):
            self.compile: Callable[[Any], Any] | None = model.compile
            self.batch_size: Callable[[Sequence[Any]], int] = model.batch_requests
            self.answer_many: Callable[..., list[Any]] = model.answer_many
        else:
            self.compile = None
            self.batch_size = lambda queued: 1
            self.answer_many = functools.partial(_answer_each, model.decide)


class DecisionWorker:
    """The one thread that runs forwards, back to back, each over as many queued requests as the model takes.

    `submit(request, abandoned)` puts a compiled request on the FIFO and returns its `Future`; `abandoned` is the
    caller's flag that no client waits for the answer any more. The bound: at most `queue_size` jobs wait at once,
    counting every job submitted and not yet taken into a forward or answered (the queue and the jobs taken from it for
    the next forward alike: `depth`); one more raises `ServerBusy` at once. The thread takes the oldest job, and with it
    every job queued meanwhile (no waiting for company: a lone request goes at once; under load, requests queue while a
    forward runs and the next forward takes them together), asks `calls.batch_size` how many of them, from the front,
    one forward takes, and answers those with `calls.answer_many`; the rest stay first in line for the next forward.
    Each job's future gets its result: the answer or the exception answering it raised, any `BaseException` included, as
    the future's result value, never set as its exception (asyncio refuses a `StopIteration` as a future's exception and
    treats a `CancelledError` as a cancellation; ServerClosing and WorkerStopped alone are set as exceptions). Should
    `answer_many` itself raise (a `DecisionModel` raises KeyboardInterrupt and SystemExit instead of keeping them in a
    slot), every request of that forward is answered alone, so only the one that raises gets the exception. A job whose
    future was cancelled while queued (its deadline passed) is skipped; a forward is told to stop (`answer_many(...,
    abandoned=...)`) once every job of it is `abandoned` (the server sets the flag when a request's deadline passes or
    its client closes the connection). `on_batch(answers)` is told the answers of each forward (the metrics).

    `batching=False`: each forward answers the oldest job alone (`calls.answer_many` of one request); the thread neither
    takes the jobs queued behind it nor calls `calls.batch_size`.

    `intraop_threads`: when set, the thread first sets its torch intra-op thread count (`torch.set_num_threads`, which
    also sets the count that threads started later begin with; a thread already running keeps its own). The server
    sets `CPU_WORKER_THREADS` for a model on the CPU and leaves a CUDA model's worker alone.

    If the loop itself fails, `failure` holds the error, `on_failure(error)` is called once, and every queued and later
    job gets `WorkerStopped`.
    """

    def __init__(
        self,
        calls: ModelCalls,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        *,
        on_failure: Callable[[BaseException], None],
        on_batch: Callable[[list[dict]], None] = lambda answers: None,
        batching: bool = True,
        intraop_threads: int | None = None,
    ):
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if intraop_threads is not None and intraop_threads < 1:
            raise ValueError(f"intraop_threads must be >= 1, got {intraop_threads}")
        self._calls = calls
        self.queue_size = queue_size
        self.batching = batching
        self.intraop_threads = intraop_threads
        self._next: list[_Job] = []  # taken from the queue, not yet answered (only the worker thread touches it)
        self._on_failure = on_failure
        self._on_batch = on_batch
        self.failure: BaseException | None = None
        self._queue: queue.Queue[_Job] = queue.Queue()  # bounded by `_waiting`, counted under `_lock`
        self._waiting = 0
        self._lock = threading.Lock()  # orders submit against close and the count of waiting jobs
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def depth(self) -> int:
        """Jobs waiting: submitted, not yet taken into a forward and not yet answered (the queue bound's count)."""
        return self._waiting

    def submit(self, request: Any, abandoned: threading.Event | None = None) -> Future:
        job = _Job(request, Future(), abandoned if abandoned is not None else threading.Event())
        with self._lock:
            if self.failure is not None:
                raise WorkerStopped()
            if self._closed.is_set():
                raise ServerClosing()
            if self._waiting >= self.queue_size:
                raise ServerBusy()
            self._waiting += 1
            self._queue.put_nowait(job)
        job.future.add_done_callback(lambda _: self._stop_waiting(job))  # cancelled at its deadline, or drained
        return job.future

    def _stop_waiting(self, job: _Job) -> None:
        with self._lock:
            if job.waiting:
                job.waiting = False
                self._waiting -= 1

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop taking jobs, let the running one finish, answer every queued one with `ServerClosing`."""
        with self._lock:
            self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._drain(ServerClosing)

    def _drain(self, error: type[Exception]) -> None:
        """Answer every queued job with `error`."""
        jobs, self._next = self._next, []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error())

    def _start(self, jobs: list[_Job]) -> list[_Job]:
        """The jobs whose clients still wait (not cancelled at their deadline), now running and no longer waiting."""
        running = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        for job in running:
            self._stop_waiting(job)
        return running

    def _take(self) -> list[_Job]:
        """The jobs of the next forward: the oldest job and those queued behind it, as many as `batch_size` takes."""
        if not self._next:
            try:
                self._next.append(self._queue.get(timeout=0.1))
            except queue.Empty:
                return []
        while True:
            try:
                self._next.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._next = [job for job in self._next if not job.future.cancelled()]  # deadlines passed while queued
        if not self._next:
            return []
        front = self._next[:MAX_BATCH_REQUESTS]
        count = self._calls.batch_size([job.request for job in front])
        taken, self._next = self._next[:count], self._next[count:]
        return self._start(taken)

    def _take_one(self) -> list[_Job]:
        """The job of the next forward without batching: the oldest job alone (none if its deadline passed)."""
        try:
            job = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        return self._start([job])

    def _answer(self, jobs: list[_Job]) -> list[Any]:
        def abandoned() -> bool:
            return all(job.abandoned.is_set() for job in jobs)

        try:
            results = self._calls.answer_many([job.request for job in jobs], abandoned=abandoned)
        except BaseException as error:  # noqa: BLE001 - one of them raised: each alone, so only that one fails
            if len(jobs) == 1:
                return [error]
            return [result for job in jobs for result in self._answer([job])]
        if len(results) != len(jobs):  # a model bug: every request of the forward is a 500
            error = RuntimeError(f"answer_many returned {len(results)} results for {len(jobs)} requests")
            return [error] * len(jobs)
        return results

    def _run(self) -> None:
        try:
            if self.intraop_threads is not None:
                torch.set_num_threads(self.intraop_threads)
            while not self._closed.is_set():
                jobs = self._take() if self.batching else self._take_one()
                if not jobs:
                    continue
                results = self._answer(jobs)
                for job, result in zip(jobs, results):
                    job.future.set_result(result)
                self._on_batch([result for result in results if not isinstance(result, BaseException)])
        except BaseException as error:  # noqa: BLE001 - the loop itself failed: stop for good, and say so
            with self._lock:
                self.failure = error
            self._drain(WorkerStopped)
            self._on_failure(error)


class AccessLog:
    """Buffered access log: lines are kept in memory and written in blocks; never a request body."""

    def __init__(self, stream: TextIO | None, *, flush_lines: int = 64, flush_s: float = 1.0):
        self._stream = stream
        self._flush_lines = flush_lines
        self._flush_s = flush_s
        self._lines: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        if self._stream is None:
            return
        with self._lock:
            self._lines.append(line)
            if len(self._lines) >= self._flush_lines or time.monotonic() - self._last_flush >= self._flush_s:
                self._flush_locked()

    def request(self, client: str, request_line: str, status: int, size: int, elapsed_s: float | None) -> None:
        """One request's line: `client - [date] "request line" status bytes ms`."""
        if self._stream is None:
            return
        elapsed = f" {1e3 * elapsed_s:.2f}ms" if elapsed_s is not None else ""
        when = time.strftime("%d/%b/%Y %H:%M:%S")
        self.write(f'{client} - [{when}] "{request_line}" {status} {size}{elapsed}')

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def alert(self, line: str) -> None:
        """Write `line` at once, after what is buffered: to the log's stream, or to stderr when the log is off."""
        with self._lock:
            self._flush_locked()
            stream = self._stream if self._stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()

    def _flush_locked(self) -> None:
        if self._lines and self._stream is not None:
            self._stream.write("\n".join(self._lines) + "\n")
            self._stream.flush()
        self._lines.clear()
        self._last_flush = time.monotonic()


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


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _error(status: int, message: str, **extra: str) -> tuple[int, bytes]:
    return status, _json_bytes({"error": message, **extra})


def _where(error: BaseException) -> str:
    """` at file:line` of the innermost frame of the error's traceback, or nothing."""
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    return f" at {frame.filename}:{frame.lineno}" if frame else ""


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
HOST_FIELD = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/?#@\\]+)(:[0-9]{0,5})?")  # name[:port] (RFC 9110 §7.2)
ANSWER_HEADERS = ((b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"))


def _fields(scope: Scope, name: bytes) -> list[str]:
    """The values of every header field `name` (lower case) of a request, in order."""
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


def _declares_body(scope: Scope) -> bool:
    return bool(_fields(scope, b"transfer-encoding")) or any(
        v.strip() != "0" for v in _fields(scope, b"content-length")
    )


def _request_line(scope: Scope) -> str:
    target = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    return f"{scope['method']} {target} HTTP/{scope['http_version']}"


def _same_origin(origin: str, host: str | None) -> bool:
    """`Origin` names this server as the request reached it: `http://` and exactly the request's `Host`."""
    try:
        parts = urlsplit(origin)
    except ValueError:  # an unclosed `[`, a bad port: not this origin
        return False
    return parts.scheme == "http" and parts.netloc == host and not parts.path.strip("/")


class _Answer(Response):
    """A JSON answer with the contract's headers. `close`: end the connection after it. `drain`: the body was not
    read; after the answer, read and drop what the client still sends (bounded) before the connection closes, so the
    client reads the answer instead of a reset (the answer goes out in full first: its Content-Length is met)."""

    media_type = "application/json"

    def __init__(self, status: int, payload: bytes, *, close: bool = False, drain: bool = False, retry: bool = False):
        super().__init__(payload, status_code=status)
        self.raw_headers.extend(ANSWER_HEADERS)
        if retry:
            self.raw_headers.append((b"retry-after", b"1"))
        if close or drain:
            self.raw_headers.append((b"connection", b"close"))
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": self.drain})
        if self.drain:
            await _discard_body(receive)
            await send({"type": "http.response.body", "body": b""})


def _refusal(scope: Scope, status: int, message: str) -> _Answer:
    """An answer before the body was read: close the connection, dropping the unread body first."""
    return _Answer(*_error(status, message), close=True, drain=_declares_body(scope))


async def _disconnected(receive: Receive) -> None:
    """Return once the client is gone: the request's body was read, so what `receive` gives next is a disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _discard_body(receive: Receive) -> None:
    """Read and drop the rest of a request body: at most `LINGER_BYTES`, for at most `LINGER_S`."""
    received = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while received < LINGER_BYTES:
                message = await receive()
                received += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return


class DecisionApp:
    """What the routes serve: a decision model behind its worker, the access log, the metrics and the checks.

    `model` is a `reference.service.DecisionModel` (anything with `decide(obj) -> dict` and `weights.model_id`,
    `weights.method` will do). `answered_hosts`: the `Host` names answered (any case, any port); None answers every
    name. `deadline_s`: a request's queue wait and inference before it is answered 504. `body_timeout_s`: from the
    end of a request's head to the end of its declared body before it is answered 408. `examples_dir`: the folder
    `/examples.json` lists. `batching`: whether one forward may answer several queued requests (`DecisionWorker`).
    `activation_memory`: the admission bound in bytes (engine/serve/admission.py; default: derived from the device's
    memory when the app is built); a backbone that module does not cost is admitted by the budgets alone.
    """

    def __init__(
        self,
        model: Any,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        allow_cross_origin: bool = False,
        answered_hosts: Iterable[str] | None = LOOPBACK_HOSTS,
        access_log: TextIO | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        examples_dir: Path = EXAMPLES_DIR,
        batching: bool = True,
        activation_memory: int | None = None,
    ):
        self.model = model
        self.model_id: str = model.weights.model_id
        self.method: str = model.weights.method
        self.allow_cross_origin = allow_cross_origin
        self.hosts = None if answered_hosts is None else {name.lower() for name in answered_hosts}
        self.deadline_s = deadline_s
        self.body_timeout_s = body_timeout_s
        self.examples_dir = examples_dir
        self.access_log = AccessLog(access_log)
        self.graphs = getattr(getattr(model, "backbone", None), "graphs", None)
        self.fla_configs = getattr(getattr(model, "backbone", None), "fla_configs", None)  # set by its warm-up
        device = getattr(getattr(model, "backbone", None), "device", None)
        self.cuda_device = device if isinstance(device, torch.device) and device.type == "cuda" else None
        self.metrics = ServerMetrics(lambda: self.worker.depth(), self.graphs)
        self.calls = ModelCalls(model)
        self.admission = AdmissionBound.for_backbone(getattr(model, "backbone", None), activation_memory)
        self.metrics.memory(self.cuda_device, self.admission)
        self.worker = DecisionWorker(
            self.calls,
            queue_size,
            on_failure=self._worker_failed,
            on_batch=self.metrics.batch,
            batching=batching,
            intraop_threads=CPU_WORKER_THREADS if self.calls.on_cpu else None,
        )

    def check_host(self, values: list[str]) -> tuple[int, str] | None:
        """The refusal of a request whose `Host` field lines are `values`, or None when it may pass."""
        if len(values) != 1 or not (field := HOST_FIELD.fullmatch(values[0].strip())):
            return 400, "a request needs exactly one valid Host header"
        if self.hosts is not None and field.group(1).lower() not in self.hosts:
            return 403, "Host is not allowed: this server answers localhost, 127.0.0.1, [::1] and --allow-host names"
        return None

    def answered(self, client: str, request_line: str, status: int, size: int, elapsed_s: float | None) -> None:
        """Log and count one answer."""
        self.access_log.request(client, request_line, status, size, elapsed_s)
        self.metrics.answered(status, elapsed_s)

    def _worker_failed(self, error: BaseException) -> None:
        self.access_log.alert(
            f"model worker stopped: {type(error).__name__}: {error}{_where(error)}; "
            "every request and /health now answer 503 until the server is restarted"
        )

    def health(self) -> dict:
        """Ready once bound: the model, and for `graphs` its kernels and the whole grid, were built before the bind.
        A `graphs` backbone adds its cache: graphs captured, capture seconds, reserved CUDA bytes, hits and misses.
        After the model worker stopped (see the module docstring): `status` "stopped" and the `error` that stopped it,
        answered with 503."""
        if self.worker.failure is not None:
            error = f"model worker stopped: {type(self.worker.failure).__name__}"
            return {"status": "stopped", "model": self.model_id, "method": self.method, "error": error}
        health = {"status": "ready", "model": self.model_id, "method": self.method}
        if self.graphs is not None:
            health["graphs"] = self.graphs.describe()
        if self.fla_configs is not None:  # `graphs` on CUDA: the FLA config pin and the keys its warm-up autotuned
            health["fla_configs"] = self.fla_configs
        if self.cuda_device is not None:
            health["memory"] = cuda_memory(self.cuda_device, self.admission)
        return health

    def models(self) -> dict:
        entry = {
            "id": self.model_id,
            "name": self.model_id,
            "description": f"Open-Jev local {self.method}",
            "release_date": RELEASE_DATE,
            "method": self.method,
        }
        return {"models": [entry], "aliases": list(MODEL_ALIASES)}

    def examples(self) -> list[str]:
        """The JSON files under `examples_dir` that validate as requests for this model, as `examples/...` paths."""
        if not self.examples_dir.is_dir():
            return []
        valid = []
        for path in sorted(self.examples_dir.rglob("*.json")):
            try:
                validate_request(parse_json_strict(path.read_bytes()), model_id=self.model_id)
            except (OSError, RequestError):
                continue
            valid.append(f"{self.examples_dir.name}/{path.relative_to(self.examples_dir).as_posix()}")
        return valid

    def _parse_and_compile(self, body: bytes) -> Any:
        """Strict JSON, then `compile` when the model has one, then the admission bound (RequestError for a fault of
        the body or a request over the bound)."""
        request = parse_json_strict(body)
        if self.calls.compile is None:
            return request
        compiled = self.calls.compile(request)
        if self.admission is not None:
            self.admission.admit(compiled.candidates, compiled.groups)
        return compiled

    def _compile_outcome(self, body: bytes) -> Any:
        """`_parse_and_compile`'s result, or the exception it raised (any BaseException) as the value: what passes
        through a thread's future then cannot be a `StopIteration`, which asyncio refuses as a future's exception."""
        try:
            return self._parse_and_compile(body)
        except BaseException as error:  # noqa: BLE001 - handed to `answer`, which answers it
            return error

    def _failed(self, error: BaseException) -> tuple[int, bytes]:
        """The answer to a request whose compile or forward raised `error`: its own status for a RequestError, else 500
        (logged with where it was raised): never a fallback answer."""
        if isinstance(error, RequestError):
            return _error(error.status, error.message)
        self.access_log.write(f"inference failed: {type(error).__name__}{_where(error)}")
        return _error(500, INFERENCE_FAILED, error_type=type(error).__name__)

    async def answer(self, body: bytes, receive: Receive | None = None) -> tuple[int, bytes]:
        """The decision endpoint behind the HTTP framing: body bytes -> (status, response JSON bytes). `receive`: the
        request's ASGI receive, read for the client's disconnect while the request waits for the worker."""
        if len(body) <= INLINE_COMPILE_BYTES:
            request = self._compile_outcome(body)
        else:  # a large request: parsed and compiled on the thread pool, so the loop keeps serving
            request = await asyncio.to_thread(self._compile_outcome, body)
        if isinstance(request, BaseException):
            return self._failed(request)
        abandoned = threading.Event()
        try:
            future = self.worker.submit(request, abandoned)
        except ServerBusy:
            return _error(503, "server busy: the request queue is full")
        except ServerClosing:
            return _error(503, "server is shutting down")
        except WorkerStopped:
            return _error(503, WORKER_STOPPED)
        answered = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        try:
            done, _ = await asyncio.wait(
                [answered] if gone is None else [answered, gone],
                timeout=self.deadline_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            if gone is not None:
                gone.cancel()
        if answered not in done:
            abandoned.set()  # a forward that runs for it alone stops at its next check
            answered.cancel()  # drops the job if it is still queued
            if gone is not None and gone in done:
                return _error(499, "the client closed the connection before the answer")
            return _error(504, f"request deadline exceeded: {self.deadline_s:g} s for queue wait and inference")
        try:
            outcome = answered.result()
        except ServerClosing:
            return _error(503, "server is shutting down")
        except WorkerStopped:
            return _error(503, WORKER_STOPPED)
        if isinstance(outcome, BaseException):
            return self._failed(outcome)
        try:
            return 200, _json_bytes(outcome)
        except (TypeError, ValueError) as error:  # an answer that is not JSON (a NaN): the model's fault
            return self._failed(error)

    # ---- endpoints -------------------------------------------------------------------------------------------------

    async def get_health(self, request: Request) -> Response:
        health = self.health()
        return _Answer(200 if health["status"] == "ready" else 503, _json_bytes(health))

    async def get_models(self, request: Request) -> Response:
        return _Answer(200, _json_bytes(self.models()))

    async def get_metrics(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST, headers={"cache-control": "no-store"})

    async def get_examples(self, request: Request) -> Response:
        return _Answer(200, _json_bytes(self.examples()))

    async def get_root(self, request: Request) -> Response:
        return RedirectResponse(WORKBENCH, status_code=302)

    async def post_decide(self, request: Request) -> Response:
        scope = request.scope
        origins = _fields(scope, b"origin")
        if len(origins) > 1:
            return _refusal(scope, 400, "a request may carry at most one Origin header")
        origin = origins[0] if origins else None
        if origin is not None and not self.allow_cross_origin and not _same_origin(origin, request.headers.get("host")):
            return _refusal(scope, 403, "cross-origin requests are disabled")
        if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
            return _refusal(scope, 415, "Content-Type must be application/json")
        try:
            body = await self._read_body(scope, request.receive)
        except HTTPError as error:
            return _Answer(*_error(error.status, error.message), close=True, drain=error.status != 408)
        status, payload = await self.answer(body, request.receive)
        # With both framings, chunked won (RFC 9112 §6.3): answer, then close.
        both = bool(_fields(scope, b"transfer-encoding")) and bool(_fields(scope, b"content-length"))
        return _Answer(status, payload, close=both, retry=status == 503)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body by `Transfer-Encoding: chunked` or `Content-Length`; empty or over 4 MiB -> 413."""
        encodings = _fields(scope, b"transfer-encoding")
        if encodings:
            if len(encodings) != 1 or encodings[0].strip().lower() != "chunked":
                raise HTTPError(400, f"unsupported Transfer-Encoding {', '.join(encodings)!r}")
        else:
            lengths = {value.strip() for value in _fields(scope, b"content-length") or ["0"]}
            if len(lengths) != 1 or not DECIMAL.fullmatch(text := lengths.pop()):
                raise HTTPError(400, "invalid Content-Length")
            if not 1 <= int(text) <= MAX_BODY_BYTES:
                raise HTTPError(413, "request body size is outside server limits")
        parts: list[bytes] = []
        total = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        raise HTTPError(400, "the client closed the connection before the body was complete")
                    parts.append(message.get("body", b""))
                    total += len(parts[-1])
                    if total > MAX_BODY_BYTES:
                        raise HTTPError(413, "request body size is outside server limits")
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise HTTPError(408, f"the request body was not complete within {self.body_timeout_s:g} s") from None
        if total == 0:
            raise HTTPError(413, "request body size is outside server limits")
        return b"".join(parts)


class _Gate:
    """The checks before routing (Host, method), and the access log and metrics of every answer."""

    def __init__(self, app: ASGIApp, decisions: DecisionApp):
        self.app = app
        self.decisions = decisions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        answer = {"status": 500, "size": 0, "elapsed": None}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body":
                if answer["elapsed"] is None:
                    answer["elapsed"] = time.perf_counter() - started
                answer["size"] += len(message.get("body", b""))
            await send(message)

        refusal = self.decisions.check_host(_fields(scope, b"host"))
        if refusal is None and scope["method"] not in ("GET", "HEAD", "POST"):
            refusal = 501, f"unsupported method {scope['method']!r}"
        try:
            if refusal is not None:
                await _refusal(scope, *refusal)(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            client = scope["client"][0] if scope.get("client") else "-"
            self.decisions.answered(client, _request_line(scope), answer["status"], answer["size"], answer["elapsed"])


async def _not_found(request: Request, error: Exception) -> Response:
    """404 for an unknown path and for a known one asked with the other method (Starlette's 405)."""
    return _Answer(*_error(404, "not found"), close=_declares_body(request.scope), drain=_declares_body(request.scope))


def build_app(model: Any, **options: Any) -> Starlette:
    """The decision server as one ASGI app (Starlette): the routes of the module docstring over a `DecisionApp` of
    `model` and `options` (its keyword arguments), which `app.state.decisions` holds. The app's lifespan starts the
    model worker and closes it; an ASGI server or a replica manager (Ray Serve's `@serve.ingress`) runs it as is."""
    decisions = DecisionApp(model, **options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        decisions.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(decisions.worker.close)
            decisions.access_log.flush()

    routes = [
        Route("/health", decisions.get_health, methods=["GET"]),
        Route("/v1/models", decisions.get_models, methods=["GET"]),
        Route("/metrics", decisions.get_metrics, methods=["GET"]),
        Route("/examples.json", decisions.get_examples, methods=["GET"]),
        Route("/", decisions.get_root, methods=["GET"]),
        *(Route(path, decisions.post_decide, methods=["POST"]) for path in POST_PATHS),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_Gate, decisions=decisions)],
        exception_handlers={404: _not_found, 405: _not_found},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # `/v1/systemone/` is an unknown path (404), not a 307 without a body
    app.state.decisions = decisions
    return app


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request the protocol refuses."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class DecisionProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the framing answers of the module docstring as JSON, a bound on the head
    (bytes, fields, time), idle connections closed after `IDLE_TIMEOUT_S` from the start, and the access log and
    metrics of what it refuses. Both framings are read as chunked (httptools' `lenient_chunked_length`); the app
    answers such a request on a closed connection."""

    def __init__(self, *args: Any, decisions: DecisionApp, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self.decisions = decisions
        self._in_head = False
        self._head_bytes = 0  # bytes received while the head is unfinished
        self._head_parsed = 0  # bytes of the target and fields the parser has read
        self._head_fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._running: Any = None  # the request cycle whose app runs (or ran last); pipelined ones wait behind it
        self._refusal: tuple[int, str, bool] | None = None  # a refusal waiting for the answers before it
        self._began_in_feed = False  # a request began in the bytes being parsed now
        self._body_bytes = 0  # body bytes of the request being read
        self._chunk_body = 0  # body bytes of its open chunk since the chunk's size line
        self._chunk_open = False
        self._chunk_started_in_feed = False  # a chunk header was parsed in the bytes being parsed now
        self._tail = b""  # the last CHUNK_LINE_BYTES bytes received before the ones being parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True  # uvicorn marks only the latest cycle; the running one must not write either
            running.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # the connection closes after the answers before the refused request
        self._unset_keepalive_if_required()
        self._began_in_feed = self._chunk_started_in_feed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrades: the request is answered as plain HTTP
        except httptools.HttpParserError as error:
            self._refuse(*_framing_refusal(error))
            return
        finally:
            tail, self._tail = self._tail, (self._tail + data)[-CHUNK_LINE_BYTES:]
        # A read that holds a head's beginning may hold the end of the request before it (a pipelined body): its head
        # bytes are counted as the parser reports them (`_count_head`); every later read of an unfinished head belongs
        # to it whole (one field may be growing without end, reported only at its end). So a head is refused at most
        # one read (asyncio reads up to 256 KiB) past MAX_HEAD_BYTES.
        if self._in_head and not self._began_in_feed:
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
        elif self._chunk_open and self._chunk_started_in_feed:
            declared = _open_chunk_size(tail + data, self._chunk_body)
            if declared is not None and self._body_bytes - self._chunk_body + declared > MAX_BODY_BYTES:
                self._refuse(413, "request body size is outside server limits")

    def on_chunk_header(self) -> None:
        self._chunk_open = self._chunk_started_in_feed = True
        self._chunk_body = 0

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._chunk_body += len(body)
        super().on_body(body)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._began_in_feed = True
        self._body_bytes = 0
        self._chunk_open = False
        self._head_bytes = 0
        self._head_parsed = 0
        self._head_fields = 0
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > MAX_HEADER_FIELDS:
            raise _Refused(431, f"request head over {MAX_HEADER_FIELDS} header fields")
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        """A head that arrives in one piece is counted as the parser reads it (target and fields)."""
        self._head_parsed += size
        if self._head_parsed > MAX_HEAD_BYTES:
            raise _Refused(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise _Refused(505, f"HTTP version not supported: HTTP/{version} (this server speaks HTTP/1.1 and 1.0)")
        super().on_headers_complete()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"the request head was not complete within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the parser refused, unless its answer has begun, and close the connection. Pipelined
        requests before it are answered first, in order (reading stops meanwhile): the refusal is the answer to the
        request it refuses, never to an earlier one."""
        self._in_head = False
        self._stop_head_timer()
        if self._refusal is not None:  # already refused: waiting for the earlier answers
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is not None and not cycle.more_body:
            cycle = None  # that request is complete: the refused one is the next, whose head did not parse
        queued = [entry for entry in self.pipeline if entry[0] is cycle]
        for entry in queued:  # the refused request was waiting behind others: it never runs
            self.pipeline.remove(entry)
        if cycle is not None and not queued:
            cycle.disconnected = True  # the app, if it runs, reads a disconnect and its answer goes nowhere
            cycle.message_event.set()
        logged = cycle is None or bool(queued)  # else the app, reading the disconnect, logs and counts the request
        running = self._running is not None and not self._running.response_complete and self._running is not cycle
        if self.pipeline or running:
            self._refusal = (status, message, logged)
            self.flow.pause_reading()
            return
        self._send_refusal(status, message, logged, started=cycle is not None and cycle.response_started)

    def _send_refusal(self, status: int, message: str, logged: bool, *, started: bool = False) -> None:
        if not self.transport.is_closing() and not started:
            payload = _json_bytes({"error": message})
            head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
            head += [name + b": " + value for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json", b"content-length: %d" % len(payload)]
            head += [name + b": " + value for name, value in ANSWER_HEADERS] + [b"connection: close"]
            self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + payload)
            if logged:
                line = _request_line(self.scope) if self.scope and "path" in self.scope else "-"
                self.decisions.answered(self.client[0] if self.client else "-", line, status, len(payload), None)
        self.transport.close()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        """As uvicorn's, but with a refusal waiting: start the next earlier request, or after the last one answer the
        refusal, and read nothing more."""
        if self._refusal is None:
            return super().on_response_complete()
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self.pipeline:
            self._start_asgi_task(*self.pipeline.pop())
        else:
            self._send_refusal(*self._refusal)


def _open_chunk_size(received: bytes, chunk_body: int) -> int | None:
    """The declared size of the chunk being read, from the bytes `received` up to now, which end with its size line
    and then the `chunk_body` bytes of it the parser delivered; None when the line is not all there or not hex."""
    line = received[: len(received) - chunk_body].rstrip(b"\r\n")
    start = max(line.rfind(b"\n"), line.rfind(b"\r")) + 1
    if start == 0 and len(received) >= CHUNK_LINE_BYTES:
        return None  # the line may have begun before what is kept
    size = line[start:].split(b";", 1)[0].strip()
    try:
        return int(size, 16)
    except ValueError:
        return None


def _framing_refusal(error: httptools.HttpParserError) -> tuple[int, str]:
    """The answer to what httptools refused (its messages are llhttp's)."""
    cause = error.__context__
    if isinstance(cause, _Refused):
        return cause.status, cause.message
    if isinstance(error, httptools.HttpParserInvalidMethodError):
        return 501, "unsupported method"
    if isinstance(cause, httptools.HttpParserInvalidURLError):
        return 400, "invalid request target"
    text = str(error)
    if "Content-Length" in text:
        return 400, "invalid Content-Length"
    if "Transfer-Encoding" in text:
        return 400, "unsupported Transfer-Encoding"
    if "chunk" in text.lower():
        return 400, "invalid chunked body"
    return 400, f"malformed request: {text}"


class DecisionServer:
    """A decision model behind the Open-Jev HTTP contract: binds on construction, serves after `start()`.

    `model`: see `DecisionApp`. `port=0` picks a free port; `url` and `server_address` tell which. Use as a context
    manager, or call `close()`. `allowed_hosts`: `Host` names answered besides the loopback ones (only checked when
    bound to a loopback address). `batching`: see `DecisionWorker`; `activation_memory`: see `DecisionApp`. `app` is the
    ASGI app (`build_app`), `uvicorn` the server that runs it.
    """

    def __init__(
        self,
        model: Any,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        allow_cross_origin: bool = False,
        allowed_hosts: Iterable[str] = (),
        access_log: TextIO | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        batching: bool = True,
        activation_memory: int | None = None,
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.app = build_app(
            model,
            queue_size=queue_size,
            allow_cross_origin=allow_cross_origin,
            answered_hosts=answered_hosts(self.server_address[0], allowed_hosts),
            access_log=access_log,
            deadline_s=deadline_s,
            body_timeout_s=body_timeout_s,
            batching=batching,
            activation_memory=activation_memory,
        )
        self.decisions: DecisionApp = self.app.state.decisions
        self.worker = self.decisions.worker
        self.access_log = self.decisions.access_log
        config = uvicorn.Config(
            self.app,
            http=functools.partial(DecisionProtocol, decisions=self.decisions),
            lifespan="on",
            ws="none",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=IDLE_TIMEOUT_S,
            timeout_graceful_shutdown=10,
            backlog=LISTEN_BACKLOG,
            log_config=None,
            log_level="warning",
        )
        self.uvicorn = uvicorn.Server(config)
        self._serve_thread: threading.Thread | None = None
        self._closed = False

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> DecisionServer:
        """Serve on a background thread (tests, in-process benchmarks)."""
        self._serve_thread = threading.Thread(
            target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, name="decision-http", daemon=True
        )
        self._serve_thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until `close()` is called from another thread, or SIGINT or SIGTERM stops it (uvicorn
        answers what is in flight first, then raises the signal again for the handler it had replaced)."""
        self.uvicorn.run(sockets=[self.socket])

    def stop(self) -> None:
        """Ask the serving loop to stop (from a signal handler or another thread); `close()` waits for it."""
        self.uvicorn.should_exit = True

    def close(self) -> None:
        """Stop accepting, answer queued requests 503, let answers in flight go out, end every connection, join the
        threads, flush the log."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        self.worker.close()
        if self._serve_thread is not None:
            self._serve_thread.join(30.0)
        self.socket.close()
        self.access_log.flush()

    def __enter__(self) -> DecisionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- building a model and running the server -----------------------------------------------------------------------


def default_shapes_name() -> str:
    return QWEN38_27B.name if torch.cuda.is_available() else TINY.name


def default_backend() -> str:
    return "graphs" if torch.cuda.is_available() else "hf_torch"


def build_decision_model(
    backend: str,
    shapes_name: str,
    *,
    checkpoint: str | None = None,
    base: str | None = None,
    max_length: int | None = None,
    candidate_budget: int = DEFAULT_CANDIDATE_BUDGET,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    seed: int = 0,
) -> DecisionModel:
    """A `DecisionModel` on any registry stage (`engine.stages`, built by `build_backbone`): a real Open-Jev package
    when `checkpoint` and `base` are given, else seeded synthetic weights of `shapes_name` (true numerics path,
    meaningless probabilities). The process is prepared for the stage first (`engine.stages.prepare_process`: the
    Triton interpreter on the CPU, row-count-invariant cuBLAS on CUDA where the stage's GEMM choice needs it), and a
    stage that cannot run on this device is refused with the reason before any weights are made. FLA's autotune
    configs are pinned right after that and before anything imports fla (`engine.fla_configs.pin_fla_configs`: the
    committed set of this GPU, a no-op without CUDA; it asks CUDA for the device name, so it must follow
    `prepare_process`, which cuBLAS's workspace setting requires before CUDA starts), so the server, the in-process
    JevBench and concurrency servers and the replicas pick the same FLA kernels."""
    stage = get_stage(backend)
    if (checkpoint is None) != (base is None):
        raise ValueError("--checkpoint and --base go together (the package and the HF base model it adapts)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in stage.devices:
        raise ValueError(f"stage {stage.name} runs on {', '.join(stage.devices)} only, not on {device.type}")
    prepare_process([stage.name], device.type)  # before this process's first kernel or GEMM
    pin_fla_configs()
    if checkpoint is not None:
        weights = load_package(checkpoint, base, device=device)
    else:
        weights = synthetic_weights(get_shapes(shapes_name), seed=seed, device=device)
    backbone = build_backbone(stage.name, BuildContext(weights))
    warm_up = getattr(backbone, "warm_up", None)
    if warm_up is not None:  # `graphs`: compile the eager paths and capture the grid before the port binds
        warm_up(
            lambda items: tqdm(items, desc=f"{stage.name}: capturing the bucket grid", unit="graph", file=sys.stderr)
        )
    return DecisionModel(
        backbone, weights, max_length=max_length, candidate_budget=candidate_budget, token_budget=token_budget
    )


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    backend_option: str = "--backend",
    backend_help: str = "any registry stage (engine/stages); default: graphs on CUDA, else hf_torch",
) -> None:
    """The flags that choose the model; shared by the server and the in-process JevBench run (which names the
    backend flag its own way)."""
    parser.add_argument(backend_option, dest="backend", choices=list(STAGES), default=None, help=backend_help)
    parser.add_argument(
        "--shapes", choices=sorted(SHAPES), default=None, help="default: the 27B on CUDA, else the tiny twin"
    )
    parser.add_argument("--checkpoint", default=None, help="Open-Jev package directory (with --base)")
    parser.add_argument("--base", default=None, help="HF base model directory for --checkpoint")
    parser.add_argument("--max-length", type=int, default=None, help="per-candidate token limit (default: saved)")
    parser.add_argument(
        "--candidate-budget",
        type=int,
        default=DEFAULT_CANDIDATE_BUDGET,
        help=f"candidate sequences one request may have (default {DEFAULT_CANDIDATE_BUDGET})",
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        default=DEFAULT_TOKEN_BUDGET,
        help=f"input tokens one request may have, bounded before tokenizing (default {DEFAULT_TOKEN_BUDGET})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")


def model_from_arguments(args: argparse.Namespace) -> DecisionModel:
    return build_decision_model(
        args.backend or default_backend(),
        args.shapes or default_shapes_name(),
        checkpoint=args.checkpoint,
        base=args.base,
        max_length=args.max_length,
        candidate_budget=args.candidate_budget,
        token_budget=args.token_budget,
        seed=args.seed,
    )


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE, help="queued requests before 503")
    parser.add_argument(
        "--allow-cross-origin",
        action="store_true",
        default=os.environ.get("JEV_ALLOW_CROSS_ORIGIN", "") == "1",
        help="accept POSTs with a foreign Origin (also JEV_ALLOW_CROSS_ORIGIN=1)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer besides localhost, 127.0.0.1 and [::1] when bound to loopback (repeatable)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_DEADLINE_S,
        metavar="S",
        help=f"seconds a request may wait in the queue and run before its 504 (default {DEFAULT_DEADLINE_S:g})",
    )
    parser.add_argument(
        "--batching",
        choices=["on", "off"],
        default="on",
        help="on (default): one forward answers the requests queued together; off: each request gets its own forward",
    )
    parser.add_argument(
        "--activation-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB of activation memory one request's largest forward may need (default: min(1/8 of the device's "
        "memory, 1/2 of what is free at start); engine/serve/admission.py)",
    )
    parser.add_argument("--access-log", choices=["stderr", "off"], default="stderr")
    args = parser.parse_args(argv)
    if args.activation_memory is not None and args.activation_memory <= 0:
        parser.error(f"--activation-memory must be positive, got {args.activation_memory:g}")
    return args


def answered_hosts(bind_address: str, allowed: Iterable[str]) -> tuple[str, ...] | None:
    """The `Host` names a server listening on `bind_address` (an IP address) answers: on a loopback address the
    loopback names and `allowed`, on any other every name (None)."""
    return (*LOOPBACK_HOSTS, *allowed) if ipaddress.ip_address(bind_address).is_loopback else None


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """The app's options from the command line (`parse_arguments`), as `DecisionServer` and `build_app` take them;
    the server here and each replica (engine/replicas.py) alike."""
    return {
        "queue_size": args.queue_size,
        "allow_cross_origin": args.allow_cross_origin,
        "access_log": sys.stderr if args.access_log == "stderr" else None,
        "deadline_s": args.deadline,
        "batching": args.batching == "on",
        "activation_memory": None if args.activation_memory is None else int(args.activation_memory * 2**30),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        model = model_from_arguments(args)
    except (ValueError, RuntimeError) as error:  # a stage this machine cannot run, bad flags: say why, no traceback
        print(f"engine.server: cannot serve --backend {args.backend or default_backend()}: {error}", file=sys.stderr)
        return 2
    server = DecisionServer(model, host=args.host, port=args.port, allowed_hosts=args.allow_host, **app_options(args))
    ready = {"url": server.url, "model": server.decisions.model_id, "method": server.decisions.method}
    print(json.dumps(ready), flush=True)
    # SIGTERM before uvicorn takes the signals, or raised again after it gave them back: stop (again), exit 0.
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
