"""How the runner measures: forward timings, kernel counts and GPU-busy time, the device's ceilings, the floors.

Timings (ARCHITECTURE.md, Measuring). On a GPU each sample is one call bracketed by CUDA events with the device
synchronized before and after, so a sample is the latency of one forward from an idle GPU: kernels plus the launch
gaps a CPU-bound forward leaves. Beside it, the host time until the call returned (`host_median_ms`): when it is
close to the sample, the host is the bottleneck. On the CPU each sample is `time.perf_counter` around one call.
Warm-up calls run first and are not sampled. Summaries: median with p10 / p90 (numpy's linear interpolation), and
the raw samples.

Kernel counts and GPU-busy time come from `torch.profiler` (CPU + CUDA activities) over `profile_runs` calls: the
chrome trace's events of category `kernel` (memcpy, memset and user annotations excluded) divided by the calls, and
the union of those kernels' [start, end) intervals (overlapping kernels counted once) divided by the calls. The same
kernels are summed per family (`KERNEL_FAMILIES`: our fused kernels, GEMMs, the GDN core, the attention core, the
rest), so a record says how much of a forward is the work the engine cannot avoid (GEMMs + GDN core + attention core:
`core_ms`) and how much is everything else, launch gaps included (`median_ms / core_ms`, issue 4's target). The
time between those kernels in the profiled window, per call, and the kernel pairs with the most of it: `kernel_gaps`.

Ceilings are upper bounds of what the device did in this process, so that a floor computed from them is a floor:
* streaming (`stream_tbps`): the larger of the read-only rate (`read_tbps`: bytes of a `copy_bytes` bf16 buffer read
  by one reduction per second; a GEMM reads its weights, it does not copy them) and the copy rate (`copy_tbps`: bytes
  read + written by a device-to-device copy of `copy_bytes` random bytes per second);
* bf16 compute (`bf16_tflops`): the best of the n x n x n bf16 matmul on random inputs (`bf16_cube_tflops`) and the
  model's own GEMM shapes (`gemm_shapes`: name -> (N, K)) at their largest row bucket (`bf16_shape_tflops`): on the
  H200, cuBLAS ran gate_up at 1,024 rows faster than the 8192^3 cube's rate (775 TFLOP/s at 2f9c178), which made a
  floor from the cube alone no floor.
Each rate is the median over `runs` after 3 warm-up calls. A measured time under a floor from these ceilings is still
possible (another shape or row count can run faster than the ones measured here): the runner and the GEMM tuner flag
it (`below_floor`) and go on; it says the ceiling was low, never that the time is wrong.

Floors per workload: weight streaming = the GEMM weights' bytes / streaming rate (the bytes every forward must read:
the backbone's `gemm_weight_bytes()`, else 2 x shapes.linear_params() for bf16); compute = 2 x linear_params x rows /
the matmul rate of the weights' format (rows the stage computes); the floor is the larger of the two.

NVTX: `nvtx_range` marks stage / workload / phase on the GPU timeline; `layer_ranges` adds one range per decoder layer
and per op family (the layer's direct children: attention or GDN mixer, MLP, norms) through module hooks, so an Nsight
Systems profile reads by name. Hooks cost CPU time, so the runner keeps them on only for the profiled calls unless
asked (`--nvtx`). On the CPU both are no-ops.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NOT_KERNELS = re.compile(r"^(Memcpy|Memset)", re.IGNORECASE)


@dataclass(frozen=True)
class Samples:
    samples_ms: list[float]
    host_ms: list[float] | None = None  # GPU only: per sample, the host time until the call returned (launch time)

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.samples_ms))

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_ms, dtype=np.float64), q))

    def summary(self) -> dict[str, float | int | list[float]]:
        return {
            "median_ms": self.median_ms,
            "p10_ms": self.percentile_ms(10),
            "p90_ms": self.percentile_ms(90),
            "min_ms": min(self.samples_ms),
            "max_ms": max(self.samples_ms),
            "runs": len(self.samples_ms),
            "samples_ms": list(self.samples_ms),
            "host_median_ms": float(statistics.median(self.host_ms)) if self.host_ms else None,
        }


def time_calls(fn: Callable[[], object], *, device: str, warmup: int, runs: int) -> Samples:
    """`runs` latency samples (ms) of `fn()` after `warmup` unsampled calls: CUDA events on a GPU, else perf_counter."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    if device == "cuda":
        return Samples(*_cuda_samples(fn, runs))
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return Samples(samples)


def _cuda_samples(fn: Callable[[], object], runs: int) -> tuple[list[float], list[float]]:
    """CUDA-event samples, and beside each the host time from before the start event to `fn`'s return: when the host
    time is about the sample, the forward is launch-bound (the GPU waits on the host)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples, host = [], []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        samples.append(float(start.elapsed_time(end)))
    return samples, host


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


# Kernel families, first match wins, by substring of the lower-cased kernel name. `ours` comes first: the names of the
# Triton kernels in kernels/ (one of them contains "attention"). The GDN core is FLA's chunked kernels, ours
# (`_gdn_chunk_*`) and FlashInfer's (`...delta_rule_sm90...`, whose name holds "flash" too, so the GDN core comes before
# the attention core; records of e85e07c and before put it under attention_core); the HF torch fallback's GDN core is
# plain torch ops and lands in gemm / other. The attention core is FlashAttention or SDPA.
KERNEL_FAMILIES: dict[str, tuple[str, ...]] = {
    "ours": (
        "_residual_rmsnorm",
        "_silu_mul",
        "_gdn_prep",
        "_gated_rmsnorm",
        "_attn_prep",
        "_attention_gate",
        "_gather_slots",
    ),
    "gdn_core": ("chunk_", "recompute_w_u", "solve_tril", "l2norm", "kkt", "delta_rule"),
    "attention_core": ("flash", "fmha", "attention", "sdpa"),
    "gemm": ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas"),
}
FAMILIES = (*KERNEL_FAMILIES, "other")
CORE_FAMILIES = ("gemm", "gdn_core", "attention_core")  # the work a forward cannot avoid (issue 4's 1.10x target)


def kernel_family(name: str) -> str:
    """The family of a kernel name (KERNEL_FAMILIES, else "other")."""
    lower = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES.items() if any(key in lower for key in keys)), "other")


@dataclass(frozen=True)
class KernelStats:
    kernels_per_forward: float
    gpu_busy_ms: float  # per forward
    top_kernels: list[dict]  # the kernels with the most time: name, calls per forward, ms per forward
    families: dict[str, dict]  # per family (FAMILIES): calls per forward, ms per forward (summed kernel time)
    idle_ms: float  # per forward: the GPU's time between kernels in the profiled window (`kernel_gaps`)
    top_gaps: list[dict]  # the kernel pairs with the most idle time between them (`kernel_gaps`)
    non_kernel: dict[str, dict]  # per forward: the GPU's memsets and copies (`non_kernel_activity`)

    @property
    def core_ms(self) -> float:
        """Summed kernel time per forward of the GEMMs, the GDN core and the attention core."""
        return sum(self.families[f]["ms_per_forward"] for f in CORE_FAMILIES)


def kernel_stats(trace_events: list[dict], calls: int, top: int = 24) -> KernelStats:
    """Kernel count, busy time, top kernels and families per call from chrome-trace events (`cat` == "kernel",
    `ts` / `dur` in us). `top` 24 lists every kernel of a 27B forward but the rare ones (records before 2026-12-04's
    runs list 10, which left most of the engine's own kernels out of the per-kernel floors, `measure.kernel_floors`)."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel" and not NOT_KERNELS.match(e.get("name", ""))]
    busy_us = union_length((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event["name"], []).append(float(event["dur"]))
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    top_kernels = [
        {"name": name, "calls_per_forward": len(durs) / calls, "ms_per_forward": sum(durs) / calls / 1e3}
        for name, durs in ranked
    ]
    families = {family: {"calls_per_forward": 0.0, "ms_per_forward": 0.0} for family in FAMILIES}
    for name, durs in by_name.items():
        family = families[kernel_family(name)]
        family["calls_per_forward"] += len(durs) / calls
        family["ms_per_forward"] += sum(durs) / calls / 1e3
    idle_ms, top_gaps = kernel_gaps(kernels, calls)
    return KernelStats(
        len(kernels) / calls, busy_us / calls / 1e3, top_kernels, families, idle_ms, top_gaps,
        non_kernel_activity(trace_events, calls),
    )  # fmt: skip


def non_kernel_activity(trace_events: list[dict], calls: int) -> dict[str, dict]:
    """The GPU's activities that are not kernels, per call, by "<category>: <name>" ({calls_per_forward,
    ms_per_forward}): memsets and copies (`cat` gpu_memset / gpu_memcpy, or a kernel event named Memset / Memcpy).
    They lie in `kernel_gaps`' idle time, so a gap that holds one says so (cuBLASLt puts one before some algorithms of
    the GEMM table; moving it did not close their gap: engine/stages/gemm.md, "The idle before some cuBLASLt
    kernels")."""
    out: dict[str, dict] = {}
    for event in trace_events:
        category, name = event.get("cat"), event.get("name", "")
        if category in ("gpu_memset", "gpu_memcpy") or (category == "kernel" and NOT_KERNELS.match(name)):
            entry = out.setdefault(f"{category}: {name}", {"calls_per_forward": 0.0, "ms_per_forward": 0.0})
            entry["calls_per_forward"] += 1 / calls
            entry["ms_per_forward"] += float(event.get("dur", 0.0)) / calls / 1e3
    return out


def kernel_gaps(kernels: list[dict], calls: int, top: int = 10) -> tuple[float, list[dict]]:
    """The time between kernels (trace events of `kernel_stats`, overlaps merged) from the window's first kernel to
    its last, per call, and the `top` (kernel before, kernel after) pairs by that time: {after, before,
    gaps_per_forward, ms_per_forward}. Busy plus idle is the window, so idle is what the GPU waited inside the
    profiled calls and between them (the runner's calls follow one another without a sync); a timed median above
    busy + idle was lost outside the kernels' window or to a slower card in the timed calls."""
    idle_us, pairs, reach, last = 0.0, {}, None, None
    for event in sorted(kernels, key=lambda e: float(e["ts"])):
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        if reach is not None and start > reach:
            idle_us += start - reach
            gap = pairs.setdefault((last, event["name"]), [0, 0.0])
            gap[0], gap[1] = gap[0] + 1, gap[1] + start - reach
        if reach is None or end > reach:
            reach, last = end, event["name"]
    ranked = sorted(pairs.items(), key=lambda item: -item[1][1])[:top]
    top_gaps = [{"after": after, "before": before, "gaps_per_forward": n / calls, "ms_per_forward": us / calls / 1e3}
                for (after, before), (n, us) in ranked]  # fmt: skip
    return idle_us / calls / 1e3, top_gaps


def profile_kernels(fn: Callable[[], object], calls: int, top: int = 24) -> KernelStats:
    """Run `fn` `calls` times under torch.profiler (CUDA) and count the kernels it launched (`kernel_stats`, its `top`
    kernels listed)."""
    return kernel_stats(profiled_events(fn, calls), calls, top)


def profiled_events(fn: Callable[[], object], calls: int) -> list[dict]:
    """The chrome-trace events of `calls` calls of `fn` under torch.profiler (CPU and CUDA activities)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def host_profile(fn: Callable[[], object], top: int = 15) -> dict:
    """Where the host spends one call of `fn`: cProfile over the call (the profiler slows Python down, so read the
    shares, not the absolute times), the `top` functions by own time and by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    total_ms = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}

    def rows(key: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda item: -item[1][key])[:top]
        return [
            {
                "function": f"{Path(file).name}:{line}({name})",
                "calls": calls,
                "own_ms": own * 1e3,
                "cumulative_ms": cumulative * 1e3,
            }
            for (file, line, name), (_, calls, own, cumulative, _) in ranked
        ]

    return {"profiled_ms": total_ms, "by_own_time": rows(2), "by_cumulative_time": rows(3)}


def measure_ceilings(
    device: str,
    *,
    copy_bytes: int,
    gemm_n: int,
    runs: int,
    gemm_shapes: dict[str, tuple[int, int]] | None = None,
    shape_rows: int = 0,
) -> dict:
    """Ceilings of this device (module docstring): streaming TB/s and bf16 TFLOP/s, each the best of its probes, with
    every probe's rate and samples. `gemm_shapes` (name -> (N, K)) at `shape_rows` rows join the cube's rate."""
    generator = torch.Generator(device=device).manual_seed(0)
    source = torch.randint(0, 256, (copy_bytes,), dtype=torch.uint8, device=device, generator=generator)
    target = torch.empty_like(source)
    copy = time_calls(lambda: target.copy_(source), device=device, warmup=3, runs=runs)
    values = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device=device, generator=generator)
    read = time_calls(lambda: values.sum(dtype=torch.float32), device=device, warmup=3, runs=runs)
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device, generator=generator)
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device, generator=generator)
    cube = time_calls(lambda: torch.mm(a, b), device=device, warmup=3, runs=runs)
    shape_rates, shape_samples = {}, {}
    for name, (n, k) in (gemm_shapes or {}).items():
        x = torch.randn(shape_rows, k, dtype=torch.bfloat16, device=device, generator=generator)
        w = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=generator) * k**-0.5).to(torch.bfloat16)
        timed = time_calls(lambda x=x, w=w: torch.nn.functional.linear(x, w), device=device, warmup=3, runs=runs)
        shape_rates[name] = 2 * n * k * shape_rows / (timed.median_ms * 1e-3) / 1e12
        shape_samples[name] = timed.samples_ms
        del x, w
    copy_tbps = 2 * copy_bytes / (copy.median_ms * 1e-3) / 1e12
    read_tbps = (copy_bytes // 2) * 2 / (read.median_ms * 1e-3) / 1e12
    cube_tflops = 2 * gemm_n**3 / (cube.median_ms * 1e-3) / 1e12
    return {
        "stream_tbps": max(copy_tbps, read_tbps),
        "bf16_tflops": max([cube_tflops, *shape_rates.values()]),
        "copy_tbps": copy_tbps,
        "read_tbps": read_tbps,
        "bf16_cube_tflops": cube_tflops,
        "bf16_shape_tflops": shape_rates,
        "shape_rows": shape_rows,
        "copy_bytes": copy_bytes,
        "copy_samples_ms": copy.samples_ms,
        "read_samples_ms": read.samples_ms,
        "gemm_n": gemm_n,
        "gemm_samples_ms": cube.samples_ms,
        "shape_samples_ms": shape_samples,
        "method": "median of runs after 3 warm-up calls; copy rate = 2 x bytes / time; read rate = bytes / time of "
        "one bf16 sum; bf16 rate = 2 n k rows / time (cube: n = k = rows); stream_tbps and bf16_tflops are the best "
        "of their probes",
    }


def streaming_tbps(ceilings: dict) -> float:
    """The streaming ceiling of a record: `stream_tbps`, or the copy rate in records from before it existed."""
    return ceilings.get("stream_tbps", ceilings["copy_tbps"])


COMPUTE_CEILINGS = {"bf16": "bf16_tflops"}  # the matmul rate that bounds a GEMM of each weight format


def floors(weight_bytes: int, linear_params: int, rows: int, ceilings: dict, weight_format: str = "bf16") -> dict:
    """Weight-streaming and compute floors (ms) of one forward over `rows` rows; the floor is the larger.

    weight_bytes: the GEMM weights' real bytes (scales included); compute at the ceiling of their format."""
    weight_ms = weight_bytes / (streaming_tbps(ceilings) * 1e12) * 1e3
    compute_ms = 2 * linear_params * rows / (ceilings[COMPUTE_CEILINGS[weight_format]] * 1e12) * 1e3
    return {"floor_ms": max(weight_ms, compute_ms), "weight_floor_ms": weight_ms, "compute_floor_ms": compute_ms}


def below_floor(time_ms: float, floor_ms: float, ceilings: dict) -> str | None:
    """The finding a time under its floor is (the ceilings were low: module docstring), or None."""
    if time_ms >= floor_ms:
        return None
    return (
        f"{time_ms:.4g} ms is under its floor {floor_ms:.4g} ms: a ceiling was low (streaming "
        f"{streaming_tbps(ceilings):.3g} TB/s, bf16 {ceilings['bf16_tflops']:.4g} TFLOP/s)"
    )


@contextmanager
def nvtx_range(name: str, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


LAYER_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)$")


def _layer_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(range name, module) for each decoder layer (`...layers.<i>`) and each of its direct children."""
    named = []
    for name, module in root.named_modules():
        match = LAYER_NAME.match(name)
        if match is None:
            continue
        named.append((f"layer {match.group(1)}", module))
        for child_name, child in module.named_children():
            named.append((f"layer {match.group(1)} {child_name}", child))
    return named


@contextmanager
def layer_ranges(backbone: object, enabled: bool) -> Iterator[int]:
    """NVTX ranges per decoder layer and op family of the backbone's torch module (`backbone.model` or the backbone
    itself when it is a module); yields how many modules got ranges (0 when disabled or no module is found)."""
    root = backbone if isinstance(backbone, torch.nn.Module) else getattr(backbone, "model", None)
    if not enabled or not isinstance(root, torch.nn.Module):
        yield 0
        return
    handles = []
    named = _layer_modules(root)

    # A hook that returns a value replaces the module's input (pre-hook) or output (hook): these must return None,
    # while nvtx's push/pop return the range depth.
    def push(*_: object, name: str) -> None:
        torch.cuda.nvtx.range_push(name)

    def pop(*_: object) -> None:
        torch.cuda.nvtx.range_pop()

    for range_name, module in named:
        handles.append(module.register_forward_pre_hook(functools.partial(push, name=range_name)))
        handles.append(module.register_forward_hook(pop))
    try:
        yield len(named)
    finally:
        for handle in handles:
            handle.remove()
