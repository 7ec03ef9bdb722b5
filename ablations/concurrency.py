"""Serving under concurrency: JevBench public tasks from 1, 4, 8 and 16 clients at once against one decision server.

    python -m ablations.concurrency [--endpoint http://127.0.0.1:8791 | --serve-backend graphs [--shapes ...]]
                                    [--clients 1,4,8,16] [--tasks easy,original] [--limit N] [--out results/serving]
                                    [--label NAME]

First the alone pass: every task once, one request at a time; it warms the server (the issue's "second pass" is every
pass after it) and gives each task's answer alone, the reference of every later answer. Then, per client count k, k
client threads each send every task once, client i starting at task i*n/k and wrapping around (so that at any moment the
clients ask for different tasks), each request on a new connection as JevBench connects, the next one as soon as the
last answered (`ablations.jevbench.run_task`: built, sent, read and mapped as JevBench does). Per k: requests/s over the
wall clock from the first request sent to the last answer read, the client latency of every request (mean/P50/P95/max),
the statuses, and how many answers are bit-identical to the same task's answer alone (every probability the same float).
The server's own view, where it says (metadata.batch), is averaged: requests per forward.

Written under `--out/<utc>-<gpu or cpu>-<sha7>-<label>/`: `records.jsonl` (one row per request: clients, client,
task, status, latency, identical) and `summary.json` (per k, the targets of issue 15 evaluated at 8 clients against
1, and the environment); `python -m paper.figures` draws `serving-<device>.png` from the newest summary.

With synthetic weights the probabilities are meaningless for accuracy; they are compared only with themselves.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ablations import envinfo
from ablations.jevbench import environment, load_tasks, run_task, server_identity, write_run
from ablations.overhead import latency_stats
from engine.server import DecisionServer, add_model_arguments, model_from_arguments
from reference.data import REPO

DEFAULT_OUT = REPO / "results" / "serving"
DEFAULT_CLIENTS = (1, 4, 8, 16)
# Issue 15, at 8 clients against 1 (H200, JevBench public tiers, with `graphs`).
TARGET_CLIENTS = 8
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_P50_RATIO = 2.0


def alone_pass(endpoint: str, tasks: list[dict]) -> dict[str, dict[str, float]]:
    """Every task once, one at a time: the answers alone (a task the server refuses has none)."""
    alone = {}
    for task in tasks:
        record = run_task(endpoint, task, model="open-jev")
        if record["probabilities"] is not None:
            alone[task["id"]] = record["probabilities"]
    return alone


def concurrent_pass(endpoint: str, tasks: list[dict], clients: int, alone: dict) -> tuple[list[dict], float]:
    """`clients` threads, each sending every task once from its own offset; the records and the wall seconds."""
    records: list[list[dict]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        offset = index * len(tasks) // clients
        barrier.wait()
        for number in range(len(tasks)):
            task = tasks[(offset + number) % len(tasks)]
            record = run_task(endpoint, task, model="open-jev")
            probabilities = record["probabilities"]
            records[index].append({
                "clients": clients,
                "client": index,
                "id": task["id"],
                "status": record["status"],
                "latency_ms": record["latency_ms"],
                "error": record["error"],
                "batch": record["server"]["batch"] if record["server"] else None,
                "identical": probabilities is not None and probabilities == alone.get(task["id"]),
            })  # fmt: skip

    threads = [threading.Thread(target=client, args=(index,), daemon=True) for index in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return [record for per_client in records for record in per_client], time.perf_counter() - start


def summarize_clients(records: list[dict], wall_s: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for record in records:
        statuses[str(record["status"])] = statuses.get(str(record["status"]), 0) + 1
    batches = [record["batch"]["requests"] for record in records if record.get("batch")]
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s,
        "latency": latency_stats([record["latency_ms"] for record in records]),
        "status_counts": statuses,
        "errors": sum(record["status"] != 200 for record in records),
        "identical_to_alone": sum(record["identical"] for record in records),
        "mean_requests_per_forward": sum(batches) / len(batches) if batches else None,
    }


def evaluate_targets(per_clients: dict[str, dict]) -> dict[str, Any] | None:
    """Issue 15's targets at 8 clients against 1 client, or None when either was not run."""
    one, many = per_clients.get("1"), per_clients.get(str(TARGET_CLIENTS))
    if one is None or many is None:
        return None
    throughput = many["requests_per_s"] / one["requests_per_s"]
    p50 = many["latency"]["p50_ms"] / one["latency"]["p50_ms"]
    return {
        "clients": TARGET_CLIENTS,
        "throughput_ratio": throughput,
        "throughput_met": throughput >= TARGET_THROUGHPUT_RATIO,
        "p50_ratio": p50,
        "p50_met": p50 <= TARGET_P50_RATIO,
        "errors": many["errors"],
        "all_identical": many["identical_to_alone"] == many["requests"],
    }


def run_concurrency(
    endpoint: str, tasks: list[dict], *, clients: tuple[int, ...], out_root: Path, label: str, progress: bool = True
) -> tuple[Path, dict]:
    """The alone pass, then one concurrent pass per client count; writes records and summary, returns (dir, summary)."""
    env = environment()
    identity = server_identity(endpoint)
    out_dir = Path(out_root) / f"{envinfo.record_stem(env)}-{envinfo.slug(label)}"
    out_dir.mkdir(parents=True, exist_ok=False)  # a run never overwrites another
    alone = alone_pass(endpoint, tasks)
    records: list[dict] = []
    per_clients: dict[str, dict] = {}
    for count in clients:
        pass_records, wall_s = concurrent_pass(endpoint, tasks, count, alone)
        records.extend(pass_records)
        per_clients[str(count)] = summarize_clients(pass_records, wall_s)
        if progress:
            row = per_clients[str(count)]
            print(
                f"[concurrency] {count:>2} clients: {row['requests']} requests, {row['requests_per_s']:.1f}/s, "
                f"P50 {row['latency']['p50_ms']:.1f} ms, P95 {row['latency']['p95_ms']:.1f} ms, "
                f"errors {row['errors']}, identical {row['identical_to_alone']}/{row['requests']}",
                file=sys.stderr,
            )
    summary = {
        "run": {
            "label": label,
            "endpoint": endpoint,
            "tasks": len(tasks),
            "answered_alone": len(alone),
            "clients": list(clients),
            "server": identity,
            "latency": "client wall clock per request: body encoding, a new connection, the server, reading, mapping",
        },
        "note": "synthetic weights: probabilities are compared only with the same task answered alone",
        "per_clients": per_clients,
        "targets": evaluate_targets(per_clients),
        "environment": env,
    }
    write_run(out_dir, records, summary)
    return out_dir, summary


def parse_clients(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients must be positive, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=None, help="server base URL (default: --serve-backend in this process)")
    parser.add_argument("--tasks", default=None, help="comma-separated JSONL files or tiers (default: easy,original)")
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks only")
    parser.add_argument("--clients", type=parse_clients, default=DEFAULT_CLIENTS, help="default 1,4,8,16")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--label", default=None, help="name of this run (default: the backend, or 'endpoint')")
    add_model_arguments(
        parser,
        backend_option="--serve-backend",
        backend_help="build the model and serve it in this process on a free port (instead of --endpoint)",
    )
    args = parser.parse_args(argv)
    if (args.backend is None) == (args.endpoint is None):
        parser.error("give exactly one of --endpoint and --serve-backend")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    tasks = load_tasks(args.tasks)[: args.limit]
    server = None
    if args.backend is not None:
        model = model_from_arguments(args)
        server = DecisionServer(model, port=0, queue_size=4 * max(args.clients), access_log=None).start()
    endpoint = args.endpoint or server.url
    try:
        out_dir, summary = run_concurrency(
            endpoint, tasks, clients=args.clients, out_root=args.out, label=args.label or args.backend or "endpoint"
        )
    finally:
        if server is not None:
            server.close()
    print(out_dir)
    return 0 if all(row["errors"] == 0 for row in summary["per_clients"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
