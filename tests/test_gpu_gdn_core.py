"""GPU: `kernels.gdn_core.FlaForwardCore` (FLA's forward kernels launched directly, the solve buffer reused through a
workspace) against FLA's public `chunk_gated_delta_rule`, bit for bit, at the 27B's GDN head shapes.

Fresh random inputs per call (never zeros), odd sequence lengths (1, 7, 63, 65, 277, 1000 rows: partial chunks, chunk
boundaries, one-row sequences), with and without initial states, final states kept, q/k normalised by FLA or before.
The workspace case runs several "layers" (new inputs each) over one workspace, as a forward does, and also
interleaves a second call layout, as the tree's hand-off schedule does: every call must still match FLA's function.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.plan import SolveWorkspace
from kernels.gdn_core import FlaForwardCore, fla_chunk_function
from reference.shapes import QWEN38_27B as S

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
ODD_LENGTHS = [1, 7, 63, 65, 277, 1000]


def varlen(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.utils.index import prepare_chunk_indices

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return cu, prepare_chunk_indices(cu, 64)


def inputs(tokens: int, sequences: int, *, seed: int, initial: bool) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h, hv, d = S.linear_num_key_heads, S.linear_num_value_heads, S.linear_key_head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    a_log = torch.log(torch.rand(hv, generator=gen, device=DEVICE) * 15 + 1)
    out = {
        "q": F.normalize(randn(1, tokens, h, d), dim=-1).bfloat16(),
        "k": F.normalize(randn(1, tokens, h, d), dim=-1).bfloat16(),
        "v": randn(1, tokens, hv, d).bfloat16(),
        "g": -torch.exp(a_log) * F.softplus(randn(1, tokens, hv) + randn(hv)),
        "beta": torch.sigmoid(randn(1, tokens, hv)).bfloat16(),
    }
    out["initial_state"] = randn(sequences, hv, d, d) * 0.1 if initial else None
    return out


@pytest.mark.parametrize("l2norm_in_kernel", [False, True])
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("lengths", [ODD_LENGTHS, [1000], [65, 1, 63]])
def test_fla_forward_core_bitwise(lengths, initial, l2norm_in_kernel):
    public, direct = fla_chunk_function(), FlaForwardCore()
    cu, chunk_indices = varlen(lengths)
    x = inputs(sum(lengths), len(lengths), seed=len(lengths) + 10 * initial + 100 * l2norm_in_kernel, initial=initial)
    options = {"cu_seqlens": cu, "chunk_indices": chunk_indices, "output_final_state": True}
    options["use_qk_l2norm_in_kernel"] = l2norm_in_kernel
    o_ref, state_ref = public(**x, **options)
    o, state = direct(**x, **options)
    assert not o.isnan().any() and not state.isnan().any()
    assert o.dtype == o_ref.dtype == torch.bfloat16 and state.dtype == state_ref.dtype == torch.float32
    assert torch.equal(o, o_ref), f"max abs {(o.float() - o_ref.float()).abs().max().item():.3g}"
    assert torch.equal(state, state_ref)


def test_fla_forward_core_workspace_reuse_is_bitwise():
    """One workspace over six 'layers' that alternate two call layouts: each call equals FLA's function, and the
    workspace holds one solve buffer per layout (the zero fill happens once per layout)."""
    public, direct = fla_chunk_function(), FlaForwardCore()
    layouts = [varlen(ODD_LENGTHS), varlen([130, 5, 64])]
    workspace = SolveWorkspace()
    for layer in range(6):
        lengths = ODD_LENGTHS if layer % 2 == 0 else [130, 5, 64]
        cu, chunk_indices = layouts[layer % 2]
        x = inputs(sum(lengths), len(lengths), seed=1000 + layer, initial=layer % 2 == 1)
        options = {"cu_seqlens": cu, "chunk_indices": chunk_indices, "output_final_state": layer % 2 == 1}
        o_ref, state_ref = public(**x, **options)
        o, state = direct(**x, **options, workspace=workspace)
        assert torch.equal(o, o_ref), f"layer {layer}: max abs {(o.float() - o_ref.float()).abs().max().item():.3g}"
        if layer % 2 == 1:
            assert torch.equal(state, state_ref)
    assert len(workspace) == 2


def test_fla_forward_core_rejects_bad_input():
    direct = FlaForwardCore()
    cu, chunk_indices = varlen([7, 9])
    x = inputs(16, 2, seed=3, initial=False)
    with pytest.raises(ValueError, match="contiguous"):
        direct(**(x | {"v": x["v"].transpose(2, 3)}), cu_seqlens=cu, chunk_indices=chunk_indices)
    with pytest.raises(ValueError, match="initial states"):
        bad_state = torch.ones(
            3, S.linear_num_value_heads, S.linear_key_head_dim, S.linear_value_head_dim, device=DEVICE
        )
        direct(**(x | {"initial_state": bad_state}), cu_seqlens=cu, chunk_indices=chunk_indices)
