"""The GPU's clocks, temperature and power while the runner times a workload, sampled by `nvidia-smi` in a loop.

Why: the runner times its stages one after another, so a difference between two stages' kernels can be the card's
clock rather than the kernels. At 450783f (H100) every kernel family of `core` on drone ran about 5 % slower per call
than the same cuBLAS and Triton kernels in `graphs` (engine/stages/core.md); a record that holds the clocks of each
workload's timed calls says whether the card or the code moved.

`sample_clocks(device)` is a context manager around the timed calls: a thread asks `nvidia-smi --query-gpu=FIELDS
--format=csv,noheader,nounits --id=UUID` for the GPU of `device` once every INTERVAL_MS (one short process a sample,
not nvidia-smi's own loop, whose output sits in a pipe buffer when it is stopped), and on exit the dict it yields holds
the summary (`summarise`): samples, SM clock median / min / max in MHz, memory clock median, temperature max in C,
power median and max in W, and the clock event reasons seen (the union of the active bitmasks, decoded by `REASONS`).
A sample costs the host one process start (tens of ms of one core, in parallel with the timed calls). The card's
settings are only read, never changed. Where there is no GPU, no `nvidia-smi`, or it refuses the fields, the dict
holds `error` instead and the run goes on: the clocks are evidence beside a timing, never a condition of it. Tests:
tests/test_clocks.py (a stand-in `nvidia-smi` on PATH).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

INTERVAL_MS = 200
FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")
OLD_REASONS_FIELD = "clocks_throttle_reasons.active"  # the same bitmask's name in drivers before 535
REASONS = {  # nvidia-smi's clocks event reason bits (nvml.h, nvmlClocksEventReason*)
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def _query(gpu: str | None, fields: tuple[str, ...]) -> list[str]:
    command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    return command + ([f"--id={gpu}"] if gpu else [])


def _working_fields(device: torch.device) -> tuple[tuple[str, ...] | None, str | None, str]:
    """The fields this driver answers for the device (the reasons under their old name on older drivers) and the id
    that names it (its UUID; no id on a one-GPU machine if the UUID is refused), or None and why not."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    ids = ([f"GPU-{uuid}"] if uuid is not None else []) + ([None] if torch.cuda.device_count() == 1 else [])
    error = "no nvidia-smi id for this device"
    for gpu in ids:
        for fields in (FIELDS, (*FIELDS[:-1], OLD_REASONS_FIELD)):
            try:
                done = subprocess.run(_query(gpu, fields), capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.SubprocessError) as failure:
                return None, None, f"nvidia-smi failed: {failure}"
            if done.returncode == 0 and len(done.stdout.strip().splitlines()) == 1:
                return fields, gpu, ""
            error = f"nvidia-smi exit {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    return None, None, error


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarise(lines: list[str]) -> dict:
    """The summary of nvidia-smi's CSV lines (FIELDS' order): a line that does not parse is skipped and counted."""
    sm, mem, temp, power, reasons, skipped = [], [], [], [], 0, 0
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(FIELDS) or _number(cells[0]) is None:
            skipped += int(bool(line.strip()))
            continue
        sm.append(float(cells[0]))
        for values, cell in ((mem, cells[1]), (temp, cells[2]), (power, cells[3])):
            if (value := _number(cell)) is not None:
                values.append(value)
        try:
            reasons |= int(cells[4], 16)
        except ValueError:
            pass
    if not sm:
        return {"samples": 0, "skipped_lines": skipped, "error": "no sample parsed"}
    return {
        "samples": len(sm),
        "skipped_lines": skipped,
        "interval_ms": INTERVAL_MS,
        "sm_mhz_median": statistics.median(sm),
        "sm_mhz_min": min(sm),
        "sm_mhz_max": max(sm),
        "mem_mhz_median": statistics.median(mem) if mem else None,
        "temperature_c_max": max(temp) if temp else None,
        "power_w_median": statistics.median(power) if power else None,
        "power_w_max": max(power) if power else None,
        "reasons": [name for bit, name in REASONS.items() if reasons & bit],
    }


@contextmanager
def sample_clocks(device: str | torch.device) -> Iterator[dict]:
    """Sample the GPU of `device` while the block runs; the yielded dict holds the summary (or `error`) after it."""
    summary: dict = {}
    device = torch.device(device)
    if device.type != "cuda":
        summary["error"] = f"no GPU ({device.type})"
        yield summary
        return
    if shutil.which("nvidia-smi") is None:
        summary["error"] = "nvidia-smi not found"
        yield summary
        return
    fields, gpu, error = _working_fields(device)
    if fields is None:
        summary["error"] = error
        yield summary
        return
    lines: list[str] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            try:
                done = subprocess.run(_query(gpu, fields), capture_output=True, text=True, timeout=20)
                lines.extend(done.stdout.splitlines())
            except (OSError, subprocess.SubprocessError):
                pass  # a lost sample; the summary counts what arrived
            if stop.wait(INTERVAL_MS / 1e3):
                return

    sampler = threading.Thread(target=sample, name="sample_clocks", daemon=True)
    sampler.start()
    try:
        yield summary
    finally:
        stop.set()
        sampler.join()
        summary |= summarise(lines)
        summary["fields"] = list(fields)
