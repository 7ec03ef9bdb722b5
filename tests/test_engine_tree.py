"""Stage `tree` (prefix tree in the engine backbone) against the same engine with the tree off, on the CPU.

Tiny twin, synthetic weights (bf16; the engine's GEMMs and kernels take bf16 only, so there is no fp32 whole-model run:
the fp32 layer-function checks are in tests/test_tree.py). "Tree off with the same kernels" is the flat plan through
the same forward: the flat layout with varlen attention (`config_of("merged", attention="varlen")`; with the
kernels, the `fused` stage itself). What is checked:
* whole forward and every hidden state, tree vs flat: bitwise (hypothesis-generated requests; reference-composition
  ops for speed, both GDN modes), and once with the fused kernels under the Triton interpreter;
* batching by question: any split of the questions over batches gives the same bits (nothing depends on the batch);
  `prepare`'s batches are `split_questions`' and its plans `plan_tree`'s at budgets around the request's rows (a
  request whose tree fits is one batch, planned from that tree's layout);
* the drone request: rows computed (<= 45% of 971), the service's `prefix_cache` metadata, identical probabilities;
* kernel launches of one forward, counted on the CPU (torch ops that launch a kernel, Triton launches, GDN core and
  attention calls) and scaled to the 27B's 48 + 16 layers: the predicted CUDA kernel count is printed and its
  structure asserted (what each layer launches, no stray copies).
Synthetic weights: the probabilities mean nothing for accuracy; only their equality between layouts is tested.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is first imported (by engine.backbone)

import triton  # noqa: E402

from engine.backbone import EngineBackbone  # noqa: E402
from engine.plan import plan_tree, tree_layout  # noqa: E402
from engine.planner import split_questions  # noqa: E402
from engine.stages import build_engine, config_of  # noqa: E402
from engine.weights import MergedWeights  # noqa: E402
from kernels import activations  # noqa: E402
from reference.shapes import QWEN38_27B, TINY  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402

SEED = 5
DRONE_LOGICAL_TOKENS = 971
FLA_KERNELS_PER_CALL = 5  # FLA 0.6.0 GDN forward kernels: local cumsum, kkt+solve, w/u, h, o
# the RoPE tables, computed inside the forward from the plan's positions (so that a CUDA graph replays them): the
# torch ops the counter sees (the cat of the two frequency halves is not among them)
ROPE_TORCH_OPS = {"_to_copy": 3, "mul": 1, "cos": 1, "sin": 1}
ROPE_OPS = sum(ROPE_TORCH_OPS.values())
# + the zero fill of the solve buffer A: per call in FLA's function, once per call layout and batch forward in
# kernels.gdn_core.FlaForwardCore (the `fused` and `tree` core on CUDA)
FLA_FINAL_STATE_FILL = 1  # + a zero fill of the final state when a call keeps it (handoff)
MERGED_TREE = config_of("merged", layout="tree", attention="varlen")  # the tree over the reference compositions


@pytest.fixture(scope="module")
def merged_weights() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=SEED))


@st.composite
def requests(draw):
    """Token lists: shared root | question text | option, roots and question nodes straddling 64-row chunks."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    root = [rng.randrange(100, 150_000) for _ in range(draw(st.sampled_from([0, 1, 40, 63, 64, 65, 130])))]
    candidates, groups = [], []
    for r in range(draw(st.integers(1, 3))):
        question = [rng.randrange(100, 150_000) for _ in range(draw(st.integers(0, 70)))]
        for o in range(draw(st.integers(1, 3))):
            leaf = [rng.randrange(100, 150_000) for _ in range(draw(st.integers(0, 20)))]
            candidates.append(root + [r + 1] + question + [o + 1] + leaf)
            groups.append(r)
    return candidates, groups


def assert_same_states(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) == TINY.num_layers + 2
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"state {i} departs (0 = embedding, i = layer i-1, last = final norm)"


# ------------------------------------------------------------------------------------------------- tree vs flat


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_tokens=requests())
def test_tree_matches_flat_bitwise(merged_weights, request_tokens):
    """Reference-composition ops: the whole forward and every hidden state, tree (cost-rule mode, replicated,
    handoff) == flat, bit for bit; the tree never computes more rows."""
    candidates, groups = request_tokens
    flat = build_engine(merged_weights, "merged", attention="varlen")
    flat_rows = flat.prepare(candidates, groups)
    want_last = flat.forward(flat_rows)
    want_states = flat.hidden_states(flat_rows)
    for gdn_mode in ("cost", "replicated", "handoff"):
        tree = build_engine(merged_weights, MERGED_TREE, gdn_mode=gdn_mode)
        tree_rows = tree.prepare(candidates, groups)
        assert tree.rows_computed(tree_rows) <= flat.rows_computed(flat_rows) == sum(map(len, candidates))
        assert torch.equal(tree.forward(tree_rows), want_last), f"gdn_mode {gdn_mode}: last-token states depart"
        assert_same_states(tree.hidden_states(tree_rows), want_states)


def test_batching_by_question_changes_no_bit(merged_weights):
    """Questions interleaved in candidate order, split over batches by a small row budget: same bits as one batch.

    Every batch is its own plan; its rows follow split_questions' count (checked against the plan) and stay within
    the budget unless one question alone exceeds it.
    """
    rng = random.Random(3)
    root = [rng.randrange(100, 150_000) for _ in range(70)]
    candidates, groups = [], []
    for c in range(9):
        question = c % 4  # interleaved: questions 0 1 2 3 0 1 2 3 0
        candidates.append(root + [question + 1] * 20 + [rng.randrange(100, 150_000) for _ in range(1 + c)])
        groups.append(question)
    one = build_engine(merged_weights, MERGED_TREE)
    one_rows = one.prepare(candidates, groups)
    assert len(one_rows.batches) == 1 and one_rows.order is None
    budget = 140
    split = build_engine(merged_weights, MERGED_TREE, max_batch_rows=budget)
    split_rows = split.prepare(candidates, groups)
    assert len(split_rows.batches) > 1 and split_rows.order is not None  # batches of interleaved questions
    covered = sorted(c for b in split_rows.batches for c in b.candidates)
    assert covered == list(range(len(candidates)))
    for batch in split_rows.batches:
        assert len({groups[c] for c in batch.candidates}) == batch.plan.num_questions  # whole questions only
        assert batch.plan.num_rows <= budget or batch.plan.num_questions == 1
    assert torch.equal(split.forward(split_rows), one.forward(one_rows))
    assert_same_states(split.hidden_states(split_rows), one.hidden_states(one_rows))


def test_split_questions_row_count_is_the_plans():
    """Greedy and exact: each batch's tree fits the budget (or holds one question), and adding the next batch's first
    question would not fit; so split_questions' incremental row count agrees with plan_tree's on both sides."""
    rng = random.Random(8)
    root = [rng.randrange(100, 150_000) for _ in range(30)]
    candidates = [root + [q] * rng.randrange(0, 9) + [rng.randrange(100, 150_000) for _ in range(3)] for q in range(12)]
    groups = [c // 2 for c in range(12)]

    def rows(index: list[int]) -> int:
        return plan_tree([candidates[c] for c in index], [groups[c] for c in index]).num_rows

    for budget in (1, 60, 75, 90, 120, 200, 10_000):
        batches = split_questions(candidates, groups, budget)
        assert [c for b in batches for c in b] == list(range(12))  # questions are contiguous here: order kept
        for batch, following in zip(batches, batches[1:] + [None]):
            assert rows(batch) <= budget or len({groups[c] for c in batch}) == 1
            if following is not None:
                next_question = [c for c in following if groups[c] == groups[following[0]]]
                assert rows(batch + next_question) > budget
    assert len(split_questions(candidates, groups, 10_000)) == 1
    with pytest.raises(ValueError, match="max_rows"):
        split_questions(candidates, groups, 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_tokens=requests(), slack=st.sampled_from([-1, 0, 1, 10_000]))
def test_prepare_batches_and_plans_are_split_questions_and_plan_tree(merged_weights, request_tokens, slack):
    """`prepare` takes a request whose whole tree fits the row budget (or that has one question) as one batch without
    splitting it, and plans it from that tree's layout: at budgets just under, at and over the request's rows, its
    batches are `split_questions`' and each batch's plan is `plan_tree`'s of the batch (at the batch's bucket for the
    `graphs` stage), every array equal."""
    candidates, groups = request_tokens
    budget = max(1, tree_layout(candidates, groups).rows + slack)
    want = split_questions(candidates, groups, budget)
    for stage in ("tree", "graphs"):
        batches = build_engine(merged_weights, stage, max_batch_rows=budget).prepare(candidates, groups).batches
        assert [list(batch.candidates) for batch in batches] == want
        for batch in batches:
            own, own_groups = [candidates[c] for c in batch.candidates], [groups[c] for c in batch.candidates]
            plan, expect = batch.plan, plan_tree(own, own_groups, bucket=batch.plan.bucket)
            assert plan.shape == expect.shape and torch.equal(plan.arena.buffer, expect.arena.buffer)
            assert all(torch.equal(t, expect.arena.int32[name]) for name, t in plan.arena.int32.items())
            assert torch.equal(plan.conv_taps, expect.conv_taps)
            host = ("candidate_lens", "question_of", "root_len", "question_lens", "leaf_lens", "padding_lens")
            assert all(getattr(plan, name) == getattr(expect, name) for name in host)


@pytest.mark.slow
def test_fused_tree_matches_fused_under_the_interpreter(merged_weights):
    """The `tree` stage against `fused` (its tree-off twin: same kernels, flat plan): bitwise, both GDN modes.

    Fused kernels under the Triton interpreter (slow: one request, ~200 logical tokens), root of 65 tokens (it
    straddles a chunk), a question node crossing a 64-row boundary, a one-candidate question.
    """
    if isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were compiled, not interpreted: TRITON_INTERPRET=1 was not set before `kernels` import")
    rng = random.Random(11)
    root = [rng.randrange(100, 150_000) for _ in range(65)]
    long_question = [rng.randrange(100, 150_000) for _ in range(10)]
    candidates = [root + [1] + long_question + [o] * (o + 1) for o in (2, 3)]
    candidates.append(root + [4, 5])  # a one-candidate question
    groups = [0, 0, 1]
    fused = build_engine(merged_weights, "fused")
    assert fused.name == "fused" and fused.attention == "varlen"
    want = fused.hidden_states(fused.prepare(candidates, groups))
    for gdn_mode in ("replicated", "handoff"):
        tree = build_engine(merged_weights, "tree", gdn_mode=gdn_mode)
        assert tree.name == "tree"
        assert_same_states(tree.hidden_states(tree.prepare(candidates, groups)), want)


# ------------------------------------------------------------------------------------------ drone, service metadata


def open_jev_candidates(workload: str) -> tuple[list[list[int]], list[int]]:
    """Token ids and groups of an Open-Jev workload, through the request pipeline (DecisionModel.plan's steps)."""
    from reference.data import open_jev_workloads
    from reference.service import request_candidates

    return request_candidates(open_jev_workloads()[workload]["request"])


def test_drone_rows_and_prefix_cache_metadata(shared_dir):
    """Drone through DecisionModel: <= 45% of the 971 rows computed, the response's prefix_cache block, and the same
    probabilities as the flat layout (synthetic weights: equality only, not accuracy)."""
    from reference.data import open_jev_workloads
    from reference.service import DecisionModel

    weights = synthetic_weights(TINY, seed=SEED)
    merged = MergedWeights.from_decision_weights(weights)  # weights keeps its head and temperature
    request = open_jev_workloads()["drone"]["request"]
    tree = DecisionModel(build_engine(merged, MERGED_TREE), weights, code_commit="test")
    flat = DecisionModel(build_engine(merged, "merged", attention="varlen"), weights, code_commit="test")
    plan = tree.plan(request)
    prepared = tree.backbone.prepare(plan.candidates, plan.groups)
    rows = tree.backbone.rows_computed(prepared)
    meta = tree.backbone.prefix_cache_metadata(prepared)
    print(f"drone: {rows} rows computed of {DRONE_LOGICAL_TOKENS} ({rows / DRONE_LOGICAL_TOKENS:.1%}); {meta}")
    assert sum(map(len, plan.candidates)) == DRONE_LOGICAL_TOKENS and rows <= 0.45 * DRONE_LOGICAL_TOKENS
    assert meta["enabled"] is True and meta["mode"] == "prefix_tree"
    assert meta["logical_input_tokens"] == DRONE_LOGICAL_TOKENS and meta["processed_input_tokens"] == rows
    assert meta["reused_input_tokens"] == DRONE_LOGICAL_TOKENS - rows
    assert meta["shared_prefix_tokens"] == prepared.batches[0].plan.root_len > 0
    assert meta["candidate_sequences"] == len(plan.candidates) and meta["gdn_modes"] == ["replicated"]
    tree_response, flat_response = tree.decide(request), flat.decide(request)
    assert (
        tree_response["metadata"]["prefix_cache"] == meta
        and tree_response["metadata"]["backend"] == "tree[elementwise=torch]"
    )
    assert flat_response["metadata"]["prefix_cache"] == {"enabled": False, "mode": "independent_candidates"}
    assert tree_response["answers"] == flat_response["answers"]
    assert tree_response["usage"] == flat_response["usage"]


# ------------------------------------------------------------------------------------------------ kernel launches

# aten ops that launch no kernel (views, metadata, allocation without initialisation)
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "split",
    "split_with_sizes",
    "unbind",
    "alias",
    "detach",
    "as_strided",
    "empty",
    "empty_strided",
    "new_empty",
    "lift_fresh",
}


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel by name; `total` runs on. Not counted: NO_KERNEL ops, and host scalar
    arithmetic (every tensor argument 0-dim: e.g. `kernels.norms.inverse_count`, a CPU tensor on any machine)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if name not in NO_KERNEL and not all(t.ndim == 0 for t in tensors):
            self.ops[name] += 1
            self.total += 1
        return func(*args, **(kwargs or {}))


def count_launches(engine: EngineBackbone, prepared, monkeypatch) -> dict:
    """One forward's launches with every Triton kernel counted and skipped, the GDN core and attention cores stubbed.

    Returns counters: `torch` (aten ops by name), `triton`, `gdn_calls`, `gdn_final_states`, `attention_calls`, and the
    launches inside each GDN / attention mixer (out_proj included) and in total.
    """
    from triton.runtime.interpreter import InterpretedFunction

    counts = Counter()
    counter = LaunchCounter()
    solve_layouts: set[int] = set()

    def skipped_launch(self, *args, grid, warmup, **kwargs):
        counts["triton"] += 1
        counter.total += 1

    def gdn_core(q, k, v, g, beta, *, output_final_state=False, cu_seqlens=None, chunk_indices=None, **kwargs):
        counts["gdn_calls"] += 1
        counts["gdn_final_states"] += bool(output_final_state)
        counter.total += FLA_KERNELS_PER_CALL + FLA_FINAL_STATE_FILL * bool(output_final_state)
        assert kwargs["workspace"] is prepared.batches[0].plan.arena.workspace  # FlaForwardCore's: the plan arena's
        layout = chunk_indices.data_ptr()  # one zeroed A per call layout, counted once per forward
        if layout not in solve_layouts:
            solve_layouts.add(layout)
            counts["solve_fills"] += 1
        final = q.new_empty(len(cu_seqlens) - 1, v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32)
        return v.new_empty(v.shape), final if output_final_state else None

    def node_core(q, k, v, layout, scale):
        counts["attention_calls"] += 1
        counter.total += 1
        return q.new_empty(q.shape)

    def mixer(method, key):
        def wrapped(*args):
            before = counter.total
            out = method(*args)
            counts[key] += counter.total - before
            return out

        return wrapped

    monkeypatch.setattr(InterpretedFunction, "run", skipped_launch)
    monkeypatch.setattr(engine, "_core", gdn_core)
    monkeypatch.setattr(engine, "gdn_core", "fla_forward")  # the CUDA core of `fused` and `tree`, stubbed
    monkeypatch.setattr(engine, "_node_core", node_core)
    monkeypatch.setattr(engine, "_gdn", mixer(engine._gdn, "gdn_mixers"))
    monkeypatch.setattr(engine, "_attention", mixer(engine._attention, "attention_mixers"))
    with counter:
        engine.forward(prepared)
    return {"torch": counter.ops, "total": counter.total, **counts}


def predict_27b(counts: dict) -> dict:
    """Scale a tiny-twin count (6 GDN + 2 attention layers) to the 27B (48 + 16): per-layer launches outside the
    mixer are uniform; embedding, first norm, final row gather and the solve-buffer fills happen once."""
    gdn_tiny, attn_tiny = TINY.layer_types.count("linear_attention"), TINY.layer_types.count("full_attention")
    gdn_27b, attn_27b = QWEN38_27B.layer_types.count("linear_attention"), QWEN38_27B.layer_types.count("full_attention")
    per_gdn, per_attn = counts["gdn_mixers"] / gdn_tiny, counts["attention_mixers"] / attn_tiny
    once = 3 + ROPE_OPS  # embedding, layer 0's input norm, the read-row gather, the RoPE tables
    fills = counts["solve_fills"]  # once per call layout and forward, whatever the layer count
    outside = counts["total"] - counts["gdn_mixers"] - counts["attention_mixers"] - once
    per_layer = outside / TINY.num_layers  # in_proj, post norm, gate_up, silu_mul, down, next norm
    assert per_layer == 6, f"{per_layer} launches per layer outside the mixer, expected 6"
    gemms = 4 * QWEN38_27B.num_layers
    return {
        "total": once + per_layer * QWEN38_27B.num_layers + per_gdn * gdn_27b + per_attn * attn_27b + fills,
        "per_gdn_layer": per_layer + per_gdn,
        "per_attention_layer": per_layer + per_attn,
        "gemms": gemms,
        "fla": (counts["gdn_calls"] * FLA_KERNELS_PER_CALL + counts["gdn_final_states"]) / gdn_tiny * gdn_27b + fills,
        "attention": counts["attention_calls"] / attn_tiny * attn_27b,
    }


def test_launch_counts_per_forward(merged_weights, shared_dir, monkeypatch):
    """Drone, `fused` and `tree`: launches per forward, counted on the CPU and scaled to the 27B.

    fused (flat plan): per GDN layer in_proj, prep, FLA (5), gated norm, out_proj, 2 norms, gate_up, silu, down = 14;
    per attention layer in_proj, prep, one varlen attention call, gate, o_proj + the same 5 = 10; plus embedding,
    first norm, read-row gather, the RoPE tables (6 ops) and one zero fill of FLA's solve buffer:
    10 + 48 x 14 + 16 x 10 = 842 (889 with FLA's function, which fills the buffer in every layer). No torch op besides
    the embedding gather, the RoPE tables, the GEMMs and the read-row gather (no copies, repeats or casts).
    tree (replicated GDN): the prep kernel computes each packed row once at its representative path slot and one
    launch (`kernels.gather_slots`) lays its five outputs out on the paths (kernels/gdn_prep.py v4: the kernel is
    bound by its arithmetic, so a shared row is not recomputed per path); the gated norm reads the representative
    rows and the attention prep writes k and v in the key layout through row indices: 15 launches per GDN layer,
    10 + 48 x 15 + 16 x 10 = 890, and no torch gather besides the read rows.
    """
    if isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were compiled, not interpreted: this count patches the interpreter")
    candidates, groups = open_jev_candidates("drone")
    results = {}
    for name, tree in (("fused", False), ("tree", True)):
        engine = build_engine(merged_weights, "tree" if tree else "fused")
        counts = count_launches(engine, engine.prepare(candidates, groups), monkeypatch)
        monkeypatch.undo()
        results[name] = (counts, predict_27b(counts))
    for name, (counts, p) in results.items():
        rest = p["total"] - p["gemms"] - p["fla"] - p["attention"]
        print(
            f"{name}: predicted CUDA kernels per 27B drone forward {p['total']:.0f} (GEMMs {p['gemms']}, FLA "
            f"{p['fla']:.0f}, attention {p['attention']:.0f}, rest {rest:.0f}); per GDN layer "
            f"{p['per_gdn_layer']:.0f}, per attention layer {p['per_attention_layer']:.0f}; "
            f"tiny-twin torch ops {dict(counts['torch'])}, Triton launches {counts['triton']}"
        )
    fused_counts, fused = results["fused"]
    plain_ops = {"embedding": 1, "mm": 4 * TINY.num_layers, "index_select": 1, **ROPE_TORCH_OPS}
    assert dict(fused_counts["torch"]) == plain_ops
    assert (fused["per_gdn_layer"], fused["per_attention_layer"], fused["total"]) == (14, 10, 842)
    tree_counts, tree = results["tree"]
    assert (tree["per_gdn_layer"], tree["per_attention_layer"], tree["total"]) == (15, 10, 890)
    assert dict(tree_counts["torch"]) == plain_ops  # the read rows are the only torch gather
