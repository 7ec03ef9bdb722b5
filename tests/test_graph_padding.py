"""`measure.graph_padding` on the CPU: the per-kernel padding table and the refusals before any 27B build (the
measurement itself needs CUDA graphs: it runs on the device)."""

from __future__ import annotations

import pytest

from ablations.timing import kernel_stats
from engine.graphs import default_grid
from measure.graph_padding import finer_rows_grid, kernel_padding, main


def trace(kernels: list[tuple[str, float]]) -> list[dict]:
    """Chrome-trace kernel events, back to back, `dur` in us."""
    events, ts = [], 0.0
    for name, dur in kernels:
        events.append({"cat": "kernel", "name": name, "ts": ts, "dur": dur})
        ts += dur + 1.0
    return events


def test_kernel_padding_lists_every_kernel_of_either_profile_largest_first():
    exact = kernel_stats(trace([("walk", 500.0), ("gemm", 3000.0), ("walk", 500.0), ("exact_only", 7.0)]), calls=1)
    bucket = kernel_stats(trace([("walk", 900.0), ("gemm", 3100.0), ("walk", 700.0), ("bucket_only", 40.0)]), calls=1)
    rows = kernel_padding(exact, bucket)
    by_name = {row["name"]: row for row in rows}
    assert set(by_name) == {"walk", "gemm", "exact_only", "bucket_only"}
    assert by_name["walk"]["exact_ms"] == pytest.approx(1.0) and by_name["walk"]["bucket_ms"] == pytest.approx(1.6)
    assert by_name["walk"]["padding_ms"] == pytest.approx(0.6)
    assert by_name["gemm"]["padding_ms"] == pytest.approx(0.1)
    assert by_name["bucket_only"]["padding_ms"] == pytest.approx(0.04)
    assert by_name["exact_only"]["padding_ms"] == pytest.approx(-0.007)
    assert [row["name"] for row in rows] == ["walk", "gemm", "bucket_only", "exact_only"]


def test_refuses_a_stage_without_graphs_and_an_unknown_workload_before_building():
    with pytest.raises(SystemExit) as stage:
        main(["--stage", "fused"])
    assert stage.value.code == 2
    with pytest.raises(ValueError, match="no-such-workload"):
        main(["--stage", "core", "--workloads", "drone,no-such-workload"])
    with pytest.raises(SystemExit) as calls:
        main(["--stage", "core", "--profile-calls", "0"])
    assert calls.value.code == 2


def test_the_finer_rows_grid_halves_the_step_above_256_rows_and_holds_the_default_grid():
    finer = finer_rows_grid()
    assert len(finer) == 424 and len(set(finer)) == 424
    assert set(default_grid()) <= set(finer)
    rows = sorted({bucket.rows for bucket in finer})
    steps = {b - a for a, b in zip(rows, rows[1:])}
    assert steps == {16, 32, 64} and rows[0] == 64 and rows[-1] == 1280
    assert [b - a for a, b in zip(rows, rows[1:]) if a >= 256 and b <= 512] == [16] * 16


def test_the_record_with_the_gpu_parts_stubbed(monkeypatch, tmp_path):
    """The tool's record on the CPU, every CUDA step replaced by a stand-in (capture, replay, timing, profiler): each
    variant's bucket, the per-kernel table of the grid bucket against the exact plan, the served path; and a workload
    outside the grid (hand-off) skipped with its reason. Checks the code path the device runs, not a measurement."""
    import json
    from types import SimpleNamespace

    import torch

    import measure.graph_padding as tool

    class Engine:
        device = torch.device("cpu")
        graphs = SimpleNamespace(capture_on_miss=False)

        def exact_graph(self, cands, groups):
            return lambda: torch.ones(len(cands), 4)

        def _forward_plan(self, plan):
            return torch.ones(7, 4)  # drone's candidates

        def prepare(self, cands, groups):
            return SimpleNamespace(batches=[SimpleNamespace(graph_hit=True)], count=len(cands))

        def forward(self, prepared):
            return torch.ones(prepared.count, 4)

    class Graph:
        def replay(self):
            pass

    profiles = iter([[("walk", 900.0), ("gemm", 3000.0)], [("walk", 1300.0), ("gemm", 3100.0), ("solve", 40.0)]])
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tool, "prepare_process", lambda stages, device: {})
    monkeypatch.setattr(tool, "synthetic_weights", lambda *a, **k: None)
    monkeypatch.setattr(tool.MergedWeights, "from_decision_weights", staticmethod(lambda weights: None))
    monkeypatch.setattr(tool, "build_engine", lambda merged, stage: Engine())
    monkeypatch.setattr(tool, "plan_tree", lambda cands, groups, device, bucket: SimpleNamespace(arena=None))
    monkeypatch.setattr(tool, "capture_forward", lambda fn, arena, device: (Graph(), fn()))
    monkeypatch.setattr(tool, "timed", lambda fn: (fn(), 2.5)[1])
    monkeypatch.setattr(tool, "profile_kernels", lambda fn, calls, top: kernel_stats(trace(next(profiles)), calls))
    monkeypatch.setattr(tool.envinfo, "collect", lambda device: {"utc": "2026-12-06T00:00:00Z", "gpu": None,
                                                                 "git_commit": "0000000"})  # fmt: skip
    out = tmp_path / "padding.json"
    assert main(["--stage", "core", "--workloads", "drone,long-10k-choice-5", "--kernels", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["stage"] == "core"
    drone, long = record["workloads"]
    assert drone["grid_bucket"] == "r352-s1074-c8" and drone["finer_rows_grid"]["bucket"]["rows"] == 352
    assert drone["grid_to_1152"]["bucket"] == drone["grid"]["bucket"]  # the grids differ above 1,024 rows only
    assert drone["one_dummy_row_minimal_rest"]["bucket"]["rows"] == 338
    assert all(drone[name]["bitwise_vs_exact"] for name in ("grid", "finer_rows_grid", "served"))
    assert [k["name"] for k in drone["kernel_padding_ms"]] == ["walk", "gemm", "solve"]
    assert drone["kernel_padding_ms"][0]["padding_ms"] == pytest.approx(0.08)  # 400 us over 5 profiled calls
    assert drone["grid_profile"]["gpu_busy_ms"] == pytest.approx(0.888) and "stats" not in drone["grid_profile"]
    assert long["skipped"] and "grid_bucket" not in long
