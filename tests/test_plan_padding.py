"""Plans as shape plus buffers (engine/plan.py), and the padding rule the `graphs` stage relies on, on the CPU.

* Padding: detached dummy sequences (`pad_lens`) appended to a tree or flat plan change no bit of any real row: the
  final states the head reads and every residual state of every real candidate are identical with and without them
  (hypothesis-generated requests, both GDN modes, reference-composition ops; once with the fused kernels under the
  Triton interpreter).
* Shape: hashable and host-only; two requests of equal shape share an arena, and a refilled arena gives the second
  request exactly the bits of its own fresh plan; a plan of another shape is refused by the arena.
* Buckets (stage `graphs`): the host-only layout gives the plan's sizes and the cost rule's costs; a bucketed plan has
  exactly its bucket's sizes, and two requests of one bucket launch with the same host values; padding to every
  bucket of a small grid changes no bit of any real candidate (hypothesis); the stage's CPU form (bucketed plans run
  eagerly with the fused kernels) is bitwise against `tree`; a request outside the grid or in hand-off mode runs
  eagerly and says why; the capture placeholder fits every bucket of the default grid; the graph cache holds its
  backbone's forward weakly (no reference cycle: a dropped owner is freed without the cycle collector).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is first imported (by engine.backbone)

from ablations.workloads import get_workload  # noqa: E402
from engine.graphs import (  # noqa: E402
    ROWS_GRID,
    candidate_classes,
    default_grid,
    grid_bucket,
    placeholder_request,
    slot_factors,
    smallest_bucket,
    weak_callable,
)
from engine.plan import Bucket, PlanArena, bucket_padding, plan_flat, plan_tree, tree_layout  # noqa: E402
from engine.plan_arrays import PAD_TOKEN_ID  # noqa: E402
from engine.planner import GDN_CALL_COST_CHUNKS, EngineRows, gdn_mode_costs, row_batch  # noqa: E402  # noqa: E402
from engine.stages import build_engine, config_of  # noqa: E402
from engine.tree import page_keys  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from reference.service import request_candidates  # noqa: E402
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
    batch = row_batch(plan, range(plan.num_candidates), engine.gdn_mode, engine.attention)
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


# ---------------------------------------------------------------------------------------------------------- buckets


def small_grid() -> list[Bucket]:
    """Four rows sizes, every candidate class of the default grid at each, their slot factors. The largest (288 rows,
    up to 16 candidates, 5 x rows slots) holds every request `requests()` draws (at most 283 rows, 9 candidates)."""
    return [
        grid_bucket(rows, factor, candidates)
        for rows in (64, 96, 160, 288)
        for candidates in candidate_classes(rows)
        for factor in slot_factors(candidates)
    ]


@settings(max_examples=25, deadline=None)
@given(request_tokens=requests())
def test_layout_sizes_and_cost_rule_match_the_plan(request_tokens):
    """`tree_layout` (host sizes, no plan) gives the plan's sizes and the cost rule's costs, so a batch's bucket and
    GDN mode are chosen before any plan is built."""
    candidates, groups = request_tokens
    layout, plan = tree_layout(candidates, groups), plan_tree(candidates, groups)
    call = plan.gdn["replicated"].calls[0]
    assert (layout.rows, layout.slots, layout.chunks) == (plan.num_rows, call.num_tokens, call.chunks)
    assert (layout.nodes, layout.keys) == (len(plan.attention.cu_seqlens_q_cpu) - 1, plan.attention.num_keys)
    assert (layout.max_q, layout.max_k) == (plan.attention.max_q, plan.attention.max_k)
    assert layout.gdn_mode_costs(GDN_CALL_COST_CHUNKS) == gdn_mode_costs(plan)


@settings(max_examples=25, deadline=None)
@given(request_tokens=requests())
def test_a_bucketed_plan_has_exactly_its_buckets_sizes(request_tokens):
    candidates, groups = request_tokens
    layout = tree_layout(candidates, groups)
    fitting = [b for b in small_grid() if bucket_padding(layout, b) is not None]
    for bucket in fitting:
        plan = plan_tree(candidates, groups, bucket=bucket)
        sizes = dict(plan.shape.arrays)
        assert plan.num_rows == bucket.rows and plan.bucket == bucket
        assert sizes["path_rows"] == (bucket.slots,) and sizes["path_cu_seqlens"] == (bucket.sequences + 1,)
        assert sizes["replicated.0.chunk_indices"] == (bucket.chunks, 2)
        assert sizes["attention.cu_seqlens_q"] == (bucket.nodes + 1,) and sizes["attention.key_rows"] == (bucket.keys,)
        assert sizes["read_rows"] == (bucket.candidates,)
        assert plan.shape.attention_max == (bucket.max_q, bucket.max_k)
        assert plan.conv_segments is None and list(plan.gdn) == ["replicated"]
        assert plan.read_rows[: len(candidates)].tolist() == plan_tree(candidates, groups).read_rows.tolist()
    for bucket in set(small_grid()) - set(fitting):
        with pytest.raises(ValueError, match="does not fit"):
            plan_tree(candidates, groups, bucket=bucket)


@settings(max_examples=15, deadline=None)
@given(request_tokens=requests())
def test_page_keys_lists_each_nodes_key_rows(request_tokens):
    """`engine.tree.page_keys` (stage `paged`'s page table) on the flat, tree and every fitting bucketed plan: row i
    holds node i's key rows and then only rows of the plan, seqused_k its key count, int32 as FlashAttention-4 reads
    them; dummy and empty sequences included."""
    candidates, groups = request_tokens
    layout = tree_layout(candidates, groups)
    buckets = [b for b in small_grid() if bucket_padding(layout, b) is not None][:3]
    plans = [plan_flat(candidates, groups), plan_tree(candidates, groups)]
    plans += [plan_tree(candidates, groups, bucket=bucket) for bucket in buckets]
    for plan in plans:
        nodes = plan.attention
        keys = page_keys(nodes)
        bounds = nodes.cu_seqlens_k_cpu.tolist()
        assert keys.nodes is nodes and keys.page_table.dtype == keys.seqused_k.dtype == torch.int32
        assert keys.page_table.shape == (len(bounds) - 1, max(1, nodes.max_k))
        assert keys.seqused_k.tolist() == [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        assert 0 <= int(keys.page_table.min()) and int(keys.page_table.max()) < plan.num_rows
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            assert keys.page_table[i, : end - start].tolist() == nodes.key_rows[start:end].tolist()


def test_equal_bucketed_shapes_launch_the_same_parameters():
    """Two requests of one bucket: equal shapes, and then every host value a launch reads is equal too (array sizes,
    GDN call flags and counts, conv flags, attention maxima)."""
    bucket = grid_bucket(96, 2)
    a = plan_tree([[5] * 30 + [1, 2], [5] * 30 + [1, 3]], [0, 0], bucket=bucket)
    b = plan_tree([[7] * 10 + [4] * 9, [7] * 10 + [4] * 9 + [8], [7] * 10 + [9]], [0, 0, 1], bucket=bucket)
    placeholder = plan_tree(*placeholder_request(), bucket=bucket)  # what the graph of the bucket is captured on
    assert a.shape == b.shape == placeholder.shape
    for name, view in a.arena.views.items():
        assert view.shape == b.arena.views[name].shape, name
    call_a, call_b = a.gdn["replicated"].calls[0], b.gdn["replicated"].calls[0]
    host = ("keep_final", "chunks", "rows_start", "out_start", "num_sequences")
    assert [getattr(call_a, f) for f in host] == [getattr(call_b, f) for f in host]
    assert (a.attention.max_q, a.attention.max_k, a.attention.keys_are_rows) == (
        b.attention.max_q, b.attention.max_k, b.attention.keys_are_rows)  # fmt: skip
    flags = ("rows_are_packed", "keep_all", "keep_rows_are_packed")
    assert [getattr(a.conv_paths, f) for f in flags] == [getattr(b.conv_paths, f) for f in flags]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_tokens=requests())
def test_padding_to_every_bucket_changes_no_bit(merged_weights, request_tokens):
    """Two buckets of a small grid the request fits (reference-composition ops, replicated mode): the smallest (the
    tightest padding) and the smallest of the largest candidate class (the most dummy sequences, nodes and chunks).
    In both the head's rows and every residual state of every real candidate are those of the unpadded plan."""
    candidates, groups = request_tokens
    engine = build_engine(merged_weights, MERGED_TREE, gdn_mode="replicated")
    want = outputs(engine, plan_tree(candidates, groups))
    layout = tree_layout(candidates, groups)
    fitting = [bucket for bucket in small_grid() if bucket_padding(layout, bucket) is not None]
    assert fitting, "every request of the strategy fits some bucket of the small grid"
    tightest = smallest_bucket(layout, fitting)
    widest = smallest_bucket(layout, [b for b in fitting if b.candidates == max(f.candidates for f in fitting)])
    for bucket in dict.fromkeys([tightest, widest]):
        plan = plan_tree(candidates, groups, bucket=bucket)
        rows = rows_of(engine, plan)
        last = engine.forward(rows)[: len(candidates)]
        assert_same((last, engine.hidden_states(rows)), want)


def test_bucketed_forward_matches_unpadded_bitwise(merged_weights):
    """The `graphs` stage's CPU gate: its CPU form (bucketed plans, run eagerly, fused kernels under the interpreter)
    against `tree` on the same requests: bitwise; the metadata names the bucket; the CPU has no graphs to hit."""
    rng = random.Random(5)
    root = [rng.randrange(100, 150_000) for _ in range(70)]
    candidates = [root + [q + 1] + [rng.randrange(100, 150_000) for _ in range(q * 4)] + [o + 1]
                  for q in range(2) for o in range(3)]  # fmt: skip
    groups = [0, 0, 0, 1, 1, 1]
    tree, graphs = build_engine(merged_weights, "tree"), build_engine(merged_weights, "graphs")
    assert graphs.config.graphs and graphs.graphs is None  # no CUDA graphs on the CPU; the plans are still padded
    want, prepared = tree.prepare(candidates, groups), graphs.prepare(candidates, groups)
    assert prepared.batches[0].plan.bucket is not None
    assert prepared.rows_computed > want.rows_computed
    assert torch.equal(graphs.forward(prepared), tree.forward(want))
    assert all(torch.equal(g, w) for g, w in zip(graphs.hidden_states(prepared), tree.hidden_states(want)))
    meta = graphs.graph_metadata(prepared)
    assert meta["bucket"] == prepared.batches[0].plan.bucket.name and meta["hit"] is False


def test_prefix_cache_counts_no_padding_row_as_a_token(merged_weights):
    """A bucket's dummy rows are computed but are no input tokens: `graphs` reports the token counts of `tree` (a
    request of little sharing, where the bucket pads more rows than the tree shares: the reused count was negative),
    and the padding on its own (the GDN core's tokens, a count of computed slots, include the bucket's dummy paths)."""
    rng = random.Random(11)
    root = [rng.randrange(100, 150_000) for _ in range(5)]
    candidates = [root + [rng.randrange(100, 150_000) for _ in range(9 + o)] for o in range(3)]
    tree, graphs = build_engine(merged_weights, "tree"), build_engine(merged_weights, "graphs")
    want, prepared = tree.prepare(candidates, [0] * 3), graphs.prepare(candidates, [0] * 3)
    meta, tree_meta = graphs.prefix_cache_metadata(prepared), tree.prefix_cache_metadata(want)
    padding = prepared.rows_computed - want.rows_computed
    assert prepared.batches[0].plan.bucket is not None and padding > meta["logical_input_tokens"] - want.rows_computed
    assert meta["gdn_core_tokens"] > tree_meta["gdn_core_tokens"]
    same = {key: meta[key] for key in tree_meta if key != "gdn_core_tokens"}
    assert same == {key: tree_meta[key] for key in same} | {"padding_rows": padding} and tree_meta["padding_rows"] == 0
    assert meta["processed_input_tokens"] == want.rows_computed
    assert meta["reused_input_tokens"] == 3 * 5 - 5 >= 0  # the root's tokens, computed once for three candidates


def test_requests_outside_the_grid_run_eagerly_and_say_why(merged_weights):
    graphs = build_engine(merged_weights, "graphs")
    many = [[3, 4, c + 10] for c in range(40)]  # 40 candidates: more than any bucket holds
    prepared = graphs.prepare(many, [0] * 40)
    assert prepared.batches[0].plan.bucket is None and prepared.batches[0].eager_reason == "outside grid"
    long_root = [rng_token % 150_000 + 100 for rng_token in range(3000)]
    handoff = graphs.prepare([long_root + [1, o + 2] for o in range(6)], [0] * 6)
    assert handoff.batches[0].eager_reason == "handoff" and handoff.batches[0].gdn_mode == "handoff"
    assert (
        tree_layout(many, [0] * 40).rows < 1280 and smallest_bucket(tree_layout(many, [0] * 40), default_grid()) is None
    )
    meta = graphs.graph_metadata(prepared)
    assert meta == {"bucket": None, "hit": False, "eager_reasons": ["outside grid"]}


def test_the_capture_placeholder_fits_every_bucket_of_the_grid():
    """Every bucket can be captured on the placeholder, and its shape is that of a real request in the bucket."""
    grid = default_grid()
    assert len(grid) == len(set(grid)) == 280  # the start-time budget: engine/graphs.py, "The grid"
    assert max(b.rows for b in grid) == ROWS_GRID[-1] and {b.rows for b in grid} == set(ROWS_GRID)
    placeholder = tree_layout(*placeholder_request())
    assert all(bucket_padding(placeholder, bucket) is not None for bucket in grid)
    rng = random.Random(2)
    for bucket in grid[::7]:
        root = [rng.randrange(100, 150_000) for _ in range(bucket.rows // 2)]
        request = [root + [1, 2], root + [1, 3]], [0, 0]
        if bucket_padding(tree_layout(*request), bucket) is not None:
            real = plan_tree(*request, bucket=bucket)
            assert real.shape == plan_tree(*placeholder_request(), bucket=bucket).shape, bucket.name


def test_the_rows_step_is_64_from_512_to_the_largest_size():
    """Above 512 rows the step is 64 up to the largest size (the grid before had 1,152 after 1,024): the 27B's
    customer_service request, 1,032 rows, lands in a 1,088-row bucket (engine/graphs.py, "How it was chosen")."""
    above = [rows for rows in ROWS_GRID if rows >= 512]
    assert [b - a for a, b in zip(above, above[1:])] == [64] * (len(above) - 1) and above[-1] == 1280
    layout = tree_layout(*request_candidates(get_workload("customer_service").request))
    assert layout.rows == 1032 and smallest_bucket(layout, default_grid()).rows == 1088


def _tensors(obj, path: str):
    """Every tensor reachable from a plan's dataclass fields (lists, tuples and dicts followed), with its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _tensors(item, f"{path}[{key!r}]")


@settings(max_examples=15, deadline=None)
@given(request_tokens=requests())
def test_a_moved_plan_leaves_no_index_array_behind(request_tokens):
    """`TreePlan.to` (how a host-built bucketed plan runs eagerly on CUDA) moves every tensor a kernel reads: on the
    `meta` device, every tensor of the moved plan is there but the declared host fields (the `*_cpu` copies the
    launches read on the host), and the host plan is left as it was."""
    candidates, groups = request_tokens
    layout = tree_layout(candidates, groups)
    bucket = smallest_bucket(layout, default_grid())
    plan = plan_tree(candidates, groups, bucket=bucket, layout=layout)
    moved = plan.to("meta")
    left = [p for p, t in _tensors(moved, "plan") if t.device.type != "meta"]
    assert left and all(p.endswith("_cpu") for p in left), left
    assert all(t.device.type == "cpu" for _, t in _tensors(plan, "plan"))


def test_the_graph_cache_holds_its_owners_forward_weakly():
    """`weak_callable`, what `GraphCache` keeps of the forward it captures (CUDA only, so its owner is modelled here):
    a bound method is held weakly, so an owner that keeps its cache (as `EngineBackbone.graphs` does) is freed by
    reference counting alone, and a call after that says so; a plain function is held."""

    class Owner:
        def __init__(self):
            self.cache = weak_callable(self.forward)

        def forward(self, rows: int) -> int:
            return 2 * rows

    owner = Owner()
    held, alive = owner.cache, weakref.ref(owner)
    assert held()(21) == 42
    gc.disable()
    try:
        del owner
        assert alive() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="is gone"):
        held()
    assert weak_callable(len)()([1, 2]) == 2
