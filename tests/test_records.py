"""The run-record schema (ablations/records.py): validator, writer, readers, the bit-identity table, attempts record.

Records are built by `tests.cases.small_record` (numbers made up for the schema tests only).
"""

from __future__ import annotations

import math

import pytest

from ablations import records
from tests.cases import bit_identity_result, first_stage, first_timed, small_record


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


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: r.update(schema="jevlab-run/0"), "record.schema"),
        (lambda r: first_timed(r).update(median_ms="10.5"), "median_ms: expected number"),
        (lambda r: first_timed(r).update(median_ms=math.nan), "median_ms: expected number"),
        (lambda r: first_timed(r).update(median_ms=10.0), "is not the median of samples_ms"),
        (lambda r: first_timed(r).update(p10_ms=11.0), "p10_ms <= median_ms <= p90_ms"),
        (lambda r: first_timed(r).update(samples_ms=[]), "non-empty list of positive numbers"),
        (lambda r: first_timed(r).update(rows=971.0), "rows: expected int"),
        (lambda r: first_timed(r).update(max_abs_dp=None), "compares every timed workload"),
        (lambda r: first_stage(r).update(status="fast"), "is not one of"),
        (lambda r: first_stage(r).update(status="pending"), "no pending stage"),
        (lambda r: first_stage(r).update(status="gate-red"), "says why"),
        (lambda r: first_stage(r).update(status="gate-red", reason="red"), "only an ok"),
        (lambda r: first_stage(r)["gate"].update(outcome="red"), "timed although its gate is red"),
        (lambda r: first_stage(r).update(gate=None), "timed without a gate"),
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
    first_timed(record)["max_abs_dp"] = None
    first_stage(record)["status"] = "pending"
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
    assert records.notebook_record(runs, "other")["env"]["utc"] == "2026-11-30T09:00:00Z"
    assert records.notebook_record(runs, "gpu-27b")["env"]["utc"] == "2026-11-30T11:00:00Z"  # no such plan: newest
    with pytest.raises(SystemExit, match="no complete run record"):
        records.notebook_record(tmp_path / "empty", "cpu-tiny")


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


# ----------------------------------------------------------------------------------------------- bit identity
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
