"""Exact plan arrays (engine/plan.py) on the CPU: what the host-side planner must keep bit for bit.

The planner builds every index array from the node table with vectorized gathers (module docstring of engine/plan.py
for the layout); these tests pin its output so that a faster or restructured planner cannot drift:
* a small tree request written out by hand: every row array, the paths, the representative slots, the conv windows
  and both conv layouts, the node attention and both GDN schedules (chunk size 2, so the hand-off has a root call and
  states handed to the leaves);
* a bucketed plan written out by hand: the dummy node, the dummy paths, trailing slots and keys, rowless nodes;
* the representative slot is the first occurrence of each row in the paths (what the replicated call produces from);
* digests of every array of the plans of four JevBench-sized requests (tree, flat, `pad_lens`, bucketed at the
  bucket commit 2b0f72d's grid chose for each, pinned in `PINNED_BUCKETS`; the values at commit 2b0f72d, whose
  planner the vectorized one replaced); arrays added since (`NEW_ARRAYS`: the replicated call's tree walk, and the
  conv windows as an arena array, `conv_taps`, which the pins above hash as the host `conv_rows` they were then) are
  left out of those digests and pinned on their own (`NEW_ARRAY_DIGESTS`, `NEW_ARRAY_SWEEP_DIGEST`);
* the replicated call's hand-off arena (FlashInfer's two calls) by hand on both plans above, and on every plan below
  against its definition (`check_arena`); it is in no digest;
* one digest over every plan of 120 generated requests (tree, flat, `pad_lens`, bucketed: empty roots and question
  nodes, interleaved questions, one-token leaves, chunk sizes 2, 16 and 64), pinned at commit 35ca3d3's planner (the
  one before `_build` took fewer numpy calls);
* `plan_tree(..., layout=...)` gives the plan it builds itself and refuses another request's layout;
  `smallest_bucket` (and the backbone's `GridIndex`) is the minimum by (rows, slots, sequences) of the fitting
  buckets, whatever the grid's order; one- and two-candidate requests take the buckets of their own candidate class.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import numpy as np
import pytest
import torch

from engine.graphs import GridIndex, default_grid, grid_bucket, smallest_bucket
from engine.plan import Bucket, TreePlan, bucket_padding, plan_flat, plan_tree, tree_layout


def arrays_of(plan: TreePlan) -> dict[str, torch.Tensor]:
    """Every array a plan carries: the arena's views and int32 copies, and the host tensors."""
    out = {name: plan.arena.views[name] for name, _ in plan.shape.arrays}
    out |= {f"int32.{name}": t for name, t in plan.arena.int32.items()}
    out["conv_rows"], out["path_cu_seqlens_cpu"] = plan.conv_taps.cpu(), plan.path_cu_seqlens_cpu  # its old name
    for mode, schedule in plan.gdn.items():
        for i, call in enumerate(schedule.calls):
            out[f"{mode}.{i}.cu_seqlens_cpu"] = call.cu_seqlens_cpu
    for name in ("conv_paths", "conv_segments"):
        if getattr(plan, name) is not None:
            out[f"{name}.cu_seqlens_cpu"] = getattr(plan, name).cu_seqlens_cpu
    out["attention.cu_seqlens_q_cpu"] = plan.attention.cu_seqlens_q_cpu
    out["attention.cu_seqlens_k_cpu"] = plan.attention.cu_seqlens_k_cpu
    return out


def digest(plan: TreePlan, *, new_arrays: bool = False) -> str:
    """sha256 over the plan's shape, host facts and every array (name, dtype, shape, bytes); 16 hex digits. Without
    `new_arrays`, the arrays added after the pins below were taken (`NEW_ARRAYS`) are left out of the shape and the
    arrays, so the pins keep checking every older array bit for bit; with it, only those arrays are hashed."""

    def pinned(name: str) -> bool:
        if ".arena." in name:  # the hand-off arena: by hand and by its invariants (`check_arena`), in no digest
            return False
        return name.rsplit(".", 1)[-1] in NEW_ARRAYS if new_arrays else name.rsplit(".", 1)[-1] not in NEW_ARRAYS

    if new_arrays:
        h = hashlib.sha256()
        for name, t in arrays_of(plan).items():
            if pinned(name):
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]
    shape = dataclasses.replace(plan.shape, arrays=tuple(a for a in plan.shape.arrays if pinned(a[0])))
    h = hashlib.sha256(repr(shape).encode())
    host = (plan.candidate_lens, plan.question_of, plan.root_len, plan.question_lens, plan.leaf_lens)
    h.update(repr((host, plan.padding_lens, plan.bucket)).encode())
    for mode, schedule in plan.gdn.items():
        h.update(
            repr([(mode, c.start_positions, c.chunks, c.rows_start, c.out_start) for c in schedule.calls]).encode()
        )
    for name, t in arrays_of(plan).items():
        if pinned(name):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def as_list(t: torch.Tensor) -> list:
    return t.tolist()


def test_tree_plan_by_hand():
    """Root [1, 2]; question 0 holds [3] (candidates 0, 1), question 1 nothing (candidate 2); leaves [4], [5, 6],
    [7]."""
    plan = plan_tree([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]], [0, 0, 1], chunk_size=2)
    assert (plan.root_len, plan.question_lens, plan.leaf_lens) == (2, (1, 0), (1, 2, 1))
    assert as_list(plan.token_ids) == [1, 2, 3, 4, 5, 6, 7]
    assert as_list(plan.positions) == [0, 1, 2, 3, 3, 4, 2]
    assert as_list(plan.row_node) == [0, 0, 1, 3, 4, 4, 5]  # node 2 (question 1) is empty
    assert as_list(plan.row_parent) == [-1, -1, 0, 1, 1, 1, 2]
    assert as_list(plan.row_grandparent) == [-1, -1, -1, 0, 0, 0, 0]
    assert as_list(plan.path_rows) == [0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1, 6]
    assert as_list(plan.path_cu_seqlens) == as_list(plan.path_cu_seqlens_cpu) == [0, 4, 9, 12]
    assert as_list(plan.row_slot) == [0, 1, 2, 3, 7, 8, 11]
    assert as_list(plan.read_rows) == [3, 5, 6]
    z = 7  # the zero row
    conv = [[z, z, z, 0], [z, z, 0, 1], [z, 0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [1, 2, 4, 5], [z, 0, 1, 6]]
    assert as_list(plan.conv_taps) == conv

    paths = plan.conv_paths
    assert as_list(paths.rows) == as_list(plan.path_rows) and as_list(paths.cu_seqlens) == [0, 4, 9, 12]
    assert as_list(paths.keep) == list(range(12)) and as_list(paths.keep_rows) == as_list(plan.path_rows)
    assert as_list(paths.spaced) == [0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 1, 2, 3, 5, 6, 0, 0, 0, 1, 2, 7]
    assert as_list(paths.spaced_keep) == [3, 4, 5, 6, 10, 11, 12, 13, 14, 18, 19, 20]
    assert (paths.rows_are_packed, paths.keep_all, paths.keep_rows_are_packed) == (False, True, False)
    segments = plan.conv_segments  # each non-empty node after its (up to 3) history rows
    assert as_list(segments.rows) == [0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1, 6]
    assert as_list(segments.cu_seqlens) == as_list(segments.cu_seqlens_i32) == [0, 2, 5, 9, 14, 17]
    assert as_list(segments.keep) == [0, 1, 4, 8, 12, 13, 16] and as_list(segments.keep_rows) == list(range(7))
    assert (segments.rows_are_packed, segments.keep_all, segments.keep_rows_are_packed) == (False, False, True)

    a = plan.attention  # nodes root, question 0, leaves 0-2
    assert as_list(a.cu_seqlens_q) == as_list(a.cu_seqlens_q_cpu) == [0, 2, 3, 4, 6, 7]
    assert as_list(a.cu_seqlens_k) == as_list(a.cu_seqlens_k_cpu) == [0, 2, 5, 9, 14, 17]
    assert as_list(a.key_rows) == [0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1, 6]
    assert (a.max_q, a.max_k, a.keys_are_rows) == (2, 5, False)

    (replicated,) = plan.gdn["replicated"].calls
    assert as_list(replicated.rows) == as_list(plan.path_rows) and replicated.init_state is None
    assert as_list(replicated.out_slots) == [0, 1, 2, 3, 7, 8, 11] and as_list(replicated.out_rows) == list(range(7))
    assert as_list(replicated.chunk_offsets) == [0, 2, 5, 7] and replicated.chunks == 7
    assert as_list(replicated.chunk_indices) == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1]]
    root, leaves = plan.gdn["handoff"].calls  # A0 = 2; no question node crosses a further boundary
    assert as_list(root.rows) == [0, 1] and root.keep_final and root.init_state is None and root.out_start == (0, 0)
    assert as_list(leaves.rows) == [2, 3, 2, 4, 5, 6] and as_list(leaves.cu_seqlens_cpu) == [0, 2, 5, 6]
    assert as_list(leaves.init_state) == [1, 1, 1] and leaves.start_positions == (2, 2, 2)
    assert as_list(leaves.out_slots) == [0, 1, 3, 4, 5] and as_list(leaves.out_rows) == [2, 3, 4, 5, 6]
    assert (leaves.rows_start, leaves.out_start) == (None, None)
    # the tree walk of the replicated call: candidate 0 publishes at A0 (1 chunk) in slot 0, the others start there
    assert as_list(replicated.walk) == [[0, 0, -1, 1, 0, 0, 0, 3], [1, 1, 0, 0, 0, 0, 0, 3], [2, 1, 0, 0, 0, 0, 0, 3]]
    assert leaves.walk is None and root.walk is None
    # the hand-off arena: candidate 0's rows [0, A0 = 2), then each candidate from A0 (the rest: the last path row)
    arena = replicated.arena
    assert as_list(arena.rows) == [0, 1, 2, 3, 2, 4, 5, 6, 6, 6, 6, 6] and as_list(arena.cu_seqlens) == [0, 2, 4, 7, 8]
    assert as_list(arena.states) == [-1, 0, 0, 0, 0, -1, -1, -1] and as_list(arena.out_slots) == [0, 1, 2, 3, 5, 6, 7]
    assert as_list(arena.gathered) == [10]  # the 8 arena slots and a chunk (2) after them
    assert root.arena is None and leaves.arena is None


def test_bucketed_plan_by_hand():
    """One candidate of one token in a bucket of 4 rows: a dummy node of 3 rows, dummy paths of 3 and 1 slots."""
    bucket = Bucket(rows=4, slots=10, sequences=3, chunks=3, nodes=4, keys=8, candidates=2, max_q=4, max_k=4)
    padding = bucket_padding(tree_layout([[1]], [0]), bucket)
    assert (padding.dummy_rows, padding.path_lens, padding.trailing_slots) == (3, (3, 1), 5)
    assert (padding.empty_nodes, padding.trailing_keys, padding.extra_reads) == (2, 4, 1)
    plan = plan_tree([[1]], [0], bucket=bucket)
    assert as_list(plan.token_ids) == [1, 0, 0, 0] and as_list(plan.positions) == [0, 0, 1, 2]
    assert as_list(plan.row_node) == [2, 3, 3, 3]
    assert as_list(plan.row_parent) == [1, -1, -1, -1] and as_list(plan.row_grandparent) == [0, -1, -1, -1]
    assert as_list(plan.path_rows) == [0, 1, 2, 3, 1, 3, 3, 3, 3, 3]  # dummy paths, then the trailing slots
    assert as_list(plan.path_cu_seqlens) == [0, 1, 4, 5]
    assert as_list(plan.row_slot) == [0, 1, 2, 3] and as_list(plan.read_rows) == [0, 3]
    assert as_list(plan.conv_taps) == [[4, 4, 4, 0], [4, 4, 4, 1], [4, 4, 1, 2], [4, 1, 2, 3]]
    paths = plan.conv_paths
    assert as_list(paths.spaced) == [0, 0, 0, 1, 0, 0, 0, 2, 3, 4, 0, 0, 0, 2, 4, 4, 4, 4, 4]
    assert as_list(paths.spaced_keep) == [3, 7, 8, 9, 13, 14, 15, 16, 17, 18]
    assert plan.conv_segments is None and list(plan.gdn) == ["replicated"]
    a = plan.attention
    assert as_list(a.key_rows) == [0, 1, 2, 3, 3, 3, 3, 3]
    assert as_list(a.cu_seqlens_q) == [0, 1, 4, 4, 4] and as_list(a.cu_seqlens_k) == [0, 1, 4, 4, 4]
    assert (a.max_q, a.max_k) == (4, 4)
    (call,) = plan.gdn["replicated"].calls
    assert as_list(call.out_slots) == [0, 1, 2, 3] and as_list(call.chunk_indices) == [[0, 0], [1, 0], [2, 0]]
    assert as_list(call.walk) == [[0, 0, -1, 0, 0, 0, 0, 1], [1, -1, -1, 0, 0, 0, 0, 1], [2, -1, -1, 0, 0, 0, 0, 1]]
    assert (call.rows_start, call.out_start) == (None, None)
    # no shared rows (A0 = 0): the candidate and the dummy node's path from the zero state; the other dummy path empty
    arena = call.arena
    assert as_list(arena.rows) == [0, 1, 2, 3, 3, 3, 3, 3, 3, 3] and as_list(arena.cu_seqlens) == [0, 0, 1, 4, 4]
    assert as_list(arena.states) == [-1, 0, -1, -1, -1, -1, -1, -1] and as_list(arena.out_slots) == [0, 1, 2, 3]
    assert as_list(arena.gathered) == [10]  # 4 and a chunk of 64, capped at the 10 slots


def check_arena(plan: TreePlan) -> None:
    """The replicated call's hand-off arena (`engine.plan_arrays._handoff_arena`) against its definition: call 1 is
    candidate 0's first A0 slots; call 2's sequences are the paths that hold a representative slot, in path order,
    each from A0 (candidates) or 0 (dummy sequences), then empty ones up to the bucket's candidates and dummy node; each
    packed row produced by a slot that holds it; reads from pool row 0 exactly for candidates where A0 > 0."""
    call = plan.gdn["replicated"].calls[0]
    arena, path_cu = call.arena, plan.path_cu_seqlens_cpu.tolist()
    rows, cu, states = arena.rows.tolist(), arena.cu_seqlens.tolist(), arena.states.tolist()
    num_cands, row_slot = len(plan.candidate_lens), plan.row_slot.tolist()
    producing = [p for p in range(len(path_cu) - 1) if any(path_cu[p] <= s < path_cu[p + 1] for s in row_slot)]
    sequences = len(cu) - 2
    assert sequences == (len(producing) if plan.bucket is None else plan.bucket.candidates + 1)
    a0 = cu[1]
    shared = plan.root_len + (plan.question_lens[0] if len(plan.question_lens) == 1 else 0)
    assert a0 == shared // plan.chunk_size * plan.chunk_size and len(rows) == len(plan.path_rows)
    path_rows = plan.path_rows.tolist()
    assert rows[:a0] == path_rows[:a0] and states[:2] == [-1, 0] and len(states) == 2 + 2 * sequences
    for i in range(sequences):
        piece = rows[cu[i + 1] : cu[i + 2]]
        if i < len(producing):
            p = producing[i]
            start = a0 if p < num_cands else 0
            assert piece == path_rows[path_cu[p] + start : path_cu[p + 1]] and piece, (i, p)
            assert states[2 + i] == (0 if p < num_cands and a0 > 0 else -1)
        else:
            assert piece == [] and states[2 + i] == -1
        assert states[2 + sequences + i] == -1
    assert producing[:num_cands] == list(range(num_cands))  # every candidate runs
    assert cu[-1] <= len(rows) and all(r == rows[-1] for r in rows[cu[-1] :])
    assert arena.rows[arena.out_slots].tolist() == list(range(plan.num_rows))
    assert (arena.out_slots < cu[-1]).all() and arena.gathered.tolist() == [min(len(rows), cu[-1] + plan.chunk_size)]


def jevbench_like(seed: int, options: int, questions: int = 1) -> tuple[list[list[int]], list[int]]:
    """A chat-templated request: a shared state of 40-120 tokens, question texts, options of 1-12 tokens."""
    rng = random.Random(seed)
    state = [rng.randrange(100, 150_000) for _ in range(rng.randrange(40, 120))]
    candidates, groups = [], []
    for r in range(questions):
        question = [rng.randrange(100, 150_000) for _ in range(rng.randrange(5, 30))]
        for _ in range(options):
            option = [rng.randrange(100, 150_000) for _ in range(rng.randrange(1, 12))]
            candidates.append([151644, 872] + state + question + option + [151645, 198])
            groups.append(r)
    return candidates, groups


REQUESTS = {"one option": (1, 1, 1), "five options": (2, 5, 1), "six options": (3, 6, 1), "three questions": (4, 3, 3)}
PINNED_BUCKETS = {  # (rows, slot factor, candidates) of the bucket each request was pinned at (the grid of 2b0f72d)
    "one option": (96, 1, 8),
    "five options": (112, 5, 8),
    "six options": (128, 5, 8),
    "three questions": (288, 5, 16),
}
DIGESTS = {  # per request: tree, flat, tree with pad_lens (3, 64, 65), bucketed (at commit 2b0f72d's planner)
    "one option": ("cc7655aea0da3b17", "ea21104de18f2ab6", "12bf26501ad399e6", "1b9f8ef0a9db57fe"),
    "five options": ("30b888beb03a457b", "33ab18a2e95fdd4e", "221bdf9f39e06ba3", "f2957fa546a4306c"),
    "six options": ("76dba8a3a9cd7f4f", "56ffb534d0c9ba61", "95b4deee70b84b21", "6bccc6ca94e69144"),
    "three questions": ("68b9f67329754ed8", "e311e2232ada9c90", "0d84f371e7dc821b", "41d9256423bb638e"),
}


SWEEP_REQUESTS = 120
SWEEP_DIGEST = "01197b00e64d1673"  # at commit 35ca3d3's planner (the one before fewer numpy calls per plan)
NEW_ARRAYS = ("walk", "conv_taps")  # added after the pins above: the tree walk, the prep kernel's conv windows
NEW_ARRAY_DIGESTS = {  # the NEW_ARRAYS alone, per request as DIGESTS (at the commit that added the walk's column 7)
    "one option": ("943860a65f4f324d", "943860a65f4f324d", "45f489326c0a535a", "8c4fc776163042a0"),
    "five options": ("a18ee033b60e703d", "0e5facd72810f002", "541ae7fb441526ac", "024cf7108497cdb8"),
    "six options": ("cb57910a2dd65653", "45deafe63a2eab7a", "7e698f22459aabc1", "6bc767b7b2247905"),
    "three questions": ("7eab39d39dbf3919", "3b7e9c42cb5e3358", "a6b562a73b450885", "117f1fef85e5cd02"),
}
# The NEW_ARRAYS of the sweep's plans (at the commit that added the walk's column 7, the count of sequences that run;
# two commits after the one that ordered the walk's dummy paths last: the per-sequence columns of all 495 walks as
# before, the run order changed in 86).
NEW_ARRAY_SWEEP_DIGEST = "cbbbcf45502a89f3"


def generated_request(seed: int) -> tuple[list[list[int]], list[int], int, tuple[int, ...]]:
    """A request of the sweep: a state of 0-130 tokens (0: an empty root), 1-5 questions interleaved in candidate
    order under sparse group ids, question texts of 0-20 tokens (0: empty question nodes), 1-8 options of 1-65 tokens
    from a 3-token vocabulary (options that are prefixes of each other, one-token leaves); a chunk size and pad_lens."""
    rng = random.Random(seed)
    state = [rng.randrange(100, 150_000) for _ in range(rng.choice([0, 1, 5, 40, 130]))]
    questions = rng.choice([1, 1, 2, 3, 5])
    texts = [[rng.randrange(100, 150_000) for _ in range(rng.choice([0, 1, 3, 20]))] for _ in range(questions)]
    candidates, groups = [], []
    for r in range(questions):
        for _ in range(rng.choice([1, 2, 4, 6, 8])):
            option = [rng.randrange(1, 4) for _ in range(rng.choice([1, 1, 2, 5, 30, 65]))]
            candidates.append(state + texts[r] + option)
            groups.append(7 * r + 3)
    order = list(range(len(candidates)))
    rng.shuffle(order)
    pad_lens = tuple(rng.randrange(1, 100) for _ in range(rng.randrange(1, 4)))
    return [candidates[c] for c in order], [groups[c] for c in order], rng.choice([2, 16, 64]), pad_lens


def test_plan_digests_on_generated_requests():
    """The digests of every plan (tree, flat, `pad_lens`, bucketed at the smallest grid bucket) of 120 generated
    requests, hashed together: the planner's output on many shapes (empty roots and question nodes, interleaved
    questions, one-token leaves, three chunk sizes), pinned at the planner before the current one. And the tree
    walk's run order (`engine.plan_arrays._tree_walk`, column 0) on each: every dummy path (start -1: no chunk
    computed) after every real sequence, so the kernel's tickets reach the readers first, and column 7 the count of
    those that run in every row (the kernel ends the groups after them at their ticket)."""
    grid = sorted(default_grid(), key=lambda b: (b.rows, b.slots, b.sequences))
    h, walks = hashlib.sha256(), hashlib.sha256()
    dummies_seen = 0
    for seed in range(SWEEP_REQUESTS):
        candidates, groups, chunk_size, pad_lens = generated_request(seed)
        plans = [
            plan_tree(candidates, groups, chunk_size=chunk_size),
            plan_flat(candidates, groups, chunk_size=chunk_size),
            plan_tree(candidates, groups, chunk_size=chunk_size, pad_lens=pad_lens),
        ]
        bucket = smallest_bucket(tree_layout(candidates, groups), grid)
        if bucket is not None:
            plans.append(plan_tree(candidates, groups, bucket=bucket))
        for plan in plans:
            h.update(digest(plan).encode())
            walks.update(digest(plan, new_arrays=True).encode())
            check_arena(plan)
            walk = plan.gdn["replicated"].calls[0].walk
            if walk is not None:
                walk = walk.numpy()
                dummy = walk[walk[:, 0], 1] < 0  # in run order
                assert not (dummy[:-1] & ~dummy[1:]).any(), (seed, walk[:, 0].tolist())
                assert (walk[:, 7] == (~dummy).sum()).all()  # the sequences that run: the kernel ends the later groups
                dummies_seen += int(dummy.sum())
    assert h.hexdigest()[:16] == SWEEP_DIGEST
    assert walks.hexdigest()[:16] == NEW_ARRAY_SWEEP_DIGEST
    assert dummies_seen > 0


@pytest.mark.parametrize("name", REQUESTS)
def test_plan_digests(name):
    candidates, groups = jevbench_like(*REQUESTS[name])
    bucket = grid_bucket(*PINNED_BUCKETS[name])
    plans = (
        plan_tree(candidates, groups),
        plan_flat(candidates, groups),
        plan_tree(candidates, groups, pad_lens=(3, 64, 65)),
        plan_tree(candidates, groups, bucket=bucket),
    )
    for plan in plans:  # the representative slot is each row's first occurrence in the paths
        _, first = np.unique(plan.path_rows.numpy(), return_index=True)
        assert np.array_equal(plan.row_slot.numpy(), first)
        assert np.array_equal(plan.gdn["replicated"].calls[0].out_slots.numpy(), first)
        check_arena(plan)
    assert tuple(digest(plan) for plan in plans) == DIGESTS[name]
    assert tuple(digest(plan, new_arrays=True) for plan in plans) == NEW_ARRAY_DIGESTS[name]


def test_plan_tree_takes_the_callers_layout():
    candidates, groups = jevbench_like(4, 3, 3)
    layout = tree_layout(candidates, groups)
    bucket = smallest_bucket(layout, default_grid())
    assert digest(plan_tree(candidates, groups, layout=layout)) == digest(plan_tree(candidates, groups))
    with_layout = plan_tree(candidates, groups, bucket=bucket, layout=layout)
    assert digest(with_layout) == digest(plan_tree(candidates, groups, bucket=bucket))
    with pytest.raises(ValueError, match="another request's"):
        plan_tree(candidates[:-1], groups[:-1], layout=layout)
    with pytest.raises(ValueError, match="another request's"):
        plan_tree(candidates, groups, layout=layout, chunk_size=32)


def test_smallest_bucket_is_the_minimum_in_any_grid_order():
    grid = list(default_grid())
    random.Random(0).shuffle(grid)
    index = GridIndex(grid)
    for seed, options, questions in [(5, 1, 1), (9, 2, 1), (10, 4, 1), (6, 6, 1), (7, 8, 2), (11, 5, 3), (8, 40, 1)]:
        layout = tree_layout(*jevbench_like(seed, options, questions))
        fitting = [b for b in grid if bucket_padding(layout, b) is not None]
        want = min(fitting, key=lambda b: (b.rows, b.slots, b.sequences)) if fitting else None
        assert (
            smallest_bucket(layout, grid) == want == smallest_bucket(layout, default_grid()) == index.smallest(layout)
        )
        assert (want is None) == (options > 32), "only the 40-option request is outside the grid"
        if options * questions <= 2:  # slots <= candidates x rows: the own candidate class holds them
            assert want.candidates == options * questions
