"""Probes: measurements the runner records beside the stage timings, in `record["probes"]` (CUDA plans only).

    python -m ablations.probes [NAME ...]     (on a CUDA machine: prints the probes' results as JSON)

Each probe runs in a fresh Python process (`python -m ablations.probes NAME`), so it starts with an empty GPU, its own
cuBLAS settings and none of the runner's state, and its result is one JSON object on the last line of its output.
`run_probes` collects them as `{name: {"error": null or why it failed, "seconds": wall time, ...its fields}}`:

* `gemm_rows`: cuBLAS row-count invariance of the engine's six GEMM shapes at the 27B widths. For each shape and each
  (flat rows, tree rows) pair of `ROW_PAIRS`, the first `tree rows` rows of one random input are multiplied alone and
  inside the flat call: the share of bit-equal output rows and both calls' median µs. Measured twice, each in a fresh
  process: with torch's cuBLAS defaults (`default`) and without the cuBLAS workspace (`no_workspace`, the engine's
  setting `engine.gemm.ROW_INVARIANT_CUBLAS`). Fields: `default`, `no_workspace` (lists of cases).
* `gdn_handoff`: issue 5's hand-off target. The GDN core of one layer as the `tree` engine calls it (FLA's forward
  kernels launched directly, q/k normalised before) on a 4,000-token shared context with 5 candidates: the
  `handoff` and `replicated` schedules against prefilling the context once; wall time of back-to-back calls
  (`cuda_time_ms`) and GPU kernel time per call (profiler busy time, `gpu_busy_ms`).
* `kernel_tiles`: the three costliest fused kernels (silu_mul, residual_rmsnorm, gdn_prep as the engine calls it, from
  each row's conv window), the gated norm and attn_prep as stage `core` calls them (o read through `o_rows`, k and v at
  key rows) at the 27B widths and 971 rows in the shipped tile shape (the first case of each kernel) and in other
  width-derived shapes: mean µs of the kernel in a CUDA graph, L2 flushed before each launch (`graph_kernel_us`;
  `triton.testing.do_bench` medians in records up to b02c126), effective TB/s (each input read once, each output written
  once), the share of output elements bit-equal to the shipped shape's, and whether every output element was written
  (outputs NaN-poisoned before the launch).
* `engine_checks`: the whole model (27B synthetic weights) on the drone request through `hf_fla`, `hf_torch`,
  `merged` and `fused`, in two phases so the weights are never held twice: per pair, the relative RMSE of every
  residual state, the first state that is not bit-identical, the last-token relative RMSE and max |dp| over every
  candidate probability; whether NVTX ranges change `fused`'s answer; whether `fused` on FLA's kernels launched
  directly equals `fused` on FLA's public function; the peak GPU memory of each phase. Synthetic weights: |dp| is
  fidelity between code paths, not accuracy.

The measuring code imports torch when it runs; this module's import, `FIELDS` and `validate_probes` do not, so the
report (which imports no torch) and the record validator can use them.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROW_PAIRS = [(359, 199), (330, 190), (347, 179), (277, 160), (294, 150), (971, 337)]  # last: drone (bitwise there)
TILE_ROWS = 971  # the drone request's packed rows
ENGINE_CORE_OPTIONS = {"use_qk_l2norm_in_kernel": False}  # engine/backbone.py `_gdn` with the fused kernels
ENGINE_WORKLOAD = "drone"
GIB = 2**30

# The fields each probe's result carries (besides `error` and `seconds`), for the validator and the report.
FIELDS = {
    "gemm_rows": ("default", "no_workspace"),
    "gdn_handoff": ("workload", "rows", "context_rows", "prefill_context_ms", "handoff_ms", "replicated_ms",
                    "handoff_over_prefill", "gpu_busy_ms", "gpu_busy_handoff_over_prefill", "chosen_mode"),
    "kernel_tiles": ("rows", "cases"),
    "engine_checks": ("workload", "peak_gib", "comparisons", "nvtx_ranges_bitwise", "fla_forward_core_bitwise",
                      "fla_forward_core_first_departing_state"),
}  # fmt: skip


def validate_probes(probes: Any, where: str = "probes") -> list[str]:
    """Problems of a record's `probes` object: each entry a known probe with a string-or-null `error`, numeric
    `seconds` and, when it did not fail, every field of `FIELDS`; an empty list when there are none."""
    if not isinstance(probes, dict):
        return [f"{where}: expected an object, got {type(probes).__name__}"]
    problems = []
    for name, result in probes.items():
        at = f"{where}.{name}"
        if name not in FIELDS:
            problems.append(f"{at}: not a known probe ({', '.join(FIELDS)})")
        elif not isinstance(result, dict):
            problems.append(f"{at}: expected an object")
        elif not (result.get("error") is None or isinstance(result.get("error"), str)):
            problems.append(f"{at}.error: expected a string or null")
        elif not isinstance(result.get("seconds"), int | float):
            problems.append(f"{at}.seconds: expected a number")
        elif result["error"] is None:
            problems += [f"{at}.{field}: missing" for field in FIELDS[name] if field not in result]
    return problems


# ---------------------------------------------------------------------------------------------- running
def run_probe(name: str, env: dict[str, str] | None = None, timeout_s: float = 1800.0) -> dict[str, Any]:
    """`python -m ablations.probes NAME` in a fresh process: its JSON result, or `error` saying why there is none."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "ablations.probes", name], cwd=REPO, env=env, timeout=timeout_s,
                              capture_output=True, text=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-800:]}", "seconds": seconds}
    return {"error": None, "seconds": seconds, **json.loads(done.stdout.strip().splitlines()[-1])}


def run_probes(names: tuple[str, ...] = tuple(FIELDS)) -> dict[str, dict[str, Any]]:
    """Every probe of `names`, each in its own process, in order; a failed probe is recorded and the rest still run."""
    return {name: run_probe(name) for name in names}


# ---------------------------------------------------------------------------------------------- gemm_rows
def gemm_shapes() -> dict[str, tuple[int, int]]:
    """(out features, in features) of the engine's GEMMs at the 27B shapes."""
    from reference.shapes import QWEN38_27B as S

    hidden, hq, hkv, d = S.hidden_size, S.num_attention_heads, S.num_key_value_heads, S.head_dim
    return {
        "gdn_in": (S.conv_dim + S.linear_value_dim + 2 * S.linear_num_value_heads, hidden),
        "gdn_out": (hidden, S.linear_value_dim),
        "attn_in": (2 * hq * d + 2 * hkv * d, hidden),
        "attn_out": (hidden, hq * d),
        "gate_up": (2 * S.intermediate_size, hidden),
        "down": (hidden, S.intermediate_size),
    }


def gemm_row_cases() -> list[dict[str, Any]]:
    """Every (GEMM shape, row pair) case in this process's cuBLAS setting: equal-row share, flat and tree µs."""
    import torch
    import torch.nn.functional as F
    import triton

    gen = torch.Generator(device="cuda").manual_seed(21)
    cases = []
    for name, (n, k) in gemm_shapes().items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
        for flat_rows, tree_rows in ROW_PAIRS:
            x = torch.randn(flat_rows, k, generator=gen, device="cuda").bfloat16()
            big, small = F.linear(x, w), F.linear(x[:tree_rows], w)
            cases.append({
                "gemm": name, "n": n, "k": k, "flat_rows": flat_rows, "tree_rows": tree_rows,
                "equal_row_share": (big[:tree_rows] == small).all(dim=1).float().mean().item(),
                "flat_us": 1000 * triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w), return_mode="median"),
                "tree_us": 1000 * triton.testing.do_bench(
                    lambda x=x, w=w, m=tree_rows: F.linear(x[:m], w), return_mode="median"
                ),
            })  # fmt: skip
    return cases


def gemm_rows() -> dict[str, Any]:
    """`gemm_row_cases` in two fresh processes: cuBLAS defaults, and without the workspace (the engine's setting)."""
    from engine.gemm import ROW_INVARIANT_CUBLAS

    default_env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    runs = {}
    for label, env in (("default", default_env), ("no_workspace", default_env | ROW_INVARIANT_CUBLAS)):
        result = run_probe("gemm_row_cases", env=env, timeout_s=600)
        if result["error"]:
            raise RuntimeError(f"{label}: {result['error']}")
        runs[label] = result["cases"]
    return runs


# ---------------------------------------------------------------------------------------------- gdn_handoff
def long_single_question(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """4,000 shared tokens (template, context, question), then 5 options of 31-45 tokens each."""
    rng = random.Random(seed)
    shared = [rng.randrange(150_000) for _ in range(4000)]
    candidates = [
        shared + [1000 + o] + [rng.randrange(150_000) for _ in range(rng.randrange(30, 45))] for o in range(5)
    ]
    return candidates, [0] * 5


def gdn_inputs(num_rows: int, seed: int, device: str = "cuda"):
    """27B GDN core inputs: q, k [N, 16, 128], v [N, 48, 128] bf16; g = -exp(A_log) softplus(a + dt_bias) fp32."""
    import torch
    import torch.nn.functional as F

    from reference.shapes import QWEN38_27B as S

    gen = torch.Generator(device=device).manual_seed(seed)
    h, hv, d = S.linear_num_key_heads, S.linear_num_value_heads, S.linear_key_head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = randn(num_rows, h, d).bfloat16(), randn(num_rows, h, d).bfloat16(), randn(num_rows, hv, d).bfloat16()
    a_log = torch.log(torch.rand(hv, generator=gen, device=device) * 15 + 1)
    g = -torch.exp(a_log) * F.softplus(randn(num_rows, hv) + randn(hv))
    beta = torch.sigmoid(randn(num_rows, hv)).bfloat16()
    return q, k, v, g, beta


def engine_gdn_inputs(num_rows: int, seed: int, device: str = "cuda"):
    """`gdn_inputs` as the `fused` and `tree` engines hand them to the core: q and k already L2-normalised per head
    (by `kernels.gdn_prep`), so the core runs with use_qk_l2norm_in_kernel=False (ENGINE_CORE_OPTIONS)."""
    import torch.nn.functional as F

    q, k, v, g, beta = gdn_inputs(num_rows, seed, device)
    q, k = (F.normalize(t.float(), dim=-1).bfloat16() for t in (q, k))
    return q, k, v, g, beta


def cuda_time_ms(fn, inner: int = 10, rounds: int = 15) -> float:
    """GPU time per call: median over `rounds` of CUDA-event time for `inner` back-to-back calls, divided by `inner`.

    Back-to-back calls let the host run ahead, as in a forward pass, so host-side launch overhead is not counted
    where the GPU work covers it. Three warm-up calls first (autotuning, caches).
    """
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def gdn_handoff() -> dict[str, Any]:
    """GDN-core time of the `handoff` and `replicated` schedules against prefilling the shared context once."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # the deterministic Triton path (reference-math §4.3), before FLA loads
    import torch
    from fla.ops.utils.index import prepare_chunk_indices

    from ablations import timing
    from engine.plan import SolveWorkspace, plan_tree
    from engine.planner import choose_gdn_mode
    from engine.tree import tree_gdn_core
    from kernels.gdn_core import FlaForwardCore

    core = FlaForwardCore()
    tree = plan_tree(*long_single_question(), device="cuda")
    options = {"workspace": tree.arena.workspace, **ENGINE_CORE_OPTIONS}  # as the `tree` engine calls the core
    q, k, v, g, beta = engine_gdn_inputs(tree.num_rows, seed=6)
    context = torch.arange(tree.root_len + tree.question_lens[0], device="cuda")  # the shared rows, in order
    ctx = [t.index_select(0, context).unsqueeze(0) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0, len(context)], device="cuda")
    chunk_indices = prepare_chunk_indices(cu, 64)

    prefill_options = options | {"workspace": SolveWorkspace()}  # its own layout, its own solve buffer

    def prefill():
        core(*ctx, cu_seqlens=cu, chunk_indices=chunk_indices, **prefill_options)

    calls = {
        mode: lambda mode=mode: tree_gdn_core(q, k, v, g, beta, tree, mode=mode, core=core, **options)
        for mode in ("replicated", "handoff")
    }
    prefill_ms = cuda_time_ms(prefill)
    wall = {mode: cuda_time_ms(call) for mode, call in calls.items()}
    busy = {name: timing.profile_kernels(fn, 5).gpu_busy_ms for name, fn in (("prefill", prefill), *calls.items())}
    return {
        "workload": "long4k",
        "rows": tree.num_rows,
        "context_rows": len(context),
        "prefill_context_ms": prefill_ms,
        "handoff_ms": wall["handoff"],
        "replicated_ms": wall["replicated"],
        "handoff_over_prefill": wall["handoff"] / prefill_ms,
        "gpu_busy_ms": busy,
        "gpu_busy_handoff_over_prefill": busy["handoff"] / busy["prefill"],
        "chosen_mode": choose_gdn_mode(tree),
    }


# ---------------------------------------------------------------------------------------------- kernel_tiles
TILE_CALLS = 20  # launches of a tile per captured graph
FLUSH_BYTES = 256 * 2**20  # written before each launch: five times the H200's 50 MB L2


def graph_kernel_us(launch, outs, kernel: str, calls: int = TILE_CALLS, replays: int = 3) -> float:
    """Mean µs of the Triton kernel named `kernel` over `calls` launches captured in one CUDA graph, each behind a
    `FLUSH_BYTES` write that evicts L2 (cold inputs, as `triton.testing.do_bench`), replayed `replays` times under
    torch.profiler: the CUPTI durations the runner's per-kernel table counts (`ablations.timing.profile_kernels`), so
    neither the host's launch time nor the flush is in the number. A do_bench median includes whatever the host needs
    to launch the kernel beyond the flush's GPU time: in the H200 sweep of 827fa63 the shipped gdn_prep tile, timed
    first, took 52.1 us there and 31.4 us on an H100 at 450783f."""
    import torch

    from ablations.timing import profile_kernels

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=outs[0].device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(outs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            flush.zero_()
            launch(outs)
    graph.replay()
    timed = [k for k in profile_kernels(graph.replay, replays).top_kernels if k["name"] == kernel]
    if not timed:
        raise RuntimeError(f"the profiler saw no {kernel!r} in the graph's replays")
    return 1000.0 * timed[0]["ms_per_forward"] / timed[0]["calls_per_forward"]


def equal_share(a, b) -> float:
    """Share of elements of `a` bit-equal to `b`'s (bf16 compared as 16-bit integers, so NaNs compare too)."""
    import torch

    same = (a.view(torch.int16) == b.view(torch.int16)) if a.dtype == torch.bfloat16 else (a == b)
    return same.float().mean().item()


def _tile_sweep(kernel: str, sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Launch each (tile name, launch function) of a sweep (`silu_mul_tiles`) once on fresh NaN-poisoned outputs,
    compare with the first tile's outputs, then time it in a CUDA graph (`graph_kernel_us` of `_<kernel>_kernel`)."""
    cases, shipped, nbytes = [], None, sweep["nbytes"]
    for tile, launch in sweep["tiles"]:
        outs = sweep["outputs"]()
        launch(outs)
        shipped = [t.clone() for t in outs] if shipped is None else shipped
        us = graph_kernel_us(launch, outs, f"_{kernel}_kernel")
        cases.append({"kernel": kernel, "tile": tile, "us": us, "tbps": nbytes / us / 1e6,
                      "equal_share": min(equal_share(a, b) for a, b in zip(outs, shipped, strict=True)),
                      "nan_free": not any(t.isnan().any().item() for t in outs)})  # fmt: skip
    return cases


def _poisoned(device, *shapes_dtypes):
    import torch

    return [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes_dtypes]


def silu_mul_tiles(device: str = "cuda", rows: int = TILE_ROWS) -> dict[str, Any]:
    """The tiles of `_silu_mul_kernel` at the 27B width, the shipped one first; `wrapper` is the public call they must
    match. A sweep: {"tiles": [(name, launch(outs))], "outputs": fresh NaN-poisoned outputs, "nbytes", "wrapper"}.
    Each launch passes the kernel's arguments by name, so a changed signature fails (tests/test_kernel_tile_sweeps.py
    runs every launch under the interpreter)."""
    import torch
    import triton

    from ablations.kernel_bytes import silu_mul_bytes
    from kernels import silu_mul
    from kernels.activations import _silu_mul_kernel
    from kernels.numerics import LAUNCH_OPTIONS, ieee_quiet, kernel_mode
    from reference.shapes import QWEN38_27B as S

    inter = S.intermediate_size
    gen = torch.Generator(device=device).manual_seed(11)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen, device=device) * 2).bfloat16()
    torch_cpu = kernel_mode(_silu_mul_kernel, gate_up.device)

    def tile(block_r, block_n, warps):
        def launch(outs):
            grid = (triton.cdiv(rows, block_r), triton.cdiv(inter, block_n))
            with ieee_quiet(torch_cpu):
                _silu_mul_kernel[grid](gate_up_ptr=gate_up, out_ptr=outs[0], rows=rows, stride_in=gate_up.stride(0),
                                       INTER=inter, BLOCK_R=block_r, BLOCK_N=block_n, TORCH_CPU=torch_cpu,
                                       num_warps=warps, **LAUNCH_OPTIONS)  # fmt: skip

        return f"{block_r}x{block_n}, {warps} warps", launch

    shapes = [(4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (16, 1024, 8), (2, 2048, 4), (4, 2048, 8), (1, 4096, 4),
              (2, 4096, 8), (16, 512, 4), (32, 512, 8), (2, 1024, 4), (4, 1024, 8), (1, 1024, 4)]  # fmt: skip
    return {"tiles": [tile(*shape) for shape in shapes],
            "outputs": lambda: _poisoned(device, ((rows, inter), torch.bfloat16)),
            "nbytes": silu_mul_bytes(rows), "wrapper": lambda: [silu_mul(gate_up)]}  # fmt: skip


def residual_rmsnorm_tiles(device: str = "cuda", rows: int = TILE_ROWS) -> dict[str, Any]:
    """The tiles of `_residual_rmsnorm_kernel` (bf16 delta) at the 27B hidden size, as `silu_mul_tiles`."""
    import torch
    import triton

    from ablations.kernel_bytes import residual_rmsnorm_bytes
    from kernels import residual_rmsnorm
    from kernels.norms import _residual_rmsnorm_kernel, inverse_count
    from kernels.numerics import LAUNCH_OPTIONS, ieee_quiet, kernel_mode
    from reference.shapes import QWEN38_27B as S

    hidden, eps = S.hidden_size, S.rms_norm_eps
    gen = torch.Generator(device=device).manual_seed(12)
    residual = (torch.randn(rows, hidden, generator=gen, device=device) * 4).bfloat16()
    delta = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()
    weight = (torch.randn(hidden, generator=gen, device=device) * 0.1).bfloat16()
    block_h = triton.next_power_of_2(hidden)
    torch_cpu = kernel_mode(_residual_rmsnorm_kernel, residual.device)

    def tile(block_r, warps):
        def launch(outs):
            with ieee_quiet(torch_cpu):
                _residual_rmsnorm_kernel[(triton.cdiv(rows, block_r),)](
                    residual_ptr=residual, delta_ptr=delta, weight_ptr=weight, new_residual_ptr=outs[0],
                    normed_ptr=outs[1], rows=rows, residual_sr=hidden, delta_sr=hidden, delta_ss=0, eps=eps,
                    inv_n=inverse_count(hidden), HIDDEN=hidden, BLOCK_R=block_r, BLOCK_H=block_h, HAS_DELTA=True,
                    SPLITS=0, TORCH_CPU=torch_cpu, num_warps=warps, **LAUNCH_OPTIONS,
                )  # fmt: skip

        return f"{block_r}x{block_h}, {warps} warps", launch

    shapes = [(1, 16), (1, 8), (1, 4), (2, 16), (4, 16), (2, 8)]
    return {"tiles": [tile(*shape) for shape in shapes],
            "outputs": lambda: _poisoned(device, *[((rows, hidden), torch.bfloat16)] * 2),  # new residual, normed
            "nbytes": residual_rmsnorm_bytes(rows),
            "wrapper": lambda: list(residual_rmsnorm(residual, delta, weight, eps))}  # fmt: skip


def gdn_prep_tiles(device: str = "cuda", rows: int = TILE_ROWS) -> dict[str, Any]:
    """The tiles of `_gdn_prep_kernel` as the engine calls it since gdn_prep v5 (each row's conv window, `taps`), at the
    27B GDN widths over four packed sequences of `rows` rows in all, as `silu_mul_tiles`."""
    import torch
    import triton

    from ablations.kernel_bytes import gdn_prep_bytes
    from kernels import gdn_prep
    from kernels.gdn_prep import _gdn_prep_kernel
    from kernels.numerics import LAUNCH_OPTIONS, ieee_quiet, kernel_mode
    from reference.shapes import QWEN38_27B as S

    hk, hv = S.linear_num_key_heads, S.linear_num_value_heads
    k_dim, v_dim, width = S.linear_key_head_dim, S.linear_value_head_dim, S.linear_conv_kernel_dim
    conv_dim = 2 * hk * k_dim + hv * v_dim
    gen = torch.Generator(device=device).manual_seed(13)
    proj = torch.randn(rows, conv_dim + hv * v_dim + 2 * hv, generator=gen, device=device).bfloat16()
    conv_weight = (torch.randn(conv_dim, width, generator=gen, device=device) * 0.5).bfloat16()
    a_log = torch.log(torch.rand(hv, generator=gen, device=device) * 15 + 1)
    dt_bias = torch.randn(hv, generator=gen, device=device)
    cuts = [0, rows * 300 // 971, rows * 301 // 971, rows * 578 // 971, rows]  # drone's 300, 1, 277, 393 at 971
    taps = torch.tensor([[row - lag if row - lag >= start else -1 for lag in range(width - 1, -1, -1)]
                         for start, end in zip(cuts, cuts[1:]) for row in range(start, end)],
                        dtype=torch.int64, device=device)  # fmt: skip
    torch_cpu = kernel_mode(_gdn_prep_kernel, proj.device)
    dims = {"num_k_heads": hk, "num_v_heads": hv, "head_k_dim": k_dim, "head_v_dim": v_dim}

    def tile(block_t, warps):
        def launch(outs):
            with ieee_quiet(torch_cpu):
                _gdn_prep_kernel[(triton.cdiv(rows, block_t), 2 * hk + hv + 1)](
                    proj_ptr=proj, conv_weight_ptr=conv_weight, a_log_ptr=a_log, dt_bias_ptr=dt_bias,
                    cu_seqlens_ptr=taps, rows_ptr=taps, slots_ptr=taps, taps_ptr=taps, q_ptr=outs[0], k_ptr=outs[1],
                    v_ptr=outs[2], g_ptr=outs[3], beta_ptr=outs[4], tokens=rows, num_seqs=1, proj_rows=rows,
                    proj_sr=proj.stride(0), eps=1e-6, KEY_HEADS=hk, VALUE_HEADS=hv, KEY_DIM=k_dim, VALUE_DIM=v_dim,
                    WIDTH=width, SEARCH_STEPS=0, QK_L2NORM=True, HAS_ROWS=False, HAS_SLOTS=False, HAS_TAPS=True,
                    BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(max(k_dim, v_dim)),
                    BLOCK_HV=triton.next_power_of_2(hv), TORCH_CPU=torch_cpu, num_warps=warps, **LAUNCH_OPTIONS,
                )  # fmt: skip

        return f"{block_t} rows, {warps} warps", launch

    def outputs():
        return _poisoned(device, ((rows, hk * k_dim), torch.bfloat16), ((rows, hk * k_dim), torch.bfloat16),
                         ((rows, hv * v_dim), torch.bfloat16), ((rows, hv), torch.float32),
                         ((rows, hv), torch.bfloat16))  # fmt: skip

    def wrapper():
        out = gdn_prep(proj, conv_weight, a_log, dt_bias, None, taps=taps, **dims)
        return [t.reshape(rows, -1) for t in out]

    shapes = [(16, 4), (16, 8), (32, 4), (32, 8), (8, 4), (64, 8)]
    return {
        "tiles": [tile(*shape) for shape in shapes],
        "outputs": outputs,
        "nbytes": gdn_prep_bytes(rows, rows),
        "wrapper": wrapper,
    }


def gated_rmsnorm_tiles(device: str = "cuda", rows: int = TILE_ROWS) -> dict[str, Any]:
    """The tiles of `_gated_rmsnorm_kernel` as stage `core` calls it (o at the tree's path slots, each output row read
    through `o_rows` from its representative slot: 3 slots a row, drone's bucket has 1,074 for 352) at the 27B GDN
    widths with the engine's fp32 weight, as `silu_mul_tiles`; bytes as `ablations.kernel_bytes` counts them. A tile is
    (value-head rows per program, warps); the shipped one is 16 rows, 4 warps since kernels/norms.py v4
    (`kernels.numerics.tile_elements` / 2 V; 32 before, the first tile of the sweep of 827fa63, which ran with a bf16
    weight)."""
    import torch
    import triton

    from ablations.kernel_bytes import gated_rmsnorm_bytes
    from kernels import gated_rmsnorm
    from kernels.norms import _gated_rmsnorm_kernel, inverse_count
    from kernels.numerics import LAUNCH_OPTIONS, ieee_quiet, kernel_mode
    from reference.shapes import QWEN38_27B as S

    hv, v_dim, eps = S.linear_num_value_heads, S.linear_value_head_dim, S.rms_norm_eps
    gen = torch.Generator(device=device).manual_seed(14)
    o = torch.randn(3 * rows, hv, v_dim, generator=gen, device=device).bfloat16()
    o_rows = torch.randperm(3 * rows, generator=gen, device=device)[:rows]
    z = (torch.randn(rows, hv * v_dim, generator=gen, device=device) * 2).bfloat16()
    weight = (1 + torch.randn(v_dim, generator=gen, device=device) * 0.1).bfloat16().float()  # fp32, as the engine
    torch_cpu = kernel_mode(_gated_rmsnorm_kernel, z.device)

    def tile(block_r, warps):
        def launch(outs):
            with ieee_quiet(torch_cpu):
                _gated_rmsnorm_kernel[(triton.cdiv(rows * hv, block_r),)](
                    o_ptr=o, o_rows_ptr=o_rows, z_ptr=z, weight_ptr=weight, out_ptr=outs[0], head_rows=rows * hv,
                    z_sr=z.stride(0), eps=eps, inv_n=inverse_count(v_dim), HEADS=hv, HEAD_DIM=v_dim, BLOCK_R=block_r,
                    BLOCK_D=triton.next_power_of_2(v_dim), W_BF16=False, HAS_O_ROWS=True, TORCH_CPU=torch_cpu,
                    num_warps=warps, **LAUNCH_OPTIONS,
                )  # fmt: skip

        return f"{block_r} rows, {warps} warps", launch

    shapes = [(16, 4), (32, 4), (8, 4), (64, 4), (16, 2), (64, 8)]
    return {"tiles": [tile(*shape) for shape in shapes],
            "outputs": lambda: _poisoned(device, ((rows, hv * v_dim), torch.bfloat16)),
            "nbytes": gated_rmsnorm_bytes(rows),
            "wrapper": lambda: [gated_rmsnorm(o, z, weight, eps, o_rows=o_rows)]}  # fmt: skip


def attn_prep_tiles(device: str = "cuda", rows: int = TILE_ROWS) -> dict[str, Any]:
    """The tiles of `_attn_prep_kernel` as the tree's attention calls it (k and v prepared at 3 key rows a row, read
    from random proj rows through `key_rows`; drone's bucket has 1,074 key slots for 352 rows) at the 27B attention
    widths, as `silu_mul_tiles`; bytes as `ablations.kernel_bytes` counts them. A tile is (rows per program, warps);
    the shipped one is 8 rows, 4 warps (`kernels.numerics.tile_elements` / 2 D)."""
    import torch
    import triton

    from ablations.kernel_bytes import attn_prep_bytes
    from kernels import attn_prep
    from kernels.attn_prep import _attn_prep_kernel
    from kernels.norms import inverse_count
    from kernels.numerics import LAUNCH_OPTIONS, ieee_quiet, kernel_mode
    from reference.shapes import QWEN38_27B as S

    hq, hkv, d, r, eps = S.num_attention_heads, S.num_key_value_heads, S.head_dim, S.rotary_dim, S.rms_norm_eps
    keys = 3 * rows
    gen = torch.Generator(device=device).manual_seed(15)
    proj = (torch.randn(rows, 2 * hq * d + 2 * hkv * d, generator=gen, device=device) * 2).bfloat16()
    q_weight, k_weight = ((torch.randn(d, generator=gen, device=device) * 0.1).bfloat16() for _ in range(2))
    angles = torch.rand(rows, r, generator=gen, device=device) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    key_rows = torch.randint(0, rows, (keys,), generator=gen, device=device)
    torch_cpu = kernel_mode(_attn_prep_kernel, proj.device)

    def tile(block_t, warps):
        def launch(outs):
            programs = triton.cdiv(rows, block_t) * hq + triton.cdiv(keys, block_t) * 2 * hkv
            with ieee_quiet(torch_cpu):
                _attn_prep_kernel[(programs,)](
                    proj_ptr=proj, q_weight_ptr=q_weight, k_weight_ptr=k_weight, cos_ptr=cos, sin_ptr=sin,
                    q_ptr=outs[0], k_ptr=outs[1], v_ptr=outs[2], key_rows_ptr=key_rows, tokens=rows, keys=keys,
                    proj_sr=proj.stride(0), cos_sr=cos.stride(0), sin_sr=sin.stride(0), q_st=hq * d, q_sh=d,
                    kv_st=hkv * d, kv_sh=d, eps=eps, inv_n=inverse_count(d), HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d,
                    ROTARY_DIM=r, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(d), HAS_KEY_ROWS=True,
                    TORCH_CPU=torch_cpu, num_warps=warps, **LAUNCH_OPTIONS,
                )  # fmt: skip

        return f"{block_t} rows, {warps} warps", launch

    def outputs():
        return _poisoned(device, ((rows, hq, d), torch.bfloat16), ((keys, hkv, d), torch.bfloat16),
                         ((keys, hkv, d), torch.bfloat16))  # fmt: skip

    def wrapper():
        dims = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
        return list(attn_prep(proj, q_weight, k_weight, cos, sin, eps, key_rows=key_rows, **dims))

    shapes = [(8, 4), (4, 4), (16, 4), (8, 2), (16, 8), (32, 8)]
    return {"tiles": [tile(*shape) for shape in shapes], "outputs": outputs, "nbytes": attn_prep_bytes(rows, keys),
            "wrapper": wrapper}  # fmt: skip


TILE_SWEEPS = {
    "silu_mul": silu_mul_tiles,
    "residual_rmsnorm": residual_rmsnorm_tiles,
    "gdn_prep": gdn_prep_tiles,
    "gated_rmsnorm": gated_rmsnorm_tiles,
    "attn_prep": attn_prep_tiles,
}


def kernel_tiles() -> dict[str, Any]:
    """The tile sweeps of `TILE_SWEEPS`' kernels; the first case of each kernel is its shipped tile."""
    cases = [case for kernel, tiles_of in TILE_SWEEPS.items() for case in _tile_sweep(kernel, tiles_of())]
    return {"rows": TILE_ROWS, "cases": cases}


# ---------------------------------------------------------------------------------------------- engine_checks
def rel_rmse(x, ref) -> float:
    d = x.float() - ref.float()
    return (d.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


def states_of(backbone, plan) -> dict:
    """Hidden states (host) and last-token states (host) of one backbone on the plan."""
    prepared = backbone.prepare(plan.candidates, plan.groups)
    states = [s.cpu() for s in backbone.hidden_states(prepared)]
    return {"states": states, "last": backbone.forward(prepared).cpu()}


def release_cuda_memory() -> None:
    """Free what the phase left (its objects deleted by the caller) and check that no copy of the weights is left."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() / GIB
    if left >= 1.0:
        raise RuntimeError(f"{left:.2f} GiB still allocated after freeing a phase: the next would hold the 27B twice")


def probabilities(last, plan, head_weight, head_bias, temperature) -> list[float]:
    """Every candidate probability of the request, question by question (synthetic: fidelity only)."""
    from reference.readout import head_scores, record_probabilities

    scores = head_scores(last, head_weight, head_bias).tolist()
    out, start = [], 0
    for record in plan.records:
        out += record_probabilities(record, scores[start : start + record.candidate_count], temperature)
        start += record.candidate_count
    return out


def compare_paths(got: dict, ref: dict, plan, head) -> dict[str, Any]:
    """Two paths' `states_of` results: per-state relative RMSE, first non-identical state, last-token RMSE, max |dp|."""
    import torch

    identical = [torch.equal(g, r) for g, r in zip(got["states"], ref["states"], strict=True)]
    p_got, p_ref = probabilities(got["last"], plan, *head), probabilities(ref["last"], plan, *head)
    return {
        "first_departing_state": identical.index(False) if False in identical else None,
        "per_state_rel_rmse": [rel_rmse(g, r) for g, r in zip(got["states"], ref["states"], strict=True)],
        "last_rel_rmse": rel_rmse(got["last"], ref["last"]),
        "max_dp": max(abs(a - b) for a, b in zip(p_got, p_ref, strict=True)),
    }


def engine_checks(seed: int = 0) -> dict[str, Any]:
    """The whole-model checks (module docstring), in two phases that each free their copy of the weights."""
    import torch

    from engine.stages import build_engine
    from engine.weights import MergedWeights
    from reference.data import open_jev_workloads
    from reference.model import HFBackbone
    from reference.service import DecisionModel
    from reference.shapes import QWEN38_27B
    from reference.weights import synthetic_weights

    torch.manual_seed(seed)
    request = open_jev_workloads()[ENGINE_WORKLOAD]["request"]
    device = torch.device("cuda")

    # Phase 1: the HF reference, both GDN cores, on one copy of the weights.
    torch.cuda.reset_peak_memory_stats()
    weights = synthetic_weights(QWEN38_27B, seed=seed, device=device)
    hf = {"hf_fla": HFBackbone(weights, "fla")}
    hf["hf_torch"] = HFBackbone(weights, "torch", model=hf["hf_fla"].model)
    plan = DecisionModel(hf["hf_fla"], weights).plan(request)
    head = (weights.head_weight.cpu(), weights.head_bias.cpu(), weights.temperature)
    paths = {name: states_of(backbone, plan) for name, backbone in hf.items()}
    hf_peak = torch.cuda.max_memory_allocated() / GIB
    del hf, weights
    release_cuda_memory()

    # Phase 2: the engine, one merged copy of the weights shared by both stages.
    torch.cuda.reset_peak_memory_stats()
    merged_weights = MergedWeights.from_decision_weights(synthetic_weights(QWEN38_27B, seed=seed, device=device))
    engines = {
        "merged": build_engine(merged_weights, "merged"),
        "fused": build_engine(merged_weights, "fused"),
    }
    paths |= {name: states_of(backbone, plan) for name, backbone in engines.items()}
    nvtx = build_engine(merged_weights, "fused", nvtx_ranges=True)
    nvtx_equal = torch.equal(nvtx.forward(nvtx.prepare(plan.candidates, plan.groups)).cpu(), paths["fused"]["last"])
    # fused on FLA's public function instead of its forward kernels launched directly (kernels.gdn_core)
    fla_function = states_of(build_engine(merged_weights, "fused", gdn_core="fla"), plan)
    core_states_equal = [torch.equal(a, b) for a, b in zip(fla_function["states"], paths["fused"]["states"])]
    core_equal = all(core_states_equal) and torch.equal(fla_function["last"], paths["fused"]["last"])
    engine_peak = torch.cuda.max_memory_allocated() / GIB
    del engines, nvtx, merged_weights
    release_cuda_memory()

    pairs = [("merged", "hf_fla"), ("merged", "hf_torch"), ("fused", "hf_fla"), ("fused", "hf_torch"),
             ("fused", "merged"), ("hf_torch", "hf_fla")]  # fmt: skip
    return {
        "workload": ENGINE_WORKLOAD,
        "peak_gib": {"hf": hf_peak, "engine": engine_peak},
        "comparisons": {f"{a} vs {b}": compare_paths(paths[a], paths[b], plan, head) for a, b in pairs},
        "nvtx_ranges_bitwise": nvtx_equal,
        "fla_forward_core_bitwise": core_equal,
        "fla_forward_core_first_departing_state": None if core_equal else core_states_equal.index(False),
    }


MEASURE = {"gemm_rows": gemm_rows, "gdn_handoff": gdn_handoff, "kernel_tiles": kernel_tiles,
           "engine_checks": engine_checks, "gemm_row_cases": lambda: {"cases": gemm_row_cases()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(FIELDS)
    if len(names) == 1:  # one probe in this process: its JSON on the last line (what `run_probe` reads)
        print(json.dumps(MEASURE[names[0]](), allow_nan=False))
    else:
        print(json.dumps(run_probes(tuple(names)), indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
