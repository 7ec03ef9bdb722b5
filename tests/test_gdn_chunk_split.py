"""CPU tests of the two-launch schedule of the chunked gated-delta-rule forward (`kernels/gdn_chunk_split.py`, Triton
interpreter): bit for bit the one-kernel forward (`kernels/gdn_chunk.py`, itself tested against the fp32 oracle in
tests/test_gdn_chunk.py), outputs and final states.

Inputs: fresh seeded random tensors (`tests.cases.gdn_chunk_inputs`, never zeros) at small odd sizes (GVA 2 -> 6
heads, K = 32, V = 16; 1 -> 2 heads, K = 16, V = 32); sequences of 0, 1, 63, 64, 65 and 130 tokens packed together,
NaN input rows after the last sequence (a bucket's trailing slots), nonzero initial states; outputs NaN-poisoned
before each launch (every row of a sequence is written, no row outside them).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py)

import triton  # noqa: E402
from fla.ops.utils.index import prepare_chunk_indices  # noqa: E402

from kernels import gdn_chunk_split  # noqa: E402
from kernels.gdn_chunk import GdnChunkCore, gdn_chunk_forward  # noqa: E402
from tests.cases import gdn_chunk_inputs  # noqa: E402

if isinstance(gdn_chunk_split._gdn_chunk_state_kernel, triton.runtime.JITFunction):
    pytest.skip("kernels were compiled, not interpreted (TRITON_INTERPRET=1 unset)", allow_module_level=True)

LENGTHS = (65, 0, 1, 130, 63, 64)  # an empty sequence between others, as a bucket's dummy paths
DIMS = {"gva-2-6-k32-v16": (2, 6, 32, 16), "gva-1-2-k16-v32": (1, 2, 16, 32)}
TRAILING = 5  # input rows after the last sequence


def _inputs(lengths, dims, seed):
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(lengths, dims, seed=seed)
    nan_rows = [torch.full((TRAILING, *t.shape[1:]), float("nan"), dtype=t.dtype) for t in (q, k, v, g, beta)]
    q, k, v, g, beta = (torch.cat([t, rows]) for t, rows in zip((q, k, v, g, beta), nan_rows))
    return q, k, v, g, beta, cu, h0


def _both(inputs, dims, bf16_points=True, **options):
    """(fused, split): each (o, final) into NaN-poisoned buffers."""
    q, k, v, g, beta, cu, h0 = inputs
    results = []
    for schedule in ("fused", "split"):
        out = torch.full(
            (len(q), dims[1], dims[3]), float("nan"), dtype=torch.bfloat16 if bf16_points else torch.float32
        )
        final = torch.full((len(cu) - 1, dims[1], dims[2], dims[3]), float("nan"))
        results.append(
            gdn_chunk_forward(
                q,
                k,
                v,
                g,
                beta,
                cu,
                initial_state=h0,
                output_final_state=True,
                out=out,
                final_state_out=final,
                bf16_points=bf16_points,
                schedule=schedule,
                **options,
            )  # fmt: skip
        )
    return results


@pytest.mark.parametrize(
    ("dims", "bf16_points", "value_block"),
    [
        (DIMS["gva-2-6-k32-v16"], True, None),
        (DIMS["gva-1-2-k16-v32"], True, 16),
        (DIMS["gva-1-2-k16-v32"], False, None),
    ],
    ids=["gva-2-6-k32-v16-bf16", "gva-1-2-k16-v32-bf16-bv16", "gva-1-2-k16-v32-fp32"],
)
def test_split_is_the_fused_kernel_bit_for_bit(dims, bf16_points, value_block):
    """Outputs and final states equal, with FLA's rounding points and without, for the value block V and a smaller
    one; rows outside the sequences stay unwritten; an empty sequence keeps its initial state."""
    inputs = _inputs(LENGTHS, dims, seed=31 + bf16_points)
    (fused_o, fused_s), (split_o, split_s) = _both(inputs, dims, bf16_points, value_block=value_block)
    end = int(inputs[5][-1])
    assert torch.isfinite(split_o[:end]).all() and torch.isnan(split_o[end:]).all()
    assert torch.equal(split_o[:end], fused_o[:end]) and torch.equal(split_s, fused_s)
    assert torch.equal(split_s[1], inputs[6][1]), "the empty sequence's final state is its initial state"


def test_split_from_zero_states_and_a_single_sequence():
    """No initial state (zeros), one sequence of 130 rows and one of 64: the bits of the fused kernel."""
    dims = DIMS["gva-2-6-k32-v16"]
    for lengths, seed in (((130,), 33), ((64,), 34)):
        q, k, v, g, beta, cu, _ = gdn_chunk_inputs(lengths, dims, seed=seed)
        fused = gdn_chunk_forward(q, k, v, g, beta, cu, output_final_state=True)
        split = gdn_chunk_forward(q, k, v, g, beta, cu, output_final_state=True, schedule="split")
        assert torch.equal(split[0], fused[0]) and torch.equal(split[1], fused[1])


def test_the_core_adapter_takes_the_plans_chunk_index():
    """`GdnChunkCore(schedule="split")` launches over the chunk index it is handed (the plan's `GdnCall.chunk_indices`,
    `engine.plan_arrays._chunk_layout`, FLA's `prepare_chunk_indices` layout) or builds FLA's from `cu_seqlens_cpu`;
    both give the fused kernel's bits, with and without states."""
    from engine.plan_arrays import _chunk_layout

    dims = DIMS["gva-1-2-k16-v32"]
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs((63, 0, 130), dims, seed=35)
    plan_indices, _ = _chunk_layout(cu.numpy(), 64)
    built = prepare_chunk_indices(cu, 64)
    assert np.array_equal(built.numpy(), plan_indices) and built.tolist() == [[0, 0], [2, 0], [2, 1], [2, 2]]
    batch = [t[None] for t in (q, k, v, g, beta)]
    ref_o, ref_s = GdnChunkCore()(*batch, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    split = GdnChunkCore(schedule="split")
    for layout in ({"chunk_indices": torch.from_numpy(plan_indices)}, {"cu_seqlens_cpu": cu.clone()}):
        o, final = split(*batch, cu_seqlens=cu, initial_state=h0, output_final_state=True, **layout)
        assert torch.equal(o, ref_o) and torch.equal(final, ref_s)
    o, final = split(*batch, cu_seqlens=cu, chunk_indices=torch.from_numpy(plan_indices))
    assert final is None and torch.equal(o, GdnChunkCore()(*batch, cu_seqlens=cu)[0])


def test_bad_schedules_and_chunk_indices_are_refused():
    dims = DIMS["gva-1-2-k16-v32"]
    q, k, v, g, beta, cu, _ = gdn_chunk_inputs((5,), dims, seed=36)
    with pytest.raises(ValueError, match="schedule"):
        gdn_chunk_forward(q, k, v, g, beta, cu, schedule="serial")
    with pytest.raises(ValueError, match="chunk_indices: shape"):
        gdn_chunk_forward(q, k, v, g, beta, cu, schedule="split", chunk_indices=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="chunk_indices: dtype"):
        gdn_chunk_forward(q, k, v, g, beta, cu, schedule="split", chunk_indices=torch.zeros(1, 2))
