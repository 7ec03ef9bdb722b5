"""Plans as shape plus buffers (engine/plan.py), and the padding rule the `graphs` stage relies on, on the CPU.

* Padding: detached dummy sequences (`pad_lens`) appended to a tree or flat plan change no bit of any real row: the
  final states the head reads and every residual state of every real candidate are identical with and without them
  (hypothesis-generated requests, both GDN modes, reference-composition ops; once with the fused kernels under the
  Triton interpreter).
* Shape: hashable and host-only; two requests of equal shape share an arena, and a refilled arena gives the second
  request exactly the bits of its own fresh plan; a plan of another shape is refused by the arena.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is first imported (by engine.backbone)

from engine.backbone import EngineRows, _row_batch  # noqa: E402
from engine.plan import PAD_TOKEN_ID, PlanArena, plan_flat, plan_tree  # noqa: E402
from engine.stages import build_engine, config_of  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from reference.shapes import TINY  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402

MERGED_TREE = config_of("merged", layout="tree", attention="varlen")
PADDINGS = [(1,), (3, 64, 65), (130, 1, 7)]


@pytest.fixture(scope="module")
def merged_weights() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=13))


@st.composite
def requests(draw):
    """A shared root, 1-3 questions with their own text, 1-3 options each; roots straddling 64-row chunks."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    root = [rng.randrange(100, 150_000) for _ in range(draw(st.sampled_from([0, 5, 63, 64, 70])))]
    candidates, groups = [], []
    for r in range(draw(st.integers(1, 3))):
        question = [rng.randrange(100, 150_000) for _ in range(draw(st.integers(0, 40)))]
        for o in range(draw(st.integers(1, 3))):
            leaf = [rng.randrange(100, 150_000) for _ in range(draw(st.integers(0, 9)))]
            candidates.append(root + [r + 1] + question + [o + 1] + leaf)
            groups.append(r)
    return candidates, groups


def rows_of(engine, plan) -> EngineRows:
    """The plan as one batch of the engine (what `prepare` builds for an unpadded plan)."""
    gdn_mode = engine.gdn_mode
    batch = _row_batch(plan, range(plan.num_candidates), engine.shapes, gdn_mode, engine.attention)
    return EngineRows([batch], plan.num_candidates, None)


def outputs(engine, plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rows = rows_of(engine, plan)
    return engine.forward(rows), engine.hidden_states(rows)


def assert_same(got, want) -> None:
    (got_last, got_states), (want_last, want_states) = got, want
    assert torch.equal(got_last, want_last), "the head's rows depart"
    assert len(got_states) == len(want_states) == TINY.num_layers + 2
    for i, (g, w) in enumerate(zip(got_states, want_states)):
        assert torch.equal(g, w), f"residual state {i} departs (0 = embedding, last = final norm)"


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_tokens=requests(), padding=st.sampled_from(PADDINGS))
def test_padding_changes_no_bit_of_any_real_row(merged_weights, request_tokens, padding):
    candidates, groups = request_tokens
    for make_plan, config in ((plan_tree, MERGED_TREE), (plan_flat, config_of("merged", attention="varlen"))):
        for gdn_mode in ("replicated", "handoff"):
            engine = build_engine(merged_weights, config, gdn_mode=gdn_mode)
            plain = make_plan(candidates, groups)
            padded = make_plan(candidates, groups, pad_lens=padding)
            assert padded.num_rows == plain.num_rows + sum(padding)
            assert padded.shape.num_padding == len(padding) and padded.num_candidates == plain.num_candidates
            assert_same(outputs(engine, padded), outputs(engine, plain))


@pytest.mark.slow
def test_padding_changes_no_bit_with_the_fused_kernels(merged_weights):
    """The kernels (interpreter) read their rows through the plan's layouts: dummies reach no real row either."""
    rng = random.Random(4)
    root = [rng.randrange(100, 150_000) for _ in range(66)]
    candidates = [root + [q + 1] * 5 + [o + 1] for q in range(2) for o in range(2)]
    groups = [0, 0, 1, 1]
    engine = build_engine(merged_weights, "tree")
    plain, padded = plan_tree(candidates, groups), plan_tree(candidates, groups, pad_lens=(65, 2))
    assert_same(outputs(engine, padded), outputs(engine, plain))


def test_dummy_rows_are_detached():
    """Dummy rows: own nodes without parents, positions from 0, the pad token, their own GDN and attention sequences,
    never read by the head."""
    candidates, groups = [[7, 8, 9, 10], [7, 8, 9, 11]], [0, 0]
    plan = plan_tree(candidates, groups, pad_lens=(3, 2))
    real = plan_tree(candidates, groups).num_rows
    dummy = slice(real, plan.num_rows)
    assert plan.token_ids[dummy].tolist() == [PAD_TOKEN_ID] * 5
    assert plan.positions[dummy].tolist() == [0, 1, 2, 0, 1]
    assert (plan.row_parent[dummy] == -1).all() and (plan.row_grandparent[dummy] == -1).all()
    assert len(set(plan.row_node[dummy].tolist())) == 2
    assert plan.read_rows.tolist() == plan_tree(candidates, groups).read_rows.tolist()
    assert plan.path_cu_seqlens_cpu.tolist()[-3:] == [8, 11, 13]  # two paths of their own after the candidates'
    rows = torch.arange(plan.num_rows)
    visible = plan.visible(rows[:, None], rows[None, :])
    assert not visible[:real, real:].any() and not visible[real:, :real].any()
    with pytest.raises(ValueError, match="at least one row"):
        plan_tree(candidates, groups, pad_lens=(0,))


def test_equal_shapes_share_an_arena_refilled_in_place(merged_weights):
    """Two requests with the same sizes (other tokens): equal, hashable shapes; the second refills the first's arena
    in place and gets the bits of its own fresh plan."""
    rng = random.Random(9)

    def request():
        root = [rng.randrange(100, 150_000) for _ in range(40)]
        return [root + [1, rng.randrange(100, 150_000)], root + [2, rng.randrange(100, 150_000)]], [0, 0]

    first, second = request(), request()
    plan_a, fresh_b = plan_tree(*first), plan_tree(*second)
    assert plan_a.shape == fresh_b.shape and hash(plan_a.shape) == hash(fresh_b.shape)
    buffer = plan_a.arena.buffer.data_ptr()
    refilled_b = plan_tree(*second, arena=plan_a.arena)
    assert refilled_b.arena is plan_a.arena and refilled_b.arena.buffer.data_ptr() == buffer
    assert torch.equal(refilled_b.token_ids, fresh_b.token_ids)
    engine = build_engine(merged_weights, MERGED_TREE)
    assert_same(outputs(engine, refilled_b), outputs(engine, fresh_b))
    with pytest.raises(ValueError, match="shape differs"):
        plan_tree([[5, 6, 7]], [0], arena=plan_a.arena)
    other = PlanArena(plan_a.shape, plan_a.device)
    with pytest.raises(ValueError, match="do not match"):
        other.fill({"token_ids": plan_a.token_ids.numpy()})


def test_the_solve_workspace_is_keyed_by_arena_position_and_zeroed_per_forward():
    plan = plan_tree([[1, 2, 3, 4], [1, 2, 3, 5]], [0, 0])
    workspace = plan.arena.workspace
    chunk_indices = plan.gdn["replicated"].calls[0].chunk_indices
    like = torch.empty(0, dtype=torch.bfloat16)
    first = workspace.zeros(chunk_indices, (1, 8, 2, 64), like)
    first.fill_(3.0)
    assert workspace.zeros(chunk_indices, (1, 8, 2, 64), like) is first and (first == 3).all()  # same forward
    workspace.begin_forward()
    again = workspace.zeros(chunk_indices, (1, 8, 2, 64), like)
    assert again is first and (again == 0).all()  # zeroed at its first use in the next forward
    handoff = plan.gdn["handoff"].calls[-1].chunk_indices
    assert workspace.zeros(handoff, (1, 8, 2, 64), like) is not first  # another call layout, another buffer
