"""The ladder runner (ablations/run.py) on the CPU: comparisons, readout, gates (real pytest subprocesses on throw-away
test files), summary lines, the CLI, the bit-identity step, per-state divergence.

No model runs here except the tiny twin in the bit-identity and divergence steps (the end-to-end tiny-plan run is
`nox -s ablate`).
"""

from __future__ import annotations

import math

import pytest
import torch

from ablations import records
from ablations.plans import load_plan
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
    resolve,
)
from engine.stages import BuildContext, build_backbone, get_stage, in_ladder_order
from tests.cases import bit_identity_result, first_stage, first_timed, small_record


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


GATES_OUT_OF_MEMORY = """import os
import pytest
class OutOfMemoryError(RuntimeError):
    pass
@pytest.fixture(scope="module")
def model():
    if os.environ.get("GATE_HELD_MEMORY"):  # an earlier node of the same process still holds its model
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 170.00 MiB")
    yield 1
def test_holds_memory():
    os.environ["GATE_HELD_MEMORY"] = "1"
def test_needs_memory(model):
    assert model == 1
def test_red_with_memory(model):
    assert model == 2
"""


@pytest.mark.slow
def test_a_gate_that_ran_out_of_cuda_memory_in_setup_runs_again_alone(tmp_path):
    (tmp_path / "test_gates_oom.py").write_text(GATES_OUT_OF_MEMORY)
    first, needs, red = (f"test_gates_oom.py::{name}" for name in ("test_holds_memory", "test_needs_memory",
                                                                     "test_red_with_memory"))  # fmt: skip
    gates = run_gates([first, needs, red], "cpu", timeout_s=120, cwd=tmp_path)
    assert gates[first]["outcome"] == "green" and "alone" not in gates[first]
    assert gates[needs]["outcome"] == "green" and "out of memory" in gates[needs]["alone"]
    assert gates[needs]["command"].endswith(needs)  # judged by its own process
    assert gates[red]["outcome"] == "red" and "alone" in gates[red] and "assert 1 == 2" in gates[red]["output_tail"]
    alone = run_gates([needs], "cpu", timeout_s=120, cwd=tmp_path)[needs]
    assert alone["outcome"] == "green" and "alone" not in alone


def test_summary_lines_show_every_stage():
    record = small_record()
    record["stages"].append({"name": "hf_fla", "status": "unavailable", "reason": "runs on cuda only",
                             "gate": None, "workloads": [], "workload_errors": []})  # fmt: skip
    first_stage(record)["workload_errors"] = []
    first_timed(record)["floor_multiple"] = 7.0
    lines = "\n".join(summary_lines(record))
    assert "hf_torch" in lines and "10.50" in lines and "unavailable  runs on cuda only" in lines
    assert "synthetic weights" in lines
    assert summary_lines(record)[3].endswith(" -")  # a CPU run has no clocks
    first_timed(record)["clocks"] = {"samples": 7, "sm_mhz_median": 1755.0}
    assert summary_lines(record)[3].endswith(" 1755") and "SM MHz" in summary_lines(record)[2]


def test_cli_lists_a_plan_and_refuses_the_gpu_plan_without_cuda(capsys):
    assert main(["--plan", "cpu-tiny", "--list"]) == 0
    out = capsys.readouterr().out
    assert "stage hf_torch" in out and "workload drone" in out
    if not torch.cuda.is_available():
        assert main(["--plan", "gpu-27b"]) == 2


# ----------------------------------------------------------------------------------------------- bit identity
def test_summary_lines_report_the_bit_identity_step():
    record = small_record(bit_identity=bit_identity_result())
    first_timed(record)["floor_multiple"] = 7.0
    first_stage(record)["workload_errors"] = []
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


def test_a_median_under_its_floor_is_flagged_and_the_run_goes_on(tmp_path):
    """Ceilings far too low (1e-9 TB/s streaming): every floor is above the measured median; the workload's result
    says so in `below_floor` and is still recorded with its times (a finding, not a refusal)."""
    from reference.service import DecisionModel

    run = _bit_identity_run(tmp_path, ["merged"])
    backbone = build_backbone("merged", run.ctx)
    run.decision_plans["drone"] = DecisionModel(backbone, run.weights).plan(resolve(["drone"])[0].request)
    run.record["ceilings"] = {"copy_tbps": 1e-9, "stream_tbps": 1e-9, "bf16_tflops": 1e-9}
    run.head_weight, run.head_bias = run.weights.head_weight, run.weights.head_bias
    run.linear_params = run.weights.shapes.linear_params()
    stage = get_stage("merged")
    result, _ = run.measure(stage, backbone, resolve(["drone"])[0])
    assert result["median_ms"] < result["floor_ms"] and len(result["samples_ms"]) == run.runs
    assert result["wall_s"] * 1e3 > sum(result["samples_ms"])  # every call of the workload, the timed ones among them
    assert result["below_floor"].startswith(f"{result['median_ms']:.4g} ms is under its floor")
    run.record["ceilings"] = {"copy_tbps": 1e9, "stream_tbps": 1e9, "bf16_tflops": 1e9}
    result, _ = run.measure(stage, backbone, resolve(["drone"])[0])
    assert result["below_floor"] is None


def test_capture_workloads_takes_only_the_buckets_of_the_runs_workloads(tmp_path):
    """`--capture workloads`: the buckets the workloads are padded to, all in the grid, fewer than the grid."""
    from engine.graphs import default_grid

    run = _bit_identity_run(tmp_path, ["graphs"])
    buckets = run.workload_buckets(build_backbone("graphs", run.ctx))
    assert buckets and buckets <= set(default_grid()) and len(buckets) < len(default_grid())
