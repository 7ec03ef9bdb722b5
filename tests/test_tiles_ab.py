"""measure.tiles_ab: the kernel_tiles A/B log read back into a table (CPU; synthetic logs with known numbers)."""

from __future__ import annotations

import json

import pytest

from measure import tiles_ab

WARNING = "/opt/torch/profiler.py:224: UserWarning: Profiler clears events at the end of each cycle."


def _run(header: str, us: dict[tuple[str, str], float], equal: float = 1.0, nan_free: bool = True) -> str:
    cases = [{"kernel": k, "tile": t, "us": u, "tbps": 1.0, "equal_share": equal, "nan_free": nan_free}
             for (k, t), u in us.items()]  # fmt: skip
    return f"== {header}\n{WARNING}\n{json.dumps({'rows': 971, 'cases': cases})}\n"


TILES = [("silu_mul", "4x1024, 4 warps"), ("silu_mul", "8x1024, 4 warps"), ("gdn_prep", "16 rows, 4 warps")]


def _log(old: list[float], new: list[float], again: list[float], **new_flags) -> str:
    return (_run("old abc1234", dict(zip(TILES, old))) + _run("new def5678", dict(zip(TILES, new)), **new_flags)
            + _run("old abc1234 again", dict(zip(TILES, again))))  # fmt: skip


def test_each_new_run_is_compared_with_the_mean_of_the_old_runs_beside_it():
    runs = tiles_ab.parse_runs(_log([40.0, 50.0, 26.0], [44.0, 50.0, 25.0], [40.2, 49.8, 26.0]))
    assert [run["role"] for run in runs] == ["old", "new", "old"]
    rows = tiles_ab.compare(runs)
    assert [(row["kernel"], row["shipped"]) for row in rows] == [("silu_mul", True), ("silu_mul", False),
                                                                 ("gdn_prep", True)]  # fmt: skip
    (change,) = rows[0]["changes"]
    assert change["baseline_us"] == pytest.approx(40.1) and change["change"] == pytest.approx(44.0 / 40.1 - 1)
    assert rows[0]["old_spread"] == pytest.approx(40.2 / 40.0 - 1)
    assert rows[2]["changes"][0]["change"] == pytest.approx(25.0 / 26.0 - 1)
    text = tiles_ab.table(runs, rows)
    assert "| silu_mul | 4x1024, 4 warps (shipped) | 40.00 | 44.00 | 40.20 | 0.5 % | +9.7 % | 1.000000, yes |" in text
    assert "| gdn_prep | 16 rows, 4 warps (shipped) |" in text and "-3.8 %" in text


def test_a_new_run_at_the_end_is_compared_with_the_old_run_before_it_and_bad_bits_show():
    log = _run("old a", dict(zip(TILES, [10.0, 20.0, 30.0]))) + _run(
        "new b", dict(zip(TILES, [11.0, 20.0, 27.0])), equal=0.5, nan_free=False
    )
    runs = tiles_ab.parse_runs(log)
    rows = tiles_ab.compare(runs)
    assert rows[0]["changes"][0]["baseline_us"] == 10.0 and rows[0]["changes"][0]["change"] == pytest.approx(0.1)
    assert "0.500000, NO" in tiles_ab.table(runs, rows)


@pytest.mark.parametrize(
    ("log", "message"),
    [
        ("no headers at all\n", "no '== old' / '== new' run headers"),
        ("== baseline x\n{}\n", "must start with '== old' or '== new'"),
        (
            _run("old a", dict(zip(TILES, [1.0, 2.0, 3.0]))) + "== new b\nTraceback: the probe failed\n",
            "has no probe JSON",
        ),
        (_run("old a", dict(zip(TILES, [1.0, 2.0, 3.0]))), "at least one old and one new run"),
        ('== old a\n{"rows": 971, "cases": [{"kernel"\n', "does not parse"),
    ],
)
def test_unreadable_logs_are_refused_with_where_and_why(log, message):
    with pytest.raises(tiles_ab.TilesLogError, match=message):
        tiles_ab.parse_runs(log)


def test_tiles_that_only_some_runs_swept_get_their_times_and_no_change():
    """An older tree's sweep lacks the tiles added since: a tile only the new run swept keeps its time, no change, and
    sits with its kernel's other tiles; a tile only the old runs swept has no new time."""
    extra = ("silu_mul", "1x1024, 4 warps")
    old = dict(zip(TILES, [40.0, 50.0, 26.0]))
    new = dict(zip(TILES[:2], [44.0, 50.0])) | {extra: 38.0}
    runs = tiles_ab.parse_runs(_run("old a", old) + _run("new b", new) + _run("old a again", old))
    rows = tiles_ab.compare(runs)
    assert [(row["kernel"], row["tile"]) for row in rows] == [*TILES[:2], extra, TILES[2]]
    assert rows[2]["us"] == [None, 38.0, None] and rows[2]["old_spread"] is None
    assert rows[2]["changes"][0]["change"] is None and rows[2]["changes"][0]["us"] == 38.0
    assert rows[3]["us"] == [26.0, None, 26.0]
    assert rows[3]["changes"] == [{"run": "new b", "us": None, "baseline_us": 26.0, "change": None,
                                   "equal_share": None, "nan_free": None}]  # fmt: skip
    assert rows[0]["changes"][0]["change"] == pytest.approx(0.1)
    text = tiles_ab.table(runs, rows)
    assert "| silu_mul | 1x1024, 4 warps | - | 38.00 | - | - | - | 1.000000, yes |" in text
    assert "| gdn_prep | 16 rows, 4 warps (shipped) | 26.00 | - | 26.00 | 0.0 % | - | - |" in text


def test_two_new_runs_of_one_commit_keep_a_column_each_where_one_lacks_a_tile():
    old = dict(zip(TILES, [40.0, 50.0, 26.0]))
    log = (_run("old a", old) + _run("new b", dict(zip(TILES, [44.0, 50.0, 25.0]))) + _run("old a again", old)
           + _run("new b", dict(zip(TILES[:2], [42.0, 50.0]))) + _run("old a again", old))  # fmt: skip
    runs = tiles_ab.parse_runs(log)
    rows = tiles_ab.compare(runs)
    assert [change["us"] for change in rows[0]["changes"]] == [44.0, 42.0]
    assert [change["us"] for change in rows[2]["changes"]] == [25.0, None]
    times = "| 26.00 | 25.00 | 26.00 | - | 26.00 | 0.0 % |"
    text = tiles_ab.table(runs, rows)
    assert f"| gdn_prep | 16 rows, 4 warps (shipped) {times} -3.8 % | 1.000000, yes | - | - |" in text


def test_the_command_prints_the_table_writes_the_json_and_fails_cleanly(tmp_path, capsys):
    log = tmp_path / "ab.log"
    log.write_text(_log([40.0, 50.0, 26.0], [44.0, 50.0, 25.0], [40.2, 49.8, 26.0]))
    out = tmp_path / "kernel-tiles" / "ab.json"
    assert tiles_ab.main([str(log), "--json", str(out)]) == 0
    assert "3 runs of the kernel_tiles probe at [971] rows" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["runs"] == ["old abc1234", "new def5678", "old abc1234 again"] and len(record["rows"]) == 3
    assert tiles_ab.main([str(tmp_path / "missing.log")]) == 2
    assert "tiles_ab:" in capsys.readouterr().err
