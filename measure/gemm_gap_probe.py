"""Where the idle time before a tuned GEMM comes from: the MLP half of a layer, in a CUDA graph, kernel gaps profiled.

    python -m measure.gemm_gap_probe                  # rows 352 (drone's bucket), this GPU's newest GEMM table
    python -m measure.gemm_gap_probe --rows 1088 --layers 8 --calls 5

In the runner's records of stage `gemm` and `core` (H200 at 8edfe66, H100 at 581c73c and a25795f) the GPU sat idle
6-7 us before each call of some of the table's cuBLASLt kernels, always right after `residual_rmsnorm` (drone: gate_up
at 352 rows, 0.43-0.46 ms a forward; customer_service: gate_up and gdn_in at 1,088), where `F.linear`'s kernels
waited 0.3-0.5 us; the tuner, timing the same kernel behind the same norm (`measure.tune_gemm`, Timing), saw about
half of it. This probe rebuilds the MLP half of a layer as the engine runs it (`engine.gemm.GemmDispatch`, the
engine's Triton norms and activation):

    out GEMM -> residual_rmsnorm -> gate_up GEMM -> silu_mul -> down GEMM -> residual_rmsnorm       (x `--layers`)

with each GEMM from the table or from `F.linear` (`VARIANTS`), every layer on its own weights (no L2 reuse across
layers), and the tuner's context (`norm-gate_up`: residual_rmsnorm -> gate_up alone). Each variant is one CUDA graph
replayed `--calls` times under torch.profiler; the record has, per layer, the GPU-busy and idle time, the kernel pairs
with the most idle time between them (`ablations.timing.kernel_gaps`), and every GPU activity that is not a kernel
(memsets, copies) by name, so an idle gap that hides a memset node shows as one. Synthetic weights and inputs: timings
only. Writes results/gemm/<utc>-<gpu>-<commit>-gap-probe-r<rows>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> the GEMMs that run the table's choice (the others run F.linear); "norm-gate_up": tuner context
    "table": ("out", "gate_up", "down"),
    "gate_up-f_linear": ("out", "down"),
    "out-down-f_linear": ("gate_up",),
    "f_linear": (),
    "norm-gate_up": ("gate_up",),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.gemm_gap_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=352, help="a bucket of engine.graphs.ROWS_GRID")
    parser.add_argument("--layers", type=int, default=8, help="MLP halves per graph, each on its own weights")
    parser.add_argument("--calls", type=int, default=5, help="profiled replays per variant")
    parser.add_argument("--table", type=Path, help="a GEMM table (default: this GPU's newest under results/gemm/)")
    args = parser.parse_args(argv)

    import torch

    from ablations import envinfo, timing
    from engine import gemm
    from engine.gemm_table import GEMM_SHAPES
    from engine.graphs import ROWS_GRID
    from engine.stages import config_of
    from engine.weights import Weight

    if args.rows not in ROWS_GRID:
        parser.error(f"--rows {args.rows} is not a bucket of engine.graphs.ROWS_GRID")
    if not torch.cuda.is_available():
        parser.error("the probe profiles CUDA kernels: run it on the GPU")
    gemm.prepare_process([config_of("gemm")])
    import kernels

    device = torch.device("cuda")
    env = envinfo.collect("cuda")
    table, source = gemm.resolve_table(args.table, device)
    if table is None:
        parser.error(f"no usable GEMM table: {source}")
    gen = torch.Generator(device=device).manual_seed(22)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).bfloat16()

    shapes = ("out", "gate_up", "down")
    weights = {s: [randn(*GEMM_SHAPES[s], scale=GEMM_SHAPES[s][1] ** -0.5) for _ in range(args.layers)] for s in shapes}
    plan_weights = {s: [weights[s][0]] if s in shapes else [randn(*GEMM_SHAPES[s])] for s in GEMM_SHAPES}
    tuned = gemm.GemmDispatch(table, device, plan_weights, source)  # plans every cuBLASLt choice, as a backbone does
    plain = gemm.GemmDispatch(None, device, {}, "F.linear")
    hidden = GEMM_SHAPES["out"][0]
    rows = args.rows
    o = randn(rows, GEMM_SHAPES["out"][1])
    residual, norm_weight = randn(rows, hidden), randn(hidden, scale=0.1)

    class Norms:  # the engine's Triton norms, as `GemmDispatch.residual_rmsnorm` calls them
        residual_rmsnorm = staticmethod(lambda r, d, w: kernels.residual_rmsnorm(r, d, w, 1e-6))
        residual_rmsnorm_splitk = staticmethod(lambda r, p, w: kernels.residual_rmsnorm_splitk(r, p, w, 1e-6))

    def weight(shape: str, layer: int) -> Weight:
        return Weight(weights[shape][layer])

    def mlp_half(tabled: tuple[str, ...]) -> Any:
        def by(shape: str) -> gemm.GemmDispatch:
            return tuned if shape in tabled else plain

        def run() -> None:
            res = residual
            for layer in range(args.layers):
                delta = by("out").project(o, weight("out", layer), "out")
                res, normed = by("out").residual_rmsnorm(Norms, res, delta, norm_weight)
                act = kernels.silu_mul(by("gate_up").linear(normed, weight("gate_up", layer), "gate_up"))
                down = by("down").project(act, weight("down", layer), "down")
                res, _ = by("down").residual_rmsnorm(Norms, res, down, norm_weight)

        return run

    def norm_gate_up() -> None:
        for layer in range(args.layers):
            _, normed = kernels.residual_rmsnorm(residual, o[:, :hidden], norm_weight, 1e-6)
            tuned.linear(normed, weight("gate_up", layer), "gate_up")

    record: dict[str, Any] = {
        "env": env, "rows": rows, "layers": args.layers, "calls": args.calls, "table": source,
        "kernels": {s: str(tuned.kernel(s, rows)) for s in shapes}, "variants": {},
    }  # fmt: skip
    for name, tabled in VARIANTS.items():
        fn = norm_gate_up if name == "norm-gate_up" else mlp_half(tabled)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = timing.profiled_events(graph.replay, args.calls)
        stats = timing.kernel_stats(events, args.calls * args.layers)  # per layer
        other = {activity: {"per_layer": v["calls_per_forward"], "us": v["ms_per_forward"] * 1e3}
                 for activity, v in stats.non_kernel.items()}  # fmt: skip
        record["variants"][name] = {
            "tabled": list(tabled),
            "busy_us_per_layer": stats.gpu_busy_ms * 1e3,
            "idle_us_per_layer": stats.idle_ms * 1e3,
            "top_gaps": stats.top_gaps,
            "top_kernels": stats.top_kernels,
            "gpu_non_kernel": other,
        }
        print(f"{name:18s} busy {stats.gpu_busy_ms * 1e3:8.1f} us/layer  idle {stats.idle_ms * 1e3:6.2f} us/layer  "
              f"non-kernel GPU events {sorted(other)}")  # fmt: skip
    out = REPO / "results" / "gemm" / f"{envinfo.record_stem(env)}-gap-probe-r{rows}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
