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

from ablations import records, targets
from engine.stages import STAGE_LIST, get_stage
from paper import build, figures, readme, serving, tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = ["Method", "Records", "Serving", "Failed attempts", "Limits"]
PARTIAL_TEXT = (
    "partial run: stopped before completion; fused pending: timed on 1 of 2 workloads; tree not reached (run stopped)"
)


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
# (gemm, gdn_core, attention_core, ours, other) kernel ms and the host launch ms of the headline, per stage.
FAMILY_MS = {"hf_torch": (90.0, 0.0, 2.0, 0.0, 60.0, 150.0), "hf_fla": (60.0, 5.0, 2.0, 0.0, 25.0, 95.0),
             "merged": (50.0, 5.0, 2.0, 0.0, 20.0, 78.0), "fused": (40.0, 5.0, 1.0, 4.0, 1.0, 45.0)}  # fmt: skip


def add_families(w: dict, gemm: float, gdn: float, attention: float, ours: float, other: float, host: float) -> None:
    """Per-family kernel times (as the GPU runner writes them) on a timed workload."""
    ms_by_family = {"gemm": gemm, "gdn_core": gdn, "attention_core": attention, "ours": ours, "other": other}
    w["kernel_families"] = {f: {"calls_per_forward": 10.0 * i, "ms_per_forward": v}
                            for i, (f, v) in enumerate(ms_by_family.items())}  # fmt: skip
    core = gemm + gdn + attention
    w |= {"core_ms": core, "core_multiple": w["median_ms"] / core, "gemm_ms": gemm,
          "gemm_multiple": w["median_ms"] / gemm, "host_median_ms": host}  # fmt: skip


def partial_record(utc: str, plan: str = "gpu-27b") -> dict:
    """A run stopped inside `fused`: hf_torch, hf_fla, merged on both workloads, fused on the headline only, tree not
    reached; the headline carries per-family kernel times (FAMILY_MS) and host launch times."""
    medians = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": 80.0, "fused": 60.0, "tree": 40.0}
    record = fake_record(plan, utc, gpu=True, medians=medians) | {"complete": False}
    for stage in record["stages"]:
        if stage["name"] in FAMILY_MS:
            add_families(stage["workloads"][0], *FAMILY_MS[stage["name"]])
    fused, tree = record["stages"][3], record["stages"][4]
    fused |= {"status": "pending", "workloads": fused["workloads"][:1]}
    tree |= {"status": "pending", "workloads": []}
    return record


@pytest.fixture
def results(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    older = fake_record("gpu-27b", "2026-11-30T09:00:00Z", gpu=True, medians={"hf_torch": 170.0, "hf_fla": 110.0})
    records.write_record(older, runs / "older.json")
    records.write_record(
        fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=GPU_MEDIANS), runs / "new.json"
    )
    records.write_record(partial_record("2026-11-30T11:00:00Z"), runs / "running.json")
    cpu = fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False, medians={"hf_torch": 30.0, "merged": 40.0})
    records.write_record(cpu, runs / "cpu.json")
    return tmp_path


def test_figures_from_the_newest_complete_record_and_a_newer_partial_one(results):
    assert figures.main(["--results", str(results)]) == 0
    for name in ("gpu-27b-partial", "gpu-27b", "cpu-tiny"):
        for kind in figures.FIGURES:
            png = results / "figures" / f"{kind}-{name}.png"
            assert png.read_bytes()[:8] == PNG_MAGIC, png
    summary = json.loads((results / "figures" / "summary.json").read_text())
    partial, gpu, cpu = summary["plans"]
    assert [p["record"] for p in summary["plans"]] == ["runs/running.json", "runs/new.json", "runs/cpu.json"]
    assert (partial["name"], gpu["name"], cpu["name"]) == ("gpu-27b", "gpu-27b", "cpu-tiny")
    assert "CPU plan" in cpu["label"] and cpu["is_cpu"] and not gpu["is_cpu"]
    assert gpu["figures"]["ladder"] == "/figures/ladder-gpu-27b.png"
    assert partial["figures"]["time"] == "/figures/time-gpu-27b-partial.png"
    assert (partial["partial"], gpu["partial"], cpu["partial"]) == (True, False, False)
    assert partial["label"] == "gpu-27b on NVIDIA H200 — partial run" and gpu["label"] == "gpu-27b on NVIDIA H200"
    assert (partial["completeness"], gpu["completeness"]) == (PARTIAL_TEXT, "complete run")
    assert summary["newest_utc"] == "2026-11-30T11:00:00Z"
    assert (partial["headline_stages"], gpu["headline_stages"]) == (["hf_torch", "hf_fla", "merged", "fused"],
                                                                    ["hf_torch", "hf_fla", "merged"])  # fmt: skip


def _write(runs: Path, name: str, record: dict) -> None:
    records.write_record(record, runs / name)


def test_a_partial_record_older_than_the_newest_complete_one_is_ignored(tmp_path):
    _write(tmp_path / "runs", "partial.json", partial_record("2026-11-30T09:30:00Z"))
    _write(tmp_path / "runs", "complete.json", fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True,
                                                           medians=GPU_MEDIANS))  # fmt: skip
    chosen = figures.select_records(tmp_path, None, [])
    assert [path.name for path, _ in chosen] == ["complete.json"]


def test_a_newer_record_without_the_headline_workload_is_not_chosen_and_omissions_are_labelled(tmp_path):
    with_headline = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=GPU_MEDIANS)
    with_headline["plan"]["omitted_workloads"] = ["synthetic-1024-choice-32"]
    _write(tmp_path / "runs", "main.json", with_headline)
    split = fake_record("gpu-27b", "2026-11-30T11:00:00Z", gpu=True, medians=GPU_MEDIANS)
    split["plan"]["omitted_workloads"] = ["drone"]
    _write(tmp_path / "runs", "split.json", split)
    chosen = figures.select_records(tmp_path, None, [])
    assert [path.name for path, _ in chosen] == ["main.json"]
    assert tables.completeness(with_headline) == "complete run (without synthetic-1024-choice-32: not requested)"


def test_a_newer_record_of_some_stages_is_not_chosen_but_settles_an_errored_tree_workload(tmp_path):
    """A rerun of two stages (`--stages fused,tree`) is not the ladder; the targets take from it the tree-vs-fused
    comparison of a workload on which tree errored in the ladder, and name both records."""
    medians = {"hf_fla": 100.0, "fused": 60.0, "tree": 40.0}
    ladder = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=medians)
    ladder["plan"]["stages"] = list(medians)
    tree = tables.stage_by_name(ladder, "tree")
    errored = tree["workloads"].pop(1)
    tree["workload_errors"] = [{"id": errored["id"], "error": "RuntimeError: PassManager::run failed"}]
    tree["workloads"][0]["vs_builds_on"] = {"stage": "fused", "bitwise": True, "max_abs_dp": 0.0}
    rerun = fake_record("gpu-27b", "2026-11-30T11:00:00Z", gpu=True, medians={"fused": 60.0, "tree": 40.0})
    rerun["plan"] |= {"stages": list(medians), "requested_stages": ["fused", "tree"]}
    _write(tmp_path / "runs", "ladder.json", ladder)
    _write(tmp_path / "runs", "rerun.json", rerun)
    assert [path.name for path, _ in figures.select_records(tmp_path, None, [])] == ["ladder.json"]

    def identity() -> dict:
        rows = targets.evaluate(ladder, tables.followups(ladder, tmp_path))
        return next(row for row in rows if row["id"] == "tree_bitwise_vs_fused")

    row = identity()  # the rerun's tree has no vs_builds_on for it: not compared, so not met
    assert (row["outcome"], row["measured"]) == ("missed", "1 of 2 workloads")
    assert f"tree errored on {errored['id']} (RuntimeError: PassManager::run failed), not compared" in row["note"]
    for w in tables.stage_by_name(rerun, "tree")["workloads"]:
        w["vs_builds_on"] = {"stage": "fused", "bitwise": True, "max_abs_dp": 0.0}
    _write(tmp_path / "runs", "rerun.json", rerun)
    row = identity()
    assert (row["outcome"], row["measured"]) == ("met", "2 of 2 workloads")
    assert row["note"].endswith(f"tree errored on {errored['id']} here (RuntimeError: PassManager::run failed); "
                                "bitwise in runs/rerun.json")  # fmt: skip


def test_a_plan_with_only_a_partial_record_gets_it_and_only_the_newest_partial(tmp_path):
    _write(tmp_path / "runs", "first.json", partial_record("2026-11-30T09:00:00Z"))
    _write(tmp_path / "runs", "second.json", partial_record("2026-11-30T09:30:00Z"))
    _write(tmp_path / "runs", "cpu.json", fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False,
                                                      medians={"hf_torch": 30.0}))  # fmt: skip
    chosen = figures.select_records(tmp_path, None, [])
    assert [path.name for path, _ in chosen] == ["second.json", "cpu.json"]
    assert figures.main(["--results", str(tmp_path), "--plan", "gpu-27b"]) == 0
    (plan,) = json.loads((tmp_path / "figures" / "summary.json").read_text())["plans"]
    assert plan["partial"] and plan["figures"]["ladder"] == "/figures/ladder-gpu-27b-partial.png"
    assert not (tmp_path / "figures" / "ladder-gpu-27b.png").exists()


def test_a_named_partial_record_is_labelled_partial(results):
    assert figures.main(["--results", str(results), "--record", str(results / "runs" / "running.json")]) == 0
    (plan,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    assert plan["partial"] and plan["completeness"] == PARTIAL_TEXT


def _titles(monkeypatch) -> list[str]:
    """Per figure drawn (in order), its titles and texts joined (figures._save is wrapped for the test)."""
    texts, save = [], figures._save

    def keep_texts(fig, path):
        parts = [fig.get_suptitle(), *(ax.get_title() for ax in fig.axes)]
        parts += [text.get_text() for ax in fig.axes for text in ax.texts]
        texts.append(" | ".join(parts))
        save(fig, path)

    monkeypatch.setattr(figures, "_save", keep_texts)
    return texts


def test_partial_figures_say_so_and_draw_the_pending_stage_where_it_was_timed(results, monkeypatch):
    texts = _titles(monkeypatch)
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    partial_titles, complete_titles = texts[: len(figures.FIGURES)], texts[len(figures.FIGURES) :]
    assert all(PARTIAL_TEXT.upper() in t for t in partial_titles)
    assert not any("PARTIAL" in t for t in complete_titles)
    assert "not reached\n(run stopped)" in partial_titles[0]  # the ladder's tree slot
    (partial, _) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    header, *rows = partial["ladder"]
    by_stage = {row[0]: dict(zip(header, row)) for row in rows}
    assert by_stage["fused"]["status"] == "pending: timed on 1 of 2 workloads"
    assert by_stage["fused"]["median ms"] == "60.00" and by_stage["fused"]["× vs hf_fla"] == "1.67×"
    assert by_stage["tree"]["status"] == "not reached (run stopped)" and by_stage["tree"]["median ms"] == records.DASH
    assert "fused (partial: 1 of 2)" in {row[0] for row in partial["exactness"][1:]}
    assert "tree (not reached (run stopped))" in {row[0] for row in partial["exactness"][1:]}


def test_kernel_profile_families_idle_and_host_time(results, monkeypatch):
    texts = _titles(monkeypatch)
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    rows = {r["heading"]: r for r in tables.time_rows(records.read_record(results / "runs" / "running.json"))}
    assert list(rows) == ["hf_torch", "hf_fla", "merged", "fused (partial: 1 of 2)"]
    fused = rows["fused (partial: 1 of 2)"]
    assert list(fused["families"]) == list(tables.FAMILIES) and fused["families"]["ours"]["ms_per_forward"] == 4.0
    assert fused["idle_ms"] == 9.0  # 60 - (40 + 5 + 1 + 4 + 1)
    assert fused["host_median_ms"] == 45.0 and fused["core_multiple"] == pytest.approx(60.0 / 46.0)
    assert rows["hf_torch"]["idle_ms"] == 8.0 and rows["hf_fla"]["idle_ms"] == 8.0
    assert tables.time_rows(records.read_record(results / "runs" / "new.json")) == []
    time_texts = [t for t in texts if "Where the time goes" in t]
    assert len(time_texts) == 2 and tables.NO_FAMILIES in time_texts[1]


def test_gpu_idle_is_clipped_at_zero():
    record = partial_record("2026-11-30T11:00:00Z")
    add_families(record["stages"][0]["workloads"][0], 100.0, 0.0, 10.0, 0.0, 60.0, 150.0)  # 170 ms of kernels > 160
    (first, *_) = tables.time_rows(record)
    assert first["kernel_ms"] == 170.0 and first["idle_ms"] == 0.0


def test_family_order_is_the_runners():
    from ablations.timing import CORE_FAMILIES, FAMILIES

    assert set(tables.FAMILIES) == set(FAMILIES) and set(CORE_FAMILIES) <= set(tables.FAMILIES)


def _outcomes(record: dict) -> dict[str, str]:
    return {row["id"]: row["outcome"] for row in targets.evaluate(record)}


def _headline(record: dict, stage: str) -> dict:
    return figures.measured(tables.stage_by_name(record, stage), "drone")


GRAPHS_NOT_TIMED = {t.id: "not measured" for t in targets.TARGETS if t.stage in ("graphs", "gemm", "core")}


def test_graphs_targets_are_measured_on_the_newest_run_that_timed_graphs():
    """The issue-13 targets: medians against their limits, the speed-up over hf_fla, the worst median over the
    exact-plan graph among the workloads a graph served; a record without `graphs` takes them from the newest
    follow-up record that timed it, and the note names that record."""
    ladder = fake_record(
        "gpu-27b",
        "2026-11-30T10:00:00Z",
        gpu=True,
        medians={"hf_torch": 160.0, "hf_fla": 100.0, "merged": 80.0, "fused": 60.0, "tree": 40.0},
    )
    later = fake_record("gpu-27b", "2026-12-01T10:00:00Z", gpu=True, medians={"hf_fla": 140.0, "graphs": 40.0})
    graphs = tables.stage_by_name(later, "graphs")
    for w, exact in zip(graphs["workloads"], (37.0, 105.0), strict=True):  # medians 40 and 120 ms
        w |= {"exact_graph_ms": exact, "graph": {"bucket": "r352-s1090-c16", "hit": True, "eager_reasons": []}}
    path = Path("results/runs/later.json")
    rows = {row["id"]: row for row in targets.evaluate(ladder, [(path, later)])}
    assert rows["graphs_drone_ms"]["outcome"] == "met" and rows["graphs_drone_ms"]["value"] == 40.0
    assert rows["graphs_drone_ms"]["note"].startswith(
        "from runs/later.json (a later run of the plan that timed graphs)"
    )
    assert rows["graphs_vs_hf_fla"]["outcome"] == "met" and rows["graphs_vs_hf_fla"]["measured"] == "0.286 (3.50x)"
    assert rows["graphs_padding_cost"]["value"] == pytest.approx(120.0 / 105.0)
    assert rows["graphs_padding_cost"]["outcome"] == "missed"  # 1.14x > 1.10x on the second workload
    assert rows["graphs_easy_fact_ms"]["outcome"] == "not measured"  # that workload is not in these records
    assert {row["id"]: row["outcome"] for row in targets.evaluate(ladder)}["graphs_drone_ms"] == "not measured"
    graphs["workloads"][1]["graph"]["hit"] = False  # served eagerly: no padding cost to judge there
    rows = {row["id"]: row for row in targets.evaluate(ladder, [(path, later)])}
    assert rows["graphs_padding_cost"]["outcome"] == "met" and rows["graphs_padding_cost"]["value"] == 40.0 / 37.0


def test_later_ladders_show_registry_stages_only():
    """A later run's stage that the registry holds is shown as a later ladder; one since dropped from the registry (its
    record kept as an attempt's evidence) is not."""
    ladder = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians={"hf_fla": 100.0, "tree": 40.0})
    later = fake_record("gpu-27b", "2026-12-01T10:00:00Z", gpu=True, medians={"hf_fla": 100.0, "graphs": 38.0})
    dropped = fake_record("gpu-27b", "2026-12-02T10:00:00Z", gpu=True, medians={"hf_fla": 100.0, "core": 35.0})
    tables.stage_by_name(dropped, "core")["name"] = "pdl"  # a stage name the registry no longer has
    shown = tables.later_stage_ladders(ladder, [(Path("runs/a.json"), later), (Path("runs/b.json"), dropped)], Path())
    assert [entry["stages"] for entry in shown] == [["graphs"]]


def test_targets_met_missed_and_not_measured():
    medians = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": 80.0, "fused": 60.0, "tree": 40.0}
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=medians)
    fused, tree, merged = _headline(record, "fused"), _headline(record, "tree"), _headline(record, "merged")
    add_families(fused, 40.0, 5.0, 5.0, 4.0, 1.0, 45.0)  # core 50 ms: 60 / 50 = 1.2x > 1.10
    fused |= {"kernels_per_forward": 700.0, "max_abs_dp": 1e-3}  # exactly at the kernel target: met
    _headline(record, "hf_torch")["max_abs_dp"] = 2e-3
    merged["rows"], tree["rows"] = 1000, 450  # 45.0 % of the packed rows: met
    assert _outcomes(record) == {"fused_kernels": "met", "fused_core_multiple": "missed", "fused_fidelity": "met",
                                 "tree_gemm_multiple": "not measured", "tree_rows_share": "met",
                                 "tree_bitwise_vs_fused": "not measured",
                                 "tree_handoff_core_time": "not measured",  # no probes in this record
                                 **GRAPHS_NOT_TIMED}  # fmt: skip
    tree_stage, fused_stage = tables.stage_by_name(record, "tree"), tables.stage_by_name(record, "fused")
    for w in fused_stage["workloads"]:
        w["probabilities"] = [[0.25, 0.75]]
    for w in tree_stage["workloads"]:  # an older record: equal probabilities stand for equal bits
        w["probabilities"] = [[0.25, 0.75]]
    identity = {row["id"]: row for row in targets.evaluate(record)}["tree_bitwise_vs_fused"]
    assert (identity["outcome"], identity["measured"]) == ("met", "2 of 2 workloads")
    assert identity["note"] == "every workload compared; from equal probabilities (record older than vs_builds_on)"
    tree_stage["workloads"][1]["vs_builds_on"] = {"stage": "fused", "bitwise": False, "max_abs_dp": 3e-3}
    identity = {row["id"]: row for row in targets.evaluate(record)}["tree_bitwise_vs_fused"]
    assert (identity["outcome"], identity["measured"]) == ("missed", "1 of 2 workloads")
    assert identity["note"].startswith(f"differ: {tree_stage['workloads'][1]['id']} (max |dp| 3.00e-03)")
    add_families(tree, 32.0, 1.0, 1.0, 1.0, 1.0, 30.0)  # 40 / 32 = 1.25x: met
    fused |= {"kernels_per_forward": 701.0, "max_abs_dp": 2.5e-3}
    tree["rows"] = 451
    assert _outcomes(record) == {"fused_kernels": "missed", "fused_core_multiple": "missed",
                                 "fused_fidelity": "missed", "tree_gemm_multiple": "met",
                                 "tree_rows_share": "missed", "tree_bitwise_vs_fused": "missed",
                                 "tree_handoff_core_time": "not measured", **GRAPHS_NOT_TIMED}  # fmt: skip
    rows = {row["id"]: row for row in targets.evaluate(record)}
    assert rows["fused_fidelity"]["note"].startswith("against hf_fla, fused <= hf_torch on 1 of 2 workloads;")
    fused["state_rel_rmse"], _headline(record, "hf_torch")["state_rel_rmse"] = [0.0, 1e-3, 3e-2], [0.0, 2e-3, 2e-2]
    note = {row["id"]: row for row in targets.evaluate(record)}["fused_fidelity"]["note"]
    assert ", hidden states: fused no farther than hf_torch at 2 of 3 residual states;" in note
    busy = tree["gpu_busy_ms"]
    assert rows["tree_gemm_multiple"]["note"] == (
        f"median 40.00 ms, GEMM kernels 32.00 ms; GPU busy {figures.ms(busy)} ms = {busy / 32.0:.2f}× (the multiple if "
        "launches cost nothing)"
    )
    assert rows["tree_rows_share"]["measured"] == "45.1% (451 of 1,000 rows)"
    assert rows["tree_rows_share"]["note"] == "unshared rows: merged's packed rows"
    assert {t.id for t in targets.TARGETS} == set(rows)
    assert {r["issue"] for r in rows.values()} == {4, 5, 13, 20, 22}


def test_core_targets_against_limits_and_the_stages_of_the_same_record():
    """Issue 22's targets: kernel time outside the GEMMs (every family but `gemm`), the drone median, the median on a
    workload against another stage's on it in the same record, and max |dp| against fused's; issue 20's gemm bitwise
    vs graphs. Made-up times: what is tested is how a record is read."""
    medians = {"hf_fla": 100.0, "fused": 60.0, "graphs": 40.0, "gemm": 39.0, "core": 30.0}
    record = fake_record("gpu-27b", "2026-12-03T10:00:00Z", gpu=True, medians=medians)
    core = _headline(record, "core")
    add_families(core, 25.0, 2.0, 0.5, 2.0, 0.4, 31.0)  # outside the GEMMs: 4.9 ms, met
    tables.stage_by_name(record, "core")["workloads"][1]["id"] = "long-10k-choice-5"  # 90 ms
    tables.stage_by_name(record, "graphs")["workloads"][1]["id"] = "long-10k-choice-5"  # 120 ms
    for w in tables.stage_by_name(record, "gemm")["workloads"]:
        w["vs_builds_on"] = {"stage": "graphs", "bitwise": True, "max_abs_dp": 0.0}
    core["max_abs_dp"], _headline(record, "fused")["max_abs_dp"] = 2e-3, 3e-3
    rows = {row["id"]: row for row in targets.evaluate(record)}
    assert {k: rows[k]["outcome"] for k in rows if rows[k]["issue"] in (20, 22)} == {
        "gemm_bitwise_vs_graphs": "met", "core_drone_non_gemm_ms": "met", "core_drone_ms": "met",
        "core_customer_service_non_gemm_ms": "not measured", "core_long_context_vs_graphs": "met",
        "core_fidelity": "met"}  # fmt: skip
    assert rows["core_drone_non_gemm_ms"]["measured"] == "4.90 ms"
    assert rows["core_drone_non_gemm_ms"]["note"].endswith("other 0.400 ms; GEMMs 25.00 ms")
    assert rows["core_long_context_vs_graphs"]["limit_text"] == "120.0 ms (graphs)"
    add_families(core, 25.0, 3.0, 0.5, 2.0, 0.4, 31.0)
    tables.stage_by_name(record, "graphs")["workloads"][1]["median_ms"] = 80.0
    core["max_abs_dp"] = 4e-3
    tables.stage_by_name(record, "gemm")["workloads"][1]["vs_builds_on"]["bitwise"] = False
    rows = {row["id"]: row for row in targets.evaluate(record)}
    assert [rows[k]["outcome"] for k in ("core_drone_non_gemm_ms", "core_long_context_vs_graphs", "core_fidelity",
                                         "gemm_bitwise_vs_graphs")] == ["missed"] * 4  # fmt: skip
    tables.stage_by_name(record, "graphs")["workloads"].pop()
    row = {r["id"]: r for r in targets.evaluate(record)}["core_long_context_vs_graphs"]
    assert (row["outcome"], row["limit_text"]) == ("not measured", "–")
    assert row["note"] == "graphs not timed on long-10k-choice-5 in the same record"


# Fabricated probe results (not measurements): the shapes the runner's probes write, with made-up numbers, to test
# how the targets and the report read them.
FAKE_HANDOFF = {"error": None, "seconds": 12.0, "workload": "long4k", "rows": 4200, "context_rows": 4010,
                "prefill_context_ms": 1.2, "handoff_ms": 2.0, "replicated_ms": 5.0, "handoff_over_prefill": 1.67,
                "gpu_busy_ms": {"prefill": 0.4, "handoff": 0.524, "replicated": 1.1},
                "gpu_busy_handoff_over_prefill": 1.31, "chosen_mode": "handoff"}  # fmt: skip
FAKE_COMPARISON = {"first_departing_state": 1, "per_state_rel_rmse": [0.0, 1e-3], "last_rel_rmse": 3e-2,
                   "max_dp": 5e-3}  # fmt: skip
FAKE_ENGINE = {"error": None, "seconds": 300.0, "workload": "drone", "peak_gib": {"hf": 49.7, "engine": 49.6},
               "comparisons": {"fused vs hf_fla": FAKE_COMPARISON}, "nvtx_ranges_bitwise": True,
               "fla_forward_core_bitwise": False, "fla_forward_core_first_departing_state": 3}  # fmt: skip
FAKE_CASE = {"gemm": "down", "n": 5120, "k": 17408, "flat_rows": 359, "tree_rows": 199, "flat_us": 100.0}
FAKE_GEMM_ROWS = {"error": None, "seconds": 40.0, "default": [FAKE_CASE | {"equal_row_share": 0.0, "tree_us": 68.0}],
                  "no_workspace": [FAKE_CASE | {"equal_row_share": 1.0, "tree_us": 75.0}]}  # fmt: skip


def test_the_handoff_target_comes_from_the_records_probe():
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians={"hf_fla": 100.0, "tree": 40.0})
    row = {r["id"]: r for r in targets.evaluate(record)}["tree_handoff_core_time"]
    assert (row["outcome"], row["note"]) == ("not measured", targets.NO_PROBES)
    record["probes"] = {"gdn_handoff": FAKE_HANDOFF}
    records.validate_record(record)
    row = {r["id"]: r for r in targets.evaluate(record)}["tree_handoff_core_time"]
    assert (row["issue"], row["outcome"], row["measured"], row["limit_text"]) == (5, "missed", "1.31×", "1.30×")
    assert row["note"].startswith("probe gdn_handoff: kernel ms per call 0.524 vs 0.400")
    record["probes"]["gdn_handoff"] = FAKE_HANDOFF | {"gpu_busy_handoff_over_prefill": 1.3}
    assert {r["id"]: r for r in targets.evaluate(record)}["tree_handoff_core_time"]["outcome"] == "met"  # at the limit
    record["probes"]["gdn_handoff"] = {"error": "exit 1: CUDA out of memory", "seconds": 3.0}
    row = {r["id"]: r for r in targets.evaluate(record)}["tree_handoff_core_time"]
    assert (row["outcome"], row["note"]) == ("not measured", "the gdn_handoff probe failed: exit 1: CUDA out of memory")
    cpu = fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False, medians={"hf_torch": 30.0})
    assert "tree_handoff_core_time" not in {r["id"] for r in targets.evaluate(cpu)}


def test_probe_results_are_validated():
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians={"hf_fla": 100.0})
    record["probes"] = {"gdn_handoff": FAKE_HANDOFF, "engine_checks": FAKE_ENGINE, "gemm_rows": FAKE_GEMM_ROWS}
    records.validate_record(record)
    incomplete = {k: v for k, v in FAKE_HANDOFF.items() if k != "gpu_busy_ms"}
    record["probes"] = {"gdn_handoff": incomplete, "tiles": {"error": None, "seconds": 1.0}}
    with pytest.raises(records.RecordError) as error:
        records.validate_record(record)
    assert "probes.gdn_handoff.gpu_busy_ms: missing" in str(error.value)
    assert "probes.tiles: not a known probe" in str(error.value)
    record["probes"] = {"gemm_rows": {"error": "timed out after 600 s", "seconds": 600.0}}  # a failed probe: no fields
    records.validate_record(record)


def test_targets_not_measured_and_the_token_count_fallback():
    medians = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": None, "fused": None, "tree": 40.0}
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=medians)
    _headline(record, "tree")["rows"] = 300
    rows = {row["id"]: row for row in targets.evaluate(record)}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "fused_kernels": "not measured", "fused_core_multiple": "not measured", "fused_fidelity": "not measured",
        "tree_gemm_multiple": "not measured", "tree_rows_share": "met",
        "tree_bitwise_vs_fused": "not measured", "tree_handoff_core_time": "not measured",
        **GRAPHS_NOT_TIMED}  # fmt: skip
    assert rows["fused_kernels"]["note"] == "fused not timed on drone: gate red"
    assert rows["tree_rows_share"]["measured"] == "30.9% (300 of 971 rows)"  # the workload's 971 tokens
    assert rows["tree_rows_share"]["note"] == "unshared rows: the drone request's tokens"
    partial = {row["id"]: row for row in targets.evaluate(partial_record("2026-11-30T11:00:00Z"))}
    assert partial["tree_rows_share"]["outcome"] == "not measured"
    assert partial["tree_rows_share"]["note"] == "tree not timed on drone: not reached (run stopped)"
    cpu = fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False, medians={"hf_torch": 30.0, "fused": 40.0})
    cpu_rows = {row["id"]: row for row in targets.evaluate(cpu)}
    assert cpu_rows["fused_kernels"]["outcome"] == "not measured"  # no CUDA kernels on the CPU
    assert cpu_rows["fused_fidelity"]["outcome"] == "not measured"  # hf_torch is the CPU plan's reference


def test_ladder_table_speedups_floors_and_untimed_stages(results):
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    (_, gpu) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    header, *rows = gpu["ladder"]
    by_stage = {row[0]: dict(zip(header, row)) for row in rows}
    assert by_stage["hf_fla"]["× vs hf_fla"] == "1.00×"
    assert by_stage["merged"]["× vs hf_fla"] == "2.00×"
    assert by_stage["hf_torch"]["× vs hf_fla"] == "0.62×"
    assert by_stage["merged"]["× floor"] == "4.3" and by_stage["merged"]["kernels"] == "4,000"
    assert by_stage["fused"]["status"] == "gate-red" and by_stage["fused"]["median ms"] == records.DASH
    assert by_stage["fused"]["gate"] == "red"
    assert [row[0] for row in gpu["exactness"][1:]] == ["hf_torch", "hf_fla", "merged", "fused (gate-red)"]
    assert gpu["exactness"][3][2:5] == ["1.00e-03", "2.00e-03", records.DASH]  # merged: |dp|, RMSE, no vs_builds_on


def test_cpu_record_has_no_kernel_counts(results):
    figures.main(["--results", str(results), "--plan", "cpu-tiny"])
    (cpu,) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    header, *rows = cpu["ladder"]
    assert all(dict(zip(header, row))["kernels"] == records.DASH for row in rows)
    assert "CPU only (Test CPU), CPU Test CPU (16 cores)" in cpu["run"] and "3 warm-up and 30 timed runs" in cpu["run"]


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
            sys_inputs={"summary": "/" + figures.SUMMARY_FILE},
        )
    )


def test_report_builds_a_pdf_with_every_section_and_the_synthetic_statement(results):
    figures.main(["--results", str(results)])
    pdf = build.build(results)
    assert pdf == results / "report.pdf" and pdf.read_bytes()[:5] == b"%PDF-"
    assert build.build(results, results / "again.pdf").read_bytes() == pdf.read_bytes()  # same results, same PDF
    assert len(_query(results, "<synthetic-weights>")) == 1
    glance, *headings = [h["text"] for h in _query(results, "heading.where(level: 1)", "body")]
    assert glance == "At a glance: gpu-27b on NVIDIA H200 — partial run" and headings == SECTIONS
    assert len(_query(results, "<at-a-glance>")) == 1
    plan_headings = [h["text"] for h in _query(results, "heading.where(level: 2)", "body")]
    assert any("cpu-tiny" in h and "CPU plan" in h for h in plan_headings)
    assert any(h == "gpu-27b on NVIDIA H200" for h in plan_headings)
    assert any(h == "gpu-27b on NVIDIA H200 — partial run" for h in plan_headings)
    assert len(_query(results, "<targets-table>")) == 3
    assert _query(results, "<gemm-over-graphs>") == [] and len(_query(results, "<jevbench-table>")) == 1


def test_report_without_records_says_so(tmp_path):
    assert figures.main(["--results", str(tmp_path)]) == 0
    assert build.main(["--results", str(tmp_path)]) == 0
    assert (tmp_path / "report.pdf").read_bytes()[:5] == b"%PDF-"
    assert len(_query(tmp_path, "<no-records>")) == 1


def test_build_needs_the_figures_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="paper.figures"):
        build.build(tmp_path)


def test_readme_markers_are_replaced_and_nothing_else():
    from paper.readme import README_END, README_START, replace_between_markers

    text = f"intro\n{README_START}\nold table\n{README_END}\noutro\n"
    out = replace_between_markers(text, "| new |\n")
    assert out == f"intro\n{README_START}\n| new |\n{README_END}\noutro\n"
    with pytest.raises(ValueError):
        replace_between_markers("no markers here", "x")
    with pytest.raises(ValueError):
        replace_between_markers(text + README_START, "x")


def test_the_readme_carries_the_generated_ladder_of_the_committed_records():
    """README.md's ladder block is exactly what paper.figures writes from the committed records (never hand-edited)."""
    from paper.figures import plan_summary, select_records
    from paper.readme import README_END, README_START, replace_between_markers
    from paper.tables import REPO

    root = REPO / "results"
    text = (REPO / "README.md").read_text()
    plans = [plan_summary(record, path, root) for path, record in select_records(root, None, [])]
    summary = {"plans": plans, "gemm_over_graphs": tables.gemm_over_graphs(root)}
    assert replace_between_markers(text, readme.ladder(summary)) == text
    assert text.index(README_START) < text.index(README_END)


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
    _, gpu, cpu = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    bits = gpu["bit_identity"]
    assert (
        bits["measured"]
        and "of drone (7 candidates, 971 tokens) at layers 0 (GDN), 3 (attention): 2 of 2 outputs" in (bits["text"])
    )
    header, bitwise, one_off = bits["table"]
    assert header[:5] == ["layer", "kernel", "output", "elements", "bit-identical"]
    assert bitwise[:7] == ["0", "silu_mul", "out", "33,800,000", "100 %", "0", "0"]
    assert one_off[4] == "99.9999 %" and one_off[-1] == "yes"  # never rounded up to 100 %
    assert not cpu["bit_identity"]["measured"] and cpu["bit_identity"]["text"].startswith("Not measured in this record")
    build.build(results)
    assert len(_query(results, "<bit-identity-table>")) == 1
    assert len(_query(results, "<bit-identity-missing>")) == 2


def test_a_failed_bit_identity_step_is_reported_as_not_measured(results):
    _with_bit_identity(results, "new.json", bit_identity(error="RuntimeError: out of memory"))
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    (_, gpu) = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    assert not gpu["bit_identity"]["measured"]
    assert gpu["bit_identity"]["text"] == "Not measured in this record (RuntimeError: out of memory)."
    build.build(results)
    assert "RuntimeError: out of memory" in json.dumps(_query(results, "<bit-identity-missing>"))


def test_a_kernel_off_its_declared_exactness_is_marked_in_the_summary_and_the_report(results):
    value = bit_identity()
    value["rows"][1] |= {"bit_identical": 990_000, "share": 0.99, "max_ulp": 3, "as_expected": False}
    _with_bit_identity(results, "running.json", value)
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    partial, _ = json.loads((results / "figures" / "summary.json").read_text())["plans"]
    bits = partial["bit_identity"]
    assert "1 of 2 outputs meet" in bits["text"] and "NOT as declared: layer 3 attn_prep.q." in (bits["text"])
    assert [row[-1] for row in bits["table"][1:]] == ["yes", "NO"]
    build.build(results)
    (table,) = _query(results, "<bit-identity-table>")
    assert "NO" in json.dumps(table)


def test_the_readme_block_carries_both_records_partial_first(results):
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    block = readme.ladder(json.loads((results / "figures" / "summary.json").read_text()))
    partial_at = block.index("**gpu-27b on NVIDIA H200 — partial run**")
    complete_at = block.index("**gpu-27b on NVIDIA H200**")
    assert partial_at < complete_at
    assert f"(record `runs/running.json`, {PARTIAL_TEXT}; synthetic weights)" in block  # it timed fused, new.json not
    assert "median of 30 CUDA-event timings (record `runs/new.json`, complete run; synthetic weights)" in block
    assert "![ladder](results/figures/ladder-gpu-27b-partial.png)" in block
    assert "![ladder](results/figures/ladder-gpu-27b.png)" in block


def test_a_partial_record_that_timed_nothing_new_on_the_headline_stays_out_of_the_readme(results):
    """The partial run cut inside hf_fla: the complete record timed hf_torch and hf_fla, so only the report has it."""
    cut = fake_record("gpu-27b", "2026-11-30T12:00:00Z", gpu=True, medians={"hf_torch": 170.0, "hf_fla": 110.0})
    cut["complete"] = False
    cut["stages"][1] |= {"status": "pending", "workloads": cut["stages"][1]["workloads"][:1]}
    _write(results / "runs", "cut.json", cut)
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    summary = json.loads((results / "figures" / "summary.json").read_text())
    assert [p["record"] for p in summary["plans"]] == ["runs/cut.json", "runs/new.json"]  # the report shows both
    assert [p["record"] for p in readme.shown_plans(summary["plans"])] == ["runs/new.json"]
    assert "runs/cut.json" not in readme.ladder(summary)
    cut["stages"][1]["workloads"] = []  # hf_fla never reached drone either: still nothing new
    _write(results / "runs", "cut.json", cut)
    figures.main(["--results", str(results), "--plan", "gpu-27b"])
    assert "runs/cut.json" not in readme.ladder(json.loads((results / "figures" / "summary.json").read_text()))
    alone = [p for p in summary["plans"] if p["partial"]]  # a plan with no complete record shows its partial one
    assert readme.shown_plans(alone) == alone


# ------------------------------------------------------------------------------------------ where each path departs
def departing(count: int, first: int | None, step: float = 1e-3) -> list[float]:
    """Made-up per-state relative RMSE: 0 before `first` (all 0 when None), then step, 2 step, ... after it."""
    if first is None:
        return [0.0] * count
    return [0.0 if i < first else step * (i - first + 1) for i in range(count)]


def with_states(record: dict, stage: str, states: list[float], first: int | None) -> None:
    """The per-state fields on the stage's headline measurement, as the runner writes them."""
    _headline(record, stage).update(state_rel_rmse=states, first_departing_state=first)


GPU_STATES = 66  # qwen3.8-27b: embedding, 64 layers, final norm


def departures_record() -> dict:
    """GPU plan (reference hf_fla): hf_torch departs at the embedding, merged at the final norm, tree nowhere,
    fused gate red; the reference itself all zeros."""
    medians = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": 80.0, "fused": None, "tree": 40.0}
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=medians)
    with_states(record, "hf_fla", departing(GPU_STATES, None), None)
    with_states(record, "hf_torch", departing(GPU_STATES, 0), 0)
    with_states(record, "merged", departing(GPU_STATES, 65, step=4e-4), 65)
    with_states(record, "tree", departing(GPU_STATES, None), None)
    _headline(record, "hf_torch")["max_abs_dp"] = 2.5e-3
    return record


def test_exactness_names_the_first_departing_state_on_the_headline():
    header, *rows = tables.exactness_table(departures_record())
    assert header[-1] == "first state departing from hf_fla"
    by_stage = {row[0]: row[-1] for row in rows}
    assert by_stage == {"hf_torch": "0 of 65", "hf_fla": "none: bitwise", "merged": "65 of 65",
                        "fused (gate-red)": records.DASH, "tree": "none: bitwise"}  # fmt: skip
    cpu = fake_record("cpu-tiny", "2026-11-30T08:00:00Z", gpu=False, medians={"hf_torch": 30.0})
    assert tables.exactness_table(cpu)[1][-1] == records.DASH  # no per-state comparison in the record


def test_paper_figures_imports_no_torch():
    """The layer pattern comes from reference/shapes.py, which must stay free of torch for the report."""
    import subprocess
    import sys

    code = "import sys, paper.figures; assert 'torch' not in sys.modules, 'paper.figures pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tables.REPO)


def test_a_record_without_probes_takes_those_of_a_newer_record_of_its_plan():
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians={"hf_fla": 100.0})
    record["probes"] = {"engine_checks": FAKE_ENGINE, "gemm_rows": FAKE_GEMM_ROWS}
    older = fake_record("gpu-27b", "2026-11-29T10:00:00Z", gpu=True, medians={"hf_fla": 100.0})
    later = [(Path("results/runs/probe-run.json"), record)]
    assert targets.probes_of(older, later) == (record["probes"], later[0][0])
    assert targets.probes_of(older, []) == ({}, None) and targets.probes_of(record, []) == (record["probes"], None)


def test_overview_speedups_per_workload_class_exactness_and_what_is_missing():
    medians = {"hf_torch": 160.0, "hf_fla": 100.0, "merged": 80.0, "fused": None, "tree": 40.0}
    record = fake_record("gpu-27b", "2026-11-30T10:00:00Z", gpu=True, medians=medians)
    header, *rows = tables.class_speedups(record)
    by_stage = {row[0]: dict(zip(header, row)) for row in rows}
    assert header == ["stage", "ungrouped (2)"]  # these fabricated workloads carry no group, as older records
    assert by_stage["merged"]["ungrouped (2)"] == "1.25× (2)" and by_stage["tree"]["ungrouped (2)"] == "2.50× (2)"
    record["workloads"][1]["group"] = "jevbench"
    header, *rows = tables.class_speedups(record)
    assert header == ["stage", "ungrouped (1)", "jevbench (1)"] and rows[2][1:] == ["1.25× (1)", "1.25× (1)"]
    assert "fused" not in by_stage  # gate red: not timed
    header, *rows = tables.exactness_table(record)
    assert rows[3][0] == "fused (gate-red)"
    missing = tables.still_missing(record, targets.evaluate(record))
    assert "stage fused: gate-red" in missing
    registered = [stage.name for stage in STAGE_LIST if stage.status == "unmeasured"]  # none timed in this record
    never = [item for item in missing if item.startswith("stages registered but never measured")]
    assert never == ([f"stages registered but never measured: {', '.join(registered)}"] if registered else [])
    record["registry"].append({**get_stage("core").describe(), "name": "fp8", "registry_status": "unmeasured"})
    missing = tables.still_missing(record, targets.evaluate(record))
    assert missing[-1] == f"stages registered but never measured: {', '.join([*registered, 'fp8'])}"
    assert "issue 4 target not measured: kernels per fused forward <= 700 (–)" in missing


def test_attempts_recorded_after_the_newest_run_reach_the_report_table(results, monkeypatch):
    later = {"id": "grid-slot-factor-4", "stage": "graphs", "title": "slot factor 4", "outcome": "rejected",
             "reason": "no gain", "numbers": {"ratio": 1.12}, "evidence": "runs/new.json",
             "date": "2026-12-01"}  # fmt: skip
    monkeypatch.setattr(figures, "load_attempts", lambda: [later])
    figures.main(["--results", str(results)])
    attempts = json.loads((results / "figures" / "summary.json").read_text())["attempts"]
    assert ["grid-slot-factor-4", "graphs", "slot factor 4", "rejected"] in [row[:4] for row in attempts]


# --------------------------------------------------------------------------------- gemm against graphs, and serving
def gemm_record(utc: str, *, gemm_ok: bool = True) -> dict:
    """A GPU record that timed `graphs` and (unless `gemm_ok` is false: gate red) `gemm` on both workloads, each
    workload with a GEMM kernel time (`gemm_ms`) of 0.4 of its median for graphs and 0.36 for gemm."""
    medians = {"hf_fla": 100.0, "graphs": 40.0, "gemm": 38.0 if gemm_ok else None}
    record = fake_record("gpu-27b", utc, gpu=True, medians=medians)
    for stage in record["stages"]:
        for w in stage["workloads"]:
            w["gemm_ms"] = w["median_ms"] * {"hf_fla": 0.5, "graphs": 0.4, "gemm": 0.36}[stage["name"]]
    return record


def test_gemm_over_graphs_comes_from_the_newest_gpu_record_with_both_stages(results):
    _write(results / "runs", "gemm-old.json", gemm_record("2026-11-30T12:00:00Z"))
    newer = gemm_record("2026-11-30T13:00:00Z")
    newer["stages"][2]["workloads"][1]["gemm_ms"] = None  # gemm's customer_service without a profiled GEMM time
    _write(results / "runs", "gemm-new.json", newer)
    _write(results / "runs", "gemm-red.json", gemm_record("2026-11-30T14:00:00Z", gemm_ok=False))
    figures.main(["--results", str(results)])
    summary = json.loads((results / "figures" / "summary.json").read_text())
    gemm = summary["gemm_over_graphs"]
    assert gemm["record"] == "runs/gemm-new.json"
    # drone's medians are 40 and 38 ms (timed() takes the median of its samples), GEMM ms 0.4 x 40 and 0.36 x 38
    assert gemm["table"][1] == ["drone", "16.00", "13.68", "0.855×", "40.00", "38.00", "0.950×"]
    assert gemm["table"][2][:4] == ["customer_service", "48.00", "–", "–"] and gemm["table"][2][-1] == "0.950×"
    block = readme.ladder(summary)
    assert "(record `runs/gemm-new.json`, synthetic weights)" in block and "| drone | 16.00 | 13.68 | 0.855× |" in block
    build.build(results)
    (table,) = _query(results, "<gemm-over-graphs>")
    assert "0.855×" in json.dumps(table, ensure_ascii=False)


def test_without_a_record_of_both_stages_there_is_no_gemm_table(results):
    _write(results / "runs", "gemm-red.json", gemm_record("2026-11-30T14:00:00Z", gemm_ok=False))
    figures.main(["--results", str(results)])
    summary = json.loads((results / "figures" / "summary.json").read_text())
    assert summary["gemm_over_graphs"] is None
    assert "GEMM kernel time per forward" not in readme.ladder(summary)
    build.build(results)
    assert _query(results, "<gemm-over-graphs>") == []


def jevbench_summary(label: str, gpu: bool, p50: float, agreement: dict | None = None) -> dict:
    """A `python -m bench.jevbench` summary.json with the fields the serving block reads."""
    latency = {"n": 10, "mean_ms": p50, "p50_ms": p50, "p95_ms": 1.5 * p50, "max_ms": 2 * p50}
    second = {"tasks": 10, "answered": 9, "latency": latency} | ({"agreement": agreement} if agreement else {})
    return {"run": {"label": label, "reference": "results/jevbench/ref/" if agreement else None},
            "passes": {"1": second, "2": second}, "environment": {"gpu": "NVIDIA H200" if gpu else None,
                                                                    "cpu": "Test CPU"}}  # fmt: skip


def test_the_serving_block_has_the_newest_jevbench_run_per_backend_and_device(tmp_path):
    agreement = {"compared": 9, "argmax_agreement": 8, "max_abs_dp": 0.0042}
    runs = {"20261130T1000Z-old-graphs": jevbench_summary("graphs", True, 50.0),
            "20261130T1100Z-new-graphs": jevbench_summary("graphs", True, 25.0, agreement),
            "20261130T0900Z-cpu-graphs": jevbench_summary("graphs", False, 900.0),
            "20261130T0800Z-one-pass": jevbench_summary("tree", True, 30.0)}  # fmt: skip
    del runs["20261130T0800Z-one-pass"]["passes"]["2"]
    for name, summary in runs.items():
        (tmp_path / "jevbench" / name).mkdir(parents=True)
        (tmp_path / "jevbench" / name / "summary.json").write_text(json.dumps(summary))
    table = serving.jevbench_table(tmp_path)
    assert table[1:] == [
        ["tree", "NVIDIA H200", "jevbench/20261130T0800Z-one-pass", "no pass 2", "–", "–", "–", "–"],
        ["graphs", "CPU only (Test CPU)", "jevbench/20261130T0900Z-cpu-graphs", "9 of 10", "900.0 / 1350.0 / 1800.0",
         "–", "–", "–"],
        ["graphs", "NVIDIA H200", "jevbench/20261130T1100Z-new-graphs", "9 of 10", "25.0 / 37.5 / 50.0", "8 of 9",
         "4.20e-03", "ref"],
    ]  # fmt: skip
    sweep = {"device": "gpu", "label": "graphs on NVIDIA H200", "record": "serving/run", "targets": "At 8 clients: x.",
             "table": [["clients"], ["1"]]}  # fmt: skip
    block = readme.serving(
        {"jevbench": table, "serving": [sweep, sweep | {"device": "cpu", "record": "serving/cpu-run"}]}
    )
    assert "synthetic weights: latency and agreement, not accuracy" in block
    assert "| graphs | NVIDIA H200 | jevbench/20261130T1100Z-new-graphs |" in block and "old-graphs" not in block
    assert "Client sweep, graphs on NVIDIA H200 (run `serving/run`" in block and "serving/cpu-run" not in block
    assert serving.jevbench_table(tmp_path / "empty") == [serving.JEVBENCH_HEADER]
    assert "No JevBench run yet." in readme.serving({"jevbench": [serving.JEVBENCH_HEADER], "serving": []})


def test_the_readme_carries_the_generated_serving_block_of_the_committed_runs():
    """README.md's serving block is exactly what paper.figures writes from results/jevbench and results/serving
    (read only: the serving figures are drawn by `draw_serving_figures`, not by the summary)."""
    from paper.tables import REPO

    text = (REPO / "README.md").read_text()
    root = REPO / "results"
    block = readme.serving({"jevbench": serving.jevbench_table(root), "serving": serving.serving_summary(root)})
    assert readme.replace_between_markers(text, block, readme.SERVING_BLOCK) == text
    assert "| graphs | NVIDIA H200 |" in block
