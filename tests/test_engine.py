"""The engine backbone on the CPU (tiny twin, synthetic weights): merged weights, packed layout, `merged` against the
HF reference (`hf_torch`), `fused` against `merged`.

What is exact, measured here (tiny twin, seed 3):
* merged GEMMs: bitwise against HF's separate projections (the CPU bf16 GEMM's output element does not depend on the
  matrix width or the row count);
* everything up to the first attention layer (embedding, GDN layers 0-2: norms, conv over the packed conv layout,
  gates, HF's torch chunk rule per candidate, gated norm, MLP): bitwise against `hf_torch`;
* attention layers: q, k, v reach SDPA bitwise; SDPA itself is the first op that departs (the packed block-diagonal
  call tiles keys differently from HF's padded batch; CPU flash-attention blocking depends on the key count), by a few
  bf16 ulps on some rows; with a single candidate (no padding in HF either) it is bitwise. From there on the residual
  stream carries it: relative RMSE per state up to 3.7e-3 with the current synthetic weights. An earlier draft of the
  synthetic scales gave 1.4e-2 on set "three" (its 5-token candidate had a near-cancelling GDN head that the gated
  RMSNorm renormalises, amplifying one ulp tenfold), hence the bound of 3e-2.
* fused vs merged under the interpreter: bounded, not bitwise (see that test); `tree` vs `fused`: bitwise
  (tests/test_engine_tree.py).
Synthetic weights: no probability here means anything for accuracy.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is first imported (by engine.backbone)

import triton  # noqa: E402

from engine.backbone import EngineBackbone  # noqa: E402
from engine.planner import EngineRows  # noqa: E402
from engine.stages import build_engine, config_of  # noqa: E402
from engine.weights import AttentionLayerWeights, GDNLayerWeights, MergedWeights  # noqa: E402
from kernels import activations  # noqa: E402
from reference.model import HFBackbone  # noqa: E402
from reference.shapes import TINY  # noqa: E402
from reference.weights import synthetic_weights  # noqa: E402

SEED = 3
# Candidate sets: one token, odd lengths, a candidate crossing the 64-row GDN chunk boundary, 1..6 candidates.
CANDIDATE_SETS = {
    "one": [41],
    "two": [1, 23],
    "three": [19, 70, 5],
    "six": [17, 2, 29, 11, 8, 5],
}
REL_RMSE_BOUND = 3e-2  # per residual state from the first attention layer on (module docstring)


def rel_rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    d = x.float() - ref.float()
    return (d.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


def random_candidates(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_torch() -> HFBackbone:
    return HFBackbone(synthetic_weights(TINY, seed=SEED), "torch")


@pytest.fixture(scope="module")
def merged_weights() -> MergedWeights:
    return MergedWeights.from_decision_weights(synthetic_weights(TINY, seed=SEED))


@pytest.fixture(scope="module")
def merged(merged_weights) -> EngineBackbone:
    return build_engine(merged_weights, "merged")


# ---------------------------------------------------------------------------------------------------------------------
# Merged weights


def test_merge_consumes_the_backbone_and_holds_it_once():
    weights = synthetic_weights(TINY, seed=SEED)
    source_bytes = sum(t.numel() * t.element_size() for t in weights.backbone.values())
    concatenated = [
        name
        for name in weights.backbone
        if name.endswith(("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"))
        or name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))
    ]
    sources = {name: weakref.ref(weights.backbone[name]) for name in concatenated}

    merged = MergedWeights.from_decision_weights(weights)
    gc.collect()

    assert weights.backbone == {}
    assert merged.nbytes() == source_bytes  # every element exactly once
    alive = [name for name, ref in sources.items() if ref() is not None]
    assert not alive, f"sources of merged GEMMs still alive: {alive}"
    storages = [t.untyped_storage().data_ptr() for _, t in merged.named_tensors()]
    assert len(set(storages)) == len(storages), "two merged tensors share storage"
    assert weights.head_weight.shape == (TINY.hidden_size,)  # the rest of DecisionWeights stays usable


def test_merged_layout_is_the_concatenation_of_hf_weights(merged_weights):
    ref = synthetic_weights(TINY, seed=SEED).backbone  # the same values: seeded per tensor name
    assert torch.equal(merged_weights.embed, ref["embed_tokens.weight"])
    assert torch.equal(merged_weights.final_norm, ref["norm.weight"])
    for i, layer in enumerate(merged_weights.layers):
        p = f"layers.{i}."
        if isinstance(layer, GDNLayerWeights):
            parts = [ref[p + f"linear_attn.in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")]
            assert layer.w_in.shape == (TINY.gdn_in_width, TINY.hidden_size)
            assert torch.equal(layer.conv_weight, ref[p + "linear_attn.conv1d.weight"][:, 0])
            assert torch.equal(layer.A_log, ref[p + "linear_attn.A_log"])
            assert torch.equal(layer.out_norm, ref[p + "linear_attn.norm.weight"])
            assert torch.equal(layer.w_out.data, ref[p + "linear_attn.out_proj.weight"])
        else:
            assert isinstance(layer, AttentionLayerWeights)
            parts = [ref[p + f"self_attn.{x}_proj.weight"] for x in ("q", "k", "v")]
            assert layer.w_in.shape == (TINY.attn_in_width, TINY.hidden_size)
            assert torch.equal(layer.q_norm, ref[p + "self_attn.q_norm.weight"])
            assert torch.equal(layer.w_out.data, ref[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.w_in.data, torch.cat(parts))
        assert torch.equal(
            layer.w_gate_up.data, torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
        )
        assert torch.equal(layer.w_down.data, ref[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_norm, ref[p + "input_layernorm.weight"])


@pytest.mark.parametrize("damage", ["missing", "shape", "extra"])
def test_merge_rejects_a_bad_state_dict_and_leaves_it_untouched(damage):
    weights = synthetic_weights(TINY, seed=SEED)
    name = "layers.1.linear_attn.in_proj_z.weight"
    if damage == "missing":
        del weights.backbone[name]
    elif damage == "shape":
        weights.backbone[name] = weights.backbone[name][:-1]
    else:
        weights.backbone["lm_head.weight"] = weights.backbone["embed_tokens.weight"]
    keys = list(weights.backbone)
    with pytest.raises(ValueError, match="in_proj_z|lm_head"):
        MergedWeights.from_decision_weights(weights)
    assert list(weights.backbone) == keys


# ---------------------------------------------------------------------------------------------------------------------
# Packed layout


def test_prepare_packs_rows_with_varlen_metadata(merged):
    lengths = [3, 70, 1, 5]
    candidates = random_candidates(lengths, seed=1)
    prepared = merged.prepare(candidates, [0, 0, 1, 2])
    assert isinstance(prepared, EngineRows) and len(prepared.batches) == 1 and prepared.order is None
    b = prepared.batches[0]
    plan = b.plan
    assert plan.kind == "flat" and b.gdn_mode == "replicated" and b.candidates == (0, 1, 2, 3)
    assert plan.token_ids.tolist() == [i for ids in candidates for i in ids]
    assert plan.positions.tolist() == [p for n in lengths for p in range(n)]
    assert plan.path_cu_seqlens.tolist() == [0, 3, 73, 74, 79] and plan.path_cu_seqlens.dtype == torch.int64
    assert plan.conv_paths.cu_seqlens_i32.tolist() == [0, 3, 73, 74, 79]
    assert plan.conv_paths.cu_seqlens_i32.dtype == torch.int32
    assert plan.read_rows.tolist() == [2, 72, 73, 78]
    assert plan.gdn["replicated"].calls[0].chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0]]
    assert prepared.rows_computed == prepared.logical_tokens == 79
    # block-diagonal causal mask: row r sees key j iff same candidate and j <= r
    seen = b.attn_mask[0, 0] == 0
    candidate = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    rows = torch.arange(79)
    assert torch.equal(seen, (candidate[:, None] == candidate[None, :]) & (rows[:, None] >= rows[None, :]))
    assert torch.isneginf(b.attn_mask[0, 0][~seen]).all()
    # reference conv layout: 3 zero rows (index 0) before each candidate, then its rows (1-based into [0 | proj])
    conv = plan.conv_paths.spaced.tolist()
    assert conv[:6] == [0, 0, 0, 1, 2, 3] and conv[6:9] == [0, 0, 0] and conv[9] == 4
    assert plan.conv_paths.spaced[plan.conv_paths.spaced_keep].tolist() == list(range(1, 80))
    # the flat plan is the packed rows: no gather anywhere
    assert plan.conv_paths.rows_are_packed and plan.conv_paths.keep_all and plan.attention.keys_are_rows


def test_prepare_splits_batches_without_splitting_candidates(merged_weights):
    engine = build_engine(merged_weights, "merged", max_batch_rows=10)
    prepared = engine.prepare(random_candidates([4, 5, 3, 12, 2], seed=2), [0, 1, 2, 3, 4])
    assert [b.plan.candidate_lens for b in prepared.batches] == [(4, 5), (3,), (12,), (2,)]
    assert [b.candidates for b in prepared.batches] == [(0, 1), (2,), (3,), (4,)]


@pytest.mark.parametrize(
    "candidates, groups, message",
    [
        ([], [], "no candidates"),
        ([[1, 2]], [0, 0], "groups"),
        ([[1], []], [0, 1], "no tokens"),
        ([[1, TINY.vocab_size]], [0], "outside"),
        ([[-1]], [0], "outside"),
        ([[1, 2.0]], [0], "not 64-bit integers"),
        ([[-0.5, 3]], [0], "not 64-bit integers"),
    ],
)
def test_prepare_rejects_bad_input(merged, candidates, groups, message):
    with pytest.raises(ValueError, match=message):
        merged.prepare(candidates, groups)


def test_constructor_rejects_bad_options(merged_weights):
    with pytest.raises(ValueError, match="Triton interpreter"):
        EngineBackbone(merged_weights, config_of("merged"))  # gdn_core="fla": not the config's CPU form
    with pytest.raises(ValueError, match="gdn_core='cuda' is not one of"):
        build_engine(merged_weights, "merged", gdn_core="cuda")
    with pytest.raises(ValueError, match="max_batch_rows"):
        build_engine(merged_weights, "merged", max_batch_rows=0)
    with pytest.raises(ValueError, match="attention='flex' is not one of"):
        build_engine(merged_weights, "merged", attention="flex")
    with pytest.raises(ValueError, match="gdn_mode='state' is not one of"):
        build_engine(merged_weights, "tree", gdn_mode="state")
    with pytest.raises(ValueError, match="backbone='engine' configs"):
        EngineBackbone(merged_weights, config_of("hf_torch"))


# ---------------------------------------------------------------------------------------------------------------------
# merged against hf_torch


def first_attention_state() -> int:
    """Index into hidden_states of the first attention layer's output (entry i + 1 is layer i's output)."""
    return TINY.layer_types.index("full_attention") + 1


def candidate_set(name: str) -> list[list[int]]:
    return random_candidates(CANDIDATE_SETS[name], seed=len(name))


@pytest.mark.parametrize("name", list(CANDIDATE_SETS))
def test_merged_matches_hf_torch(hf_torch, merged, name):
    candidates = candidate_set(name)
    groups = list(range(len(candidates)))
    ref = hf_torch.hidden_states(hf_torch.prepare(candidates, groups))
    prepared = merged.prepare(candidates, groups)
    got = merged.hidden_states(prepared)
    assert len(got) == len(ref) == TINY.num_layers + 2
    first_attn = first_attention_state()
    for i in range(first_attn):  # embedding and the GDN layers before the first attention layer
        assert torch.equal(got[i], ref[i]), f"state {i} departs from hf_torch before any attention layer"
    if len(candidates) == 1:  # no padding in HF's batch either: the one-block mask gives SDPA's bits
        assert all(torch.equal(g, r) for g, r in zip(got, ref)), "a single candidate departs from hf_torch"
    report = []
    for i in range(first_attn, len(ref)):
        err = rel_rmse(got[i], ref[i])
        report.append(f"{i}:{err:.1e}")
        assert err <= REL_RMSE_BOUND, f"state {i}: relative RMSE {err:.2e} > {REL_RMSE_BOUND}"
    print(f"{name}: rel RMSE per state from the first attention layer on: {' '.join(report)}")

    last = merged.forward(prepared)
    assert torch.equal(last, got[-1][prepared.batches[0].plan.read_rows])  # the final-norm rows hidden_states shows
    assert rel_rmse(last, hf_torch.forward(hf_torch.prepare(candidates, groups))) <= REL_RMSE_BOUND


def test_first_departure_is_the_attention_kernel(hf_torch, merged, monkeypatch):
    """q, k, v reach SDPA bitwise in both; only SDPA's output differs, and by a few ulps (set "three")."""
    lengths = CANDIDATE_SETS["three"]
    candidates = candidate_set("three")
    calls: list[tuple[torch.Tensor, ...]] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        out = sdpa(q, k, v, *args, **kwargs)
        calls.append((q, k, v, out))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    groups = list(range(len(candidates)))
    hf_torch.forward(hf_torch.prepare(candidates, groups))
    merged.forward(merged.prepare(candidates, groups))
    hf_call, engine_call = calls[0], calls[TINY.layer_types.count("full_attention")]  # first attention layer of each
    start, departed = 0, 0
    for c, n in enumerate(lengths):
        for j, (ref, got) in enumerate(zip(hf_call, engine_call)):  # q, k, v, output
            ref_c, got_c = ref[c, :, :n], got[0, :, start : start + n]  # [heads, n, D]
            if j == 3:
                ulp = torch.finfo(torch.bfloat16).eps * ref_c.float().abs().clamp_min(2**-8)
                assert ((got_c.float() - ref_c.float()).abs() <= 4 * ulp).all()
                departed += not torch.equal(got_c, ref_c)
            else:
                assert torch.equal(got_c, ref_c), f"candidate {c}: an SDPA input departs"
        start += n
    assert departed > 0, "SDPA outputs are all bitwise here: update the module docstring and bounds"


def test_batch_splitting_changes_only_attention_tiling(merged_weights, merged):
    """Splitting candidates over batches leaves every state before the first attention layer bitwise."""
    candidates = random_candidates([12, 30, 7], seed=11)
    whole = merged.hidden_states(merged.prepare(candidates, [0, 1, 2]))
    split_engine = build_engine(merged_weights, "merged", max_batch_rows=20)
    split_rows = split_engine.prepare(candidates, [0, 1, 2])
    assert len(split_rows.batches) == 3
    split = split_engine.hidden_states(split_rows)
    for i in range(first_attention_state()):
        assert torch.equal(split[i], whole[i])
    for i in range(first_attention_state(), len(whole)):
        assert rel_rmse(split[i], whole[i]) <= REL_RMSE_BOUND


def test_nvtx_ranges_do_not_change_the_result(merged_weights, merged):
    candidates = random_candidates([9, 4], seed=5)
    with_ranges = build_engine(merged_weights, "merged", nvtx_ranges=True)
    a = merged.forward(merged.prepare(candidates, [0, 1]))
    b = with_ranges.forward(with_ranges.prepare(candidates, [0, 1]))
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# fused against merged (Triton interpreter)


@pytest.mark.slow
def test_fused_close_to_merged_under_the_interpreter(merged_weights, merged):
    """Not bitwise on the CPU: `fused` attends with the varlen blockwise core (fp32, one rounding) where `merged` calls
    SDPA with a mask, the interpreter's g (numpy exp/log1p) differs from torch's CPU kernels (SLEEF) by a few fp32
    ulps, and the norms sum squares in another order (kernels/__init__.py); the first departing state and the
    per-state relative RMSE are printed (measured: states 0-3 bitwise, the first attention layer's output departs,
    then up to 7.5e-3 on this set)."""
    if isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip(
            "kernels were compiled, not interpreted: TRITON_INTERPRET=1 was not set before `kernels` was imported"
        )
    fused = build_engine(merged_weights, "fused")
    candidates = random_candidates([13, 2, 7], seed=13)
    ref = merged.hidden_states(merged.prepare(candidates, [0, 1, 1]))
    got = fused.hidden_states(fused.prepare(candidates, [0, 1, 1]))
    assert torch.equal(got[0], ref[0]), "the embedding gather must be bitwise"
    errors = [rel_rmse(g, r) for g, r in zip(got, ref)]
    departs = next((i for i, (g, r) in enumerate(zip(got, ref)) if not torch.equal(g, r)), None)
    print(f"fused vs merged: first departing state {departs}; rel RMSE " + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) <= REL_RMSE_BOUND


def test_decision_model_reports_the_engine_parameter_dtypes():
    """The merge empties DecisionWeights.backbone; the response metadata must still name the dtypes the engine holds."""
    from engine.weights import MergedWeights
    from reference.service import DecisionModel
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=11)
    backbone = build_engine(MergedWeights.from_decision_weights(weights), "merged")
    assert not weights.backbone
    model = DecisionModel(backbone, weights)
    assert model.parameter_dtypes and set(model.parameter_dtypes) <= {"torch.bfloat16", "torch.float32"}
