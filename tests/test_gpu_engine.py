"""The engine backbone on the H200 with the 27B shapes: the `drone` request through `merged` and `fused` against the
HF reference with the FLA core (`hf_fla`) and with the torch core (`hf_torch`).

    nox --no-venv -s gpu_tests -- tests/test_gpu_engine.py        (prints the table; JSON to $OUT if set)

The correctness half (`checks`) is the runner's `engine_checks` probe (ablations/probes.py).

Two module fixtures, each in two phases so that the 27B weights are never held twice:
- `checks` (correctness; all that the `merged` and `fused` gates trigger, no timing or profiling):
  1. synthetic weights (seed 0) -> HF model: hidden states and last-token states of hf_fla and hf_torch (kept on the
     host), then everything of phase 1 is freed;
  2. the same synthetic weights again -> `MergedWeights` (consumes them) -> `merged` and `fused` engines on that one
     copy: the same states, the NVTX check, and the peak GPU memory of the whole phase (weights, merge, forwards);
     then freed.
- `results` (measurements, for the table, the kernel-count test and $OUT): the same two phases again, with forward
  times and kernel counts instead of states (the HF phase cannot share the engine phase's copy of the weights).
Compared per residual state (embedding, 64 layers, final norm; all real tokens): relative RMSE and the first state
that is not bit-identical; on the last-token states: relative RMSE, and max |dp| over all candidate probabilities of
the request (fp32 head + per-question softmax at the synthetic temperature). Synthetic weights: the probabilities
mean nothing for accuracy; |dp| only measures fidelity between paths.

`fused` runs its attention as one FlashAttention-2 varlen call per layer (GQA native, no mask; engine/backbone.py),
`merged` as a masked SDPA call with k/v repeated (HF's way); both are compared with the HF paths as before.

Bounds. PEAK_GIB comes from the brief. The closeness bounds were set before any GPU measurement, from the tiny twin
on the CPU (per-state relative RMSE up to 1.4e-2 there) scaled for 64 layers; they are provisional: replace them with
the measured values (plus a stated margin) after the first H200 run.

Kernels per fused forward. The brief's target is 700. The CPU count of tests/test_engine_tree.py predicts 836 for the
drone: 256 GEMMs, 241 FLA (5 forward kernels x 48 layers, launched directly by kernels.gdn_core.FlaForwardCore, + one
zero fill of its solve buffer per forward; FLA's own function fills it in every layer: 883), 16 attention, 321 of
ours, 2 torch gathers. The floor with FLA's kernels is about there: reaching 700 needs a GDN core in fewer launches
(5 -> 2 would give 692) or norms and SiLU-mul folded into GEMM epilogues (later stages). Asserted: the kernels
besides the GEMMs do not exceed the prediction (cuBLAS may add a split-K reduction kernel to a GEMM, so GEMMs are
counted apart and printed).
"""

from __future__ import annotations

import json
import os
import statistics
import warnings
from pathlib import Path

import pytest
import torch

from ablations import probes
from engine.stages import build_engine
from engine.weights import MergedWeights
from reference.data import open_jev_workloads
from reference.model import HFBackbone
from reference.service import DecisionModel
from reference.shapes import QWEN38_27B
from reference.weights import synthetic_weights

pytestmark = pytest.mark.gpu

SEED = 0
WORKLOAD = "drone"
PEAK_GIB = 56.0  # engine phase: weights + merge + forwards
FUSED_KERNEL_TARGET = 700  # the brief's target for kernels per fused forward: printed beside the count
PREDICTED_FUSED_NON_GEMM = 836 - 256  # tests/test_engine_tree.py::test_launch_counts_per_forward, GEMMs apart
GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")
STATE_REL_RMSE_BOUND = 5e-2  # provisional (module docstring)
LAST_REL_RMSE_BOUND = 5e-2  # provisional
MAX_DP_BOUND = 2e-2  # provisional
TIMED_RUNS, WARMUP_RUNS = 30, 5


def time_forward(backbone, prepared) -> dict:
    """CUDA-event times of `forward` on prepared inputs: median and p10/p90 of TIMED_RUNS after WARMUP_RUNS."""
    for _ in range(WARMUP_RUNS):
        backbone.forward(prepared)
    samples = []
    for _ in range(TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backbone.forward(prepared)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    deciles = statistics.quantiles(samples, n=10)
    return {"median_ms": statistics.median(samples), "p10_ms": deciles[0], "p90_ms": deciles[-1]}


def count_kernels(backbone, prepared) -> dict:
    """GPU activities of one `forward` (after warm-up) by torch.profiler: kernels, and memcpy/memset separately.

    The profiler's own UserWarnings are ignored (torch 2.11 warns "Profiler clears events at the end of each cycle"
    when a second profile starts; each profile here is one cycle, read at once), so that no profiler notice fails the
    measurement under warnings-as-errors; warnings from the forward itself still count."""
    from torch.profiler import ProfilerActivity, profile

    backbone.forward(prepared)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning. Profiler clears events", category=UserWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.profiler")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            backbone.forward(prepared)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(name.startswith(("Memcpy", "Memset")) for name in names)
    gemms = sum(any(key in name.lower() for key in GEMM_NAMES) for name in names)
    return {"kernels": len(names) - copies, "gemm_kernels": gemms, "memcpy_memset": copies}


def measure(backbone, plan) -> dict:
    """Forward times and kernel counts of one backbone on the plan."""
    prepared = backbone.prepare(plan.candidates, plan.groups)
    return {"time": time_forward(backbone, prepared), **count_kernels(backbone, prepared)}


@pytest.fixture(scope="module")
def checks() -> dict:
    """Correctness, no timing and no profiling (all that the `merged` and `fused` gates trigger): the runner's
    `engine_checks` probe (ablations/probes.py): the four paths' comparisons on the drone request, the peak GPU memory
    of each phase, the NVTX and FLA-core checks. Two phases so that the 27B weights are never held twice."""
    return probes.engine_checks(SEED)


@pytest.fixture(scope="module")
def results(checks) -> dict:
    """Measurements: forward times and kernel counts of the four paths, on weights built again phase by phase (the
    HF model and the merged weights never at once; `checks` freed its copies), beside `checks`' comparisons, peaks and
    NVTX check. Written to $OUT/gpu_engine.json when OUT is set."""
    device = torch.device("cuda")

    weights = synthetic_weights(QWEN38_27B, seed=SEED, device=device)
    hf = {"hf_fla": HFBackbone(weights, "fla")}
    hf["hf_torch"] = HFBackbone(weights, "torch", model=hf["hf_fla"].model)
    plan = DecisionModel(hf["hf_fla"], weights).plan(open_jev_workloads()[WORKLOAD]["request"])
    paths = {name: measure(backbone, plan) for name, backbone in hf.items()}
    del hf, weights
    probes.release_cuda_memory()

    merged_weights = MergedWeights.from_decision_weights(synthetic_weights(QWEN38_27B, seed=SEED, device=device))
    engines = {
        "merged": build_engine(merged_weights, "merged"),
        "fused": build_engine(merged_weights, "fused"),
    }
    paths |= {name: measure(backbone, plan) for name, backbone in engines.items()}  # no loop variable keeps one
    del engines, merged_weights
    probes.release_cuda_memory()

    out = {
        "workload": WORKLOAD,
        "rows": sum(len(c) for c in plan.candidates),
        "candidates": [len(c) for c in plan.candidates],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_gib": checks["peak_gib"],
        "paths": paths,
        "comparisons": checks["comparisons"],
        "nvtx_ranges_bitwise": checks["nvtx_ranges_bitwise"],
        "fla_forward_core_bitwise": checks["fla_forward_core_bitwise"],
        "synthetic_weights": True,
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_engine.json").write_text(json.dumps(out, indent=1))
    return out


def test_print_table(results, capsys):
    r = results
    lines = [
        f"\nengine on {r['device']} ({r['torch']}), {r['workload']}: {len(r['candidates'])} candidates, "
        f"{r['rows']} rows; synthetic weights (probabilities meaningless for accuracy)",
        f"peak GPU memory: HF phase {r['peak_gib']['hf']:.2f} GiB, engine phase {r['peak_gib']['engine']:.2f} GiB "
        f"(bound {PEAK_GIB})",
        f"{'path':<9} {'forward ms p50 [p10, p90]':<28} {'kernels':>8} {'GEMMs':>6} {'memcpy/set':>11}"
        f"   (fused target {FUSED_KERNEL_TARGET}, predicted {PREDICTED_FUSED_NON_GEMM} + GEMMs)",
    ]
    for name, p in r["paths"].items():
        t = p["time"]
        timing = f"{t['median_ms']:8.2f} [{t['p10_ms']:.2f}, {t['p90_ms']:.2f}]"
        lines.append(f"{name:<9} {timing:<28} {p['kernels']:>8} {p['gemm_kernels']:>6} {p['memcpy_memset']:>11}")
    lines.append(f"{'comparison':<20} {'first departing state':>22} {'last rel RMSE':>14} {'max |dp|':>10}")
    for name, c in r["comparisons"].items():
        first = "none" if c["first_departing_state"] is None else str(c["first_departing_state"])
        lines.append(f"{name:<20} {first:>22} {c['last_rel_rmse']:>14.2e} {c['max_dp']:>10.2e}")
    lines.append("per-state relative RMSE (state 0 = embedding, i = layer i-1 output, last = final norm):")
    for name, c in r["comparisons"].items():
        lines.append(f"  {name}: " + " ".join(f"{x:.1e}" for x in c["per_state_rel_rmse"]))
    with capsys.disabled():
        print("\n".join(lines))


def test_peak_memory_holds_the_weights_once(checks):
    assert checks["peak_gib"]["engine"] <= PEAK_GIB


@pytest.mark.parametrize("name", ["merged vs hf_fla", "merged vs hf_torch", "fused vs hf_fla", "fused vs hf_torch"])
def test_engine_close_to_the_reference(checks, name):
    c = checks["comparisons"][name]
    assert c["per_state_rel_rmse"][0] == 0.0, "the embedding gather must be bitwise"
    worst = max(c["per_state_rel_rmse"])
    assert worst <= STATE_REL_RMSE_BOUND, f"{name}: worst per-state relative RMSE {worst:.2e}"
    assert c["last_rel_rmse"] <= LAST_REL_RMSE_BOUND
    assert c["max_dp"] <= MAX_DP_BOUND


def test_fused_close_to_merged(checks):
    c = checks["comparisons"]["fused vs merged"]
    assert c["first_departing_state"] != 0
    assert max(c["per_state_rel_rmse"]) <= STATE_REL_RMSE_BOUND
    assert c["max_dp"] <= MAX_DP_BOUND


def test_nvtx_ranges_do_not_change_the_result(checks):
    assert checks["nvtx_ranges_bitwise"]


def test_fla_forward_core_bitwise_to_fla_function(checks):
    """`fused` with FLA's kernels launched directly (its default core) equals `fused` on FLA's public function."""
    assert checks["fla_forward_core_bitwise"], checks["fla_forward_core_first_departing_state"]


def test_fused_kernel_count_meets_the_prediction(results):
    fused = results["paths"]["fused"]
    assert fused["kernels"] - fused["gemm_kernels"] <= PREDICTED_FUSED_NON_GEMM
