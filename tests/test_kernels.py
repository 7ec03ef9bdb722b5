"""CPU tests of the fused kernels (Triton interpreter) against reference.ops: tiny-twin shapes, odd row counts,
packed sequences, a few 27B-width rows, NaN-poisoned outputs, and input validation.

Interpreter mode. Triton decides at `@triton.jit` time (when `kernels` is imported) whether a kernel is compiled or
interpreted, so TRITON_INTERPRET=1 must be in the environment before the first import of `kernels` in the process.
`nox -s tests` sets it for the whole run. For a bare `pytest` on a machine without CUDA this module sets it itself,
before its own import of `kernels`; that is the robust choice because it makes the file runnable alone and changes
nothing where the variable is already set. If another module imported `kernels` first without the variable, the
kernels are compiled objects and cannot take CPU tensors: the module then skips and says so (the fix is to set the
variable, e.g. in tests/conftest.py). On a CUDA machine the GPU path is covered by tests/test_gpu_kernels.py.

Exactness asserted per output (ablations/bit_identity.py, `check_rows`): bitwise where the kernel's math is torch's
op for op; after a sum of squares (Triton sums in another order than torch: kernels/norms.py explains it), at most
1e-4 of the elements differ, by at most one bf16 ulp where the normalised n is the output (residual norm, gdn_prep
q / k), and only as the reference's chain after n gives them from n moved by one ulp where more rounded arithmetic
follows (gated norm, attn_prep q / k: the flip model). One CPU-only departure: the GDN decay g is fp32 and never
rounded, and torch's CPU kernels use SLEEF expf/log1pf where the interpreter uses numpy's, so g is bounded by
CPU_G_MAX_ULP ulps here (measured: at most 2 ulp, 93-100 % of the elements bit-identical) and bitwise on the GPU.
Every test prints its bit-identity table (`pytest -s` shows it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (module docstring)

import triton  # noqa: E402

import kernels  # noqa: E402
from ablations.bit_identity import (  # noqa: E402
    bit_identity_table,
    check_rows,
    compare,
    format_table,
)
from kernels import activations, compile_check  # noqa: E402
from reference import ops  # noqa: E402
from reference.shapes import QWEN38_27B, TINY  # noqa: E402
from tests.cases import (  # noqa: E402
    check_bf16_rounding_matches_torch,
    check_gates_on_every_bf16_input,
    check_prep_ways,
    check_row_indexed_kernels,
    gdn_dims,
    random_activations,
)

if isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
    pytest.skip(
        "kernels were compiled, not interpreted: TRITON_INTERPRET=1 was not set before `kernels` was first imported "
        "(run `nox -s tests`, or set it in the environment); GPU coverage is tests/test_gpu_kernels.py",
        allow_module_level=True,
    )

CPU_G_MAX_ULP = 2  # measured max over these tests; see module docstring
CPU_RELAXED = {("gdn_prep", "g"): CPU_G_MAX_ULP}
ROWS = (1, 7, 63, 65)


def _report(title: str, table: list[dict]) -> None:
    print(f"\n{title}\n{format_table(table)}")


@pytest.mark.parametrize("rows", ROWS)
def test_kernels_tiny(rows: int) -> None:
    """All six kernels on one sequence of the tiny twin, outputs NaN-poisoned, against reference.ops."""
    table = bit_identity_table(random_activations(TINY, [rows], "cpu", seed=rows), TINY)
    _report(f"tiny, {rows} rows", table)
    assert len(table) == 13
    check_rows(table, relaxed=CPU_RELAXED)


def test_gdn_prep_packed_sequences_tiny() -> None:
    """Packed varlen rows (an empty sequence included): the conv restarts from zero history at every sequence start,
    so each sequence equals its own reference, and the packed call equals separate calls bit for bit."""
    lens = [1, 7, 0, 63, 65]
    act = random_activations(TINY, lens, "cpu", seed=1)
    table = bit_identity_table(act, TINY, kernels=["gdn_prep"])
    _report(f"tiny gdn_prep, packed {lens}", table)
    check_rows(table, relaxed=CPU_RELAXED)

    dims = gdn_dims(TINY)
    args = (act["gdn_proj"], act["conv_weight"], act["A_log"], act["dt_bias"])
    packed = kernels.gdn_prep(*args, act["gdn_cu_seqlens"], **dims)
    offsets = act["gdn_cu_seqlens"].tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        alone = kernels.gdn_prep(
            act["gdn_proj"][start:end], *args[1:], torch.tensor([0, end - start], dtype=torch.int32), **dims
        )
        for got, want in zip(packed, alone):
            assert torch.equal(got[:, start:end], want), (start, end)


def test_row_indexed_kernels_equal_the_gathered_calls_tiny() -> None:
    """`check_row_indexed_kernels` on the tiny twin: 57 path rows (an empty path) over 40 source rows, 29 output
    rows, 57 keys; int32 indices (the GPU test uses int64)."""
    check_row_indexed_kernels(
        TINY, "cpu", source_rows=40, path_lens=[5, 0, 25, 27], out_rows=29, keys=57, seed=3, index_dtype=torch.int32
    )


def test_gdn_prep_from_a_plans_taps_tiny() -> None:
    """`gdn_prep(taps=plan.conv_taps)` gives every packed row of a tree plan (two questions, dummy paths) bit for bit as
    the conv over the candidates' paths at the rows' representative slots (`conv_paths`, `slots=row_slot`) and as
    the conv over the node segments (`conv_segments`, kept rows), NaN-poisoned outputs."""
    import random

    from engine.plan import plan_tree

    rng = random.Random(5)
    root, first, second = ([rng.randrange(1, 999) for _ in range(n)] for n in (9, 4, 2))
    candidates = [root + first + [rng.randrange(1, 999) for _ in range(n)] for n in (1, 6, 3)]
    candidates += [root + second + [rng.randrange(1, 999) for _ in range(n)] for n in (2, 5)]
    groups = [0, 0, 0, 1, 1]
    act = random_activations(TINY, [37], "cpu", seed=6)
    args = (act["conv_weight"], act["A_log"], act["dt_bias"])
    for pad_lens in ((), (3, 2)):
        plan = plan_tree(candidates, groups, pad_lens=pad_lens)
        proj = act["gdn_proj"][: plan.num_rows]
        assert plan.num_rows == 32 + sum(pad_lens)
        paths = plan.conv_paths
        want = kernels.gdn_prep(proj, *args, paths.cu_seqlens_i32, rows=paths.rows, slots=plan.row_slot,
                                **gdn_dims(TINY))  # fmt: skip
        poisoned = tuple(torch.full_like(t, float("nan")) for t in want)
        got = kernels.gdn_prep(proj, *args, None, taps=plan.conv_taps, out=poisoned, **gdn_dims(TINY))
        for name, tapped, at_slots in zip("q k v g beta".split(), got, want):
            assert not tapped.isnan().any() and torch.equal(tapped, at_slots), (name, pad_lens)
        if plan.conv_segments is not None:  # the hand-off's conv input (unpadded plans)
            conv = plan.conv_segments
            whole = kernels.gdn_prep(proj, *args, conv.cu_seqlens_i32, rows=conv.rows, **gdn_dims(TINY))
            for name, tapped, segments in zip("q k v g beta".split(), got, whole):
                assert torch.equal(tapped, segments.index_select(1, conv.keep)), (name, "segments")
    with pytest.raises(ValueError, match="taps replace"):
        kernels.gdn_prep(proj, *args, paths.cu_seqlens_i32, taps=plan.conv_taps, **gdn_dims(TINY))


@pytest.mark.parametrize("shapes", [TINY, QWEN38_27B], ids=["tiny", "27b"])
def test_gather_slots_equals_index_select(shapes) -> None:
    """gather_slots against index_select on each of gdn_prep's outputs, bit for bit: random bits (NaN and inf
    patterns included), 13 packed rows to 301 slots with repeats and every row used, int32 and int64 indices (at the
    27B widths the interpreter's two programs stride over five blocks of 64 slots, the last one partial)."""
    generator = torch.Generator().manual_seed(7)
    n, dims = 13, gdn_dims(shapes)
    hk, hv, k_dim, v_dim = dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"]

    def random_bits(*shape, dtype):
        bits = torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32)
        return bits.to(torch.int16).view(dtype) if dtype == torch.bfloat16 else (bits * 65537).view(dtype)

    prepared = (random_bits(1, n, hk, k_dim, dtype=torch.bfloat16), random_bits(1, n, hk, k_dim, dtype=torch.bfloat16),
                random_bits(1, n, hv, v_dim, dtype=torch.bfloat16), random_bits(1, n, hv, dtype=torch.float32),
                random_bits(1, n, hv, dtype=torch.bfloat16))  # fmt: skip
    rows = torch.cat([torch.arange(n), torch.randint(0, n, (288,), generator=generator)])
    for index in (rows.to(torch.int32), rows):
        for got, want in zip(kernels.gather_slots(prepared, index), prepared, strict=True):
            bits = torch.int32 if want.dtype == torch.float32 else torch.int16
            assert torch.equal(got.view(bits), want.index_select(1, rows).view(bits))


@pytest.mark.parametrize(("shapes", "slots", "count"), [(TINY, 29, 17), (QWEN38_27B, 301, 217), (TINY, 29, 40)],
                         ids=["tiny", "27b", "count-past-the-slots"])  # fmt: skip
def test_gather_slots_with_a_count_and_linear_gates(shapes, slots: int, count: int) -> None:
    """gather_slots with a device count writes the slots below it only (the others keep the poison the buffers are
    filled with here, by patching torch.empty), and with linear gates gives exp(g) and beta in fp32 (beta exactly,
    exp(g) within 2 ulp of torch.exp); q, k, v moved bit for bit. Odd sizes: 11 rows, 29 slots and a count of 17; at
    the 27B widths 301 slots and a count of 217 (the interpreter's two programs stride over four blocks of 64, the
    count inside the fourth); a count past the slots writes them all."""
    generator = torch.Generator().manual_seed(9)
    n, dims = 11, gdn_dims(shapes)
    hk, hv, k_dim, v_dim = dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"]
    q, k = (torch.randn(1, n, hk, k_dim, generator=generator).bfloat16() for _ in range(2))
    v = torch.randn(1, n, hv, v_dim, generator=generator).bfloat16()
    g, beta = -torch.rand(1, n, hv, generator=generator) * 8, torch.rand(1, n, hv, generator=generator).bfloat16()
    prepared = (q, k, v, g, beta)
    rows = torch.randint(0, n, (slots,), generator=generator)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", poisoned)
        got = kernels.gather_slots(prepared, rows, count=torch.tensor([count]), linear_gates=True)
    written = min(count, slots)
    want = [t.index_select(1, rows[:written]) for t in prepared]
    for name, tensor, ref in zip("q k v".split(), got[:3], want[:3]):
        assert torch.equal(tensor[:, :written].view(torch.int16), ref.view(torch.int16)), name
    assert got[3].dtype == got[4].dtype == torch.float32
    torch.testing.assert_close(got[3][:, :written], want[3].exp(), rtol=2 * 2**-23, atol=0)
    assert torch.equal(got[4][:, :written], want[4].float())
    assert all(t[:, written:].isnan().all() for t in got)


@pytest.mark.parametrize("workload_id", ["jevbench/easy-intent-00", "drone"])
def test_packed_prep_equals_every_slot_on_a_bucketed_plan(workload_id: str) -> None:
    """What the engine runs on a `graphs` bucket (each packed row prepared once, then gathered: gdn_prep from the
    plan's `conv_taps`, v4's way at `plan.row_slot`, attn_prep over the rows) equals the kernels over every path slot
    and key entry, bit for bit (`tests.cases.check_prep_ways`, tiny widths; measure/prep_probe.py times the ways on
    the H200)."""
    check_prep_ways(workload_id, TINY, "cpu")


@pytest.fixture(scope="module")
def compile_runs(request) -> Iterator[dict[int, subprocess.Popen]]:
    """`python -m kernels.compile_check --capability N` started at once for every capability the session's
    `test_kernels_compile_for` items ask for and ptxas can target: the targets compile side by side (two cores on CI)
    instead of one after another. Subprocesses, because this process defined the kernels under TRITON_INTERPRET=1.
    Under pytest-xdist every worker collects every item, so a worker that ran one target would start all three:
    tests/conftest.py (`pytest_xdist_make_scheduler`) sends the targets to one worker, together and first."""
    pytest.importorskip("triton.backends.nvidia")
    wanted = sorted({item.callspec.params["capability"] for item in request.session.items
                     if getattr(item, "originalname", None) == "test_kernels_compile_for"})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {
        capability: subprocess.Popen(
            [sys.executable, "-m", "kernels.compile_check", "--capability", str(capability)],
            env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for capability in wanted if compile_check.ptxas_lacks(capability) is None
    }  # fmt: skip
    yield runs
    for run in runs.values():
        run.kill()
        run.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("capability", compile_check.CAPABILITIES)
def test_kernels_compile_for(capability: int, compile_runs) -> None:
    """`python -m kernels.compile_check --capability N`: every kernel, as the wrappers launch it at the 27B shapes
    (gdn_prep from a plan's taps; gather_slots; residual_rmsnorm_splitk at S = 1-4; gdn_chunk's solve and walk for
    drone's bucket with its tree walk, without it and for a hand-off call; on sm_90 also the launches only the GPU
    tests and the probes make: gdn_prep over cu_seqlens at binary-search depths 0, 1, 4-7 and 12 with and without a
    row index and at output slots at depth 5, the walk on gathered inputs and at the probe's solve and value blocks),
    compiles for sm_N with the installed Triton, aligned and unaligned (the interpreter never runs Triton's compiler
    passes, kernels/compile_check.py): sm_90 (H200), sm_100 and sm_103 (B200, B300), skipped where Triton's ptxas
    cannot target one; every kernel family on each. The three targets compile side by side (`compile_runs`), from the
    start of a `nox -s tests` run while the other worker runs the rest. On the 2-core dev machine with an empty Triton
    cache, alone: 166 s of CPU for sm_90; sm_103 208 s with every launch, 78 s with the stages' only
    (2026-12-07)."""
    lacking = compile_check.ptxas_lacks(capability)
    if lacking:
        pytest.skip(lacking)
    run = compile_runs[capability]
    stdout, stderr = run.communicate(timeout=900)
    print(stdout)
    lines = stdout.splitlines()
    # each launch aligned and unaligned; a gdn_chunk call launches two kernels (the solve, the walk)
    labels = [label for label, _ in compile_check.engine_launches(capability)]
    launches = len(labels) + sum(label.startswith("gdn_chunk") for label in labels)
    expected = f"{2 * launches} compiled, 0 failed"
    assert run.returncode == 0 and lines and lines[-1] == expected, stdout + stderr[-3000:]
    names = {line.split()[-3] for line in lines if line.endswith(" ok")}
    families = ("silu_mul", "residual_rmsnorm", "gated_rmsnorm", "attn_prep", "attention_gate", "gdn_prep",
                "gather_slots", "gdn_chunk_solve", "gdn_chunk_fwd")  # fmt: skip
    assert names == {f"_{k}_kernel" for k in families}


@pytest.mark.slow
def test_compile_check_reports_usage_and_sass(tmp_path) -> None:
    """`--usage --sass --only silu_mul --listings DIR`: the one silu_mul launch, its aligned compile annotated with
    ptxas' registers and spills and with its SASS instruction count (the instruction lines of the listing it writes)
    and the most common opcodes, whose counts add up to no more than the total; the unaligned compile unannotated."""
    pytest.importorskip("triton.backends.nvidia")
    if compile_check.ptxas_lacks(compile_check.SM90):
        pytest.skip(compile_check.ptxas_lacks(compile_check.SM90))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--usage", "--sass", "--only", "silu_mul", "--listings",
         str(tmp_path)],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1] == "2 compiled, 0 failed", run.stdout + run.stderr[-3000:]
    aligned, unaligned = (line for line in lines if "_silu_mul_kernel" in line)
    assert unaligned.endswith("unaligned ok")
    note = re.fullmatch(r".* aligned +ok +\[(\d+) registers.*spill stores.*; (\d+) SASS instructions: (.*)\]", aligned)
    assert note is not None, aligned
    registers, total = int(note.group(1)), int(note.group(2))
    counts = [int(pair.split()[1]) for pair in note.group(3).split(", ")]
    assert 0 < registers <= 255 and len(counts) == compile_check.SASS_OPCODES_SHOWN and 0 < sum(counts) <= total
    (listing,) = tmp_path.iterdir()
    assert listing.name == "silu_mul._silu_mul_kernel.sass"
    assert sum("\t" in line for line in listing.read_text().splitlines()) == total


def test_gates_exact_path_is_tritons_ptx_of_torchs_formula() -> None:
    """`--gates`: the exact path of the compiled gates' inline assembly (`numerics.SILU_BF16_PTX`,
    `SIGMOID_BF16_PTX`) is, instruction by instruction, the PTX Triton compiles `silu_f32` / `sigmoid_f32` to, whose
    bits the GPU tests check against torch. The fast path before it runs only on a GPU
    (tests/test_gpu_kernels.py::test_gpu_gates_on_every_bf16_input)."""
    pytest.importorskip("triton.backends.nvidia")
    if compile_check.ptxas_lacks(compile_check.SM90):
        pytest.skip(compile_check.ptxas_lacks(compile_check.SM90))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--gates"],
        env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip() == "silu_bf16 and sigmoid_bf16: the exact path is Triton's PTX of torch's formula"


def test_gdn_prep_without_l2norm_tiny() -> None:
    """qk_l2norm=False leaves q and k as the conv + SiLU outputs (for FLA's in-kernel l2norm), bitwise."""
    act = random_activations(TINY, [63], "cpu", seed=2)
    q, k, *_ = kernels.gdn_prep(
        act["gdn_proj"],
        act["conv_weight"],
        act["A_log"],
        act["dt_bias"],
        act["gdn_cu_seqlens"],
        qk_l2norm=False,
        **gdn_dims(TINY),
    )
    want = ops.gdn_prep(
        act["gdn_proj"], act["conv_weight"], act["A_log"], act["dt_bias"], act["gdn_cu_seqlens"], TINY, qk_l2norm=False
    )
    table = [compare("gdn_prep raw", "q", q[0], want["q"]), compare("gdn_prep raw", "k", k[0], want["k"])]
    _report("tiny gdn_prep, qk_l2norm=False", table)
    assert all(r["bit_identical"] == r["elements"] for r in table)


def test_norm_variants_tiny() -> None:
    """rmsnorm_1p without a residual add, an in-place residual update, and the gated norm with a bf16 weight (its
    table row, so that the flip model applies)."""
    act = random_activations(TINY, [65], "cpu", seed=3)
    residual, delta, weight, eps = act["residual"], act["delta"], act["norm_weight"], TINY.rms_norm_eps
    normed = kernels.rmsnorm_1p(residual, weight, eps, out=torch.full_like(residual, float("nan")))
    table = [compare("rmsnorm_1p", "normed", normed, ops.rmsnorm_1p(residual, weight, eps))]

    want_residual, want_normed = ops.residual_rmsnorm(residual, delta, weight, eps)
    in_place = residual.clone()
    new_residual, normed = kernels.residual_rmsnorm(in_place, delta, weight, eps, out_residual=in_place)
    assert new_residual.data_ptr() == in_place.data_ptr()
    table += [
        compare("residual in place", "new_residual", new_residual, want_residual),
        compare("residual in place", "normed", normed, want_normed),
    ]

    bf16_weight = {"gdn_norm_weight": act["gdn_norm_weight"].to(torch.bfloat16)}
    table += bit_identity_table(act | bf16_weight, TINY, kernels=["gated_rmsnorm"])
    _report("tiny norm variants (the gated norm with a bf16 weight)", table)
    assert table[1]["bit_identical"] == table[1]["elements"]
    check_rows([table[0], table[2], table[3]])


def _splitk_inputs(splits: int, rows: int, hidden: int, layout: str, seed: int):
    """Fresh random residual [R, H] bf16, partials [S, R, H] fp32 in `layout` ("contiguous", "padded": row stride
    H + 9, "row_major": split stride H, row stride S·H, as a [R, S, H] buffer gives) and a weight [H] fp32. The
    partials' scales differ by powers of two per split, so the fp32 sum rounds at every add."""
    generator = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, hidden, generator=generator).bfloat16()
    scales = torch.tensor([1.0, 64.0, 1 / 32, 8.0])[:splits].view(splits, 1, 1)
    if layout == "padded":
        partials = torch.randn(splits, rows, hidden + 9, generator=generator)[..., :hidden]
    elif layout == "row_major":
        partials = torch.randn(rows, splits, hidden, generator=generator).transpose(0, 1)
    else:
        partials = torch.randn(splits, rows, hidden, generator=generator)
    partials.mul_(scales)
    return residual, partials, torch.randn(hidden, generator=generator) / 8


@pytest.mark.parametrize("splits", (1, 2, 3, 4))
@pytest.mark.parametrize(
    ("rows", "hidden", "layout"),
    [(1, TINY.hidden_size, "contiguous"), (65, 200, "padded"), (7, QWEN38_27B.hidden_size, "row_major")],
)
def test_residual_rmsnorm_splitk(splits: int, rows: int, hidden: int, layout: str) -> None:
    """The split-K partials reduced in the residual norm, outputs NaN-poisoned: new_residual bitwise against
    `ops.residual_rmsnorm_splitk`; the delta bitwise against `ops.splitk_delta` (seen as new_residual of a -0.0
    residual: x + (-0) = x for every x); normed bitwise against `kernels.residual_rmsnorm` on the reference delta
    and within the sum-of-squares bound of the reference."""
    residual, partials, weight = _splitk_inputs(splits, rows, hidden, layout, seed=100 * splits + rows)
    eps = TINY.rms_norm_eps
    nan = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    new_residual, normed = kernels.residual_rmsnorm_splitk(
        residual, partials, weight, eps, out_residual=nan.clone(), out_normed=nan.clone()
    )
    want_residual, want_normed = ops.residual_rmsnorm_splitk(residual, partials, weight, eps)
    assert torch.equal(new_residual.view(torch.int16), want_residual.view(torch.int16))
    same_kernel = kernels.residual_rmsnorm(residual, ops.splitk_delta(partials), weight, eps)
    assert torch.equal(normed.view(torch.int16), same_kernel[1].view(torch.int16))
    table = [compare("residual_rmsnorm", "normed", normed, want_normed)]
    _report(f"residual_rmsnorm_splitk S={splits}, {rows} x {hidden} {layout}", table)
    check_rows(table)

    minus_zero = torch.full_like(residual, -0.0)
    delta, _ = kernels.residual_rmsnorm_splitk(minus_zero, partials, weight, eps, out_residual=nan.clone())
    assert torch.equal(delta.view(torch.int16), ops.splitk_delta(partials).view(torch.int16))


def test_residual_rmsnorm_splitk_sums_in_split_order() -> None:
    """p_0 = x, p_1 = -x, p_2 = y with |x| >> |y|: in split order the sum is exactly y; any other order loses y's low
    bits. The kernel's delta is y (as a -0.0 residual shows it), so it adds in split order; in place over residual."""
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(9, 96, generator=generator) * 2**20, torch.randn(9, 96, generator=generator)
    partials = torch.stack([x, -x, y])
    assert not torch.equal(((y + -x) + x).bfloat16(), y.bfloat16())  # the other order differs
    residual = torch.full((9, 96), -0.0, dtype=torch.bfloat16)
    new_residual, _ = kernels.residual_rmsnorm_splitk(residual, partials, torch.zeros(96), 1e-6, out_residual=residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual.view(torch.int16), y.bfloat16().view(torch.int16))


def test_attn_prep_head_major_layout_tiny() -> None:
    """layout="htd" writes the same values as "thd", transposed to [H, T, D] for SDPA."""
    act = random_activations(TINY, [63], "cpu", seed=4)
    args = (act["attn_proj"], act["q_norm_weight"], act["k_norm_weight"], act["cos"], act["sin"], TINY.rms_norm_eps)
    dims = {"num_heads": TINY.num_attention_heads, "num_kv_heads": TINY.num_key_value_heads, "head_dim": TINY.head_dim}
    token_major = kernels.attn_prep(*args, **dims)
    head_major = kernels.attn_prep(*args, layout="htd", **dims)
    for a, b in zip(token_major, head_major):
        assert torch.equal(a, b.transpose(0, 1))


def test_batch_invariance_tiny() -> None:
    """A row's bits do not depend on the other rows of the call: the first rows alone equal the same rows in a
    65-row call, for every kernel with a reduction."""
    act = random_activations(TINY, [65], "cpu", seed=6)
    eps = TINY.rms_norm_eps
    full = kernels.residual_rmsnorm(act["residual"], act["delta"], act["norm_weight"], eps)[1]
    part = kernels.residual_rmsnorm(act["residual"][:7], act["delta"][:7], act["norm_weight"], eps)[1]
    assert torch.equal(part, full[:7])
    partials = torch.randn(3, 65, TINY.hidden_size, generator=torch.Generator().manual_seed(6))
    full = kernels.residual_rmsnorm_splitk(act["residual"], partials, act["norm_weight"], eps)[1]
    part = kernels.residual_rmsnorm_splitk(act["residual"][:7], partials[:, :7], act["norm_weight"], eps)[1]
    assert torch.equal(part, full[:7])
    args = (act["q_norm_weight"], act["k_norm_weight"])
    dims = {"num_heads": TINY.num_attention_heads, "num_kv_heads": TINY.num_key_value_heads, "head_dim": TINY.head_dim}
    full_q = kernels.attn_prep(act["attn_proj"], *args, act["cos"], act["sin"], eps, **dims)[0]
    part_q = kernels.attn_prep(act["attn_proj"][:7], *args, act["cos"][:7], act["sin"][:7], eps, **dims)[0]
    assert torch.equal(part_q, full_q[:7])


@pytest.mark.slow
def test_kernels_27b_rows() -> None:
    """All six kernels on a few 27B-width rows (two packed sequences of 3 and 2 tokens); interpreter-bound, ~15 s."""
    table = bit_identity_table(random_activations(QWEN38_27B, [3, 2], "cpu", seed=27), QWEN38_27B)
    _report("27B widths, packed [3, 2]", table)
    assert len(table) == 13
    check_rows(table, relaxed=CPU_RELAXED)


def test_flip_model_on_real_differences_27b() -> None:
    """The gated norm and attn_prep at the 27B widths, 101 rows (620,544 elements of q and of the gated norm): enough
    that the interpreter's sum order moves some n by one ulp, so the flip model explains real kernel differences,
    not only made-up ones (measured here: gated norm 99.9997 % bit-identical, max 2 ulp; q 99.9994 %); ~1 s."""
    act = random_activations(QWEN38_27B, [101], "cpu", seed=2)
    table = bit_identity_table(act, QWEN38_27B, kernels=["gated_rmsnorm", "attn_prep"])
    _report("27B widths, 101 rows: the flip model", table)
    assert sum(r["elements"] - r["bit_identical"] for r in table) > 0, "no difference for the flip model to explain"
    check_rows(table)


def test_round_to_bf16_matches_torch() -> None:
    """The bf16 rounding used at every rounding point (interpreted: integer arithmetic on the bits) equals torch's
    fp32 -> bf16 conversion (nearest even) on random values, exact ties, values that carry into the exponent, ±inf,
    ±0, subnormals, NaN and the largest finite values (which overflow to inf); tests/cases.py."""
    check_bf16_rounding_matches_torch("cpu")


def test_gates_on_every_bf16_input_tiny() -> None:
    """silu_mul's silu, attention_gate's sigmoid and gdn_prep's v and beta on all 65,536 bf16 inputs against torch's
    CPU kernels, bit for bit (tests/cases.py). Interpreted, the gates run their exact path (torch's formula); the
    fast path exists only compiled: tests/test_gpu_kernels.py runs the same check on the GPU."""
    check_gates_on_every_bf16_input(TINY, "cpu")


def _tiny_gdn_prep(*, conv_weight=None, cu_seqlens=None, rows=None):
    """gdn_prep on 5 random tiny-twin rows, one sequence, with one input replaced (a bad-input case)."""
    return kernels.gdn_prep(
        torch.randn(5, TINY.gdn_in_width).bfloat16(),
        torch.randn(TINY.conv_dim, 4).bfloat16() if conv_weight is None else conv_weight,
        torch.zeros(6),
        torch.zeros(6),
        torch.tensor([0, 5]) if cu_seqlens is None else cu_seqlens,
        rows=rows,
        **gdn_dims(TINY),
    )


def _tiny_attn_prep(*, rotary_dim: int = 16, **options):
    """attn_prep on 4 random tiny-twin rows (6 heads, 1 kv head, head dim 64) with `options` (a bad-input case)."""
    cos_sin = (torch.randn(4, rotary_dim).bfloat16(), torch.randn(4, rotary_dim).bfloat16())
    proj = torch.randn(4, TINY.attn_in_width).bfloat16()
    return kernels.attn_prep(
        proj, torch.zeros(64), torch.zeros(64), *cos_sin, 1e-6, num_heads=6, num_kv_heads=1, head_dim=64, **options
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kernels.silu_mul(torch.randn(3, 8)), "dtype torch.float32"),
        (lambda: kernels.silu_mul(torch.randn(3, 7).bfloat16()), r"\[R, 2I\]"),
        (lambda: kernels.silu_mul(torch.randn(8, 3).bfloat16().t()), "stride 1"),
        (
            lambda: kernels.silu_mul(torch.randn(3, 8).bfloat16(), out=torch.empty(3, 5, dtype=torch.bfloat16)),
            r"out: shape \(3, 5\)",
        ),
        (
            lambda: kernels.residual_rmsnorm(torch.randn(2, 8).bfloat16(), None, torch.zeros(9), 1e-6),
            r"weight: shape \(9,\)",
        ),
        (
            lambda: kernels.residual_rmsnorm(
                torch.randn(2, 8).bfloat16(), None, torch.zeros(8), 1e-6, out_residual=torch.empty(2, 8)
            ),
            "delta is None",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.randn(2, 2, 8).bfloat16(), torch.zeros(8), 1e-6
            ),
            "partials: dtype torch.bfloat16",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.randn(2, 8), torch.zeros(8), 1e-6
            ),
            r"partials must be \[S, R, H\] with S >= 1, got \(2, 8\)",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.empty(0, 2, 8), torch.zeros(8), 1e-6
            ),
            r"S >= 1, got \(0, 2, 8\)",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.randn(3, 2, 9), torch.zeros(8), 1e-6
            ),
            r"partials: shape \(3, 2, 9\), expected \[\*, 2, 8\]",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.randn(3, 8, 2).transpose(1, 2), torch.zeros(8), 1e-6
            ),
            "partials: last dim must have stride 1",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(torch.randn(2, 8), torch.randn(3, 2, 8), torch.zeros(8), 1e-6),
            "residual_rmsnorm_splitk: residual: dtype torch.float32",
        ),
        (
            lambda: kernels.residual_rmsnorm_splitk(
                torch.randn(2, 8).bfloat16(), torch.randn(3, 2, 8), torch.zeros(8), 1e-6, out_normed=torch.empty(2, 8)
            ),
            "out_normed: dtype torch.float32",
        ),
        (
            lambda: kernels.gated_rmsnorm(
                torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 12).bfloat16(), torch.ones(4, dtype=torch.float16), 1e-6
            ),
            "dtype torch.float16",
        ),
        (
            lambda: kernels.gated_rmsnorm(
                torch.randn(5, 3, 4).bfloat16(),
                torch.randn(2, 12).bfloat16(),
                torch.ones(4),
                1e-6,
                o_rows=torch.tensor([0, 4, 1]),
            ),
            r"o_rows: shape \(3,\)",
        ),
        (
            lambda: kernels.gated_rmsnorm(
                torch.randn(5, 3, 4).bfloat16(), torch.randn(2, 12).bfloat16(), torch.ones(4), 1e-6
            ),
            r"must be \[R or L, Hv, V\] = \[2, 3, 4\]",
        ),
        (
            lambda: _tiny_gdn_prep(cu_seqlens=torch.tensor([0, 3]), rows=torch.tensor([0.0, 1.0, 2.0])),
            "rows: dtype torch.float32",
        ),
        (
            lambda: kernels.attention_gate(torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 3, 5).bfloat16()),
            r"gate: shape \(2, 3, 5\)",
        ),
        (lambda: _tiny_gdn_prep(conv_weight=torch.randn(TINY.conv_dim, 4)), "bf16 only"),
        (lambda: _tiny_gdn_prep(cu_seqlens=torch.tensor([0.0, 5.0])), "cu_seqlens: dtype"),
        (lambda: _tiny_attn_prep(layout="bhtd"), "layout"),
        (lambda: _tiny_attn_prep(layout="htd", key_rows=torch.tensor([0, 3])), "key_rows needs layout 'thd'"),
        (lambda: _tiny_attn_prep(rotary_dim=15), "rotary_dim 15"),
    ],
)
def test_launchers_reject_bad_inputs(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
