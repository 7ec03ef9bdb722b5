"""The decision server under failures: forced inference failures (500, then the server answers again; a
BaseException that is not an Exception included), a worker whose loop fails (503 and a truthful /health), the worker's
thread count, the bounded queue (503), deadlines (504), a clean shutdown and the access log. Tiny twin or stand-in
models; synthetic weights, so no decision is checked.
"""

from __future__ import annotations

import io
import socket
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.serve.access_log import AccessLog
from engine.serve.app import WORKER_STOPPED
from engine.serve.worker import CPU_WORKER_THREADS, DecisionWorker, ModelCalls, WorkerStopped
from engine.server import DecisionServer
from tests.server_client import (
    INFERENCE_FAILED,
    TIMEOUT_S,
    FailingModel,
    Panic,
    address,
    call,
    post,
    short_request,
    wait_until,
    without_timing,
)

# ---------------------------------------------------------------- failures, queue, shutdown


def test_inference_failure_is_500_then_the_next_request_succeeds(server, tiny_model, monkeypatch):
    request = short_request(5)
    expected = without_timing(post(server, request)[2])
    original = tiny_model.backbone.forward
    calls = []

    def fail_once(prepared):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("forced failure")
        return original(prepared)

    monkeypatch.setattr(tiny_model.backbone, "forward", fail_once)
    assert post(server, request)[::2] == (500, INFERENCE_FAILED)
    status, _, body = post(server, request)
    assert status == 200 and without_timing(body) == expected and len(calls) == 2


def test_nan_in_an_answer_is_500_not_invalid_json(server, tiny_model, monkeypatch):
    original = tiny_model.backbone.forward
    monkeypatch.setattr(tiny_model.backbone, "forward", lambda prepared: original(prepared) * float("nan"))
    status, _, body = post(server, short_request(6))
    assert status == 500 and body["error"] == "model inference failed" and isinstance(body["error_type"], str)


def test_a_base_exception_fails_only_its_own_request():
    """Before: the worker thread died, every later request timed out and /health still said ready. Now each is a 500
    naming the class; the next request is answered, the worker lives, /health is ready. KeyboardInterrupt and
    SystemExit from the model are one request's failure too (see the module docstring)."""
    log = io.StringIO()
    with DecisionServer(FailingModel(), port=0, access_log=log) as failing:
        failing.start()
        for name in ("Panic", "KeyboardInterrupt", "SystemExit", "Panic"):
            assert post(failing, {"raise": name})[::2] == (500, {"error": "model inference failed", "error_type": name})
            assert post(failing, {"n": name})[::2] == (200, {"echo": {"n": name}})
        assert failing.worker._thread.is_alive()
        assert call(failing, "GET", "/health")[::2] == (200, {"status": "ready", "model": "failing", "method": "test"})
    assert log.getvalue().count("inference failed: Panic at ") == 2


def break_queue_once(worker: DecisionWorker, proceed: threading.Event) -> None:
    """Make the worker's first wait for a job raise `Panic` once `proceed` is set: a failure outside any request."""
    original = worker._queue.get
    calls = []

    def get(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            proceed.wait(TIMEOUT_S)
            raise Panic("queue broke")
        return original(*args, **kwargs)

    worker._queue.get = get


def test_a_worker_whose_loop_fails_says_so_and_answers_503():
    """A failure outside any request ends the worker: the queued job and every later one get 503, /health answers 503
    with status "stopped", and one line names the error."""
    proceed = threading.Event()
    failures: list[BaseException] = []
    echo = types.SimpleNamespace(decide=lambda request: {"echo": request})
    worker = DecisionWorker(ModelCalls(echo), on_failure=failures.append)
    break_queue_once(worker, proceed)
    worker.start()
    queued = worker.submit({"n": 1})
    proceed.set()
    assert isinstance(queued.exception(TIMEOUT_S), WorkerStopped)
    worker._thread.join(TIMEOUT_S)
    assert isinstance(worker.failure, Panic) and failures == [worker.failure]
    with pytest.raises(WorkerStopped):
        worker.submit({"n": 2})

    log = io.StringIO()
    with DecisionServer(FailingModel(), port=0, access_log=log) as stopping:
        proceed = threading.Event()
        break_queue_once(stopping.worker, proceed)
        stopping.start()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, stopping, {"n": 3})
            wait_until(lambda: stopping.worker._queue.qsize() == 1)
            proceed.set()
            assert pending.result(TIMEOUT_S)[::2] == (503, {"error": WORKER_STOPPED})
        assert stopping.worker.failure is not None
        assert post(stopping, {"n": 4})[::2] == (503, {"error": WORKER_STOPPED})
        status, _, health = call(stopping, "GET", "/health")
        assert (status, health) == (
            503,
            {"status": "stopped", "model": "failing", "method": "test", "error": "model worker stopped: Panic"},
        )
        assert "model worker stopped: Panic: queue broke at " in log.getvalue()  # written at once, not buffered


class ThreadCountModel:
    """A decide-only model that answers the torch intra-op thread count of the thread it runs on; `backbone_device`
    None: a model without a backbone."""

    weights = types.SimpleNamespace(model_id="threads", method="test")

    def __init__(self, backbone_device: str | None):
        if backbone_device is not None:
            self.backbone = types.SimpleNamespace(device=torch.device(backbone_device))

    def decide(self, request: dict) -> dict:
        return {"threads": torch.get_num_threads()}


def thread_count_of_a_new_thread() -> int:
    counts = []
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join(TIMEOUT_S)
    return counts[0]


@pytest.mark.parametrize("device", ["cpu", "cuda", None])
def test_a_cpu_model_s_worker_runs_one_intraop_thread_and_no_other_worker_is_touched(device):
    """On the CPU the worker runs with CPU_WORKER_THREADS intra-op threads (engine/serve/worker.py: why); a CUDA model's
    worker and a model without a backbone start with what any new thread starts with; the main thread keeps its own.
    New threads are first made to start with CPU_WORKER_THREADS + 1 (a CPU worker started earlier in this process
    left them at CPU_WORKER_THREADS), so the CPU case cannot pass by inheritance."""
    main_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(CPU_WORKER_THREADS + 1)
        assert thread_count_of_a_new_thread() == CPU_WORKER_THREADS + 1
        with DecisionServer(ThreadCountModel(device), port=0, access_log=io.StringIO()) as running:
            running.start()
            status, _, answer = post(running, {"n": 1})
        assert status == 200
        assert answer == {"threads": CPU_WORKER_THREADS if device == "cpu" else CPU_WORKER_THREADS + 1}
        assert torch.get_num_threads() == CPU_WORKER_THREADS + 1
    finally:
        torch.set_num_threads(main_threads)


def test_worker_refuses_a_thread_count_below_one():
    with pytest.raises(ValueError, match="intraop_threads must be >= 1, got 0"):
        DecisionWorker(ModelCalls(ThreadCountModel(None)), on_failure=lambda error: None, intraop_threads=0)


def test_worker_alert_goes_to_stderr_when_the_access_log_is_off(capsys):
    AccessLog(None).alert("model worker stopped: Panic")
    assert capsys.readouterr().err == "model worker stopped: Panic\n"


class BlockingModel:
    """A model whose `decide` waits for `release`: holds the worker so the queue can fill."""

    weights = types.SimpleNamespace(model_id="blocking", method="test")

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()

    def decide(self, request):
        self.started.set()
        if not self.release.wait(TIMEOUT_S):
            raise TimeoutError("never released")
        return {"echo": request}


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_full_queue_answers_503_and_loses_nothing(batching):
    model = BlockingModel()
    with DecisionServer(model, port=0, queue_size=1, batching=batching) as blocking, ThreadPoolExecutor(2) as pool:
        blocking.start()
        running = pool.submit(post, blocking, {"n": 1})
        try:
            assert model.started.wait(TIMEOUT_S)
            queued = pool.submit(post, blocking, {"n": 2})
            wait_until(lambda: blocking.worker._queue.qsize() == 1)
            busy = post(blocking, {"n": 3})
        finally:
            model.release.set()
        assert busy[0] == 503 and busy[2] == {"error": "server busy: the request queue is full"}
        assert busy[1]["retry-after"] == "1"
        assert running.result(TIMEOUT_S)[::2] == (200, {"echo": {"n": 1}})
        assert queued.result(TIMEOUT_S)[::2] == (200, {"echo": {"n": 2}})


def test_close_answers_queued_requests_and_ends_every_thread():
    model = BlockingModel()
    blocking = DecisionServer(model, port=0, queue_size=4).start()
    idle = socket.create_connection(address(blocking), timeout=TIMEOUT_S)  # a keep-alive client that never sends
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, blocking, {"n": 1})
        closer = threading.Thread(target=blocking.close)
        try:
            assert model.started.wait(TIMEOUT_S)
            queued = pool.submit(post, blocking, {"n": 2})
            wait_until(lambda: blocking.worker._queue.qsize() == 1)
            closer.start()
            wait_until(lambda: blocking.worker._closed.is_set())
        finally:
            model.release.set()
        closer.join(TIMEOUT_S)
        assert not closer.is_alive()
        assert running.result(TIMEOUT_S)[0] == 200
        assert queued.result(TIMEOUT_S)[::2] == (503, {"error": "server is shutting down"})
    idle.close()
    assert not blocking.worker._thread.is_alive()
    assert not blocking._serve_thread.is_alive()
    assert not blocking.uvicorn.server_state.connections  # every connection ended, the idle one included
    with pytest.raises(OSError):
        socket.create_connection(address(blocking), timeout=1.0)


def test_tcp_nodelay_on_accepted_connections(server):
    connections = server.uvicorn.server_state.connections
    before = set(connections)
    with socket.create_connection(address(server), timeout=TIMEOUT_S):
        wait_until(lambda: len(connections - before) == 1)
        (accepted,) = connections - before
        sock = accepted.transport.get_extra_info("socket")
        wait_until(lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)


def test_access_log_is_buffered_and_never_holds_a_body(tiny_model):
    log = io.StringIO()
    secret = "SENTINEL-BODY-TEXT"
    with DecisionServer(tiny_model, port=0, access_log=log) as logged:
        logged.start()
        logged.access_log._flush_s = 3600.0  # only the line count or close flushes from here on
        logged.access_log.flush()
        written = log.getvalue()
        post(logged, {"state": secret, "questions": {}})
        post(logged, b"{" + secret.encode())
        assert log.getvalue() == written  # buffered: nothing written yet
    text = log.getvalue()
    assert text.count('"POST /v1/systemone HTTP/1.1" 422') == 2
    assert secret not in text


def test_access_log_flushes_by_count():
    stream = io.StringIO()
    log = AccessLog(stream, flush_lines=3, flush_s=3600.0)
    log.write("a")
    log.write("b")
    assert stream.getvalue() == ""
    log.write("c")
    assert stream.getvalue() == "a\nb\nc\n"
