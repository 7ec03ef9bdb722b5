"""The FlashInfer GDN core's adapter on the CPU (kernels/gdn_flashinfer.py): FlashInfer's kernel needs sm_90, so a
stand-in implements its documented contract (q, k, v [T, H, D]; linear fp32 alpha and fp32 beta [T, Hv]; states
[N, Hv, V, K]; value head j reads q/k head j · Hk / Hv) with the fp32 oracle `reference.ops.gdn_recurrent`, and the
adapter, called as FLA's core is (states [N, Hv, K, V], log decay, bf16 beta), must give the oracle's outputs and final
states. A transpose left out, a head grouping other than FLA's or the decay passed in the wrong domain moves the
outputs by their own size; the only difference allowed is the rounding of log(exp(g)) in fp32. The kernel itself is
checked on the GPU (tests/test_gpu_gdn_flashinfer.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.gdn_flashinfer import FLASHINFER, FlashInferCore
from reference import ops
from tests.cases import gdn_chunk_inputs, gdn_chunk_oracle

LENGTHS = (37, 1, 70, 129)  # odd lengths, one row, across 64-row chunk edges
DIMS = (2, 6, 16, 16)  # Hk, Hv, K, V: three value heads a key head, as 16 and 48 in the 27B


def flashinfer_contract(q, k, v, alpha, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, output_state, state_indices, output_state_indices, use_cp,
                        backend):  # fmt: skip
    """FlashInfer's `chunk_gated_delta_rule` with state pools, as its docstring states it, computed by the oracle:
    sequence i starts from row state_indices[i] of initial_state (-1: zeros) and stores its final state to row
    output_state_indices[i] of output_state (-1: nothing)."""
    assert (use_cp, backend, use_qk_l2norm_in_kernel, output_final_state) == (False, "flashinfer", False, True)
    assert alpha.dtype == beta.dtype == torch.float32 and alpha.shape == beta.shape == v.shape[:2]
    assert q.dim() == k.dim() == v.dim() == 3 and all(t.is_contiguous() for t in (q, k, v, alpha, beta))
    assert state_indices.dtype == output_state_indices.dtype == torch.int32
    assert initial_state.shape[1:] == output_state.shape[1:] == (v.shape[1], v.shape[2], q.shape[2])
    bounds = cu_seqlens.tolist()
    out = torch.full(v.shape, float("nan"), dtype=v.dtype)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        read, write = int(state_indices[i]), int(output_state_indices[i])
        h0 = None if read < 0 else initial_state[read].transpose(-1, -2)  # [Hv, V, K] -> [Hv, K, V]
        o, final = ops.gdn_recurrent(q[s:e], k[s:e], v[s:e], alpha[s:e].log(), beta[s:e], h0, scale)
        out[s:e] = o.to(v.dtype)
        if write >= 0:
            output_state[write] = final.transpose(-1, -2)  # the library's [Hv, V, K]
    return out, output_state


def test_adapter_gives_the_oracle_through_the_library_contract():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=5)
    core = FlashInferCore(function=flashinfer_contract)
    o, final = core(*(t[None].contiguous() for t in (q, k, v, g, beta)), cu_seqlens=cu, initial_state=h0,
                    output_final_state=True, chunk_indices=None, workspace=None)  # fmt: skip
    ref_o, ref_final = gdn_chunk_oracle(q, k, v, g, beta, cu, h0)
    assert o.shape == (1, *v.shape) and o.dtype == torch.bfloat16 and final.shape == h0.shape
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-5)


def test_adapter_without_states_returns_none():
    q, k, v, g, beta, cu, _ = gdn_chunk_inputs(LENGTHS, DIMS, seed=6)
    o, final = FlashInferCore(function=flashinfer_contract)(*(t[None].contiguous() for t in (q, k, v, g, beta)),
                                                             cu_seqlens=cu)  # fmt: skip
    ref_o, _ = gdn_chunk_oracle(q, k, v, g, beta, cu, torch.zeros(len(LENGTHS), *DIMS[1:2], *DIMS[2:]))
    assert final is None
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_adapter_with_initial_states_and_no_final_state_leaves_them_alone():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=8)
    before = h0.clone()
    o, final = FlashInferCore(function=flashinfer_contract)(*(t[None].contiguous() for t in (q, k, v, g, beta)),
                                                             cu_seqlens=cu, initial_state=h0)  # fmt: skip
    ref_o, _ = gdn_chunk_oracle(q, k, v, g, beta, cu, h0)
    assert final is None and torch.equal(h0, before)
    torch.testing.assert_close(o[0].float(), ref_o.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_adapter_refuses_bad_input():
    q, k, v, g, beta, cu, h0 = gdn_chunk_inputs(LENGTHS, DIMS, seed=7)
    core = FlashInferCore(function=flashinfer_contract)
    packed = [t[None].contiguous() for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="q must be contiguous"):
        core(q, *packed[1:], cu_seqlens=cu)  # no batch dim
    with pytest.raises(ValueError, match="3 initial states for 4 sequences"):
        core(*packed, cu_seqlens=cu, initial_state=h0[:3])


def test_missing_library_names_the_package():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=FLASHINFER.replace(".", r"\.")):
            FlashInferCore()
    else:
        pytest.skip("flashinfer is installed here")
