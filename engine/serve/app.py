"""The decision server as one ASGI app (Starlette): the routes, the checks of every request, and the hand-off to the
model worker. `build_app(model, ...)` returns it; engine/server.py runs it on uvicorn, a replica manager may run it as
it is.

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

Deviation from the original server, on purpose: it maps any ValueError/KeyError/TypeError/UnicodeError to 422 by class.
Here a request is answered 422 only through `RequestError`, which the request pipeline raises with the contract's
messages for every fault of the body (not UTF-8, not strict JSON, schema, model, length); any other exception inside
the model is a 500, so a bug in a forward cannot pass for a client error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import traceback
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import torch
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serve.access_log import AccessLog
from engine.serve.admission import AdmissionBound
from engine.serve.metrics import ServerMetrics, cuda_memory
from engine.serve.worker import (
    CPU_WORKER_THREADS,
    DEFAULT_QUEUE_SIZE,
    DecisionWorker,
    ModelCalls,
    ServerBusy,
    ServerClosing,
    WorkerStopped,
)
from reference.request import MODEL_ALIASES, RequestError, parse_json_strict, validate_request

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DEADLINE_S = 60.0  # a request's queue wait and inference
BODY_TIMEOUT_S = 30.0  # from the end of the head to the end of a declared body
POST_PATHS = ("/v1/systemone", "/v1/inference", "/api/jev")
RELEASE_DATE = "2026-09-19"
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
WORKBENCH = "/examples/workbench/index.html"

# After an answer sent before the body was read, the rest of the body is read and dropped (at most this many bytes,
# for at most this long) before the connection closes, so the client reads the answer instead of a connection reset.
LINGER_BYTES = 2 * MAX_BODY_BYTES
LINGER_S = 2.0
DECIMAL = re.compile(r"[0-9]{1,19}")  # a Content-Length value (no sign, no spaces, no other digits)
INFERENCE_FAILED = "model inference failed"
INLINE_COMPILE_BYTES = 64 * 1024  # bodies up to this size are compiled on the event loop (module docstring)
WORKER_STOPPED = "the model worker stopped; see /health"


class HTTPError(Exception):
    """An HTTP-level rejection (framing, size, time) raised while reading a request."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _error(status: int, message: str, **extra: str) -> tuple[int, bytes]:
    return status, json_bytes({"error": message, **extra})


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


def request_line(scope: Scope) -> str:
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
    """Return once the client is gone. The body was read, so an ASGI server's next message is the disconnect (uvicorn,
    Starlette's test client); should a server give anything else, it does not report disconnects this way, and this
    waits until cancelled (the answer came or the deadline passed) instead of asking again."""
    if (await receive())["type"] != "http.disconnect":
        await asyncio.Event().wait()


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
        except asyncio.CancelledError:  # the handler itself was cancelled (shutdown): nobody waits for the answer
            abandoned.set()
            answered.cancel()
            raise
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
            return 200, json_bytes(outcome)
        except Exception as error:  # noqa: BLE001 - an answer that is not JSON (a NaN): the model's fault
            return self._failed(error)

    # ---- endpoints -------------------------------------------------------------------------------------------------

    async def get_health(self, request: Request) -> Response:
        health = self.health()
        return _Answer(200 if health["status"] == "ready" else 503, json_bytes(health))

    async def get_models(self, request: Request) -> Response:
        return _Answer(200, json_bytes(self.models()))

    async def get_metrics(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST, headers={"cache-control": "no-store"})

    async def get_examples(self, request: Request) -> Response:
        return _Answer(200, json_bytes(self.examples()))

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
            self.decisions.answered(client, request_line(scope), answer["status"], answer["size"], answer["elapsed"])


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
