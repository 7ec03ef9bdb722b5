"""The model worker: one thread that runs the forwards, fed by a bounded FIFO of compiled requests.

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
server without the batcher that issue 15's one-client target compares with (`bench/concurrency.py
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
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from reference.service import ForwardAbandoned

DEFAULT_QUEUE_SIZE = 64
# A forward takes at most this many queued requests: deciding how many costs the worker thread a pass over the queue
# as far as the batch reaches (`DecisionModel.batch_requests`, linear in the queue; its time at 1, 4, 8 and 16 queued
# JevBench requests: `timing` in results/batching/batch-packing.json, from measure/batch_packing.py).
MAX_BATCH_REQUESTS = 16
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
