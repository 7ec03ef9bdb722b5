"""The ablation spine on the CPU: plans, workloads, run-record schema, timing helpers and runner pieces.

No model runs here (the end-to-end tiny-plan run is `nox -s ablate`); the gate runner runs real pytest subprocesses on
throw-away test files.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ablations import envinfo, records, timing
from ablations.plans import check_plan, load_plan, plan_names
from ablations.run import (
    Outputs,
    compare,
    gate_result,
    junit_cases,
    main,
    node_key,
    probabilities_of,
    rows_computed,
    run_gates,
    summary_lines,
)
from ablations.workloads import (
    HEADLINE,
    JEVBENCH_TIERS,
    SYNTHETIC,
    get_workload,
    jevbench_panel,
    resolve,
    synthetic_state,
)
from engine.stages import BuildContext, build_backbone, in_ladder_order

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("name", ["gpu-27b", "cpu-tiny"])
def test_plans_load_and_name_known_stages_and_workloads(name):
    assert name in plan_names()
    plan = load_plan(name)
    in_ladder_order(plan.stages)
    workload_ids = [w.id for w in resolve(plan.workloads)]
    assert plan.headline == HEADLINE and plan.headline in workload_ids
    assert len(workload_ids) == len(set(workload_ids))
    if plan.device == "cuda":
        assert plan.timing.min_runs >= 30 and plan.timing.timer == "cuda-events"
        assert set(workload_ids) >= {"drone", "customer_service", "synthetic-1024-choice-32", "long-10k-choice-5"}
    else:
        assert plan.timing.timer == "perf-counter" and "long-10k-choice-5" not in workload_ids


def test_check_plan_rejects_inconsistent_plans():
    plan = load_plan("gpu-27b")
    with pytest.raises(ValueError, match="at least 30 runs"):
        check_plan(dataclasses.replace(plan, timing=dataclasses.replace(plan.timing, min_runs=5)))
    with pytest.raises(ValueError, match="reference must be an HF stage"):
        check_plan(dataclasses.replace(plan, reference="merged"))
    with pytest.raises(ValueError, match="times with 'perf-counter'"):
        check_plan(dataclasses.replace(load_plan("cpu-tiny"), timing=plan.timing))
    with pytest.raises(ValueError, match="cannot run on cpu"):
        check_plan(dataclasses.replace(load_plan("cpu-tiny"), reference="hf_fla"))
    with pytest.raises(ValueError, match="unknown plan"):
        load_plan("gpu-999b")


# ---------------------------------------------------------------------------------------------------------- workloads
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


# ---------------------------------------------------------------------------------------------------------- records
def small_record(**changes) -> dict:
    """A valid complete record of one timed stage on one workload (numbers made up for the schema test only)."""
    samples = [10.5, 10.0, 11.25, 10.25, 12.0]
    record = {
        "schema": records.SCHEMA,
        "complete": True,
        "plan": {"name": "cpu-tiny", "device": "cpu", "shapes": "tiny", "reference": "hf_torch",
                 "baseline": "hf_torch", "headline": "drone", "timer": "perf-counter", "warmup": 1, "runs": 5},
        "env": {"gpu": None, "driver": None, "torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": None,
                "git_commit": "0123456789abcdef", "git_dirty": False, "utc": "2026-11-30T10:00:00Z", "device": "cpu"},
        "weights": {"synthetic": True, "method": "synthetic_weights", "linear_params": 2_057_216},
        "ceilings": {"copy_tbps": 0.01, "bf16_tflops": 0.1},
        "workloads": [{"id": "drone", "questions": 3, "candidates": 7, "tokens": 971}],
        "stages": [{
            "name": "hf_torch", "status": "ok", "reason": None,
            "gate": {"node": "tests/test_x.py::test_y", "outcome": "green", "exit_code": 0},
            "workloads": [{"id": "drone", "rows": 971, "median_ms": statistics.median(samples),
                           "p10_ms": float(np.percentile(samples, 10)), "p90_ms": float(np.percentile(samples, 90)),
                           "samples_ms": samples, "kernels_per_forward": None, "gpu_busy_ms": None, "floor_ms": 1.5,
                           "max_abs_dp": 0.0, "hidden_rel_rmse": 0.0}],
        }],
        "attempts": [],
    }  # fmt: skip
    record.update(changes)
    return record


def test_a_valid_record_passes_and_round_trips(tmp_path):
    record = small_record()
    records.validate_record(record)
    path = records.write_record(record, tmp_path / "runs" / "r.json")
    assert records.read_record(path) == record
    assert not list(tmp_path.glob("runs/*.partial"))


def _delete(record: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    target = record
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    del target[last]


REQUIRED = [
    "schema", "plan", "env", "ceilings", "stages", "plan.name", "env.gpu", "env.driver", "env.torch", "env.triton",
    "env.cuda", "env.git_commit", "env.git_dirty", "env.utc", "ceilings.copy_tbps", "ceilings.bf16_tflops",
    "stages.0.name", "stages.0.status", "stages.0.gate", "stages.0.workloads", "stages.0.workloads.0.id",
    "stages.0.workloads.0.rows", "stages.0.workloads.0.median_ms", "stages.0.workloads.0.p10_ms",
    "stages.0.workloads.0.p90_ms", "stages.0.workloads.0.samples_ms", "stages.0.workloads.0.kernels_per_forward",
    "stages.0.workloads.0.gpu_busy_ms", "stages.0.workloads.0.floor_ms", "stages.0.workloads.0.max_abs_dp",
    "stages.0.workloads.0.hidden_rel_rmse",
]  # fmt: skip


@pytest.mark.parametrize("dotted", REQUIRED)
def test_a_record_missing_a_required_name_is_rejected(dotted):
    record = small_record()
    _delete(record, dotted)
    last = dotted.split(".")[-1]
    with pytest.raises(records.RecordError, match=rf"\.{last}: missing|{last}"):
        records.validate_record(record)


def _stage(record: dict) -> dict:
    return record["stages"][0]


def _timed(record: dict) -> dict:
    return record["stages"][0]["workloads"][0]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: r.update(schema="jevlab-run/0"), "record.schema"),
        (lambda r: _timed(r).update(median_ms="10.5"), "median_ms: expected number"),
        (lambda r: _timed(r).update(median_ms=math.nan), "median_ms: expected number"),
        (lambda r: _timed(r).update(median_ms=10.0), "is not the median of samples_ms"),
        (lambda r: _timed(r).update(p10_ms=11.0), "p10_ms <= median_ms <= p90_ms"),
        (lambda r: _timed(r).update(samples_ms=[]), "non-empty list of positive numbers"),
        (lambda r: _timed(r).update(rows=971.0), "rows: expected int"),
        (lambda r: _timed(r).update(max_abs_dp=None), "compares every timed workload"),
        (lambda r: _stage(r).update(status="fast"), "is not one of"),
        (lambda r: _stage(r).update(status="pending"), "no pending stage"),
        (lambda r: _stage(r).update(status="gate-red"), "says why"),
        (lambda r: _stage(r).update(status="gate-red", reason="red"), "only an ok"),
        (lambda r: _stage(r)["gate"].update(outcome="red"), "timed although its gate is red"),
        (lambda r: _stage(r).update(gate=None), "timed without a gate"),
        (lambda r: r["env"].update(git_dirty="no"), "git_dirty: expected bool"),
        (lambda r: r["attempts"].append({"id": "x"}), r"attempts\[0\]\.stage: missing"),
    ],
)
def test_a_damaged_record_is_rejected(damage, message):
    record = small_record()
    damage(record)
    with pytest.raises(records.RecordError, match=message):
        records.validate_record(record)


def test_an_incomplete_record_may_lack_comparisons_and_have_pending_stages():
    record = small_record(complete=False)
    _timed(record)["max_abs_dp"] = None
    _stage(record)["status"] = "pending"
    records.validate_record(record)


def test_newest_complete_record_per_plan(tmp_path):
    runs = tmp_path / "runs"
    for name, plan, utc, complete in [
        ("a.json", "cpu-tiny", "2026-11-30T10:00:00Z", True),
        ("b.json", "cpu-tiny", "2026-11-30T11:00:00Z", True),
        ("c.json", "cpu-tiny", "2026-11-30T12:00:00Z", False),
        ("d.json", "other", "2026-11-30T09:00:00Z", True),
        ("e.json", "cpu-tiny", "2026-11-30T13:00:00Z", True),  # a rerun of some stages: not the plan's ladder
    ]:
        record = small_record(complete=complete)
        record["plan"]["name"], record["env"]["utc"] = plan, utc
        if name == "e.json":
            record["plan"] |= {"stages": ["hf_torch", "fused"], "requested_stages": ["fused"]}
        records.write_record(record, runs / name)
    newest = records.newest_per_plan(runs)
    assert {plan: path.name for plan, (path, _) in newest.items()} == {"cpu-tiny": "b.json", "other": "d.json"}


def test_attempts_record_validates(tmp_path):
    assert isinstance(records.load_attempts(), list)
    bad = tmp_path / "attempts.toml"
    bad.write_text('schema = "jevlab-attempts/1"\n[[attempts]]\nid = "x"\nstage = "gemm"\n')
    with pytest.raises(records.RecordError, match="title: missing"):
        records.load_attempts(bad)
    good = bad.read_text() + (
        'title = "t"\noutcome = "failed"\nreason = "slower"\nevidence = "results/runs/r.json"\ndate = "2026-11-30"\n'
        "numbers = { ms = 1.5 }\n"
    )
    bad.write_text(good)
    assert records.load_attempts(bad)[0]["numbers"] == {"ms": 1.5}


# ---------------------------------------------------------------------------------------------------------- timing
def test_union_length_counts_overlaps_once():
    assert timing.union_length([]) == 0
    assert timing.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.75), (10, 10)]) == 4.0
    assert timing.union_length([(4, 9), (0, 1), (2, 5)]) == 8.0


def test_kernel_stats_from_a_chrome_trace():
    trace = [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "norm", "ts": 5, "dur": 10},  # overlaps gemm: busy 0..15
        {"cat": "kernel", "name": "gemm", "ts": 20, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 40, "dur": 100},
        {"cat": "kernel", "name": "Memset (Device)", "ts": 40, "dur": 100},
        {"cat": "gpu_user_annotation", "name": "forward", "ts": 0, "dur": 1000},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},
    ]
    stats = timing.kernel_stats(trace, calls=2)
    assert stats.kernels_per_forward == 1.5
    assert stats.gpu_busy_ms == pytest.approx(25 / 2 / 1e3)
    assert [k["name"] for k in stats.top_kernels] == ["gemm", "norm"]
    assert stats.top_kernels[0] == {"name": "gemm", "calls_per_forward": 1.0, "ms_per_forward": 0.01}
    assert stats.families["gemm"] == {"calls_per_forward": 1.0, "ms_per_forward": 0.01}
    assert stats.families["other"] == {"calls_per_forward": 0.5, "ms_per_forward": 0.005}
    assert stats.core_ms == pytest.approx(0.01)


@pytest.mark.parametrize(
    "name, family",
    [
        ("nvjet_sm90_tst_256x152_64x4_2x1_v_bz_coopA_TNT", "gemm"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3", "gemm"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn_core"),
        ("chunk_gated_delta_rule_fwd_kkt_solve_kernel", "gdn_core"),
        ("recompute_w_u_fwd_kernel", "gdn_core"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 128, 64, 4>>", "attention_core"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention_core"),
        ("_attention_gate_kernel", "ours"),
        ("_residual_rmsnorm_kernel", "ours"),
        ("_gdn_prep_kernel", "ours"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>", "other"),
        ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel_generic", "other"),
    ],
)
def test_kernel_family_of_real_kernel_names(name, family):
    """Names as they appear in H200 profiles (results/runs/*nvidia-h200*.json top_kernels, the tree gate JSON)."""
    assert timing.kernel_family(name) == family


def test_kernel_families_cover_every_kernel_once():
    rng = random.Random(3)
    names = ["nvjet_a", "chunk_fwd_kernel_o", "flash_fwd", "_silu_mul_kernel", "elementwise_kernel"]
    trace = [{"cat": "kernel", "name": rng.choice(names), "ts": i * 10, "dur": rng.uniform(1, 9)} for i in range(200)]
    stats = timing.kernel_stats(trace, calls=4)
    assert set(stats.families) == set(timing.FAMILIES)
    assert sum(f["calls_per_forward"] for f in stats.families.values()) == stats.kernels_per_forward
    total_ms = sum(e["dur"] for e in trace) / 4 / 1e3
    assert sum(f["ms_per_forward"] for f in stats.families.values()) == pytest.approx(total_ms, rel=1e-12)
    core = sum(stats.families[f]["ms_per_forward"] for f in ("gemm", "gdn_core", "attention_core"))
    assert stats.core_ms == pytest.approx(core, rel=1e-12) and 0 < core < total_ms


def test_host_profile_names_the_function_that_takes_the_time():
    def slow_part() -> float:
        return sum(i * i for i in range(200_000))

    def call() -> None:
        slow_part()
        sorted(range(1000))

    profile = timing.host_profile(call, top=5)
    assert profile["profiled_ms"] > 0
    assert any("slow_part" in row["function"] for row in profile["by_cumulative_time"][:3])
    own = [row["own_ms"] for row in profile["by_own_time"]]
    assert own == sorted(own, reverse=True) and len(own) <= 5
    assert all(row["cumulative_ms"] <= profile["profiled_ms"] * 1.5 for row in profile["by_cumulative_time"])


def test_samples_summary_matches_numpy():
    rng = random.Random(7)
    values = [rng.uniform(1, 50) for _ in range(31)]
    summary = timing.Samples(values).summary()
    assert summary["median_ms"] == statistics.median(values)
    assert summary["p10_ms"] == pytest.approx(np.percentile(values, 10), rel=1e-12)
    assert summary["p90_ms"] == pytest.approx(np.percentile(values, 90), rel=1e-12)
    assert summary["runs"] == 31 and summary["samples_ms"] == values
    assert summary["host_median_ms"] is None
    with_host = timing.Samples(values, host_ms=[v / 2 for v in values]).summary()
    assert with_host["host_median_ms"] == statistics.median(values) / 2


def test_time_calls_on_the_cpu_samples_every_run_after_warmup():
    calls = []
    samples = timing.time_calls(lambda: calls.append(sum(range(1000))), device="cpu", warmup=2, runs=4)
    assert len(calls) == 6 and len(samples.samples_ms) == 4 and all(s > 0 for s in samples.samples_ms)
    with pytest.raises(ValueError):
        timing.time_calls(lambda: None, device="cpu", warmup=0, runs=0)


def test_floors_are_the_larger_of_streaming_and_compute():
    ceilings = {"copy_tbps": 2.0, "bf16_tflops": 1000.0}
    # 2 GB at 2 TB/s = 1 ms; 2e11 flop at 1e15 = 0.2 ms
    few = timing.floors(2 * 10**9, 10**9, rows=100, ceilings=ceilings)
    assert few["weight_floor_ms"] == pytest.approx(1.0) and few["compute_floor_ms"] == pytest.approx(0.2)
    assert few["floor_ms"] == pytest.approx(1.0)
    many = timing.floors(2 * 10**9, 10**9, rows=1000, ceilings=ceilings)
    assert many["floor_ms"] == pytest.approx(2.0) == many["compute_floor_ms"]


def test_ceilings_on_the_cpu_are_positive_rates():
    ceilings = timing.measure_ceilings("cpu", copy_bytes=1 << 20, gemm_n=256, runs=3)
    assert ceilings["copy_tbps"] > 0 and ceilings["bf16_tflops"] > 0
    assert len(ceilings["copy_samples_ms"]) == len(ceilings["gemm_samples_ms"]) == 3


def test_layer_ranges_find_layers_and_their_op_families():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.input_layernorm = torch.nn.Identity(), torch.nn.Identity()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])
            self.norm = torch.nn.Identity()

    names = [name for name, _ in timing._layer_modules(Model())]
    assert names == ["layer 0", "layer 0 mlp", "layer 0 input_layernorm", "layer 1", "layer 1 mlp",
                     "layer 1 input_layernorm"]  # fmt: skip
    with timing.layer_ranges(Model(), enabled=False) as count:
        assert count == 0
    with timing.nvtx_range("nothing", enabled=False):
        pass


# ---------------------------------------------------------------------------------------------------------- runner
def test_compare_reports_max_dp_rel_rmse_and_flips():
    torch.manual_seed(0)
    hidden = torch.randn(3, 16)
    reference = Outputs(hidden, [[0.5, 0.3, 0.2], [0.4, 0.6]])
    assert compare(Outputs(hidden.clone(), [[0.5, 0.3, 0.2], [0.4, 0.6]]), reference) == {
        "max_abs_dp": 0.0, "hidden_rel_rmse": 0.0, "argmax_flips": 0}  # fmt: skip
    shifted = Outputs(hidden * 1.01, [[0.5, 0.25, 0.25], [0.65, 0.35]])
    result = compare(shifted, reference)
    assert result["max_abs_dp"] == pytest.approx(0.25) and result["argmax_flips"] == 1
    assert result["hidden_rel_rmse"] == pytest.approx(0.01, rel=1e-5)
    with pytest.raises(ValueError, match="hidden shapes differ"):
        compare(Outputs(hidden[:2], reference.probabilities), reference)


def test_probabilities_go_through_the_service_readout():
    from reference.prompts import compile_records
    from reference.request import validate_request

    choice = {"type": "choice", "instructions": "i", "criteria": {"a": "x", "b": "y"}}
    request = {"state": "s", "questions": {"q": choice, "n": {"type": "noul", "instructions": "j"}}}

    class Plan:
        records = compile_records(validate_request(request, model_id="m"))

    probabilities = probabilities_of(Plan, [0.5, -0.25, 1.5], temperature=2.0)
    assert probabilities[0] == pytest.approx([1 / (1 + math.exp(-0.375)), 1 / (1 + math.exp(0.375))], rel=1e-14)
    assert probabilities[1] == pytest.approx([1 - 1 / (1 + math.exp(-0.75)), 1 / (1 + math.exp(-0.75))], rel=1e-14)


def test_rows_computed_defaults_to_real_tokens():
    class Packed:
        pass

    class Padded:
        def rows_computed(self, prepared):
            return 40

    assert rows_computed(Packed(), None, [[1, 2, 3], [4]]) == 4
    assert rows_computed(Padded(), None, [[1, 2, 3], [4]]) == 40


def test_node_keys_match_junit_names():
    assert node_key("tests/test_x.py::test_y") == ("tests.test_x", "test_y", None)
    assert node_key("tests/test_x.py::test_y[merged vs hf_fla]") == (
        "tests.test_x",
        "test_y",
        "test_y[merged vs hf_fla]",
    )
    assert node_key("tests/sub/test_x.py::TestZ::test_y") == ("tests.sub.test_x.TestZ", "test_y", None)


def test_gate_result_judges_only_the_nodes_own_cases(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="tests.test_x" name="test_a[1]"/><testcase classname="tests.test_x" name="test_a[2]"/>'
        '<testcase classname="tests.test_x" name="test_b"><failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.test_x" name="test_c"><skipped message="no gpu"/></testcase>'
        '<testcase classname="tests.test_x" name="test_ab"/>'
        "</testsuite></testsuites>"
    )
    run = {"exit_code": 1, "output": "out", "cases": junit_cases(junit), "seconds": 1.0, "command": "c"}
    a = gate_result("tests/test_x.py::test_a", run)
    assert (a["outcome"], a["passed"], a["failed"]) == ("green", 2, 0)
    assert gate_result("tests/test_x.py::test_a[2]", run)["passed"] == 1
    b = gate_result("tests/test_x.py::test_b", run)
    assert (b["outcome"], b["failed"]) == ("red", 1) and "boom" in b["output_tail"]
    c = gate_result("tests/test_x.py::test_c", run)
    assert (c["outcome"], c["skipped"]) == ("red", 1)
    assert gate_result("tests/test_other.py::test_a", run)["outcome"] == "red"
    assert gate_result("tests/test_x.py::test_a", run | {"exit_code": 2})["outcome"] == "red"


GATES = """import pytest
def test_ok():
    assert True
def test_broken():
    assert 1 == 2
@pytest.mark.skip(reason="nothing to run")
def test_skipped():
    pass
"""


@pytest.mark.slow
def test_gates_run_in_one_process_and_alone_after_a_usage_error(tmp_path):
    (tmp_path / "test_gates.py").write_text(GATES)
    nodes = ["test_gates.py::test_ok", "test_gates.py::test_broken", "test_gates.py::test_skipped"]
    gates = run_gates([*nodes, nodes[0]], "cpu", timeout_s=120, cwd=tmp_path)
    assert {node: gate["outcome"] for node, gate in gates.items()} == dict(zip(nodes, ["green", "red", "red"]))
    assert "assert 1 == 2" in gates[nodes[1]]["output_tail"]
    assert gates[nodes[2]]["skipped"] == 1
    mixed = run_gates([nodes[0], "test_gates.py::test_missing"], "cpu", timeout_s=120, cwd=tmp_path)
    assert mixed[nodes[0]]["outcome"] == "green"  # judged alone: the unknown node stopped the shared process
    assert mixed["test_gates.py::test_missing"]["outcome"] == "red"


def test_summary_lines_show_every_stage():
    record = small_record()
    record["stages"].append({"name": "hf_fla", "status": "unavailable", "reason": "runs on cuda only",
                             "gate": None, "workloads": [], "workload_errors": []})  # fmt: skip
    _stage(record)["workload_errors"] = []
    _timed(record)["floor_multiple"] = 7.0
    lines = "\n".join(summary_lines(record))
    assert "hf_torch" in lines and "10.50" in lines and "unavailable  runs on cuda only" in lines
    assert "synthetic weights" in lines


def test_cli_lists_a_plan_and_refuses_the_gpu_plan_without_cuda(capsys):
    assert main(["--plan", "cpu-tiny", "--list"]) == 0
    out = capsys.readouterr().out
    assert "stage hf_torch" in out and "workload drone" in out
    if not torch.cuda.is_available():
        assert main(["--plan", "gpu-27b"]) == 2


# ---------------------------------------------------------------------------------------------------------- envinfo
def test_environment_names_and_record_stem(monkeypatch):
    env = envinfo.collect("cpu")
    records.validate_record(small_record(env=env))  # every name the schema wants, with the right types
    assert env["device"] == "cpu" and env["gpu"] is None and env["cpu_count"] >= 1
    assert envinfo.record_stem({"utc": "2026-11-30T10:21:13Z", "gpu": "NVIDIA H200", "git_commit": "9a63d16abc"}) == (
        "20261130T102113Z-nvidia-h200-9a63d16"
    )
    assert envinfo.record_stem({"utc": "2026-11-30T10:21:13Z", "gpu": None, "git_commit": "unknown"}).endswith(
        "-cpu-unknown"
    )


def test_git_state_falls_back_to_the_sender_variables(monkeypatch):
    monkeypatch.setattr(envinfo, "_run", lambda args, cwd=None: None)
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state() == {"git_commit": "unknown", "git_dirty": True, "git_source": "none"}
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state() == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _committed_checkout(root: Path) -> str:
    """A git checkout at `root` with code, a README with the generated block, and an output under results/."""
    start, end = envinfo.README_BLOCK
    (root / "results").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "README.md").write_text(f"# lab\n\n{start}\nold table\n{end}\n\nmore text\n")
    (root / "results" / "ladder.png").write_bytes(b"old")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "c")
    return _git(root, "rev-parse", "HEAD")


def test_dirty_describes_the_code_not_the_outputs_a_run_writes(tmp_path):
    """What `nox -s ablate` rewrites (results/, README's generated block) and untracked files leave a checkout clean;
    a change to code, or to README outside the block, makes it dirty."""
    commit = _committed_checkout(tmp_path)
    assert envinfo.git_state(tmp_path) == {"git_commit": commit, "git_dirty": False, "git_source": "git"}
    readme = tmp_path / "README.md"
    (tmp_path / "results" / "ladder.png").write_bytes(b"new")
    (tmp_path / "results" / "run.json").write_text("{}")
    (tmp_path / "scratch.py").write_text("y = 2\n")
    readme.write_text(readme.read_text().replace("old table", "new table\n| with | rows |"))
    assert envinfo.code_dirty(tmp_path) is False
    readme.write_text(readme.read_text().replace("more text", "edited text"))
    assert envinfo.code_dirty(tmp_path) is True
    _git(tmp_path, "checkout", "README.md")
    start, end = envinfo.README_BLOCK
    readme.write_text(readme.read_text().replace(end, ""))  # a broken block cannot be told apart from an edit
    assert envinfo.code_dirty(tmp_path) is True
    _git(tmp_path, "checkout", "README.md")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert envinfo.git_state(tmp_path)["git_dirty"] is True


def test_the_readme_block_is_the_one_the_figures_write():
    from paper import figures

    assert envinfo.README_BLOCK == (figures.README_START, figures.README_END)


def test_a_copy_inside_another_repository_records_no_commit_of_it(tmp_path, monkeypatch):
    """An exported copy placed inside another git checkout: that checkout's commit is not this code's."""
    outer = tmp_path / "other"
    _committed_checkout(outer)
    copy = outer / "vendored" / "jevlab"
    copy.mkdir(parents=True)
    (copy / "code.py").write_text("x = 1\n")
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state(copy) == {"git_commit": "unknown", "git_dirty": True, "git_source": "none"}
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state(copy) == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}


def test_the_senders_variables_win_over_a_copys_own_git(tmp_path, monkeypatch):
    """A lent GPU machine's copy carried a stale `.git` of its own: the variables the sender set name the code."""
    _committed_checkout(tmp_path)
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state(tmp_path)["git_source"] == "git"
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state(tmp_path) == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}


def test_layer_ranges_hooks_leave_inputs_and_outputs_alone(monkeypatch):
    """nvtx push/pop return the range depth; a hook that passed it on would replace the module's input or output
    (this broke every timed workload of the first H200 run)."""
    import torch

    from ablations import timing

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: 1)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: 0)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(5, 8)
    expected = model(x)

    class Holder:
        pass

    holder = Holder()
    holder.model = model
    with timing.layer_ranges(holder, True) as count:
        got = model(x)
    assert count > 0
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------- bit identity
def bit_identity_result(**changes) -> dict:
    """A `record["bit_identity"]` of two rows (numbers made up for the schema tests only)."""
    rows = [
        {"layer": 0, "kernel": "silu_mul", "output": "out", "elements": 1000, "bit_identical": 1000, "share": 1.0,
         "max_ulp": 0, "max_abs_diff": 0.0, "unwritten": 0, "expected": "bitwise", "as_expected": True},
        {"layer": 3, "kernel": "attn_prep", "output": "q", "elements": 1000, "bit_identical": 999, "share": 0.999,
         "max_ulp": 1, "max_abs_diff": 4.9e-4, "unwritten": 0, "expected": "<= 1 ulp in >= 99.99 %",
         "as_expected": False},
    ]  # fmt: skip
    result = {"workload": "drone", "reference": "hf_torch", "candidates": 7, "tokens": 971, "interpreter": True,
              "layers": [{"index": 0, "type": "linear_attention"}, {"index": 3, "type": "full_attention"}],
              "note": "CPU: interpreter", "error": None, "seconds": 1.0, "rows": rows}  # fmt: skip
    result.update(changes)
    return result


def test_a_record_with_a_bit_identity_table_validates():
    records.validate_record(small_record(bit_identity=bit_identity_result()))
    failed = bit_identity_result(rows=[], error="RuntimeError: boom")
    records.validate_record(small_record(bit_identity=failed))


def _row(result: dict, i: int = 1) -> dict:
    return result["rows"][i]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: _row(b).update(share=0.5), "share: 0.5 is not bit_identical / elements"),
        (lambda b: _row(b).update(bit_identical=1001, share=1.001), "0 <= bit_identical <= elements"),
        (lambda b: _row(b).update(layer=7), "is not one of the listed layers"),
        (lambda b: _row(b).update(max_ulp=1.0), "max_ulp: expected int"),
        (lambda b: _row(b).pop("as_expected"), "as_expected: missing"),
        (lambda b: b.update(rows=[]), "no rows and no error"),
        (lambda b: b.update(error="boom"), "rows and an error at once"),
        (lambda b: b.pop("interpreter"), "interpreter: missing"),
        (lambda b: b["layers"].append({"index": "5"}), r"layers\[2\]\.index: expected int"),
    ],
)
def test_a_damaged_bit_identity_table_is_rejected(damage, message):
    result = bit_identity_result()
    damage(result)
    with pytest.raises(records.RecordError, match=message):
        records.validate_record(small_record(bit_identity=result))


def test_summary_lines_report_the_bit_identity_step():
    record = small_record(bit_identity=bit_identity_result())
    _timed(record)["floor_multiple"] = 7.0
    _stage(record)["workload_errors"] = []
    lines = "\n".join(summary_lines(record))
    assert "bit identity of the fused kernels on drone (layers 0, 3): 1/2 outputs as expected" in lines
    assert "not as expected: 3:attn_prep.q" in lines and "[Triton interpreter]" in lines
    record["bit_identity"] = bit_identity_result(rows=[], error="RuntimeError: boom")
    assert summary_lines(record)[-1].endswith("failed: RuntimeError: boom")
    del record["bit_identity"]
    assert not any("bit identity" in line for line in summary_lines(record))


def _bit_identity_run(tmp_path, stages: list[str]):
    """A cpu-tiny Run at the point where the reference outputs exist: tiny weights, a short stand-in for drone's
    token ids (two candidates of 6 and 4 real tokens), valid weights and ceilings entries."""
    from types import SimpleNamespace

    from ablations.run import Run, parse_args
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    run = Run(load_plan("cpu-tiny"), in_ladder_order(stages), resolve(["drone"]),
              parse_args(["--results", str(tmp_path), "--no-progress"]))  # fmt: skip
    run.weights = synthetic_weights(TINY, seed=0)
    run.ctx = BuildContext(run.weights)
    run.record["weights"] = {"synthetic": True, "method": "synthetic_weights", "linear_params": 1}
    run.record["ceilings"] = {"copy_tbps": 1.0, "bf16_tflops": 1.0}
    generator = torch.Generator().manual_seed(4)
    candidates = [torch.randint(0, 248320, (n,), generator=generator).tolist() for n in (6, 4)]
    run.decision_plans["drone"] = SimpleNamespace(candidates=candidates, groups=[0, 0])
    return run


def test_the_runner_records_the_bit_identity_table_when_the_plan_has_the_fused_stage(tmp_path):
    run = _bit_identity_run(tmp_path, ["hf_torch", "fused"])
    run.measure_bit_identity()
    result = run.record["bit_identity"]
    assert result["error"] is None, result["error"]
    assert [layer["index"] for layer in result["layers"]] == [0, 3]  # CPU plan: the first GDN and attention layer
    assert (result["workload"], result["reference"], result["candidates"], result["tokens"]) == ("drone", "hf_torch",
                                                                                                   2, 10)  # fmt: skip
    assert result["interpreter"] and "interpreter" in result["note"]
    kernels = {row["kernel"] for row in result["rows"]}
    assert kernels == {"silu_mul", "residual_rmsnorm", "gdn_prep", "gated_rmsnorm", "attn_prep", "attention_gate"}
    assert all(row["as_expected"] for row in result["rows"]), [r for r in result["rows"] if not r["as_expected"]]
    assert records.read_record(run.path)["bit_identity"] == result  # written, and valid
    run.measure_bit_identity()  # once per run
    assert run.record["bit_identity"] is result


def test_a_failing_bit_identity_step_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    from ablations import bit_identity

    def broken(*args, **kwargs):
        raise RuntimeError("capture broke")

    monkeypatch.setattr(bit_identity, "capture_activations", broken)
    run = _bit_identity_run(tmp_path, ["hf_torch", "fused"])
    run.measure_bit_identity()
    result = run.record["bit_identity"]
    assert result["error"] == "RuntimeError: capture broke" and result["rows"] == []
    records.read_record(run.path)


def test_no_bit_identity_step_without_the_fused_stage(tmp_path):
    run = _bit_identity_run(tmp_path, ["hf_torch", "merged"])
    run.measure_bit_identity()
    assert "bit_identity" not in run.record


# ------------------------------------------------------------------------------------- per-state divergence
def test_compare_states_finds_the_first_departing_state():
    from ablations.run import compare_states

    generator = torch.Generator().manual_seed(11)
    reference = [torch.randn(7, 5, generator=generator).bfloat16() for _ in range(6)]
    same = [state.clone() for state in reference]
    assert compare_states(same, reference) == {"state_rel_rmse": [0.0] * 6, "first_departing_state": None}
    moved = [state.clone() for state in reference]
    moved[3][2, 4] = moved[3][2, 4] * 1.5 + 0.25
    moved[5] = -moved[5]
    result = compare_states(moved, reference)
    assert result["first_departing_state"] == 3
    assert result["state_rel_rmse"][:3] == [0.0] * 3 and result["state_rel_rmse"][4] == 0.0
    assert 0 < result["state_rel_rmse"][3] < 1 and result["state_rel_rmse"][5] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="states against"):
        compare_states(moved[:5], reference)
    with pytest.raises(ValueError, match="shape"):
        compare_states([s[:6] for s in moved], reference)


@pytest.mark.slow
def test_the_runner_compares_every_residual_state_of_the_headline(tmp_path):
    """Tiny twin: hf_torch (the cpu-tiny reference) and merged keep their headline states; the comparison lands on
    the headline's workload results, the reference's own at zero, merged's departing after the (bitwise) embedding."""
    from ablations.run import compare_states
    from reference.service import DecisionModel

    run = _bit_identity_run(tmp_path, ["hf_torch", "merged"])
    reference_backbone = build_backbone("hf_torch", run.ctx)
    plan = DecisionModel(reference_backbone, run.weights).plan(resolve(["drone"])[0].request)  # the real 971 tokens
    for name in ("hf_torch", "merged"):
        backbone = build_backbone(name, run.ctx)
        with torch.inference_mode():
            run.keep_states(name, backbone, backbone.prepare(plan.candidates, plan.groups))
        run.entry(name)["workloads"].append({"id": "drone"})
        run.update_comparisons()
    reference, merged = (run.entry(name)["workloads"][0] for name in ("hf_torch", "merged"))
    layers = run.weights.shapes.num_layers
    assert reference["state_rel_rmse"] == [0.0] * (layers + 2) and reference["first_departing_state"] is None
    assert len(merged["state_rel_rmse"]) == layers + 2 and merged["state_rel_rmse"][0] == 0.0
    first = merged["first_departing_state"]  # measured on this CPU: merged ends 5.3e-3 from hf_torch on drone
    assert first is not None and first >= 1 and merged["state_rel_rmse"][:first] == [0.0] * first
    assert 0 < max(merged["state_rel_rmse"]) < 0.05
    assert run.headline_states == {}  # compared once, then dropped
    assert compare_states(run.reference_states, run.reference_states)["first_departing_state"] is None


def test_the_record_names_the_plan_workloads_a_run_leaves_out(tmp_path):
    run = _bit_identity_run(tmp_path, ["hf_torch"])
    plan_ids = [w.id for w in resolve(load_plan("cpu-tiny").workloads)]
    assert run.record["plan"]["requested_workloads"] == ["drone"]
    assert run.record["plan"]["omitted_workloads"] == [i for i in plan_ids if i != "drone"]
    assert "drone" in plan_ids and len(plan_ids) > 1


def test_a_stage_is_compared_with_the_stage_it_builds_on():
    from ablations.run import Outputs, compare_with_base

    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 8, generator=generator)
    base = Outputs(hidden, [[0.25, 0.75], [0.6, 0.4]])
    same = compare_with_base(Outputs(hidden.clone(), [[0.25, 0.75], [0.6, 0.4]]), base, "fused")
    assert same["stage"] == "fused" and same["bitwise"] is True and same["max_abs_dp"] == 0.0
    nudged = hidden.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(float("inf")))
    moved = compare_with_base(Outputs(nudged, [[0.25, 0.75], [0.4, 0.6]]), base, "fused")
    assert moved["bitwise"] is False and moved["argmax_flips"] == 1 and moved["max_abs_dp"] == pytest.approx(0.2)
    padded = compare_with_base(Outputs(torch.randn(5, 8, generator=generator), [[0.5, 0.5]]), base, "hf_fla")
    assert padded == {"stage": "hf_fla", "bitwise": None}
