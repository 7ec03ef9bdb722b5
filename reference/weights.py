"""Decision-model weights: seeded synthetic weights of exact shapes, and the loader for a real Open-Jev package.

`DecisionWeights.backbone` holds the text backbone under the state-dict names of transformers' `Qwen3_5TextModel`
(`embed_tokens.weight`, `layers.{i}.…`, `norm.weight`); `backbone_layout(shapes)` lists every name with its shape and
dtype. The head is the Open-Jev scalar head `nn.Linear(hidden, 1, bias=True)`, kept in fp32 as a weight vector [hidden]
and a 0-dim bias.

Dtypes. Everything is bf16 except `linear_attn.A_log` and `linear_attn.norm.weight`, which stay fp32: the Qwen3.5-family
checkpoints store these two in fp32 (reference-math.md §0 item 4), and the reference model is built from the tensors as
stored (`reference.model.build_hf_model` assigns them, no cast). Note what this departs from: Open-Jev loads the base
with `from_pretrained(..., torch_dtype=bfloat16)`, and transformers 5.23 then casts these two to bf16 as well (checked
on a saved tiny model: both come back bf16, with `dtype=bfloat16` and with `dtype="auto"`). With fp32 parameters the
GDN gated norm skips one bf16 rounding (reference-math.md §2.5, round 2) and `g` uses the unrounded A_log. Synthetic
values of both are drawn bf16-representable, so a bf16 cast loses nothing and only that one rounding differs. A base
tensor stored in another dtype than its layout says is cast to bf16 at load, as `from_pretrained(torch_dtype=bfloat16)`
does.

Synthetic weights (`synthetic_weights`). Every tensor is drawn on the target device from its own generator seeded with
32 bits of sha256(seed/name), so a tensor does not depend on the order of generation; values differ between CPU and CUDA
generators. L is the number of layers, fan_in the input width of a linear layer.

| tensor | distribution |
|---|---|
| `embed_tokens.weight` | N(0, 0.02) |
| input projections: `in_proj_*`, `q/k/v_proj`, `gate/up_proj` | N(0, 1/sqrt(fan_in)): unit-RMS outputs |
| output projections: `out_proj`, `o_proj`, `down_proj` | N(0, c/sqrt(fan_in)), c = 0.04/sqrt(2L) |
| (1 + w) norm offsets: `*_layernorm`, `q_norm`, `k_norm`, final `norm` | N(0, 0.1) |
| `linear_attn.norm.weight` (plain w) | 1 + N(0, 0.1); fp32, bf16-representable |
| `linear_attn.A_log` | log(U(1, 16)); fp32, bf16-representable |
| `linear_attn.dt_bias` | softplus⁻¹(dt), dt log-uniform in [1e-3, 1e-1] (Mamba's dt init) |
| `linear_attn.conv1d.weight` | N(0, 1/sqrt(4)) (kernel width 4) |
| head weight / bias | N(0, 1/sqrt(hidden)) fp32, so scores are O(1) / 0 |

Why dt_bias and c are not the simpler HF init values (dt_bias = 1, c = 1/sqrt(2L)). Measured on the tiny twin's widths
in fp32, perturbing the embedding output by 1e-3 relative noise and reading the relative change of the last residual:
random gated layers amplify relative perturbations (products of perturbed factors in the MLP and the GDN, and the GDN
gated norm's per-head normalisation of outputs of very different sizes), so a residual stream made only of layer
updates is chaotic. With dt_bias = 1 (per-token decay e^-1 to e^-20: almost no memory) and c = 1/sqrt(2L) the
amplification was 67x over 8 layers and 650x over 64, so bf16 rounding alone would move the 27B's final state by O(1)
and no engine-vs-reference comparison could be told apart from noise. Mamba's dt (most heads remember tens to thousands
of tokens, so the GDN state also carries information across chunk and prefix boundaries, where tree bugs would show)
brings it to 190x at 64 layers; updates small next to the embedding (with c = 0.04/sqrt(2L) the 2L updates together
carry about as much variance as the embedding, so the residual RMS grows from 0.02 to about 0.03) bring it to 2.6x.
Scaling the embedding up instead would be equivalent: the RMSNorms make every layer scale-free. `tests/test_weights.py`
measures the tiny twin's per-layer residual RMS and its amplification; `tests/test_gpu_reference.py` prints and bounds
the 27B's per-layer RMS. Synthetic weights make every probability meaningless for accuracy: use them for speed and
fidelity only.

Packages (`load_package`). An Open-Jev package directory holds `model.json` ({model_id, revision, max_length,
lora_rank, method}), `adapter/` (PEFT `adapter_config.json` + `adapter_model.safetensors`), `head.pt` (state dict of
the Linear head) and `temperature.json` ({"temperature": T}). The base is an HF safetensors directory of a
Qwen3.5-family model (`config.json` + one or more `*.safetensors`, sharded through `model.safetensors.index.json` or
not). Keys may
carry the multimodal prefix `model.language_model.` or the CausalLM prefix `model.`; `lm_head`, `visual` and `mtp`
tensors are skipped unread; any other unknown key is an error. Tensors are read straight onto the target device one by
one and the LoRA is merged into each target as it arrives, so only one copy of the weights is ever alive.

LoRA merge: W_merged = bf16(W_f + s·(B_f @ A_f)), s = lora_alpha/r (lora_alpha/sqrt(r) with rsLoRA), all in fp32
(TF32 off) and rounded to bf16 once. PEFT's `merge_and_unload` computes the fp32 delta (B @ A)·s first and adds it to
the bf16 weight in place (also one rounding when the adapter is fp32; two when the adapter is bf16); the unmerged PEFT
forward instead adds the fp32 LoRA branch to the bf16 base output. Measured on the tiny checkpoint of
`tests/test_weights.py` (fp32 adapter, s = 2): our merge is bitwise equal to PEFT's `merge_and_unload`; against PEFT's
unmerged forward the final-norm states differ by 1.8e-2 rel-RMS, while each is 1.3e-2 from an fp32 LoRA forward, i.e.
the merge is as accurate as the path Open-Jev runs, and the two differ by bf16 noise.

`checkpoint_sha256` = sha256 over the package's regular files (hidden files and folders, such as `.cache/` left by
`hf download`, excluded), in sorted order of their POSIX paths relative to the package, each contributing
`path bytes + NUL + sha256(file bytes)`. Base weights are not hashed (the revision in `model.json` names them). This is
our own definition; Open-Jev's `checkpoint_sha256` value (c49994563c3c…) is computed in a way we could not check.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from reference.shapes import QWEN38_27B, SHAPES, TINY, ModelShapes

SYNTHETIC_TEMPERATURE = 2.5343690298472983  # Open-Jev-27B-v1.1's fitted temperature
SYNTHETIC_MAX_LENGTH = 16384  # the per-candidate limit the 27B evaluations ran at
SYNTHETIC_MODEL_IDS = {QWEN38_27B.name: "Qwen/Qwen3.8-27B", TINY.name: "jevlab/tiny-twin"}
PACKAGE_METHOD = "lora_decision_head"  # what the Open-Jev server reports for a checkpoint package

FP32_PARAMETERS = ("linear_attn.A_log", "linear_attn.norm.weight")  # stored fp32 in the checkpoints; see docstring
SKIPPED_PREFIXES = ("lm_head.", "visual.", "mtp.")  # base-checkpoint tensors that are not the text backbone

EMBED_STD = 0.02
UPDATE_GAIN = 0.04  # c·sqrt(2L) for the output projections
NORM_OFFSET_STD = 0.1
GATED_NORM_STD = 0.1
DT_RANGE = (1e-3, 1e-1)
A_RANGE = (1.0, 16.0)
INPUT_PROJECTIONS = tuple(
    f"{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj")
) + ("gate_proj.weight", "up_proj.weight")
OUTPUT_PROJECTIONS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


@dataclass
class DecisionWeights:
    shapes: ModelShapes
    backbone: dict[str, torch.Tensor]  # HF Qwen3_5TextModel state-dict names
    head_weight: torch.Tensor  # fp32 [hidden]
    head_bias: torch.Tensor  # fp32 [] (0-dim)
    temperature: float
    model_id: str  # HF base id
    revision: str | None
    max_length: int  # per-candidate token limit
    checkpoint_sha256: str | None
    method: str  # "lora_decision_head" for a package, "synthetic_weights" for synthetic
    synthetic: bool

    @property
    def device(self) -> torch.device:
        return self.backbone["embed_tokens.weight"].device


def backbone_layout(shapes: ModelShapes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every backbone tensor of `Qwen3_5TextModel` for these shapes: name -> (shape, dtype), in state-dict order."""
    h, bf16, fp32 = shapes.hidden_size, torch.bfloat16, torch.float32
    layout = {"embed_tokens.weight": ((shapes.vocab_size, h), bf16)}
    for i, layer_type in enumerate(shapes.layer_types):
        p = f"layers.{i}."
        if layer_type == "linear_attention":
            hv = shapes.linear_num_value_heads
            layout |= {
                p + "linear_attn.dt_bias": ((hv,), bf16),
                p + "linear_attn.A_log": ((hv,), fp32),
                p + "linear_attn.conv1d.weight": ((shapes.conv_dim, 1, shapes.linear_conv_kernel_dim), bf16),
                p + "linear_attn.norm.weight": ((shapes.linear_value_head_dim,), fp32),
                p + "linear_attn.out_proj.weight": ((h, shapes.linear_value_dim), bf16),
                p + "linear_attn.in_proj_qkv.weight": ((shapes.conv_dim, h), bf16),
                p + "linear_attn.in_proj_z.weight": ((shapes.linear_value_dim, h), bf16),
                p + "linear_attn.in_proj_b.weight": ((hv, h), bf16),
                p + "linear_attn.in_proj_a.weight": ((hv, h), bf16),
            }
        else:
            q_width = shapes.num_attention_heads * shapes.head_dim
            kv_width = shapes.num_key_value_heads * shapes.head_dim
            layout |= {
                p + "self_attn.q_proj.weight": ((2 * q_width, h), bf16),  # per head: 256 query rows, 256 gate rows
                p + "self_attn.k_proj.weight": ((kv_width, h), bf16),
                p + "self_attn.v_proj.weight": ((kv_width, h), bf16),
                p + "self_attn.o_proj.weight": ((h, q_width), bf16),
                p + "self_attn.q_norm.weight": ((shapes.head_dim,), bf16),
                p + "self_attn.k_norm.weight": ((shapes.head_dim,), bf16),
            }
        layout |= {
            p + "mlp.gate_proj.weight": ((shapes.intermediate_size, h), bf16),
            p + "mlp.up_proj.weight": ((shapes.intermediate_size, h), bf16),
            p + "mlp.down_proj.weight": ((h, shapes.intermediate_size), bf16),
            p + "input_layernorm.weight": ((h,), bf16),
            p + "post_attention_layernorm.weight": ((h,), bf16),
        }
    layout["norm.weight"] = ((h,), bf16)
    return layout


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic weights


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one tensor. 32-bit seeds: the CPU generator ignores the high bits of a 64-bit seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little"))
    return generator


def _normal(shape, std: float, mean: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """bf16 N(mean, std²), drawn in bf16 on the device (no fp32 copy of the 27B's large matrices)."""
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16).mul_(std)
    return x.add_(mean) if mean else x


def _synthetic_tensor(name: str, shape, dtype, shapes: ModelShapes, seed: int, device: torch.device) -> torch.Tensor:
    generator = _generator(seed, name, device)
    out_gain = UPDATE_GAIN / math.sqrt(2 * shapes.num_layers)
    if name == "embed_tokens.weight":
        x = _normal(shape, EMBED_STD, 0.0, generator, device)
    elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
        x = _normal(shape, NORM_OFFSET_STD, 0.0, generator, device)  # offsets: the norms scale by (1 + w)
    elif name.endswith("linear_attn.norm.weight"):
        x = _normal(shape, GATED_NORM_STD, 1.0, generator, device)  # plain w around 1
    elif name.endswith("linear_attn.A_log"):
        a = torch.empty(shape, device=device, dtype=torch.float32).uniform_(*A_RANGE, generator=generator)
        x = a.log_().to(torch.bfloat16)
    elif name.endswith("linear_attn.dt_bias"):
        log_dt = torch.empty(shape, device=device, dtype=torch.float32).uniform_(
            math.log(DT_RANGE[0]), math.log(DT_RANGE[1]), generator=generator
        )
        dt = log_dt.exp()
        x = (dt + torch.log(-torch.expm1(-dt))).to(torch.bfloat16)  # softplus(x) = dt
    elif name.endswith("conv1d.weight"):
        x = _normal(shape, 1.0 / math.sqrt(shapes.linear_conv_kernel_dim), 0.0, generator, device)
    elif name.endswith(OUTPUT_PROJECTIONS):
        x = _normal(shape, out_gain / math.sqrt(shape[1]), 0.0, generator, device)
    elif name.endswith(INPUT_PROJECTIONS):
        x = _normal(shape, 1.0 / math.sqrt(shape[1]), 0.0, generator, device)
    else:
        raise AssertionError(f"no synthetic rule for {name}")
    return x.to(dtype)  # fp32 tensors hold bf16-representable values


def synthetic_weights(shapes: ModelShapes, *, seed: int = 0, device="cpu") -> DecisionWeights:
    """Seeded random weights of the exact shapes, built on `device` (see the module docstring for the scales)."""
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    device = torch.device(device)
    backbone = {
        name: _synthetic_tensor(name, shape, dtype, shapes, seed, device)
        for name, (shape, dtype) in backbone_layout(shapes).items()
    }
    head_generator = _generator(seed, "head.weight", device)
    head_weight = torch.randn(shapes.hidden_size, generator=head_generator, device=device, dtype=torch.float32)
    head_weight.mul_(1.0 / math.sqrt(shapes.hidden_size))
    return DecisionWeights(
        shapes=shapes,
        backbone=backbone,
        head_weight=head_weight,
        head_bias=torch.zeros((), device=device, dtype=torch.float32),
        temperature=SYNTHETIC_TEMPERATURE,
        model_id=SYNTHETIC_MODEL_IDS.get(shapes.name, f"jevlab/synthetic-{shapes.name}"),
        revision=None,
        max_length=SYNTHETIC_MAX_LENGTH,
        checkpoint_sha256=None,
        method="synthetic_weights",
        synthetic=True,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Real checkpoints


def shapes_from_hf_config(base_dir) -> ModelShapes:
    """The `ModelShapes` of an HF Qwen3.5-family `config.json` (text part); a known shape set if it matches one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(base_dir))
    text = getattr(config, "text_config", None) or config
    if text.model_type != "qwen3_5_text":
        raise ValueError(f"{base_dir}: expected a Qwen3.5-family text config (qwen3_5_text), got {text.model_type!r}")
    rope = text.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{base_dir}: rope_type {rope['rope_type']!r}; only the default (unscaled) RoPE is supported")
    interval = next((i + 1 for i, t in enumerate(text.layer_types) if t == "full_attention"), None)
    if interval is None:
        raise ValueError(f"{base_dir}: no full_attention layer in layer_types")
    shapes = ModelShapes(
        name=f"hf:{Path(base_dir).name}",
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        full_attention_interval=interval,
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),  # defaults as in modeling_qwen3_5
        rope_theta=rope["rope_theta"],
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
    )
    if list(text.layer_types) != shapes.layer_types:
        raise ValueError(f"{base_dir}: layer_types do not follow a full-attention interval of {interval}")
    if text.hidden_act != "silu" or text.attention_bias or text.tie_word_embeddings:
        raise ValueError(f"{base_dir}: unsupported hidden_act / attention_bias / tied embeddings")
    for known in SHAPES.values():
        if {**known.to_dict(), "name": shapes.name} == shapes.to_dict():
            return known
    return shapes


def backbone_name(key: str) -> str | None:
    """The backbone state-dict name of a checkpoint key, or None for tensors that are not the text backbone."""
    if key.startswith("model."):
        key = key[len("model.") :]
    if key.startswith("language_model."):
        key = key[len("language_model.") :]
    return None if key.startswith(SKIPPED_PREFIXES) else key


def _safetensors_files(base_dir: Path) -> dict[Path, list[str]]:
    """Each safetensors file of the base with the keys it holds."""
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        files: dict[Path, list[str]] = {}
        for key, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(base_dir / file, []).append(key)
        return files
    paths = sorted(base_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors under {base_dir}")
    files = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            files[path] = list(f.keys())
    return files


@dataclass
class _Lora:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


def _read_adapter(adapter_dir: Path, lora_rank: int, device: torch.device) -> tuple[dict[str, _Lora], float]:
    """LoRA pairs by backbone weight name, and the scaling s."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r} is not LORA")
    r = config["r"]
    if r != lora_rank:
        raise ValueError(f"{adapter_dir}: adapter r={r} but model.json lora_rank={lora_rank}")
    unsupported = {
        "use_dora": config.get("use_dora", False),
        "fan_in_fan_out": config.get("fan_in_fan_out", False),
        "bias": config.get("bias", "none") != "none",
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    if any(unsupported.values()):
        raise ValueError(f"{adapter_dir}: unsupported LoRA options {[k for k, v in unsupported.items() if v]}")
    alpha = config["lora_alpha"]
    scaling = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r

    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt", device=str(device)) as f:
        for key in f.keys():
            stripped = key[len("base_model.model.") :] if key.startswith("base_model.model.") else key
            name = backbone_name(stripped)
            for half in ("lora_A", "lora_B"):
                suffix = f".{half}.weight"
                if name is not None and name.endswith(suffix):
                    halves.setdefault(name[: -len(suffix)] + ".weight", {})[half] = f.get_tensor(key)
                    break
            else:
                raise ValueError(f"{adapter_dir}: unexpected adapter tensor {key!r}")
    loras = {}
    for name, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{adapter_dir}: {name} has only {sorted(pair)}")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{adapter_dir}: {name} LoRA shapes {tuple(a.shape)}, {tuple(b.shape)} do not match r={r}")
        loras[name] = _Lora(a, b)
    return loras, scaling


@contextmanager
def _fp32_matmul_precision() -> Iterator[None]:
    """Full-precision fp32 matmuls (TF32 off) for the merge, whatever the process setting is."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def merge_lora(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """bf16(W_f + s·(B_f @ A_f)): [out, in] bf16 weight, A [r, in], B [out, r]; fp32 math, one rounding."""
    if weight.shape != (lora_b.shape[0], lora_a.shape[1]):
        raise ValueError(f"LoRA shapes {tuple(lora_a.shape)}, {tuple(lora_b.shape)} do not fit {tuple(weight.shape)}")
    with _fp32_matmul_precision():
        merged = torch.addmm(weight.float(), lora_b.float(), lora_a.float(), alpha=scaling)
    return merged.to(torch.bfloat16)


def package_sha256(package_dir) -> str:
    """sha256 over the package's regular files (see the module docstring for exactly what is hashed)."""
    package_dir = Path(package_dir)
    digest = hashlib.sha256()
    paths = sorted(
        p.relative_to(package_dir).as_posix()
        for p in package_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(package_dir).parts)
    )
    for rel in paths:
        digest.update(rel.encode() + b"\0" + hashlib.sha256((package_dir / rel).read_bytes()).digest())
    return digest.hexdigest()


def _read_head(path: Path, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.load(path, map_location=device, weights_only=True)
    if set(state) != {"weight", "bias"}:
        raise ValueError(
            f"{path}: expected the state dict of nn.Linear(hidden, 1, bias=True), got keys {sorted(state)}"
        )
    weight, bias = state["weight"], state["bias"]
    if weight.shape != (1, hidden) or bias.shape != (1,):
        raise ValueError(
            f"{path}: head shapes {tuple(weight.shape)}, {tuple(bias.shape)}; expected (1, {hidden}), (1,)"
        )
    return weight[0].to(torch.float32).contiguous(), bias[0].to(torch.float32).clone()


def load_package(package_dir, base_dir, *, device="cpu") -> DecisionWeights:
    """An Open-Jev package on an HF Qwen3.5-family base, LoRA merged, everything on `device` (one copy)."""
    package_dir, base_dir, device = Path(package_dir), Path(base_dir), torch.device(device)
    meta = json.loads((package_dir / "model.json").read_text())
    missing = {"model_id", "revision", "max_length", "lora_rank"} - set(meta)
    if missing:
        raise ValueError(f"{package_dir}/model.json lacks {sorted(missing)}")
    temperature = json.loads((package_dir / "temperature.json").read_text())["temperature"]
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{package_dir}/temperature.json: temperature must be a positive finite number")

    shapes = shapes_from_hf_config(base_dir)
    layout = backbone_layout(shapes)
    loras, scaling = _read_adapter(package_dir / "adapter", meta["lora_rank"], device)
    unknown_targets = sorted(set(loras) - set(layout))
    if unknown_targets:
        raise ValueError(f"adapter targets not in the backbone: {unknown_targets[:5]}")

    backbone: dict[str, torch.Tensor] = {}
    for path, keys in _safetensors_files(base_dir).items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in keys:
                name = backbone_name(key)
                if name is None:
                    continue
                if name not in layout:
                    raise ValueError(f"{path.name}: unexpected tensor {key!r} (not a {shapes.name} backbone tensor)")
                if name in backbone:
                    raise ValueError(f"{path.name}: {name} appears twice in the base checkpoint")
                shape, dtype = layout[name]
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{key}: shape {tuple(tensor.shape)}, expected {shape}")
                if name.endswith(FP32_PARAMETERS):
                    dtype = tensor.dtype  # kept as stored (module docstring)
                tensor = tensor.to(dtype)
                if name in loras:
                    lora = loras.pop(name)
                    tensor = merge_lora(tensor, lora.a, lora.b, scaling)
                backbone[name] = tensor
    absent = [name for name in layout if name not in backbone]
    if absent:
        raise ValueError(f"{base_dir}: missing backbone tensors {absent[:5]} ({len(absent)} in all)")
    head_weight, head_bias = _read_head(package_dir / "head.pt", shapes.hidden_size, device)
    return DecisionWeights(
        shapes=shapes,
        backbone={name: backbone[name] for name in layout},
        head_weight=head_weight,
        head_bias=head_bias,
        temperature=float(temperature),
        model_id=meta["model_id"],
        revision=meta["revision"],
        max_length=int(meta["max_length"]),
        checkpoint_sha256=package_sha256(package_dir),
        method=PACKAGE_METHOD,
        synthetic=False,
    )
