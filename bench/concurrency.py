"""Serving under concurrency: JevBench public tasks from 1, 4, 8 and 16 clients at once against one decision server.

    python -m bench.concurrency [--endpoint http://127.0.0.1:8791 | --serve-backend graphs [--shapes ...]
                                 | --serve-precomputed] [--clients 1,4,8,16 | --compare-batching [--blocks N]]
                                [--tasks easy,original] [--limit N] [--out results/serving] [--label NAME]

First the alone pass: every task once, one request at a time; it warms the server (the issue's "second pass" is every
pass after it) and gives each task's answer alone, the reference of every later answer. Then, per client count k, k
client threads each send every task once, client i starting at task i*n/k and wrapping around (so that at any moment the
clients ask for different tasks), each request on a new connection as JevBench connects, the next one as soon as the
last answered (`bench.jevbench.run_task`: built, sent, read and mapped as JevBench does). Per k: requests/s over the
wall clock from the first request sent to the last answer read, the client latency of every request (mean/P50/P95/max),
the statuses, and how many answers are bit-identical to the same task's answer alone (every probability the same float).
The server's own view, where it says (metadata.batch), is averaged: requests per forward.

Written under `--out/<utc>-<gpu or cpu>-<sha7>-<label>/`: `records.jsonl` (one row per request: clients, client,
task, status, latency, identical) and `summary.json` (per k, the targets of issue 15 evaluated at 8 clients against
1, and the environment); `python -m paper.figures` draws `serving-<device>.png` from the newest summary.

`--compare-batching` measures instead what the batcher costs one client (issue 15: "one client: P50 no more than 1 ms
above the same server without the batcher"). It serves the model from two servers in this process, `--batching off`
and `--batching on` (`DecisionWorker`), warms each with its own alone pass, then sends every task `--blocks` times to
both, one request at a time: per task the two requests back to back, which goes first alternating from task to task
and from block to block, so that drift of the machine falls on both modes alike. `summary.json` has, per mode, the
latency and how many answers are bit-identical to the task's answer alone from the batching server, and the P50
difference (on - off) with a 95% bootstrap interval over the (block, task) pairs and per block; no `per_clients`, so
the report's serving section (paper/serving.py) does not take it for a sweep. On a CPU that difference is the
batcher's host-side cost (the queue hand-off, gathering the queue, the batch join) beside the CPU's forward; what the
batcher costs on the GPU needs the same run there. `--serve-precomputed` serves `bench.overhead`'s precomputed
hidden states (no forward: the server's own time alone), which resolves that difference where a CPU forward's noise
would not.

With synthetic weights the probabilities are meaningless for accuracy; they are compared only with themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ablations import envinfo
from bench.jevbench import environment, load_tasks, run_task, server_identity, write_run
from bench.overhead import latency_stats, overhead_model
from engine.server import DecisionServer, add_model_arguments, default_shapes_name, model_from_arguments
from reference.data import REPO
from reference.service import DecisionModel
from reference.shapes import get_shapes

DEFAULT_OUT = REPO / "results" / "serving"
DEFAULT_CLIENTS = (1, 4, 8, 16)
# Issue 15, at 8 clients against 1 (H200, JevBench public tiers, with `graphs`).
TARGET_CLIENTS = 8
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_P50_RATIO = 2.0
# Issue 15, one client: P50 no more than this above the same server without the batcher (`--compare-batching`).
TARGET_BATCHER_P50_MS = 1.0
BATCHING_MODES = ("off", "on")
DEFAULT_BLOCKS = 6
BOOTSTRAP_RESAMPLES = 2000


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


def summarize_requests(records: list[dict]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for record in records:
        statuses[str(record["status"])] = statuses.get(str(record["status"]), 0) + 1
    batches = [record["batch"]["requests"] for record in records if record.get("batch")]
    return {
        "requests": len(records),
        "latency": latency_stats([record["latency_ms"] for record in records]),
        "status_counts": statuses,
        "errors": sum(record["status"] != 200 for record in records),
        "identical_to_alone": sum(record["identical"] for record in records),
        "mean_requests_per_forward": sum(batches) / len(batches) if batches else None,
    }


def summarize_clients(records: list[dict], wall_s: float) -> dict[str, Any]:
    return {"wall_s": wall_s, "requests_per_s": len(records) / wall_s, **summarize_requests(records)}


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


def comparison_pass(endpoints: dict[str, str], tasks: list[dict], blocks: int, alone: dict) -> list[dict]:
    """One client: `blocks` times every task to the server of each batching mode (`endpoints`), the two requests of a
    task back to back, the first one's mode alternating from task to task and from block to block."""
    records = []
    for block in range(blocks):
        for index, task in enumerate(tasks):
            first = (block + index) % 2
            for mode in (BATCHING_MODES[first], BATCHING_MODES[1 - first]):
                record = run_task(endpoints[mode], task, model="open-jev")
                probabilities = record["probabilities"]
                records.append({
                    "block": block,
                    "batching": mode,
                    "id": task["id"],
                    "status": record["status"],
                    "latency_ms": record["latency_ms"],
                    "error": record["error"],
                    "backend": record["server"]["backend"] if record["server"] else None,
                    "batch": record["server"]["batch"] if record["server"] else None,
                    "identical": probabilities is not None and probabilities == alone.get(task["id"]),
                })  # fmt: skip
    return records


def p50_difference(records: list[dict]) -> float:
    """P50 of the batching server's latencies minus P50 of the other's, in ms."""
    on, off = ([r["latency_ms"] for r in records if r["batching"] == mode] for mode in ("on", "off"))
    return float(np.percentile(on, 50) - np.percentile(off, 50))


def summarize_comparison(records: list[dict], blocks: int, *, seed: int = 0) -> dict[str, Any]:
    """Per mode the requests' summary; the P50 difference (on - off), its 95% bootstrap interval (the (block, task)
    pairs resampled, so each resample keeps a task's two requests together) and its value per block."""
    pairs: dict[tuple[int, str], dict[str, float]] = {}
    for record in records:
        pairs.setdefault((record["block"], record["id"]), {})[record["batching"]] = record["latency_ms"]
    on, off = (np.array([pair[mode] for pair in pairs.values()]) for mode in ("on", "off"))
    resampled = np.random.default_rng(seed).integers(0, len(pairs), size=(BOOTSTRAP_RESAMPLES, len(pairs)))
    differences = np.percentile(on[resampled], 50, axis=1) - np.percentile(off[resampled], 50, axis=1)
    difference = p50_difference(records)
    return {
        "clients": 1,
        "blocks": blocks,
        "backends": sorted({record["backend"] for record in records if record["backend"]}),
        "per_mode": {
            mode: summarize_requests([r for r in records if r["batching"] == mode]) for mode in BATCHING_MODES
        },
        "p50_difference_ms": difference,
        "p50_difference_interval_ms": [float(bound) for bound in np.percentile(differences, [2.5, 97.5])],
        "interval": f"95% bootstrap over the {len(pairs)} (block, task) pairs, {BOOTSTRAP_RESAMPLES} resamples",
        "per_block_p50_difference_ms": [
            p50_difference([r for r in records if r["block"] == block]) for block in range(blocks)
        ],
        "target_p50_difference_ms": TARGET_BATCHER_P50_MS,
        "target_met": difference <= TARGET_BATCHER_P50_MS,
    }


def run_comparison(
    endpoints: dict[str, str], tasks: list[dict], *, blocks: int, out_root: Path, label: str, progress: bool = True
) -> tuple[Path, dict]:
    """An alone pass per mode (it warms that server), then the comparison pass; writes records and summary, returns
    (dir, summary)."""
    env = environment()
    identity = server_identity(endpoints["on"])
    out_dir = Path(out_root) / f"{envinfo.record_stem(env)}-{envinfo.slug(label)}"
    out_dir.mkdir(parents=True, exist_ok=False)  # a run never overwrites another
    alone = {mode: alone_pass(endpoints[mode], tasks) for mode in BATCHING_MODES}
    records = comparison_pass(endpoints, tasks, blocks, alone["on"])
    comparison = summarize_comparison(records, blocks)
    if progress:
        latency = {mode: comparison["per_mode"][mode]["latency"]["p50_ms"] for mode in BATCHING_MODES}
        low, high = comparison["p50_difference_interval_ms"]
        print(
            f"[concurrency] 1 client, {len(records) // 2} requests per mode: P50 batching off {latency['off']:.3f} ms, "
            f"on {latency['on']:.3f} ms, difference {comparison['p50_difference_ms']:+.3f} ms "
            f"(95% {low:+.3f} .. {high:+.3f})",
            file=sys.stderr,
        )
    device_note = (
        ""
        if env["gpu"]
        else "; CPU run: the difference is the batcher's host-side cost on this CPU (queue hand-off, gathering the "
        "queue, the batch join); what the batcher costs one client on the GPU is not measured by this record"
    )
    summary = {
        "run": {
            "label": label,
            "endpoints": endpoints,
            "tasks": len(tasks),
            "answered_alone": {mode: len(alone[mode]) for mode in BATCHING_MODES},
            "alone_identical_across_modes": sum(
                alone["off"].get(task_id) == probabilities for task_id, probabilities in alone["on"].items()
            ),
            "server": identity,
            "order": "per task both modes back to back, the first alternating from task to task and block to block",
            "latency": "client wall clock per request: body encoding, a new connection, the server, reading, mapping",
        },
        "note": "synthetic weights: probabilities are compared only with the same task answered alone" + device_note,
        "batching_comparison": comparison,
        "environment": env,
    }
    write_run(out_dir, records, summary)
    return out_dir, summary


def served_model(args: argparse.Namespace) -> DecisionModel:
    """The model the in-process servers serve: precomputed hidden states or a `--serve-backend` model."""
    if args.serve_precomputed:
        return overhead_model(get_shapes(args.shapes or default_shapes_name()))
    return model_from_arguments(args)


def parse_clients(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients must be positive, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.concurrency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", default=None, help="server base URL (default: --serve-backend in this process)")
    parser.add_argument("--tasks", default=None, help="comma-separated JSONL files or tiers (default: easy,original)")
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks only")
    parser.add_argument("--clients", type=parse_clients, default=None, help="default 1,4,8,16")
    parser.add_argument(
        "--compare-batching",
        action="store_true",
        help="one client against two in-process servers of the model, --batching off and on, alternating (module "
        "docstring); instead of the --clients sweep",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=DEFAULT_BLOCKS,
        help=f"--compare-batching: passes over the tasks (default {DEFAULT_BLOCKS})",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--label", default=None, help="name of this run (default: the backend, 'precomputed', or 'endpoint')"
    )
    parser.add_argument(
        "--serve-precomputed",
        action="store_true",
        help="serve bench.overhead's precomputed hidden states in this process (no forward: the server's own time)",
    )
    add_model_arguments(
        parser,
        backend_option="--serve-backend",
        backend_help="build the model and serve it in this process on a free port (instead of --endpoint)",
    )
    args = parser.parse_args(argv)
    if [args.endpoint is not None, args.backend is not None, args.serve_precomputed].count(True) != 1:
        parser.error("give exactly one of --endpoint, --serve-backend and --serve-precomputed")
    if args.compare_batching and args.endpoint is not None:
        parser.error("--compare-batching starts its own two servers: give --serve-backend or --serve-precomputed")
    if args.compare_batching and args.clients is not None:
        parser.error("--compare-batching runs one client; --clients is the sweep's")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.blocks < 1:
        parser.error("--blocks must be >= 1")
    tasks = load_tasks(args.tasks)[: args.limit]
    label = args.label or args.backend or ("precomputed" if args.serve_precomputed else "endpoint")
    if args.compare_batching:
        model = served_model(args)
        with contextlib.ExitStack() as servers:
            endpoints = {}
            for mode in BATCHING_MODES:
                server = servers.enter_context(DecisionServer(model, port=0, access_log=None, batching=mode == "on"))
                endpoints[mode] = server.start().url
            out_dir, summary = run_comparison(endpoints, tasks, blocks=args.blocks, out_root=args.out, label=label)
        print(out_dir)
        return 0 if all(row["errors"] == 0 for row in summary["batching_comparison"]["per_mode"].values()) else 1
    clients = args.clients or DEFAULT_CLIENTS
    server = None
    if args.endpoint is None:
        server = DecisionServer(served_model(args), port=0, queue_size=4 * max(clients), access_log=None).start()
    endpoint = args.endpoint or server.url
    try:
        out_dir, summary = run_concurrency(endpoint, tasks, clients=clients, out_root=args.out, label=label)
    finally:
        if server is not None:
            server.close()
    print(out_dir)
    return 0 if all(row["errors"] == 0 for row in summary["per_clients"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
