"""Model shapes: the exact Qwen3.8-27B text backbone and a tiny twin with the same structure.

The 27B numbers are the `Qwen3_5TextConfig` of Qwen/Qwen3.8-27B (shared/research/reference-math.md §1). The tiny twin
keeps every structural ratio that a kernel or the prefix tree could depend on, so CPU tests exercise the same code
paths: the [GDN, GDN, GDN, attention] layer pattern, 1 GDN key head per 3 value heads (16:48 in the 27B), GQA 6:1
(24:4), partial RoPE on a quarter of the head, the attention output gate and the (1 + w) norms. Its vocabulary is the
real one, so the real tokenizer's ids index it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShapes:
    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Gated DeltaNet (linear attention)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262_144

    def __post_init__(self) -> None:
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.linear_num_value_heads % self.linear_num_key_heads == 0
        assert self.num_layers % self.full_attention_interval == 0
        assert sum(self.mrope_section) * 2 == self.rotary_dim

    @property
    def layer_types(self) -> list[str]:
        """`full_attention` at every `full_attention_interval`-th layer (3, 7, ... in the 27B), else linear."""
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_layers)
        ]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # GDN widths, in the channel order of the checkpoint: qkv = [q | k | v], then z, b, a.
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def gdn_in_width(self) -> int:
        """Merged GDN input projection: qkv | z | b | a (16,480 in the 27B)."""
        return self.conv_dim + self.linear_value_dim + 2 * self.linear_num_value_heads

    @property
    def attn_in_width(self) -> int:
        """Merged attention input projection: q+gate (per head interleaved) | k | v (14,336 in the 27B)."""
        return 2 * self.num_attention_heads * self.head_dim + 2 * self.num_key_value_heads * self.head_dim

    def linear_params(self) -> int:
        """Parameters of every linear layer of the backbone (no embedding, no LM head): what a forward streams."""
        h, i = self.hidden_size, self.intermediate_size
        mlp = 3 * h * i
        gdn = h * self.gdn_in_width + self.linear_value_dim * h
        attn = h * self.attn_in_width + self.num_attention_heads * self.head_dim * h
        types = self.layer_types
        n_full = types.count("full_attention")
        return (len(types) - n_full) * (gdn + mlp) + n_full * (attn + mlp)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_hf_config(self):
        """The transformers `Qwen3_5TextConfig` for these shapes (bf16, SDPA attention)."""
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            layer_types=self.layer_types,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            attention_bias=False,
            hidden_act="silu",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
            dtype="bfloat16",
        )
        config._attn_implementation = "sdpa"
        return config


QWEN38_27B = ModelShapes(
    name="qwen3.8-27b",
    hidden_size=5120,
    num_layers=64,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)

# Tiny twin: 8 layers (6 GDN + 2 attention), hidden 128. Head dims of 32 / 64 keep Triton tiles legal (>= 16).
TINY = ModelShapes(
    name="tiny",
    hidden_size=128,
    num_layers=8,
    intermediate_size=384,
    vocab_size=248320,
    num_attention_heads=6,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    mrope_section=(3, 3, 2),
)

SHAPES = {s.name: s for s in (QWEN38_27B, TINY)}


def get_shapes(name: str) -> ModelShapes:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shapes {name!r}; known: {sorted(SHAPES)}") from None
