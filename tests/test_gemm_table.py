"""CPU tests of the GEMM tuning table loader (engine/gemm_table.py): a valid table built here (no measured table
exists yet), its lookups, every refusal, and the cuBLAS fallback with its one warning."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from engine.gemm_table import (
    CUBLASLT_ALGORITHM_KEYS,
    GEMM_SHAPES,
    GemmTableError,
    load_gemm_table,
    table_or_fallback,
)
from engine.graphs import ROWS_GRID

GPU = "NVIDIA H200"


def example_table() -> dict:
    """A table of every shape and bucket: cuBLAS for the input projections, one cuBLASLt algorithm for gate_up,
    split-K S=3 for out and S=2 for down (times made up; floors below them)."""
    algorithm = dict.fromkeys(CUBLASLT_ALGORITHM_KEYS, 0) | {"id": 66, "tile_id": 20, "splitk_num": 1, "stages_id": 8}
    kernels = {
        "gdn_in": {"family": "cublas"},
        "attn_in": {"family": "cublas"},
        "out": {"family": "splitk", "split": 3},
        "gate_up": {"family": "cublaslt", "algorithm": algorithm},
        "down": {"family": "splitk", "split": 2},
    }
    shapes = {
        name: {
            "n": n,
            "k": k,
            "buckets": [
                {
                    "rows": rows,
                    "kernel": kernels[name],
                    "time_us": 20.0 + rows / 10,
                    "floor_us": 15.0 + rows / 12,
                    "bitwise_f_linear": kernels[name]["family"] != "splitk",
                    "row_invariant": True,
                }
                for rows in ROWS_GRID
            ],
        }
        for name, (n, k) in GEMM_SHAPES.items()
    }
    return {
        "schema_version": 1,
        "gpu": {"name": GPU, "capability": [9, 0]},
        "versions": {
            "torch": "2.11.0",
            "cuda": "13.0",
            "cublas": "13.1.0",
            "cublaslt": "13.1.0",
            "nvmath": None,
            "triton": "3.6.0",
        },
        "commit": "1c45c5f",
        "created_utc": "2026-12-02T10:00:00Z",
        "shapes": shapes,
    }


def write(tmp_path: Path, table: dict | str, name: str = "gemm-table.json") -> Path:
    path = tmp_path / name
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    return path


def test_gemm_shapes_are_the_27b_merged_weights() -> None:
    """N out x K in of the merged weights (engine/weights.py) at the 27B shapes."""
    assert GEMM_SHAPES == {
        "gdn_in": (16480, 5120),
        "attn_in": (14336, 5120),
        "out": (5120, 6144),
        "gate_up": (34816, 5120),
        "down": (5120, 17408),
    }


def test_load_and_choose(tmp_path: Path) -> None:
    """A valid table loads into frozen, typed values; `choice` takes the smallest bucket >= rows, and the largest
    bucket's choice above it (the shape's one split at every row count)."""
    table = load_gemm_table(write(tmp_path, example_table()), device_name=GPU)
    assert (table.gpu_name, table.capability, table.commit) == (GPU, (9, 0), "1c45c5f")
    assert table.created_utc.isoformat() == "2026-12-02T10:00:00+00:00"
    assert dict(table.versions)["nvmath"] is None and dict(table.versions)["triton"] == "3.6.0"
    assert [s.name for s in table.shapes] == list(GEMM_SHAPES)
    assert [s.split for s in table.shapes] == [1, 1, 3, 1, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.commit = "0000000"  # type: ignore[misc]

    assert table.choice("down", 1).rows == ROWS_GRID[0] == 64
    assert table.choice("down", 64).rows == 64
    assert table.choice("down", 65).rows == 80
    assert table.choice("down", 1280).rows == 1280 == ROWS_GRID[-1]
    above = table.choice("down", 5000)
    assert above.rows == 1280 and above.kernel.family == "splitk" and above.kernel.split == 2
    lt = table.choice("gate_up", 300).kernel
    assert lt.family == "cublaslt" and dict(lt.algorithm)["id"] == 66 and lt.split == 1
    assert table.choice("out", 90).bitwise_f_linear is False
    with pytest.raises(KeyError, match="no GEMM shape 'qkv'"):
        table.choice("qkv", 90)
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        table.choice("down", 0)


def _edit(path: str, value) -> dict:
    """The example table with the value at `path` (keys and list indices separated by '/') replaced; a value of
    `...` deletes the key."""
    table = copy.deepcopy(example_table())
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
    node = table
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return table


def _swapped_buckets() -> dict:
    table = example_table()
    buckets = table["shapes"]["out"]["buckets"]
    buckets[0], buckets[1] = buckets[1], buckets[0]
    return table


def _split_varies() -> dict:
    table = example_table()
    table["shapes"]["down"]["buckets"][5]["kernel"] = {"family": "splitk", "split": 3}
    return table


def _family_varies() -> dict:
    table = example_table()
    table["shapes"]["down"]["buckets"][-1]["kernel"] = {"family": "cublas"}
    return table


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "schema_version 'none \\(a JSON list\\)', this loader reads 1"),
        (_edit("schema_version", 2), "schema_version 2, this loader reads 1"),
        (_edit("schema_version", True), "schema_version True"),
        (_edit("shapes/down", ...), r"shapes: missing keys \['down'\]"),
        (_edit("shapes/qkv", {}), r"shapes: missing keys \[\], unknown keys \['qkv'\]"),
        (_edit("shapes/down/k", 17400), "the 27B's down is 5120 x 17408"),
        (_edit("shapes/down/buckets/3", ...), r"every shape must have the same bucket rows"),
        (_edit("shapes/out/buckets/0/rows", 65), r"of engine.graphs.ROWS_GRID, ascending: not in the grid \[65\]"),
        (_swapped_buckets(), "out of order"),
        (_split_varies(), r"split 2 at rows \[64, .*\]; split 3 at rows \[144\]\): the row-invariance law"),
        (_family_varies(), r"split 2 at rows .*; split 1 at rows \[1280\]"),
        (_edit("gpu/name", "NVIDIA H100 80GB HBM3"), "tuned on 'NVIDIA H100 80GB HBM3', this GPU is 'NVIDIA H200'"),
        (_edit("gpu/capability", [9]), "gpu.capability: expected"),
        (_edit("versions/torch", None), "versions.torch: expected a non-empty string"),
        (_edit("versions/cufft", "1"), r"unknown keys \['cufft'\]"),
        (_edit("commit", "HEAD"), "commit: expected 7-40"),
        (_edit("created_utc", "2026-12-02T10:00:00"), "created_utc: expected an ISO 8601 time in UTC"),
        (_edit("created_utc", "yesterday"), "created_utc"),
        (_edit("shapes/down/buckets/0/kernel", {"family": "cutlass"}), "family must be 'cublas', 'cublaslt' or"),
        (_edit("shapes/down/buckets/0/kernel/split", 1), r"buckets\[0\].kernel.split: expected an integer >= 2"),
        (_edit("shapes/down/buckets/0/kernel/split", 2.0), "expected an integer >= 2, got 2.0"),
        (_edit("shapes/gate_up/buckets/0/kernel/algorithm/tile_id", ...), r"missing keys \['tile_id'\]"),
        (_edit("shapes/gate_up/buckets/0/kernel/algorithm/splitk_num", 0), "splitk_num: expected an integer >= 1"),
        (_edit("shapes/gate_up/buckets/0/kernel/algorithm/id", True), "algorithm.id: expected an integer"),
        (_edit("shapes/gdn_in/buckets/2/time_us", float("nan")), "time_us: expected a finite number > 0"),
        (_edit("shapes/gdn_in/buckets/2/row_invariant", False), "row_invariant is False; a chosen kernel must be"),
        (_edit("shapes/gdn_in/buckets/2/bitwise_f_linear", 1), "bitwise_f_linear: expected true or false"),
        (_edit("shapes/gdn_in/buckets/2/note", "x"), r"unknown keys \['note'\]"),
    ],
)
def test_refusals(tmp_path: Path, table: dict | str, message: str) -> None:
    """Every refusal is a GemmTableError naming the file and what is wrong."""
    path = write(tmp_path, table)
    with pytest.raises(GemmTableError, match=message) as raised:
        load_gemm_table(path, device_name=GPU)
    assert str(raised.value).startswith(f"GEMM table {path}: ")


def test_a_time_below_its_floor_loads(tmp_path: Path) -> None:
    """A time under the tuner's floor says its ceiling was low (the tuner's record flags it): the loader takes it."""
    table = load_gemm_table(write(tmp_path, _edit("shapes/gdn_in/buckets/2/time_us", 1.0)), device_name=GPU)
    choice = table.choice("gdn_in", ROWS_GRID[2])
    assert choice.time_us == 1.0 and choice.floor_us > choice.time_us


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GemmTableError, match="cannot read it \\(No such file or directory\\)"):
        load_gemm_table(tmp_path / "absent.json", device_name=GPU)


def test_fallback_warns_once_and_returns_none(tmp_path: Path) -> None:
    """`table_or_fallback`: the table when it is good (no warning); otherwise None and exactly one warning, for a
    missing file, corrupt JSON and a table of another GPU alike."""
    warnings: list[str] = []
    good = write(tmp_path, example_table())
    assert table_or_fallback(good, GPU, warn=warnings.append) is not None and warnings == []
    for path, device, why in [
        (tmp_path / "absent.json", GPU, "cannot read it"),
        (write(tmp_path, "{", "corrupt.json"), GPU, "not valid JSON"),
        (good, "NVIDIA B300", "tuned on 'NVIDIA H200'"),
    ]:
        warnings.clear()
        assert table_or_fallback(path, device, warn=warnings.append) is None
        assert len(warnings) == 1 and why in warnings[0] and warnings[0].endswith("GEMMs fall back to cuBLAS")


def test_fallback_logs_by_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="engine.gemm_table"):
        assert table_or_fallback(tmp_path / "absent.json", GPU) is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
