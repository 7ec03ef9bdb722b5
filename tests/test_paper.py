"""Figures and the report from small fake run records in a temporary results folder (CPU, no model).

The records are made up for these tests (numbers chosen so speed-ups are easy to check) and written through the same
writer and validator as real ones.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import typst

from ablations import records
from ablations.registry import STAGE_LIST, get_stage
from paper import build, figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = ["Method", "Environment", "Latency ladder", "Kernels and GPU-busy time", "Correctness", "Stages",
            "Failed attempts", "Limits"]  # fmt: skip


def timed(workload_id: str, median: float, *, gpu: bool, rows: int = 971) -> dict:
    samples = [median * f for f in (0.97, 0.99, 1.0, 1.02, 1.1)]
    return {
        "id": workload_id,
        "rows": rows,
        "median_ms": statistics.median(samples),
        "p10_ms": float(np.percentile(samples, 10)),
        "p90_ms": float(np.percentile(samples, 90)),
        "samples_ms": samples,
        "kernels_per_forward": 4000.0 if gpu else None,
        "gpu_busy_ms": median * 0.6 if gpu else None,
        "floor_ms": 11.5,
        "max_abs_dp": 1e-3,
        "hidden_rel_rmse": 2e-3,
        "argmax_flips": 0,
    }


def fake_record(plan: str, utc: str, *, gpu: bool, medians: dict[str, float | None]) -> dict:
    """A complete record; a stage with median None is recorded gate-red."""
    stages = []
    for name, median in medians.items():
        gate = {"node": get_stage(name).gate, "outcome": "green" if median else "red", "exit_code": 0 if median else 1}
        entry = {"name": name, "status": "ok" if median else "gate-red", "reason": None if median else "gate red",
                 "gate": gate, "registry": get_stage(name).describe(), "workload_errors": [],
                 "workloads": [timed("drone", median, gpu=gpu), timed("customer_service", 3 * median, gpu=gpu)]
                 if median else []}  # fmt: skip
        stages.append(entry)
    reference = "hf_fla" if gpu else "hf_torch"
    return {
        "schema": records.SCHEMA,
        "complete": True,
        "plan": {"name": plan, "device": "cuda" if gpu else "cpu", "shapes": "qwen3.8-27b" if gpu else "tiny",
                 "reference": reference, "baseline": reference, "headline": "drone",
                 "timer": "cuda-events" if gpu else "perf-counter", "warmup": 3, "runs": 30,
                 "description": "test plan", "notes": ""},
        "env": {"gpu": "NVIDIA H200" if gpu else None, "driver": "580.1" if gpu else None, "torch": "2.11.0",
                "triton": "3.6.0", "cuda": "13.0" if gpu else None, "git_commit": "0123456789abcdef",
                "git_dirty": False, "utc": utc, "device": "cuda" if gpu else "cpu", "cpu": "Test CPU", "cpu_count": 16},
        "weights": {"synthetic": True, "method": "synthetic_weights", "linear_params": 24_000_000_000,
                    "shapes": "qwen3.8-27b", "seed": 0, "statement": "Synthetic weights."},
        "ceilings": {"copy_tbps": 4.2, "bf16_tflops": 750.0, "gemm_n": 8192},
        "workloads": [{"id": "drone", "questions": 3, "candidates": 7, "tokens": 971},
                      {"id": "customer_service", "questions": 8, "candidates": 8, "tokens": 4637}],
        "stages": stages,
        "registry": [stage.describe() for stage in STAGE_LIST],
        "attempts": [],
    }  # fmt: skip


GPU_MEDIANS = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": 50.0, "fused": None}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    older = fake_record("gpu-27b", "2026-11-30T09:00:00Z", gpu=True, medians={"hf_torch": 170.0, "hf_fla": 110.0})
    records.write_record(older, runs / "older.json")
    records.write_record(
        fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=GPU_MEDIANS), runs / "new.json"
    )
    running = fake_record("gpu-27b", "2026-11-30T11:00:00Z", gpu=True, medians=GPU_MEDIANS) | {"complete": False}
    records.write_record(running, runs / "running.json")
    cpu = fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False, medians={"hf_torch": 30.0, "merged": 40.0})
    records.write_record(cpu, runs / "cpu.json")
    return tmp_path


def test_figures_from_the_newest_complete_record_of_each_plan(results):
    assert figures.main(["--results", str(results)]) == 0
    for plan in ("gpu-27b", "cpu-tiny"):
        for kind in ("ladder", "workloads", "kernels"):
            png = results / "figures" / f"{kind}-{plan}.png"
            assert png.read_bytes()[:8] == PNG_MAGIC, png
    summary = json.loads((results / "figures" / "summary.json").read_text())
    gpu, cpu = summary["plans"]
    assert (gpu["name"], gpu["record"], cpu["name"]) == ("gpu-27b", "runs/new.json", "cpu-tiny")
    assert "CPU plan" in cpu["label"] and cpu["is_cpu"] and not gpu["is_cpu"]
    assert gpu["figures"]["ladder"] == "/figures/ladder-gpu-27b.png"
    assert summary["newest_utc"] == "2026-11-30T10:00:00Z" and summary["synthetic"] is True


def test_ladder_table_speedups_floors_and_untimed_stages(results):
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    (gpu,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    header, *rows = gpu["ladder"]
    by_stage = {row[0]: dict(zip(header, row)) for row in rows}
    assert by_stage["hf_fla"]["× vs hf_fla"] == "1.00×"
    assert by_stage["merged"]["× vs hf_fla"] == "2.00×"
    assert by_stage["hf_torch"]["× vs hf_fla"] == "0.62×"
    assert by_stage["merged"]["× floor"] == "4.3" and by_stage["merged"]["kernels"] == "4,000"
    assert by_stage["fused"]["status"] == "gate-red" and by_stage["fused"]["median ms"] == figures.DASH
    assert by_stage["fused"]["gate"] == "red"
    correctness_stages = {row[0] for row in gpu["correctness"][1:]}
    assert correctness_stages == {"hf_torch", "hf_fla", "merged"}


def test_cpu_record_has_no_kernel_counts(results):
    figures.main(["--results", str(results), "--plan", "cpu-tiny"])
    (cpu,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    header, *rows = cpu["ladder"]
    assert all(dict(zip(header, row))["kernels"] == figures.DASH for row in rows)
    assert ["machine", "CPU only (Test CPU)"] in cpu["environment"]


def test_a_named_record_and_the_results_variable(results, monkeypatch):
    monkeypatch.setenv("JEVLAB_RESULTS", str(results))
    assert figures.main(["--record", str(results / "runs" / "older.json")]) == 0
    (plan,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    assert plan["record"] == "runs/older.json" and plan["utc"] == "2026-11-30T09:00:00Z"


def test_failed_attempts_reach_the_report_table(results):
    path = results / "runs" / "new.json"
    record = json.loads(path.read_text())
    record["attempts"] = [{"id": "splitk-bf16", "stage": "gemm", "title": "split-K with bf16 partials",
                           "outcome": "failed", "reason": "noisier", "numbers": {"max_abs_dp": 0.02},
                           "evidence": "runs/new.json", "date": "2026-11-30"}]  # fmt: skip
    records.write_record(record, path)
    figures.main(["--results", str(results)])
    attempts = json.loads((results / "figures" / "summary.json").read_text())["attempts"]
    assert attempts[1][:4] == ["splitk-bf16", "gemm", "split-K with bf16 partials", "failed"]
    assert attempts[1][5] == "max_abs_dp 0.02"


def _query(results: Path, selector: str, field: str | None = None):
    return json.loads(
        typst.query(
            build.REPORT_SOURCE.read_bytes(),
            selector,
            field=field,
            root=str(results),
            sys_inputs={"summary": "/" + build.SUMMARY},
        )
    )


def test_report_builds_a_pdf_with_every_section_and_the_synthetic_statement(results):
    figures.main(["--results", str(results)])
    pdf = build.build(results)
    assert pdf == results / "report.pdf" and pdf.read_bytes()[:5] == b"%PDF-"
    assert build.build(results, results / "again.pdf").read_bytes() == pdf.read_bytes()  # same results, same PDF
    assert len(_query(results, "<synthetic-weights>")) == 1
    headings = [h["text"] for h in _query(results, "heading.where(level: 1)", "body")]
    assert headings == SECTIONS
    plan_headings = [h["text"] for h in _query(results, "heading.where(level: 2)", "body")]
    assert any("cpu-tiny" in h and "CPU plan" in h for h in plan_headings)
    assert any(h == "gpu-27b on NVIDIA H200" for h in plan_headings)


def test_report_without_records_says_so(tmp_path):
    assert figures.main(["--results", str(tmp_path)]) == 0
    assert build.main(["--results", str(tmp_path)]) == 0
    assert (tmp_path / "report.pdf").read_bytes()[:5] == b"%PDF-"
    assert len(_query(tmp_path, "<no-records>")) == 1


def test_build_needs_the_figures_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="paper.figures"):
        build.build(tmp_path)


def test_readme_markers_are_replaced_and_nothing_else():
    from paper.figures import README_END, README_START, replace_between_markers

    text = f"intro\n{README_START}\nold table\n{README_END}\noutro\n"
    out = replace_between_markers(text, "| new |\n")
    assert out == f"intro\n{README_START}\n| new |\n{README_END}\noutro\n"
    with pytest.raises(ValueError):
        replace_between_markers("no markers here", "x")
    with pytest.raises(ValueError):
        replace_between_markers(text + README_START, "x")


def test_the_readme_carries_the_generated_ladder_of_the_committed_records():
    """README.md's ladder block is exactly what paper.figures writes from the committed records (never hand-edited)."""
    from paper.figures import README_END, README_START, REPO, readme_ladder, replace_between_markers, select_records

    root = REPO / "results"
    readme = (REPO / "README.md").read_text()
    assert replace_between_markers(readme, readme_ladder(select_records(root, None, []), root)) == readme
    assert readme.index(README_START) < readme.index(README_END)


BIT_IDENTITY_HEADING = "Fused kernels against their reference compositions on captured activations"


def bit_identity(error: str | None = None) -> dict:
    """A made-up `record["bit_identity"]`: one bitwise row, one row a few elements off."""
    rows = [
        {"layer": 0, "kernel": "silu_mul", "output": "out", "elements": 33_800_000, "bit_identical": 33_800_000,
         "share": 1.0, "max_ulp": 0, "max_abs_diff": 0.0, "unwritten": 0, "expected": "bitwise", "as_expected": True},
        {"layer": 3, "kernel": "attn_prep", "output": "q", "elements": 1_000_000, "bit_identical": 999_999,
         "share": 0.999999, "max_ulp": 1, "max_abs_diff": 4.9e-4, "unwritten": 0,
         "expected": "<= 1 ulp in >= 99.99 %", "as_expected": True},
    ]  # fmt: skip
    return {"workload": "drone", "reference": "hf_fla", "candidates": 7, "tokens": 971, "interpreter": False,
            "layers": [{"index": 0, "type": "linear_attention"}, {"index": 3, "type": "full_attention"}],
            "note": None, "error": error, "seconds": 2.0, "rows": [] if error else rows}  # fmt: skip


def _with_bit_identity(results: Path, name: str, value: dict) -> None:
    path = results / "runs" / name
    record = json.loads(path.read_text())
    record["bit_identity"] = value
    records.write_record(record, path)


def test_bit_identity_table_reaches_the_summary_and_the_report(results):
    _with_bit_identity(results, "new.json", bit_identity())
    figures.main(["--results", str(results)])
    gpu, cpu = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    bits = gpu["bit_identity"]
    assert (
        bits["measured"]
        and "drone request (7 candidates, 971 real tokens) at layers 0 (GDN), 3 (attention)" in (bits["text"])
    )
    header, bitwise, one_off = bits["table"]
    assert header[:5] == ["layer", "kernel", "output", "elements", "bit-identical"]
    assert bitwise[:7] == ["0", "silu_mul", "out", "33,800,000", "100 %", "0", "0"]
    assert one_off[4] == "99.9999 %" and one_off[-1] == "yes"  # never rounded up to 100 %
    assert not cpu["bit_identity"]["measured"] and cpu["bit_identity"]["text"].startswith("Not measured in this record")
    build.build(results)
    assert len(_query(results, "<bit-identity-table>")) == 1
    assert len(_query(results, "<bit-identity-not-measured>")) == 1
    subheadings = [h["text"] for h in _query(results, "heading.where(level: 3)", "body")]
    assert subheadings.count(BIT_IDENTITY_HEADING) == 2


def test_a_failed_bit_identity_step_is_reported_as_not_measured(results):
    _with_bit_identity(results, "new.json", bit_identity(error="RuntimeError: out of memory"))
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    (gpu,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    assert not gpu["bit_identity"]["measured"]
    assert gpu["bit_identity"]["text"] == "Not measured in this record: the step failed (RuntimeError: out of memory)."
    build.build(results)
    assert "RuntimeError: out of memory" in json.dumps(_query(results, "<bit-identity-not-measured>"))


def test_a_summary_written_before_the_bit_identity_step_still_builds(results):
    """The committed summary.json predates the field: the report says the table is not measured."""
    figures.main(["--results", str(results)])
    path = results / "figures" / "summary.json"
    summary = json.loads(path.read_text())
    for plan in summary["plans"]:
        del plan["bit_identity"]
    path.write_text(json.dumps(summary))
    build.build(results)
    missing = _query(results, "<bit-identity-not-measured>")
    assert len(missing) == 2 and "Not measured in this record" in json.dumps(missing)
    assert not _query(results, "<bit-identity-table>")
