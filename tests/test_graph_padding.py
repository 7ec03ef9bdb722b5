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
