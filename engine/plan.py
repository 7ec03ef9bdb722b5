"""Row layouts for the engine: the two-level prefix tree (stage `tree`) and the flat layout it replaces.

A request's candidates (token ids) share long prefixes: the chat template and the context are common to every
candidate, the question text to every candidate of one question. The tree packs each shared token once:

    packed rows = [ root | question node 0 | question node 1 | ... | leaf 0 | leaf 1 | ... ]

* root: the longest common token prefix of all candidates, capped so that every candidate keeps at least one token;
* question node r: the longest common prefix of question r's candidates beyond the root, capped the same way (a
  one-candidate question's node holds all but its last token; nodes may be empty);
* leaf c: the rest of candidate c (at least one token; its last row is the row the head reads).

Splits are on token ids, never on strings. Rows keep their original positions (RoPE and the GDN chunk grid count
from each candidate's first token), and each candidate's path (root rows, its question's rows, its leaf rows) lists
exactly its own tokens in order. The flat plan is the same structure with an empty root and empty question nodes:
candidates back to back, which is the unshared packed layout (cu_seqlens over candidates) that the tree is compared
against; every tree function in `engine/tree.py` runs on both plans.

Node ids: 0 = root, 1 + r = question r (questions numbered in order of first appearance in `groups`),
1 + R + c = leaf of candidate c.

Besides the layout, a plan holds the index tensors the layer functions need, all built on the host and copied to the
device in one transfer: the gather of each candidate's path, the representative slot of each packed row, the
row-to-node relation for the attention mask, two GDN schedules (`replicated` and `handoff`, see `GdnSchedule`), two
conv input layouts for kernels that read a sequence's previous rows (`ConvInput`: the paths, and node segments with
their history rows) and the node-wise varlen attention layout (`NodeAttention`).

Shape and buffers. A plan is split in two: `PlanShape`, hashable and host-only, holds every size and flag a launch
reads from the host (the length of every index array, the GDN calls' flags and contiguous ranges, the attention's
`max_q` / `max_k`), so two plans of equal shape launch the same kernels with the same grids (the CUDA-graph key of the
`graphs` stage); `PlanArena` holds one buffer per shape with a named view per index array (plus the int32 copies
some kernels take and the FLA solve workspace), refilled in place by one copy (`plan_tree(..., arena=...)`). A new
plan on the CPU gets an arena over its host buffer itself (no copy); a plan on CUDA gets a device arena and one
host-to-device copy. The `graphs` stage builds its bucketed plans on the CPU on every device (host-only: the captured
graph's arena is filled from them at replay, `engine.graphs.CapturedGraph.run`) and moves one to the device
(`TreePlan.to`: every array identical, one copy) only where it runs eagerly. What else a plan carries is request
data on the host (candidate and node lengths, sequence bounds for the CPU cores, the conv windows); no CUDA launch
reads it.

Padding. `pad_lens` appends detached dummy sequences after the real leaves: each is one node of its own (no parent,
positions from 0, token id `PAD_TOKEN_ID`), a path of its own for the GDN core, a sequence of its own for the conv and
attention, never read by the head. No real row can see a dummy row, and every op is row- or prefix-invariant, so the
real rows' bits do not change (tests/test_plan_padding.py); the `graphs` stage pads a request to its bucket's shape this
way.

Buckets. `Bucket` is the capacity of a captured shape (stage `graphs`): rows, path slots, sequences, GDN chunks,
attention nodes and keys, candidates and the attention's `max_q` / `max_k`. `plan_tree(..., bucket=b)` lays a request
out at exactly b's sizes, replicated GDN mode only (no `handoff` schedule, no node-segment conv layout):
* one dummy node of `b.rows - N` rows (positions from 0, `PAD_TOKEN_ID`) with its own path and attention node;
* further dummy paths over the dummy rows (no rows or attention nodes of their own) up to `b.sequences`, their
  lengths chosen so that the dummy chunks reach `b.chunks` spread evenly (the GDN recurrence runs a sequence's
  chunks in order, so one long dummy sequence would lengthen the critical path); a dummy path may be empty;
* path slots after the last sequence (`b.slots` in all), attention nodes without rows (`b.nodes`), key entries after
  the last node (`b.keys`) and read rows (`b.candidates`), all at the dummy node's last row; no kernel reads a slot,
  key or node outside its sequences, and no real row reads a dummy one.
`bucket_padding` says whether a request fits a bucket and how it is padded; the padded plan's shape is the graph key,
and it depends on the bucket alone (no contiguous-range shortcuts, which depend on the request: tested against the
capture placeholder).

Host cost. A plan's arrays hold a few hundred to a few thousand entries, so building them costs per numpy or torch
call, not per row; `engine.plan_arrays.host_arrays` builds them in a few vectorized calls per array (its docstring
lists the steps), and this module lays them into an arena and views. Nothing is cached between requests: a bucket's
padding depends on the request's rows, chunks, slots, keys and candidates, not on the bucket alone. Which plans a
request gets (batches, GDN mode, bucket) is the planner's decision (engine/planner.py); measured host time of
`prepare`: engine/stages/graphs.md, "`prepare` in fewer host calls".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from engine.plan_arrays import ARENA_ARRAYS, HostArrays, host_arrays
from reference.ops import GDN_CHUNK_SIZE as CHUNK_SIZE

INT32_ARRAYS = ("conv_paths.cu_seqlens", "conv_segments.cu_seqlens", "attention.cu_seqlens_q", "attention.cu_seqlens_k")


@dataclass(frozen=True, eq=False)
class GdnArena:
    """The replicated call as a core with state pools runs it in two calls (`kernels.gdn_flashinfer.FlashInferCore.
    arena`; the arrays: `engine.plan_arrays._handoff_arena`): the shared root once to its last chunk boundary A0, its
    fp32 state to every candidate, which runs from A0. Every sequence starts at a multiple of the chunk size of its
    path, so the chunk grid is the replicated call's. Call 2 holds the paths that produce a row (a bucket's: S = its
    candidates and the dummy node, the unused ones empty; its other dummy paths, which balance FLA's grid, left out)."""

    rows: torch.Tensor  # [L] int64: the packed row of each arena slot (slots after cu_seqlens[-1] are in no sequence)
    cu_seqlens: torch.Tensor  # [S + 2] int64: call 1 (the root) cu_seqlens[:2], call 2 (S paths) cu_seqlens[1:]
    states: torch.Tensor  # [2 + 2S] int64: pool rows read and written by call 1 (2), read by call 2 (S), written (S)
    out_slots: torch.Tensor  # [N] int64: the arena slot that produces each packed row
    gathered: torch.Tensor  # [1] int64: the slots to gather (the sequences' and 64 more: a last chunk's tile is read)


@dataclass(frozen=True, eq=False)
class GdnCall:
    """One call of the varlen GDN core: sequences of packed rows gathered back to back.

    Sequence i occupies slots cu_seqlens[i]:cu_seqlens[i+1]; slot s holds packed row `rows[s]`. A sequence either
    starts at original position 0 with a zero state, or continues from a state in the state bank (index
    `init_state[i]`; bank entry 0 is the zero state, then the final states of earlier calls with `keep_final`, in call
    and sequence order). `init_state` is None when every sequence starts at position 0. The call produces the packed
    rows `out_rows` from its slots `out_slots`; across a schedule every packed row is produced exactly once.
    `rows_start` / `out_start` are set where `rows` / (`out_slots`, `out_rows`) are contiguous ranges, so the inputs
    can be sliced instead of gathered and the outputs copied as one block (the flat plan, the root's call).
    """

    rows: torch.Tensor  # [T] int64, on the plan's device
    cu_seqlens: torch.Tensor  # [S + 1] int64, on the plan's device
    cu_seqlens_cpu: torch.Tensor  # [S + 1] int64, host copy (lets FLA and the torch core avoid a device sync)
    chunk_indices: torch.Tensor  # [sum ceil(len / chunk_size), 2] int64: (sequence, chunk) pairs, FLA's varlen layout
    chunk_offsets: torch.Tensor  # [S + 1] int64: first chunk of each sequence (FLA's `chunk_offsets`, from the arena)
    init_state: torch.Tensor | None  # [S] int64 index into the state bank, or None (all start at position 0)
    keep_final: bool  # its final states join the bank
    out_slots: torch.Tensor  # [n] int64
    out_rows: torch.Tensor  # [n] int64
    start_positions: tuple[int, ...]  # original position of each sequence's first token
    walk: torch.Tensor | None  # [S, 8] int64: the tree walk of a replicated call (`kernels.gdn_chunk`), else None
    arena: GdnArena | None  # the replicated call's hand-off arena (FlashInfer's core), else None
    chunks: int  # sum over sequences of ceil(len / chunk_size): the work measure of the cost rule
    rows_start: int | None  # rows == arange(rows_start, rows_start + T), else None
    out_start: tuple[int, int] | None  # (first slot, first row) when out_slots and out_rows are both contiguous

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_cpu[-1])

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens_cpu) - 1


@dataclass(frozen=True, eq=False)
class GdnSchedule:
    """The GDN core calls of one mode.

    * `replicated`: one call over every candidate's full path (the shared rows copied into each path). Each path
      starts at position 0, so the chunk grid, conv window and recurrent state match an unshared run exactly.
    * `handoff`: the root runs once up to its last chunk boundary A0 = 64*floor(root_len/64) and keeps its fp32 final
      state; each question whose node crosses a further boundary A_r runs [A0, A_r) once from that state; each leaf
      then runs [A_r, end) from its question's state. Every split is at a multiple of 64 from the sequence start, so
      the straddling chunk is recomputed per branch and the chunk grid is the unshared one. With a single question
      the root and the question node form one chain: it runs [0, A_1) in one call (A0 is not a branch point), so
      the mode takes two calls, not three (the three-call measurement that decided it: engine/stages/tree.md).
    """

    mode: str
    calls: tuple[GdnCall, ...]

    @property
    def chunks(self) -> int:
        return sum(call.chunks for call in self.calls)

    @property
    def num_tokens(self) -> int:
        """Rows the GDN core processes (shared rows counted once per sequence that holds them)."""
        return sum(call.num_tokens for call in self.calls)


@dataclass(frozen=True, eq=False)
class ConvInput:
    """Packed rows laid out as sequences for a causal conv that starts each sequence from zero history.

    Sequence i is `rows[cu_seqlens[i]:cu_seqlens[i+1]]` (packed row ids); the wanted outputs are the slots `keep`, in
    order (`keep_rows = rows[keep]` are their packed rows). Two layouts per plan:
    * `conv_paths`: every candidate's path (keep: all slots, so the outputs are in path layout);
    * `conv_segments`: each non-empty node's rows after up to W-1 history rows (the last rows of its ancestors), nodes
      in packed order (keep: the node rows, so the outputs are the packed rows in order).
    A row's conv window is the same W rows in both, and in the unshared run. `spaced` lays the sequences out for a conv
    that does not know sequence boundaries (`reference.ops.causal_conv1d_silu`): an index into [zero row | packed
    rows] with W-1 zero rows before each sequence; `spaced_keep` are the positions of the `keep` slots in it.
    """

    rows: torch.Tensor  # [M] int64
    cu_seqlens: torch.Tensor  # [S + 1] int64, on the device
    cu_seqlens_i32: torch.Tensor  # [S + 1] int32, on the device (for the GDN prep kernel; an arena int32 copy)
    cu_seqlens_cpu: torch.Tensor  # [S + 1] int64, host
    keep: torch.Tensor  # [n] int64
    keep_rows: torch.Tensor  # [n] int64
    keep_rows_are_packed: bool  # keep_rows == arange(N): the outputs are the packed rows in order
    spaced: torch.Tensor  # [M + (W-1) S] int64
    spaced_keep: torch.Tensor  # [n] int64
    rows_are_packed: bool  # rows == arange(N): the packed rows need no gather
    keep_all: bool  # keep == arange(M): every output is wanted, in order


@dataclass(frozen=True, eq=False)
class NodeAttention:
    """Varlen causal attention over the tree, one sequence per non-empty node (packed order).

    Sequence i's queries are the node's own packed rows (contiguous: `cu_seqlens_q`), its keys the node's path up to
    its last row (`key_rows[cu_seqlens_k[i]:cu_seqlens_k[i+1]]`: root rows, question rows, own rows), and the queries
    are the last rows of the keys (causal alignment at the bottom right, as FlashAttention's varlen kernel does when
    seqlen_q < seqlen_k). A row sees exactly its ancestors and the earlier rows of its own node, as `visible`. For a
    flat plan the nodes are the candidates and `key_rows` are the packed rows themselves (`keys_are_rows`).
    """

    key_rows: torch.Tensor  # [K] int64
    cu_seqlens_q: torch.Tensor  # [S + 1] int32, on the device
    cu_seqlens_k: torch.Tensor  # [S + 1] int32, on the device
    cu_seqlens_q_cpu: torch.Tensor  # [S + 1] int64, host
    cu_seqlens_k_cpu: torch.Tensor  # [S + 1] int64, host
    max_q: int
    max_k: int
    keys_are_rows: bool

    @property
    def num_keys(self) -> int:
        return len(self.key_rows)


@dataclass(frozen=True)
class GdnCallShape:
    """The host-side facts of one GDN call that a launch reads (its array sizes are in `PlanShape.arrays`)."""

    keep_final: bool
    has_init_state: bool
    rows_start: int | None
    out_start: tuple[int, int] | None


@dataclass(frozen=True)
class PlanShape:
    """Everything a launch over a plan reads from the host; hashable. Equal shapes launch the same kernels with the
    same grids: the arena layout (`arrays`: every index array's name and shape, in arena order) fixes every row,
    sequence, chunk, node and key count; the flags fix which gathers and copies run."""

    kind: str
    chunk_size: int
    num_rows: int
    num_candidates: int
    num_padding: int  # detached dummy sequences (`pad_lens`)
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    gdn: tuple[tuple[str, tuple[GdnCallShape, ...]], ...]  # per mode, per call
    conv_flags: tuple[tuple[str, tuple[bool, bool, bool]], ...]  # per layout: rows_are_packed, keep_all, keep_packed
    attention_max: tuple[int, int]  # max_q, max_k
    keys_are_rows: bool

    def array_shape(self, name: str) -> tuple[int, ...]:
        return dict(self.arrays)[name]


@dataclass(frozen=True)
class Bucket:
    """The capacity of one captured plan shape (module docstring, "Buckets"); `plan_tree(..., bucket=...)` pads a
    request to exactly these sizes."""

    rows: int  # packed rows N
    slots: int  # path slots (the replicated GDN call's tokens, the conv input rows)
    sequences: int  # paths: candidates + dummy paths
    chunks: int  # GDN chunks of the replicated call
    nodes: int  # attention sequences
    keys: int  # attention key entries
    candidates: int  # read rows
    max_q: int
    max_k: int

    @property
    def name(self) -> str:
        return f"r{self.rows}-s{self.slots}-c{self.candidates}"


@dataclass(frozen=True)
class BucketPadding:
    """How a request fills a bucket: `dummy_rows` rows in one dummy node; `path_lens` the dummy paths (the first
    holds the dummy node's rows, then repeats its last row; the others cycle through the dummy rows); the counts of
    trailing slots, rowless nodes, trailing keys and extra read rows."""

    dummy_rows: int
    path_lens: tuple[int, ...]
    trailing_slots: int
    empty_nodes: int
    trailing_keys: int
    extra_reads: int


@dataclass(frozen=True)
class TreeLayout:
    """The host-only sizes of a request's prefix tree (before any plan is built): enough for the GDN cost rule and
    for `bucket_padding` (the sizes are computed once per layout: `smallest_bucket` reads them for many buckets)."""

    candidate_lens: tuple[int, ...]
    question_of: tuple[int, ...]
    root_len: int
    question_lens: tuple[int, ...]
    chunk_size: int = CHUNK_SIZE

    @cached_property
    def leaf_lens(self) -> tuple[int, ...]:
        return tuple(n - self.root_len - self.question_lens[r] for n, r in zip(self.candidate_lens, self.question_of))

    @cached_property
    def rows(self) -> int:
        return self.root_len + sum(self.question_lens) + sum(self.leaf_lens)

    @cached_property
    def slots(self) -> int:
        return sum(self.candidate_lens)

    @cached_property
    def chunks(self) -> int:
        return sum(-(-n // self.chunk_size) for n in self.candidate_lens)

    @cached_property
    def nodes(self) -> int:
        return (self.root_len > 0) + sum(q > 0 for q in self.question_lens) + len(self.candidate_lens)

    @cached_property
    def keys(self) -> int:
        root = self.root_len
        return root + sum(root + q for q in self.question_lens if q > 0) + self.slots

    @cached_property
    def max_q(self) -> int:
        return max(self.root_len, *self.question_lens, *self.leaf_lens)

    @cached_property
    def max_k(self) -> int:
        return max(self.candidate_lens)

    def gdn_mode_costs(self, call_cost_chunks: float) -> dict[str, float]:
        """The cost rule of `engine.planner.gdn_mode_costs` (chunks of work plus a fixed cost per call) from the sizes
        alone, without building either schedule (equal to it: tests/test_plan_padding.py)."""
        size, root, q_lens = self.chunk_size, self.root_len, self.question_lens
        a0 = 0 if len(q_lens) == 1 else root // size * size
        q_end = [(root + q) // size * size for q in q_lens]
        crossing = [r for r in range(len(q_lens)) if q_end[r] > a0]
        chunks = a0 // size + sum((q_end[r] - a0) // size for r in crossing)
        for n, r in zip(self.candidate_lens, self.question_of):
            start = q_end[r] if r in crossing else a0
            chunks += -(-(n - start) // size)
        calls = (a0 > 0) + bool(crossing) + 1
        return {"replicated": self.chunks + call_cost_chunks, "handoff": chunks + call_cost_chunks * calls}


def tree_layout(candidates: Sequence[Sequence[int]], groups: Sequence[int], chunk_size: int = CHUNK_SIZE) -> TreeLayout:
    """The prefix tree's node sizes of a request (as `plan_tree` splits it), host-only."""
    return prefix_summary(candidates, groups).layout(chunk_size)


@dataclass(frozen=True, eq=False)
class PrefixSummary:
    """What the two-level tree's split needs of one request's tokens (`_summary`), read from them once.

    With P(S) the common prefix length of a set of candidates: `common` = P(all), `shortest` the shortest candidate's
    length, and per question (in order of first appearance) `question_ends[q]` = min(P(its candidates), its shortest
    - 1). The request's root is min(common, shortest - 1) and question q's node holds question_ends[q] - root rows.
    `JoinedLayout` joins such summaries into the layout of several requests answered as one batch."""

    first: np.ndarray  # the first candidate's tokens
    common: int
    shortest: int
    question_ends: tuple[int, ...]
    candidate_lens: tuple[int, ...]
    question_of: tuple[int, ...]  # question index (order of first appearance) of each candidate

    def layout(self, chunk_size: int = CHUNK_SIZE) -> TreeLayout:
        root = min(self.common, self.shortest - 1)
        question_lens = tuple(end - root for end in self.question_ends)
        return TreeLayout(self.candidate_lens, self.question_of, root, question_lens, chunk_size)


def prefix_summary(candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> PrefixSummary:
    """The request's `PrefixSummary` (inputs checked as `plan_tree` checks them)."""
    seqs, question_of, num_questions = check_inputs(candidates, groups)
    return _summary(seqs, question_of, num_questions)


class JoinedLayout:
    """The layout of a queue of requests answered as one batch, grown one request at a time: after `add`ing the
    summaries of requests 1..k, `add` returned `tree_layout` of their candidates back to back, request i's questions
    numbered after request i-1's (as `reference.service.batch_inputs` joins them; equal: tests/test_batching.py).

    Why no token is read again: the common prefix of a union is min(P(batch), LCP(batch's first candidate, the new
    request's first), P(new request)) (every candidate of the new request agrees with its first on P(new request)
    tokens), and a question's end depends on its own candidates only. So `add` costs one LCP over the new request's
    first candidate and a layout of the candidates so far (integers), not a layout over every token of the batch."""

    def __init__(self) -> None:
        self._first: np.ndarray | None = None
        self._common = self._shortest = 0
        self._lens: list[int] = []
        self._question_of: list[int] = []
        self._ends: list[int] = []

    def add(self, summary: PrefixSummary, chunk_size: int = CHUNK_SIZE) -> TreeLayout:
        if self._first is None:
            self._first, self._common, self._shortest = summary.first, summary.common, summary.shortest
        else:
            self._common = min(self._common, common_prefix_len([self._first, summary.first]), summary.common)
            self._shortest = min(self._shortest, summary.shortest)
        self._question_of += [len(self._ends) + q for q in summary.question_of]
        self._ends += summary.question_ends
        self._lens += summary.candidate_lens
        joined = PrefixSummary(
            self._first, self._common, self._shortest, tuple(self._ends), tuple(self._lens), tuple(self._question_of)
        )
        return joined.layout(chunk_size)


def bucket_padding(layout: TreeLayout, bucket: Bucket) -> BucketPadding | None:
    """The padding that lays `layout` out at `bucket`'s sizes, or None where it does not fit (some size exceeds the
    bucket's). Dummy chunks are spread evenly over the dummy paths; each path is as short as its chunk count allows
    (64 (c - 1) + 1 slots), and the slots left over trail the last sequence. The sizes that need no path lengths are
    compared first (a search over a grid rejects most buckets on them)."""
    size = layout.chunk_size
    dummy_rows = bucket.rows - layout.rows
    if dummy_rows < 1:  # the common case in a search over a grid: settled before the other sizes are read
        return None
    num_paths = bucket.sequences - len(layout.candidate_lens)
    dummy_chunks = bucket.chunks - layout.chunks
    first_min = -(-dummy_rows // size)
    trailing_keys = bucket.keys - layout.keys - dummy_rows
    fits = (
        num_paths >= 1
        and dummy_chunks >= first_min
        and trailing_keys >= 0
        and bucket.slots >= layout.slots + dummy_rows  # the dummy node's path holds its rows (before the counts)
        and bucket.nodes >= layout.nodes + 1
        and bucket.candidates >= len(layout.candidate_lens)
        and bucket.max_q >= max(layout.max_q, dummy_rows)
        and bucket.max_k >= max(layout.max_k, dummy_rows)
    )
    if not fits:
        return None
    counts = [dummy_chunks // num_paths + (i < dummy_chunks % num_paths) for i in range(num_paths)]
    if counts[0] < first_min:  # the dummy node's path needs its rows' chunks; spread the rest over the others
        rest = dummy_chunks - first_min
        others = num_paths - 1
        counts = [first_min] + [rest // others + (i < rest % others) for i in range(others)] if others else [first_min]
    path_lens = [size * (c - 1) + 1 if c else 0 for c in counts]
    path_lens[0] = max(path_lens[0], dummy_rows)
    trailing_slots = bucket.slots - layout.slots - sum(path_lens)
    if trailing_slots < 0 or sum(counts) != dummy_chunks:
        return None
    return BucketPadding(
        dummy_rows=dummy_rows,
        path_lens=tuple(path_lens),
        trailing_slots=trailing_slots,
        empty_nodes=bucket.nodes - layout.nodes - 1,
        trailing_keys=trailing_keys,
        extra_reads=bucket.candidates - len(layout.candidate_lens),
    )


class SolveWorkspace:
    """The FLA solve buffers of one arena: one per GDN call layout, keyed by the device address of that call's
    `chunk_indices` (an arena view: the same address for the arena's life and every refill; no object ids).

    `begin_forward()` marks every buffer stale; `zeros(chunk_indices, shape, like)` returns the layout's buffer,
    zeroed at its first use in a forward (one fill per layout and forward, as `kernels.gdn_core.FlaForwardCore`
    documents; allocated on first use)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._fresh: set[tuple] = set()

    def begin_forward(self) -> None:
        self._fresh.clear()

    def __len__(self) -> int:
        return len(self._buffers)

    def zeros(self, chunk_indices: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (chunk_indices.data_ptr(), tuple(shape), like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        elif key not in self._fresh:
            buffer.zero_()
        self._fresh.add(key)
        return buffer


class PlanArena:
    """One buffer laid out by a `PlanShape`: a named int64 view per index array, an int32 copy of the arrays kernels
    take as int32 (`INT32_ARRAYS`), and the FLA solve workspace. `fill` refills it in place (one copy of every array,
    host to device on CUDA, then the int32 copies on the arena's device); a plan of another shape is refused. `host`:
    a CPU arena over an int64 host buffer already laid out by the shape (`PlanShape.arrays` back to back), without a
    copy (what a new CPU plan gets); its int32 copies are converted from the host buffer once, on the host."""

    def __init__(self, shape: PlanShape, device: torch.device, host: np.ndarray | None = None) -> None:
        self.shape = shape
        self.device = torch.device(device)
        sizes = [math.prod(dims) for _, dims in shape.arrays]
        if host is None:
            self.buffer = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        elif self.device.type != "cpu" or host.dtype != np.int64 or host.shape != (sum(sizes),):
            raise ValueError("a host buffer backs a CPU arena only, int64 and of the shape's size")
        else:
            self.buffer = torch.from_numpy(host)
        pieces = self.buffer.split_with_sizes(sizes)
        self.views = {
            name: piece if len(dims) == 1 else piece.view(dims) for (name, dims), piece in zip(shape.arrays, pieces)
        }
        int32_names = [name for name in INT32_ARRAYS if name in self.views]
        if host is None:
            self.int32 = {name: torch.empty(self.views[name].shape, dtype=torch.int32, device=self.device)
                          for name in int32_names}  # fmt: skip
        else:
            self.int32 = {name: self.views[name].to(torch.int32) for name in int32_names}
        self.workspace = SolveWorkspace()

    def refresh_int32(self) -> None:
        """Recompute the int32 copies from the int64 views (on the device; a captured graph's first kernels)."""
        for name, copy in self.int32.items():
            copy.copy_(self.views[name])

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        if tuple((name, tuple(a.shape)) for name, a in arrays.items()) != self.shape.arrays:
            raise ValueError("the plan's arrays do not match this arena's shape")
        self.load(torch.from_numpy(_host_buffer(arrays)))

    def load(self, host: torch.Tensor) -> None:
        """Refill from `host` (int64, laid out by this arena's shape: another arena's `buffer` of the same shape)."""
        self.buffer.copy_(host)
        self.refresh_int32()


def _host_buffer(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The arrays back to back (int64), in the order of `PlanShape.arrays` (a shape built from them, or checked)."""
    return np.concatenate([a.ravel() for a in arrays.values()], dtype=np.int64)


@dataclass(frozen=True, eq=False)
class TreePlan:
    """A packed row layout (kind "tree" or "flat"): its shape, its arena (index tensors on `device`, views) and its
    request data on the host.

    Per packed row n (N rows, dummy rows last): `token_ids`, `positions` (original position in its candidates),
    `row_node`, `row_parent` / `row_grandparent` (node ids of its node's ancestors, -1 where none), `row_slot` (one slot
    of `path_rows` holding it), `conv_taps` [N, CONV_WIDTH] (its conv window: the packed rows at positions p-3..p of
    its path; N, a zero row appended by the conv, before position 0; `kernels.gdn_prep`'s taps in any GDN mode).
    Per candidate c (the real ones; dummy paths follow): its path `path_rows[path_cu_seqlens[c]:path_cu_seqlens[c+1]]`
    (root to leaf, one entry per token of the candidate) and `read_rows[c]`, the row of its last token.
    """

    kind: str
    device: torch.device
    shape: PlanShape
    arena: PlanArena
    candidate_lens: tuple[int, ...]
    question_of: tuple[int, ...]  # question index (order of first appearance) of each candidate
    root_len: int
    question_lens: tuple[int, ...]
    leaf_lens: tuple[int, ...]
    padding_lens: tuple[int, ...]  # detached dummy sequences after the real leaves
    chunk_size: int
    conv_taps: torch.Tensor  # [N, CONV_WIDTH] int64: each row's conv window (the GDN prep kernel's `taps`)
    path_cu_seqlens_cpu: torch.Tensor  # [C + P + 1] int64, host
    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    row_node: torch.Tensor  # [N] int64
    row_parent: torch.Tensor  # [N] int64
    row_grandparent: torch.Tensor  # [N] int64
    row_slot: torch.Tensor  # [N] int64
    path_rows: torch.Tensor  # [sum(candidate_lens) + sum(padding_lens)] int64
    path_cu_seqlens: torch.Tensor  # [C + P + 1] int64
    read_rows: torch.Tensor  # [C] int64
    gdn: dict[str, GdnSchedule]  # "replicated" and "handoff"
    conv_paths: ConvInput
    conv_segments: ConvInput | None  # None for a bucketed plan (replicated GDN only)
    attention: NodeAttention
    bucket: Bucket | None = None  # the bucket it is laid out at, if any

    @property
    def num_rows(self) -> int:
        return self.shape.num_rows

    @property
    def rows_computed(self) -> int:
        """Rows every row-wise op (GEMMs, norms, MLP) runs over."""
        return self.num_rows

    @property
    def token_rows(self) -> int:
        """Rows that hold a candidate's token: the packed rows less the dummy rows (`padding_lens`)."""
        return self.num_rows - sum(self.padding_lens)

    @property
    def logical_tokens(self) -> int:
        """Tokens of all candidates together: the rows of the flat layout."""
        return sum(self.candidate_lens)

    @property
    def num_candidates(self) -> int:
        return len(self.candidate_lens)

    @property
    def num_questions(self) -> int:
        return len(self.question_lens)

    def to(self, device: torch.device | str) -> TreePlan:
        """This plan with its index arrays on `device`: a new arena there, loaded by one copy of this plan's buffer
        (every array identical; the host fields are shared). How a host-only bucketed plan (stage `graphs` on CUDA)
        runs eagerly where no graph serves it."""
        device = torch.device(device)
        if device == self.device:
            return self
        arena = PlanArena(self.shape, device)
        arena.load(self.arena.buffer)
        table = {id(view): arena.views[name] for name, view in self.arena.views.items()}
        table |= {id(copy): arena.int32[name] for name, copy in self.arena.int32.items()}

        def moved(obj):
            """`obj` (a dataclass) with every field that is one of the old arena's tensors replaced by the new's."""
            swap = {f.name: table[id(v)] for f in dataclasses.fields(obj) if id(v := getattr(obj, f.name)) in table}
            return dataclasses.replace(obj, **swap)

        def moved_call(call: GdnCall) -> GdnCall:
            return moved(call) if call.arena is None else dataclasses.replace(moved(call), arena=moved(call.arena))

        gdn = {mode: GdnSchedule(mode, tuple(moved_call(call) for call in schedule.calls))
               for mode, schedule in self.gdn.items()}  # fmt: skip
        segments = None if self.conv_segments is None else moved(self.conv_segments)
        plan = dataclasses.replace(self, device=device, arena=arena, gdn=gdn, conv_paths=moved(self.conv_paths),
                                   conv_segments=segments, attention=moved(self.attention))  # fmt: skip
        return moved(plan)

    def visible(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether row i attends to row j: j lies in an ancestor node of i's node, or in i's own node at or before i.

        Broadcasts over index tensors; also usable as a FlexAttention `mask_mod` body. The diagonal is always visible.
        """
        node_j = self.row_node[j]
        own = (node_j == self.row_node[i]) & (j <= i)
        return own | (node_j == self.row_parent[i]) | (node_j == self.row_grandparent[i])


def plan_tree(
    candidates: Sequence[Sequence[int]],
    groups: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    chunk_size: int = CHUNK_SIZE,
    pad_lens: Sequence[int] = (),
    arena: PlanArena | Callable[[PlanShape], PlanArena | None] | None = None,
    bucket: Bucket | None = None,
    layout: TreeLayout | None = None,
) -> TreePlan:
    """The two-level prefix tree of a request: `groups[c]` is the question of candidate c. `pad_lens`: detached dummy
    sequences to append (module docstring); `bucket`: lay the request out at this bucket's sizes instead (module
    docstring, "Buckets"; ValueError where it does not fit); `arena`: refill this arena in place (its shape must be
    the plan's), or a function of the plan's shape that returns the arena to fill (or None for a new one); `layout`:
    the request's `tree_layout` where the caller has it, so that the split is not recomputed (ValueError where its
    candidate lengths, questions or chunk size are not the request's)."""
    seqs, question_of, num_questions = check_inputs(candidates, groups)
    if layout is None:
        layout = _summary(seqs, question_of, num_questions).layout(chunk_size)
    elif (layout.candidate_lens, layout.question_of, layout.chunk_size) != (
        tuple(len(q) for q in seqs),
        tuple(question_of),
        chunk_size,
    ):
        raise ValueError("the layout is another request's")
    padding = None
    if bucket is not None:
        if len(pad_lens):
            raise ValueError("pad_lens and bucket are two ways of padding: pass one")
        padding = bucket_padding(layout, bucket)
        if padding is None:
            raise ValueError(
                f"the request does not fit bucket {bucket.name} ({layout.rows} rows, {layout.slots} slots)"
            )
    root_len, question_lens = layout.root_len, layout.question_lens
    return _build(
        "tree", seqs, question_of, root_len, question_lens, device, chunk_size, pad_lens, arena, bucket, padding
    )


def plan_flat(
    candidates: Sequence[Sequence[int]],
    groups: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    chunk_size: int = CHUNK_SIZE,
    pad_lens: Sequence[int] = (),
    arena: PlanArena | None = None,
) -> TreePlan:
    """The unshared layout (candidates back to back) in the same structure: empty root and question nodes."""
    seqs, question_of, num_questions = check_inputs(candidates, groups)
    return _build("flat", seqs, question_of, 0, [0] * num_questions, device, chunk_size, pad_lens, arena, None, None)


def _summary(seqs: list[np.ndarray], question_of: list[int], num_questions: int) -> PrefixSummary:
    """The two-level tree's split of checked inputs (module docstring), as a `PrefixSummary`."""
    members: list[list[np.ndarray]] = [[] for _ in range(num_questions)]
    for c, r in enumerate(question_of):
        members[r].append(seqs[c])
    question_common = [common_prefix_len(m) for m in members]
    ends = tuple(min(common, min(len(q) for q in m) - 1) for common, m in zip(question_common, members))
    # P(all) = min(P(each question), P(the questions' first candidates)): each candidate agrees with its question's
    # first on P(its question) tokens (the identity `JoinedLayout` joins requests by); one question: P(all) = P(it).
    common = min(*question_common, common_prefix_len([m[0] for m in members]))
    lens = tuple(len(q) for q in seqs)
    return PrefixSummary(seqs[0], common, min(lens), ends, lens, tuple(question_of))


def token_arrays(candidates: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Each candidate's tokens as an int64 array (an int64 array as it is, without a copy). ValueError naming the first
    candidate whose ids are not integers: a float or bool id is refused, never truncated (an empty candidate is left
    to the callers' checks)."""
    arrays = [np.asarray(tokens) for tokens in candidates]
    for c, arr in enumerate(arrays):
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"candidate {c} has token ids that are not 64-bit integers ({arr.dtype})")
    return [arr.astype(np.int64, copy=False) for arr in arrays]


def check_inputs(candidates, groups) -> tuple[list[np.ndarray], list[int], int]:
    """The candidates as int64 arrays (an int64 array is taken as it is, without a copy), each question numbered in
    order of first appearance; ValueError for the first bad candidate. One range check over all tokens: the
    per-candidate checks run only to name the one that failed."""
    if len(candidates) == 0:
        raise ValueError("a plan needs at least one candidate")
    if len(groups) != len(candidates):
        raise ValueError(f"groups has {len(groups)} entries for {len(candidates)} candidates")
    seqs = token_arrays(candidates)
    if any(arr.ndim != 1 or arr.size == 0 for arr in seqs) or np.concatenate(seqs).min() < 0:
        for c, arr in enumerate(seqs):
            if arr.ndim != 1 or arr.size == 0:
                raise ValueError(f"candidate {c} must be a non-empty list of token ids")
            if arr.min() < 0:
                raise ValueError(f"candidate {c} has a negative token id")
    index: dict[int, int] = {}
    question_of = [index.setdefault(int(g), len(index)) for g in groups]
    return seqs, question_of, len(index)


def common_prefix_len(seqs: Sequence[np.ndarray]) -> int:
    first = seqs[0]
    common = len(first)
    for s in seqs[1:]:
        m = min(common, len(s))
        differ = np.flatnonzero(first[:m] != s[:m])
        common = int(differ[0]) if differ.size else m
    return common


def _build(
    kind, seqs, question_of, root_len, question_lens, device, chunk_size, pad_lens, arena, bucket, padding
) -> TreePlan:
    """The plan of checked candidates split at `root_len` / `question_lens`: its host arrays
    (`engine.plan_arrays.host_arrays`), its shape, an arena filled with the arrays, and the views over it."""
    device = torch.device(device)
    if padding is not None:
        pad_lens = (padding.dummy_rows,)  # the dummy node; its path and the further dummy paths are a bucket's
    pad = np.array(pad_lens, dtype=np.int64).reshape(-1).tolist()
    if min(pad, default=1) < 1:
        raise ValueError(f"padding sequences need at least one row each, got {pad}")
    host = host_arrays(seqs, question_of, root_len, question_lens, chunk_size, pad, padding, bucket)
    shape = _plan_shape(kind, chunk_size, host, len(pad))
    arena = _filled_arena(shape, host.arrays, device, arena)
    views, int32 = arena.views, arena.int32
    conv_inputs = {name: _conv_view(name, host, views, int32) for name in host.conv_bounds}
    return TreePlan(
        kind=kind,
        device=device,
        shape=shape,
        arena=arena,
        candidate_lens=tuple(len(s) for s in seqs),
        question_of=tuple(question_of),
        root_len=int(root_len),
        question_lens=tuple(int(n) for n in question_lens),
        leaf_lens=host.leaf_lens,
        padding_lens=tuple(pad),
        chunk_size=chunk_size,
        conv_taps=views["conv_taps"],
        path_cu_seqlens_cpu=torch.from_numpy(host.path_cu),
        token_ids=views["token_ids"],
        positions=views["positions"],
        row_node=views["row_node"],
        row_parent=views["row_parent"],
        row_grandparent=views["row_grandparent"],
        row_slot=views["row_slot"],
        path_rows=views["path_rows"],
        path_cu_seqlens=views["path_cu_seqlens"],
        read_rows=views["read_rows"],
        gdn={mode: _schedule_view(mode, host, views) for mode in host.calls},
        conv_paths=conv_inputs["conv_paths"],
        conv_segments=conv_inputs.get("conv_segments"),
        bucket=bucket,
        attention=NodeAttention(
            key_rows=views["attention.key_rows"],
            cu_seqlens_q=int32["attention.cu_seqlens_q"],
            cu_seqlens_k=int32["attention.cu_seqlens_k"],
            cu_seqlens_q_cpu=torch.from_numpy(host.attention_bounds[0]),
            cu_seqlens_k_cpu=torch.from_numpy(host.attention_bounds[1]),
            max_q=shape.attention_max[0],
            max_k=shape.attention_max[1],
            keys_are_rows=shape.keys_are_rows,
        ),
    )


def _plan_shape(kind: str, chunk_size: int, host: HostArrays, num_padding: int) -> PlanShape:
    calls = {
        mode: tuple(GdnCallShape(c.keep_final, c.has_init_state, c.rows_start, c.out_start) for c in facts)
        for mode, facts in host.calls.items()
    }
    return PlanShape(
        kind=kind,
        chunk_size=chunk_size,
        num_rows=host.num_rows,
        num_candidates=host.num_reads,
        num_padding=num_padding,
        arrays=tuple((name, a.shape) for name, a in host.arrays.items()),
        gdn=tuple(calls.items()),
        conv_flags=tuple(host.conv_flags.items()),
        attention_max=host.attention_max,
        keys_are_rows=host.keys_are_rows,
    )


def _filled_arena(
    shape: PlanShape,
    arrays: dict[str, np.ndarray],
    device: torch.device,
    arena: PlanArena | Callable[[PlanShape], PlanArena | None] | None,
) -> PlanArena:
    """The caller's arena (or the one its function returns for `shape`) refilled, or a new one: on the CPU over the
    host buffer itself (no copy), elsewhere filled by one copy."""
    if callable(arena):
        arena = arena(shape)
    if arena is None and device.type == "cpu":
        return PlanArena(shape, device, host=_host_buffer(arrays))
    if arena is None:
        arena = PlanArena(shape, device)
    elif arena.shape != shape:
        raise ValueError("the plan's shape differs from the arena's (another bucket: pad it, or use another arena)")
    arena.fill(arrays)
    return arena


def _schedule_view(mode: str, host: HostArrays, views: dict[str, torch.Tensor]) -> GdnSchedule:
    calls = []
    for i, facts in enumerate(host.calls[mode]):
        key = f"{mode}.{i}."
        calls.append(
            GdnCall(
                rows=views[key + "rows"],
                cu_seqlens=views[key + "cu_seqlens"],
                cu_seqlens_cpu=torch.from_numpy(facts.cu_seqlens),
                chunk_indices=views[key + "chunk_indices"],
                chunk_offsets=views[key + "chunk_offsets"],
                init_state=views.get(key + "init_state"),
                keep_final=facts.keep_final,
                out_slots=views[key + "out_slots"],
                out_rows=views[key + "out_rows"],
                start_positions=facts.start_positions,
                walk=views.get(key + "walk"),
                arena=GdnArena(*(views[f"{key}arena.{n}"] for n in ARENA_ARRAYS))
                if f"{key}arena.rows" in views
                else None,
                chunks=facts.chunks,
                rows_start=facts.rows_start,
                out_start=facts.out_start,
            )
        )
    return GdnSchedule(mode=mode, calls=tuple(calls))


def _conv_view(name: str, host: HostArrays, views: dict, int32: dict) -> ConvInput:
    rows_are_packed, keep_all, keep_rows_are_packed = host.conv_flags[name]
    return ConvInput(
        rows=views[f"{name}.rows"],
        cu_seqlens=views[f"{name}.cu_seqlens"],
        cu_seqlens_i32=int32[f"{name}.cu_seqlens"],
        cu_seqlens_cpu=torch.from_numpy(host.conv_bounds[name]),
        keep=views[f"{name}.keep"],
        keep_rows=views[f"{name}.keep_rows"],
        keep_rows_are_packed=keep_rows_are_packed,
        spaced=views[f"{name}.spaced"],
        spaced_keep=views[f"{name}.spaced_keep"],
        rows_are_packed=rows_are_packed,
        keep_all=keep_all,
    )
