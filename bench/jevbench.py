"""JevBench runner: the public tasks against a decision server, as JevBench's TypeSafe adapter drives it.

    python -m bench.jevbench [--endpoint http://127.0.0.1:8791 | --serve-backend hf_fla [--shapes ...]]
                             [--tasks easy,original | a.jsonl,b.jsonl] [--passes 2] [--out results/jevbench]
                             [--reference RUN_DIR_OR_RECORDS] [--label NAME]

Each task is one request to `{endpoint}/v1/systemone`: `{"model", "state", "questions": {"decision": question}}`, on a
new connection, one task at a time, no retries (contract §11.2). The latency is the client's wall clock around the
whole task: encoding, connecting, the server's work, reading and mapping the answer (§11.3). Answers map back to the
task's labels as the adapter does (noul `{"no": 1 - p, "yes": p}`, choice the returned `probabilities`, score the
levels `"0".."n-1"`) and are scored by `score_task` (§11.4). Like JevBench's runner, a 422 counts as a wrong answer,
a 401/403/429 or three failures in a row stop the run.

Written under `--out/<utc>-<gpu or cpu>-<sha7>-<label>/`: `records.jsonl` (one row per pass and task: latency,
status, prediction, probabilities, score) and `summary.json` (per pass: latency mean/P50/P95/max, server-side
inference time, schema validity; accuracy only when the server reports real weights; with `--reference`, argmax
agreement and max |dp| against that run; plus the environment from `ablations.envinfo`). With synthetic weights
every probability is meaningless for accuracy: such a run is compared with a reference run, never scored for accuracy.

`--serve-backend` builds the model and starts the server in this process on a free local port first, so one command on
the H200 gives a run (`python -m bench.jevbench --serve-backend hf_fla --max-length 16384`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from ablations import envinfo
from bench.overhead import latency_stats, measure_overhead
from engine.server import DecisionServer, add_model_arguments, model_from_arguments
from reference.data import REPO, jevbench_tasks
from reference.shapes import get_shapes

DEFAULT_ENDPOINT = "http://127.0.0.1:8791"
DEFAULT_OUT = REPO / "results" / "jevbench"
DEFAULT_OVERHEAD_OUT = REPO / "results" / "server" / "overhead.json"
ENDPOINT_PATH = "/v1/systemone"
QUESTION_ID = "decision"
STRICT_SUM_TOLERANCE = 1e-3  # |sum - 1| for a strictly valid distribution
HEADLINE_SUM_TOLERANCE = 2e-2  # |sum - 1| for a valid one (renormalised)
LEAK_KEYS = frozenset({"expected", "label", "ground_truth", "answer_key"})
STOP_STATUSES = frozenset({401, 403, 429})
MAX_CONSECUTIVE_FAILURES = 3
REQUEST_TIMEOUT_S = 300.0


class RunStopped(Exception):
    """The runner's stop rules fired (401/403/429, or three failures in a row)."""


# ---- tasks ---------------------------------------------------------------------------------------------------------


def _leaked_keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return (LEAK_KEYS & set(value)) | {key for item in value.values() for key in _leaked_keys(item)}
    if isinstance(value, list):
        return {key for item in value for key in _leaked_keys(item)}
    return set()


def check_task(task: dict) -> None:
    """Refuse a malformed task row or a state that carries its answer (JevBench's loader rules)."""
    for field in ("id", "state", "question", "labels", "expected"):
        if field not in task:
            raise ValueError(f"task {task.get('id')!r} has no {field!r}")
    leaked = _leaked_keys(task["state"])
    if leaked:
        raise ValueError(f"task {task['id']!r}: the state holds answer keys {sorted(leaked)}")
    if str(task["expected"]) not in [str(label) for label in task["labels"]]:
        raise ValueError(f"task {task['id']!r}: expected {task['expected']!r} is not one of its labels")


def load_tasks(spec: str | None) -> list[dict]:
    """Tasks from comma-separated JSONL paths or tier names (`easy`, `original`); default the easy + original tiers."""
    if spec is None:
        tasks = jevbench_tasks()
    else:
        tasks = []
        for item in (part.strip() for part in spec.split(",") if part.strip()):
            path = Path(item)
            if path.is_file():
                tasks += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            else:
                tasks += jevbench_tasks((item,))
    ids = [task.get("id") for task in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids are not unique")
    for task in tasks:
        check_task(task)
    return tasks


def tier_of(task: dict) -> str:
    return str(task["id"]).split("-", 1)[0]


def build_question(task: dict) -> dict:
    """The task's single question: type, instructions and (when present) criteria, in the stored order."""
    question = task["question"]
    built = {"type": question["type"], "instructions": question["instructions"]}
    if question.get("criteria") is not None:
        built["criteria"] = question["criteria"]
    return built


def request_body(task: dict, model: str | None) -> dict:
    body: dict[str, Any] = {"model": model} if model is not None else {}
    body["state"] = task["state"]
    body["questions"] = {QUESTION_ID: build_question(task)}
    return body


def probabilities_from_answer(task: dict, answer: Any) -> dict[str, float]:
    """The adapter's mapping of the server's answer to a distribution over the task's labels."""
    kind = task["question"]["type"]
    if not isinstance(answer, dict) or answer.get("type") != kind:
        raise ValueError(f"answer is not a {kind} answer")
    if kind == "noul":
        p_yes = answer.get("noul")
        if isinstance(p_yes, bool) or not isinstance(p_yes, (int, float)):
            raise ValueError("noul answer has no numeric 'noul'")
        return {"no": 1.0 - p_yes, "yes": p_yes}
    probabilities = answer.get("probabilities")
    if not isinstance(probabilities, dict):
        raise ValueError(f"{kind} answer has no 'probabilities' object")
    return dict(probabilities)


# ---- scoring -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """One task's score (JevBench `score_task`): validity, the (renormalised) distribution, the argmax, correctness."""

    valid: bool  # |sum - 1| <= 2e-2 (headline): the answer is scored
    strict_valid: bool  # |sum - 1| <= 1e-3
    renormalized: bool  # valid but not strictly: divided by its sum
    probs: dict[str, float] | None  # None when invalid
    predicted: str | None  # argmax label, ties to the lexicographically smallest
    correct: bool
    ordinal_ev: float | None  # score tasks: sum_i i * p_i
    reason: str | None  # why invalid


def argmax_label(probs: dict[str, float]) -> str:
    """The label with the highest probability; ties go to the lexicographically smallest label."""
    return min(probs, key=lambda label: (-probs[label], label))


def _invalid(reason: str) -> Score:
    return Score(False, False, False, None, None, False, None, reason)


def score_task(probs: Any, task: dict) -> Score:
    """Score a distribution over the task's labels.

    Keys must equal the label set; values real (not bool), finite and in [0, 1]. Strictly valid when
    |sum - 1| <= 1e-3; valid (headline) when |sum - 1| <= 2e-2, renormalised if not strictly valid; otherwise invalid
    and wrong. The prediction is the argmax, ties going to the lexicographically smallest label, and is compared with
    `str(expected)` (score tasks: the argmax level, never the rounded mean; `ordinal_ev` is recorded beside it).
    """
    labels = [str(label) for label in task["labels"]]
    if not isinstance(probs, dict) or set(probs) != set(labels):
        got = sorted(map(str, probs)) if isinstance(probs, dict) else type(probs).__name__
        return _invalid(f"probability keys {got} differ from the labels {sorted(labels)}")
    for label in labels:
        value = probs[label]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _invalid(f"probability of {label!r} is not a real number")
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            return _invalid(f"probability of {label!r} is {value}, outside [0, 1]")
    total = math.fsum(float(probs[label]) for label in labels)
    deviation = abs(total - 1.0)
    if deviation > HEADLINE_SUM_TOLERANCE:
        return _invalid(f"probabilities sum to {total:.6g}")
    strict_valid = deviation <= STRICT_SUM_TOLERANCE
    scored = {label: float(probs[label]) if strict_valid else float(probs[label]) / total for label in labels}
    predicted = argmax_label(scored)
    ordinal_ev = None
    if task["question"]["type"] == "score":
        ordinal_ev = math.fsum(int(label) * p for label, p in scored.items())
    correct = predicted == str(task["expected"])
    return Score(True, strict_valid, not strict_valid, scored, predicted, correct, ordinal_ev, None)


# ---- one task over HTTP --------------------------------------------------------------------------------------------


def post_json(endpoint: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    """POST a JSON body to `{endpoint}/v1/systemone` on a new connection; (status, parsed JSON or raw text)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"endpoint must be an http:// URL, got {endpoint!r}")
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
        connection.request(
            "POST", parts.path.rstrip("/") + ENDPOINT_PATH, payload, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode("utf-8", "replace")


def server_fields(response: dict) -> dict:
    """What the response says about how it was made (contract §3 metadata, plus this project's backend flags)."""
    metadata = response["metadata"]
    return {
        "inference_ms": 1e3 * metadata["inference_seconds"],
        "input_tokens": response["usage"]["input_tokens"],
        "candidate_sequences": metadata["candidate_sequences"],
        # This project's servers say so; another Open-Jev server does not, and only its method can tell.
        "synthetic_weights": metadata.get("synthetic_weights", metadata["method"] == "synthetic_weights"),
        "backend": metadata.get("backend"),
        "graph": metadata.get("graph"),  # a `graphs` server: the bucket and whether a graph served the request
        "batch": metadata.get("batch"),  # answered by a forward shared with other requests: how many
        "model": response["model"],
        "method": metadata["method"],
    }


def run_task(endpoint: str, task: dict, *, model: str | None, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    """One task, timed on the client from building the body to the mapped distribution; a record for records.jsonl."""
    record: dict[str, Any] = {
        "id": task["id"],
        "tier": tier_of(task),
        "family": task.get("family"),
        "type": task["question"]["type"],
        "labels": [str(label) for label in task["labels"]],
        "expected": str(task["expected"]),
    }
    status: int | None = None
    response: Any = None
    probabilities = server = error = None
    start = time.perf_counter()
    try:
        status, response = post_json(endpoint, request_body(task, model), timeout_s)
        if status == 200:
            probabilities = probabilities_from_answer(task, response["answers"][QUESTION_ID])
            server = server_fields(response)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as failure:
        probabilities, error = None, f"{type(failure).__name__}: {failure}"
    latency_s = time.perf_counter() - start
    if error is None and status != 200:
        error = response.get("error") if isinstance(response, dict) else str(response)[:200]
    record.update(status=status, latency_ms=1e3 * latency_s, error=error, probabilities=probabilities, server=server)
    score = score_task(probabilities, task) if probabilities is not None else _invalid(error or "no answer")
    record["score"] = {
        "valid": score.valid,
        "strict_valid": score.strict_valid,
        "renormalized": score.renormalized,
        "predicted": score.predicted,
        "correct": score.correct,
        "ordinal_ev": score.ordinal_ev,
        "reason": score.reason,
    }
    return record


def run_passes(
    endpoint: str, tasks: list[dict], *, passes: int, model: str | None, progress: bool = False
) -> tuple[list[dict], str | None]:
    """Every task once per pass, in order, one at a time. Returns the records and why the run stopped (or None)."""
    records: list[dict] = []
    failures_in_a_row = 0
    for pass_index in range(1, passes + 1):
        for number, task in enumerate(tasks, 1):
            record = {"pass": pass_index, **run_task(endpoint, task, model=model)}
            records.append(record)
            if progress:
                print(
                    f"[jevbench] pass {pass_index} {number}/{len(tasks)} {task['id']}: {record['status']} "
                    f"{record['latency_ms']:.1f} ms",
                    file=sys.stderr,
                )
            if record["status"] in STOP_STATUSES:
                return records, f"status {record['status']} on {task['id']}"
            failed = record["status"] != 422 and record["probabilities"] is None  # a 422 is a wrong answer
            failures_in_a_row = failures_in_a_row + 1 if failed else 0
            if failures_in_a_row >= MAX_CONSECUTIVE_FAILURES:
                return records, f"{MAX_CONSECUTIVE_FAILURES} failures in a row, the last on {task['id']}"
    return records, None


# ---- summary -------------------------------------------------------------------------------------------------------


def load_reference(path: str | Path) -> dict[str, dict[str, float]]:
    """Per-task distributions of a previous run (its directory or records.jsonl), from its last pass."""
    path = Path(path)
    if path.is_dir():
        path = path / "records.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last_pass = max(row["pass"] for row in rows)
    return {row["id"]: row["probabilities"] for row in rows if row["pass"] == last_pass and row["probabilities"]}


def agreement(records: list[dict], reference: dict[str, dict[str, float]]) -> dict:
    """Argmax agreement and max |dp| against a reference run, over the tasks both answered."""
    compared, agreed, max_dp, max_dp_task, disagreements = 0, 0, 0.0, None, []
    for record in records:
        theirs, ours = reference.get(record["id"]), record["probabilities"]
        if theirs is None or ours is None:
            continue
        if set(theirs) != set(ours):
            raise ValueError(f"task {record['id']}: the reference has labels {sorted(theirs)}, this run {sorted(ours)}")
        compared += 1
        if argmax_label(ours) == argmax_label(theirs):
            agreed += 1
        else:
            disagreements.append(record["id"])
        dp = max(abs(float(ours[label]) - float(theirs[label])) for label in ours)
        if dp > max_dp:
            max_dp, max_dp_task = dp, record["id"]
    return {
        "compared": compared,
        "argmax_agreement": agreed,
        "disagreements": disagreements,
        "max_abs_dp": max_dp,
        "max_abs_dp_task": max_dp_task,
    }


def summarize_pass(records: list[dict], *, real_weights: bool, reference: dict | None) -> dict:
    answered = [r for r in records if r["status"] == 200 and r["probabilities"] is not None]
    summary: dict[str, Any] = {
        "tasks": len(records),
        "answered": len(answered),
        "status_counts": {
            str(s): sum(r["status"] == s for r in records) for s in sorted({r["status"] for r in records}, key=str)
        },
        "schema_valid": sum(r["score"]["valid"] for r in records),
        "schema_strict_valid": sum(r["score"]["strict_valid"] for r in records),
        "latency": latency_stats([r["latency_ms"] for r in records]),
        "server_inference": latency_stats([r["server"]["inference_ms"] for r in answered]),
    }
    graphs = [r["server"]["graph"] for r in answered if r["server"].get("graph") is not None]
    if graphs:  # a `graphs` server: how many requests a captured graph served
        summary["graph_hits"] = sum(bool(g["hit"]) for g in graphs)
        summary["graph_misses"] = len(graphs) - summary["graph_hits"]
    if real_weights:
        summary["correct"] = sum(r["score"]["correct"] for r in records)
        summary["accuracy"] = summary["correct"] / len(records) if records else None
        summary["correct_by_tier"] = {
            tier: f"{sum(r['score']['correct'] for r in records if r['tier'] == tier)}/"
            f"{sum(r['tier'] == tier for r in records)}"
            for tier in sorted({r["tier"] for r in records})
        }
    if reference is not None:
        summary["agreement"] = agreement(records, reference)
    return summary


def summarize(
    records: list[dict], *, reference: dict | None, stopped: str | None, run: dict, environment_record: dict
) -> dict:
    """The run's summary: per pass latency and validity; accuracy only with real weights; agreement when asked."""
    synthetic = {r["server"]["synthetic_weights"] for r in records if r["server"] is not None}
    real_weights = synthetic == {False}
    passes = sorted({r["pass"] for r in records})
    return {
        "run": run,
        "stopped": stopped,
        "weights": "real" if real_weights else "synthetic" if synthetic == {True} else "unknown",
        "note": None
        if real_weights
        else "synthetic weights: probabilities are meaningless for accuracy; compare with a reference run instead",
        "passes": {
            str(p): summarize_pass(
                [r for r in records if r["pass"] == p], real_weights=real_weights, reference=reference
            )
            for p in passes
        },
        "environment": environment_record,
    }


def write_run(out_dir: Path, records: list[dict], summary: dict) -> None:
    with open(out_dir / "records.jsonl", "w") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def server_identity(endpoint: str) -> dict:
    """`/health` and `/v1/models` of the server, on their own connections, before the clock starts."""
    parts = urlsplit(endpoint)
    identity = {}
    for path in ("/health", "/v1/models"):
        connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
        try:
            connection.request("GET", parts.path.rstrip("/") + path)
            response = connection.getresponse()
            identity[path] = json.loads(response.read())
        finally:
            connection.close()
    return identity


def run_benchmark(
    endpoint: str,
    tasks: list[dict],
    *,
    passes: int,
    out_root: Path,
    label: str,
    model: str | None = "open-jev",
    reference: str | Path | None = None,
    progress: bool = False,
) -> tuple[Path, dict]:
    """Run every pass, write records and summary under `out_root/<utc>-<gpu or cpu>-<sha7>-<label>/`; returns
    (dir, summary)."""
    env = environment()
    identity = server_identity(endpoint)
    reference_probs = load_reference(reference) if reference is not None else None
    out_dir = Path(out_root) / f"{envinfo.record_stem(env)}-{envinfo.slug(label)}"
    out_dir.mkdir(parents=True, exist_ok=False)  # a run never overwrites another
    records, stopped = run_passes(endpoint, tasks, passes=passes, model=model, progress=progress)
    run = {
        "label": label,
        "endpoint": endpoint,
        "model_field": model,
        "passes": passes,
        "tasks": len(tasks),
        "task_tiers": sorted({tier_of(task) for task in tasks}),
        "server": identity,
        "reference": str(reference) if reference is not None else None,
        "latency": "client wall clock per task: body encoding, a new connection, the server, reading, mapping",
    }
    summary = summarize(records, reference=reference_probs, stopped=stopped, run=run, environment_record=env)
    write_run(out_dir, records, summary)
    return out_dir, summary


def environment() -> dict:
    """The machine and code of this run (ablations.envinfo): git commit, GPU, versions, UTC time."""
    return envinfo.collect("cuda" if torch.cuda.is_available() else "cpu")


def record_overhead(tasks: list[dict], *, shapes_name: str, rounds: int, out: Path) -> dict:
    """Measure the server overhead (`bench.overhead`) on the JevBench bodies; write it with the environment."""

    bodies = [request_body(task, "open-jev") for task in tasks]
    result = measure_overhead(bodies, shapes=get_shapes(shapes_name), rounds=rounds)
    result["task_tiers"] = sorted({tier_of(task) for task in tasks})
    result["environment"] = environment()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.jevbench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", default=None, help=f"server base URL (default {DEFAULT_ENDPOINT})")
    parser.add_argument("--tasks", default=None, help="comma-separated JSONL files or tiers (default: easy,original)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--reference", default=None, help="a previous run (dir or records.jsonl) to compare with")
    parser.add_argument("--label", default=None, help="name of this run (default: the backend, or 'endpoint')")
    parser.add_argument("--model", default="open-jev", help="the request's model field (JevBench passes open-jev)")
    parser.add_argument(
        "--overhead",
        type=Path,
        nargs="?",
        const=DEFAULT_OVERHEAD_OUT,
        default=None,
        help=f"instead of a run: measure the server overhead without a forward, write it here "
        f"(default {DEFAULT_OVERHEAD_OUT.relative_to(REPO)}); --shapes sets the head width",
    )
    parser.add_argument("--rounds", type=int, default=5, help="with --overhead: timed rounds over the tasks")
    add_model_arguments(
        parser,
        backend_option="--serve-backend",
        backend_help="build the model and serve it in this process on a free port (instead of --endpoint)",
    )
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes must be >= 1")
    if args.backend is not None and args.endpoint is not None:
        parser.error("--endpoint and --serve-backend exclude each other")

    tasks = load_tasks(args.tasks)
    if args.overhead is not None:
        result = record_overhead(tasks, shapes_name=args.shapes or "qwen3.8-27b", rounds=args.rounds, out=args.overhead)
        keys = ("http", "floor", "ratio_to_floor", "transport_ratio", "work_ratio", "decide", "meets_target")
        print(json.dumps({key: result[key] for key in keys}, indent=2))
        return 0 if result["meets_target"] else 1
    server = None
    if args.backend is not None:
        server = DecisionServer(model_from_arguments(args), host="127.0.0.1", port=0).start()
        endpoint, label = server.url, args.label or args.backend
    else:
        endpoint, label = args.endpoint or DEFAULT_ENDPOINT, args.label or "endpoint"
    try:
        out_dir, summary = run_benchmark(
            endpoint,
            tasks,
            passes=args.passes,
            out_root=args.out,
            label=label,
            model=args.model,
            reference=args.reference,
            progress=True,
        )
    finally:
        if server is not None:
            server.close()
    print(json.dumps({"out": str(out_dir), "stopped": summary["stopped"], "passes": summary["passes"]}, indent=2))
    return 1 if summary["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
