"""The drop-in decision server: the Open-Jev HTTP contract in front of any backbone, as one ASGI app.

    python -m engine.server [--backend STAGE] [--shapes qwen3.8-27b|tiny] [--checkpoint PKG --base DIR]
                            [--host 127.0.0.1] [--port 8791] [--max-length N] [--queue-size N] [--allow-cross-origin]
                            [--candidate-budget N] [--token-budget N] [--allow-host NAME ...] [--deadline S]
                            [--batching on|off] [--activation-memory GIB]

The wire contract is `shared/research/open-jev-server-contract.md` §1-§4. The stack is Starlette on uvicorn
(httptools parses HTTP/1.1, uvloop runs the event loop when installed): `build_app(model, ...)` returns the Starlette
app, the one object a replica manager (Ray Serve's `@serve.ingress`) wraps; `DecisionServer` binds a socket for it and
runs uvicorn, on a background thread after `start()` or on the calling thread in `serve_forever()`.

Routes: `POST /v1/systemone` (aliases `/v1/inference`, `/api/jev`) answers a decision request; `GET /health` and
`GET /v1/models` describe the loaded model; `GET /metrics` is Prometheus text (`metrics`); `GET /examples.json` lists
the JSON files under the repository's `examples/` that validate as requests (the repository has no such folder: `[]`);
`GET /` redirects (302) to `/examples/workbench/index.html`, the contract's workbench (not served here: 404). A HEAD
is answered as its GET without a body. The model is built before the port binds, so a server that answers `/health`
is ready; once bound it prints one JSON line with `url`, `model` and `method`. With `--backend graphs` (the default on
CUDA) building includes compiling the eager paths' kernels and capturing the whole bucket grid (a progress bar on
stderr); `/health` then also reports the graph cache (graphs, capture seconds, reserved CUDA bytes, hits, misses) and
every response's `metadata.graph` says which bucket served it and whether a graph did.

The parts, one module each (engine/serve/): `app` (the ASGI app: routes, the checks of every request, the hand-off to
the worker), `worker` (the model worker thread, its bounded queue, batching, deadlines and failures), `admission` (the
cost bound of a request's largest forward), `protocol` (uvicorn's httptools protocol with the framing answers),
`metrics` (Prometheus text, CUDA memory) and `access_log`. This module holds the server object and the command line.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterable
from typing import Any, TextIO

import torch
import uvicorn
from tqdm import tqdm

from engine.fla_configs import pin_fla_configs
from engine.serve.app import BODY_TIMEOUT_S, DEFAULT_DEADLINE_S, LOOPBACK_HOSTS, DecisionApp, build_app
from engine.serve.protocol import IDLE_TIMEOUT_S, DecisionProtocol
from engine.serve.worker import DEFAULT_QUEUE_SIZE
from engine.stages import STAGES, BuildContext, build_backbone, get_stage, prepare_process
from reference.service import DEFAULT_CANDIDATE_BUDGET, DEFAULT_TOKEN_BUDGET, DecisionModel
from reference.shapes import QWEN38_27B, SHAPES, TINY, get_shapes
from reference.weights import load_package, synthetic_weights

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8791
LISTEN_BACKLOG = 1024  # many clients may connect at once


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
