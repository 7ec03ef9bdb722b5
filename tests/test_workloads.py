"""The workloads (ablations/workloads.py): synthetic requests, Open-Jev token counts, the JevBench panel."""

from __future__ import annotations

import pytest

from ablations.workloads import (
    JEVBENCH_TIERS,
    SYNTHETIC,
    get_workload,
    jevbench_panel,
    resolve,
    synthetic_state,
)


def test_synthetic_state_hits_the_exact_count_and_is_deterministic():
    words = lambda text: len(text.split(" "))  # a stand-in tokenizer: one token per word
    a, b = synthetic_state(137, seed=3, count_tokens=words), synthetic_state(137, seed=3, count_tokens=words)
    assert a == b and words(a) == 137
    assert synthetic_state(137, seed=4, count_tokens=words) != a
    with pytest.raises(ValueError, match="at least 8 tokens"):
        synthetic_state(5, seed=0, count_tokens=words)


def _candidate_lengths(request: dict) -> list[int]:
    from reference.prompts import candidate_prompts, compile_records
    from reference.request import validate_request
    from reference.tokenizer import default_prompt_tokenizer

    records_ = compile_records(validate_request(request, model_id="Qwen/Qwen3.8-27B"))
    prompts = [p for record in records_ for p in candidate_prompts(record)]
    return [len(ids) for ids in default_prompt_tokenizer().encode_prompts(prompts)]


def test_our_synthetic_workloads_have_the_stated_shapes():
    from reference.tokenizer import default_prompt_tokenizer

    count = default_prompt_tokenizer().count_tokens
    for workload_id, spec in SYNTHETIC.items():
        workload = get_workload(workload_id)
        assert workload == get_workload(workload_id)  # same request every time
        assert count(workload.request["state"]) == spec.state_tokens
        (question,) = workload.request["questions"].values()
        assert question["type"] == "choice" and len(question["criteria"]) == spec.options
    assert len(_candidate_lengths(get_workload("synthetic-1024-choice-32").request)) == 32
    long_lengths = _candidate_lengths(get_workload("long-10k-choice-5").request)
    assert len(long_lengths) == 5 and 9_500 <= sum(long_lengths) <= 10_500


def test_open_jev_workloads_reproduce_the_recorded_token_counts():
    from reference.data import open_jev_workloads

    recorded = open_jev_workloads()
    for workload in resolve(["open-jev"]):
        lengths = _candidate_lengths(workload.request)
        assert lengths == recorded[workload.id]["candidate_input_tokens"], workload.id


def test_jevbench_panel_is_one_task_per_family_sent_as_jevbench_sends_it():
    from reference.data import jevbench_tasks

    panel = jevbench_panel()
    tasks = {t["id"]: t for t in jevbench_tasks(JEVBENCH_TIERS)}
    families = {(t["id"].split("-")[0], t["family"]) for t in tasks.values()}
    assert len(panel) == len(families) == 10
    assert {(w.id.split("/")[1].split("-")[0], tasks[w.id.split("/")[1]]["family"]) for w in panel} == families
    for workload in panel:
        task = tasks[workload.id.removeprefix("jevbench/")]
        assert set(workload.request) == {"state", "questions"} and workload.request["state"] == task["state"]
        assert workload.request["questions"] == {"decision": {**task["question"]}}


def test_resolve_expands_groups_in_order_without_duplicates():
    ids = [w.id for w in resolve(["drone", "open-jev", "jevbench/easy-fact-00", "jevbench"])]
    assert ids[:6] == ["drone", "customer_service", "context-128-choice-2", "context-128-choice-8",
                       "context-512-choice-2", "context-512-choice-8"]  # fmt: skip
    assert ids[6] == "jevbench/easy-fact-00" and len(ids) == len(set(ids)) == 6 + 10
    with pytest.raises(ValueError, match="unknown workload 'dron'"):
        resolve(["dron"])
