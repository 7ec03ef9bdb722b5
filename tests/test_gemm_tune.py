"""CPU tests of the GEMM tuner's selection law and outputs (ablations/tune_gemm.py) on synthetic measurements: the
per-bucket mix only of kernels bitwise with F.linear, one kernel or one split per shape otherwise, the ship rule,
the written table accepted by the engine's loader, and candidates of several device calls merged into one table."""

from __future__ import annotations

import json

import pytest

from ablations import tune_gemm
from ablations.tune_gemm import Measurement, select_table
from engine.gemm_table import CUBLASLT_ALGORITHM_KEYS, GEMM_SHAPES, load_gemm_table

GRID = (64, 128, 256)
CUBLAS = {"family": "cublas"}


def lt(algo_id: int, splitk: int = 1) -> dict:
    algorithm = dict.fromkeys(CUBLASLT_ALGORITHM_KEYS, 0) | {"id": algo_id, "splitk_num": splitk}
    return {"family": "cublaslt", "algorithm": algorithm}


def m(shape, rows, kernel, time_us, bitwise=True, invariant=True) -> Measurement:
    return Measurement(shape, rows, kernel, time_us, bitwise, invariant)


def floors(shapes, grid=GRID) -> dict:
    return {(s, r): 1.0 for s in shapes for r in grid}


def test_bitwise_kernels_mix_across_buckets_and_the_fastest_wins():
    ms = [m("gate_up", r, CUBLAS, 100.0) for r in GRID]
    ms += [m("gate_up", 64, lt(1), 80.0), m("gate_up", 128, lt(2), 90.0), m("gate_up", 256, lt(1), 120.0)]
    chosen = select_table(ms, floors(["gate_up"]), GRID)
    assert [b["kernel"] for b in chosen["best"]["gate_up"]] == [lt(1), lt(2), CUBLAS]
    assert chosen["best"] == chosen["bitwise"] and chosen["ship"] == "bitwise"


def test_a_kernel_not_bitwise_with_f_linear_serves_every_bucket_or_none():
    """lt(3) is fastest at two buckets but not bitwise with F.linear and not measured at 256: it cannot be mixed in;
    lt(4), measured everywhere and faster in total, is one kernel for the whole shape."""
    ms = [m("gdn_in", r, CUBLAS, 100.0) for r in GRID]
    ms += [m("gdn_in", 64, lt(3), 50.0, bitwise=False), m("gdn_in", 128, lt(3), 50.0, bitwise=False)]
    ms += [m("gdn_in", r, lt(4), 90.0, bitwise=False) for r in GRID]
    chosen = select_table(ms, floors(["gdn_in"]), GRID)
    assert [b["kernel"] for b in chosen["best"]["gdn_in"]] == [lt(4)] * 3
    assert [b["kernel"] for b in chosen["bitwise"]["gdn_in"]] == [CUBLAS] * 3
    assert chosen["bitwise_within_margin"] is False and chosen["ship"] == "best"


def test_one_split_per_shape_and_the_two_percent_ship_rule():
    """Split-K S=2 is 1.5% faster than cuBLAS in total: the best table has it at every bucket, the bitwise table is
    within 2% at every bucket, so the bitwise one ships. Row-variant candidates never count."""
    ms = [m("down", r, CUBLAS, 100.0) for r in GRID]
    ms += [m("down", r, {"family": "splitk", "split": 2}, 98.5, bitwise=False) for r in GRID]
    ms += [m("down", r, {"family": "splitk", "split": 3}, 10.0, bitwise=False, invariant=False) for r in GRID]
    ms += [m("down", 64, {"family": "splitk", "split": 4}, 20.0, bitwise=False)]  # one bucket only: no option
    chosen = select_table(ms, floors(["down"]), GRID)
    assert {b["kernel"]["split"] for b in chosen["best"]["down"]} == {2}
    assert chosen["bitwise_within_margin"] is True and chosen["ship"] == "bitwise"
    slower = [x if x.kernel.get("split") != 2 else m("down", x.rows, x.kernel, 97.0, bitwise=False) for x in ms]
    assert select_table(slower, floors(["down"]), GRID)["ship"] == "best"  # 3% faster: the split-K table ships


def test_forward_time_weighs_each_shape_by_its_calls():
    ms = [m("attn_in", r, CUBLAS, 10.0) for r in GRID] + [m("out", r, CUBLAS, 1.0) for r in GRID]
    chosen = select_table(ms, floors(["attn_in", "out"]), GRID)
    assert chosen["forward_us"]["best"] == [16 * 10.0 + 64 * 1.0] * 3


def test_a_bucket_without_a_bitwise_candidate_is_an_error():
    with pytest.raises(ValueError, match="no row-invariant candidate at rows"):
        select_table([m("out", 64, CUBLAS, 1.0)], floors(["out"]), GRID)
    ms = [m("out", r, CUBLAS, 1.0, bitwise=r != 128) for r in GRID]
    with pytest.raises(ValueError, match="no candidate bitwise with F.linear"):
        select_table(ms, floors(["out"]), GRID)


def full_measurements() -> list[Measurement]:
    from engine.graphs import ROWS_GRID

    ms = []
    for shape in GEMM_SHAPES:
        for rows in ROWS_GRID:
            ms.append(m(shape, rows, CUBLAS, 50.0 + rows))
            if shape == "out":
                ms.append(m(shape, rows, {"family": "splitk", "split": 3}, 10.0 + rows, bitwise=False))
    return ms


def env() -> dict:
    versions = {"torch": "2.11.0", "cuda": "13.0", "cublas": "13.1.0", "cublaslt": "13.1.0", "nvmath": "1.0.0",
                "triton": "3.6.0"}  # fmt: skip
    return {"gpu": "NVIDIA H200", "capability": [9, 0], "versions": versions, "commit": "abc1234",
            "utc": "2026-12-02T10:00:00Z", "env": {"utc": "2026-12-02T10:00:00Z"},
            "stem": "20261202T100000Z-nvidia-h200-abc1234"}  # fmt: skip


def test_the_written_table_is_what_the_engine_loads(tmp_path, monkeypatch):
    from engine.graphs import ROWS_GRID

    monkeypatch.setattr(tune_gemm, "RESULTS", tmp_path)
    measured = full_measurements()
    all_floors = {(s, r): 5.0 + r / 100 for s in GEMM_SHAPES for r in ROWS_GRID}
    written = tune_gemm.write_outputs(measured, all_floors, env(), {"copy_tbps": 4.0}, ROWS_GRID, [])
    table = load_gemm_table(written["table"], device_name="NVIDIA H200")
    assert table.shape("out").split == 3  # far faster, not bitwise: the best (split-K) table ships
    record = json.loads(written["candidates"].read_text())
    assert record["selection"]["ship"] == "best" and len(record["measurements"]) == len(measured)
    assert record["table"] == str(written["table"])
    assert written["table"].name == "20261202T100000Z-nvidia-h200-abc1234-table.json"


def test_subsets_write_candidates_only_and_merge_into_one_table(tmp_path, monkeypatch):
    from engine.graphs import ROWS_GRID

    monkeypatch.setattr(tune_gemm, "RESULTS", tmp_path)
    measured = full_measurements()
    all_floors = {(s, r): 5.0 for s in GEMM_SHAPES for r in ROWS_GRID}
    paths = []
    for part in (["gdn_in", "attn_in"], ["out", "gate_up", "down"]):
        ms = [x for x in measured if x.shape in part]
        fl = {key: value for key, value in all_floors.items() if key[0] in part}
        written = tune_gemm.write_outputs(ms, fl, env(), {"copy_tbps": 4.0}, ROWS_GRID, [])
        assert set(written) == {"candidates"}
        paths.append(written["candidates"])
    with pytest.raises(SystemExit, match="measured in more than one record"):
        tune_gemm.from_candidates([paths[0], paths[0]])
    merged = tune_gemm.from_candidates(paths)
    assert load_gemm_table(merged["table"], device_name="NVIDIA H200").shape("gdn_in").choices[0].kernel.family == (
        "cublas"
    )


def test_a_time_below_its_floor_writes_no_table(tmp_path, monkeypatch):
    from engine.graphs import ROWS_GRID

    monkeypatch.setattr(tune_gemm, "RESULTS", tmp_path)
    all_floors = {(s, r): 1e6 for s in GEMM_SHAPES for r in ROWS_GRID}
    written = tune_gemm.write_outputs(full_measurements(), all_floors, env(), {}, ROWS_GRID, [])
    assert set(written) == {"candidates"}
    assert json.loads(written["candidates"].read_text())["table"].startswith("not written: time below the floor")


def test_the_command_line_refuses_unknown_shapes_and_buckets():
    with pytest.raises(SystemExit):
        tune_gemm.main(["--shapes", "qkv"])
    with pytest.raises(SystemExit):
        tune_gemm.main(["--buckets", "100"])
