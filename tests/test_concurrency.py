"""The concurrency runner (ablations/concurrency.py) and the report's serving section (paper/serving.py), on the CPU
against a server without a forward (ablations.overhead's precomputed hidden states: fast, synthetic answers)."""

from __future__ import annotations

import io
import json

import pytest

from ablations import concurrency
from ablations.overhead import overhead_model
from engine.server import DecisionServer
from paper import serving
from reference.data import jevbench_tasks
from reference.shapes import TINY


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tasks = jevbench_tasks()[:5]
    root = tmp_path_factory.mktemp("results")
    with DecisionServer(overhead_model(TINY), port=0, access_log=io.StringIO()) as server:
        server.start()
        out_dir, summary = concurrency.run_concurrency(
            server.url, tasks, clients=(1, 3, 8), out_root=root / "serving", label="precomputed", progress=False
        )
    return root, out_dir, summary, tasks


def test_every_client_sends_every_task_once_and_every_answer_matches_alone(run):
    _, out_dir, summary, tasks = run
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines()]
    assert summary["run"]["answered_alone"] == len(tasks)
    for clients in (1, 3, 8):
        rows = [r for r in records if r["clients"] == clients]
        assert len(rows) == clients * len(tasks)
        for client in range(clients):  # each client asked for every task once, from its own offset
            asked = [r["id"] for r in rows if r["client"] == client]
            assert sorted(asked) == sorted(t["id"] for t in tasks)
            assert asked[0] == tasks[client * len(tasks) // clients]["id"]
        row = summary["per_clients"][str(clients)]
        assert row["requests"] == len(rows) and row["errors"] == 0 and row["status_counts"] == {"200": len(rows)}
        assert row["identical_to_alone"] == len(rows)
        assert row["requests_per_s"] == pytest.approx(row["requests"] / row["wall_s"])
        assert 0 < row["latency"]["p50_ms"] <= row["latency"]["p95_ms"] <= row["latency"]["max_ms"]
    targets = summary["targets"]
    assert targets["clients"] == 8 and targets["errors"] == 0 and targets["all_identical"]
    one, eight = summary["per_clients"]["1"], summary["per_clients"]["8"]
    assert targets["throughput_ratio"] == pytest.approx(eight["requests_per_s"] / one["requests_per_s"])
    assert targets["throughput_met"] == (targets["throughput_ratio"] >= 3.0)


def test_an_answer_that_differs_from_alone_is_counted():
    task = jevbench_tasks()[0]
    alone = {task["id"]: {"yes": 0.25, "no": 0.75}}
    with DecisionServer(overhead_model(TINY), port=0, access_log=io.StringIO()) as server:
        server.start()
        records, _ = concurrency.concurrent_pass(server.url, [task], 2, alone)
    assert [r["identical"] for r in records] == [False, False] and [r["status"] for r in records] == [200, 200]


def test_targets_need_one_and_eight_clients():
    row = {"requests_per_s": 10.0, "latency": {"p50_ms": 5.0}, "errors": 0, "identical_to_alone": 4, "requests": 4}
    assert concurrency.evaluate_targets({"1": row}) is None
    many = {**row, "requests_per_s": 31.0, "latency": {"p50_ms": 10.5}}
    result = concurrency.evaluate_targets({"1": row, "8": many})
    assert result["throughput_met"] and not result["p50_met"] and result["all_identical"]


def test_clients_option_refuses_nonsense():
    assert concurrency.parse_clients("1,4,16") == (1, 4, 16)
    for text in ("", "0,4", "a", "-1"):
        with pytest.raises(Exception, match="--clients"):
            concurrency.parse_clients(text)


def test_serving_section_shows_the_newest_run_per_device_with_its_figure(run):
    root, out_dir, summary, _ = run
    older = root / "serving" / "older-cpu-run"
    older.mkdir()
    stale = json.loads((out_dir / "summary.json").read_text())
    stale["environment"]["utc"] = "2000-01-01T00:00:00Z"
    (older / "summary.json").write_text(json.dumps(stale))
    (section,) = serving.serving_summary(root)
    assert section["record"] == f"serving/{out_dir.name}" and "CPU" in section["label"]
    assert (root / section["figure"].lstrip("/")).stat().st_size > 10_000
    header, *rows = section["table"]
    assert header[0] == "clients" and [r[0] for r in rows] == ["1", "3", "8"]
    assert rows[0][3] == "1.00x" and all(r[6] == "0" for r in rows)
    assert "At 8 clients" in section["targets"] and "bit-identical" in section["targets"]


def test_serving_section_without_runs_is_empty(tmp_path):
    assert serving.serving_summary(tmp_path) == []
