"""The GEMM tuning table: which kernel each of the 27B's GEMM shapes runs at each row bucket, as a GPU tuner chose it.

Written by the tuner (`python -m measure.tune_gemm`, `nox -s tune_gemm` on the GPU) as
results/gemm/<utc>-<gpu>-<commit>-table.json and read by stage `gemm` (`EngineConfig.gemm="tuned"`) through
`engine.gemm.build_dispatch`, which finds it at `engine.gemm.default_table_path` (the newest table of this GPU there,
or `$JEVLAB_GEMM_TABLE`). A table holds for the GEMM code it was tuned with: tests/test_gemm_stage.py
(`test_committed_tables_were_tuned_on_todays_gemm_code`) fails when engine/gemm.py or engine/weights.py changed since
a committed table's `commit`.

Schema, version 1 (one JSON object; every key required, no others; `...` elides the other buckets and shapes):

    {"schema_version": 1,
     "gpu": {"name": "NVIDIA H200", "capability": [9, 0]},
     "versions": {"torch": "2.11.0", "cuda": "13.0", "cublas": "13.1.0", "cublaslt": "13.1.0", "nvmath": "1.0.0",
                  "triton": "3.6.0"},
     "commit": "1c45c5f", "created_utc": "2026-12-02T10:00:00Z",
     "shapes": {"down": {"n": 5120, "k": 17408, "buckets": [
                  {"rows": 64, "kernel": {"family": "splitk", "split": 2}, "time_us": 61.2, "floor_us": 47.5,
                   "bitwise_f_linear": false, "row_invariant": true}, ...]},
                "gate_up": {"n": 34816, "k": 5120, "buckets": [
                  {"rows": 64, "kernel": {"family": "cublaslt", "algorithm": {"id": 66, "tile_id": 20,
                   "splitk_num": 1, "reduction_scheme": 0, "cta_swizzling": 0, "custom_option": 0, "stages_id": 8,
                   "inner_shape_id": 0, "cluster_shape_id": 2}}, ...}, ...]}, ...}}

* `gpu.name` is `torch.cuda.get_device_name()`; a table tuned on another GPU model is refused. `versions.nvmath` may
  be null (no nvmath in the tuning process); the others are strings. `commit` is the tuned tree's git hash (7-40 hex),
  `created_utc` an ISO 8601 time in UTC.
* `shapes`: exactly `GEMM_SHAPES` (name: N out, K in; `out` is both the GDN out_proj and the attention o_proj), each
  with one bucket per row count of the graphs grid (`engine.graphs.ROWS_GRID`), in the grid's order, as the tuner
  writes it. A table tuned on an earlier grid (the same rows in every shape, each a row count of today's grid,
  ascending) is taken too: a grid row it lacks runs the kernel of the table's next larger bucket (`choice`: the
  shape's one split, so the row-invariance law holds), `untuned_rows` lists them, and `table_or_fallback` warns once
  (the 264-bucket grid's tables lack 1,088 and 1,216 rows).
* A bucket's `kernel`: `cublas` (`F.linear` in the row-invariant process: no workspace, no split-K), `cublaslt` (one
  cuBLASLt algorithm: the nine `cublasLtMatmulAlgoConfigAttributes_t` values, lower-cased, as nvmath-python's
  `Algorithm` and `nvmath.bindings.cublasLt` expose them) or `splitk` (K cut in `split` >= 2 slices, fp32 partials
  reduced by `kernels.residual_rmsnorm_splitk`; only for `SPLITK_SHAPES`, whose output feeds that norm). `time_us`
  is the measured time (tables from the in-context tuner: a call behind its forward producer, less the producer's own
  time; `measure.tune_gemm`, Timing), `floor_us` the tuner's floor for that GEMM from its ceilings (a time under it
  is a finding the candidates record lists in `below_floor`: the ceiling was low; the loader accepts it),
  `bitwise_f_linear` whether its output equals `F.linear`'s bit for bit, and `row_invariant` whether a row's bits
  are independent of the call's row count (must be true: the tree layout is bitwise against the flat one only then).
* The row-invariance law: one split per shape (`cublas` counts 1, `cublaslt` its `splitk_num`), never one per row
  count, so that a row's K-reduction order does not change when the batch moves to another bucket. Kernels of equal
  split can still differ in bits; the tuner must mix them in one shape only where it measured them bitwise to each
  other (e.g. all bitwise with `F.linear`). The loader checks the split, not that measurement.

`load_gemm_table` raises `GemmTableError` on anything wrong; `table_or_fallback` turns that into one warning and None
(the caller then runs cuBLAS), so that a server never fails mid-request on a bad table.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from engine.graphs import ROWS_GRID
from reference.shapes import QWEN38_27B, ModelShapes

SCHEMA_VERSION = 1


def gemm_shapes(shapes: ModelShapes) -> dict[str, tuple[int, int]]:
    """name: (N out, K in) of a model's GEMMs, the merged weights of engine/weights.py (`out` is the GDN out_proj; the
    attention o_proj has the same N x K in the 27B)."""
    return {
        "gdn_in": (shapes.gdn_in_width, shapes.hidden_size),
        "attn_in": (shapes.attn_in_width, shapes.hidden_size),
        "out": (shapes.hidden_size, shapes.linear_value_dim),
        "gate_up": (2 * shapes.intermediate_size, shapes.hidden_size),
        "down": (shapes.hidden_size, shapes.intermediate_size),
    }


GEMM_SHAPES: dict[str, tuple[int, int]] = gemm_shapes(QWEN38_27B)  # the shapes a table holds
CUBLASLT_ALGORITHM_KEYS = (  # cublasLtMatmulAlgoConfigAttributes_t, in enum order
    "id",
    "tile_id",
    "splitk_num",
    "reduction_scheme",
    "cta_swizzling",
    "custom_option",
    "stages_id",
    "inner_shape_id",
    "cluster_shape_id",
)
VERSION_KEYS = ("torch", "cuda", "cublas", "cublaslt", "nvmath", "triton")
SPLITK_SHAPES = ("out", "down")  # the projections whose output goes straight into residual_rmsnorm
BUCKET_KEYS = ("rows", "kernel", "time_us", "floor_us", "bitwise_f_linear", "row_invariant")
LOG = logging.getLogger(__name__)


class GemmTableError(ValueError):
    """A GEMM table that cannot be used: missing, unreadable, of another schema or GPU, or breaking a law."""


@dataclass(frozen=True)
class GemmKernel:
    """One GEMM kernel: family `cublas`, `cublaslt` (with its algorithm) or `splitk`; `split` K slices."""

    family: str
    split: int
    algorithm: tuple[tuple[str, int], ...] = ()  # cublaslt: (key, value) in CUBLASLT_ALGORITHM_KEYS order


@dataclass(frozen=True)
class GemmChoice:
    """The kernel chosen for one shape at one row bucket, with what the tuner measured (row invariance is required,
    so it is no field)."""

    rows: int
    kernel: GemmKernel
    time_us: float
    floor_us: float
    bitwise_f_linear: bool


@dataclass(frozen=True)
class GemmShape:
    """One GEMM shape [rows, k] @ [n, k]ᵀ and its choices, one per bucket of ROWS_GRID in order."""

    name: str
    n: int
    k: int
    choices: tuple[GemmChoice, ...]

    @property
    def split(self) -> int:
        return self.choices[0].kernel.split


@dataclass(frozen=True)
class GemmTable:
    """A validated tuning table (module docstring); `choice` is what the `gemm` stage will look up."""

    gpu_name: str
    capability: tuple[int, int]
    versions: tuple[tuple[str, str | None], ...]  # in VERSION_KEYS order
    commit: str
    created_utc: datetime
    shapes: tuple[GemmShape, ...]  # in GEMM_SHAPES order

    def shape(self, name: str) -> GemmShape:
        for shape in self.shapes:
            if shape.name == name:
                return shape
        raise KeyError(f"no GEMM shape {name!r}; the table has {[s.name for s in self.shapes]}")

    @property
    def untuned_rows(self) -> tuple[int, ...]:
        """The grid's row counts without a bucket of their own (a table of an earlier grid)."""
        tuned = {c.rows for c in self.shapes[0].choices}
        return tuple(rows for rows in ROWS_GRID if rows not in tuned)

    def choice(self, shape_name: str, rows: int) -> GemmChoice:
        """The choice of the smallest bucket >= rows. Above the largest bucket: the largest bucket's choice, not
        cuBLAS, because it has the shape's one split (the row-invariance law holds at every row count)."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        choices = self.shape(shape_name).choices
        index = bisect.bisect_left([c.rows for c in choices], rows)
        return choices[min(index, len(choices) - 1)]


def load_gemm_table(path: str | Path, *, device_name: str) -> GemmTable:
    """Read and validate the table at `path` for the GPU named `device_name` (`torch.cuda.get_device_name()`).
    Raises GemmTableError, with the offending key and value, on anything the module docstring rules out."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise GemmTableError(f"GEMM table {path}: cannot read it ({error.strerror or error})") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise GemmTableError(f"GEMM table {path}: not valid JSON ({error})") from error
    version = data.get("schema_version") if isinstance(data, dict) else f"none (a JSON {type(data).__name__})"
    if type(version) is not int or version != SCHEMA_VERSION:
        raise GemmTableError(f"GEMM table {path}: schema_version {version!r}, this loader reads {SCHEMA_VERSION}")
    try:
        return _table(data, device_name)
    except GemmTableError as error:
        raise GemmTableError(f"GEMM table {path}: {error}") from None


def table_or_fallback(
    path: str | Path, device_name: str, warn: Callable[[str], None] = LOG.warning
) -> GemmTable | None:
    """`load_gemm_table`, or None after one `warn(message)` when the table cannot be used: the caller then runs
    cuBLAS. Meant for start-up of a server, which must not fail on a bad table. A table of an earlier grid is used
    after one `warn(message)` naming its `untuned_rows`."""
    try:
        table = load_gemm_table(path, device_name=device_name)
    except GemmTableError as error:
        warn(f"{error}; GEMMs fall back to cuBLAS")
        return None
    if table.untuned_rows:
        warn(f"GEMM table {path}: no bucket of its own at rows {list(table.untuned_rows)} (tuned on an earlier grid); "
             "those run the next larger bucket's kernel (run `nox -s tune_gemm` on this GPU)")  # fmt: skip
    return table


# ---------------------------------------------------------------------------------------------------------------------
# Validation


def _table(data: dict, device_name: str) -> GemmTable:
    _keys(data, "table", ("schema_version", "gpu", "versions", "commit", "created_utc", "shapes"))
    gpu = _keys(data["gpu"], "gpu", ("name", "capability"))
    gpu_name = _string(gpu["name"], "gpu.name")
    if gpu_name != device_name:
        raise GemmTableError(f"tuned on {gpu_name!r}, this GPU is {device_name!r} (tables do not carry across GPUs)")
    capability = gpu["capability"]
    if not isinstance(capability, list) or len(capability) != 2:
        raise GemmTableError(f"gpu.capability: expected [major, minor], got {capability!r}")
    versions = _keys(data["versions"], "versions", VERSION_KEYS)
    commit = _string(data["commit"], "commit")
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        raise GemmTableError(f"commit: expected 7-40 lower-case hex digits, got {commit!r}")
    created = _string(data["created_utc"], "created_utc")
    try:
        created_utc = datetime.fromisoformat(created)
    except ValueError:
        created_utc = None
    if created_utc is None or created_utc.utcoffset() != timedelta(0):
        raise GemmTableError(f"created_utc: expected an ISO 8601 time in UTC, got {created!r}")
    shapes = _keys(data["shapes"], "shapes", tuple(GEMM_SHAPES))
    parsed = tuple(_shape(name, shapes[name]) for name in GEMM_SHAPES)
    rows = {name: [c.rows for c in shape.choices] for name, shape in zip(GEMM_SHAPES, parsed)}
    if len({tuple(r) for r in rows.values()}) > 1:
        raise GemmTableError(f"shapes: every shape must have the same bucket rows, got {rows}")
    return GemmTable(
        gpu_name=gpu_name,
        capability=(_int(capability[0], "gpu.capability", 1), _int(capability[1], "gpu.capability", 0)),
        versions=tuple(
            (key, None if key == "nvmath" and versions[key] is None else _string(versions[key], f"versions.{key}"))
            for key in VERSION_KEYS
        ),
        commit=commit,
        created_utc=created_utc,
        shapes=parsed,
    )


def _shape(name: str, data: Any) -> GemmShape:
    where = f"shapes.{name}"
    _keys(data, where, ("n", "k", "buckets"))
    if (data["n"], data["k"]) != GEMM_SHAPES[name]:
        n, k = GEMM_SHAPES[name]
        raise GemmTableError(f"{where}: n, k = {data['n']!r}, {data['k']!r}, the 27B's {name} is {n} x {k}")
    buckets = data["buckets"]
    if not isinstance(buckets, list):
        raise GemmTableError(f"{where}.buckets: expected a list, got {type(buckets).__name__}")
    choices = tuple(_choice(bucket, f"{where}.buckets[{i}]") for i, bucket in enumerate(buckets))
    rows = [c.rows for c in choices]
    extra = sorted(set(rows) - set(ROWS_GRID))
    if not rows or extra or rows != sorted(set(rows)):
        detail = f"not in the grid {extra}" if extra else "none" if not rows else "out of order or repeated"
        raise GemmTableError(f"{where}: bucket rows must be row counts of engine.graphs.ROWS_GRID, ascending: {detail}")
    if name not in SPLITK_SHAPES and any(c.kernel.family == "splitk" for c in choices):
        raise GemmTableError(f"{where}: split-K only for {SPLITK_SHAPES}, whose partials residual_rmsnorm reduces")
    rows_by_split: dict[int, list[int]] = {}
    for c in choices:
        rows_by_split.setdefault(c.kernel.split, []).append(c.rows)
    if len(rows_by_split) > 1:
        spread = "; ".join(f"split {split} at rows {rows}" for split, rows in rows_by_split.items())
        raise GemmTableError(
            f"{where}: the split varies across buckets ({spread}): the row-invariance law fixes one split per shape"
        )
    return GemmShape(name=name, n=data["n"], k=data["k"], choices=choices)


def _choice(data: Any, where: str) -> GemmChoice:
    _keys(data, where, BUCKET_KEYS)
    time_us, floor_us = _positive(data["time_us"], f"{where}.time_us"), _positive(data["floor_us"], f"{where}.floor_us")
    if data["row_invariant"] is not True:
        raise GemmTableError(f"{where}: row_invariant is {data['row_invariant']!r}; a chosen kernel must be true")
    return GemmChoice(
        rows=_int(data["rows"], f"{where}.rows", 1),
        kernel=_kernel(data["kernel"], f"{where}.kernel"),
        time_us=time_us,
        floor_us=floor_us,
        bitwise_f_linear=_bool(data["bitwise_f_linear"], f"{where}.bitwise_f_linear"),
    )


def _kernel(data: Any, where: str) -> GemmKernel:
    family = data.get("family") if isinstance(data, dict) else None
    if family == "cublas":
        _keys(data, where, ("family",))
        return GemmKernel("cublas", 1)
    if family == "cublaslt":
        _keys(data, where, ("family", "algorithm"))
        algorithm = _keys(data["algorithm"], f"{where}.algorithm", CUBLASLT_ALGORITHM_KEYS)
        values = tuple((key, _int(algorithm[key], f"{where}.algorithm.{key}", 0)) for key in CUBLASLT_ALGORITHM_KEYS)
        return GemmKernel("cublaslt", _int(algorithm["splitk_num"], f"{where}.algorithm.splitk_num", 1), values)
    if family == "splitk":
        _keys(data, where, ("family", "split"))
        return GemmKernel("splitk", _int(data["split"], f"{where}.split", 2))
    raise GemmTableError(f"{where}: family must be 'cublas', 'cublaslt' or 'splitk', got {data!r}")


def _keys(data: Any, where: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise GemmTableError(f"{where}: expected an object, got {type(data).__name__}")
    missing, unknown = [k for k in keys if k not in data], sorted(set(data) - set(keys))
    if missing or unknown:
        raise GemmTableError(f"{where}: missing keys {missing}, unknown keys {unknown}")
    return data


def _int(value: Any, where: str, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise GemmTableError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _positive(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise GemmTableError(f"{where}: expected a finite number > 0, got {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise GemmTableError(f"{where}: expected true or false, got {value!r}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise GemmTableError(f"{where}: expected a non-empty string, got {value!r}")
    return value
