"""The prefix tree (engine/plan.py, engine/tree.py) against the unshared layout, on the CPU.

Planner: hypothesis-generated requests (1-8 questions, 1-40 options, states of 0-600 tokens, options sharing long
prefixes, single-option choices, noul-only) and adversarial token lists; every structural invariant is checked,
including the conv input layouts (paths, node segments with history rows) and the node-wise attention layout (equal
to the attention mask on the adversarial lists). Layer functions: tree against flat with identical per-row inputs (a
packed tree row's input is copied into every candidate path that holds it, so GEMM row-count effects are excluded):
conv and GDN core (both modes) bitwise in fp32 and bf16; attention bitwise in `paths` and `nodes` modes with a
prefix-invariant core (also with queries at the end of their keys) and bounded in `mask` mode. Then a two-layer
composition (embedding, GDN layer, attention layer, final norm; GEMMs over each plan's own rows): tree == flat bitwise.
Tiny-twin head shapes: GDN H=2, HV=6, K=V=32 (conv width 4, 320 channels); attention 6 query heads, 1 kv head, D=64.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.plan import CHUNK_SIZE, TreePlan, plan_flat, plan_tree
from engine.plan_arrays import CONV_WIDTH
from engine.planner import choose_gdn_mode, gdn_mode_costs
from engine.tree import (
    blockwise_causal_attention,
    blockwise_node_core,
    blockwise_paged_node_core,
    node_core,
    page_keys,
    torch_chunk_core,
    tree_gdn_core,
)
from reference import ops
from reference.shapes import TINY
from reference.tree import (
    attention_mask,
    gather_paths,
    scatter_rows,
    sdpa_varlen_causal,
    tree_attention,
    tree_conv1d_silu,
)

TEMPLATE_HEAD = [151644, 872, 198, 1972, 510]  # fixed tokens before the state ("<|im_start|>user\nContext:\n")
ANSWER = [5, 80, 9]  # fixed tokens between a question and its option ("Proposed answer: ")
TEMPLATE_TAIL = [151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]  # fixed tokens after the option
NOUL_TAIL = [3872, 279, 4226, 311]  # the noul ending ("Is the answer to this question yes? ...")


def synthetic_request(seed: int, questions: int, options: list[int], state_len: int, shared: list[int]):
    """Token lists shaped like Open-Jev prompts: template | state | question | option | template.

    options[r] == 0 marks a noul question (one candidate, no option); shared[r] tokens open every option of question
    r (long shared option prefixes). Question texts draw from a small vocabulary, so they often share first tokens.
    """
    rng = random.Random(seed)
    state = [rng.randrange(20, 150_000) for _ in range(state_len)]
    candidates, groups = [], []
    for r in range(questions):
        question = [rng.randrange(10, 14) for _ in range(rng.randrange(0, 30))]
        head = TEMPLATE_HEAD + state + [13] + question
        if options[r] == 0:
            candidates.append(head + NOUL_TAIL + TEMPLATE_TAIL)
            groups.append(r)
            continue
        prefix = [rng.randrange(20, 150_000) for _ in range(shared[r])]
        for o in range(options[r]):
            tail = [1000 + o] + [rng.randrange(20, 150_000) for _ in range(rng.randrange(0, 12))]
            candidates.append(head + ANSWER + prefix + tail + TEMPLATE_TAIL)
            groups.append(r)
    return candidates, groups


@st.composite
def requests(draw, max_questions=8, max_options=40, max_state=600, max_shared=80):
    questions = draw(st.integers(1, max_questions))
    noul_only = draw(st.booleans())
    options = [
        0 if noul_only else draw(st.sampled_from([0, 1, draw(st.integers(1, max_options))])) for _ in range(questions)
    ]
    shared = [draw(st.sampled_from([0, draw(st.integers(0, max_shared))])) for _ in range(questions)]
    state_len = draw(st.sampled_from([0, draw(st.integers(0, max_state))]))
    return synthetic_request(draw(st.integers(0, 2**31)), questions, options, state_len, shared)


@st.composite
def raw_candidates(draw):
    """Adversarial token lists from a 3-token vocabulary: prefixes of each other, duplicates, single tokens."""
    count = draw(st.integers(1, 9))
    candidates = [draw(st.lists(st.integers(0, 2), min_size=1, max_size=10)) for _ in range(count)]
    groups = [draw(st.integers(0, 3)) for _ in range(count)]
    return candidates, groups


def lcp(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def check_plan(plan: TreePlan, candidates: list[list[int]], groups: list[int]) -> None:
    """Every invariant of a plan, checked against the candidates it was built from."""
    n, lens = plan.num_rows, [len(c) for c in candidates]
    token_ids, positions, row_node = (t.numpy() for t in (plan.token_ids, plan.positions, plan.row_node))
    path_rows, cu = plan.path_rows.numpy(), plan.path_cu_seqlens.numpy()
    assert list(np.diff(cu)) == lens and plan.logical_tokens == sum(lens)
    # each path reproduces its candidate's tokens, at its original positions, root -> question -> leaf
    assert np.array_equal(token_ids[path_rows], np.concatenate([np.asarray(c) for c in candidates]))
    slot_pos = np.concatenate([np.arange(m) for m in lens])
    assert np.array_equal(positions[path_rows], slot_pos)
    question_ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    num_q = len(question_ids)
    for c, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        r = question_ids[groups[c]]
        nodes = row_node[path_rows[start:end]]
        expect = [0] * plan.root_len + [1 + r] * plan.question_lens[r] + [1 + num_q + c] * plan.leaf_lens[c]
        assert list(nodes) == expect
        assert plan.read_rows[c] == path_rows[end - 1]
    # sizes: every leaf holds a token, nothing is counted twice, the tree never has more rows than the flat layout
    assert min(plan.leaf_lens) >= 1
    assert n == plan.root_len + sum(plan.question_lens) + sum(plan.leaf_lens) <= plan.logical_tokens
    assert np.array_equal(np.unique(path_rows), np.arange(n))
    assert np.array_equal(path_rows[plan.row_slot.numpy()], np.arange(n))
    # parents as the mask reads them
    parent, grandparent = plan.row_parent.numpy(), plan.row_grandparent.numpy()
    is_root, is_question = row_node == 0, (row_node >= 1) & (row_node <= num_q)
    assert (parent[is_root] == -1).all() and (parent[is_question] == 0).all()
    assert (grandparent[~(is_root | is_question)] == 0).all() and (grandparent[is_root | is_question] == -1).all()
    # conv windows: for every slot of every path (not only the representative), rows at positions p-3..p of it
    conv_rows = plan.conv_taps.numpy()
    for k in range(CONV_WIDTH):
        back = CONV_WIDTH - 1 - k
        expect = np.where(slot_pos >= back, path_rows[np.maximum(np.arange(len(path_rows)) - back, 0)], n)
        assert np.array_equal(conv_rows[path_rows, k], expect)
    check_schedules(plan)
    check_conv_inputs(plan)
    # node attention: each node's rows are its queries, in packed order, and the last rows of its keys (its path)
    a = plan.attention
    cu_q, cu_k, key_rows = a.cu_seqlens_q_cpu.numpy(), a.cu_seqlens_k_cpu.numpy(), a.key_rows.numpy()
    assert np.array_equal(a.cu_seqlens_q.numpy(), cu_q) and np.array_equal(a.cu_seqlens_k.numpy(), cu_k)
    assert cu_q[-1] == n and (np.diff(cu_q) >= 1).all() and (np.diff(cu_k) >= np.diff(cu_q)).all()
    assert (a.max_q, a.max_k) == (np.diff(cu_q).max(), np.diff(cu_k).max())
    for i in range(len(cu_q) - 1):
        keys, queries = key_rows[cu_k[i] : cu_k[i + 1]], np.arange(cu_q[i], cu_q[i + 1])
        assert np.array_equal(keys[len(keys) - len(queries) :], queries)
        assert np.array_equal(positions[keys], np.arange(len(keys)))  # a path from position 0
        assert np.array_equal(conv_rows[keys[1:], CONV_WIDTH - 2], keys[:-1])  # consecutive on one path
    assert a.keys_are_rows == np.array_equal(key_rows, np.arange(n)) and (a.keys_are_rows or plan.kind == "tree")


def check_conv_inputs(plan: TreePlan) -> None:
    """Both conv inputs give every kept row the window of its own path (zeros before position 0), both in the
    sequence layout (the prep kernel masks rows before a sequence start) and in the zero-spaced layout."""
    n, conv_rows = plan.num_rows, plan.conv_taps.numpy()
    for layout in (plan.conv_paths, plan.conv_segments):
        rows, cu, keep = layout.rows.numpy(), layout.cu_seqlens_cpu.numpy(), layout.keep.numpy()
        assert np.array_equal(layout.cu_seqlens.numpy(), cu) and np.array_equal(layout.cu_seqlens_i32.numpy(), cu)
        assert np.array_equal(layout.keep_rows.numpy(), rows[keep])
        sequence_start = np.repeat(cu[:-1], np.diff(cu))[keep]
        spaced, spaced_keep = layout.spaced.numpy(), layout.spaced_keep.numpy()
        for k in range(CONV_WIDTH):
            back = CONV_WIDTH - 1 - k
            in_sequence = np.where(keep - back >= sequence_start, rows[np.maximum(keep - back, 0)], n)
            assert np.array_equal(in_sequence, conv_rows[rows[keep], k])
            zero_spaced = spaced[spaced_keep - back] - 1  # index into [zero | rows]: -1 is the zero row
            assert np.array_equal(np.where(zero_spaced < 0, n, zero_spaced), conv_rows[rows[keep], k])
        assert layout.rows_are_packed == np.array_equal(rows, np.arange(n))
        assert layout.keep_all == np.array_equal(keep, np.arange(len(rows)))
    assert np.array_equal(plan.conv_paths.keep_rows.numpy(), plan.path_rows.numpy())
    assert np.array_equal(plan.conv_segments.keep_rows.numpy(), np.arange(n))
    assert len(plan.conv_segments.rows) <= n + (CONV_WIDTH - 1) * (1 + plan.num_questions + plan.num_candidates)


def check_tree_split(plan: TreePlan, candidates: list[list[int]], groups: list[int]) -> None:
    """Root and question nodes are the longest common prefixes, capped so each leaf keeps a token."""
    assert plan.kind == "tree"
    assert plan.root_len == min(lcp(candidates), min(len(c) for c in candidates) - 1)
    for r, g in enumerate(dict.fromkeys(groups)):
        members = [c for c, gc in zip(candidates, groups) if gc == g]
        assert plan.root_len + plan.question_lens[r] == min(lcp(members), min(len(c) for c in members) - 1)


def check_schedules(plan: TreePlan) -> None:
    """Each GDN call's sequences are path slices; states hand off only at chunk boundaries; rows produced once."""
    conv_rows = plan.conv_taps.numpy()
    positions = plan.positions.numpy()
    for mode, schedule in plan.gdn.items():
        produced = []
        bank_last_row = [None]  # the last packed row of the sequence each bank entry's state ends at
        for call in schedule.calls:
            rows, cu = call.rows.numpy(), call.cu_seqlens_cpu.numpy()
            assert np.array_equal(cu, call.cu_seqlens.numpy())
            init = None if call.init_state is None else call.init_state.numpy()
            for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
                seq = rows[start:end]
                first_pos = call.start_positions[i]
                assert np.array_equal(positions[seq], first_pos + np.arange(end - start))
                assert np.array_equal(conv_rows[seq[1:], CONV_WIDTH - 2], seq[:-1])  # consecutive on one path
                if first_pos == 0:
                    assert init is None or init[i] == 0
                else:
                    assert first_pos % plan.chunk_size == 0 and init is not None and init[i] >= 1
                    assert bank_last_row[init[i]] == conv_rows[seq[0], CONV_WIDTH - 2]  # state ends right before
            if call.keep_final:
                bank_last_row += [rows[end - 1] for end in cu[1:]]
            produced.append(rows[call.out_slots.numpy()])
            assert np.array_equal(produced[-1], call.out_rows.numpy())
        produced = np.concatenate(produced)
        assert len(produced) == plan.num_rows and np.array_equal(np.sort(produced), np.arange(plan.num_rows)), mode
    replicated = plan.gdn["replicated"]
    assert len(replicated.calls) == 1 and replicated.num_tokens == plan.logical_tokens
    assert plan.gdn["handoff"].num_tokens <= plan.logical_tokens


# ----------------------------------------------------------------------------------------------------------- planner


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
@example(synthetic_request(7, 8, [40] * 8, 600, [80] * 8))  # the largest: 320 candidates of ~700 tokens
@example(synthetic_request(8, 8, [0] * 8, 0, [0] * 8))  # noul-only, empty state
def test_plan_tree_invariants_on_requests(request_tokens):
    candidates, groups = request_tokens
    tree = plan_tree(candidates, groups)
    check_plan(tree, candidates, groups)
    check_tree_split(tree, candidates, groups)
    flat = plan_flat(candidates, groups)
    check_plan(flat, candidates, groups)
    assert flat.num_rows == flat.logical_tokens and tree.num_rows <= flat.num_rows


@settings(max_examples=150, deadline=None)
@given(raw_candidates())
def test_plan_tree_invariants_adversarial(request_tokens):
    candidates, groups = request_tokens
    tree = plan_tree(candidates, groups, chunk_size=2)  # chunk 2 exercises every hand-off branch on short lists
    check_plan(tree, candidates, groups)
    check_tree_split(tree, candidates, groups)
    # the mask against its definition: row i sees row j iff some path holds both with j at or before i
    visible = np.zeros((tree.num_rows, tree.num_rows), dtype=bool)
    cu = tree.path_cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        path = tree.path_rows[start:end].numpy()
        visible[np.ix_(path, path)] |= np.tril(np.ones((end - start, end - start), dtype=bool))
    assert np.array_equal(attention_mask(tree).numpy(), visible)
    # node attention sees exactly the mask: query j of a node with q queries and k keys sees keys 0..k-q+j
    a, seen = tree.attention, np.zeros_like(visible)
    cu_q, cu_k, key_rows = a.cu_seqlens_q_cpu.tolist(), a.cu_seqlens_k_cpu.tolist(), a.key_rows.numpy()
    for i in range(len(cu_q) - 1):
        num_q, keys = cu_q[i + 1] - cu_q[i], key_rows[cu_k[i] : cu_k[i + 1]]
        for j in range(num_q):
            seen[cu_q[i] + j, keys[: len(keys) - num_q + j + 1]] = True
    assert np.array_equal(seen, visible)


def test_plan_flat_layout():
    candidates, groups = synthetic_request(3, 3, [0, 4, 1], 40, [0, 10, 0])
    flat = plan_flat(candidates, groups)
    lens = np.array([len(c) for c in candidates])
    assert flat.root_len == 0 and set(flat.question_lens) == {0} and list(flat.leaf_lens) == list(lens)
    assert np.array_equal(flat.path_rows.numpy(), np.arange(lens.sum()))
    assert np.array_equal(flat.read_rows.numpy(), np.cumsum(lens) - 1)
    assert np.array_equal(flat.gdn["handoff"].calls[0].rows.numpy(), np.arange(lens.sum()))
    mask = attention_mask(flat).numpy()
    blocks = np.zeros_like(mask)
    for start, end in zip(np.cumsum(lens) - lens, np.cumsum(lens)):
        blocks[start:end, start:end] = np.tril(np.ones((end - start, end - start), dtype=bool))
    assert np.array_equal(mask, blocks)


def test_handoff_single_question_runs_root_and_question_as_one_chain():
    """One question: [0, A_1) in one call from the zero state, then the leaves from A_1; no root-only call."""
    candidates, groups = synthetic_request(1, 1, [5], 150, [40])
    tree = plan_tree(candidates, groups)
    shared = tree.root_len + tree.question_lens[0]
    a1 = shared // CHUNK_SIZE * CHUNK_SIZE
    assert a1 > 0 and tree.root_len // CHUNK_SIZE * CHUNK_SIZE > 0  # the old schedule had a root call here
    prefix, leaves = tree.gdn["handoff"].calls
    assert prefix.init_state is None and prefix.keep_final
    assert prefix.cu_seqlens_cpu.tolist() == [0, a1]
    assert np.array_equal(prefix.rows.numpy(), tree.path_rows[:a1].numpy())
    assert leaves.num_sequences == 5 and not leaves.keep_final
    assert leaves.init_state.tolist() == [1] * 5  # every leaf from the chain's state (bank entry 1)
    several, several_groups = synthetic_request(2, 2, [3, 4], 150, [40, 20])
    assert len(plan_tree(several, several_groups).gdn["handoff"].calls) == 3


def test_plan_edge_cases():
    one = plan_tree([[7, 8, 9]], [0])  # one candidate: everything but the last token in the root
    assert (one.root_len, one.question_lens, one.leaf_lens) == (2, (0,), (1,))
    noul, noul_groups = synthetic_request(1, 5, [0] * 5, 100, [0] * 5)  # noul-only: one candidate per question
    tree = plan_tree(noul, noul_groups)
    check_plan(tree, noul, noul_groups)
    assert tree.leaf_lens == (1,) * 5
    nothing_shared, groups = synthetic_request(2, 4, [3, 0, 2, 5], 0, [0, 0, 0, 0])  # share only the template
    tree = plan_tree(nothing_shared, groups)
    check_plan(tree, nothing_shared, groups)
    assert tree.root_len == lcp(nothing_shared) >= len(TEMPLATE_HEAD)
    wide, wide_groups = synthetic_request(4, 1, [255], 300, [40])  # a 255-option choice
    tree = plan_tree(wide, wide_groups)
    check_plan(tree, wide, wide_groups)
    assert tree.num_candidates == 255 and tree.question_lens == (0,)  # one question: its shared text is the root
    assert tree.root_len >= len(TEMPLATE_HEAD) + 300 + len(ANSWER) + 40
    duplicates = plan_tree([[1, 2, 3], [1, 2, 3], [1, 2]], [0, 0, 1])
    assert duplicates.leaf_lens == (1, 1, 1) and duplicates.root_len == 1


def test_chunk_indices_match_fla():
    """The plan's precomputed chunk layout is FLA's own (so FLA needs no host work or copy per call)."""
    with warnings.catch_warnings():  # importing fla on a machine without flash-attn warns (ImportWarning)
        warnings.simplefilter("ignore", ImportWarning)
        from fla.ops.utils.index import prepare_chunk_indices

    candidates, groups = synthetic_request(6, 3, [3, 1, 0], 200, [70, 0, 0])
    for plan in (plan_tree(candidates, groups), plan_flat(candidates, groups)):
        for schedule in plan.gdn.values():
            for call in schedule.calls:
                expect = prepare_chunk_indices(call.cu_seqlens, plan.chunk_size)
                assert torch.equal(call.chunk_indices, expect)


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one candidate"):
        plan_tree([], [])
    with pytest.raises(ValueError, match="groups has 1 entries for 2 candidates"):
        plan_tree([[1], [2]], [0])
    with pytest.raises(ValueError, match="candidate 1 must be a non-empty"):
        plan_tree([[1], []], [0, 0])
    with pytest.raises(ValueError, match="negative token id"):
        plan_flat([[1, -3]], [0])
    with pytest.raises(ValueError, match="candidate 1 has token ids that are not 64-bit integers"):
        plan_tree([[1, 2], [1, 2.5]], [0, 0])  # refused, not truncated to 2


def test_choose_gdn_mode():
    short, groups = synthetic_request(5, 3, [3, 3, 0], 83, [0, 0, 0])  # drone-like: replication is cheap
    assert choose_gdn_mode(plan_tree(short, groups)) == "replicated"
    rng = random.Random(0)
    context = [rng.randrange(150_000) for _ in range(4000)]
    long_single = [context + [1000 + o] + [rng.randrange(150_000) for _ in range(40)] for o in range(5)]
    tree = plan_tree(long_single, [0] * 5)
    costs = gdn_mode_costs(tree)
    assert choose_gdn_mode(tree) == "handoff" and costs["handoff"] < costs["replicated"]
    assert tree.gdn["handoff"].num_tokens == 3968 + 5 * (4041 - 3968)  # root once to 62*64, then each branch


def open_jev_candidates(workload: str) -> tuple[list[list[int]], list[int]]:
    """Token ids and groups of an Open-Jev workload, through the request pipeline (DecisionModel.plan's steps)."""
    from reference.data import open_jev_workloads
    from reference.service import request_candidates

    return request_candidates(open_jev_workloads()[workload]["request"])


def test_drone_rows_computed(shared_dir):
    """Issue 5 target: the drone request computes at most 45% of its 971 unshared rows."""
    candidates, groups = open_jev_candidates("drone")
    tree = plan_tree(candidates, groups)
    check_plan(tree, candidates, groups)
    ratio = tree.rows_computed / tree.logical_tokens
    print(
        f"drone: {tree.rows_computed} rows computed of {tree.logical_tokens} logical tokens ({ratio:.1%}); "
        f"root {tree.root_len}, questions {tree.question_lens}, leaves {tree.leaf_lens}"
    )
    assert tree.logical_tokens == 971
    assert ratio <= 0.45


# ----------------------------------------------------------------------------------------------- layer functions

DTYPES = [torch.float32, torch.bfloat16]


@st.composite
def small_trees(draw):
    """Small requests whose root and question nodes straddle 64-token chunk boundaries."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    root = [rng.randrange(100, 1000) for _ in range(draw(st.sampled_from([0, 1, 63, 64, 65, 127, 130])))]
    candidates, groups = [], []
    for r in range(draw(st.integers(1, 3))):
        question = [rng.randrange(100, 1000) for _ in range(draw(st.integers(0, 70)))]
        for o in range(draw(st.integers(1, 3))):
            leaf = [rng.randrange(100, 1000) for _ in range(draw(st.integers(0, 30)))]
            candidates.append(root + [r + 1] + question + [o + 1] + leaf)
            groups.append(r)
    return candidates, groups


def gdn_inputs(num_rows: int, dtype: torch.dtype, seed: int):
    """Packed GDN core inputs with the tiny twin's heads; g as -exp(A_log) * softplus(a + dt_bias) in fp32."""
    gen = torch.Generator().manual_seed(seed)
    h, hv, d = TINY.linear_num_key_heads, TINY.linear_num_value_heads, TINY.linear_key_head_dim
    q = torch.randn(num_rows, h, d, generator=gen).to(dtype)
    k = torch.randn(num_rows, h, d, generator=gen).to(dtype)
    v = torch.randn(num_rows, hv, d, generator=gen).to(dtype)
    a = torch.randn(num_rows, hv, generator=gen)
    g = -torch.exp(torch.rand(hv, generator=gen) * 2 - 1) * F.softplus(a + 0.5)
    beta = torch.sigmoid(torch.randn(num_rows, hv, generator=gen)).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8, deadline=None)
@given(request_tokens=small_trees(), seed=st.integers(0, 2**31))
def test_conv_tree_matches_flat_and_hf(dtype, request_tokens, seed):
    """The tree conv equals the flat conv bitwise; against reference.ops.causal_conv1d_silu (HF's torch path) per
    candidate: bitwise in bf16.

    In fp32, F.conv1d on this CPU rounds differently depending on the sequence length (a vectorised body and a
    scalar tail), so it is not prefix-invariant itself and no shared layout can match it bitwise: bounded there by the
    rounding of two orders of the W fp32 products and sum (each within W·u·Σ|x·w| of the exact sum, u = 2^-24), carried
    through SiLU (slope at most 1.1), plus two roundings of SiLU's own output (`fp32_conv_silu_bound`).
    """
    candidates, groups = request_tokens
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    gen = torch.Generator().manual_seed(seed)
    channels = TINY.conv_dim
    x = torch.randn(tree.num_rows, channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, CONV_WIDTH, generator=gen) * 0.5).to(dtype)
    y_tree = tree_conv1d_silu(x, weight, tree)
    x_flat = gather_paths(x, tree)
    y_flat = tree_conv1d_silu(x_flat, weight, flat)
    assert torch.equal(gather_paths(y_tree, tree), y_flat)
    cu = flat.path_cu_seqlens.tolist()
    hf = torch.cat([ops.causal_conv1d_silu(x_flat[s:e], weight) for s, e in zip(cu[:-1], cu[1:])])
    if dtype == torch.bfloat16:
        assert torch.equal(y_flat, hf)
    else:
        assert ((y_flat - hf).abs() <= fp32_conv_silu_bound(x_flat, weight, cu, hf)).all()


def fp32_conv_silu_bound(x: torch.Tensor, weight: torch.Tensor, cu: list[int], y: torch.Tensor) -> torch.Tensor:
    """Per element, how far two fp32 evaluations of silu(Σ_w x·w) that add the W products in different orders can
    differ: 2·W·u·Σ_w |x·w| (each order within W·u·Σ|x·w| of the exact sum, products rounded once), times SiLU's
    largest slope 1.1, plus 4·u·|y| (SiLU's output rounded in each), u = 2^-24. Σ|x·w| is the causal conv of |x| with
    |w| per sequence, in fp64."""
    width, u = weight.shape[1], 2.0**-24
    magnitude = torch.cat([
        F.conv1d(x[s:e].t().unsqueeze(0).abs().double(), weight.abs().double().unsqueeze(1), padding=width - 1,
                 groups=x.shape[1])[0, :, : e - s].t()
        for s, e in zip(cu[:-1], cu[1:])
    ])  # fmt: skip
    return (1.1 * 2 * width * u * magnitude + 4 * u * y.abs().double()).to(y.dtype)


@pytest.mark.parametrize("mode", ["replicated", "handoff"])
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8, deadline=None)
@given(request_tokens=small_trees(), seed=st.integers(0, 2**31))
def test_gdn_core_tree_matches_flat(mode, dtype, request_tokens, seed):
    """Bitwise, torch chunk core: every candidate's rows of the tree run equal its rows in the unshared run."""
    candidates, groups = request_tokens
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    q, k, v, g, beta = gdn_inputs(tree.num_rows, dtype, seed)
    poisoned = torch.full((tree.num_rows, *v.shape[1:]), float("nan"), dtype=dtype)
    o_tree = tree_gdn_core(
        q, k, v, g, beta, tree, mode=mode, core=torch_chunk_core, out=poisoned, use_qk_l2norm_in_kernel=True
    )
    per_path = [gather_paths(t, tree).unsqueeze(0) for t in (q, k, v, g, beta)]
    o_flat, _ = torch_chunk_core(
        *per_path,
        cu_seqlens=flat.path_cu_seqlens,
        cu_seqlens_cpu=flat.path_cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=True,
    )
    assert not o_tree.isnan().any()
    assert torch.equal(gather_paths(o_tree, tree), o_flat[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_split_alignment_measured(dtype):
    """Why the hand-off splits at multiples of 64: an aligned split is bitwise, an unaligned one departs (printed)."""
    q, k, v, g, beta = (t.unsqueeze(0) for t in gdn_inputs(300, dtype, seed=11))
    whole, _ = torch_chunk_core(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 300]), use_qk_l2norm_in_kernel=True)
    departures = {}
    for split in (64, 128, 100, 130):
        first = [t[:, :split] for t in (q, k, v, g, beta)]
        rest = [t[:, split:] for t in (q, k, v, g, beta)]
        o1, state = torch_chunk_core(
            *first, cu_seqlens=torch.tensor([0, split]), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        o2, _ = torch_chunk_core(
            *rest, cu_seqlens=torch.tensor([0, 300 - split]), initial_state=state, use_qk_l2norm_in_kernel=True
        )
        departures[split] = (torch.cat([o1, o2], 1).float() - whole.float()).abs().max().item()
    print(f"{dtype}: max |o_split - o_whole| by split position: {departures}")
    assert departures[64] == 0 and departures[128] == 0
    assert 0 < departures[100] < (1e-5 if dtype == torch.float32 else 2e-2)


def attention_inputs(num_rows: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = TINY.num_attention_heads, TINY.num_key_value_heads, TINY.head_dim
    q = torch.randn(num_rows, hq, d, generator=gen).to(dtype)
    k = torch.randn(num_rows, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_rows, hkv, d, generator=gen).to(dtype)
    return q, k, v


def shared_row_spread(y_paths: torch.Tensor, plan: TreePlan) -> float:
    """Max over packed rows of the spread between the copies of that row in different candidates' flat results."""
    rep = scatter_rows(y_paths, plan)  # the representative copy of each row
    return (y_paths.float() - gather_paths(rep, plan).float()).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=6, deadline=None)
@given(request_tokens=small_trees(), seed=st.integers(0, 2**31))
def test_attention_paths_mode_bitwise(dtype, request_tokens, seed):
    """Bitwise with a prefix-invariant core (blockwise_causal_attention); the tree's mask is exercised separately."""
    candidates, groups = request_tokens
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    q, k, v = attention_inputs(tree.num_rows, dtype, seed)
    scale = TINY.head_dim**-0.5
    o_tree = tree_attention(q, k, v, tree, scale, mode="paths", core=blockwise_causal_attention)
    per_path = [gather_paths(t, tree) for t in (q, k, v)]
    o_flat = blockwise_causal_attention(*per_path, flat.path_cu_seqlens_cpu, scale)
    assert torch.equal(gather_paths(o_tree, tree), o_flat)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=6, deadline=None)
@given(request_tokens=small_trees(), seed=st.integers(0, 2**31))
def test_attention_nodes_mode_bitwise(dtype, request_tokens, seed):
    """Nodes mode (the engine's attention: queries = a node's rows, keys = its path) with the prefix-invariant core:
    tree == flat bitwise, and each packed row computed once."""
    candidates, groups = request_tokens
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    q, k, v = attention_inputs(tree.num_rows, dtype, seed)
    scale = TINY.head_dim**-0.5
    o_tree = tree_attention(q, k, v, tree, scale, mode="nodes", core=blockwise_node_core)
    per_path = [gather_paths(t, tree) for t in (q, k, v)]
    o_flat = tree_attention(*per_path, flat, scale, mode="nodes", core=blockwise_node_core)
    assert o_tree.shape == q.shape
    assert torch.equal(gather_paths(o_tree, tree), o_flat)
    assert torch.equal(o_flat, blockwise_causal_attention(*per_path, flat.path_cu_seqlens_cpu, scale))


def test_node_core_per_attention_and_device():
    """The varlen attentions run the blockwise core on the CPU (`paged_fa4` after gathering the key rows); on CUDA
    FlashAttention-4's cores refuse at build time, with the install line, where `flash-attn-4` is missing (as on every
    CPU machine); other attentions have none."""
    cpu = torch.device("cpu")
    assert node_core("varlen", cpu) is node_core("varlen_fa4", cpu) is blockwise_node_core
    assert node_core("paged_fa4", cpu) is blockwise_paged_node_core
    try:
        import flash_attn.cute.interface  # noqa: F401
    except ImportError:
        for attention in ("varlen_fa4", "paged_fa4"):
            with pytest.raises(RuntimeError, match=r"flash-attn-4\[cu13\]==4\.0\.0b40"):
                node_core(attention, torch.device("cuda"))
    with pytest.raises(ValueError, match="no node-wise core"):
        node_core("mask", cpu)


def test_flash4_cores_pass_the_pinned_call(monkeypatch):
    """Both FlashAttention-4 cores make one call with the stage's pins (causal, one split, packed GQA) and the plan's
    lengths: the key layout through cu_seqlens_k, the paged one through one-row pages, the page table and seqused_k
    (the package itself runs on CUDA only: a recorder stands in for it here)."""
    import engine.tree as tree_module

    calls = []
    monkeypatch.setattr(
        tree_module, "flash4_varlen_function", lambda: lambda *a, **kw: calls.append((a, kw)) or (a[0],)
    )
    plan = plan_tree([[7] * 9 + [1, 2], [7] * 9 + [3]], [0, 0])
    nodes, keys = plan.attention, page_keys(plan.attention)
    q, k, v = attention_inputs(plan.num_rows, torch.bfloat16, seed=3)
    pins = {"softmax_scale": 0.5, "causal": True, "num_splits": 1, "pack_gqa": True, "cu_seqlens_q": nodes.cu_seqlens_q,
            "max_seqlen_q": nodes.max_q, "max_seqlen_k": nodes.max_k}  # fmt: skip
    assert tree_module.flash4_node_core(q, k, v, nodes, 0.5) is q
    assert tree_module.flash4_paged_node_core(q, k, v, keys, 0.5) is q
    (args, laid_out), (paged_args, paged) = calls
    assert args == (q, k, v) and laid_out == pins | {"cu_seqlens_k": nodes.cu_seqlens_k}
    assert paged_args[0] is q and paged_args[1].shape == (plan.num_rows, 1, *k.shape[1:])
    assert torch.equal(paged_args[1][:, 0], k) and torch.equal(paged_args[2][:, 0], v)
    assert paged == pins | {"seqused_k": keys.seqused_k, "page_table": keys.page_table}


def test_paged_core_on_the_rows_matches_the_flat_run_bitwise():
    """`blockwise_paged_node_core` (stage `paged` on the CPU) on k and v at the tree's packed rows, through
    `page_keys`, gives every candidate the bits of the flat run on its whole path (a shared root, two questions, odd
    lengths)."""
    candidates = [[7] * 37 + [1, 2, 3], [7] * 37 + [1, 4], [7] * 37 + [9] * 11 + [5], [7] * 37 + [9] * 11 + [6, 8]]
    groups = [0, 0, 1, 1]
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    q, k, v = attention_inputs(tree.num_rows, torch.bfloat16, seed=5)
    scale = TINY.head_dim**-0.5
    o_tree = blockwise_paged_node_core(q, k, v, page_keys(tree.attention), scale)
    per_path = [gather_paths(t, tree) for t in (q, k, v)]
    o_flat = tree_attention(*per_path, flat, scale, mode="nodes", core=blockwise_node_core)
    assert o_tree.shape == q.shape and torch.isfinite(o_tree).all()
    assert torch.equal(gather_paths(o_tree, tree), o_flat)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_mask_mode_bounded(dtype):
    """Mask mode against an fp64 per-candidate reference (bounded), with the CPU SDPA figures printed.

    Measured on this CPU (torch 2.13): per-candidate causal SDPA is not prefix-invariant (a row shared by several
    candidates gets different bits in each), so neither mask mode nor paths mode with SDPA can be bitwise against
    it; the printed spread is that figure.
    """
    candidates, groups = synthetic_request(9, 3, [3, 2, 0], 150, [20, 0, 0])
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    q, k, v = attention_inputs(tree.num_rows, dtype, seed=5)
    scale = TINY.head_dim**-0.5
    per_path = [gather_paths(t, tree) for t in (q, k, v)]
    exact = sdpa_varlen_causal(*(t.double() for t in per_path), flat.path_cu_seqlens_cpu, scale)
    o_mask = gather_paths(tree_attention(q, k, v, tree, scale, mode="mask"), tree)
    o_flat_sdpa = sdpa_varlen_causal(*per_path, flat.path_cu_seqlens_cpu, scale)
    o_flat_mask = tree_attention(*per_path, flat, scale, mode="mask")
    o_paths = tree_attention(q, k, v, tree, scale, mode="paths")
    o_paths_sdpa = gather_paths(o_paths, tree)
    err = {
        "tree mask vs fp64": (o_mask.double() - exact).abs().max().item(),
        "flat SDPA vs fp64": (o_flat_sdpa.double() - exact).abs().max().item(),
        "tree mask vs flat SDPA": (o_mask.float() - o_flat_sdpa.float()).abs().max().item(),
        "tree mask vs flat mask": (o_mask.float() - o_flat_mask.float()).abs().max().item(),
        "tree paths(SDPA) vs flat SDPA": (o_paths_sdpa.float() - o_flat_sdpa.float()).abs().max().item(),
        "flat SDPA shared-row spread": shared_row_spread(o_flat_sdpa, tree),
    }
    print(f"{dtype} attention, max abs: {err}")
    bound = 2 * err["flat SDPA vs fp64"] if dtype == torch.bfloat16 else 1e-5
    assert err["tree mask vs fp64"] <= bound
    assert torch.equal(o_paths, scatter_rows(o_flat_sdpa, tree))  # paths mode = flat SDPA of the representative


def test_blockwise_attention_prefix_invariant_and_accurate():
    """Row i of blockwise_causal_attention is bitwise independent of later rows and of the sequence length."""
    q, k, v = attention_inputs(300, torch.bfloat16, seed=3)
    scale = TINY.head_dim**-0.5
    whole = blockwise_causal_attention(q, k, v, torch.tensor([0, 300]), scale)
    gen = torch.Generator().manual_seed(4)
    for keep, length in ((1, 1), (63, 70), (64, 64), (65, 129), (200, 257)):
        q2, k2, v2 = (t[:length].clone() for t in (q, k, v))
        for t in (q2, k2, v2):
            t[keep:] = torch.randn(t[keep:].shape, generator=gen).to(t.dtype)
        assert torch.equal(
            blockwise_causal_attention(q2, k2, v2, torch.tensor([0, length]), scale)[:keep], whole[:keep]
        )
    for first_query in (0, 63, 64, 130, 299):  # queries at the end of their keys (bottom-right causal)
        part = blockwise_causal_attention(
            q[first_query:], k, v, torch.tensor([0, 300 - first_query]), scale, cu_seqlens_k_cpu=torch.tensor([0, 300])
        )
        assert torch.equal(part, whole[first_query:])
    with pytest.raises(ValueError, match="queries"):
        blockwise_causal_attention(
            q, k[:10], v[:10], torch.tensor([0, 300]), scale, cu_seqlens_k_cpu=torch.tensor([0, 10])
        )
    exact = sdpa_varlen_causal(q.double(), k.double(), v.double(), torch.tensor([0, 300]), scale)
    sdpa = sdpa_varlen_causal(q, k, v, torch.tensor([0, 300]), scale)
    assert (whole.double() - exact).abs().max() <= (sdpa.double() - exact).abs().max()


def test_layer_functions_reject_bad_shapes():
    candidates, groups = synthetic_request(1, 2, [2, 0], 10, [0, 0])
    tree = plan_tree(candidates, groups)
    n = tree.num_rows
    with pytest.raises(ValueError, match="rows"):
        tree_conv1d_silu(torch.randn(n + 1, 8), torch.randn(8, 4), tree)
    with pytest.raises(ValueError, match="conv weight"):
        tree_conv1d_silu(torch.randn(n, 8), torch.randn(8, 3), tree)
    q, k, v, g, beta = gdn_inputs(n, torch.float32, seed=0)
    with pytest.raises(ValueError, match="unknown GDN tree mode"):
        tree_gdn_core(q, k, v, g, beta, tree, mode="state")
    with pytest.raises(ValueError, match="beta has"):
        tree_gdn_core(q, k, v, g, beta[:-1], tree)
    qa, ka, va = attention_inputs(n, torch.float32, seed=0)
    with pytest.raises(ValueError, match="unknown tree attention mode.*'nodes'"):
        tree_attention(qa, ka, va, tree, 0.125, mode="dense")
    with pytest.raises(ValueError, match="unknown tree attention backend"):
        tree_attention(qa, ka, va, tree, 0.125, backend="eager")
    with pytest.raises(ValueError, match="mode 'nodes' takes the node core"):
        tree_attention(qa, ka, va, tree, 0.125, mode="nodes")


# ------------------------------------------------------------------------------------- two-layer composition (tiny)


def tiny_layer_params(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for one GDN layer and one attention layer of the tiny twin, merged GEMM layout."""
    gen = torch.Generator().manual_seed(seed)
    s = TINY

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    hv, hid = s.linear_num_value_heads, s.hidden_size
    return {
        "embed": randn(512, hid),
        "gdn_in_norm": randn(hid, scale=0.1),
        "gdn_in": randn(s.gdn_in_width, hid, scale=hid**-0.5),
        "conv": randn(s.conv_dim, CONV_WIDTH, scale=0.5),
        "A_log": torch.log(torch.rand(hv, generator=gen) * 15 + 1),
        "dt_bias": torch.randn(hv, generator=gen),
        "gdn_norm": 1 + randn(s.linear_value_head_dim, scale=0.1),
        "gdn_out": randn(hid, s.linear_value_dim, scale=s.linear_value_dim**-0.5),
        "attn_in_norm": randn(hid, scale=0.1),
        "attn_in": randn(s.attn_in_width, hid, scale=hid**-0.5),
        "q_norm": randn(s.head_dim, scale=0.1),
        "k_norm": randn(s.head_dim, scale=0.1),
        "attn_out": randn(hid, s.num_attention_heads * s.head_dim, scale=(s.num_attention_heads * s.head_dim) ** -0.5),
        "final_norm": randn(hid, scale=0.1),
    }


def position_invariant_gates(a, b, A_log, dt_bias):
    """ops.gdn_gates on rows zero-padded to a multiple of 32, then cut back.

    On the CPU, softplus and sigmoid compute the last (N * Hv) mod 16 elements of a tensor in a scalar tail that rounds
    differently from the SIMD body (measured: most random lengths differ in the last fp32 bit), so with the tiny
    twin's 6 value heads a row's bits would depend on N and tree and flat could differ. Padding puts every real
    element in the body. (The 27B's 48 heads make N * Hv a multiple of 16 for every N; CUDA has no such tail.)
    """
    pad = -a.shape[0] % 32
    g, beta = ops.gdn_gates(F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad)), A_log, dt_bias)
    return g[: a.shape[0]], beta[: a.shape[0]]


def two_layer_forward(plan: TreePlan, p: dict[str, torch.Tensor], gdn_mode: str, attention_mode: str) -> torch.Tensor:
    """Embedding, one GDN layer, one attention layer, final norm over a plan's packed rows; [C, hidden] at read rows.

    Row-wise ops are the reference compositions (reference/ops.py) and GEMMs run over the plan's rows; conv, GDN core
    and attention are the tree functions. What a backbone's forward looks like with the tree switched in.
    """
    s, eps = TINY, TINY.rms_norm_eps
    x = F.embedding(plan.token_ids % p["embed"].shape[0], p["embed"])  # [N, hidden]
    cos, sin = ops.rope_cos_sin(plan.positions, s.rotary_dim, s.rope_theta, dtype=x.dtype)
    # GDN layer
    _, normed = ops.residual_rmsnorm(x, None, p["gdn_in_norm"], eps)
    hv, n = s.linear_num_value_heads, plan.num_rows
    qkv, z, b, a = ops.linear(normed, p["gdn_in"]).split([s.conv_dim, s.linear_value_dim, hv, hv], -1)
    q, k, v = tree_conv1d_silu(qkv, p["conv"], plan).split([s.linear_key_dim, s.linear_key_dim, s.linear_value_dim], -1)
    g, beta = position_invariant_gates(a, b, p["A_log"], p["dt_bias"])
    q, k = (t.reshape(n, s.linear_num_key_heads, s.linear_key_head_dim) for t in (q, k))
    o = tree_gdn_core(q, k, v.reshape(n, hv, -1), g, beta, plan, mode=gdn_mode, use_qk_l2norm_in_kernel=True)
    y = ops.gated_rmsnorm(o, z.reshape(n, hv, -1), p["gdn_norm"], eps).reshape(n, -1)
    residual, normed = ops.residual_rmsnorm(x, ops.linear(y, p["gdn_out"]), p["attn_in_norm"], eps)
    # attention layer
    hq, hkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
    q_gate, k, v = ops.linear(normed, p["attn_in"]).split([2 * hq * d, hkv * d, hkv * d], -1)
    query, gate = q_gate.reshape(n, hq, 2 * d).chunk(2, dim=-1)
    q = ops.apply_partial_rope(ops.rmsnorm_1p(query, p["q_norm"], eps), cos, sin)
    k = ops.apply_partial_rope(ops.rmsnorm_1p(k.reshape(n, hkv, d), p["k_norm"], eps), cos, sin)
    core = blockwise_causal_attention if attention_mode == "paths" else None
    attn = tree_attention(q, k, v.reshape(n, hkv, d), plan, d**-0.5, mode=attention_mode, core=core)
    gated = ops.attention_gate(attn.reshape(n, hq * d), gate.reshape(n, hq * d))
    residual = ops.residual_add(residual, ops.linear(gated, p["attn_out"]))
    return ops.rmsnorm_1p(residual, p["final_norm"], eps).index_select(0, plan.read_rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gdn_mode", ["replicated", "handoff"])
@settings(max_examples=3, deadline=None)
@given(request_tokens=small_trees(), seed=st.integers(0, 2**31))
def test_two_layer_tree_matches_flat(gdn_mode, dtype, request_tokens, seed):
    """Bitwise: embedding, a GDN layer, an attention layer and the final norm over the tree's rows against the flat
    rows, GEMMs included (row-count invariant on this CPU for these shapes), attention in paths mode with the
    prefix-invariant core. Mask-mode attention: bounded."""
    candidates, groups = request_tokens
    tree, flat = plan_tree(candidates, groups), plan_flat(candidates, groups)
    params = tiny_layer_params(dtype, seed)
    got = two_layer_forward(tree, params, gdn_mode, "paths")
    want = two_layer_forward(flat, params, "replicated", "paths")
    assert torch.equal(got, want)
    masked = two_layer_forward(tree, params, gdn_mode, "mask")
    assert (masked.float() - want.float()).abs().max() <= 2**-4 * want.float().abs().max()
