"""The drop-in decision server: the Open-Jev HTTP contract in front of any backbone.

    python -m engine.server [--backend STAGE] [--shapes qwen3.8-27b|tiny] [--checkpoint PKG --base DIR]
                            [--host 127.0.0.1] [--port 8791] [--max-length N] [--queue-size N] [--allow-cross-origin]
                            [--candidate-budget N] [--token-budget N] [--allow-host NAME ...]

The wire contract is `shared/research/open-jev-server-contract.md` §1-§4. `POST /v1/systemone` (aliases
`/v1/inference`, `/api/jev`) answers a decision request; `GET /health` and `GET /v1/models` describe the loaded model.
The model is built before the port binds, so a server that answers `/health` is ready; once bound it prints one JSON
line with `url`, `model` and `method`. With `--backend graphs` (the default on CUDA) building includes compiling the
eager paths' kernels and capturing the whole bucket grid (a progress bar on stderr); `/health` then also reports the
graph cache (graphs, capture seconds, reserved CUDA bytes, hits, misses) and every response's `metadata.graph` says
which bucket served it and whether a graph did.

Every request (GET or POST) first has its `Host` checked, against DNS rebinding (a page of a foreign site whose name
resolves to 127.0.0.1 would otherwise drive the server from a browser, with an `Origin` matching its own `Host`):
400 no `Host`, several, or one that is not `name[:port]` (HTTP/1.1 requires exactly one; HTTP/1.0 requests are held
to it too) -> 403 a name this server does not answer: a loopback-bound server answers only `localhost`, `127.0.0.1`
and `[::1]` (any port, any case) and the names given with `--allow-host`, as Jupyter does; bound to any other
address, every name passes.
Then a POST is checked in the contract's order, and the first failing check answers:
404 unknown path -> 403 foreign `Origin` (unless allowed) -> 415 media type not `application/json` -> 413 body empty or
over 4 MiB (Content-Length or chunked) -> 422 not strict JSON (duplicate keys, NaN/Infinity) or a schema violation,
an unknown model, a request over the candidate or the token budget (`--candidate-budget`, `--token-budget`: checked
from the validated request before any prompt is built, see `reference.service`), an over-length candidate -> 503 the
model queue is full -> 500 inference failed (`error_type` names the exception class; never a fallback answer).
Malformed framing (a Content-Length that is not one decimal number, a bad chunk, a Transfer-Encoding other than
chunked) is a 400, which the contract does not name. The server keeps serving after every one of these.

Concurrency: the HTTP side is one thread per connection (stdlib `ThreadingHTTPServer`, TCP_NODELAY, 30 s socket
timeout). It frames the body and parses the JSON; all model work (validation, prompts, tokens, forward, readout) runs on
one `DecisionWorker` thread fed by a bounded FIFO. Each request carries its own future, so an answer can only go back to
the request it came from; a full queue answers 503 at once instead of growing.

The worker survives any failure of one request: whatever `decide` raises, a `BaseException` that is not an `Exception`
included (a panicking native extension raises one), is that request's 500 with `error_type`, and the next request is
answered as usual. KeyboardInterrupt and SystemExit are no exception to this, on purpose: Python delivers signals to
the main thread only (where Ctrl-C still ends `serve_forever` and SIGTERM has its handler), so in the worker they can
only come from model code, and a `sys.exit()` there would end just that thread, the silent death this rule prevents.
Should the worker's own loop ever fail, outside any request, the worker stops for good: it writes one line naming the
error (to the access log, or stderr when that is off), answers every queued and later request 503, and `/health`
answers 503 with `status` "stopped" instead of "ready", so a supervisor's health check sees the truth.

Deviation from the original server, on purpose: it maps any ValueError/KeyError/TypeError/UnicodeError to 422 by class.
Here a request is answered 422 only through `RequestError`, which the request pipeline raises with the contract's
messages for every fault of the body (not UTF-8, not strict JSON, schema, model, length); any other exception inside
the model is a 500, so a bug in a forward cannot pass for a client error.

Request bodies are never logged. The access log (one line per request: client, request line, status, bytes, ms) is
buffered: written every 64 lines, at the first line 1 s or more after the last write, and on shutdown.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO
from urllib.parse import urlsplit

import torch
from tqdm import tqdm

from engine.stages import STAGES, BuildContext, build_backbone, get_stage, prepare_process
from reference.request import MODEL_ALIASES, RequestError, parse_json_strict
from reference.service import DEFAULT_CANDIDATE_BUDGET, DEFAULT_TOKEN_BUDGET, DecisionModel
from reference.shapes import QWEN38_27B, SHAPES, TINY, get_shapes
from reference.weights import load_package, synthetic_weights

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8791
MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_SIZE = 64
SOCKET_TIMEOUT_S = 30.0
POST_PATHS = ("/v1/systemone", "/v1/inference", "/api/jev")
RELEASE_DATE = "2026-09-19"

# After a response sent before the body was read, the rest of the body is read and dropped (at most this many bytes,
# for at most this long) before the socket closes, so the client reads the response instead of a connection reset.
LINGER_BYTES = 2 * MAX_BODY_BYTES
LINGER_S = 2.0
CHUNK_LINE_MAX = 1024  # bytes of one chunk-size or trailer line
DECIMAL = re.compile(r"[0-9]{1,19}")  # a Content-Length value (no sign, no spaces, no other digits)
HEXADECIMAL = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk size
TRAILER_LINES_MAX = 64

INFERENCE_FAILED = "model inference failed"
WORKER_STOPPED = "the model worker stopped; see /health"


class ServerBusy(Exception):
    """The model queue is full: answered 503 at once."""


class ServerClosing(Exception):
    """The server is shutting down: queued requests are answered 503."""


class WorkerStopped(Exception):
    """The model worker stopped after a failure of its own loop: every request is answered 503."""


class HTTPError(Exception):
    """An HTTP-level rejection (framing, size) raised while reading a request body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Job:
    request: Any  # the parsed request object
    future: Future


class DecisionWorker:
    """The one thread that runs model work, in arrival order, one request per forward.

    `submit` puts a request on a bounded FIFO and returns its own `Future`; a full queue raises `ServerBusy`. The
    thread calls `decide(request)` for each job and completes that job's future with the answer or the exception, any
    `BaseException` included, and goes on. Batching several queued requests into one forward belongs in `_run`: take
    what is queued, answer it in one call, complete each future with its own part.

    If the loop itself fails, `failure` holds the error, `on_failure(error)` is called once, and every queued and later
    job gets `WorkerStopped`.
    """

    def __init__(
        self,
        decide: Callable[[Any], dict],
        queue_size: int = DEFAULT_QUEUE_SIZE,
        *,
        on_failure: Callable[[BaseException], None],
    ):
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self._decide = decide
        self._on_failure = on_failure
        self.failure: BaseException | None = None
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # orders submit against close, so no job is queued after the last drain
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Any) -> Future:
        job = _Job(request, Future())
        with self._lock:
            if self.failure is not None:
                raise WorkerStopped()
            if self._closed.is_set():
                raise ServerClosing()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise ServerBusy() from None
        return job.future

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop taking jobs, let the running one finish, answer every queued one with `ServerClosing`."""
        with self._lock:
            self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._drain(ServerClosing)

    def _drain(self, error: type[Exception]) -> None:
        """Answer every queued job with `error`."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error())

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    job = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    job.future.set_result(self._decide(job.request))
                except BaseException as error:  # noqa: BLE001 - any failure of one request is that request's own
                    job.future.set_exception(error)
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


class DecisionServer:
    """A decision model behind the Open-Jev HTTP contract: binds on construction, serves after `start()`.

    `model` is a `reference.service.DecisionModel` (anything with `decide(obj) -> dict` and `weights.model_id`,
    `weights.method` will do).
    `port=0` picks a free port; `url` tells which. Use as a context manager, or call `close()`.
    `allowed_hosts`: `Host` names answered besides the loopback ones (only checked when bound to a loopback address).
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
    ):
        self.model = model
        self.model_id: str = model.weights.model_id
        self.method: str = model.weights.method
        self.allow_cross_origin = allow_cross_origin
        self.access_log = AccessLog(access_log)
        self.worker = DecisionWorker(model.decide, queue_size, on_failure=self._worker_failed)
        self.httpd = _DecisionHTTPServer((host, port), _DecisionHandler, self)
        loopback = ipaddress.ip_address(self.httpd.server_address[0]).is_loopback
        # The names answered, lower case; None: any name (not bound to loopback).
        self.hosts = {name.lower() for name in (*LOOPBACK_HOSTS, *allowed_hosts)} if loopback else None
        self._serve_thread: threading.Thread | None = None
        self._closed = False

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def check_host(self, values: list[str]) -> tuple[int, str] | None:
        """The refusal of a request whose `Host` field lines are `values`, or None when it may pass."""
        if len(values) != 1 or not (field := HOST_FIELD.fullmatch(values[0].strip())):
            return 400, "a request needs exactly one valid Host header"
        if self.hosts is not None and field.group(1).lower() not in self.hosts:
            return 403, "Host is not allowed: this server answers localhost, 127.0.0.1, [::1] and --allow-host names"
        return None

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
        graphs = getattr(getattr(self.model, "backbone", None), "graphs", None)
        if graphs is not None:
            health["graphs"] = graphs.describe()
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

    def answer(self, body: bytes) -> tuple[int, bytes]:
        """The decision endpoint behind the HTTP framing: body bytes -> (status, response JSON bytes)."""
        try:
            request = parse_json_strict(body)
        except RequestError as error:
            return _error(error.status, error.message)
        try:
            future = self.worker.submit(request)
        except ServerBusy:
            return _error(503, "server busy: the request queue is full")
        except ServerClosing:
            return _error(503, "server is shutting down")
        except WorkerStopped:
            return _error(503, WORKER_STOPPED)
        try:
            return 200, _json_bytes(future.result())
        except RequestError as error:
            return _error(error.status, error.message)
        except (ServerClosing, CancelledError):
            return _error(503, "server is shutting down")
        except WorkerStopped:
            return _error(503, WORKER_STOPPED)
        except BaseException as error:  # noqa: BLE001 - a failed inference is a 500, never a fallback answer
            self.access_log.write(f"inference failed: {type(error).__name__}{_where(error)}")
            return _error(500, INFERENCE_FAILED, error_type=type(error).__name__)

    def start(self) -> DecisionServer:
        """Serve on a background thread (tests, in-process benchmarks)."""
        self.worker.start()
        self._serve_thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="decision-http", daemon=True
        )
        self._serve_thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until `close()` is called from another thread (or a signal)."""
        self.worker.start()
        self.httpd.serve_forever(poll_interval=0.05)

    def close(self) -> None:
        """Stop accepting, answer queued requests 503, end every connection, join the threads, flush the log."""
        if self._closed:
            return
        self._closed = True
        if self._serve_thread is not None:
            self.httpd.shutdown()
            self._serve_thread.join(10.0)
        self.worker.close()
        self.httpd.wait_idle(10.0)  # answers already computed (or refused) get written before the sockets go
        self.httpd.close_connections()
        self.httpd.server_close()
        self.access_log.flush()

    def __enter__(self) -> DecisionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DecisionHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # listen backlog: many clients may connect at once

    def __init__(self, address: tuple[str, int], handler: type, app: DecisionServer):
        self.app = app
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._in_flight = 0  # requests between dispatch and their response written
        self._idle = threading.Condition()
        super().__init__(address, handler)

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> None:
        """Wait (bounded) until no request is between dispatch and its written response."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every connection still open (idle keep-alive clients) so `server_close` can join its thread."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            return  # the client went away; nothing to answer
        self.app.access_log.write(f"handler error: {type(error).__name__}")


class _DecisionHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = SOCKET_TIMEOUT_S
    server: _DecisionHTTPServer

    def setup(self) -> None:
        super().setup()
        self._linger = False

    # ---- responses -------------------------------------------------------------------------------------------------

    def _send(self, status: int, payload: bytes, *, close: bool = False, headers: tuple = ()) -> None:
        """Status line, headers and body in one write (one segment on loopback for small answers)."""
        if close:
            self.close_connection = True
        lines = [
            f"{self.protocol_version} {status} {self.responses.get(status, ('',))[0]}",
            f"Server: {self.version_string()}",
            f"Date: {self.date_time_string()}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Cache-Control: no-store",
            "X-Content-Type-Options: nosniff",
            *(f"{name}: {value}" for name, value in headers),
        ]
        if self.close_connection:
            lines.append("Connection: close")
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        self._log_access(status, len(payload))

    def _reject(self, status: int, message: str) -> None:
        """Answer before the body was read: close the connection, dropping the unread body first (see `finish`)."""
        self._linger = True
        self._send(*_error(status, message), close=True)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own rejections (bad request line, headers too large, unknown method) as JSON bodies."""
        self._linger = True
        self._send(*_error(code, message or self.responses.get(code, ("error",))[0]), close=True)

    def _log_access(self, status: int, size: int) -> None:
        started = getattr(self, "_started", None)
        elapsed = f" {1e3 * (time.perf_counter() - started):.2f}ms" if started is not None else ""
        self.server.app.access_log.write(
            f'{self.address_string()} - [{self.log_date_time_string()}] "{self.requestline}" {status} {size}{elapsed}'
        )

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        self.server.app.access_log.write(f"{self.address_string()} - [{self.log_date_time_string()}] {format % args}")

    def finish(self) -> None:
        super().finish()
        if self._linger:
            _drain(self.connection)

    # ---- endpoints -------------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's dispatch name
        with self.server.in_flight():
            self._get()

    def do_POST(self) -> None:  # noqa: N802
        with self.server.in_flight():
            self._post()

    def _refuse_host(self) -> bool:
        """Answer a request whose `Host` the server does not accept (see `DecisionServer.check_host`)."""
        refusal = self.server.app.check_host(self.headers.get_all("Host") or [])
        if refusal is not None:
            self._reject(*refusal)
        return refusal is not None

    def _get(self) -> None:
        self._started = time.perf_counter()
        if self._refuse_host():
            return
        path = urlsplit(self.path).path
        app = self.server.app
        if self.headers.get("Transfer-Encoding") is not None or self.headers.get("Content-Length", "0") != "0":
            self._linger = True  # a GET with a body: answer, then close rather than parse the body as a request
            self.close_connection = True
        if path == "/health":
            health = app.health()
            self._send(200 if health["status"] == "ready" else 503, _json_bytes(health))
        elif path == "/v1/models":
            self._send(200, _json_bytes(app.models()))
        else:
            self._send(*_error(404, "not found"))

    def _post(self) -> None:
        self._started = time.perf_counter()
        if self._refuse_host():
            return
        app = self.server.app
        if urlsplit(self.path).path not in POST_PATHS:
            return self._reject(404, "not found")
        origin = self.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != self.headers.get("Host") and not app.allow_cross_origin:
            return self._reject(403, "cross-origin requests are disabled")
        if self.headers.get_content_type() != "application/json":
            return self._reject(415, "Content-Type must be application/json")
        try:
            body = self._read_body()
        except HTTPError as error:
            return self._reject(error.status, error.message)
        status, payload = app.answer(body)
        self._send(status, payload, headers=(("Retry-After", "1"),) if status == 503 else ())

    # ---- body framing ----------------------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        """The request body by `Transfer-Encoding: chunked` or `Content-Length`; empty or over 4 MiB -> 413."""
        transfer_encoding = self.headers.get("Transfer-Encoding")
        if transfer_encoding is not None:
            if transfer_encoding.strip().lower() != "chunked":
                raise HTTPError(400, f"unsupported Transfer-Encoding {transfer_encoding!r}")
            if self.headers.get("Content-Length") is not None:
                self.close_connection = True  # RFC 9112 §6.3: chunked wins; do not reuse the connection
            body = self._read_chunked()
        else:
            lengths = {value.strip() for value in self.headers.get_all("Content-Length") or ["0"]}
            if len(lengths) != 1 or not DECIMAL.fullmatch(text := lengths.pop()):
                raise HTTPError(400, "invalid Content-Length")
            length = int(text)
            if length < 1 or length > MAX_BODY_BYTES:
                raise HTTPError(413, "request body size is outside server limits")
            body = self.rfile.read(length)
            if len(body) != length:
                raise HTTPError(400, "incomplete request body")
        if not body:
            raise HTTPError(413, "request body size is outside server limits")
        return body

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(CHUNK_LINE_MAX + 1)
            size_text = line.split(b";", 1)[0].strip()
            if len(line) > CHUNK_LINE_MAX or not line.endswith(b"\n") or not HEXADECIMAL.fullmatch(size_text):
                raise HTTPError(400, "invalid chunked body")
            size = int(size_text, 16)
            if size == 0:
                break
            total += size
            if total > MAX_BODY_BYTES:
                raise HTTPError(413, "request body size is outside server limits")
            data = self.rfile.read(size)
            if len(data) != size or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise HTTPError(400, "invalid chunked body")
            parts.append(data)
        for _ in range(TRAILER_LINES_MAX):
            trailer = self.rfile.readline(CHUNK_LINE_MAX + 1)
            if trailer in (b"\r\n", b"\n"):
                return b"".join(parts)
            if not trailer.endswith(b"\n"):
                break
        raise HTTPError(400, "invalid chunked body")


def _drain(connection: socket.socket) -> None:
    """Half-close, then read and drop what the client still sends (bounded in bytes and time)."""
    try:
        connection.shutdown(socket.SHUT_WR)
        connection.settimeout(0.25)
        deadline = time.monotonic() + LINGER_S
        received = 0
        while received < LINGER_BYTES and time.monotonic() < deadline:
            data = connection.recv(65536)
            if not data:
                break
            received += len(data)
    except OSError:
        pass


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
    stage that cannot run on this device is refused with the reason before any weights are made."""
    stage = get_stage(backend)
    if (checkpoint is None) != (base is None):
        raise ValueError("--checkpoint and --base go together (the package and the HF base model it adapts)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in stage.devices:
        raise ValueError(f"stage {stage.name} runs on {', '.join(stage.devices)} only, not on {device.type}")
    prepare_process([stage.name], device.type)  # before this process's first kernel or GEMM
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
    parser.add_argument("--access-log", choices=["stderr", "off"], default="stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        model = model_from_arguments(args)
    except (ValueError, RuntimeError) as error:  # a stage this machine cannot run, bad flags: say why, no traceback
        print(f"engine.server: cannot serve --backend {args.backend or default_backend()}: {error}", file=sys.stderr)
        return 2
    server = DecisionServer(
        model,
        host=args.host,
        port=args.port,
        queue_size=args.queue_size,
        allow_cross_origin=args.allow_cross_origin,
        allowed_hosts=args.allow_host,
        access_log=sys.stderr if args.access_log == "stderr" else None,
    )
    print(json.dumps({"url": server.url, "model": server.model_id, "method": server.method}), flush=True)
    # SIGTERM stops the accept loop from another thread (shutdown() waits for serve_forever on this one).
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.httpd.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
