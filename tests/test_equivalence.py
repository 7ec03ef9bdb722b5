"""measure/equivalence.py on made-up records: identical numerics pass, one changed bit or a missing pair fails."""

from __future__ import annotations

import copy
import math

import pytest

from measure.equivalence import compare


def record(plan: str = "cpu-tiny") -> dict:
    workload = {"id": "drone", "rows": 337, "median_ms": 10.0, "probabilities": [[0.25, 0.75]], "max_abs_dp": 1e-3,
                "hidden_rel_rmse": 2e-3, "argmax_flips": 0, "state_rel_rmse": [0.0, 1e-6], "first_departing_state": 1,
                "vs_builds_on": {"stage": "fused", "bitwise": True}}  # fmt: skip
    stages = [{"name": "tree", "workloads": [workload]}, {"name": "graphs", "workloads": [dict(workload)]}]
    return {"plan": {"name": plan}, "stages": stages}


def test_identical_numerics_with_other_timings_are_identical():
    after = copy.deepcopy(before := record())
    after["stages"][0]["workloads"][0]["median_ms"] = 99.0
    assert [r["status"] for r in compare(before, after)] == ["identical", "identical"]


def test_one_changed_bit_or_a_missing_pair_is_reported():
    after = copy.deepcopy(before := record())
    probabilities = after["stages"][1]["workloads"][0]["probabilities"]
    probabilities[0][0] = math.nextafter(probabilities[0][0], 1.0)  # one bit
    after["stages"][0]["workloads"] = []
    rows = compare(before, after)
    assert rows[0] == {"stage": "tree", "workload": "drone", "status": "missing", "missing_in": "after"}
    assert rows[1]["status"] == "differs" and rows[1]["differing"] == ["probabilities"]
    with pytest.raises(ValueError, match="two plans"):
        compare(before, record("gpu-27b"))


def test_out_copies_both_records_and_keeps_one_already_there(tmp_path, capsys):
    """`--out` on the folder that holds `before` (the kept record of an earlier comparison) copies only `after`."""
    import json
    import shutil
    from pathlib import Path

    from measure.equivalence import main

    committed = Path(__file__).resolve().parents[1] / "results" / "equivalence" / "20261202T154512Z-cpu-7d751a0.json"
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy2(committed, kept / "before.json")
    shutil.copy2(committed, tmp_path / "after.json")
    assert main([str(kept / "before.json"), str(tmp_path / "after.json"), "--out", str(kept)]) == 0
    assert sorted(p.name for p in kept.iterdir()) == ["after.json", "before.json"]
    assert json.loads(capsys.readouterr().out)["after"] == "7d751a0"
