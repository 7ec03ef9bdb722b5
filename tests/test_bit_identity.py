"""CPU tests of ablations/bit_identity.py: activations captured from the HF reference forward of the tiny twin
(synthetic weights, padded batches, odd candidate lengths) and the per-kernel bit-identity table on them under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is present).

What is proved: the capture takes exactly the tensors HF computed (the layer inputs equal the reference backbone's
own hidden states bit for bit, at the real tokens, in candidate order; the merged projections are the HF modules'
outputs in merged order; hooks and the attention interface are restored afterwards); every kernel of the captured
layers appears in the table with a share in [0, 1]; the outputs that are bitwise on the CPU (kernels/__init__.py)
are 100 % bit-identical and the rest meet their bounds (g: CPU_RELAXED, the interpreter's exp / log1p); an output a
kernel leaves unwritten (still NaN from the poisoning) fails the expectation.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (tests/test_kernels.py explains)

from ablations import bit_identity  # noqa: E402
from reference import ops  # noqa: E402
from reference.shapes import TINY  # noqa: E402

CANDIDATE_LENGTHS = (5, 9, 1, 6)  # batch_size 3: two padded batches, one of a single candidate
GROUPS = [0, 0, 1, 1]
LAYERS = [0, 3, 6, 7]  # first GDN, first attention, last GDN, last attention of the tiny twin
GDN_OUTPUTS = {"silu_mul": ["out"], "residual_rmsnorm": ["new_residual", "normed"],
               "gdn_prep": ["q", "k", "v", "g", "beta"], "gated_rmsnorm": ["out"]}  # fmt: skip
ATTENTION_OUTPUTS = {"silu_mul": ["out"], "residual_rmsnorm": ["new_residual", "normed"],
                     "attn_prep": ["q", "k", "v"], "attention_gate": ["out"]}  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """The tiny reference backbone (hf_torch, batches of 3), seeded candidates, and what was captured from it."""
    from reference.model import HFBackbone
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=3)
    backbone = HFBackbone(weights, "torch", batch_size=3)
    generator = torch.Generator().manual_seed(11)
    candidates = [torch.randint(0, TINY.vocab_size, (n,), generator=generator).tolist() for n in CANDIDATE_LENGTHS]
    backbone.forward(backbone.prepare(candidates, GROUPS))  # HF installs its own hooks at the first call
    before = _hooks(backbone.model)
    captured = bit_identity.capture_activations(backbone, candidates, GROUPS, layers=LAYERS)
    assert _hooks(backbone.model) == before, "the capture left hooks behind"
    return backbone, candidates, captured


def _hooks(model: torch.nn.Module) -> dict[str, tuple]:
    return {name: (*m._forward_hooks, *m._forward_pre_hooks) for name, m in model.named_modules()}


def _require_interpreter() -> None:
    import triton

    from kernels import activations

    if isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were compiled, not interpreted: TRITON_INTERPRET=1 was not set before `kernels` loaded")


def test_representative_layers_are_the_first_and_last_of_each_kind():
    assert bit_identity.representative_layers(TINY) == LAYERS
    assert bit_identity.representative_layers(TINY, late=False) == [0, 3]


def test_capture_has_every_kernel_input_in_the_kernel_layouts(tiny):
    _, _, captured = tiny
    tokens, sh = sum(CANDIDATE_LENGTHS), TINY
    assert sorted(captured) == LAYERS
    for layer in (0, 6):
        act = captured[layer]
        assert act["gdn_proj"].shape == (tokens, sh.gdn_in_width)
        assert act["gdn_core_out"].shape == (tokens, sh.linear_num_value_heads, sh.linear_value_head_dim)
        assert act["conv_weight"].shape == (sh.conv_dim, sh.linear_conv_kernel_dim)
        assert act["gdn_cu_seqlens"].tolist() == [0, 5, 14, 15, 21]
        assert "attn_proj" not in act
    for layer in (3, 7):
        act = captured[layer]
        assert act["attn_proj"].shape == (tokens, sh.attn_in_width)
        assert act["attn_core_out"].shape == (tokens, sh.num_attention_heads, sh.head_dim)
        assert act["cos"].shape == act["sin"].shape == (tokens, sh.rotary_dim)
        assert "gdn_proj" not in act
    for act in captured.values():
        assert act["mlp_gate_up"].shape == (tokens, 2 * sh.intermediate_size)
        assert act["residual"].shape == act["delta"].shape == (tokens, sh.hidden_size)
        assert all(t.dtype in (torch.bfloat16, torch.float32, torch.int32) for t in act.values())
        assert all(not t.is_floating_point() or bool(t.isfinite().all()) for t in act.values())


def test_capture_takes_what_the_reference_forward_computed(tiny):
    """Layer inputs equal the backbone's own hidden states at the real tokens; the merged projections are the HF
    modules' outputs on the layer's normed input; the rotary tables restart at every candidate."""
    backbone, candidates, captured = tiny
    prepared = backbone.prepare(candidates, GROUPS)
    hidden = backbone.hidden_states(prepared)
    model, eps = backbone.model, TINY.rms_norm_eps
    for layer, act in captured.items():
        assert torch.equal(act["residual"], hidden[layer]), layer
        block = model.layers[layer]
        mid, normed = ops.residual_rmsnorm(act["residual"], act["delta"], act["norm_weight"], eps)
        assert torch.equal(ops.residual_add(mid, _mlp(block, normed)), hidden[layer + 1]), layer
        x = ops.rmsnorm_1p(act["residual"], block.input_layernorm.weight, eps)
        if layer in (0, 6):
            mixer = block.linear_attn
            parts = [mixer.in_proj_qkv(x), mixer.in_proj_z(x), mixer.in_proj_b(x), mixer.in_proj_a(x)]
            assert torch.equal(act["gdn_proj"], torch.cat(parts, -1)), layer
        else:
            mixer = block.self_attn
            assert torch.equal(act["attn_proj"], torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1))
            starts = torch.tensor([0, 5, 14, 15])
            assert torch.equal(act["cos"][starts], act["cos"][:1].expand(4, -1)), "position 0 of every candidate"


def _mlp(block: torch.nn.Module, normed: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block.mlp(normed[None])[0]


def test_capture_restores_the_attention_interface(tiny):
    """(The hooks are checked in the fixture: the same hook ids before and after the capture.)"""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

    assert hf_qwen3_5.ALL_ATTENTION_FUNCTIONS is ALL_ATTENTION_FUNCTIONS


def test_capture_rejects_layers_outside_the_model(tiny):
    backbone, candidates, _ = tiny
    for layers in ([], [TINY.num_layers], [-1]):
        with pytest.raises(ValueError, match="layers must be"):
            bit_identity.capture_activations(backbone, candidates, GROUPS, layers=layers)


def test_table_on_captured_activations_meets_the_declared_exactness(tiny):
    _require_interpreter()
    _, _, captured = tiny
    table = bit_identity.captured_table(captured, TINY)
    print(f"\ntiny twin, captured activations (interpreter)\n{bit_identity.format_table(table)}")
    expected = [
        (layer, kernel, output)
        for layer in LAYERS
        for kernel, outputs in (GDN_OUTPUTS if layer in (0, 6) else ATTENTION_OUTPUTS).items()
        for output in outputs
    ]
    assert sorted((r["layer"], r["kernel"], r["output"]) for r in table) == sorted(expected)
    assert {r["kernel"] for r in table} == set(bit_identity.KERNELS)
    for r in table:
        assert 0.0 <= r["share"] <= 1.0 and r["elements"] > 0 and r["unwritten"] == 0
        if (r["kernel"], r["output"]) in bit_identity.BITWISE - set(bit_identity.CPU_RELAXED):
            assert r["share"] == 1.0, r  # bitwise on the CPU too (kernels/__init__.py)
    bit_identity.check_rows(table, relaxed=bit_identity.CPU_RELAXED)


def test_an_unwritten_output_is_not_identical_and_misses_its_expectation():
    generator = torch.Generator().manual_seed(5)
    want = torch.randn(7, 33, generator=generator).to(torch.bfloat16)
    got = want.clone()
    got[3, 17] = float("nan")
    row = bit_identity.compare("silu_mul", "out", got, want, layer=2)
    assert row["unwritten"] == 1 and row["bit_identical"] == want.numel() - 1 and row["max_abs_diff"] is None
    assert row["layer"] == 2 and row["max_ulp"] > 1000
    assert not bit_identity.meets_expectation(row)
    with pytest.raises(AssertionError, match="left unwritten"):
        bit_identity.check_rows([row])
    close = bit_identity.compare("attn_prep", "q", want, want)
    assert close["share"] == 1.0 and bit_identity.meets_expectation(close)


def test_unknown_kernel_names_are_refused():
    with pytest.raises(ValueError, match="unknown kernels"):
        bit_identity.bit_identity_table({}, TINY, kernels=["silu"])
