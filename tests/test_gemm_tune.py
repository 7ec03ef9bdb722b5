"""CPU tests of the GEMM tuner (measure/tune_gemm.py): its cuBLASLt candidates from fake heuristic offers (the
non-split query, the explicit set, buckets without a non-split offer recorded), and its selection law and outputs on
synthetic measurements: the per-bucket mix only of kernels bitwise with F.linear, one kernel or one split per shape
otherwise, the ship rule, the written table accepted by the engine's loader, and candidates of several device calls
merged into one table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.gemm import NO_ALGORITHM_OFFERED, NO_SPLIT_K_MASK, offered_algorithms
from engine.gemm_table import CUBLASLT_ALGORITHM_KEYS, GEMM_SHAPES, load_gemm_table
from engine.graphs import ROWS_GRID
from measure import tune_gemm
from measure.tune_gemm import (
    Measurement,
    cublaslt_candidates,
    heuristic_offers,
    kernel_key,
    neighbour_rows,
    select_table,
)

GRID = (64, 128, 256)
CUBLAS = {"family": "cublas"}
CEILINGS = {"copy_tbps": 4.0, "bf16_tflops": 1e9}  # floors far under the made-up times


def lt(algo_id: int, splitk: int = 1) -> dict:
    algorithm = dict.fromkeys(CUBLASLT_ALGORITHM_KEYS, 0) | {"id": algo_id, "splitk_num": splitk}
    return {"family": "cublaslt", "algorithm": algorithm}


def m(shape, rows, kernel, time_us, bitwise=True, invariant=True) -> Measurement:
    return Measurement(shape, rows, kernel, time_us, bitwise, invariant)


def floors(shapes, grid=GRID) -> dict:
    return {(s, r): 1.0 for s in shapes for r in grid}


def offer(algo_id: int, splitk: int = 1) -> SimpleNamespace:
    """A fake nvmath `Algorithm`: only its `config_ifc` attributes, which is all the tuner reads."""
    return SimpleNamespace(config_ifc=SimpleNamespace(**lt(algo_id, splitk)["algorithm"]))


class FakeMatmul:
    """An nvmath `Matmul` as cuBLASLt's heuristic answers through `plan(preferences=...)`: `any` with nvmath's default
    mask (every reduction scheme), `non_split` with the mask NONE; no offer raises as nvmath 1.0.0 does. Every
    preferences dict it was planned with is kept in `asked`."""

    def __init__(self, any_scheme: list, non_split: list, error: Exception | None = None):
        self.any_scheme, self.non_split, self.error, self.asked = any_scheme, non_split, error, []

    def plan(self, preferences: dict):
        self.asked.append(preferences)
        restricted = preferences.get("reduction_scheme_mask") == NO_SPLIT_K_MASK
        if restricted and self.error is not None:
            raise self.error
        offered = (self.non_split if restricted else self.any_scheme)[: preferences["limit"]]
        if not offered:
            raise RuntimeError(NO_ALGORITHM_OFFERED)
        return tuple(offered)


def test_the_non_split_query_asks_for_reduction_scheme_none_and_keeps_split_one_only():
    """As for down on the H200: with every reduction scheme the heuristic offers only split-K algorithms; asked with
    the mask NONE it offers non-split ones, and an offer with splitk_num > 1 (the mask not honoured) is dropped."""
    matmul = FakeMatmul([offer(1, 4), offer(2, 2)], [offer(3), offer(4, 2), offer(5)])
    assert [a.config_ifc.id for a in offered_algorithms(matmul, 8, allow_split_k=False)] == [3, 5]
    assert matmul.asked[-1] == {"limit": 8, "reduction_scheme_mask": NO_SPLIT_K_MASK} and NO_SPLIT_K_MASK == 0
    assert [a.config_ifc.id for a in offered_algorithms(matmul, 1, allow_split_k=True)] == [1]
    assert matmul.asked[-1] == {"limit": 1}


def test_no_offer_is_an_empty_list_and_other_errors_pass():
    assert offered_algorithms(FakeMatmul([offer(1, 2)], []), 8, allow_split_k=False) == []
    refused = FakeMatmul([offer(1, 2)], [], error=RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED"))
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        offered_algorithms(refused, 8, allow_split_k=False)


def test_heuristic_offers_asks_both_queries_with_the_named_limits():
    matmul = FakeMatmul([offer(1, 4)], [offer(3)])
    skipped: list[dict] = []
    offers = heuristic_offers(matmul, "down", 64, skipped)
    assert offers == {"any": [lt(1, 4)["algorithm"]], "non_split": [lt(3)["algorithm"]]} and skipped == []
    assert matmul.asked == [
        {"limit": tune_gemm.HEURISTIC_LIMIT},
        {"limit": tune_gemm.NON_SPLIT_LIMIT, "reduction_scheme_mask": NO_SPLIT_K_MASK},
    ]
    refused = FakeMatmul([offer(1, 4)], [], error=ValueError("cuBLASLt refused the query"))
    assert heuristic_offers(refused, "down", 80, skipped) == {"any": [lt(1, 4)["algorithm"]], "non_split": []}
    assert skipped == [
        {"shape": "down", "rows": 80, "query": "non-split", "why": "ValueError: cuBLASLt refused the query"}
    ]


def test_cublaslt_candidates_keep_non_split_algorithms_and_record_buckets_without_one():
    """Split-K offers are measured where offered; the explicit set is the non-split algorithms only, tried at every
    bucket; the bucket without a non-split offer is recorded, and still gets the explicit set."""
    matmuls = {
        64: FakeMatmul([offer(1, 4), offer(2, 2)], [offer(3)]),
        128: FakeMatmul([offer(1, 4)], []),
        256: FakeMatmul([offer(1, 4), offer(6)], [offer(6), offer(3)]),
    }
    skipped: list[dict] = []
    offers = {rows: heuristic_offers(matmul, "down", rows, skipped) for rows, matmul in matmuls.items()}
    candidates = cublaslt_candidates("down", offers, skipped)
    ids = {rows: sorted((c["id"], c["splitk_num"]) for c in configs) for rows, configs in candidates.items()}
    assert ids == {64: [(1, 4), (2, 2), (3, 1), (6, 1)], 128: [(1, 4), (3, 1), (6, 1)], 256: [(1, 4), (3, 1), (6, 1)]}
    assert len(skipped) == 1 and skipped[0]["rows"] == [128] and "still tried there" in skipped[0]["why"]


def test_neighbour_rows_lie_between_the_previous_size_and_the_bucket():
    """Below each bucket, above the grid's previous size: one row count in the 16-row steps, three in the 32-row
    steps, five in the 64-row steps (customer_service's 1,032 rows: 1,040 below its 1,088); the first size counts
    its own step below it; a step of 128 would take all seven offsets."""
    near = neighbour_rows(ROWS_GRID)
    assert near[64] == [56] and near[208] == [200] and near[352] == [344, 336, 328]
    assert near[640] == [632, 624, 616, 608, 592] and near[1088] == [1080, 1072, 1064, 1056, 1040]
    assert neighbour_rows([1152], (1024, 1152)) == {1152: [1144, 1136, 1128, 1120, 1104, 1088, 1056]}
    assert all(prev < r < rows for prev, rows in zip(ROWS_GRID, ROWS_GRID[1:]) for r in near[rows])
    assert neighbour_rows([352]) == {352: [344, 336, 328]}  # a subset of buckets keeps the grid's neighbours


def test_neighbour_offers_are_measured_at_the_bucket_without_split_k_or_the_explicit_set():
    """A tile offered just below a bucket (as cuBLAS sizes a 176-row tile for 337 rows) is a candidate at the bucket;
    a neighbour's split-K offer is not, and neighbour offers do not enter the explicit set of other buckets."""
    skipped: list[dict] = []
    offers = {rows: heuristic_offers(FakeMatmul([offer(1)], [offer(1)]), "gate_up", rows, skipped) for rows in GRID}
    near = {256: {240: heuristic_offers(FakeMatmul([offer(7), offer(8, 2)], [offer(7)]), "gate_up", 240, skipped)}}
    candidates = cublaslt_candidates("gate_up", offers, skipped, near)
    ids = {rows: sorted((c["id"], c["splitk_num"]) for c in configs) for rows, configs in candidates.items()}
    assert ids == {64: [(1, 1)], 128: [(1, 1)], 256: [(1, 1), (7, 1)]} and skipped == []


def test_a_shape_with_no_non_split_offer_anywhere_is_recorded_not_an_error():
    skipped: list[dict] = []
    offers = {rows: heuristic_offers(FakeMatmul([offer(1, 4)], []), "down", rows, skipped) for rows in GRID}
    candidates = cublaslt_candidates("down", offers, skipped)
    assert candidates == {rows: [lt(1, 4)["algorithm"]] for rows in GRID}
    assert skipped == [
        {
            "shape": "down",
            "rows": list(GRID),
            "query": "non-split",
            "why": "cuBLASLt's heuristic offered no algorithm without split-K at these rows; nor at any other bucket: "
            "the shape has no non-split cuBLASLt candidate",
        }
    ]


def test_a_split_k_cublaslt_algorithm_is_never_in_the_bitwise_table():
    """lt(5) splits K in two: even where its checks say bitwise and row-invariant it is no bitwise bucket, only the
    one-split option of the best table; the row-variant lt(7) is no option at all."""
    ms = [m("down", r, CUBLAS, 100.0) for r in GRID]
    ms += [m("down", r, lt(5, splitk=2), 50.0) for r in GRID]
    ms += [m("down", r, lt(6), 90.0) for r in GRID]
    ms += [m("down", r, lt(7, splitk=2), 10.0, bitwise=False, invariant=False) for r in GRID]
    chosen = select_table(ms, floors(["down"]), GRID)
    assert [b["kernel"] for b in chosen["bitwise"]["down"]] == [lt(6)] * 3
    assert [b["kernel"] for b in chosen["best"]["down"]] == [lt(5, splitk=2)] * 3
    options = chosen["options"]["down"]
    assert f"split 2 {kernel_key(lt(5, splitk=2))}" in options
    assert not any(kernel_key(lt(7, splitk=2)) in label for label in options)


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
    written = tune_gemm.write_outputs(measured, env(), CEILINGS, ROWS_GRID, [])
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
    paths = []
    for part in (["gdn_in", "attn_in"], ["out", "gate_up", "down"]):
        ms = [x for x in measured if x.shape in part]
        written = tune_gemm.write_outputs(ms, env(), CEILINGS, ROWS_GRID, [])
        assert set(written) == {"candidates"}
        paths.append(written["candidates"])
    with pytest.raises(SystemExit, match="measured in more than one record"):
        tune_gemm.from_candidates([paths[0], paths[0]])
    merged = tune_gemm.from_candidates(paths)
    assert load_gemm_table(merged["table"], device_name="NVIDIA H200").shape("gdn_in").choices[0].kernel.family == (
        "cublas"
    )


def test_a_time_below_its_floor_is_a_finding_and_the_table_is_written(tmp_path, monkeypatch):
    """Ceilings far too low for the measurements: the floors come out above the times (except at the largest bucket,
    where the candidates' own rate raises the bf16 ceiling); the table is written all the same and the record lists
    every measurement under its floor."""
    from engine.graphs import ROWS_GRID

    monkeypatch.setattr(tune_gemm, "RESULTS", tmp_path)
    slow = {"copy_tbps": 1e-6, "bf16_tflops": 1e-6}
    written = tune_gemm.write_outputs(full_measurements(), env(), slow, ROWS_GRID, [])
    load_gemm_table(written["table"], device_name="NVIDIA H200")
    record = json.loads(written["candidates"].read_text())
    assert record["table"] == str(written["table"])
    assert len(record["below_floor"]) == len(full_measurements())  # streaming at 1e-6 TB/s: every time is under it
    assert all(b["time_us"] < b["floor_us"] for b in record["below_floor"])


def test_the_bf16_ceiling_is_raised_to_the_shapes_own_rate_at_the_largest_bucket():
    """As on the H200: a shape at its largest bucket runs faster than the cube's rate; the ceiling takes that rate, and
    the fastest candidate there sits exactly on its floor instead of under it."""
    top = 1280
    n, k = GEMM_SHAPES["gate_up"]
    fast_us = 2 * n * k * top / (900e12) * 1e6  # 900 TFLOP/s, above the cube's 775
    ms = [m("gate_up", top, CUBLAS, fast_us * 1.1), m("gate_up", top, lt(7), fast_us)]
    ceilings = tune_gemm.tuned_ceilings({"copy_tbps": 4.0, "bf16_tflops": 775.0}, ms, (64, top))
    assert ceilings["bf16_tflops"] == pytest.approx(900.0) and ceilings["stream_tbps"] == 4.0
    floor = tune_gemm.floors_us(ceilings, ["gate_up"], (64, top))
    assert floor[("gate_up", top)] == pytest.approx(fast_us)
    assert tune_gemm.below_floor(ms, floor) == []
    with_read = tune_gemm.tuned_ceilings({"copy_tbps": 4.0, "stream_tbps": 4.4, "bf16_tflops": 1000.0}, ms, (64, top))
    assert with_read["bf16_tflops"] == 1000.0 and with_read["stream_tbps"] == 4.4


SHARED_CANDIDATES = sorted((Path(__file__).resolve().parents[1] / "results" / "gemm").glob("*-down-gate_up-*.json"))


@pytest.mark.skipif(not SHARED_CANDIDATES, reason="no committed H200 candidates record under results/gemm/")
def test_the_h200_candidates_give_a_table_with_findings_instead_of_none(tmp_path, monkeypatch):
    """The 2f9c178 H200 candidates (committed under results/gemm/): with the old floors (copy rate, 8192^3 cube) 32
    (shape, rows) pairs were under their floor and no table was written; with `tuned_ceilings` the table is written,
    the engine's loader takes it, and what is still under a floor is listed."""
    monkeypatch.setattr(tune_gemm, "RESULTS", tmp_path)
    gemm_dir = SHARED_CANDIDATES[0].parent
    merged_name = "-".join(sorted(GEMM_SHAPES))
    parts = [p for p in gemm_dir.glob("*2f9c178*-candidates.json") if merged_name not in p.name]  # the two device calls
    assert len(parts) == 2, [p.name for p in parts]
    written = tune_gemm.from_candidates(parts)
    table = load_gemm_table(written["table"], device_name="NVIDIA H200")
    record = json.loads(written["candidates"].read_text())
    old = {tuple(x[:2]): x[2] for p in parts for x in json.loads(p.read_text())["floors_us"]}
    new = {tuple(x[:2]): x[2] for x in record["floors_us"]}
    assert all(new[key] <= old[key] * (1 + 1e-9) for key in old)  # the ceilings only went up or stayed
    assert record["ceilings"]["bf16_tflops"] > 775.0  # the 2f9c178 cube's rate: its own shapes ran faster
    assert record["below_floor"] == []  # measured: every candidate is at or over its floor with these ceilings
    assert record["selection"]["ship"] == "bitwise"  # the bitwise table is the best one at every bucket
    assert {s.name for s in table.shapes} == set(GEMM_SHAPES)


def test_the_command_line_refuses_unknown_shapes_and_buckets():
    with pytest.raises(SystemExit):
        tune_gemm.main(["--shapes", "qkv"])
    with pytest.raises(SystemExit):
        tune_gemm.main(["--buckets", "100"])


@pytest.mark.parametrize("shape", list(GEMM_SHAPES))
def test_the_producer_writes_exactly_the_rows_the_timed_gemm_reads(shape):
    """The tuner times each GEMM behind the kernel that writes its input in the forward: that kernel must write all of
    x[:rows] (NaN-poisoned before) and nothing of x[rows:], at an odd row count (27B kernels at a small K)."""
    import torch

    gen = torch.Generator().manual_seed(3)
    x, write = tune_gemm.producer(shape, 256, 9, torch.device("cpu"), gen)
    assert x.shape == (9, 256) and x.dtype == torch.bfloat16
    x.fill_(float("nan"))
    write(5)
    assert torch.isfinite(x[:5]).all() and x[:5].abs().sum() > 0
    assert torch.isnan(x[5:]).all()
    with pytest.raises(ValueError, match="no producer"):
        tune_gemm.producer("lm_head", 256, 9, torch.device("cpu"), gen)
