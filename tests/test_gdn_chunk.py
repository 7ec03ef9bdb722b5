"""CPU tests of the fused chunked gated-delta-rule forward (`kernels/gdn_chunk.py`, Triton interpreter) against the
fp32 token-by-token oracle `reference.ops.gdn_recurrent`, and its invariances, bit for bit.

Inputs: fresh seeded random tensors (never zeros) at small odd sizes: GVA 2 -> 6 heads, K = 32, V = 16 and 1 -> 2
heads, K = 16, V = 32 (and V = 128 for the tree walk: two value blocks a head, as the 27B); sequences of 1, 63, 64, 65
and 130 tokens packed together; nonzero initial states; q/k L2-normalised by FLA's l2norm numerics
(`reference.ops.l2norm_fla`, what the prep kernel hands the core); g the log decay -exp(A_log) softplus(a + dt_bias);
outputs NaN-poisoned before each launch.

The error bounds (relative RMSE over a call's rows, rmse(Δ) / rms(reference); and max |Δ| against max |reference|)
are `tests.cases.gdn_chunk_bounds`, derived there from first-order rounding-error counts and never fitted: at K = 32
or 16 and 130 tokens (3 chunks) 9.9e-5 and 9.0e-5 without rounding points (fp32 mode), 0.055 with FLA's.
Measured here, for scale: fp32 mode ~4e-7, bf16 mode ~3.5e-3 (far inside both).

Bitwise claims, each its own test: a sequence alone equals the same sequence inside a batch; dummy sequences (empty
and not), NaN rows after the last sequence and NaN-filled outputs change no real row; a prefix of a sequence gives
the bits of the whole sequence on its rows; a hand-off at a multiple of 64 (final state in, the rest from it) equals
one pass; two runs are identical.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py)

import triton  # noqa: E402

from engine.plan import plan_tree  # noqa: E402
from kernels import gdn_chunk  # noqa: E402
from kernels.gdn_chunk import SOLVE, SOLVES, GdnChunkCore, gdn_chunk_forward  # noqa: E402
from measure.gdn_chunk_probe import bucketed_plan, walked_chunks  # noqa: E402
from tests.cases import gdn_chunk_bounds, gdn_chunk_inputs, gdn_chunk_oracle  # noqa: E402

if isinstance(gdn_chunk._gdn_chunk_fwd_kernel, triton.runtime.JITFunction):
    pytest.skip("kernels were compiled, not interpreted (TRITON_INTERPRET=1 unset)", allow_module_level=True)

LENGTHS = (1, 63, 64, 65, 130)
DIMS = {"gva-2-6-k32-v16": (2, 6, 32, 16), "gva-1-2-k16-v32": (1, 2, 16, 32)}


def _poisoned(tokens, dims, num_seqs, dtype=torch.bfloat16):
    _, hv, key_dim, value_dim = dims
    out = torch.full((tokens, hv, value_dim), float("nan"), dtype=dtype)
    final = torch.full((num_seqs, hv, key_dim, value_dim), float("nan"))
    return out, final


def _run(q, k, v, g, beta, cu, h0, out=None, final=None, **options):
    return gdn_chunk_forward(
        q, k, v, g, beta, cu, initial_state=h0, output_final_state=True, out=out, final_state_out=final, **options
    )


def _rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt(float((x.double() - ref.double()).square().sum()) / float(ref.double().square().sum()))


def _check_against_reference(o, final, inputs, bf16_points: bool) -> list[tuple]:
    q, cu = inputs[0], inputs[5]
    lengths = (cu[1:] - cu[:-1]).tolist()
    bound = gdn_chunk_bounds(q.shape[-1], max(-(-n // 64) for n in lengths))["bf16" if bf16_points else "fp32"]
    ref_o, ref_s = gdn_chunk_oracle(*inputs)
    assert torch.isfinite(o).all() and torch.isfinite(final).all(), "an output element was not written"
    figures = []
    for name, got, ref in (("o", o.float(), ref_o), ("final state", final, ref_s)):
        rel, max_abs, scale = _rel_rmse(got, ref), float((got - ref).abs().max()), float(ref.abs().max())
        figures.append((name, rel, max_abs, scale))
        assert rel <= bound, f"{name}: relative RMSE {rel:.3e} above the bound {bound:.3g}"
        assert max_abs <= bound * scale, f"{name}: max |Δ| {max_abs:.3e} above {bound:.3g} x max |ref| {scale:.3e}"
    print(f"bound {bound:.3g}", figures)
    return figures


@pytest.mark.parametrize("solve", SOLVES)
@pytest.mark.parametrize("bf16_points", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", list(DIMS.values()), ids=list(DIMS))
def test_matches_the_recurrent_reference(dims, bf16_points, solve):
    inputs = gdn_chunk_inputs(LENGTHS, dims, seed=1 + bf16_points)
    q, k, v, g, beta, cu, h0 = inputs
    out, final = _poisoned(len(q), dims, len(LENGTHS), torch.bfloat16 if bf16_points else torch.float32)
    o, ht = _run(*inputs, out=out, final=final, bf16_points=bf16_points, solve=solve)
    assert o is out and ht is final
    _check_against_reference(o, ht, inputs, bf16_points)


@pytest.mark.parametrize("solve", SOLVES)
@pytest.mark.parametrize("bf16_points", [False, True], ids=["fp32", "bf16"])
def test_a_badly_conditioned_solve_stays_within_the_bound(bf16_points, solve):
    """Keys near one direction, beta near 1, slow decay: (I + A) is close to singular-looking lower-triangular (its
    inverse has large alternating entries); a Neumann-product inverse loses all digits here (module docstring of
    kernels/gdn_chunk.py), the recursive block inverse must not."""
    dims = DIMS["gva-2-6-k32-v16"]
    inputs = gdn_chunk_inputs((64, 130), dims, seed=3, correlated=True)
    out, final = _poisoned(194, dims, 2, torch.bfloat16 if bf16_points else torch.float32)
    o, ht = _run(*inputs, out=out, final=final, bf16_points=bf16_points, solve=solve)
    _check_against_reference(o, ht, inputs, bf16_points)


def test_a_sequence_alone_equals_it_in_a_batch():
    dims = DIMS["gva-2-6-k32-v16"]
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, dims, seed=4)
    o, ht = _run(q, k, v, g, beta, cu, h0)
    bounds = cu.tolist()
    for i in (1, 4):  # 63 tokens between others; 130 tokens at the end
        s, e = bounds[i], bounds[i + 1]
        alone = torch.tensor([0, e - s])
        o_i, ht_i = _run(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], alone, h0[i : i + 1])
        assert torch.equal(o_i, o[s:e]) and torch.equal(ht_i[0], ht[i])


def test_padding_changes_no_real_row():
    """Dummy sequences before, between and after (empty ones too, as a bucket has), NaN input rows after the last
    sequence (a bucket's trailing slots: in no sequence) and NaN-poisoned outputs: the real rows' bits are those of
    the unpadded call, and rows outside every sequence are not written."""
    dims = DIMS["gva-2-6-k32-v16"]
    lengths = (65, 130)
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(lengths, dims, seed=5)
    o, ht = _run(q, k, v, g, beta, cu, h0)
    pq, pk, pv, pg, pbeta, _, ph0 = gdn_chunk_inputs((3, 65, 0, 130, 70, 0), dims, seed=6)
    real = {1: 0, 3: 1}  # padded sequence index -> unpadded index
    padded_cu = torch.tensor([0, 3, 68, 68, 198, 268, 268])
    trailing = 9
    for padded, plain in real.items():
        s, e = padded_cu[padded].item(), padded_cu[padded + 1].item()
        ps, pe = cu[plain].item(), cu[plain + 1].item()
        for dst, src in ((pq, q), (pk, k), (pv, v), (pg, g), (pbeta, beta)):
            dst[s:e] = src[ps:pe]
        ph0[padded] = h0[plain]
    nan_rows = [torch.full((trailing, *t.shape[1:]), float("nan"), dtype=t.dtype) for t in (pq, pk, pv, pg, pbeta)]
    pq, pk, pv, pg, pbeta = (torch.cat([t, rows]) for t, rows in zip((pq, pk, pv, pg, pbeta), nan_rows))
    out, final = _poisoned(len(pq), dims, len(padded_cu) - 1)
    po, pht = _run(pq, pk, pv, pg, pbeta, padded_cu, ph0, out=out, final=final)
    for padded, plain in real.items():
        s, e = padded_cu[padded].item(), padded_cu[padded + 1].item()
        ps, pe = cu[plain].item(), cu[plain + 1].item()
        assert torch.equal(po[s:e], o[ps:pe]) and torch.equal(pht[padded], ht[plain])
    assert torch.equal(pht[2], ph0[2]) and torch.equal(pht[5], ph0[5]), "an empty sequence keeps its initial state"
    assert torch.isnan(po[padded_cu[-1] :]).all(), "a row after the last sequence was written"
    assert torch.isfinite(po[: padded_cu[-1]]).all()


def test_a_prefix_gives_the_whole_sequences_bits():
    """Row t's output depends on rows <= t only: the first 1, 64, 65 and 100 rows of a 130-row sequence, run alone,
    give the bits of the 130-row run on those rows (what makes a tree path equal to its unshared candidate)."""
    dims = DIMS["gva-2-6-k32-v16"]
    q, k, v, g, beta, _, h0 = gdn_chunk_inputs((130,), dims, seed=7)
    whole, _ = _run(q, k, v, g, beta, torch.tensor([0, 130]), h0)
    for n in (1, 64, 65, 100):
        part, _ = _run(q[:n], k[:n], v[:n], g[:n], beta[:n], torch.tensor([0, n]), h0)
        assert torch.equal(part, whole[:n]), f"prefix of {n} rows"


def test_a_handoff_at_a_chunk_boundary_equals_one_pass():
    """[0, 128) with its final state, then [128, 195) from it, equals [0, 195) in one pass, outputs and final state
    (the `handoff` schedule's law: every split at a multiple of 64)."""
    dims = DIMS["gva-2-6-k32-v16"]
    q, k, v, g, beta, _, h0 = gdn_chunk_inputs((195,), dims, seed=8)
    whole, whole_final = _run(q, k, v, g, beta, torch.tensor([0, 195]), h0)
    head, head_final = _run(q[:128], k[:128], v[:128], g[:128], beta[:128], torch.tensor([0, 128]), h0)
    tail, tail_final = _run(q[128:], k[128:], v[128:], g[128:], beta[128:], torch.tensor([0, 67]), head_final)
    assert torch.equal(torch.cat([head, tail]), whole) and torch.equal(tail_final, whole_final)


def _tree_request(seed: int) -> tuple[list[list[int]], list[int]]:
    """Candidates of three questions over a 150-token root: question 0's prefix (60 tokens) crosses a chunk boundary
    past the root's last one (candidate 0 publishes twice), question 1's (5 tokens) does not, question 2 has one
    candidate; leaves of 1-80 tokens."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(1, 999) for _ in range(n)]

    root, question_0, question_1 = tokens(150), tokens(60), tokens(5)
    candidates = [root + question_0 + tokens(rng.randrange(1, 30)) for _ in range(3)]
    candidates += [root + question_1 + tokens(rng.randrange(1, 80)) for _ in range(2)] + [root + tokens(70)]
    return candidates, [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize(
    "dims", [DIMS["gva-1-2-k16-v32"], (1, 2, 16, 128)], ids=["gva-1-2-k16-v32", "gva-1-2-k16-v128"]
)
@pytest.mark.parametrize("pad_lens", [(), (3, 70, 1)], ids=["unpadded", "dummy-paths"])
def test_the_tree_walk_gives_the_replicated_bits(pad_lens, dims):
    """The replicated call of a real plan (chunk size 64) with the plan's tree walk: every packed row's output at its
    representative slot is bit-equal to the plain walk of every path from position 0 (the shared prefix's state is
    handed over at chunk boundaries, which is exact: `test_a_handoff_at_a_chunk_boundary_equals_one_pass`), and the
    dummy paths' rows are zeros. The walk here has both publish slots, readers of each and dummy sequences; V = 128
    has two value blocks of 64 per head, as the 27B (two tickets, flags and bank columns per head)."""
    plan = plan_tree(*_tree_request(seed=12), pad_lens=pad_lens)
    call = plan.gdn["replicated"].calls[0]
    assert (call.walk[:, 5] > 0).any() and (call.walk[:, 2] >= 0).sum() == 5
    q, k, v, g, beta, _, _ = gdn_chunk_inputs((plan.num_rows,), dims, seed=13)
    paths = [t[call.rows].contiguous() for t in (q, k, v, g, beta)]  # every path's rows, as the prep kernel lays them
    plain, _ = gdn_chunk_forward(*paths, call.cu_seqlens, chunk_indices=call.chunk_indices)
    out = torch.full_like(plain, float("nan"))
    tree, _ = gdn_chunk_forward(*paths, call.cu_seqlens, chunk_indices=call.chunk_indices, walk=call.walk, out=out)
    real = call.out_rows < plan.num_rows - sum(pad_lens)
    assert torch.equal(tree[call.out_slots[real]], plain[call.out_slots[real]])
    assert torch.isfinite(plain).all() and (tree[call.out_slots[~real]] == 0).all()
    walked = walked_chunks(call)
    dummy_chunks = sum(-(-n // 64) for n in pad_lens)  # the hand-off runs the dummy paths, the walk zeroes them
    assert walked + dummy_chunks == plan.gdn["handoff"].chunks < call.chunks  # the hand-off's chunks: each row once


def test_every_publish_point_of_a_hand_made_walk():
    """Publish points that no planner writes: a publish at a sequence's last chunk, a second publish point before
    the first, and two equal points (the dropped gdn_chunk v3.6 ended its chunk loops there). Six paths
    over one base sequence (every shared prefix the same rows): sequence 0 (128 rows) publishes after chunk 1 to slot
    6 and, as its second point, after chunk 0 to slot 4; sequence 3 (200 rows) publishes after chunk 0 to slots 2 and
    5; the readers 1 (from 6 at chunk 2), 2 (from 4 at chunk 1), 4 (from 2) and 5 (from 5, both at chunk 1) get the
    plain walk's bits on every row they walk, and no program waits forever."""
    dims = DIMS["gva-1-2-k16-v32"]
    base = gdn_chunk_inputs((400,), dims, seed=21)[:5]
    own = iter(range(128, 400))
    paths = [list(range(128)), list(range(128)) + [next(own) for _ in range(22)]]
    paths += [list(range(64)) + [next(own) for _ in range(n)] for n in (36, 136, 26, 6)]
    rows = torch.tensor([r for path in paths for r in path])
    cu = torch.tensor([0, *torch.tensor([len(p) for p in paths]).cumsum(0).tolist()])
    inputs = [t[rows].contiguous() for t in base]
    #  order, start, source, publish, slot, publish2, slot2, runs
    walk = torch.tensor([
        [0, 0, -1, 2, 6, 1, 4, 6], [3, 2, 6, 0, 0, 0, 0, 6], [1, 1, 4, 0, 0, 0, 0, 6],
        [2, 0, -1, 1, 2, 1, 5, 6], [4, 1, 2, 0, 0, 0, 0, 6], [5, 1, 5, 0, 0, 0, 0, 6],
    ])  # fmt: skip
    plain, _ = gdn_chunk_forward(*inputs, cu)
    out = torch.full_like(plain, float("nan"))
    tree, _ = gdn_chunk_forward(*inputs, cu, walk=walk, out=out)
    walked = torch.cat([torch.arange(int(cu[i]) + 64 * int(walk[i, 1]), int(cu[i + 1])) for i in range(6)])
    assert torch.isfinite(plain).all() and torch.equal(tree[walked], plain[walked])


@pytest.mark.parametrize("sequences", [3, 300], ids=["one-block-a-program", "more-blocks-than-programs"])
def test_the_solve_launch_zeroes_the_walk_flags(sequences):
    """The walk's tickets and flags come poisoned (the caching allocator's leftovers: 5, 7, -1, the ticket counter
    set too) and leave the solve launch as zeros, also where the launch has fewer programs than 128-flag blocks: 300
    sequences, all but two empty, give 3 chunks x 2 value heads = 6 programs for 1 + 301 · 2 · 2 = 1,205 flags (ten
    blocks)."""
    dims = DIMS["gva-1-2-k16-v32"]
    lens = [70, 40] + [0] * (sequences - 2)
    q, k, v, g, beta, _, _ = gdn_chunk_inputs((sum(lens),), dims, seed=23)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    walk = torch.zeros((sequences, 8), dtype=torch.int64)
    walk[:, 0], walk[:, 2], walk[:, 7] = torch.arange(sequences), -1, 2
    count = 1 + (sequences + 1) * 2 * 2
    flags = torch.tensor([5, 7, -1], dtype=torch.int32).repeat(count // 3 + 1)[:count].contiguous()
    gdn_chunk.gdn_chunk_solve(k, g, beta, cu, walk=walk, flags=flags)
    programs = sum(-(-n // 64) for n in lens) * dims[1]
    assert (count > 128 * programs) == (sequences == 300)
    assert (flags == 0).all()


def _packed_tree_call(seed: int):
    """A planned request with dummy paths (3 and 70 rows), its replicated call, the kernel dims, and random packed
    inputs (q, k, v, g, beta; seed + 1) followed by 5 NaN rows that no slot reads."""
    plan = plan_tree(*_tree_request(seed=seed), pad_lens=(3, 70))
    dims = DIMS["gva-1-2-k16-v32"]
    q, k, v, g, beta, _, _ = gdn_chunk_inputs((plan.num_rows,), dims, seed=seed + 1)
    packed = [torch.cat([t, torch.full((5, *t.shape[1:]), float("nan"), dtype=t.dtype)]) for t in (q, k, v, g, beta)]
    return plan, plan.gdn["replicated"].calls[0], dims, packed


@pytest.mark.parametrize(("tree_walk", "solve"), [(True, "doubling"), (True, "fla-blocks"), (False, SOLVE)],
                         ids=["tree-walk-doubling", "tree-walk-fla-blocks", f"plain-{SOLVE}"])  # fmt: skip
def test_reading_through_the_slot_rows_gives_the_gathered_bits(tree_walk, solve):
    """`rows`: each path slot reads q, k, v, g, beta at its packed row (no gathered copy) and gets, bit for bit, what
    the same call over the inputs gathered to the slots gives, in every element of o (NaN-poisoned alike, so the
    same elements are written too). The packed inputs carry NaN rows that no slot reads."""
    plan, call, dims, packed = _packed_tree_call(seed=14)
    paths = [t[call.rows].contiguous() for t in packed]
    layout = {"chunk_indices": call.chunk_indices, "solve": solve} | ({"walk": call.walk} if tree_walk else {})
    gathered, _ = gdn_chunk_forward(*paths, call.cu_seqlens, out=_poisoned(len(call.rows), dims, 1)[0], **layout)
    out = _poisoned(len(call.rows), dims, 1)[0]
    direct, _ = gdn_chunk_forward(*packed, call.cu_seqlens, rows=call.rows, out=out, **layout)
    assert direct.shape == gathered.shape and torch.equal(direct.view(torch.int16), gathered.view(torch.int16))
    written = direct[call.out_slots[call.out_rows < plan.num_rows - 73]]
    assert torch.isfinite(written).all()


def test_walked_chunks_of_the_bucketed_calls():
    """The counts engine/stages/core.md quotes (`measure.gdn_chunk_probe.walked_chunks`): chunks the tree walk
    computes on the buckets `graphs` replays."""
    expected = {"drone": 15, "jevbench/easy-intent-00": 10, "customer_service": 21}
    for workload, count in expected.items():
        assert walked_chunks(bucketed_plan(workload)[0].gdn["replicated"].calls[0]) == count, workload


def test_two_runs_are_identical():
    dims = DIMS["gva-1-2-k16-v32"]
    inputs = gdn_chunk_inputs(LENGTHS, dims, seed=9)
    first, second = _run(*inputs), _run(*inputs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_the_core_adapter_is_the_kernel():
    """`GdnChunkCore` (FLA's varlen signature, [1, T, ...]) returns the kernel's bits; without initial states and
    final states too; it refuses raw q/k."""
    dims = DIMS["gva-1-2-k16-v32"]
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs((63, 65), dims, seed=10)
    core = GdnChunkCore()
    o, final = core(*(t[None] for t in (q, k, v, g, beta)), cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ref_o, ref_final = _run(q, k, v, g, beta, cu, h0)
    assert torch.equal(o[0], ref_o) and torch.equal(final, ref_final)
    o, final = core(*(t[None] for t in (q, k, v, g, beta)), cu_seqlens=cu)
    assert final is None and torch.equal(o[0], gdn_chunk_forward(q, k, v, g, beta, cu)[0])
    with pytest.raises(ValueError, match="already L2-normalised"):
        core(*(t[None] for t in (q, k, v, g, beta)), cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def test_bad_inputs_are_refused():
    dims = DIMS["gva-1-2-k16-v32"]
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs((5,), dims, seed=11)
    with pytest.raises(ValueError, match="g: dtype"):
        gdn_chunk_forward(q, k, v, g.bfloat16(), beta, cu)
    with pytest.raises(ValueError, match="powers of two"):
        gdn_chunk_forward(q[..., :12].contiguous(), k[..., :12].contiguous(), v, g, beta, cu)
    with pytest.raises(ValueError, match="initial_state: shape"):
        gdn_chunk_forward(q, k, v, g, beta, cu, initial_state=h0[:, :1].contiguous())
    with pytest.raises(ValueError, match="N \\+ 1 >= 2"):
        gdn_chunk_forward(q, k, v, g, beta, cu[:1])
    with pytest.raises(ValueError, match="solve_precision"):
        gdn_chunk_forward(q, k, v, g, beta, cu, solve_precision="fp8")
    with pytest.raises(ValueError, match="solve 'lu'"):
        gdn_chunk_forward(q, k, v, g, beta, cu, solve="lu")
    walk = torch.tensor([[0, 0, -1, 0, 0, 0, 0, 1]])
    with pytest.raises(ValueError, match="no initial state"):
        gdn_chunk_forward(q, k, v, g, beta, cu, initial_state=h0, walk=walk)
    with pytest.raises(ValueError, match="walk: shape"):
        gdn_chunk_forward(q, k, v, g, beta, cu, walk=walk[:, :6].contiguous())
