"""The engine's one GEMM seam: every projection of the backbone goes through the op the config's `gemm` picks.

    y [N, out] bf16 = x [N, in] bf16 @ weight.dataᵀ          (fp32 accumulation inside the library; one rounding)

Choices (`EngineConfig.gemm`):
* `cublas`: `torch.nn.functional.linear`, with whatever cuBLAS workspace the process has. No row-count invariance
  is claimed: on the H200 cuBLAS's default heuristics pick a split-K kernel for the down projection (K = 17,408) at
  150-199 rows, so a row's bits there depend on how many rows share the call (the attempts record and `tree` notes).
* `cublas_row_invariant`: the same call in a process whose cuBLAS has no workspace (`CUBLAS_WORKSPACE_CONFIG=:0:0`),
  which rules out the split-K kernels: every GEMM shape of the 27B was row-count invariant on the H200 at the row
  counts requests have (tests/test_gpu_gemm_rows.py). The tree is bitwise against the flat layout only because of
  this, so a stage that claims it (`tree` and after) must run in such a process.
* `tuned` (stage `gemm`, issue 14): the kernel a GEMM tuning table (`engine/gemm_table.py`, written on the GPU by
  `python -m measure.tune_gemm`) chose for the GEMM's shape and the call's row bucket, through `GemmDispatch`. It
  runs in the same workspace-free process, since the table's `cublas` choices and the fallback are that call.

cuBLAS reads the variable once per process, when it first sizes a workspace, so the setting is process state, not a
call argument: `prepare_process` sets it before the first CUDA GEMM for the configs a process will build (the runner,
the server and the GPU tests' conftest call it), and `check_process` (called by `EngineBackbone` at build time) fails
loudly when a config's GEMM choice does not match the process. On the CPU there is no cuBLAS; every choice but
`cublaslt` is torch's CPU kernels, row-count invariant once oneDNN's bf16 matmul is off (`engine.stages.
prepare_process` turns it off for the CPU): on an AVX-512 CPU without native bf16 (seen 2026-12-07, torch 2.13) oneDNN
picks its blocking by the row count, so 9 of 172 (rows, shape) pairs of the tiny twin gave a row other bits in a call
of more rows; torch's own CPU GEMM gave none (tests/test_stages.py, tests/test_engine_tree.py,
tests/test_gemm_stage.py, tests/test_plan_padding.py).

`GemmDispatch` (one per backbone, built from a table or None): `linear(x, weight, shape)` for the input and gate_up
projections, `project(x, weight, shape)` for the out and down projections, whose result feeds `residual_rmsnorm`, and
`residual_rmsnorm(norms, residual, delta, weight)` after it. The row bucket is the smallest of the table's buckets
(`engine.graphs.ROWS_GRID`) holding the call's rows x.shape[0]; a bucketed plan's calls have its bucket's rows. Kernel
families of a table's choice:
* `cublas`: `F.linear` (bitwise with `cublas_row_invariant` by definition).
* `cublaslt`: one cuBLASLt algorithm (the table's nine config attributes) through nvmath-python's
  `nvmath.linalg.advanced.Matmul`, planned once per (shape, bucket) at build time on CUDA and kept alive for the
  backbone's lifetime (the objects are used under graph capture; `Matmul.free()` after capture raised on the H200);
  each call repoints its operands (`reset_operands_unchecked`) and executes on torch's current stream; a call of
  other rows than the plan's (eager, off the grid or above its largest bucket) runs `F.linear` when the tuner
  measured the choice bitwise with it (the same bits at a launch's cost), else padded slices of the plan's rows
  (`_run_cublaslt_rows`). nvmath is imported only when a table holds such a choice, only on CUDA; never on the
  CPU (a `cublaslt` choice there raises).
  cuBLASLt's heuristic is asked for algorithms with or without split-K (`offered_algorithms`: the reduction scheme
  mask), as the tuner asked it for the table's algorithm.
* `splitk` (out and down only; the table loader refuses it elsewhere): K cut into S equal slices, the fp32 partials
  P [S, N, out] with P_s = x[:, sK/S:(s+1)K/S] @ w[:, same]ᵀ accumulated in fp32 (`torch.bmm` with fp32 output on
  CUDA; on the CPU the same bmm on the fp32-widened operands, exact products, fp32 sums), no atomics, S fixed per
  shape. `project` returns P and `residual_rmsnorm` hands it to the ops' `residual_rmsnorm_splitk` (one pass: sum in
  split order in fp32, round once to bf16, add to the residual, normalise), so the split costs no extra pass.
  Exactness: the reduction and everything after it bitwise against `reference.ops.splitk_delta` composed with the
  ops' `residual_rmsnorm` (tests/test_gemm_stage.py); the partials against fp64 within the fp32 accumulation bound;
  the delta differs from `F.linear`'s by the fp32 sum order (bounded: engine/stages/gemm.md).
Without a table, or for a shape it lacks, every call is `F.linear`.

Weights are `engine.weights.Weight` (data, format, optional scale): only `bf16` exists today; formats with a scale
(FP8, split-K layouts) add a branch here and nothing to the layer types.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import EngineConfig
from engine.gemm_table import (
    CUBLASLT_ALGORITHM_KEYS,
    SPLITK_SHAPES,
    GemmChoice,
    GemmKernel,
    GemmTable,
    GemmTableError,
    table_or_fallback,
)
from engine.graphs import ROWS_GRID
from engine.weights import GDNLayerWeights, Weight

ROW_INVARIANT_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}  # no workspace: no split-K kernels
ROW_INVARIANT_CHOICES = ("cublas_row_invariant", "tuned")  # the configs whose process must have no cuBLAS workspace


def needs_row_invariant(config: EngineConfig) -> bool:
    """Whether the config's GEMM choice claims row-count invariance (and so needs the workspace-free cuBLAS)."""
    return config.gemm in ROW_INVARIANT_CHOICES


def prepare_process(configs: Iterable[EngineConfig]) -> dict[str, str]:
    """Put the process in the GEMM state the configs need, before its first CUDA GEMM; returns what is in force.

    Sets `ROW_INVARIANT_CUBLAS` when any config's choice is in `ROW_INVARIANT_CHOICES` and the variable is unset (a
    user's own value stands, and `check_process` then judges it). Raises when it would have to set the variable after
    CUDA was initialised in this process, since cuBLAS may already have read it.
    """
    if any(needs_row_invariant(c) for c in configs):
        for name, value in ROW_INVARIANT_CUBLAS.items():
            if name not in os.environ:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    raise RuntimeError(
                        f"{name} must be set before CUDA is initialised (cuBLAS reads it once per process); "
                        f"call engine.gemm.prepare_process first, or start the process with {name}={value}"
                    )
                os.environ[name] = value
    return {name: os.environ[name] for name in ROW_INVARIANT_CUBLAS if name in os.environ}


def check_process(config: EngineConfig, device: torch.device) -> None:
    """Raise unless this process can run `config`'s GEMM choice on `device` as the config claims."""
    if device.type != "cuda" or not needs_row_invariant(config):
        return
    wrong = {
        name: os.environ.get(name) for name, value in ROW_INVARIANT_CUBLAS.items() if os.environ.get(name) != value
    }
    if wrong:
        raise RuntimeError(
            f"gemm={config.gemm!r} needs {ROW_INVARIANT_CUBLAS} in this process before its first GEMM, but it has "
            f"{wrong}: call engine.gemm.prepare_process([config]) at start-up (row-count invariance is what makes "
            "the tree bitwise against the flat layout)"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Tuned GEMMs: the dispatcher of stage `gemm`

TABLE_ENV = "JEVLAB_GEMM_TABLE"  # a table's path: overrides the default location
TABLE_DIR = Path(__file__).resolve().parents[1] / "results" / "gemm"
LOG = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    """The name a table's `gpu.name` must equal: `torch.cuda.get_device_name` on CUDA, "cpu" elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def default_table_path(name: str, directory: Path = TABLE_DIR) -> Path | None:
    """Where stage `gemm` finds its table: `$JEVLAB_GEMM_TABLE` when set, else the newest committed table of this GPU
    under results/gemm/ (`<utc>-<gpu slug>-<commit>-table.json`, as `python -m measure.tune_gemm` names them; the
    UTC stamp sorts by name), else None."""
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV])
    gpu = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    pattern = re.compile(rf"\d{{8}}T\d{{6}}Z-{re.escape(gpu)}-[0-9a-f]{{7,40}}-table\.json")
    tables = sorted(path for path in directory.glob("*-table.json") if pattern.fullmatch(path.name))
    return tables[-1] if tables else None


def resolve_table(
    table: GemmTable | str | Path | None, device: torch.device, warn: Callable[[str], None] = LOG.warning
) -> tuple[GemmTable | None, str]:
    """(table or None, where it came from) for a backbone: a `GemmTable` as given; a path through
    `table_or_fallback`; None through `default_table_path`. Every refusal is one `warn(...)` and (None, reason): the
    backbone then runs cuBLAS."""
    if isinstance(table, GemmTable):
        return table, "given"
    path = Path(table) if table is not None else default_table_path(device_name(device))
    if path is None:
        warn(f"no GEMM table for {device_name(device)!r} under {TABLE_DIR} (and ${TABLE_ENV} unset); GEMMs fall back "
             "to cuBLAS (run `nox -s tune_gemm` on this GPU)")  # fmt: skip
        return None, "none found: cuBLAS"
    loaded = table_or_fallback(path, device_name(device), warn)
    return loaded, str(path) if loaded is not None else f"{path} refused: cuBLAS"


class GemmDispatch:
    """The GEMM op of one backbone (module docstring): each call's kernel by shape name and row bucket.

    table None (no table, or a refused one) or a shape the table lacks: `F.linear`. `plan_weights` maps shape names to
    one weight of each distinct `[out, in]` the backbone has under that name (bf16; `gemm_weights_by_shape`); on CUDA
    every `cublaslt` choice is planned at build time against it (so nothing is planned inside a graph capture and a bad
    algorithm is found before the first request), and every split-K choice is checked to cut each K equally.
    """

    def __init__(
        self, table: GemmTable | None, device: torch.device, plan_weights: dict[str, list[Tensor]], source: str
    ):
        self.table, self.device, self.source = table, device, source
        self._choice: dict[tuple[str, int], GemmChoice | None] = {}  # (shape, rows) -> its bucket's; on first use
        self._lt: dict[tuple[str, int], Any] = {}  # (shape, bucket rows) -> planned nvmath Matmul, backbone-lifetime
        self._lt_inputs: dict[str, Tensor] = {}  # shape -> [max bucket rows, K] buffer the plans were made against
        if table is None:
            return
        for shape in table.shapes:
            if shape.split > 1 and shape.name not in SPLITK_SHAPES:
                raise GemmTableError(f"{shape.name}: split-K only where residual_rmsnorm reduces it {SPLITK_SHAPES}")
            for weight in plan_weights.get(shape.name, []):
                if shape.split > 1 and weight.shape[1] % shape.split:
                    raise GemmTableError(f"{shape.name}: K = {weight.shape[1]} is not {shape.split} equal slices")
            for choice in shape.choices:
                if choice.kernel.family == "cublaslt":
                    if device.type != "cuda":
                        raise GemmTableError(f"{shape.name}: a cublaslt choice needs CUDA, this is {device.type}")
                    self._lt[(shape.name, choice.rows)] = self._plan_cublaslt(shape.name, choice, plan_weights)

    def describe(self) -> dict[str, Any]:
        """What the run record says about the table: its source, commit, GPU, and the kernel per shape and bucket."""
        if self.table is None:
            return {"source": self.source, "table": None}
        return {
            "source": self.source,
            "commit": self.table.commit,
            "gpu": self.table.gpu_name,
            "kernels": {
                s.name: [[c.rows, c.kernel.family, c.kernel.split] for c in s.choices] for s in self.table.shapes
            },
        }

    def kernel(self, shape: str, rows: int) -> GemmKernel:
        """The table's kernel for `shape` at `rows` rows (its bucket: `GemmTable.choice`); `cublas` without one."""
        choice = self._choice_at(shape, rows)
        return CUBLAS if choice is None else choice.kernel

    def _choice_at(self, shape: str, rows: int) -> GemmChoice | None:
        key = (shape, rows)
        if key not in self._choice:
            known = self.table is not None and any(s.name == shape for s in self.table.shapes)
            self._choice[key] = self.table.choice(shape, rows) if known else None
        return self._choice[key]

    def linear(self, x: Tensor, weight: Weight, shape: str) -> Tensor:
        """x [N, K] bf16 @ weight.dataᵀ -> [N, out] bf16 by the table's non-split kernel (in_proj, gate_up)."""
        kernel = self.kernel(shape, x.shape[0])
        if kernel.family == "splitk":
            raise ValueError(f"{shape}: split-K output is reduced by residual_rmsnorm; call project()")
        return self._one_pass(x, weight, shape, kernel)

    def project(self, x: Tensor, weight: Weight, shape: str) -> Tensor:
        """The out / down projection: [N, out] bf16, or with split-K the fp32 partials [S, N, out] for
        `residual_rmsnorm` to reduce."""
        kernel = self.kernel(shape, x.shape[0])
        if kernel.family != "splitk":
            return self._one_pass(x, weight, shape, kernel)
        return splitk_partials(x, weight.data, kernel.split)

    @staticmethod
    def residual_rmsnorm(norms: Any, residual: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """`norms.residual_rmsnorm` on a bf16 delta [N, H]; `norms.residual_rmsnorm_splitk` on partials [S, N, H]."""
        if delta.ndim == 3:
            return norms.residual_rmsnorm_splitk(residual, delta, weight)
        return norms.residual_rmsnorm(residual, delta, weight)

    def _one_pass(self, x: Tensor, weight: Weight, shape: str, kernel: GemmKernel) -> Tensor:
        """One bf16 result [N, out]. A cuBLASLt choice runs its plan when N is its bucket's rows (every graphed call);
        a call of other rows (eager, off the grid or above it) runs `F.linear` where the tuner measured the choice
        bitwise with it (the same bits, without padded slices), else the plan in slices (`_run_cublaslt_rows`)."""
        if kernel.family == "cublas":
            return F.linear(x, weight.data)
        choice = self._choice_at(shape, x.shape[0])
        if x.shape[0] != choice.rows and choice.bitwise_f_linear:
            return F.linear(x, weight.data)
        return _run_cublaslt_rows(self._lt[(shape, choice.rows)], choice.rows, x, weight.data, self.device)

    def _plan_cublaslt(self, shape: str, choice: GemmChoice, plan_weights: dict[str, list[Tensor]]) -> Any:
        if len(plan_weights.get(shape, [])) != 1:
            raise GemmTableError(f"{shape}: one cuBLASLt plan per bucket needs one [out, in] under the name")
        weight = plan_weights[shape][0]
        if shape not in self._lt_inputs:
            self._lt_inputs[shape] = torch.empty(
                ROWS_GRID[-1], weight.shape[1], dtype=weight.dtype, device=weight.device
            )
        wanted = dict(choice.kernel.algorithm)
        matmul = plan_cublaslt(self._lt_inputs[shape][: choice.rows], weight, wanted)
        if matmul is None:
            raise GemmTableError(f"{shape} at {choice.rows} rows: cuBLASLt plans no algorithm {wanted} here")
        return matmul


CUBLAS = GemmKernel("cublas", 1)
CUBLASLT_PLAN_LIMIT = 64  # heuristic offers searched for a table's algorithm (the tuner's come from the same query)
NO_SPLIT_K_MASK = 0  # cublasLtReductionScheme_t CUBLASLT_REDUCTION_SCHEME_NONE (nvmath: MatmulReductionScheme.NONE)
NO_ALGORITHM_OFFERED = "Planning failed to find any suitable algorithm."  # nvmath 1.0.0 Matmul.plan's RuntimeError


def offered_algorithms(matmul: Any, limit: int, allow_split_k: bool) -> list[Any]:
    """The nvmath `Algorithm`s cuBLASLt's heuristic offers for an nvmath `Matmul`, best first, at most `limit`; the
    Matmul is left planned with them (read the offers before planning it again). [] when the heuristic offers none
    (nvmath 1.0.0's `Matmul.plan` raises RuntimeError(`NO_ALGORITHM_OFFERED`) then, matmulmod.py); other errors pass.

    allow_split_k True: nvmath's default preferences, every reduction scheme, so split-K algorithms are among the
    offers (for down, K = 17,408, at 64 rows and limit 8 on the H200 every offer was split-K:
    results/gpu/20261201T2125Z-nvidia-h200-6871773-graphs-gemm-batching-tests.log).
    allow_split_k False: the preference `reduction_scheme_mask` = `NO_SPLIT_K_MASK`, which `Matmul.plan` sets as
    cuBLASLt's CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK. That is a bit set over cublasLtReductionScheme_t, the ways a
    split-K algorithm adds up the partial dot products of its K slices: INPLACE (1: in the output buffer),
    COMPUTE_TYPE (2) and OUTPUT_TYPE (4: partials in the workspace, summed in a second step); nvmath's default is all
    three (MASK, 7). The heuristic offers only configurations whose scheme the set allows; NONE (0), the scheme of an
    algorithm that runs each dot product over K in one sequence, has no bit to mask out, so a mask of 0 leaves only
    the algorithms without split-K and the limit counts only those (our reading of cublasLt.h; what the H200 offers so
    is not measured yet). The offers are also filtered on `splitk_num == 1`, so that "without split-K" rests on each
    configuration, not only on the heuristic honouring the mask: [] also when none is left."""
    preferences: dict[str, int] = {"limit": limit}
    if not allow_split_k:
        preferences["reduction_scheme_mask"] = NO_SPLIT_K_MASK
    try:
        offered = matmul.plan(preferences=preferences)
    except RuntimeError as error:
        if str(error) != NO_ALGORITHM_OFFERED:
            raise
        return []
    return [a for a in offered if allow_split_k or int(a.config_ifc.splitk_num) == 1]


def cublaslt_config(algorithm: Any) -> dict[str, int]:
    """The nine config attributes of an nvmath `Algorithm` (the table's `algorithm` object)."""
    return {key: int(getattr(algorithm.config_ifc, key)) for key in CUBLASLT_ALGORITHM_KEYS}


def plan_cublaslt(x: Tensor, weight: Tensor, wanted: dict[str, int]) -> Any | None:
    """An nvmath `Matmul` of x [rows, K] @ weight [out, K]ᵀ planned with the cuBLASLt algorithm `wanted` (nine config
    attributes), or None when cuBLASLt offers no algorithm of that id here or refuses the configuration. The
    heuristic is asked as the tuner asked it for `wanted` (`offered_algorithms`, up to `CUBLASLT_PLAN_LIMIT`): without
    split-K when `wanted` has splitk_num 1, with every reduction scheme otherwise. Its own entry when it lists exactly
    `wanted`; otherwise one of its entries of the same id with the other eight attributes set to `wanted`'s (the
    tuner's explicit set is built the same way, so a table's choice plans here). Executed once on x's current
    contents, so that a configuration cuBLASLt refuses fails here, not in a request."""
    from nvmath.linalg.advanced import Matmul  # CUDA only: imported when a table holds a cuBLASLt choice

    matmul = Matmul(x, weight.t(), stream=torch.cuda.current_stream(x.device))
    offered = offered_algorithms(matmul, CUBLASLT_PLAN_LIMIT, allow_split_k=wanted["splitk_num"] != 1)
    same_id = [a for a in offered if int(a.config_ifc.id) == wanted["id"]]
    if not same_id:
        return None
    exact = [a for a in same_id if cublaslt_config(a) == wanted]
    algorithm = exact[0] if exact else same_id[0]
    try:
        for key in CUBLASLT_ALGORITHM_KEYS[1:]:
            setattr(algorithm.config_ifc, key, wanted[key])
        matmul.plan(algorithms=[algorithm])
        matmul.execute(stream=torch.cuda.current_stream(x.device))  # once here: plan() runs no algo check, and the
        # workspace is allocated now, not under a graph capture
    except Exception as error:  # nvmath raises its own and cuBLASLt's error types for a configuration it refuses
        LOG.info("cuBLASLt refused %s at %s rows: %s", wanted, x.shape[0], error)
        return None
    return matmul if cublaslt_config(matmul.algorithms[0]) == wanted else None


def _run_cublaslt(matmul: Any, x: Tensor, weight: Tensor, device: torch.device) -> Tensor:
    """One planned nvmath `Matmul` on this call's operands (repointed, not copied), on torch's current stream."""
    matmul.reset_operands_unchecked(a=x, b=weight.t())
    return matmul.execute(stream=torch.cuda.current_stream(device))


def _run_cublaslt_rows(matmul: Any, planned: int, x: Tensor, weight: Tensor, device: torch.device) -> Tensor:
    """x [N, K] @ weightᵀ -> [N, out] through a Matmul planned for `planned` rows, for any N.

    An nvmath Matmul keeps the M it was planned with (`reset_operands_unchecked` repoints, it does not reshape), so a
    call of N != `planned` rows would return `planned` rows. N == `planned` (every bucketed plan's call): one run. Else
    (an eager request off the grid, or above the largest bucket, whose choice `GemmTable.choice` reuses): the rows in
    slices of `planned`, the last one zero-padded to `planned`, each run through the plan, and the N real rows kept.
    Bitwise with the same algorithm on the N rows in one call: every run has exactly the planned shape, and the
    table's kernels are row-invariant (`row_invariant` must be true; one split per shape), so a row's bits depend on
    that row and the weight only, not on which rows or how many share its call; the padding rows are dropped."""
    rows = x.shape[0]
    if rows == planned:
        return _run_cublaslt(matmul, x, weight, device)
    out = x.new_empty(rows, weight.shape[0])
    for start in range(0, rows, planned):
        part = x[start : start + planned]
        if part.shape[0] < planned:
            part = torch.cat([part, part.new_zeros(planned - part.shape[0], part.shape[1])])
        out[start : start + planned] = _run_cublaslt(matmul, part.contiguous(), weight, device)[: rows - start]
    return out  # each slice copied out before the next run, in stream order: safe if nvmath reuses its result


def splitk_partials(x: Tensor, weight: Tensor, split: int) -> Tensor:
    """Split-K partials P [S, N, out] fp32 of x [N, K] bf16 and weight [out, K] bf16, S = `split` equal K slices:
    P_s = x[:, s K/S:(s+1) K/S] @ weight[:, s K/S:(s+1) K/S]ᵀ, accumulated in fp32 (one batched GEMM, no atomics).
    CUDA: `torch.bmm(..., out_dtype=torch.float32)` on the bf16 operands; CPU (no such kernel): the same bmm on the
    operands widened to fp32 (exact: a bf16 product fits fp32), fp32 sums. Raises unless K is S equal slices."""
    rows, k = x.shape
    if k % split or weight.shape[1] != k:
        raise ValueError(f"splitk_partials: K = {k} (weight {tuple(weight.shape)}) is not {split} equal slices")
    x_slices = x.contiguous().view(rows, split, k // split).transpose(0, 1)  # [S, N, K/S]
    w_slices = weight.view(weight.shape[0], split, k // split).permute(1, 2, 0)  # [S, K/S, out]
    if x.device.type == "cuda":
        return torch.bmm(x_slices, w_slices, out_dtype=torch.float32)
    return torch.bmm(x_slices.float(), w_slices.float())


def gemm_weights_by_shape(layers: Iterable[Any]) -> dict[str, list[Tensor]]:
    """Shape name -> one weight of each distinct [out, in] the layers (engine.weights layer types) hold under it."""
    found: dict[str, dict[tuple[int, ...], Tensor]] = {}
    for layer in layers:
        named = {"gdn_in" if isinstance(layer, GDNLayerWeights) else "attn_in": layer.w_in, "out": layer.w_out}
        for name, weight in {**named, "gate_up": layer.w_gate_up, "down": layer.w_down}.items():
            found.setdefault(name, {}).setdefault(tuple(weight.data.shape), weight.data)
    return {name: list(by_shape.values()) for name, by_shape in found.items()}


def build_dispatch(
    config: EngineConfig,
    device: torch.device,
    plan_weights: dict[str, list[Tensor]],
    table: GemmTable | str | Path | None = None,
    warn: Callable[[str], None] = LOG.warning,
) -> GemmDispatch:
    """The backbone's dispatcher: without a table unless `config.gemm == "tuned"`; then `resolve_table(table)`, and a
    table the dispatcher cannot run here (a cuBLASLt algorithm cuBLASLt does not offer, split-K where K does not
    divide) is one warning and cuBLAS, never an error at request time."""
    if config.gemm != "tuned":
        return GemmDispatch(None, device, plan_weights, f"gemm={config.gemm}")
    loaded, source = resolve_table(table, device, warn)
    try:
        return GemmDispatch(loaded, device, plan_weights, source)
    except GemmTableError as error:
        warn(f"GEMM table {source}: {error}; GEMMs fall back to cuBLAS")
        return GemmDispatch(None, device, plan_weights, f"{source} refused: cuBLAS")
