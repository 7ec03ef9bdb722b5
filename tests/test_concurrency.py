"""The concurrency runner (bench/concurrency.py: the client sweep and the batching comparison) and the report's
serving section (paper/serving.py), on the CPU against servers without a forward (bench.overhead's precomputed
hidden states: fast, synthetic answers)."""

from __future__ import annotations

import io
import json

import pytest

from bench import concurrency
from bench.overhead import overhead_model
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
    figure = root / "figures" / "serving-cpu.png"
    figure.unlink(missing_ok=True)
    (section,) = serving.serving_summary(root)
    assert section["record"] == f"serving/{out_dir.name}" and "CPU" in section["label"]
    assert not figure.exists()  # the summary only reads; the figure is drawn by draw_serving_figures
    assert serving.draw_serving_figures(root) == [figure] and root / section["figure"].lstrip("/") == figure
    assert figure.stat().st_size > 10_000
    header, *rows = section["table"]
    assert header[0] == "clients" and [r[0] for r in rows] == ["1", "3", "8"]
    assert rows[0][3] == "1.00x" and all(r[6] == "0" for r in rows)
    assert "At 8 clients" in section["targets"] and "bit-identical" in section["targets"]


def test_serving_section_without_runs_is_empty(tmp_path):
    assert serving.serving_summary(tmp_path) == []


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    argv = ["--serve-precomputed", "--compare-batching", "--limit", "3", "--blocks", "2", "--label", "compare"]
    assert concurrency.main([*argv, "--out", str(root / "serving")]) == 0
    (out_dir,) = (root / "serving").iterdir()
    return out_dir, json.loads((out_dir / "summary.json").read_text()), jevbench_tasks()[:3]


def test_batching_comparison_sends_each_task_to_both_modes_alternating_and_they_answer_alike(comparison):
    out_dir, summary, tasks = comparison
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * len(tasks)
    pairs = [records[k : k + 2] for k in range(0, len(records), 2)]
    for number, (first, second) in enumerate(pairs):  # a task's two requests back to back, the first mode alternating
        block, index = divmod(number, len(tasks))
        assert first["id"] == second["id"] == tasks[index]["id"] and first["block"] == second["block"] == block
        assert [first["batching"], second["batching"]] == (["off", "on"] if (block + index) % 2 == 0 else ["on", "off"])
    assert all(r["status"] == 200 and r["identical"] and r["batch"] is None for r in records)
    assert (
        summary["run"]["answered_alone"] == {"off": 3, "on": 3} and summary["run"]["alone_identical_across_modes"] == 3
    )
    result = summary["batching_comparison"]
    assert result["clients"] == 1 and result["blocks"] == 2 and result["backends"] == ["precomputed"]
    for mode in ("off", "on"):
        row = result["per_mode"][mode]
        assert row["requests"] == row["identical_to_alone"] == 2 * len(tasks) and row["errors"] == 0
    p50 = {mode: result["per_mode"][mode]["latency"]["p50_ms"] for mode in ("off", "on")}
    assert result["p50_difference_ms"] == pytest.approx(p50["on"] - p50["off"])
    low, high = result["p50_difference_interval_ms"]
    assert low <= high and len(result["per_block_p50_difference_ms"]) == 2
    assert result["target_met"] == (result["p50_difference_ms"] <= 1.0)
    assert "per_clients" not in summary
    assert ("not measured" in summary["note"]) == (not summary["environment"]["gpu"])  # a CPU run says so


def test_serving_section_takes_the_newest_sweep_not_a_batching_comparison(run, comparison, tmp_path):
    _, sweep_dir, _, _ = run
    _, compare_summary, _ = comparison
    (tmp_path / "serving" / "sweep").mkdir(parents=True)
    (tmp_path / "serving" / "sweep" / "summary.json").write_text((sweep_dir / "summary.json").read_text())
    (tmp_path / "serving" / "compare").mkdir()
    newer = {**compare_summary, "environment": {**compare_summary["environment"], "utc": "2999-01-01T00:00:00Z"}}
    (tmp_path / "serving" / "compare" / "summary.json").write_text(json.dumps(newer))
    (section,) = serving.serving_summary(tmp_path)
    assert section["record"] == "serving/sweep"


def test_compare_batching_refuses_an_endpoint_and_a_clients_sweep():
    for argv in (
        ["--endpoint", "http://127.0.0.1:1", "--compare-batching"],
        ["--serve-precomputed", "--compare-batching", "--clients", "1"],
    ):
        with pytest.raises(SystemExit):
            concurrency.main(argv)
