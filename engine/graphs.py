"""CUDA graphs over bucketed tree plans (stage `graphs`): the grid, the graph cache and the replay.

A forward over a bucketed plan (`engine.plan.plan_tree(..., bucket=...)`) launches the same kernels with the same
grids for every request of its bucket: everything a launch reads from the host comes from the plan's shape. So the
forward is captured once per bucket and replayed. A bucketed plan is built on the host only (its arena is its host
buffer: no device allocation or copy in `prepare`; its host time: engine/stages/graphs.md, "`prepare` in fewer host
calls", record results/graphs/prepare-time.json); a replay copies that buffer into the captured arena through one
pinned staging buffer and one non-blocking host-to-device copy in stream order (`PinnedStaging`: it waits for the
previous copy out of the buffer before overwriting it), the int32 copies are the graph's first kernels, the graph
replays, and the real candidates' rows are copied out of the static output (the next replay overwrites it). Where no
graph serves a bucketed plan it runs eagerly after `TreePlan.to(device)`.

The grid (`default_grid`): rows x candidate class x slot factor, 280 buckets. Rows (`ROWS_GRID`): every 16 from 64 to
256, every 32 to 512, every 64 to 1,280 (33 sizes; the step grows with the size as in vLLM's and SGLang's capture
sizes, since a GEMM's cost is flat in the rows below the H200's ridge, about 178 rows, and linear above it).
Candidate classes per rows size (`candidate_classes`): 1, 2, 4, 6, 8 up to 256 rows; 1, 2, 4, 8, 16 up to 512; 1, 2,
8, 32 above (the largest class, `candidate_capacity`, is the first grid's only one, so the grid holds every request
it held). Slot factors per class (`slot_factors`; a request's slots / rows lies in [1, candidates]): 1 for one
candidate, 2 for two, 2 and 3 for four, 2 for six, 2, 3 and 5 from eight. Per bucket, with C candidates and S =
factor x rows: slots S + 2C + 2, sequences and attention nodes 2C + 2 (the dummy paths absorb each real candidate's
partial last chunk one chunk at a time), GDN chunks ceil(S / 64) + C + 1 (the bound of a request's chunks given its
slots and candidates), keys 2 x slots + rows, `max_q` = `max_k` = rows.

How it was chosen. The first grid (one class per rows size, 8 / 16 / 32 candidates, slot factors 1, 2, 3, 5: 124
buckets) sized every capacity but rows from 8-32 candidates, and the H200 measured 1.3-6.3 ms per forward from those
capacities (engine/stages/graphs.md, "Where the padding cost comes from"); JevBench requests have 1, 4, 5 or 6
candidates. The classes and factors were picked on the request shapes of the public JevBench tiers (120 tasks), the six
Open-Jev requests, our two synthetic workloads and 60 generated requests (1-16 questions of 2-64 options over states of
0-16k tokens, 145 plans) under a bucket budget: server start <= 120 s at the measured 0.25-0.33 s per capture plus about
25 s of eager warm-up allows about 280 graphs. The second grid had the rows 1,152 and 1,280 after 1,024 (264 buckets);
the padding tool measured customer_service's 1,032 rows at 101.03 ms in its 1,152-row bucket against 93.75 for the exact
plan and 99.97 at 1,088 rows (engine/stages/core.md, "Where the bucket's padding goes"), so the 64-row step now runs to
1,280 and the grid fills the budget (the 280 captures took 63.5 s on an H100 at 581c73c and 98.3 s on an H200 at
8edfe66, where the start went over 120 s: hosts differ by up to 1.5x). `python -m measure.grid_coverage` recomputes the
padding of every capacity for the three grids (results/graphs/grid-coverage.json; padded / real, this grid, the first
grid's in brackets where they differ; the second grid's differ only in the Open-Jev set: rows 1.082, slots 1.247, chunks
1.37, keys 1.61):

| set | plans | held | rows | slots | sequences | chunks | nodes | keys | cands |
|---|---|---|---|---|---|---|---|---|---|
| JevBench | 120 | 120 | 1.060 | 1.175 (1.205) | 2.75 (4.97) | 1.51 (2.13) | 2.16 (3.89) | 2.44 (2.49) | 1.10 (2.21) |
| Open-Jev | 6 | 5 | 1.058 (1.082) | 1.21 (1.27) | 2.44 (8.07) | 1.34 (1.89) | 1.54 (5.07) | 1.56 (1.63) | 1.04 (3.85) |
| generated | 145 | 17 | 1.041 | 1.193 (1.201) | 2.88 (3.91) | 1.67 (1.90) | 2.48 (3.37) | 2.40 (2.41) | 1.35 (1.87) |

(synthetic: 2 plans, both hand-off; the two generated plans left out have 5-6k rows.)
Memory: the pool is shared and sized by the largest graph, which is the same bucket in all three grids; what grows
with the bucket count is per-graph: the arena (int64 index arrays, well under 1 MiB each), the static output and the
FLA solve buffers each arena keeps (slots x 48 value heads x 64 bf16 at 27B: 2.25 GiB over the grid against 1.94 GiB
for the second and 0.91 GiB for the first, computed by the coverage tool); the server's peak is in its /health
(target <= 56 GiB).

The `handoff` mode (long shared contexts with several candidates: a host loop over calls and a state bank) and plans
outside the grid run eagerly and are counted as misses, by reason; they are the long plans, whose GPU time dwarfs
their launch overhead. Their kernels are compiled at start (`EngineBackbone.warm_up`).

Exactness: bitwise against the eager `tree` forward of the same request (tests/test_plan_padding.py on the CPU for
the padding; tests/test_gpu_graphs.py on the H200 for replay vs eager, padded vs unpadded, alternating requests,
repeated replays and a smaller request in a larger bucket).

Graph cache (`GraphCache`): plan shape -> `CapturedGraph` (graph, arena, static output); one memory pool shared by
all graphs (they never run concurrently); capture after warm-up on a side stream; an LRU bound with an eviction
count; hits and misses counted, misses by reason. `capture_grid` captures every bucket (largest first, so that the
pool is sized once) with a progress bar; nothing is captured on a request's path unless `capture_on_miss`. It holds
the backbone's forward weakly (`weak_callable`), so a dropped engine is freed without the cycle collector.
`describe()` is what `/health` and the run record show (records before this name had `pool_bytes` for the same
number: the process's reserved CUDA memory, not the pool's alone).
"""

from __future__ import annotations

import bisect
import inspect
import math
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from engine.plan import Bucket, PlanShape, TreeLayout, TreePlan, bucket_padding, plan_tree

ROWS_GRID = (*range(64, 257, 16), *range(288, 513, 32), *range(576, 1281, 64))
DEFAULT_MAX_GRAPHS = 512


def candidate_classes(rows: int) -> tuple[int, ...]:
    """The candidate capacities of the buckets of `rows` rows, ascending (module docstring, "The grid")."""
    if rows <= 256:
        return (1, 2, 4, 6, 8)
    if rows <= 512:
        return (1, 2, 4, 8, 16)
    return (1, 2, 8, 32)


def candidate_capacity(rows: int) -> int:
    """The most candidates a bucket of `rows` rows holds (its largest candidate class)."""
    return candidate_classes(rows)[-1]


def slot_factors(candidates: int) -> tuple[int, ...]:
    """The path-slot capacities, in multiples of the rows, of the buckets of `candidates` candidates: a request's
    slots / rows lies in [1, candidates] (each candidate's path holds at most every row once)."""
    return {1: (1,), 2: (2,), 4: (2, 3), 6: (2,)}.get(candidates, (2, 3, 5))


def grid_bucket(rows: int, slot_factor: int, candidates: int | None = None, chunk_size: int = 64) -> Bucket:
    """The bucket of `rows` rows, `slot_factor` x rows path slots and `candidates` candidates (default: the rows'
    largest class); the other capacities follow from these three (module docstring)."""
    candidates = candidate_capacity(rows) if candidates is None else candidates
    if candidates < 1 or slot_factor < 1 or rows < 2:
        raise ValueError(f"a bucket needs rows >= 2, slot_factor >= 1 and candidates >= 1: {rows}, {slot_factor}, "
                         f"{candidates}")  # fmt: skip
    base = int(slot_factor * rows)
    slots = base + 2 * candidates + 2
    return Bucket(
        rows=rows,
        slots=slots,
        sequences=2 * candidates + 2,
        chunks=math.ceil(base / chunk_size) + candidates + 1,
        nodes=2 * candidates + 2,
        keys=2 * slots + rows,
        candidates=candidates,
        max_q=rows,
        max_k=rows,
    )


def default_grid(rows_grid: Sequence[int] = ROWS_GRID) -> tuple[Bucket, ...]:
    """Every (rows, candidate class, slot factor) of the module docstring's grid, rows ascending; `rows_grid` other
    rows sizes with the same classes and factors (`measure.graph_padding` times a finer one)."""
    return tuple(
        grid_bucket(rows, factor, candidates)
        for rows in rows_grid
        for candidates in candidate_classes(rows)
        for factor in slot_factors(candidates)
    )


class GridIndex:
    """A grid sorted for `smallest_bucket`: buckets by rows, then (slots, sequences) within one rows size; a search
    skips every rows size below the request's rows + 1 (a bisection) and scans the rest in order."""

    def __init__(self, grid: Iterable[Bucket]):
        self.buckets = tuple(sorted(grid, key=attrgetter("rows", "slots", "sequences")))
        self._rows = [bucket.rows for bucket in self.buckets]

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def smallest(self, layout: TreeLayout) -> Bucket | None:
        """The first bucket in (rows, slots, sequences) order that `layout` fits, or None."""
        for i in range(bisect.bisect_right(self._rows, layout.rows), len(self.buckets)):
            bucket = self.buckets[i]
            if bucket.candidates >= len(layout.candidate_lens) and bucket_padding(layout, bucket) is not None:
                return bucket
        return None


def smallest_bucket(layout: TreeLayout, grid: Iterable[Bucket]) -> Bucket | None:
    """The bucket with the fewest rows (then slots, then sequences) that `layout` fits, or None: the first fit in
    that order (the grid's first in a tie). `grid` may be a `GridIndex` (built once: what the backbone holds)."""
    index = grid if isinstance(grid, GridIndex) else GridIndex(grid)
    return index.smallest(layout)


def placeholder_request() -> tuple[list[list[int]], list[int]]:
    """A request that fits every bucket (one candidate of one token): what each graph is captured on; the graph's bits
    do not depend on it, only on the arrays copied in before each replay."""
    return [[1]], [0]


def capture_forward(
    forward: Callable[[], torch.Tensor], arena, device: torch.device, *, pool=None, warmup_runs: int = 2
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `forward()` (one plan's forward over `arena`, an `engine.plan.PlanArena`) as a CUDA graph: warm-up runs
    on a side stream first (compiles, autotunes, lazily created handles and buffers), then the capture, whose first
    kernels recompute the arena's int32 copies so that a replay needs only the int64 buffer copied in. Returns the
    graph and its static output. The caller must keep the arena (its plan) alive as long as the graph: the graph
    reads its addresses, and freed memory would be handed to other tensors (an exact-plan graph whose plan was
    dropped read garbage indices in the H200 run of 0557e88: an index_select out of bounds)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            forward()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        arena.refresh_int32()
        output = forward()
    torch.cuda.synchronize(device)
    return graph, output


class PinnedStaging:
    """The host side of a replay's arena refill: one pinned int64 buffer (grown to the largest captured arena) and
    one CUDA event. `copy(dst, src)` waits for the event (the previous non-blocking copy out of the buffer must have
    finished before the buffer is overwritten), copies `src` (a host plan's arena buffer) into the pinned buffer,
    enqueues one non-blocking host-to-device copy into `dst` on the current stream (so it runs after every replay
    enqueued before it and before the next one) and records the event."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.buffer = torch.empty(0, dtype=torch.int64)
        self.event = torch.cuda.Event()
        self._pending = False

    def reserve(self, numel: int) -> None:
        if numel > self.buffer.numel():
            self._wait()
            self.buffer = torch.empty(numel, dtype=torch.int64, pin_memory=True)

    def _wait(self) -> None:
        if self._pending:
            self.event.synchronize()
            self._pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type != "cpu" or src.dtype != torch.int64 or src.shape != dst.shape:
            raise ValueError("staging copies an int64 host buffer into a device buffer of its size")
        self.reserve(src.numel())
        self._wait()
        staged = self.buffer[: src.numel()]
        staged.copy_(src)
        dst.copy_(staged, non_blocking=True)
        self.event.record(torch.cuda.current_stream(self.device))
        self._pending = True


@dataclass
class CapturedGraph:
    """One captured forward: its bucket, the plan whose arena it reads (on the device), the static output
    [bucket.candidates, hidden]."""

    bucket: Bucket
    plan: TreePlan
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    replays: int = 0

    def run(self, plan: TreePlan, staging: PinnedStaging) -> torch.Tensor:
        """Replay over `plan` (same shape; its arena on the host, as the `graphs` stage builds it on CUDA): its index
        arrays go into the captured arena through `staging`, the graph replays (its first kernels recompute the int32
        copies), and its candidates' rows are returned (a copy: the next replay overwrites the output)."""
        if plan.shape != self.plan.shape:
            raise ValueError("the plan's shape is not this graph's")
        staging.copy(self.plan.arena.buffer, plan.arena.buffer)
        self.graph.replay()
        self.replays += 1
        return self.output[: plan.num_candidates].clone()


@dataclass
class GraphStats:
    hits: int = 0
    misses: Counter = field(default_factory=Counter)  # reason -> count
    evictions: int = 0
    captures: int = 0
    capture_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "hits": self.hits,
            "misses": dict(self.misses),
            "evictions": self.evictions,
            "captures": self.captures,
            "capture_seconds": round(self.capture_seconds, 3),
        }


def weak_callable(fn: Callable) -> Callable[[], Callable]:
    """`fn` behind a call that returns it: a bound method held weakly (a backbone's cache holding the backbone's own
    method would make backbone -> cache -> method -> backbone a reference cycle, so that a dropped engine and its
    weights wait for the cycle collector: tests/conftest.py collected them before each GPU module), anything else
    strongly. Raises once a weakly held method's object is gone."""
    if not inspect.ismethod(fn):
        return lambda: fn
    method = weakref.WeakMethod(fn)

    def resolve() -> Callable:
        bound = method()
        if bound is None:
            raise RuntimeError("GraphCache: the backbone whose forward it captures is gone")
        return bound

    return resolve


class GraphCache:
    """Plan shape -> captured forward, for one backbone (`forward_batch(plan) -> [candidates, hidden]`, the eager
    forward of one bucketed plan). `grid`: the buckets requests are padded to; `max_graphs`: the LRU bound."""

    def __init__(
        self,
        forward_batch: Callable[[TreePlan], torch.Tensor],
        device: torch.device,
        grid: Sequence[Bucket] | None = None,
        *,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        capture_on_miss: bool = False,
        warmup_runs: int = 2,
    ):
        if torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._forward = weak_callable(forward_batch)
        self.device = torch.device(device)
        self.grid = tuple(default_grid() if grid is None else grid)
        self.index = GridIndex(self.grid)
        self.staging = PinnedStaging(self.device)
        self.max_graphs = max_graphs
        self.capture_on_miss = capture_on_miss
        self.warmup_runs = warmup_runs
        self.graphs: OrderedDict[PlanShape, CapturedGraph] = OrderedDict()
        self.stats = GraphStats()
        self._pool = None

    def __len__(self) -> int:
        return len(self.graphs)

    def bucket_for(self, layout: TreeLayout) -> Bucket | None:
        return self.index.smallest(layout)

    def lookup(self, plan: TreePlan) -> CapturedGraph | None:
        """The graph of a plan's shape (a hit), capturing it first when `capture_on_miss`; None (a miss) otherwise."""
        entry = self.graphs.get(plan.shape)
        if entry is None and plan.bucket is not None and self.capture_on_miss:
            entry = self.capture(plan.bucket)
            if entry.plan.shape != plan.shape:
                raise RuntimeError(f"bucket {plan.bucket.name}: the captured shape is not the request's (a shape that "
                                   "depends on more than the bucket)")  # fmt: skip
        if entry is None:
            self.stats.misses["not captured" if plan.bucket is not None else "no bucket"] += 1
            return None
        self.graphs.move_to_end(plan.shape)
        self.stats.hits += 1
        return entry

    def count_miss(self, reason: str) -> None:
        self.stats.misses[reason] += 1

    def capture(self, bucket: Bucket) -> CapturedGraph:
        """Capture the forward of `bucket` (warm-up runs on a side stream first; the pool is shared)."""
        start = time.perf_counter()
        candidates, groups = placeholder_request()
        plan = plan_tree(candidates, groups, device=self.device, bucket=bucket)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, output = capture_forward(
            lambda: self._forward()(plan), plan.arena, self.device, pool=self._pool, warmup_runs=self.warmup_runs
        )
        entry = CapturedGraph(bucket=bucket, plan=plan, graph=graph, output=output)
        self.staging.reserve(plan.arena.buffer.numel())
        self.graphs[plan.shape] = entry
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats.evictions += 1
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        return entry

    def capture_grid(
        self, progress: Callable[[Iterable], Iterable] | None = None, buckets: Iterable[Bucket] | None = None
    ) -> None:
        """Capture every bucket of the grid (or only `buckets`, a subset of it: a run or test that knows the buckets
        its requests take), largest first (the pool takes its size from the first)."""
        chosen = self.grid if buckets is None else tuple(set(buckets))
        outside = [b.name for b in chosen if b not in self.grid]
        if outside:
            raise ValueError(f"buckets {outside} are not in the grid")
        order = sorted(chosen, key=lambda b: (b.rows, b.slots), reverse=True)[: self.max_graphs]
        for bucket in progress(order) if progress else order:
            self.capture(bucket)

    def describe(self) -> dict:
        """What `/health` and the run record report: graphs, capture seconds, the CUDA memory the process holds
        (weights, graph pool and caches together: torch reports no size per pool), hits and misses."""
        return {
            "graphs": len(self.graphs),
            "grid": len(self.grid),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(self.device),
            **self.stats.as_dict(),
        }
