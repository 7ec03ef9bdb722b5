"""ablations.clocks: the card's clocks sampled while the runner times, from nvidia-smi's CSV (a stand-in on PATH)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ablations import clocks

UUID = "5c1e0c8a-9e3b-4a7e-b1d2-0f6a2c4e8d10"


def _stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, refuse: str = "") -> Path:
    """A fake `nvidia-smi` first on PATH: it logs its arguments and prints `line`, or exits 6 when an argument holds
    `refuse` (as a driver that does not know a field does)."""
    log = tmp_path / "calls.log"
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    refusal = f'case "$*" in *{refuse}*) echo "Field is not a valid field to query." >&2; exit 6;; esac'
    refusal = refusal if refuse else ""
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{refusal}\necho "{line}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=UUID))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(clocks, "INTERVAL_MS", 20)
    return log


def test_summary_of_nvidia_smi_lines():
    lines = [
        "1980, 2619, 51, 412.50, 0x0000000000000000",
        "1755, 2619, 58, 690.10, 0x0000000000000004",
        "[N/A], 2619, 58, 690.10, 0x0000000000000000",  # a sample without the SM clock: skipped, counted
        "1830, [N/A], 60, 655.00, 0x0000000000000020",
        "",
    ]
    summary = clocks.summarise(lines)
    assert summary["samples"] == 3 and summary["skipped_lines"] == 1
    assert (summary["sm_mhz_median"], summary["sm_mhz_min"], summary["sm_mhz_max"]) == (1830, 1755, 1980)
    assert summary["mem_mhz_median"] == 2619 and summary["temperature_c_max"] == 60
    assert summary["power_w_median"] == 655.0 and summary["power_w_max"] == 690.1
    assert summary["reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert clocks.summarise(["garbage"]) == {"samples": 0, "skipped_lines": 1, "error": "no sample parsed"}


def test_sampling_while_the_block_runs(tmp_path, monkeypatch):
    log = _stand_in(tmp_path, monkeypatch, "1755, 2619, 58, 690.10, 0x0000000000000004")
    with clocks.sample_clocks("cuda") as summary:
        assert summary == {}  # filled when the block ends
        time.sleep(0.3)
    assert summary["samples"] >= 2 and summary["sm_mhz_median"] == 1755 and summary["reasons"] == ["sw_power_cap"]
    assert summary["fields"] == list(clocks.FIELDS)
    calls = log.read_text().splitlines()
    assert len(calls) == summary["samples"] + 1  # the fields check, then one process a sample
    assert all(f"--id=GPU-{UUID}" in call and "--query-gpu=clocks.sm," in call for call in calls)


def test_older_drivers_name_the_reasons_field_differently(tmp_path, monkeypatch):
    log = _stand_in(tmp_path, monkeypatch, "1980, 2619, 51, 412.50, 0x0000000000000001", refuse="clocks_event")
    with clocks.sample_clocks(torch.device("cuda", 0)) as summary:
        time.sleep(0.1)
    assert summary["fields"][-1] == clocks.OLD_REASONS_FIELD and summary["reasons"] == ["gpu_idle"]
    assert summary["samples"] >= 1 and "clocks_throttle_reasons.active" in log.read_text().splitlines()[-1]


def test_no_clocks_is_an_error_entry_not_a_failure(tmp_path, monkeypatch):
    with clocks.sample_clocks("cpu") as summary:
        pass
    assert summary == {"error": "no GPU (cpu)"}
    _stand_in(tmp_path, monkeypatch, "unused", refuse="query")
    with clocks.sample_clocks("cuda") as summary:
        pass
    assert summary["error"].startswith("nvidia-smi exit 6: Field is not a valid field")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with clocks.sample_clocks("cuda") as summary:
        pass
    assert summary == {"error": "nvidia-smi not found"}
