"""Replicas: N copies of the decision server behind Ray Serve's HTTP proxy, one model (one GPU) each.

    python -m engine.replicas --replicas N [--gpus-per-replica G] [--proxy-host 127.0.0.1] [--proxy-port 8791]
                              [every engine.server flag: --backend, --shapes, --checkpoint/--base, budgets, ...]

    ray.init -> serve.start(proxy on host:port) -> serve.run(DecisionReplica x N) -> the proxy routes each request to
    one replica -> that replica's ASGI app (`engine.serve.app.build_app`, the same app `python -m engine.server` serves)

Each replica is a Ray actor that builds its own model in its constructor with the server's flags (`engine.server
.parse_arguments`, `model_from_arguments`: the same stages, budgets and graph capture, before the replica reports
ready), then hands Ray Serve the server's ASGI app over that model (`__serve_build_asgi_app__`). So a replica answers
exactly what `python -m engine.server` with the same flags answers, its queue, 503s and `/health` included; Ray Serve
adds the routing across replicas and restarts a replica whose health check fails. The health check is the app's own
readiness: `check_health` raises when `/health` would not say "ready" (the model worker stopped), and Ray Serve then
replaces the replica.

What differs from `python -m engine.server`: the proxy, not this app, parses HTTP, so the framing answers of
`engine.serve.protocol.DecisionProtocol` (JSON 400s for broken framing, 431 for oversize heads, 408 for slow heads) are
Ray's proxy's own; everything from the routes on (Host and Origin checks, 413/415/422/503/504, `/health`,
`/metrics`) is the app's.

On CUDA each replica asks Ray for `--gpus-per-replica` GPUs (default 1, so N replicas need N GPUs and Ray places one
model per GPU); on the CPU it asks for none. The Host check of the app is on (`localhost`, `127.0.0.1`, `[::1]` and
`--allow-host` names) when the proxy listens on a loopback address, as for the server itself.

What was run: the CPU nox session `replicas` (tests/test_replicas.py: one replica of the tiny twin behind the proxy,
answers identical to the server's alone); several GPUs were not (README.md, "Replicas").
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
import time
from typing import Any

import torch

DEFAULT_PROXY_HOST = "127.0.0.1"
DEFAULT_PROXY_PORT = 8791
APP_NAME = "open-jev"


def _ray_serve() -> Any:
    """Ray Serve, or a clear error: it is optional (the `replicas` group, which `nox -s replicas` installs)."""
    try:
        from ray import serve
    except ImportError as error:
        raise RuntimeError("engine.replicas needs Ray Serve: the `replicas` group (nox -s replicas)") from error
    return serve


def replica_deployment(serve: Any) -> Any:
    """The `DecisionReplica` deployment class (built on demand so that importing this module needs no Ray)."""
    from engine.serve.app import build_app
    from engine.server import answered_hosts, app_options, model_from_arguments, parse_arguments

    @serve.deployment(name="DecisionReplica", health_check_period_s=5, health_check_timeout_s=30)
    @serve.ingress()
    class DecisionReplica:
        """One model and its decision app; `server_argv` are `engine.server` flags (the port flags are ignored: the
        proxy owns the port), `proxy_host` the address the proxy listens on (it decides the Host check)."""

        def __init__(self, server_argv: list[str], proxy_host: str):
            args = parse_arguments(server_argv)
            self.decision_app = build_app(
                model_from_arguments(args),  # weights, kernels and (graphs) the whole grid, before Ray calls it ready
                answered_hosts=answered_hosts(proxy_host, args.allow_host),
                **app_options(args),
            )

        def __serve_build_asgi_app__(self) -> Any:
            return self.decision_app

        async def check_health(self) -> None:
            health = self.decision_app.state.decisions.health()
            if health["status"] != "ready":
                raise RuntimeError(f"replica not ready: {health}")

    return DecisionReplica


def start(
    server_argv: list[str],
    *,
    replicas: int,
    gpus_per_replica: float,
    proxy_host: str = DEFAULT_PROXY_HOST,
    proxy_port: int = DEFAULT_PROXY_PORT,
    num_cpus: int | None = None,
) -> str:
    """Start Ray (in this process), the proxy and `replicas` replicas; return the proxy's URL once all are ready."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    ipaddress.ip_address(proxy_host)  # an IP address (ValueError otherwise): the replicas' Host check depends on it
    if gpus_per_replica > 0 and torch.cuda.device_count() < replicas * gpus_per_replica:
        raise ValueError(
            f"{replicas} replicas x {gpus_per_replica} GPUs need {replicas * gpus_per_replica} GPUs; "
            f"this machine has {torch.cuda.device_count()}"
        )
    import ray

    serve = _ray_serve()
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    serve.start(http_options={"host": proxy_host, "port": proxy_port})
    deployment = replica_deployment(serve).options(
        num_replicas=replicas, ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 1}
    )
    serve.run(deployment.bind(server_argv, proxy_host), name=APP_NAME, route_prefix="/")
    return f"http://{proxy_host}:{proxy_port}"


def stop() -> None:
    """Take the replicas and the proxy down and leave Ray."""
    import ray

    _ray_serve().shutdown()
    ray.shutdown()


def parse_arguments(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This module's flags, and the rest, which go to every replica's `engine.server` parser unchanged."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        default=1.0 if torch.cuda.is_available() else 0.0,
        help="GPUs Ray reserves for each replica (default: 1 on CUDA, 0 on the CPU)",
    )
    parser.add_argument("--proxy-host", default=DEFAULT_PROXY_HOST)
    parser.add_argument("--proxy-port", type=int, default=DEFAULT_PROXY_PORT)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, server_argv = parse_arguments(argv)
    try:
        url = start(
            server_argv,
            replicas=args.replicas,
            gpus_per_replica=args.gpus_per_replica,
            proxy_host=args.proxy_host,
            proxy_port=args.proxy_port,
        )
    except (ValueError, RuntimeError) as error:
        print(f"engine.replicas: {error}", file=sys.stderr)
        return 2
    print(f'{{"url": "{url}", "replicas": {args.replicas}}}', flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
