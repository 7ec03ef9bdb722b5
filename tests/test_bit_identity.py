"""CPU tests of ablations/bit_identity.py: activations captured from the HF reference forward of the tiny twin
(synthetic weights, padded batches, odd candidate lengths) and the per-kernel bit-identity table on them under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is present).

What is proved: the capture takes exactly the tensors HF computed (the layer inputs equal the reference backbone's
own hidden states bit for bit, at the real tokens, in candidate order; the merged projections are the HF modules'
outputs in merged order; hooks and the attention interface are restored afterwards); every kernel of the captured
layers appears in the table with a share in [0, 1]; the outputs that are bitwise on the CPU (kernels/__init__.py)
are 100 % bit-identical and the rest meet their bounds (g: CPU_RELAXED, the interpreter's exp / log1p); an output a
kernel leaves unwritten (still NaN from the poisoning) fails the expectation.

The flip model (FLIP_MODEL outputs: the gated norm, attn_prep q / k), on made-up rows: `ulp_step` moves bf16 values
by representable values across zero and signs; `rope_with_partner` on a moved partner is the RoPE formula; an
element the reference chain gives from n moved by one ulp is accepted even where it is 2+ output ulps off (which the
old one-ulp rule, still applied to rows without "unexplained", rejects); a difference no such flip gives (+1 or
+3 ulps where no flip lands there, another value, a NaN) is unexplained and rejected, the share being high enough.
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
        if (r["kernel"], r["output"]) in bit_identity.FLIP_MODEL:
            assert r["unexplained"] == 0, r
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


# ---------------------------------------------------------------------------------------------------------------------
# The flip model, on made-up rows

FLIP_CASES = ("gated_rmsnorm fp32 weight", "gated_rmsnorm bf16 weight", "attn_prep q")


def _bf16(generator: torch.Generator, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    """Seeded normal values rounded to bf16, zeros (rare) replaced by 0.5."""
    x = (torch.randn(shape, generator=generator) * std + mean).to(torch.bfloat16)
    return x.masked_fill(x == 0, 0.5)


def _flip_case(case: str) -> tuple[str, str, torch.Tensor, list[torch.Tensor]]:
    """(kernel, output, the reference's output, its flips) on fresh seeded inputs of odd sizes, >= 10^4 elements so
    that one changed element keeps the share above ONE_ULP_MIN_SHARE."""
    generator = torch.Generator().manual_seed(FLIP_CASES.index(case) + 41)
    eps = TINY.rms_norm_eps
    if case.startswith("gated_rmsnorm"):
        o, z = _bf16(generator, 101, 3, 37, std=0.5), _bf16(generator, 101, 3, 37, std=2.0)
        weight = _bf16(generator, 37, std=0.1, mean=1.0)
        weight = weight.float() if "fp32" in case else weight
        want = ops.gated_rmsnorm(o, z, weight, eps)
        return "gated_rmsnorm", "out", want, list(bit_identity.gated_rmsnorm_flips(o, z, weight, eps))
    x, weight = _bf16(generator, 41, 5, TINY.head_dim), _bf16(generator, TINY.head_dim, std=0.1)
    cos, sin = ops.rope_cos_sin(torch.arange(23, 23 + 41), TINY.rotary_dim, TINY.rope_theta)
    normed = ops.rmsnorm_1p(x, weight, eps)
    want = ops.apply_partial_rope(normed, cos, sin)
    return "attn_prep", "q", want, list(bit_identity.rope_flips(normed, cos, sin))


def _one_changed(want: torch.Tensor, index: int, value: torch.Tensor) -> torch.Tensor:
    got = want.clone()
    got.view(-1)[index] = value
    return got


def test_ulp_step_moves_by_representable_values_across_zero_and_signs():
    generator = torch.Generator().manual_seed(43)
    x = torch.cat(
        [_bf16(generator, 999, std=3.0), torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-133], dtype=torch.bfloat16)]
    )
    for steps in (-3, -1, 1, 3):
        moved = bit_identity.ulp_step(x, steps)
        assert torch.equal(
            bit_identity._ordered(moved) - bit_identity._ordered(x), torch.full_like(moved, steps, dtype=torch.int64)
        )
        assert torch.equal(
            bit_identity.ulp_step(moved, -steps).view(torch.int16), (x + 0.0).view(torch.int16)
        )  # -0 -> +0
    tiny = torch.tensor(2.0**-133, dtype=torch.bfloat16)  # the smallest positive bf16 subnormal
    zeros = torch.tensor([0.0, -0.0], dtype=torch.bfloat16)
    assert torch.equal(bit_identity.ulp_step(zeros, 1), torch.stack([tiny, tiny]))
    assert torch.equal(bit_identity.ulp_step(zeros, -1), -torch.stack([tiny, tiny]))
    assert bit_identity.ulp_step(torch.tensor([1.0], dtype=torch.bfloat16), 1).item() == 1.0 + 2.0**-7
    assert bit_identity.ulp_step(torch.tensor([-1.0], dtype=torch.bfloat16), 1).item() == -1.0 + 2.0**-8


def test_rope_with_a_moved_partner_is_the_rope_formula():
    """Independent fp64 evaluation (each bf16 product exact, then the roundings), partner moved by one ulp."""
    generator = torch.Generator().manual_seed(47)
    seq, heads, head_dim, rotary_dim = 29, 3, 64, 16
    x = _bf16(generator, seq, heads, head_dim, std=2.0)
    partner = bit_identity.ulp_step(x, 1)
    cos, sin = ops.rope_cos_sin(torch.arange(5, 5 + seq), rotary_dim, TINY.rope_theta)
    y = ops.rope_with_partner(x, partner, cos, sin)
    assert torch.equal(ops.rope_with_partner(x, x, cos, sin), ops.apply_partial_rope(x, cos, sin))
    half = rotary_dim // 2
    x1, x2 = x[..., :half].double(), x[..., half:rotary_dim].double()
    p1, p2 = partner[..., :half].double(), partner[..., half:rotary_dim].double()
    c, s = cos[:, None, :half].double(), sin[:, None, :half].double()
    first = (x1 * c).to(torch.bfloat16).double() + (-p2 * s).to(torch.bfloat16).double()
    second = (x2 * c).to(torch.bfloat16).double() + (p1 * s).to(torch.bfloat16).double()
    assert torch.equal(y[..., :half], first.to(torch.bfloat16))
    assert torch.equal(y[..., half:rotary_dim], second.to(torch.bfloat16))
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("case", FLIP_CASES)
def test_a_flip_of_n_through_the_chain_is_explained_even_at_several_ulps(case):
    kernel, output, want, flips = _flip_case(case)
    assert len(flips) == (2 if kernel == "gated_rmsnorm" else 8)
    want_bits = bit_identity._ordered(want).reshape(-1)
    distance = torch.stack([(bit_identity._ordered(f).reshape(-1) - want_bits).abs() for f in flips])
    flip, index = divmod(int(distance.argmax()), want.numel())
    got = _one_changed(want, index, flips[flip].reshape(-1)[index])
    row = bit_identity.compare(kernel, output, got, want, flips=flips)
    print(f"{case}: a flip of n gives {row['max_ulp']} output ulps")
    assert row["max_ulp"] >= 2 and row["bit_identical"] == want.numel() - 1 and row["unexplained"] == 0
    assert row["share"] >= bit_identity.ONE_ULP_MIN_SHARE
    assert bit_identity.meets_expectation(row)
    bit_identity.check_rows([row])
    assert bit_identity.expectation(kernel, output) == "1-ulp flips of n only, in >= 99.99 %"
    old_record = {key: value for key, value in row.items() if key != "unexplained"}
    assert not bit_identity.meets_expectation(old_record)  # without the count: the one-ulp bound
    with pytest.raises(ValueError, match="no 'unexplained' count"):
        bit_identity.check_rows([old_record])


@pytest.mark.parametrize("case", FLIP_CASES)
@pytest.mark.parametrize("made_up", ["+1 ulp", "+3 ulp", "another value", "NaN"])
def test_a_difference_no_flip_gives_is_unexplained_and_rejected(case, made_up):
    kernel, output, want, flips = _flip_case(case)
    reachable = torch.stack([bit_identity._ordered(f).reshape(-1) for f in flips])
    if made_up == "NaN":
        candidate = torch.full_like(want, float("nan"))
    elif made_up == "another value":
        candidate = -3 * want.flip(-1)
    else:
        candidate = bit_identity.ulp_step(want, int(made_up[1]))
    free = ~(reachable == bit_identity._ordered(candidate).reshape(-1)).any(0)
    assert free.any(), "no element where no flip gives the made-up value"
    index = int(free.nonzero()[0])
    got = _one_changed(want, index, candidate.reshape(-1)[index])
    row = bit_identity.compare(kernel, output, got, want, flips=flips)
    assert row["unexplained"] == 1 and row["share"] >= bit_identity.ONE_ULP_MIN_SHARE
    assert row["unwritten"] == (made_up == "NaN")
    assert not bit_identity.meets_expectation(row)
    with pytest.raises(AssertionError, match="1 elements not explained by a 1-ulp flip of n"):
        bit_identity.check_rows([row])
