"""The JevBench runner: JevBench's scoring rules, the adapter's request and answer mapping, the stop rules, and a real
run against the tiny twin over HTTP (synthetic weights: agreement with a reference run is reported, never accuracy)."""

from __future__ import annotations

import json
import math

import pytest

import bench.jevbench as jevbench
from bench.jevbench import (
    agreement,
    build_question,
    check_task,
    load_tasks,
    probabilities_from_answer,
    request_body,
    run_benchmark,
    run_passes,
    score_task,
    summarize_pass,
)
from engine.server import DecisionServer
from reference.service import default_model


def choice_task(expected: str = "b") -> dict:
    return {
        "id": "easy-intent-00",
        "family": "intent",
        "state": "s",
        "question": {"type": "choice", "instructions": "Which?", "criteria": {"a": "A", "b": "B"}},
        "labels": ["b", "a"],
        "expected": expected,
    }


def score_task_row(expected: int = 0) -> dict:
    return {
        "id": "original-ordinal-00-0",
        "family": "ordinal",
        "state": "s",
        "question": {"type": "score", "instructions": "How?", "criteria": ["zero", "one", "two"]},
        "labels": ["0", "1", "2"],
        "expected": expected,
    }


def noul_task(criteria: dict | None = None) -> dict:
    question = {"type": "noul", "instructions": "Paid?", "criteria": criteria}
    return {
        "id": "easy-fact-00",
        "family": "fact",
        "state": "s",
        "question": question,
        "labels": ["no", "yes"],
        "expected": "yes",
    }


# ---------------------------------------------------------------- score_task


def test_strictly_valid_distribution_is_scored_as_sent():
    score = score_task({"a": 0.25, "b": 0.75}, choice_task())
    assert (score.valid, score.strict_valid, score.renormalized) == (True, True, False)
    assert score.probs == {"b": 0.75, "a": 0.25} and score.predicted == "b" and score.correct
    assert not score_task({"a": 0.75, "b": 0.25}, choice_task()).correct


@pytest.mark.parametrize(
    ("b", "strict", "valid"),
    [
        (0.7505, True, True),  # sum 1.0005
        (0.7495, True, True),  # sum 0.9995
        (0.7525, False, True),  # sum 1.0025: renormalised
        (0.7395, False, True),  # sum 0.9895
        (0.7695, False, True),  # sum 1.0195
        (0.7705, False, False),  # sum 1.0205
        (0.7295, False, False),  # sum 0.9795
    ],
)
def test_sum_bands(b, strict, valid):
    score = score_task({"a": 0.25, "b": b}, choice_task())
    assert (score.strict_valid, score.valid, score.renormalized) == (strict, valid, valid and not strict)
    if valid:
        assert math.isclose(sum(score.probs.values()), 1.0, abs_tol=1e-12 if not strict else 1e-3)
        assert score.correct
    else:
        assert score.probs is None and score.predicted is None and not score.correct and score.reason


@pytest.mark.parametrize(
    "probs",
    [
        {"a": 1.0},
        {"a": 0.5, "b": 0.5, "c": 0.0},
        {"a": True, "b": 0},
        {"a": math.nan, "b": 0.5},
        {"a": math.inf, "b": 0.0},
        {"a": -0.1, "b": 1.1},
        {"a": "0.5", "b": 0.5},
        {"a": None, "b": 1.0},
        [0.5, 0.5],
        None,
    ],
)
def test_invalid_distributions_are_wrong(probs):
    score = score_task(probs, choice_task())
    assert not score.valid and not score.strict_valid and not score.correct and score.predicted is None
    assert isinstance(score.reason, str)


def test_ties_go_to_the_lexicographically_smallest_label():
    assert score_task({"b": 0.5, "a": 0.5}, choice_task()).predicted == "a"
    tie = score_task({"0": 0.4, "1": 0.2, "2": 0.4}, score_task_row(expected=0))
    assert tie.predicted == "0" and tie.correct and tie.strict_valid
    assert tie.ordinal_ev == pytest.approx(1.0, abs=1e-15)
    assert score_task({"0": 0.1, "1": 0.2, "2": 0.7}, score_task_row(expected=2)).correct  # int expected vs "2"
    assert score_task({"0": 0.1, "1": 0.2, "2": 0.7}, score_task_row(expected=2)).ordinal_ev == pytest.approx(1.6)


# ---------------------------------------------------------------- the adapter's request and answer mapping


def test_request_body_is_the_task_question_keyed_decision():
    task = choice_task()
    assert request_body(task, "open-jev") == {
        "model": "open-jev",
        "state": "s",
        "questions": {"decision": {"type": "choice", "instructions": "Which?", "criteria": {"a": "A", "b": "B"}}},
    }
    assert list(request_body(task, "open-jev")) == ["model", "state", "questions"]
    assert list(request_body(task, "open-jev")["questions"]["decision"]["criteria"]) == ["a", "b"]  # stored order
    assert build_question(noul_task()) == {"type": "noul", "instructions": "Paid?"}
    rubric = {"true": "paid", "false": "unpaid"}
    assert build_question(noul_task(rubric))["criteria"] == rubric


def test_answer_mapping():
    assert probabilities_from_answer(noul_task(), {"type": "noul", "noul": 0.25}) == {"no": 0.75, "yes": 0.25}
    probs = {"a": 0.4, "b": 0.6}
    assert probabilities_from_answer(choice_task(), {"type": "choice", "choice": "b", "probabilities": probs}) == probs
    wrong_answers = [
        (noul_task(), {"type": "choice", "noul": 0.5}),
        (noul_task(), {"type": "noul", "noul": True}),
        (choice_task(), {"type": "choice"}),
        (choice_task(), None),
    ]
    for task, answer in wrong_answers:
        with pytest.raises(ValueError):
            probabilities_from_answer(task, answer)


def test_task_checks_and_public_tasks():
    leaking = {**choice_task(), "state": {"text": "s", "meta": {"ground_truth": "b"}}}
    with pytest.raises(ValueError, match="answer keys"):
        check_task(leaking)
    with pytest.raises(ValueError, match="not one of its labels"):
        check_task(choice_task(expected="c"))
    tasks = load_tasks(None)
    assert len(tasks) == 120 and len({t["id"] for t in tasks}) == 120
    assert {jevbench.tier_of(t) for t in tasks} == {"easy", "original"}
    assert [t["id"] for t in load_tasks("easy")] == [t["id"] for t in tasks[:48]]


# ---------------------------------------------------------------- stop rules and summaries


def test_stop_rules(monkeypatch):
    tasks = [{**choice_task(), "id": f"easy-intent-{i:02d}"} for i in range(6)]
    answers = {"answers": {"decision": {"type": "choice", "choice": "b", "probabilities": {"a": 0.2, "b": 0.8}}}}
    answers.update(
        model="m",
        usage={"input_tokens": 3},
        metadata={"inference_seconds": 0.001, "candidate_sequences": 2, "method": "x"},
    )

    def replies(*statuses):
        sequence = iter(statuses)

        def post(endpoint, body, timeout_s):
            status = next(sequence)
            return status, answers if status == 200 else {"error": "e"}

        return post

    monkeypatch.setattr(jevbench, "post_json", replies(200, 403))
    records, stopped = run_passes("http://127.0.0.1:1", tasks, passes=2, model="open-jev")
    assert len(records) == 2 and stopped == "status 403 on easy-intent-01"
    monkeypatch.setattr(jevbench, "post_json", replies(422, 422, 422, 200, 500, 502, 500))
    records, stopped = run_passes("http://127.0.0.1:1", tasks, passes=2, model="open-jev")
    assert len(records) == 7 and stopped.startswith("3 failures in a row")
    assert [r["score"]["correct"] for r in records[:4]] == [False, False, False, True]  # a 422 is a wrong answer
    assert records[0]["error"] == "e"


def test_accuracy_only_with_real_weights():
    record = {
        "id": "easy-intent-00",
        "tier": "easy",
        "status": 200,
        "latency_ms": 5.0,
        "probabilities": {"a": 0.2, "b": 0.8},
        "server": {"inference_ms": 1.0, "synthetic_weights": False},
        "score": {"valid": True, "strict_valid": True, "correct": True},
    }
    real = summarize_pass([record], real_weights=True, reference=None)
    assert real["accuracy"] == 1.0 and real["correct_by_tier"] == {"easy": "1/1"}
    assert "accuracy" not in summarize_pass([record], real_weights=False, reference=None)
    other = {**record, "probabilities": {"a": 0.6, "b": 0.4}}
    assert agreement([other], {"easy-intent-00": {"a": 0.2, "b": 0.8}}) == {
        "compared": 1,
        "argmax_agreement": 0,
        "disagreements": ["easy-intent-00"],
        "max_abs_dp": pytest.approx(0.4),
        "max_abs_dp_task": "easy-intent-00",
    }
    with pytest.raises(ValueError, match="labels"):
        agreement([other], {"easy-intent-00": {"a": 0.2, "c": 0.8}})


# ---------------------------------------------------------------- a real run over HTTP


def test_run_against_the_tiny_twin_and_agreement_with_itself(tmp_path):
    all_tasks = load_tasks(None)
    kinds = {"choice": 2, "noul": 2, "score": 2}
    tasks = []
    for task in all_tasks:
        if kinds.get(task["question"]["type"], 0) > 0:
            kinds[task["question"]["type"]] -= 1
            tasks.append(task)
    with DecisionServer(default_model(), port=0) as server:
        server.start()
        first_dir, first = run_benchmark(server.url, tasks, passes=2, out_root=tmp_path, label="first")
        second_dir, second = run_benchmark(
            server.url, tasks, passes=1, out_root=tmp_path, label="second", reference=first_dir
        )
    records = [json.loads(line) for line in (first_dir / "records.jsonl").read_text().splitlines()]
    assert [(r["pass"], r["id"]) for r in records] == [(p, t["id"]) for p in (1, 2) for t in tasks]
    for record, task in zip(records, tasks * 2):
        assert record["status"] == 200 and record["latency_ms"] > 0 and record["error"] is None
        assert set(record["probabilities"]) == {str(label) for label in task["labels"]}
        assert record["score"]["strict_valid"] and record["server"]["synthetic_weights"] is True
        assert record["server"]["model"] == "jevlab/tiny-twin"
    assert first["weights"] == "synthetic" and "meaningless" in first["note"] and first["stopped"] is None
    for pass_summary in first["passes"].values():
        assert pass_summary["answered"] == len(tasks) and "accuracy" not in pass_summary
        latency = pass_summary["latency"]
        assert latency["n"] == len(tasks) and 0 < latency["p50_ms"] <= latency["p95_ms"] <= latency["max_ms"]
    assert first["run"]["server"]["/health"]["status"] == "ready"
    assert first["environment"]["git_commit"] and first["environment"]["device"] == "cpu"
    assert first_dir.name.endswith("-first") and second_dir.name.endswith("-second")
    # The same model answers the same tasks: full argmax agreement and no probability difference.
    assert second["passes"]["1"]["agreement"] == {
        "compared": len(tasks),
        "argmax_agreement": len(tasks),
        "disagreements": [],
        "max_abs_dp": 0.0,
        "max_abs_dp_task": None,
    }
    assert json.loads((second_dir / "summary.json").read_text()) == second


def test_command_line_run_and_overhead_record(tmp_path):
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(task) + "\n" for task in load_tasks("easy")[:2]))
    with DecisionServer(default_model(), port=0) as server:
        server.start()
        argv = ["--endpoint", server.url, "--tasks", str(tasks_file), "--passes", "1", "--out", str(tmp_path / "runs")]
        assert jevbench.main([*argv, "--label", "cli"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-cpu-" + run_dir.name.split("-cpu-")[1]) and run_dir.name.endswith("-cli")
    assert len((run_dir / "records.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_dir / "summary.json").read_text())["passes"]["1"]["answered"] == 2

    out = tmp_path / "overhead.json"
    code = jevbench.main(["--overhead", str(out), "--tasks", str(tasks_file), "--rounds", "2", "--shapes", "tiny"])
    record = json.loads(out.read_text())
    assert code == (0 if record["meets_target"] else 1)
    assert record["requests"] == 2 and record["http"]["n"] == 4 and record["environment"]["utc"]
