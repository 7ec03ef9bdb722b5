"""Merged weights for the engine: four GEMM weights per layer instead of HF's seven (attention) or eight (GDN).

Per layer (shapes for the 27B in brackets, weights `[out, in]` as `torch.nn.functional.linear` takes them):

* `w_in`: the input projection.
  * GDN layer: `in_proj_qkv | in_proj_z | in_proj_b | in_proj_a` stacked along the output dim
    [`shapes.gdn_in_width` = 16,480, 5120]; output columns `[q 2048 | k 2048 | v 6144 | z 6144 | b 48 | a 48]`.
  * attention layer: `q_proj | k_proj | v_proj` [`shapes.attn_in_width` = 14,336, 5120]; `q_proj` keeps its stored
    per-head interleave (head 0 query 256, head 0 gate 256, head 1 query, ...), then k 4x256, then v 4x256.
* `w_out`: `out_proj` [5120, 6144] or `o_proj` [5120, 6144].
* `w_gate_up`: `gate_proj | up_proj` [2 x 17,408, 5120]; output columns `[gate | up]`.
* `w_down`: `down_proj` [5120, 17,408].

Stacking along the output dimension does not change any output element's dot product, so a merged GEMM computes the
same numbers as the separate ones wherever the GEMM library's result for one output element does not depend on the
matrix width (measured bitwise on the CPU for the tiny twin, see tests/test_engine.py).

The merged copies REPLACE the originals: `MergedWeights.from_decision_weights` consumes `weights.backbone`, popping each
source tensor as it is merged, so the 27B backbone is held once (its transient peak is one layer's sources plus their
merged copy). Afterwards `weights.backbone` is empty; the head, temperature and metadata of the `DecisionWeights` stay
usable. A model built on the same storage (`reference.model.build_hf_model`) keeps its own references alive, so build
the engine from a `DecisionWeights` that nothing else shares when memory matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from reference.shapes import ModelShapes
from reference.weights import DecisionWeights, backbone_layout

WEIGHT_FORMATS = ("bf16",)


@dataclass(frozen=True)
class Weight:
    """One GEMM weight: `data` [out, in] as `torch.nn.functional.linear` takes it, in `format`, with an optional
    `scale` (per output row or per tensor, for the scaled formats to come: FP8, split-K layouts). The GEMM op of the
    config (`engine/gemm.py`) reads it; floors count its real bytes (`nbytes`)."""

    data: Tensor
    format: str = "bf16"
    scale: Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.format!r} is not one of {WEIGHT_FORMATS}")
        if self.format == "bf16" and (self.data.dtype != torch.bfloat16 or self.scale is not None):
            raise ValueError(f"a bf16 weight holds bfloat16 data and no scale, got {self.data.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def params(self) -> int:
        return self.data.numel()

    @property
    def nbytes(self) -> int:
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The tensors held: ("", data) and, when scaled, ("scale", scale)."""
        yield "", self.data
        if self.scale is not None:
            yield "scale", self.scale


@dataclass
class GDNLayerWeights:
    """A Gated DeltaNet (linear attention) decoder layer with merged GEMM weights."""

    input_norm: Tensor  # [H] Qwen3_5RMSNorm offset weight (the norm scales by 1 + w)
    post_norm: Tensor  # [H]
    w_in: Weight  # [gdn_in_width, H] = qkv | z | b | a
    conv_weight: Tensor  # [conv_dim, W] depthwise causal conv taps, oldest first
    A_log: Tensor  # [HV]
    dt_bias: Tensor  # [HV]
    out_norm: Tensor  # [Dv] gated RMSNorm weight (plain w, not 1 + w)
    w_out: Weight  # [H, value_dim]
    w_gate_up: Weight  # [2 I, H] = gate | up
    w_down: Weight  # [H, I]

    kind = "linear_attention"


@dataclass
class AttentionLayerWeights:
    """A gated full-attention decoder layer with merged GEMM weights."""

    input_norm: Tensor  # [H]
    post_norm: Tensor  # [H]
    w_in: Weight  # [attn_in_width, H] = q+gate (per head interleaved) | k | v
    q_norm: Tensor  # [D] Qwen3_5RMSNorm offset weight over head_dim
    k_norm: Tensor  # [D]
    w_out: Weight  # [H, Hq * D]
    w_gate_up: Weight  # [2 I, H]
    w_down: Weight  # [H, I]

    kind = "full_attention"


LayerWeights = GDNLayerWeights | AttentionLayerWeights


@dataclass
class MergedWeights:
    """The backbone's weights in the engine's layout: embedding, merged layers, final norm."""

    shapes: ModelShapes
    embed: Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: Tensor  # [H]

    @classmethod
    def from_decision_weights(cls, weights: DecisionWeights) -> MergedWeights:
        """Merge `weights.backbone` into the engine layout, CONSUMING it.

        Every source tensor is popped from `weights.backbone` as it is used: GEMM weights are concatenated into a new
        tensor and the sources dropped, everything else (norms, conv taps as a `[C, W]` view, gates, embedding) moves
        over as is. On return `weights.backbone` is empty. Names and shapes are checked against the model shapes
        before anything is consumed, so a bad state dict leaves `weights` untouched.
        """
        shapes: ModelShapes = weights.shapes
        source: dict[str, Tensor] = weights.backbone
        _check_backbone(source, shapes)

        take = source.pop

        def take_cat(names: list[str]) -> Tensor:
            return torch.cat([source.pop(name) for name in names], dim=0)  # the popped sources die on return

        embed = take("embed_tokens.weight")
        layers: list[LayerWeights] = []
        for n, kind in enumerate(shapes.layer_types):
            p = f"layers.{n}."
            input_norm = take(p + "input_layernorm.weight")
            post_norm = take(p + "post_attention_layernorm.weight")
            if kind == "linear_attention":
                a = p + "linear_attn."
                mixer = dict(
                    w_in=Weight(take_cat([a + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")])),
                    conv_weight=take(a + "conv1d.weight").squeeze(1),
                    A_log=take(a + "A_log"),
                    dt_bias=take(a + "dt_bias"),
                    out_norm=take(a + "norm.weight"),
                    w_out=Weight(take(a + "out_proj.weight")),
                )
                layer_cls = GDNLayerWeights
            else:
                a = p + "self_attn."
                mixer = dict(
                    w_in=Weight(take_cat([a + f"{part}_proj.weight" for part in ("q", "k", "v")])),
                    q_norm=take(a + "q_norm.weight"),
                    k_norm=take(a + "k_norm.weight"),
                    w_out=Weight(take(a + "o_proj.weight")),
                )
                layer_cls = AttentionLayerWeights
            w_gate_up = Weight(take_cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]))
            w_down = Weight(take(p + "mlp.down_proj.weight"))
            layers.append(
                layer_cls(input_norm=input_norm, post_norm=post_norm, w_gate_up=w_gate_up, w_down=w_down, **mixer)
            )
        final_norm = take("norm.weight")
        assert not source, f"unconsumed backbone tensors: {sorted(source)}"
        return cls(shapes=shapes, embed=embed, layers=layers, final_norm=final_norm)

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor held, with an engine-side name (`embed`, `layers.{i}.{field}`, `final_norm`)."""
        yield "embed", self.embed
        for n, layer in enumerate(self.layers):
            for f in fields(layer):
                value = getattr(layer, f.name)
                if isinstance(value, Weight):
                    for part, tensor in value.tensors():
                        yield f"layers.{n}.{f.name}" + (f".{part}" if part else ""), tensor
                else:
                    yield f"layers.{n}.{f.name}", value
        yield "final_norm", self.final_norm

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def gemm_weights(self) -> Iterator[Weight]:
        """Every GEMM weight of the layers (what each forward streams once)."""
        for layer in self.layers:
            yield from (getattr(layer, f.name) for f in fields(layer) if isinstance(getattr(layer, f.name), Weight))

    def gemm_weight_bytes(self) -> int:
        """Bytes of every GEMM weight, scales included: the weight-streaming floor's numerator."""
        return sum(w.nbytes for w in self.gemm_weights())

    def gemm_formats(self) -> set[str]:
        return {w.format for w in self.gemm_weights()}

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _check_backbone(source: dict[str, Tensor], shapes: ModelShapes) -> None:
    expected = {name: shape for name, (shape, _) in backbone_layout(shapes).items()}
    missing = sorted(set(expected) - set(source))
    unexpected = sorted(set(source) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"backbone state dict does not match shapes {shapes.name!r}: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    device = source["embed_tokens.weight"].device
    for name, shape in expected.items():
        t = source[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, the embedding is on {device}")
        if t.ndim == 2 and t.dtype != torch.bfloat16:
            raise ValueError(f"{name}: dtype {t.dtype}, the engine's GEMMs and embedding need bfloat16")
