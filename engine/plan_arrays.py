"""The host index arrays of a row plan (numpy, int64): what `engine.plan.plan_tree` and `plan_flat` fill an arena
with. The layout they encode is documented in engine/plan.py (module docstring: nodes, paths, padding, buckets); this
module builds the arrays from a request's split, in these steps:

1. `_node_table`: one column per node (root, question nodes, leaves, dummy sequences) of its rows, first position,
   representative path, grandparent, parent and id; packed rows are the nodes' rows in id order;
2. `_rows`: per packed row its node, position, parent, grandparent and token id (a node's tokens are a slice of its
   representative candidate; dummy rows hold `PAD_TOKEN_ID`);
3. `_paths`: the node-wise attention's key rows (a node's path up to its last row) and every candidate's path, which
   is a slice of those keys (a leaf's keys are its path), then a bucket's dummy paths, trailing slots and read rows;
4. `_slots_and_windows`: each row's representative slot (its first occurrence in the paths) and its conv window;
5. `_conv_layouts` and `_attention_counts`: the conv input layouts (`ConvInput`) and the attention's sequence bounds;
6. `_schedules`: the GDN calls of the `replicated` and (unpadded plans) `handoff` modes, with FLA's chunk layout, and
   the replicated call's tree walk (`_tree_walk`) and hand-off arena (`_handoff_arena`).

Every array is a function of the request's split and the padding alone, built with a few vectorized numpy calls per
array, not per row (engine/plan.py, "Host cost"); the plan digests of tests/test_plan_golden.py pin every array bit for
bit. Assertions check the two invariants the forward relies on: a representative slot holds its row, and the hand-off
schedule produces every packed row exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONV_WIDTH = 4  # GDN causal depthwise convolution width (linear_conv_kernel_dim)
PAD_TOKEN_ID = 0  # token of the dummy rows (`pad_lens`); its value reaches no real row
CALL_ARRAYS = ("rows", "cu_seqlens", "chunk_indices", "chunk_offsets", "init_state", "out_slots", "out_rows", "walk")
ARENA_ARRAYS = (
    "rows",
    "cu_seqlens",
    "states",
    "out_slots",
    "gathered",
)  # the replicated call's hand-off arena, `arena.<name>`
CONV_ARRAYS = ("rows", "cu_seqlens", "keep", "keep_rows", "spaced", "spaced_keep")


@dataclass(frozen=True)
class CallFacts:
    """The host facts of one GDN call that a launch reads (engine.plan.GdnCallShape) and its host copies."""

    keep_final: bool
    has_init_state: bool
    rows_start: int | None  # rows == arange(rows_start, ...), else None (a bucket always gathers)
    out_start: tuple[int, int] | None  # (first slot, first row) when out_slots and out_rows are both contiguous
    cu_seqlens: np.ndarray
    start_positions: tuple[int, ...]
    chunks: int


@dataclass(frozen=True)
class HostArrays:
    """Every index array of a plan in arena order (`arrays`: name -> int64 array), and the host facts beside them."""

    arrays: dict[str, np.ndarray]
    calls: dict[str, list[CallFacts]]  # per GDN mode, per call
    conv_bounds: dict[str, np.ndarray]  # per conv layout: its cu_seqlens
    conv_flags: dict[str, tuple[bool, bool, bool]]  # per conv layout: rows_are_packed, keep_all, keep_rows_are_packed
    attention_bounds: tuple[np.ndarray, np.ndarray]  # cu_seqlens of the queries and of the keys
    attention_max: tuple[int, int]  # max_q, max_k
    keys_are_rows: bool
    path_cu: np.ndarray  # [paths + 1]
    num_rows: int
    num_reads: int  # read rows (a bucket's candidates)
    leaf_lens: tuple[int, ...]


@dataclass(frozen=True)
class _Nodes:
    """The node table (step 1) and what the later steps read of it."""

    lens: np.ndarray  # rows per node
    first_pos: np.ndarray  # position of each node's first row
    path: np.ndarray  # representative path of each node
    start: np.ndarray  # first packed row of each node
    end: np.ndarray  # one past its last packed row
    key_starts: np.ndarray  # [nodes, 3]: first row of the grandparent's, the parent's and its own rows
    key_lens: np.ndarray  # [nodes, 3]: their counts (0 for a missing ancestor)
    ids: np.ndarray
    leaf_ids: np.ndarray
    grandparent: np.ndarray
    parent: np.ndarray
    num_rows: int
    num_pad: int
    pad_base: int  # first dummy row

    def keys_of(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The key rows of `nodes` back to back, and each node's count."""
        rows = _concat_ranges(self.key_starts[nodes].ravel(), self.key_lens[nodes].ravel())
        return rows, self.key_lens[nodes].sum(axis=1)


def host_arrays(
    seqs: list[np.ndarray],
    question_of: Sequence[int],
    root_len: int,
    question_lens: Sequence[int],
    chunk_size: int,
    pad: list[int],
    padding,
    bucket,
) -> HostArrays:
    """The plan's arrays for checked candidates `seqs` split at `root_len` and `question_lens` (per question, in order
    of first appearance), with dummy sequences `pad` (a bucket's: its `BucketPadding`'s dummy node) and, bucketed,
    `padding` and `bucket` (engine.plan.BucketPadding and Bucket; None otherwise)."""
    lens = [len(s) for s in seqs]
    leaf_lens = [n - root_len - question_lens[r] for n, r in zip(lens, question_of)]
    assert min(leaf_lens) >= 1 and min(question_lens) >= 0 and root_len >= 0
    nodes = _node_table(lens, question_of, root_len, question_lens, leaf_lens, pad)
    row_node, positions, token_ids = _rows(nodes, seqs, pad)
    attn_nodes, key_rows, q_counts, k_counts, path_rows, path_lens, read_rows = _paths(
        nodes, len(seqs), root_len, question_lens, sum(lens), sum(pad), padding
    )
    path_cu = _bounds(path_lens)
    row_slot, conv_rows = _slots_and_windows(nodes, row_node, positions, path_rows, path_cu)
    conv_layouts = _conv_layouts(nodes, attn_nodes, q_counts, row_slot, path_rows, path_lens, padding)
    attention = _attention_counts(q_counts, k_counts, key_rows, nodes.num_rows, padding, bucket)
    key_rows, attn_cu_q, attn_cu_k, attn_max = attention
    schedules = _schedules(
        path_rows, path_cu, row_slot, lens, question_of, root_len, question_lens, chunk_size, padding
    )

    arrays = {
        "token_ids": token_ids,
        "positions": positions,
        "row_node": row_node,
        "row_parent": nodes.parent[row_node],
        "row_grandparent": nodes.grandparent[row_node],
        "row_slot": row_slot,
        "path_rows": path_rows,
        "path_cu_seqlens": path_cu,
        "read_rows": read_rows,
        "conv_taps": conv_rows,
        "attention.key_rows": key_rows,
        "attention.cu_seqlens_q": attn_cu_q,
        "attention.cu_seqlens_k": attn_cu_k,
    }
    for name, layout in conv_layouts.items():
        for field in CONV_ARRAYS:
            arrays[f"{name}.{field}"] = layout[field]
    calls = {}
    for mode, mode_calls in schedules.items():
        calls[mode] = []
        for i, call in enumerate(mode_calls):
            call["chunk_indices"], call["chunk_offsets"] = _chunk_layout(call["cu_seqlens"], chunk_size)
            for name in CALL_ARRAYS:
                if call[name] is not None:
                    arrays[f"{mode}.{i}.{name}"] = call[name]
            for name in ARENA_ARRAYS if "arena" in call else ():
                arrays[f"{mode}.{i}.arena.{name}"] = call["arena"][name]
            calls[mode].append(_call_facts(call, bucketed=padding is not None))
    num_rows = nodes.num_rows
    return HostArrays(
        arrays=arrays,
        calls=calls,
        conv_bounds={name: layout["cu_seqlens"] for name, layout in conv_layouts.items()},
        conv_flags={
            name: (
                _is_arange(layout["rows"], num_rows),
                _is_arange(layout["keep"], len(layout["rows"])),
                _is_arange(layout["keep_rows"], num_rows),
            )
            for name, layout in conv_layouts.items()
        },
        attention_bounds=(attn_cu_q, attn_cu_k),
        attention_max=attn_max,
        keys_are_rows=_is_arange(key_rows, num_rows),
        path_cu=path_cu,
        num_rows=num_rows,
        num_reads=len(read_rows),
        leaf_lens=tuple(int(n) for n in leaf_lens),
    )


def _node_table(lens, question_of, root_len, question_lens, leaf_lens, pad) -> _Nodes:
    """Step 1. Packed rows are the nodes' rows in id order: [root | question nodes | leaves | dummy sequences]. Per
    node: its rows, its first row's original position, its representative path (the first path holding its rows,
    where each row sits at its position: the candidate whose tokens it holds, the first member for a question node),
    its grandparent and parent (-1 where none) and its id; one row per field, one column per node."""
    num_cands, num_questions, num_pad = len(lens), len(question_lens), len(pad)
    num_nodes = 1 + num_questions + num_cands + num_pad
    first_member = [question_of.index(r) for r in range(num_questions)]
    leaf_first_pos = [root_len + question_lens[r] for r in question_of]
    table = np.array(
        [
            [root_len, *question_lens, *leaf_lens, *pad],
            [0, *[root_len] * num_questions, *leaf_first_pos, *[0] * num_pad],
            [0, *first_member, *range(num_cands + num_pad)],
            [-1, *[-1] * num_questions, *[0] * num_cands, *[-1] * num_pad],
            [-1, *[0] * num_questions, *(1 + r for r in question_of), *[-1] * num_pad],
            range(num_nodes),
        ],
        dtype=np.int64,
    )
    node_lens, first_pos, path, grandparent, parent, ids = table
    end = np.cumsum(node_lens)
    start = end - node_lens
    num_rows = int(end[-1])
    # A node's keys (its path up to its last row): its grandparent's rows, its parent's, its own; a missing ancestor
    # (-1) reads the zero length appended after the last node.
    key_nodes = table[3:].T
    return _Nodes(
        lens=node_lens,
        first_pos=first_pos,
        path=path,
        start=start,
        end=end,
        key_starts=start[key_nodes],
        key_lens=np.append(node_lens, 0)[key_nodes],
        ids=ids,
        leaf_ids=ids[1 + num_questions : 1 + num_questions + num_cands],
        grandparent=grandparent,
        parent=parent,
        num_rows=num_rows,
        num_pad=num_pad,
        pad_base=num_rows - sum(pad),
    )


def _rows(nodes: _Nodes, seqs: list[np.ndarray], pad: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 2: each packed row's node, position and token id (each real node's tokens are a slice of its
    representative candidate, at its positions; dummy rows pad)."""
    row_node = np.repeat(nodes.ids, nodes.lens)
    positions = nodes.first_pos[row_node] + np.arange(nodes.num_rows) - nodes.start[row_node]
    real = len(nodes.ids) - nodes.num_pad
    real_nodes = zip(nodes.lens[:real].tolist(), nodes.first_pos[:real].tolist(), nodes.path[:real].tolist())
    real_tokens = [seqs[path][first : first + rows] for rows, first, path in real_nodes]
    token_ids = np.concatenate([*real_tokens, np.full(sum(pad), PAD_TOKEN_ID, dtype=np.int64)])
    return row_node, positions, token_ids


def _paths(nodes: _Nodes, num_cands: int, root_len: int, question_lens, real_slots: int, pad_slots: int, padding):
    """Step 3. Attention: one sequence per non-empty node (packed order), its own rows as queries, its keys. Paths:
    each candidate's, then the dummy sequences' (a bucket's: engine/plan.py, "Buckets"). The attention's nodes end with
    every leaf, then every dummy node (none is empty), whose keys are their paths: the paths are the keys after the
    root's and the non-empty questions' (root_len + q_r each). Returns the attention nodes, key rows, query and key
    counts, the path rows and lengths, and the read rows."""
    attn_nodes = np.flatnonzero(nodes.lens)
    q_counts = nodes.lens[attn_nodes]
    key_rows, k_counts = nodes.keys_of(attn_nodes)
    num_inner = len(attn_nodes) - num_cands - nodes.num_pad
    first_path_key = root_len * num_inner + sum(question_lens)
    if padding is None:
        num_paths, path_slots = num_cands + nodes.num_pad, real_slots + pad_slots
    else:  # a bucket's dummy paths are laid out below
        num_paths, path_slots = num_cands, real_slots
    path_lens = k_counts[num_inner : num_inner + num_paths]
    path_rows = key_rows[first_path_key : first_path_key + path_slots]
    read_rows = nodes.end[nodes.leaf_ids] - 1
    if padding is not None:
        # The dummy node's path (its rows, then its last row repeated), then paths cycling through its rows; the
        # trailing slots and the extra read rows point at the last (dummy) row.
        last_row = nodes.num_rows - 1
        dummy_lens = np.array(padding.path_lens, dtype=np.int64)
        dummy_slot = _concat_ranges(np.zeros_like(dummy_lens), dummy_lens)  # slot in its dummy path
        dummy_row = dummy_slot % padding.dummy_rows
        dummy_row[: dummy_lens[0]] = np.minimum(dummy_slot[: dummy_lens[0]], padding.dummy_rows - 1)
        trailing = np.full(padding.trailing_slots, last_row, dtype=np.int64)
        path_rows = np.concatenate([path_rows, nodes.pad_base + dummy_row, trailing])
        path_lens = np.concatenate([path_lens, dummy_lens])
        read_rows = np.concatenate([read_rows, np.full(padding.extra_reads, last_row, dtype=np.int64)])
    return attn_nodes, key_rows, q_counts, k_counts, path_rows, path_lens, read_rows


def _slots_and_windows(nodes: _Nodes, row_node, positions, path_rows, path_cu) -> tuple[np.ndarray, np.ndarray]:
    """Step 4. The representative slot of each packed row: its first occurrence in the concatenated paths, which is
    its position in its node's representative path. So the replicated call, which produces each row from its
    representative slot, produces every packed row exactly once, in order. The conv window of each row, read from its
    representative path: rows at positions p-3..p (`num_rows`: the zero row)."""
    row_slot = path_cu[nodes.path[row_node]] + positions
    if not _is_arange(path_rows[row_slot], nodes.num_rows):
        raise AssertionError("a representative slot does not hold its row")
    back = np.arange(CONV_WIDTH - 1, -1, -1)
    window = path_rows[np.maximum(row_slot[:, None] - back, 0)]
    conv_rows = np.where(positions[:, None] >= back, window, nodes.num_rows)
    return row_slot, conv_rows


def _conv_layouts(nodes: _Nodes, attn_nodes, q_counts, row_slot, path_rows, path_lens, padding) -> dict[str, dict]:
    """Step 5: the conv over the paths, and (unpadded plans: a bucketed plan runs the replicated mode only) the conv
    segments: each non-empty node's rows after its history (the rows at positions p0-W+1..p0-1 of its representative
    path, where any), which is one slice of that path."""
    layouts = {"conv_paths": _conv_input(path_rows, path_lens)}
    if padding is None:
        first_slot = row_slot[nodes.start[attn_nodes]]
        history = np.minimum(nodes.first_pos[attn_nodes], CONV_WIDTH - 1)
        segment_lens = history + q_counts
        segment_rows = path_rows[_concat_ranges(first_slot - history, segment_lens)]
        segment_keep = _concat_ranges(np.cumsum(segment_lens) - segment_lens + history, q_counts)
        layouts["conv_segments"] = _conv_input(segment_rows, segment_lens, segment_keep)
    return layouts


def _attention_counts(q_counts, k_counts, key_rows, num_rows: int, padding, bucket):
    """Step 5: the node attention's key rows, query and key bounds and maxima; a bucket adds its rowless nodes and
    trailing keys (at the last row) and takes its own maxima."""
    attn_max = (int(q_counts.max()), int(k_counts.max()))
    if padding is not None:
        q_counts = np.concatenate([q_counts, np.zeros(padding.empty_nodes, dtype=np.int64)])
        k_counts = np.concatenate([k_counts, np.zeros(padding.empty_nodes, dtype=np.int64)])
        key_rows = np.concatenate([key_rows, np.full(padding.trailing_keys, num_rows - 1, dtype=np.int64)])
        attn_max = (bucket.max_q, bucket.max_k)
    return key_rows, _bounds(q_counts), _bounds(k_counts), attn_max


def _schedules(path_rows, path_cu, row_slot, lens, question_of, root_len, question_lens, chunk_size, padding):
    """Step 6: the replicated call, and (unpadded plans) the hand-off calls, checked to produce every row once."""
    replicated = _replicated_call(path_rows, path_cu, row_slot)
    replicated["walk"] = _tree_walk(path_cu, row_slot, lens, question_of, root_len, question_lens, chunk_size)
    shared = root_len + (question_lens[0] if len(question_lens) == 1 else 0)
    sequences = None if padding is None else len(lens) + padding.extra_reads + 1  # the bucket's candidates, dummy node
    replicated["arena"] = _handoff_arena(path_rows, path_cu, row_slot, len(lens), shared, chunk_size, sequences)
    schedules = {"replicated": [replicated]}
    if padding is None:
        num_cands = len(lens)
        paths = [path_rows[path_cu[c] : path_cu[c + 1]] for c in range(len(path_cu) - 1)]
        lens_array, q_of, q_lens = (np.array(x, dtype=np.int64) for x in (lens, question_of, question_lens))
        handoff = _handoff_calls(paths[:num_cands], lens_array, q_of, root_len, q_lens, chunk_size, paths[num_cands:])
        produced = np.concatenate([call["out_rows"] for call in handoff])
        if not np.array_equal(np.sort(produced), np.arange(len(row_slot))):
            raise AssertionError("handoff GDN schedule does not produce every packed row exactly once")
        schedules["handoff"] = handoff
    return schedules


def _call_facts(call: dict, *, bucketed: bool) -> CallFacts:
    """A call's host facts; a bucket's shape must not depend on the request, so its calls always gather."""
    rows_start = out_start = None
    if not bucketed:
        rows_start = _range_start(call["rows"])
        out_slots, out_rows = _range_start(call["out_slots"]), _range_start(call["out_rows"])
        out_start = None if out_slots is None or out_rows is None else (out_slots, out_rows)
    return CallFacts(
        keep_final=call["keep_final"],
        has_init_state=call["init_state"] is not None,
        rows_start=rows_start,
        out_start=out_start,
        cu_seqlens=call["cu_seqlens"],
        start_positions=tuple(call["start_positions"].tolist()),
        chunks=len(call["chunk_indices"]),
    )


def _is_arange(indices: np.ndarray, n: int) -> bool:
    """indices == arange(n) (the length is compared first: most index arrays are longer or shorter)."""
    return len(indices) == n and bool((indices == np.arange(n)).all())


def _range_start(indices: np.ndarray) -> int | None:
    """indices[0] if indices == arange(indices[0], indices[0] + len), else None."""
    if len(indices) == 0 or not (indices[1:] - indices[:-1] == 1).all():
        return None
    return int(indices[0])


def _chunk_layout(cu_seqlens: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """FLA's varlen chunk layout of sequences with bounds `cu_seqlens`: the chunk indices [sum ceil(len / chunk_size),
    2] ((sequence index, chunk index within it), as FLA's prepare_chunk_indices) and the chunk offsets [S + 1] (first
    chunk of each sequence)."""
    offsets = _bounds(-(-(cu_seqlens[1:] - cu_seqlens[:-1]) // chunk_size))
    num_chunks = int(offsets[-1])
    indices = np.empty((num_chunks, 2), dtype=np.int64)
    indices[:, 0] = np.repeat(np.arange(len(offsets) - 1), offsets[1:] - offsets[:-1])
    indices[:, 1] = np.arange(num_chunks) - offsets[indices[:, 0]]
    return indices, offsets


def _bounds(lens: np.ndarray) -> np.ndarray:
    """[0, cumsum(lens)...] (int64): the bounds of sequences of these lengths back to back."""
    bounds = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=bounds[1:])
    return bounds


def _concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """arange(starts[i], starts[i] + lens[i]) for every i, back to back (int64)."""
    lens = np.asarray(lens, dtype=np.int64)
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def _conv_input(rows: np.ndarray, lens: np.ndarray, keep: np.ndarray | None = None) -> dict:
    """Host arrays of a `ConvInput`: sequences of `lens` rows back to back in `rows` (packed row ids), then any rows
    after the last sequence (a bucket's trailing slots: in no sequence; `spaced` reads them as such), keeping slots
    `keep` (None: every slot, in order, so `keep_rows` is `rows` and `spaced_keep` every slot's position)."""
    history = CONV_WIDTH - 1
    trailing = len(rows) - int(lens.sum())
    # In `spaced`, W-1 zero rows precede each sequence: a slot moves by W-1 per sequence up to its own (a trailing
    # slot by W-1 per sequence).
    shift = np.repeat(np.append(np.arange(1, len(lens) + 1), len(lens)), np.append(lens, trailing))
    spaced_slot = np.arange(len(rows)) + history * shift
    spaced = np.zeros(len(rows) + history * len(lens), dtype=np.int64)
    spaced[spaced_slot] = rows + 1
    if keep is None:
        keep, keep_rows, spaced_keep = np.arange(len(rows)), rows, spaced_slot
    else:
        keep, keep_rows, spaced_keep = keep.astype(np.int64), rows[keep], spaced_slot[keep]
    return {
        "rows": rows,
        "cu_seqlens": _bounds(lens),
        "keep": keep,
        "keep_rows": keep_rows,
        "spaced": spaced,
        "spaced_keep": spaced_keep,
    }


def _replicated_call(path_rows: np.ndarray, path_cu: np.ndarray, row_slot: np.ndarray) -> dict:
    """Every path from position 0; each packed row is produced by its representative slot (so the rows produced,
    `path_rows[row_slot]`, are the packed rows in order: checked where `row_slot` is built)."""
    return {
        "rows": path_rows,
        "cu_seqlens": path_cu,
        "init_state": None,
        "keep_final": False,
        "out_slots": row_slot,
        "out_rows": np.arange(len(row_slot)),
        "start_positions": np.zeros(len(path_cu) - 1, dtype=np.int64),
    }


def _tree_walk(path_cu, row_slot, lens, question_of, root_len, question_lens, chunk_size) -> np.ndarray:
    """The replicated call's tree walk for `kernels.gdn_chunk` (its module docstring, "The tree walk"): [S, 8] int64,
    row i = (the sequence to run i-th, then sequence i's start chunk, source slot, publish chunks, publish slot, second
    publish chunks, second publish slot, and in every row the number of sequences that run: the non-dummy ones). The
    shared prefix's recurrence runs once: candidate 0 walks its whole path and publishes its state at the root's last
    chunk boundary A0 (slot 0; A0 = 0 with one question, as the hand-off's) and, where its question's prefix crosses a
    later boundary A_r, there too (slot S); the first candidate of every other question starts at A0 from slot 0 and
    publishes at A_r (its own slot); every other candidate starts at A_r (or A0) from its question's (or the root's)
    state. Dummy paths start at -1 (their rows get zeros). Rows are ordered so that every publisher precedes its readers
    (the kernel's tickets run them in this order): candidate 0, the other real sequences that read nothing, the readers
    that publish, the other readers, then the dummy paths, which compute nothing (ahead of the readers, as before
    gdn_chunk v3.4, their programs took the SMs' slots while the readers waited for tickets: drone's bucket has 11 dummy
    paths to 7 candidates, 1,056 programs to 672). Checked: no representative slot lies in a skipped chunk; every reader
    runs after its publisher."""
    num_seqs, num_cands = len(path_cu) - 1, len(lens)
    q_of = np.asarray(question_of, dtype=np.int64)
    q_lens = np.asarray(question_lens, dtype=np.int64)
    a0 = root_len // chunk_size if len(q_lens) > 1 else 0
    q_end = (root_len + q_lens) // chunk_size  # A_r per question, in chunks
    first = {r: int(np.flatnonzero(q_of == r)[0]) for r in range(len(q_lens))}
    size = {r: int((q_of == r).sum()) for r in range(len(q_lens))}
    walk = np.zeros((num_seqs, 8), dtype=np.int64)
    walk[:, 2] = -1
    walk[num_cands:, 1] = -1  # dummy paths
    r0 = int(q_of[0])
    for c in range(1, num_cands):
        r = int(q_of[c])
        if c == first[r]:
            if a0 > 0:
                walk[c, 1:3] = (a0, 0)
            if q_end[r] > a0 and size[r] > 1:
                walk[c, 3:5] = (q_end[r], c)
        elif q_end[r] > a0:
            walk[c, 1:3] = (q_end[r], num_seqs if r == r0 else first[r])
        elif a0 > 0:
            walk[c, 1:3] = (a0, 0)
    if (walk[:, 2] == 0).any():
        walk[0, 3:5] = (a0, 0)
    if (walk[:, 2] == num_seqs).any():
        walk[0, 5:7] = (q_end[r0], num_seqs)
    skipped = np.zeros(int(path_cu[-1]), dtype=bool)
    for seq in np.flatnonzero(walk[:, 1] > 0):
        skipped[path_cu[seq] : path_cu[seq] + walk[seq, 1] * chunk_size] = True
    if skipped[row_slot].any():
        raise AssertionError("the tree walk skips a representative slot")
    readers, publishers, dummies = walk[1:, 2] >= 0, (walk[1:, 3] > 0) | (walk[1:, 5] > 0), walk[1:, 1] < 0
    rest = np.arange(1, num_seqs)
    independent = rest[~readers & ~dummies]
    order = np.concatenate([[0], independent, rest[readers & publishers], rest[readers & ~publishers], rest[dummies]])
    position = np.empty(num_seqs + 1, dtype=np.int64)
    position[order] = np.arange(num_seqs)
    position[num_seqs] = position[0]  # slot S is candidate 0's second publish
    reading = np.flatnonzero(walk[:, 2] >= 0)
    if (position[walk[reading, 2]] >= position[reading]).any():
        raise AssertionError("a tree-walk reader runs before its publisher")
    walk[:, 0] = order
    walk[:, 7] = num_seqs - int(dummies.sum())  # the first walk[0, 7] of the order run; the dummy paths end it
    return walk


def _handoff_arena(
    path_rows, path_cu, row_slot, num_cands: int, shared: int, chunk_size: int, sequences: int | None
) -> dict[str, np.ndarray]:
    """The replicated call's paths as two calls of a core that reads its sequences from one arena and its initial
    states from a pool (`kernels.gdn_flashinfer.FlashInferCore.arena`): call 1 runs candidate 0's first A0 = chunk_size
    * floor(shared / chunk_size) rows (`shared`: the rows every candidate shares, the root, or the root and the
    question node of a one-question request) and keeps its final state in pool row 0; call 2 runs every candidate's
    path from A0 from that state, and every other path that produces a row (a detached dummy sequence) from position 0
    and the zero state. A hand-off at a multiple of the chunk size keeps the unshared chunk grid (the straddling chunk
    is recomputed per candidate, as the `handoff` schedule does). A bucket's dummy paths that produce no row are left
    out; call 2 has `sequences` sequences (a bucket's: its candidates and the dummy node, a shape the bucket fixes),
    the last ones empty, or (None) exactly its paths. Arrays (int64):
    * rows [L]: the packed row of each arena slot, root rows first, then the call-2 sequences back to back; the slots
      after them (the arena is never longer than the paths) hold the paths' last row and lie in no sequence;
    * cu_seqlens [S + 2]: call 1's bounds are cu_seqlens[:2], call 2's cu_seqlens[1:] (S sequences);
    * states [2 + 2S]: call 1's read and write rows (-1: the zero state; 0), call 2's read rows (0 or -1) and its write
      rows (-1: no final state);
    * out_slots [N]: the arena slot that produces each packed row (its representative slot's, checked);
    * gathered [1]: the slots to gather, the sequences' and the chunk_size after them (FlashInfer's kernel loads a last
      chunk's whole 64-row tile and zeroes the rows past the sequence by multiplying: they must be finite, measured
      in campaign 85, where a NaN left in unwritten slots reached the last candidate's rows)."""
    a0 = shared // chunk_size * chunk_size
    paths = np.unique(np.searchsorted(path_cu, row_slot, side="right") - 1)  # the paths that produce a row, in order
    sequences = len(paths) if sequences is None else sequences
    if len(paths) > sequences:
        raise AssertionError(f"the hand-off arena needs {len(paths)} sequences, its shape has {sequences}")
    candidate = paths < num_cands
    start = np.where(candidate, a0, 0)
    seq_lens = np.zeros(sequences, dtype=np.int64)
    seq_lens[: len(paths)] = np.diff(path_cu)[paths] - start
    slots = np.concatenate(
        [np.arange(a0, dtype=np.int64), _concat_ranges(path_cu[paths] + start, seq_lens[: len(paths)])]
    )
    arena_of_slot = np.full(len(path_rows), -1, dtype=np.int64)
    arena_of_slot[slots] = np.arange(len(slots))
    out_slots = arena_of_slot[row_slot]
    if (out_slots < 0).any():
        raise AssertionError("the hand-off arena leaves out a representative slot")
    reads = np.full(sequences, -1, dtype=np.int64)
    reads[: len(paths)] = np.where(candidate & (a0 > 0), 0, -1)
    return {
        "rows": np.concatenate([path_rows[slots], np.full(len(path_rows) - len(slots), path_rows[-1])]),
        "cu_seqlens": np.concatenate([[0], a0 + _bounds(seq_lens)]),
        "states": np.concatenate([[-1, 0], reads, np.full(sequences, -1)]).astype(np.int64),
        "out_slots": out_slots,
        "gathered": np.array([min(len(path_rows), len(slots) + chunk_size)], dtype=np.int64),
    }


def _handoff_calls(paths, lens, q_of, root_len, q_lens, chunk_size, dummy_paths) -> list[dict]:
    """Root to A0, questions from A0 to A_r, leaves from A_r (all multiples of chunk_size); see GdnSchedule. One
    question: no root call (A0 = 0), its node runs from position 0. Dummy sequences run whole in the leaves' call,
    from the zero state."""
    a0 = 0 if len(q_lens) == 1 else root_len // chunk_size * chunk_size
    q_end = (root_len + q_lens) // chunk_size * chunk_size  # A_r per question
    calls = []
    bank_size = 1  # entry 0: the zero state
    root_state = 0
    if a0 > 0:
        calls.append(_call([(paths[0], 0, a0, 0)], keep_final=True))
        root_state, bank_size = bank_size, bank_size + 1
    q_state = np.full(len(q_lens), root_state, dtype=np.int64)
    q_from = np.full(len(q_lens), a0, dtype=np.int64)
    crossing = [r for r in range(len(q_lens)) if q_end[r] > a0]
    if crossing:
        first_member = {r: int(np.flatnonzero(q_of == r)[0]) for r in crossing}
        calls.append(_call([(paths[first_member[r]], a0, q_end[r], root_state) for r in crossing], keep_final=True))
        for i, r in enumerate(crossing):
            q_state[r], q_from[r] = bank_size + i, q_end[r]
        bank_size += len(crossing)
    leaves = [(paths[c], q_from[q_of[c]], lens[c], q_state[q_of[c]]) for c in range(len(paths))]
    leaves += [(path, 0, len(path), 0) for path in dummy_paths]
    calls.append(_call(leaves, keep_final=False))

    # Each packed row is produced by the first slot (in call order) that holds it.
    all_rows = np.concatenate([call["rows"] for call in calls])
    _, first = np.unique(all_rows, return_index=True)
    is_first = np.zeros(len(all_rows), dtype=bool)
    is_first[first] = True
    offset = 0
    for call in calls:
        n = len(call["rows"])
        call["out_slots"] = np.flatnonzero(is_first[offset : offset + n]).astype(np.int64)
        call["out_rows"] = call["rows"][call["out_slots"]]
        offset += n
    return calls


def _call(pieces: list[tuple[np.ndarray, int, int, int]], *, keep_final: bool) -> dict:
    """pieces: (path, start position, end position, state bank index) per sequence."""
    rows = np.concatenate([path[start:end] for path, start, end, _ in pieces]).astype(np.int64)
    seq_lens = np.array([end - start for _, start, end, _ in pieces], dtype=np.int64)
    assert (seq_lens > 0).all()
    starts = np.array([start for _, start, _, _ in pieces], dtype=np.int64)
    states = np.array([state for _, _, _, state in pieces], dtype=np.int64)
    return {
        "rows": rows,
        "cu_seqlens": _bounds(seq_lens),
        "walk": None,
        "init_state": None if (starts == 0).all() else states,
        "keep_final": keep_final,
        "start_positions": starts,
    }
