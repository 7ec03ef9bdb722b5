"""The GEMM tuner of stage `gemm` (issue 14): measure every candidate kernel of every GEMM shape at every row bucket of
the graphs grid on this GPU, select a table by the row-invariance law, and write it under results/gemm/.

    python -m measure.tune_gemm [--shapes gdn_in,out] [--buckets 64,96,224] [--calls 10] [--replays 7] [--offers 8]
    python -m measure.tune_gemm --from-candidates results/gemm/A-candidates.json results/gemm/B-candidates.json
    nox --no-venv -s tune_gemm -- [the same options]          (on the H200)

Candidates per (shape, bucket rows), in a process without a cuBLAS workspace (`engine.gemm.prepare_process`, as the
stage runs):
* `cublas`: `F.linear`.
* `cublaslt`: the algorithms cuBLASLt's heuristic offers at that bucket (nvmath-python's `Matmul.plan`), asked twice
  (`heuristic_offers`): with every reduction scheme, up to `HEURISTIC_LIMIT`, and without split-K (reduction scheme
  NONE: `engine.gemm.offered_algorithms`), up to `NON_SPLIT_LIMIT` (`--offers N` asks both for N: a wider search,
  recorded as the candidates record's `offer_limits`). The second query is there because on the H200 the
  first, at limit 8, offered only split-K algorithms for down at 64 rows (K = 17,408; tests/test_gpu_gemm_tuned.py in
  results/gpu/20261201T2125Z-nvidia-h200-6871773-graphs-gemm-batching-tests.log), and a bucket with only such offers
  has no cuBLASLt candidate for the bitwise table. What the second query offers on the H200 is not measured yet.
  Plus the non-split offers at the bucket's neighbour rows (`neighbour_rows`: `NEIGHBOUR_OFFSETS` below the bucket,
  above the grid's previous size), timed at the bucket: cuBLAS sizes a kernel's row tile to the row count (on an H100
  at 9a6886e drone's 337 rows ran 128x176 and 192x176 tiles, its 352-row bucket 128x192 and 192x192 ones, and the
  bucket's GEMMs took 1.00 ms more a forward: engine/stages/core.md, "Campaign 37"), so a request padded to a bucket
  pays the bucket's tiles, and the heuristic asked at the bucket's own rows does not offer the tiles of the rows just
  below it. The offers of every row count asked are in the candidates record (`offers`).
  And an explicit set: the `EXPLICIT_PER_SHAPE` non-split algorithms offered at the most buckets of the shape, each
  tried at every bucket (a one-kernel-per-shape table needs one algorithm measured everywhere). Split-K algorithms
  are tried only where offered: no bitwise bucket takes them (`select_table`), and cuBLAS's own split-K kernel for
  down was not row-count invariant on the H200 (engine/stages/tree.md). A cuBLASLt candidate's split is its
  algorithm's `splitk_num`. The buckets of a shape where neither query offered a non-split algorithm are one
  `skipped` entry in the candidates record (`cublaslt_candidates`), not an error.
* `splitk` (out and down, `engine.gemm_table.SPLITK_SHAPES`): S in `SPLITS` where S cuts K into equal slices
  (down's K = 17,408 is not three equal slices: S = 3 is skipped there and recorded as such).
For out and down every candidate is timed with the `residual_rmsnorm` that consumes it (`kernels.residual_rmsnorm`
on the bf16 output, `kernels.residual_rmsnorm_splitk` on the partials), since split-K moves its reduction there.

Timing: each candidate is one CUDA graph of `calls` back-to-back calls cycling over `WEIGHT_COPIES` distinct weights
(the forward never reads one weight twice in a row), replayed `replays` times after a `FLUSH_BYTES` buffer write
(cold L2); the time is the median replay / calls. Each call runs in its forward context: the engine kernel that writes
the GEMM's input in the forward (`producer`: residual_rmsnorm before gdn_in, attn_in and gate_up, gated_rmsnorm before
out, silu_mul before down) writes the input the call reads, and a candidate's time is that graph's less a graph of the
producer alone (`context_us` in the candidates record); each is also timed alone, as before (`alone_us`). Timed
alone, back to back, a GEMM hides what it costs after another kernel: on the H200 at 8edfe66 and an H100 at 581c73c
the table's cuBLASLt choice for gate_up at 352 rows (192x176 tiles, 1x2 clusters) took 182.8 us a call in the
forward, 3.1 less than `F.linear`'s kernel, but the GPU then sat idle 6.7 us before each of its 64 calls, after
residual_rmsnorm (0.43 ms a drone forward; `top_gaps` of results/runs/20261206T083908Z-nvidia-h200-8edfe66.json),
where `F.linear`'s kernel waited 0.5 us.
Floor per (shape, rows) = max(weight bytes / streaming rate, 2 n k rows / bf16 rate) (`floors_us`), from ceilings
that are upper bounds of what this run saw (`tuned_ceilings`): `ablations.timing.measure_ceilings` at start in this
process (read-only and copy streaming; the 8192^3 cube and every tuned shape with `F.linear` at the largest bucket),
raised to the best candidate's rate of each shape at the largest bucket. A candidate still under its floor (another
row count ran at a higher rate) is a finding, listed in the candidates record's `below_floor`; it never keeps the
table from being written.

Checks per candidate: `bitwise_f_linear` (its bf16 output, or `splitk_delta` of its partials, equals `F.linear`'s at
the same rows bit for bit) and `row_invariant` (its first `ROWS_GRID[0]` rows equal, bit for bit, what the same
kernel gives for a call of `ROWS_GRID[0]` rows; a cuBLASLt algorithm cuBLASLt will not plan at that row count
counts as invariant only when bitwise with `F.linear`, itself checked invariant here).

Selection (`select_table`, pure, tested on the CPU with synthetic measurements): per shape, among row-invariant
candidates, (a) per bucket the fastest kernel bitwise with `F.linear` (mixing those across buckets keeps every row's
bits); (b) one non-split kernel for every bucket; (c) one split-K S for every bucket. The option with the least
forward GEMM time (sum over buckets of time x the shape's calls per forward) wins. The bitwise table is (a) for every
shape. Ship rule (issue 14): when the bitwise table's forward GEMM time is within `SHIP_MARGIN` of the best table's
at every bucket, the bitwise table is written as the table; otherwise the best, and the stage's registry entry
must then be made bounded (engine/stages/gemm.md). Both tables and the decision are in the candidates record.

Outputs (through this tool only): results/gemm/<utc>-<gpu>-<commit>-candidates.json (environment, ceilings, every
measurement, both tables, the decision) and, when every shape was measured at every bucket of the grid (or of the grid
before it, `measure.grid_coverage.ROWS_TO_1152`: its candidates records still merge into a table, which the loader takes
with its untuned rows), <...>-table.json (schema v1, engine/gemm_table.py). `--from-candidates` recomputes the floors
from the records' ceilings and measurements, so records written before `tuned_ceilings` existed get the same floors as a
new run. Runtime on the H200 at 2f9c178: 41 s for gdn_in, attn_in, out and 40 s for gate_up, down
(../shared/h200/2f9c178/logs/campaign.log); with the neighbour offers, on an H100 at 84441ff: 91 s for every shape in
one call (3,104 candidates).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ablations import timing
from engine.gemm_table import GEMM_SHAPES, SCHEMA_VERSION, SPLITK_SHAPES, load_gemm_table
from engine.graphs import ROWS_GRID
from measure.grid_coverage import ROWS_TO_1152

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gemm"
SPLITS = (2, 3, 4)
HEURISTIC_LIMIT = 8  # offers of cuBLASLt's heuristic with every reduction scheme, per (shape, bucket)
NON_SPLIT_LIMIT = 8  # offers of cuBLASLt's heuristic without split-K (reduction scheme NONE), per (shape, bucket)
OFFER_LIMITS = (HEURISTIC_LIMIT, NON_SPLIT_LIMIT)  # the two queries' limits unless `--offers` asks both for N
EXPLICIT_PER_SHAPE = 6
NEIGHBOUR_OFFSETS = (8, 16, 24, 32, 48, 64, 96)  # rows below a bucket where the heuristic is asked too (module doc)
WEIGHT_COPIES = 4
FLUSH_BYTES = 256 * 2**20  # larger than the H200's 60 MiB L2
SHIP_MARGIN = 0.02
CALLS_PER_FORWARD = {"gdn_in": 48, "attn_in": 16, "out": 64, "gate_up": 64, "down": 64}  # the 27B's 48 + 16 layers


def producer(shape: str, k: int, max_rows: int, device: Any, gen: Any) -> tuple[Any, Callable[[int], None]]:
    """(x, write): x [max_rows, k] bf16, the input a GEMM of `shape` reads, and write(rows), which runs the engine
    kernel that writes x[:rows] in the forward (module docstring, Timing) on fixed random operands, x[rows:] untouched.
    gdn_in, attn_in, gate_up: `kernels.residual_rmsnorm` (hidden k; x is its normed output). out:
    `kernels.gated_rmsnorm` over k / 128 value heads of 128. down: `kernels.silu_mul` of a [rows, 2k] gate|up."""
    import torch

    import kernels

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device).bfloat16()

    x = torch.empty(max_rows, k, dtype=torch.bfloat16, device=device)
    if shape in ("gdn_in", "attn_in", "gate_up"):
        residual, delta, weight = randn(max_rows, k), randn(max_rows, k), randn(k) * 0.1
        new_residual = torch.empty_like(residual)

        def write(rows: int) -> None:
            kernels.residual_rmsnorm(residual[:rows], delta[:rows], weight, 1e-6,
                                     out_residual=new_residual[:rows], out_normed=x[:rows])  # fmt: skip

    elif shape == "out":
        head_dim = 128
        if k % head_dim:
            raise ValueError(f"out: K = {k} is not value heads of {head_dim}")
        o, z, weight = randn(max_rows, k // head_dim, head_dim), randn(max_rows, k), 1 + randn(head_dim) * 0.1

        def write(rows: int) -> None:
            kernels.gated_rmsnorm(o[:rows], z[:rows], weight, 1e-6, out=x[:rows])

    elif shape == "down":
        gate_up = randn(max_rows, 2 * k)

        def write(rows: int) -> None:
            kernels.silu_mul(gate_up[:rows], out=x[:rows])

    else:
        raise ValueError(f"no producer for shape {shape!r}: one of {sorted(GEMM_SHAPES)}")
    return x, write


@dataclass(frozen=True)
class Measurement:
    """One candidate at one (shape, rows): its kernel (the table's `kernel` object), time and checks."""

    shape: str
    rows: int
    kernel: dict[str, Any]
    time_us: float
    bitwise_f_linear: bool
    row_invariant: bool
    alone_us: float | None = None  # the same calls without their producer, back to back (records before: None)


def kernel_key(kernel: dict[str, Any]) -> str:
    """A kernel's identity across buckets (the same cuBLASLt algorithm or split at another row count)."""
    return json.dumps(kernel, sort_keys=True)


def kernel_split(kernel: dict[str, Any]) -> int:
    if kernel["family"] == "splitk":
        return kernel["split"]
    return kernel["algorithm"]["splitk_num"] if kernel["family"] == "cublaslt" else 1


def heuristic_offers(
    matmul: Any,
    shape: str,
    rows: int,
    skipped: list[dict],
    limits: tuple[int, int] = OFFER_LIMITS,
) -> dict[str, list[dict[str, int]]]:
    """The algorithms (config dicts, `engine.gemm.cublaslt_config`) cuBLASLt's heuristic offers for one nvmath `Matmul`
    of `shape` at `rows` rows, best first: {"any": up to limits[0] (`HEURISTIC_LIMIT`) with every reduction scheme,
    "non_split": up to limits[1] (`NON_SPLIT_LIMIT`) without split-K}. A non-split query that cuBLASLt refuses with an
    error, rather than offering none, is appended to `skipped` with the error and counts as no offer, so the tuner goes
    on with the other shapes."""
    from engine.gemm import cublaslt_config, offered_algorithms

    # each query re-plans `matmul`: read its offers before the next one
    offers = {"any": [cublaslt_config(a) for a in offered_algorithms(matmul, limits[0], allow_split_k=True)]}
    try:
        non_split = [cublaslt_config(a) for a in offered_algorithms(matmul, limits[1], allow_split_k=False)]
    except Exception as error:  # nvmath and cuBLASLt raise their own types
        skipped.append({"shape": shape, "rows": rows, "query": "non-split", "why": f"{type(error).__name__}: {error}"})
        non_split = []
    offers["non_split"] = non_split
    return offers


def neighbour_rows(buckets: Iterable[int], rows_grid: tuple[int, ...] = ROWS_GRID) -> dict[int, list[int]]:
    """Per bucket, the row counts below it where the heuristic is asked too: bucket - d for d in `NEIGHBOUR_OFFSETS`
    while above the grid's previous size (for the grid's first size, above its size less the grid's first step), so
    each row count a request can have is near one of its bucket's."""
    out = {}
    for rows in buckets:
        i = rows_grid.index(rows)
        below = rows_grid[i - 1] if i else rows - (rows_grid[1] - rows_grid[0])
        out[rows] = [rows - d for d in NEIGHBOUR_OFFSETS if rows - d > below]
    return out


def cublaslt_candidates(
    shape: str,
    offers: dict[int, dict[str, list[dict[str, int]]]],
    skipped: list[dict],
    neighbours: dict[int, dict[int, dict[str, list[dict[str, int]]]]] | None = None,
) -> dict[int, list[dict[str, int]]]:
    """Per bucket rows (the keys of `offers`, `heuristic_offers` per bucket), the cuBLASLt algorithms to measure there:
    that bucket's offers of both queries, the non-split offers at its neighbour rows (`neighbours`: per bucket, the
    `heuristic_offers` at each of its `neighbour_rows`, by row count), and the explicit set, the `EXPLICIT_PER_SHAPE`
    non-split algorithms offered at the most buckets of the shape (ties in order of first offer; the buckets' own
    offers only), sorted by `kernel_key`. The buckets where no non-split algorithm was offered are one entry of
    `skipped`, saying whether the explicit set still covers them."""
    offered = {rows: {kernel_key(c): c for c in o["any"] + o["non_split"]} for rows, o in offers.items()}
    non_split = {rows: [key for key, c in by_key.items() if c["splitk_num"] == 1] for rows, by_key in offered.items()}
    near = {
        rows: {kernel_key(c) for o in (neighbours or {}).get(rows, {}).values() for c in o["any"] + o["non_split"]
               if c["splitk_num"] == 1}
        for rows in offers
    }  # fmt: skip
    counts = Counter(key for keys in non_split.values() for key in keys)
    explicit = {key for key, _ in counts.most_common(EXPLICIT_PER_SHAPE)}
    without = [rows for rows, keys in non_split.items() if not keys]
    if without:
        if explicit:
            covered = "the explicit set's non-split algorithms are still tried there"
        else:
            covered = "nor at any other bucket: the shape has no non-split cuBLASLt candidate"
        why = f"cuBLASLt's heuristic offered no algorithm without split-K at these rows; {covered}"
        skipped.append({"shape": shape, "rows": without, "query": "non-split", "why": why})
    measured = {rows: set(by_key) | near[rows] | explicit for rows, by_key in offered.items()}
    return {rows: [json.loads(key) for key in sorted(keys)] for rows, keys in measured.items()}


def tuned_ceilings(ceilings: dict, measurements: Iterable[Measurement], rows_grid: tuple[int, ...]) -> dict:
    """`ceilings` (a `measure_ceilings` dict) with the streaming and bf16 ceilings the floors use: `stream_tbps` (the
    copy rate in records from before the read-only probe) and `bf16_tflops` raised to the best candidate's rate of
    each measured shape at the largest bucket (`bf16_candidate_tflops`)."""
    top = max(rows_grid)
    fastest: dict[str, float] = {}
    for m in measurements:
        if m.rows == top:
            fastest[m.shape] = min(fastest.get(m.shape, math.inf), m.time_us)
    rates = {s: 2 * GEMM_SHAPES[s][0] * GEMM_SHAPES[s][1] * top / (t * 1e-6) / 1e12 for s, t in fastest.items()}
    return ceilings | {
        "stream_tbps": timing.streaming_tbps(ceilings),
        "bf16_tflops": max([ceilings["bf16_tflops"], *rates.values()]),
        "bf16_candidate_tflops": rates,
        "candidate_rows": top,
    }


def floors_us(ceilings: dict, shapes: Iterable[str], rows_grid: tuple[int, ...]) -> dict[tuple[str, int], float]:
    """Floor (us) per (shape, rows): the runner's `timing.floors` of one bf16 GEMM (n k weights, 2 n k bytes)."""
    return {
        (shape, rows): 1e3 * timing.floors(2 * n * k, n * k, rows, ceilings)["floor_ms"]
        for shape in shapes for n, k in [GEMM_SHAPES[shape]] for rows in rows_grid
    }  # fmt: skip


def below_floor(measurements: Iterable[Measurement], floors: dict[tuple[str, int], float]) -> list[dict]:
    """Every measurement under its floor: a finding (the ceiling was low there), never a reason to drop the table."""
    return [
        {"shape": m.shape, "rows": m.rows, "kernel": m.kernel, "time_us": m.time_us,
         "floor_us": round(floors[(m.shape, m.rows)], 3)}
        for m in measurements if m.time_us < floors[(m.shape, m.rows)]
    ]  # fmt: skip


def select_table(
    measurements: Iterable[Measurement], floors_us: dict[tuple[str, int], float], rows_grid: tuple[int, ...] = ROWS_GRID
) -> dict[str, Any]:
    """The best table and the bitwise table from measurements (module docstring, Selection).

    Returns {"best": {shape: [bucket, ...]}, "bitwise": {...}, "options": {shape: {option: forward us}},
    "forward_us": {"best": [per bucket], "bitwise": [...]}, "bitwise_within_margin": bool, "ship": "bitwise" | "best"}
    with buckets in the table's schema (rows, kernel, time_us, floor_us, bitwise_f_linear, row_invariant). Raises
    ValueError when a shape lacks a row-invariant `F.linear`-bitwise candidate at some bucket (cuBLAS must be one)."""
    by_shape: dict[str, dict[int, list[Measurement]]] = {}
    for m in measurements:
        if m.row_invariant:
            by_shape.setdefault(m.shape, {}).setdefault(m.rows, []).append(m)
    best, bitwise, options = {}, {}, {}
    for shape, per_rows in by_shape.items():
        missing = [rows for rows in rows_grid if rows not in per_rows]
        if missing:
            raise ValueError(f"{shape}: no row-invariant candidate at rows {missing}")
        weight = CALLS_PER_FORWARD.get(shape, 1)
        mixed = []
        for rows in rows_grid:
            exact = [m for m in per_rows[rows] if m.bitwise_f_linear and kernel_split(m.kernel) == 1]
            if not exact:
                raise ValueError(f"{shape} at {rows} rows: no candidate bitwise with F.linear (cuBLAS must be one)")
            mixed.append(min(exact, key=lambda m: m.time_us))
        shape_options = {"bitwise per bucket": mixed}
        everywhere: dict[str, list[Measurement]] = {}
        for rows in rows_grid:
            for m in per_rows[rows]:
                everywhere.setdefault(kernel_key(m.kernel), []).append(m)
        for key, ms in everywhere.items():
            if len(ms) == len(rows_grid):  # measured at every bucket: one kernel for the whole shape
                split = kernel_split(ms[0].kernel)
                label = f"one kernel {key}" if split == 1 else f"split {split} {key}"
                shape_options[label] = ms
        totals = {label: weight * sum(m.time_us for m in ms) for label, ms in shape_options.items()}
        winner = min(totals, key=totals.get)
        options[shape] = totals
        best[shape] = [_bucket(m, floors_us[(shape, m.rows)]) for m in shape_options[winner]]
        bitwise[shape] = [_bucket(m, floors_us[(shape, m.rows)]) for m in mixed]
    forward = {
        name: [sum(CALLS_PER_FORWARD.get(s, 1) * table[s][i]["time_us"] for s in table) for i in range(len(rows_grid))]
        for name, table in (("best", best), ("bitwise", bitwise))
    }
    within = all(b <= (1 + SHIP_MARGIN) * a for a, b in zip(forward["best"], forward["bitwise"], strict=True))
    return {
        "best": best,
        "bitwise": bitwise,
        "options": options,
        "forward_us": forward,
        "bitwise_within_margin": within,
        "ship": "bitwise" if within else "best",
    }


def _bucket(m: Measurement, floor_us: float) -> dict[str, Any]:
    return {
        "rows": m.rows,
        "kernel": m.kernel,
        "time_us": m.time_us,
        "floor_us": floor_us,
        "bitwise_f_linear": m.bitwise_f_linear,
        "row_invariant": m.row_invariant,
    }


def table_document(shapes: dict[str, list[dict]], env: dict[str, Any]) -> dict[str, Any]:
    """A schema-v1 table (engine/gemm_table.py) of the selected buckets."""
    return {
        "schema_version": SCHEMA_VERSION,
        "gpu": {"name": env["gpu"], "capability": env["capability"]},
        "versions": env["versions"],
        "commit": env["commit"],
        "created_utc": env["utc"],
        "shapes": {
            name: {"n": GEMM_SHAPES[name][0], "k": GEMM_SHAPES[name][1], "buckets": shapes[name]}
            for name in GEMM_SHAPES
        },  # fmt: skip
    }


# ---------------------------------------------------------------------------------------------------------------------
# Measuring (CUDA only)


def measure_shape(
    shape: str,
    rows_grid: tuple[int, ...],
    calls: int,
    replays: int,
    progress: Any,
    skipped: list[dict],
    offers: dict[str, Any],
    context_us: dict[str, dict[int, float]],
    limits: tuple[int, int] = OFFER_LIMITS,
) -> list[Measurement]:
    """Every candidate of one shape at every bucket of `rows_grid` (module docstring), on the current CUDA device;
    candidates that could not run are appended to `skipped` with the reason, the heuristic's offers at each bucket
    and its neighbour rows (`limits`: see `heuristic_offers`) are put in `offers[shape]`, and the producer's own time
    per bucket, taken off every candidate's (module docstring, Timing), in `context_us[shape]`."""
    import torch
    import torch.nn.functional as F
    from nvmath.linalg.advanced import Matmul

    import kernels
    from engine.gemm import plan_cublaslt, splitk_partials
    from reference.ops import splitk_delta

    n, k = GEMM_SHAPES[shape]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(14)
    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16() for _ in range(WEIGHT_COPIES)]
    x_all = torch.randn(max(rows_grid), k, generator=gen, device=device).bfloat16()
    residual_all = torch.randn(max(rows_grid), n, generator=gen, device=device).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).bfloat16()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    x_context, write_input = producer(shape, k, max(rows_grid), device, gen)  # timing reads this x, never x_all
    with_norm = shape in SPLITK_SHAPES
    first = rows_grid[0]

    def offers_at(rows: int) -> dict[str, list[dict[str, int]]]:
        matmul = Matmul(x_all[:rows], weights[0].t(), stream=torch.cuda.current_stream())
        return heuristic_offers(matmul, shape, rows, skipped, limits)

    bucket_offers = {rows: offers_at(rows) for rows in rows_grid}
    near_offers = {rows: {r: offers_at(r) for r in near} for rows, near in neighbour_rows(rows_grid).items()}
    offers[shape] = {rows: {"bucket": bucket_offers[rows], "neighbours": near_offers[rows]} for rows in rows_grid}
    lt_candidates = cublaslt_candidates(shape, bucket_offers, skipped, near_offers)
    context_us[shape] = {}

    def run_one(kernel: dict, rows: int, matmul: Any) -> tuple[Callable[[int], Any], Callable[[int], Any]]:
        """(call i in its forward context, call i alone) on the producer's x."""
        x, residual = x_context[:rows], residual_all[:rows]
        if kernel["family"] == "splitk":
            op = lambda w: splitk_partials(x, w, kernel["split"])  # noqa: E731
        elif kernel["family"] == "cublaslt":

            def op(w):
                matmul.reset_operands_unchecked(a=x, b=w.t())
                return matmul.execute(stream=torch.cuda.current_stream())
        else:
            op = lambda w: F.linear(x, w)  # noqa: E731
        if not with_norm:
            consume = op
        elif kernel["family"] == "splitk":
            consume = lambda w: kernels.residual_rmsnorm_splitk(residual, op(w), norm_weight, 1e-6)  # noqa: E731
        else:
            consume = lambda w: kernels.residual_rmsnorm(residual, op(w), norm_weight, 1e-6)  # noqa: E731

        def in_context(i: int) -> Any:
            write_input(rows)
            return consume(weights[i % WEIGHT_COPIES])

        return in_context, lambda i: consume(weights[i % WEIGHT_COPIES])

    def bits(kernel: dict, rows: int, matmul: Any) -> Any:
        x = x_all[:rows]
        if kernel["family"] == "splitk":
            return splitk_delta(splitk_partials(x, weights[0], kernel["split"]))
        if kernel["family"] == "cublaslt":
            matmul.reset_operands_unchecked(a=x, b=weights[0].t())
            return matmul.execute(stream=torch.cuda.current_stream()).clone()
        return F.linear(x, weights[0])

    def graph_time_us(fn: Callable[[int], Any]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(2):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        samples = []
        for _ in range(replays):
            flush.random_(0, 255)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(samples)

    f_linear_first = F.linear(x_all[:first], weights[0])
    keep = []  # Matmul objects used under capture stay alive until their bucket's graphs are gone (free() raised)
    out = []
    for rows in rows_grid:
        context_us[shape][rows] = producer_us = graph_time_us(lambda i, rows=rows: write_input(rows))
        want = F.linear(x_all[:rows], weights[0])
        candidates: list[tuple[dict, Any]] = [({"family": "cublas"}, None)]
        for algorithm in lt_candidates[rows]:
            matmul = plan_cublaslt(x_all[:rows], weights[0], algorithm)
            if matmul is None:
                skipped.append({"shape": shape, "rows": rows, "algorithm": algorithm, "why": "not planned here"})
                continue
            candidates.append(({"family": "cublaslt", "algorithm": algorithm}, matmul))
            keep.append(matmul)
        for split in SPLITS if shape in SPLITK_SHAPES else ():
            if k % split == 0:
                candidates.append(({"family": "splitk", "split": split}, None))
            elif rows == rows_grid[0]:
                skipped.append({"shape": shape, "split": split, "why": f"K = {k} is not {split} equal slices"})
        for kernel, matmul in candidates:
            progress.update(1)
            try:  # an explicit algorithm is planned without cuBLASLt's algo check: it may fail only when it runs
                got = bits(kernel, rows, matmul)
                bitwise = bool(torch.equal(got, want))
                if kernel["family"] == "cublaslt":
                    small = plan_cublaslt(x_all[:first], weights[0], kernel["algorithm"])
                    keep.append(small)
                    anchor = bits(kernel, first, small) if small is not None else (f_linear_first if bitwise else None)
                else:
                    anchor = bits(kernel, first, None)
                invariant = anchor is not None and bool(torch.equal(got[:first], anchor))
                in_context, alone = run_one(kernel, rows, matmul)
                time_us = graph_time_us(in_context) - producer_us
                alone_us = graph_time_us(alone)
            except Exception as error:  # nvmath and cuBLASLt raise their own types; the candidate is recorded, not lost
                skipped.append(
                    {"shape": shape, "rows": rows, "kernel": kernel, "why": f"{type(error).__name__}: {error}"}
                )
                continue
            out.append(Measurement(shape, rows, kernel, round(time_us, 3), bitwise, invariant, round(alone_us, 3)))
        keep.clear()
    return out


def environment(device: Any) -> dict[str, Any]:
    import nvmath
    import torch
    import triton
    from nvmath.bindings import cublasLt

    from ablations import envinfo

    env = envinfo.collect("cuda")
    lt = cublasLt.get_version()
    lt_text = f"{lt // 10000}.{lt // 100 % 100}.{lt % 100}"
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "capability": [props.major, props.minor],
        "versions": {
            "torch": torch.__version__,
            "cuda": str(torch.version.cuda),
            "cublas": lt_text,  # one library release
            "cublaslt": lt_text,
            "nvmath": nvmath.__version__,
            "triton": triton.__version__,
        },  # fmt: skip
        "commit": str(env["git_commit"])[:40],
        "utc": env["utc"],
        "stem": envinfo.record_stem(env),
        "env": env,
    }


def write_outputs(
    measurements: list[Measurement],
    env: dict,
    ceilings: dict,
    rows_grid: tuple[int, ...],
    skipped: list[dict],
    offers: dict[str, Any] | None = None,
    offer_limits: tuple[int, int] = OFFER_LIMITS,
    context_us: dict[str, dict[int, float]] | None = None,
) -> dict[str, Path]:
    """The candidates record always; the table (schema v1, validated by its loader) when every shape and every bucket
    of the grid was measured. Floors come from `tuned_ceilings` of `ceilings` and the measurements; times under them
    are the record's `below_floor` finding."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    shapes = sorted({m.shape for m in measurements})
    ceilings = tuned_ceilings(ceilings, measurements, rows_grid)
    floors = floors_us(ceilings, shapes, rows_grid)
    selection = select_table(measurements, floors, rows_grid)
    written = {}
    below = below_floor(measurements, floors)
    record = {
        "env": env["env"], "versions": env["versions"], "ceilings": ceilings, "rows_grid": list(rows_grid),
        "floors_us": [[s, r, f] for (s, r), f in sorted(floors.items())],
        "measurements": [asdict(m) for m in measurements], "skipped": skipped, "selection": selection,
        "below_floor": below, "stem": env["stem"], "gpu_name": env["gpu"], "capability": env["capability"],
        "commit": env["commit"], "offers": offers or {}, "offer_limits": list(offer_limits),
        "context_us": context_us or {},
    }  # fmt: skip
    complete = set(shapes) == set(GEMM_SHAPES) and tuple(rows_grid) in (ROWS_GRID, ROWS_TO_1152)  # a grid's rows
    if complete:
        path = RESULTS / f"{env['stem']}-table.json"
        path.write_text(json.dumps(table_document(selection[selection["ship"]], env), indent=1) + "\n")
        load_gemm_table(path, device_name=env["gpu"])  # the engine's loader accepts what the tuner wrote
        written["table"] = path
    record["table"] = str(written.get("table", "not written: a subset of shapes or buckets was measured"))
    path = RESULTS / f"{env['stem']}-{'-'.join(shapes)}-candidates.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    written["candidates"] = path
    if below:
        print(f"finding: {len(below)} candidate(s) under their floor (the ceilings were low there): {path}",
              file=sys.stderr)  # fmt: skip
    return written


def from_candidates(paths: list[Path]) -> dict[str, Path]:
    """Merge candidates records of one GPU and commit (e.g. one device call per shape) and write the table."""
    records = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["stem"])  # the stem: the first run's
    gpus = {r["gpu_name"] for r in records}
    if len(gpus) != 1:
        raise SystemExit(f"candidates of several GPUs {sorted(gpus)}: a table is tuned on one")
    commits = {r["commit"] for r in records}
    if len(commits) != 1:
        raise SystemExit(f"candidates of several commits {sorted(commits)}: a table is tuned on one")
    measurements = [Measurement(**m) for r in records for m in r["measurements"]]
    seen = Counter((m.shape, m.rows, kernel_key(m.kernel)) for m in measurements)
    twice = sorted({shape for (shape, _, _), count in seen.items() if count > 1})
    if twice:
        raise SystemExit(f"shapes {twice} measured in more than one record: merge one record per shape")
    first = records[0]
    env = {"gpu": first["gpu_name"], "capability": first["capability"], "versions": first["versions"],
           "commit": first["commit"], "utc": first["env"]["utc"], "env": first["env"],
           "stem": first["stem"]}  # fmt: skip
    skipped = [s for r in records for s in r["skipped"]]
    ceilings = first["ceilings"] | {  # the best of every merged process: each measured its own
        "stream_tbps": max(timing.streaming_tbps(r["ceilings"]) for r in records),
        "bf16_tflops": max(r["ceilings"]["bf16_tflops"] for r in records),
    }
    offers = {shape: by_rows for r in records for shape, by_rows in r.get("offers", {}).items()}
    limits = tuple(first.get("offer_limits", OFFER_LIMITS))
    context = {shape: by_rows for r in records for shape, by_rows in r.get("context_us", {}).items()}
    return write_outputs(measurements, env, ceilings, tuple(first["rows_grid"]), skipped, offers, limits, context)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.tune_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"comma-separated subset of {list(GEMM_SHAPES)} (default: all)")
    parser.add_argument("--buckets", help="comma-separated subset of engine.graphs.ROWS_GRID (default: all)")
    parser.add_argument("--calls", type=int, default=10, help="GEMM calls per captured graph")
    parser.add_argument("--replays", type=int, default=7, help="timed replays per candidate (median)")
    parser.add_argument("--offers", type=int, help="offers asked of each heuristic query (default: OFFER_LIMITS)")
    parser.add_argument("--from-candidates", nargs="+", type=Path, help="merge candidates records into a table")
    args = parser.parse_args(argv)
    if args.from_candidates:
        print(json.dumps({k: str(v) for k, v in from_candidates(args.from_candidates).items()}))
        return 0
    shapes = args.shapes.split(",") if args.shapes else list(GEMM_SHAPES)
    unknown = sorted(set(shapes) - set(GEMM_SHAPES))
    rows_grid = tuple(int(r) for r in args.buckets.split(",")) if args.buckets else ROWS_GRID
    outside = sorted(set(rows_grid) - set(ROWS_GRID))
    if unknown or outside or list(rows_grid) != sorted(rows_grid):
        parser.error(f"unknown shapes {unknown}, rows outside the grid {outside}, or buckets out of order")

    import torch
    from tqdm import tqdm

    from engine import gemm
    from engine.stages import config_of

    if not torch.cuda.is_available():
        parser.error("the tuner measures CUDA kernels: run it on the GPU (nox --no-venv -s tune_gemm)")
    gemm.prepare_process([config_of("gemm")])  # no cuBLAS workspace, as the stage runs
    device = torch.device("cuda")
    env = environment(device)
    if env["commit"] == "unknown":
        parser.error("a table records the commit it was tuned on: run from a git checkout or set JEVLAB_GIT_COMMIT")
    ceilings = timing.measure_ceilings(
        "cuda", copy_bytes=2**30, gemm_n=8192, runs=20,
        gemm_shapes={s: GEMM_SHAPES[s] for s in shapes}, shape_rows=max(rows_grid),
    )  # fmt: skip
    measurements: list[Measurement] = []
    skipped: list[dict] = []
    offers: dict[str, Any] = {}
    context_us: dict[str, dict[int, float]] = {}
    limits = OFFER_LIMITS if args.offers is None else (args.offers, args.offers)
    with tqdm(desc="gemm candidates", unit="cand", file=sys.stderr) as progress:
        for shape in shapes:
            progress.set_postfix_str(shape)
            measurements += measure_shape(
                shape, rows_grid, args.calls, args.replays, progress, skipped, offers, context_us, limits
            )
    written = write_outputs(measurements, env, ceilings, rows_grid, skipped, offers, limits, context_us)
    print(json.dumps({k: str(v) for k, v in written.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
