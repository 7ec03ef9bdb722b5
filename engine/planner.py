"""The planner: a request's candidates in, the batches the engine backbone runs out, through one entry.

`Planner(config, device, vocab_size).plan(candidates, groups)` makes every decision about a request's rows, in this
order, and hands `EngineBackbone.forward` finished batches (`EngineRows`), so the backbone only runs plans:

1. tokens: each candidate as an int64 array, checked once (`reference.backbone.check_candidates`' errors);
2. batches: `flat` layouts take consecutive candidates while a batch holds at most `max_batch_rows` rows (a candidate
   is never split); `tree` takes the whole request where its tree holds at most `max_batch_rows` rows or it has one
   question, else whole questions per batch (`split_questions`); the tree's layout
   (`engine.plan.tree_layout`: root, question nodes, leaves) is computed once per batch;
3. GDN mode per batch: the config's `gdn_mode`, or the cost rule (`cheaper_gdn_mode`: `handoff` where the estimated
   chunks of work plus `GDN_CALL_COST_CHUNKS` per call are fewer than `replicated`'s), from the layout's sizes alone
   for `graphs` and from the built plan's schedules otherwise (equal: tests/test_plan_padding.py);
4. bucket (`graphs` only): the smallest bucket of the grid (`engine.graphs.GridIndex`) that holds a `replicated`
   batch; a batch in `handoff` mode or outside the grid keeps its plain tree plan and the reason (`eager_reason`);
5. arena fill: the batch's plan (`engine.plan.plan_tree` / `plan_flat`) with its index arrays in an arena on the
   backbone's device; a bucketed plan is built on the host (the captured graph's arena is filled from it at replay,
   `engine.graphs.CapturedGraph.run`; the backbone moves it to the device only where it runs eagerly);
6. attention `mask` only: each batch's additive bf16 mask (0 where the plan lets a row see a key, -inf elsewhere),
   rows padded to `MASK_ALIGN` in memory.

`batch_rows` and `queue_rows` weigh a batch of requests from the host-only layout without building a plan (what
`reference.service.DecisionModel.batch_requests` reads; equal to the plans' rows: tests/test_batching.py).
Every plan the planner builds is pinned bit for bit by tests/test_plan_golden.py (the plan functions) and by the
backbone's forward tests (tests/test_engine.py, tests/test_engine_tree.py, tests/test_plan_padding.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.graphs import GridIndex, default_grid
from engine.plan import (
    JoinedLayout,
    TreeLayout,
    TreePlan,
    check_inputs,
    common_prefix_len,
    plan_flat,
    plan_tree,
    prefix_summary,
    token_arrays,
    tree_layout,
)
from reference.backbone import check_candidates

MASK_ALIGN = 8  # attention-mask rows padded to 8 bf16 (16 bytes), as the CUDA SDPA kernels want

# Fixed cost of one GDN core call in units of 64-token chunks of one sequence (launch latency of FLA's ~6 kernels
# against their per-chunk work). 32 makes the two extra calls of `handoff` pay once replication would cost more
# than ~4096 extra tokens, the threshold open-jev-fast uses for its state path; calibrate with tests/test_gpu_tree.py.
GDN_CALL_COST_CHUNKS = 32


def gdn_mode_costs(plan: TreePlan, call_cost_chunks: float = GDN_CALL_COST_CHUNKS) -> dict[str, float]:
    """Estimated GDN core cost per mode: chunks of work plus a fixed cost per call."""
    return {mode: s.chunks + call_cost_chunks * len(s.calls) for mode, s in plan.gdn.items()}


def cheaper_gdn_mode(costs: dict[str, float]) -> str:
    """The cost rule: `handoff` where it is estimated cheaper than `replicated` (long shared prefixes, several
    branches). `costs` from `gdn_mode_costs` (a plan) or `engine.plan.TreeLayout.gdn_mode_costs` (its sizes alone)."""
    return "handoff" if costs["handoff"] < costs["replicated"] else "replicated"


def choose_gdn_mode(plan: TreePlan, call_cost_chunks: float = GDN_CALL_COST_CHUNKS) -> str:
    """The cost rule (`cheaper_gdn_mode`) on a plan's two schedules."""
    return cheaper_gdn_mode(gdn_mode_costs(plan, call_cost_chunks))


@dataclass
class RowBatch:
    """One batch: its row plan and what the forward reads besides it, all on the device (host fields marked; a
    bucketed `graphs` batch keeps its plan on the host)."""

    plan: TreePlan
    candidates: tuple[int, ...]  # host: the request index of each of the plan's candidates
    gdn_mode: str  # host: "replicated" or "handoff"
    attn_mask: Tensor | None  # [1, 1, N, N] bf16 additive (0 / -inf), 16-byte aligned rows; attention "mask" only
    eager_reason: str | None = None  # host, `graphs` only: why the batch has no bucket ("handoff", "outside grid")
    graph_hit: bool | None = None  # host, `graphs` only: whether the last forward replayed a graph (set by the run)


@dataclass
class EngineRows:
    """A request's candidates laid out in batches: what `Planner.plan` returns and the backbone's `forward` reads."""

    batches: list[RowBatch]
    num_candidates: int
    order: Tensor | None  # [C] int64: row of the batches' concatenated outputs holding candidate c; None: identity

    @property
    def rows_computed(self) -> int:
        """Packed rows of all batches: the rows every row-wise op (GEMMs, norms, MLP) runs over."""
        return sum(b.plan.num_rows for b in self.batches)

    @property
    def token_rows(self) -> int:
        """Rows of all batches that hold a candidate's token (the computed rows less the padding rows of a bucket or
        `pad_lens`): each shared token counted once; at most `logical_tokens`."""
        return sum(b.plan.token_rows for b in self.batches)

    @property
    def logical_tokens(self) -> int:
        """Tokens of all candidates (the rows of the unshared layout)."""
        return sum(b.plan.logical_tokens for b in self.batches)


def row_batch(plan: TreePlan, candidates: Iterable[int], gdn_mode: str | None, attention: str) -> RowBatch:
    """A plan's batch in `gdn_mode` (None: the cost rule on its schedules) with (attention "mask") its additive mask,
    on the plan's device."""
    mask = None
    if attention == "mask":
        n = plan.num_rows
        padded = math.ceil(n / MASK_ALIGN) * MASK_ALIGN
        mask = torch.full((n, padded), float("-inf"), dtype=torch.bfloat16, device=plan.device)
        rows = torch.arange(n, device=plan.device)
        mask[:, :n].masked_fill_(plan.visible(rows[:, None], rows[None, :]), 0.0)
        mask = mask[:, :n][None, None]
    return RowBatch(plan=plan, candidates=tuple(candidates), gdn_mode=gdn_mode or choose_gdn_mode(plan), attn_mask=mask)


class Planner:
    """The planning half of an `EngineConfig` (`layout`, `attention`, `gdn_mode`, `max_batch_rows`, `graphs`) on one
    device; `plan` is the entry (module docstring). `grid` is the bucket grid (`graphs`; empty otherwise) and
    `batch_max_rows` the rows of one batched forward (the grid's largest bucket on `graphs`)."""

    def __init__(self, config: EngineConfig, device: torch.device | str, vocab_size: int):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.tree = config.layout == "tree"
        self.attention = config.attention
        self.gdn_mode = None if config.gdn_mode == "cost" else config.gdn_mode
        self.max_batch_rows = config.max_batch_rows
        self.bucketed = config.graphs
        self.grid = GridIndex(default_grid()) if config.graphs else ()
        grid_rows = max((bucket.rows for bucket in self.grid), default=config.max_batch_rows)
        self.batch_max_rows = min(config.max_batch_rows, grid_rows)

    def plan(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> EngineRows:
        """The request's batches, each with its plan (arena on the device, or on the host where bucketed), GDN mode,
        bucket and mask, and the order that puts the batches' outputs back in candidate order."""
        arrays = self._token_arrays(candidates, groups)
        batches = [self._batch(arrays, groups, index, layout) for index, layout in self._batch_indices(arrays, groups)]
        flat_order = [c for batch in batches for c in batch.candidates]
        order = None
        if flat_order != list(range(len(arrays))):
            position = {c: i for i, c in enumerate(flat_order)}
            order = torch.tensor([position[c] for c in range(len(arrays))], device=self.device)
        return EngineRows(batches, len(arrays), order)

    def exact_batch(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> RowBatch | None:
        """The request's own unpadded tree plan as one batch on the device (the yardstick of the `graphs` targets),
        or None where the request takes several batches."""
        if len(split_questions(candidates, groups, self.max_batch_rows)) > 1:
            return None
        plan = plan_tree(candidates, groups, device=self.device)
        return row_batch(plan, range(len(candidates)), self.gdn_mode, self.attention)

    def batch_rows(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> int | None:
        """The rows one forward over these candidates computes, from the host-only layout (no plan is built): the
        prefix tree's packed rows (`tree`), the tokens (flat layouts), or the rows of the smallest bucket that holds
        the batch (`graphs`; None where the cost rule picks hand-off or no bucket holds it: the batch would run
        eagerly). What `DecisionModel.batch_requests` weighs a batch of requests by."""
        if not self.tree:
            return sum(len(ids) for ids in candidates)
        return self._layout_rows(tree_layout(candidates, groups))

    def queue_rows(
        self, requests: Iterable[tuple[Sequence[Sequence[int]], Sequence[int]]]
    ) -> Iterator[tuple[int | None, int | None]]:
        """For each (candidates, groups) of a queue, in order: its `batch_rows` alone, and the `batch_rows` of the
        queue up to it answered as one batch (`reference.service.batch_inputs` order). Lazy and linear in the queue:
        each request's tokens are read once (`engine.plan.prefix_summary`) and each prefix's layout is joined from the
        summaries (`engine.plan.JoinedLayout`), where calling `batch_rows` per prefix reads every token of the
        prefix again. Equal to those calls: tests/test_batching.py."""
        if not self.tree:
            total = 0
            for candidates, _ in requests:
                own = sum(len(ids) for ids in candidates)
                total += own
                yield own, total
            return
        joined = JoinedLayout()
        for candidates, groups in requests:
            summary = prefix_summary(candidates, groups)
            yield self._layout_rows(summary.layout()), self._layout_rows(joined.add(summary))

    def _layout_rows(self, layout: TreeLayout) -> int | None:
        if not self.bucketed:
            return layout.rows
        bucket = self.grid.smallest(layout) if self._layout_mode(layout) == "replicated" else None
        return None if bucket is None else bucket.rows

    def _layout_mode(self, layout: TreeLayout) -> str:
        return self.gdn_mode or cheaper_gdn_mode(layout.gdn_mode_costs(GDN_CALL_COST_CHUNKS))

    def _token_arrays(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> list[np.ndarray]:
        """The candidates as int64 arrays, converted once per request (the plan functions take int64 arrays without
        converting them again), checked as `check_candidates` checks them: one range check over all tokens, and
        `check_candidates` itself where anything fails (it raises the error of the first bad candidate); ids that
        are not integers are refused as the plan functions refuse them (`engine.plan.token_arrays`)."""
        if len(candidates) == 0 or len(groups) != len(candidates):
            check_candidates(candidates, groups, self.vocab_size)
        try:
            arrays = [np.asarray(ids) for ids in candidates]
        except (TypeError, ValueError, OverflowError):  # not token ids: the reference check's error
            check_candidates(candidates, groups, self.vocab_size)
            raise
        if any(a.ndim != 1 or a.size == 0 for a in arrays):
            check_candidates(candidates, groups, self.vocab_size)
        arrays = token_arrays(arrays)
        tokens = np.concatenate(arrays)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            check_candidates(candidates, groups, self.vocab_size)
        return arrays

    def _batch_indices(
        self, candidates: list[np.ndarray], groups: Sequence[int]
    ) -> list[tuple[list[int], TreeLayout | None]]:
        """(candidate indices, `tree_layout` or None where not yet known) per batch (module docstring, step 2). A
        request whose whole tree holds at most `max_batch_rows` rows (or that has one question) is one batch, since
        a batch's rows grow with every question added (`split_questions`): its layout, computed to see that, is the
        batch's."""
        if not self.tree:
            lengths = [len(ids) for ids in candidates]
            return [(index, None) for index in _consecutive_batches(lengths, self.max_batch_rows)]
        whole = tree_layout(candidates, groups)
        if whole.rows <= self.max_batch_rows or len(whole.question_lens) == 1:
            return [(list(range(len(candidates))), whole)]
        return [(index, None) for index in split_questions(candidates, groups, self.max_batch_rows)]

    def _batch(
        self, candidates: list[np.ndarray], groups: Sequence[int], index: list[int], layout: TreeLayout | None
    ) -> RowBatch:
        """One batch's plan, GDN mode, bucket and mask (module docstring, steps 3-6)."""
        own, own_groups = [candidates[c] for c in index], [groups[c] for c in index]
        if not self.bucketed:
            if self.tree:
                plan = plan_tree(own, own_groups, device=self.device, layout=layout)
            else:
                plan = plan_flat(own, own_groups, device=self.device)
            return row_batch(plan, index, self.gdn_mode, self.attention)
        if layout is None:
            layout = tree_layout(own, own_groups)
        mode = self._layout_mode(layout)
        bucket = self.grid.smallest(layout) if mode == "replicated" else None
        if bucket is None:
            plan = plan_tree(own, own_groups, device=self.device, layout=layout)
            reason = "handoff" if mode == "handoff" else "outside grid"
            return RowBatch(plan, tuple(index), mode, None, eager_reason=reason)
        plan = plan_tree(own, own_groups, device="cpu", bucket=bucket, layout=layout)
        return RowBatch(plan, tuple(index), "replicated", None)


def split_questions(candidates: Sequence[Sequence[int]], groups: Sequence[int], max_rows: int) -> list[list[int]]:
    """Batches of whole questions: candidate indices per batch (ascending), each batch to be planned on its own.

    Questions are taken in order of first appearance and added to the current batch while its prefix tree would hold
    at most `max_rows` packed rows; a question whose own tree is larger forms a batch alone (never split). The rows of
    a tree over questions r with n_r candidates: root + sum_r (E_r - root) + sum_c (len_c - E_r(c)), where E_r is the
    end of question r's node (min(lcp of its candidates, its shortest - 1)) and root = min(lcp of all, shortest - 1),
    so it is updated per question from the lcp of the new question's first candidate with the batch's first.
    Adding question q to a set S of questions (root -> root' <= root) adds (root - root')(|S| - 1) + (E_q - root') +
    sum_{c in q} (len_c - E_q) >= 1 rows (E_q >= root', each leaf holds a row): rows grow with every question, so a
    request whose whole tree holds at most `max_rows` rows is one batch of every candidate (what
    `Planner.plan` reads from the request's `tree_layout` without splitting).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    seqs, question_of, num_questions = check_inputs(candidates, groups)
    if num_questions == 1:  # one batch, whatever its rows
        return [list(range(len(seqs)))]
    members: list[list[int]] = [[] for _ in range(num_questions)]
    for c, r in enumerate(question_of):
        members[r].append(c)
    batches: list[list[int]] = []
    state = None  # (anchor, lcp of all, shortest, questions, sum_r E_r (1 - n_r), sum of lengths) of the open batch
    for own in members:
        own_seqs = [seqs[c] for c in own]
        shortest = min(len(q) for q in own_seqs)
        own_lcp = common_prefix_len(own_seqs)
        end = min(own_lcp, shortest - 1)
        own_terms = (end * (1 - len(own)), sum(len(q) for q in own_seqs))
        if state is not None:
            anchor, lcp_all, short_all, count, ends, lengths = state
            lcp_new = min(lcp_all, own_lcp, common_prefix_len([anchor, own_seqs[0]]))
            short_new = min(short_all, shortest)
            root = min(lcp_new, short_new - 1)
            rows = root * (1 - count - 1) + ends + own_terms[0] + lengths + own_terms[1]
            if rows <= max_rows:
                batches[-1] += own
                state = (anchor, lcp_new, short_new, count + 1, ends + own_terms[0], lengths + own_terms[1])
                continue
        batches.append(list(own))
        state = (own_seqs[0], own_lcp, shortest, 1, *own_terms)
    return [sorted(batch) for batch in batches]


def _consecutive_batches(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """Consecutive candidates per batch while the batch holds at most `max_rows` rows (one candidate may exceed it)."""
    batches: list[list[int]] = [[]]
    rows = 0
    for c, n in enumerate(lengths):
        if batches[-1] and rows + n > max_rows:
            batches.append([])
            rows = 0
        batches[-1].append(c)
        rows += n
    return batches
