"""reference/ops.py against the HF modules it reproduces (bitwise) and against independent formulations.

Part 1 builds the tiny twin as a transformers 5.23 `Qwen3_5TextModel` with seeded random bf16 weights (GDN layers 0
and 4 keep `A_log`, `dt_bias` and the gated-norm weight in fp32, as the checkpoint stores some of them), runs one
sequence of 97 tokens through it with hooks on every sublayer, and checks that the ops of reference/ops.py reproduce
each captured output bit for bit from the captured inputs, and that their composition reproduces all 8 layer outputs.
HF resolves `torch_chunk_gated_delta_rule` to FLA's Triton kernel when `fla` imports (it does here); the fixture swaps
the module globals `torch_chunk_gated_delta_rule` and `causal_conv1d_fn` for the torch functions under HF's hub-kernel
wrapper (`inspect.unwrap`) for the duration of the forward, and runs with `use_cache=False` (the no-cache prefill
path). Part 2 tests each op on odd shapes against an independent formulation (fp64 math with explicit roundings).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from reference import ops
from reference.shapes import TINY

BF16 = torch.bfloat16
SEQ_LEN = 97
FP32_GATE_PARAM_LAYERS = (0, 4)  # GDN layers whose A_log, dt_bias and gated-norm weight stay fp32
EPS = TINY.rms_norm_eps


# ---------------------------------------------------------------------------------------------------------------------
# Comparison helpers


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        differ = actual != expected
        first = tuple(differ.nonzero()[0].tolist())
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.numel()} elements differ, max |diff| {diff:.3e}, "
            f"first at {first}: {actual[first].item()} vs {expected[first].item()}"
        )


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between two bf16 tensors (int32), counting across zero."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    assert a.dtype == b.dtype == BF16
    return (ordered(a) - ordered(b)).abs()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = BF16) -> torch.Tensor:
    return (torch.randn(shape, generator=gen(seed)) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: the tiny twin through HF, every sublayer captured


@dataclass
class HFRun:
    params: dict[str, torch.Tensor]  # HF state-dict names
    input_ids: torch.Tensor  # [T] int64
    records: dict[str, tuple]  # module or function name -> (args, kwargs, output)
    last_hidden: torch.Tensor  # [T, hidden] bf16, final-norm output


def _init_tiny_model(device: str):
    """Qwen3_5TextModel(TINY) with seeded weights at scales that keep activations O(1); params bf16 except as noted.

    Parameters are cast one by one (not `model.to(bf16)`), so the RoPE `inv_freq` buffer stays fp32 as in
    `from_pretrained(dtype=torch.bfloat16)`.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    model = Qwen3_5TextModel(TINY.to_hf_config()).eval()
    g = gen(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                value = torch.randn(p.shape, generator=g)
            elif p.ndim == 2:  # projections: unit-variance outputs
                value = torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5
            elif name.endswith("conv1d.weight"):
                value = torch.randn(p.shape, generator=g) * 0.5
            elif name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log()
            elif name.endswith("dt_bias"):
                value = torch.randn(p.shape, generator=g) * 0.5
            elif name.endswith("linear_attn.norm.weight"):  # plain scale around 1
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:  # (1 + w) norm offsets
                value = 0.1 * torch.randn(p.shape, generator=g)
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            keep_fp32 = layer in FP32_GATE_PARAM_LAYERS and name.endswith(
                ("A_log", "dt_bias", "linear_attn.norm.weight")
            )
            p.data = value.to(torch.float32 if keep_fp32 else BF16)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    return model.to(device)


def _recorder(records: dict, current: dict, name: str, function):
    def record(*args, **kwargs):
        out = function(*args, **kwargs)
        records[f"layers.{current['layer']}.{name}"] = (args, kwargs, out)
        return out

    return record


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def hf_run(request) -> HFRun:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    device = request.param
    model = _init_tiny_model(device)
    input_ids = torch.randint(0, TINY.vocab_size, (SEQ_LEN,), generator=gen(1)).to(device)
    records: dict[str, tuple] = {}
    current = {"layer": None}

    def hook(name):
        def capture(module, args, kwargs, output):
            records[name] = (args, kwargs, output)

        return capture

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__("layer", i)))
    for name, module in model.named_modules():
        if name.startswith("layers.") or name == "embed_tokens":
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    torch_chunk = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    torch_conv = inspect.unwrap(hf.causal_conv1d_fn)
    try:
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            patch.setattr(hf, "torch_chunk_gated_delta_rule", _recorder(records, current, "chunk_rule", torch_chunk))
            patch.setattr(hf, "causal_conv1d_fn", _recorder(records, current, "conv", torch_conv))
            patch.setattr(hf, "apply_rotary_pos_emb", _recorder(records, current, "rope", hf.apply_rotary_pos_emb))
            last_hidden = model(input_ids=input_ids[None], use_cache=False).last_hidden_state[0]
    finally:
        for handle in handles:
            handle.remove()
    return HFRun(dict(model.state_dict()), input_ids, records, last_hidden)


def _in(run: HFRun, name: str) -> torch.Tensor:
    args, kwargs, _ = run.records[name]
    return args[0] if args else kwargs["hidden_states"]


def _out(run: HFRun, name: str) -> torch.Tensor:
    out = run.records[name][2]
    return out[0] if isinstance(out, tuple) else out


GDN_LAYERS = [i for i, t in enumerate(TINY.layer_types) if t == "linear_attention"]
ATTN_LAYERS = [i for i, t in enumerate(TINY.layer_types) if t == "full_attention"]


def test_tiny_twin_layout():
    assert GDN_LAYERS == [0, 1, 2, 4, 5, 6] and ATTN_LAYERS == [3, 7]


def test_composition_reproduces_every_layer_output(hf_run):
    """Embedding, all 8 decoder-layer outputs and the final norm, from token ids alone: bitwise."""
    with torch.no_grad():
        states = ops.backbone_hidden_states(hf_run.input_ids, hf_run.params, TINY)
    assert len(states) == TINY.num_layers + 2
    assert_bitwise(states[0], _out(hf_run, "embed_tokens")[0], "embedding")
    for layer in range(TINY.num_layers):
        assert_bitwise(states[layer + 1], _out(hf_run, f"layers.{layer}")[0], f"layer {layer} output")
    assert_bitwise(states[-1], hf_run.last_hidden, "final norm")


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_norms_and_residual_adds(hf_run, layer):
    p, pre = hf_run.params, f"layers.{layer}."
    x = _in(hf_run, f"layers.{layer}")[0]
    mixer = pre + ("linear_attn" if layer in GDN_LAYERS else "self_attn")
    first, normed = ops.residual_rmsnorm(x, None, p[pre + "input_layernorm.weight"], EPS)
    assert first is x
    assert_bitwise(normed, _out(hf_run, pre + "input_layernorm")[0], "input norm")
    assert_bitwise(ops.rmsnorm_1p(x, p[pre + "input_layernorm.weight"], EPS), normed, "rmsnorm_1p")
    h, post = ops.residual_rmsnorm(x, _out(hf_run, mixer)[0], p[pre + "post_attention_layernorm.weight"], EPS)
    assert_bitwise(h, _in(hf_run, pre + "post_attention_layernorm")[0], "mixer residual add")
    assert_bitwise(post, _out(hf_run, pre + "post_attention_layernorm")[0], "post-attention norm")
    out = ops.residual_add(h, _out(hf_run, pre + "mlp")[0])
    assert_bitwise(out, _out(hf_run, pre.rstrip("."))[0], "MLP residual add")


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_mlp(hf_run, layer):
    p, pre = hf_run.params, f"layers.{layer}.mlp."
    gated = ops.silu_mul(_out(hf_run, pre + "gate_proj")[0], _out(hf_run, pre + "up_proj")[0])
    assert_bitwise(gated, _in(hf_run, pre + "down_proj")[0], "silu_mul")
    assert_bitwise(ops.mlp(_in(hf_run, pre.rstrip("."))[0], p, pre), _out(hf_run, pre.rstrip("."))[0], "MLP")


@pytest.mark.parametrize("layer", GDN_LAYERS)
def test_gdn_mixer_ops(hf_run, layer):
    p, pre = hf_run.params, f"layers.{layer}.linear_attn."
    seq, hv, dv = SEQ_LEN, TINY.linear_num_value_heads, TINY.linear_value_head_dim
    fp32_params = layer in FP32_GATE_PARAM_LAYERS
    assert (p[pre + "A_log"].dtype == torch.float32) == fp32_params
    assert (p[pre + "norm.weight"].dtype == torch.float32) == fp32_params

    # conv + silu: HF convolves the [1, C, T] transpose of in_proj_qkv's output
    qkv = _out(hf_run, pre + "in_proj_qkv")[0]  # [T, C]
    conv_args, _, conv_out = hf_run.records[f"layers.{layer}.conv"]
    assert_bitwise(conv_args[0][0].t(), qkv, "conv input is in_proj_qkv output")
    conv = ops.causal_conv1d_silu(qkv, p[pre + "conv1d.weight"].squeeze(1))
    assert_bitwise(conv, conv_out[0].t(), "causal_conv1d_silu")

    # gates, as handed to the chunk rule
    chunk_args, chunk_kwargs, (core_out, _) = hf_run.records[f"layers.{layer}.chunk_rule"]
    a, b = _out(hf_run, pre + "in_proj_a")[0], _out(hf_run, pre + "in_proj_b")[0]
    g, beta = ops.gdn_gates(a, b, p[pre + "A_log"], p[pre + "dt_bias"])
    assert_bitwise(g, chunk_kwargs["g"][0], "g")
    assert_bitwise(beta, chunk_kwargs["beta"][0], "beta")
    assert g.dtype == torch.float32 and beta.dtype == BF16

    # the core (HF's own torch chunk rule) through the wrapper
    q, k, v = (t[0] for t in chunk_args)
    core, state = ops.gdn_core_torch(q, k, v, g, beta)
    assert state is None
    assert_bitwise(core, core_out[0], "gdn_core_torch")

    # gated output norm, per value head, with z from in_proj_z
    z = _out(hf_run, pre + "in_proj_z")[0].view(seq, hv, dv)
    normed = ops.gated_rmsnorm(core, z, p[pre + "norm.weight"], EPS)
    assert_bitwise(normed, _out(hf_run, pre + "norm").view(seq, hv, dv), "gated_rmsnorm")

    # the whole mixer from its input
    mixed = ops.gdn_mixer(_in(hf_run, pre.rstrip("."))[0], p, pre, TINY)
    assert_bitwise(mixed, _out(hf_run, pre.rstrip("."))[0], "gdn_mixer")


@pytest.mark.parametrize("layer", ATTN_LAYERS)
def test_attention_mixer_ops(hf_run, layer):
    p, pre = hf_run.params, f"layers.{layer}.self_attn."
    seq, heads, head_dim = SEQ_LEN, TINY.num_attention_heads, TINY.head_dim

    # RoPE tables against the position embeddings HF handed to the layer
    hf_cos, hf_sin = hf_run.records[pre.rstrip(".")][1]["position_embeddings"]
    positions = torch.arange(seq, device=hf_run.input_ids.device)
    cos, sin = ops.rope_cos_sin(positions, TINY.rotary_dim, TINY.rope_theta)
    assert_bitwise(cos, hf_cos[0], "rope cos")
    assert_bitwise(sin, hf_sin[0], "rope sin")

    # q / k norms (q is the strided query half of q_proj's per-head [query | gate])
    for norm in ("q_norm", "k_norm"):
        normed = ops.rmsnorm_1p(_in(hf_run, pre + norm)[0], p[pre + norm + ".weight"], EPS)
        assert_bitwise(normed, _out(hf_run, pre + norm)[0], norm)

    # partial RoPE: HF rotates [1, H, T, D]; ops take [T, H, D]
    (hf_q, hf_k, *_), _, (hf_q_rot, hf_k_rot) = hf_run.records[f"layers.{layer}.rope"]
    q_rot = ops.apply_partial_rope(hf_q[0].transpose(0, 1), cos, sin)
    k_rot = ops.apply_partial_rope(hf_k[0].transpose(0, 1), cos, sin)
    assert_bitwise(q_rot, hf_q_rot[0].transpose(0, 1), "q rope")
    assert_bitwise(k_rot, hf_k_rot[0].transpose(0, 1), "k rope")

    # SDPA core and output gate: the o_proj input
    v = _out(hf_run, pre + "v_proj")[0].view(seq, TINY.num_key_value_heads, head_dim)
    gate = _out(hf_run, pre + "q_proj")[0].view(seq, heads, 2 * head_dim)[..., head_dim:].reshape(seq, -1)
    attn = ops.attention_sdpa(q_rot, k_rot, v, head_dim**-0.5).reshape(seq, heads * head_dim)
    assert_bitwise(ops.attention_gate(attn, gate), _in(hf_run, pre + "o_proj")[0], "gated attention output")

    # the whole mixer from its input
    mixed = ops.attention_mixer(_in(hf_run, pre.rstrip("."))[0], p, pre, TINY, cos, sin)
    assert_bitwise(mixed, _out(hf_run, pre.rstrip("."))[0], "attention_mixer")


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: each op on odd shapes, against HF's module (bitwise) and an independent formulation


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_rmsnorm_1p(weight_dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    x, w = randn(37, 3, 129, seed=10, scale=3.0), randn(129, seed=11, scale=0.2, dtype=weight_dtype)
    hf_norm = Qwen3_5RMSNorm(129, eps=EPS)
    hf_norm.weight.data = w
    y = ops.rmsnorm_1p(x, w, EPS)
    with torch.no_grad():
        assert_bitwise(y, hf_norm(x), "rmsnorm_1p vs Qwen3_5RMSNorm")
    x64 = x.double()
    y64 = x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * (1 + w.double())
    assert bf16_ulps(y, y64.to(BF16)).max() <= 1  # fp32 evaluation, one rounding


def test_residual_add_is_one_exact_rounding():
    # magnitudes far apart, so that some sums round and some are exact
    a = randn(41, 131, seed=12, scale=50.0)
    b = randn(41, 131, seed=13) * torch.logspace(-4, 2, 131).to(BF16)
    assert_bitwise(ops.residual_add(a, b), (a.double() + b.double()).to(BF16), "residual_add vs fp64 sum")
    new, normed = ops.residual_rmsnorm(a, b, randn(131, seed=14, scale=0.1), EPS)
    assert_bitwise(new, ops.residual_add(a, b), "residual_rmsnorm residual")
    assert_bitwise(normed, ops.rmsnorm_1p(new, randn(131, seed=14, scale=0.1), EPS), "residual_rmsnorm norm")


def test_silu_mul_rounds_silu_then_product():
    gate, up = randn(53, 389, seed=15, scale=3.0), randn(53, 389, seed=16, scale=2.0)
    out = ops.silu_mul(gate, up)
    silu = F.silu(gate)
    silu64 = gate.double() * torch.sigmoid(gate.double())
    assert bf16_ulps(silu, silu64.to(BF16)).max() <= 1
    assert_bitwise(out, (silu.double() * up.double()).to(BF16), "silu_mul vs bf16 silu times up")
    one_rounding = (silu64 * up.double()).to(BF16)
    assert (out != one_rounding).any(), "rounding silu before the product must be visible"


def test_attention_gate_rounds_sigmoid_then_product():
    attn, gate = randn(29, 6 * 64 + 3, seed=17), randn(29, 6 * 64 + 3, seed=18, scale=3.0)
    out = ops.attention_gate(attn, gate)
    sig = torch.sigmoid(gate)
    assert sig.dtype == BF16
    assert bf16_ulps(sig, torch.sigmoid(gate.double()).to(BF16)).max() <= 1
    assert_bitwise(out, (attn.double() * sig.double()).to(BF16), "attention_gate vs bf16 sigmoid times attn")
    assert (out != (attn.double() * torch.sigmoid(gate.double())).to(BF16)).any()


@pytest.mark.parametrize("param_dtype", [BF16, torch.float32])
def test_gdn_gates(param_dtype):
    seq, hv = 67, 6
    a = randn(seq, hv, seed=19, scale=8.0)  # reaches softplus' x > 20 branch with dt_bias
    b = randn(seq, hv, seed=20, scale=3.0)
    A_log = torch.empty(hv).uniform_(1.0, 16.0, generator=gen(21)).log().to(param_dtype)
    dt_bias = randn(hv, seed=22, scale=4.0, dtype=param_dtype)
    g, beta = ops.gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == BF16
    assert bf16_ulps(beta, torch.sigmoid(b.double()).to(BF16)).max() <= 1
    x64 = (a.float() + dt_bias.float()).double()  # the fp32 sum is where HF adds them
    assert (x64 > 20).any()
    g64 = -A_log.double().exp() * torch.log1p(x64.exp())
    assert ((g.double() - g64).abs() <= 1e-6 * g64.abs()).all()  # fp32 exp, log1p and products: a few ulps


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_causal_conv1d_silu(weight_dtype):
    seq, channels, width = 101, 77, 4
    x, w = randn(seq, channels, seed=23), randn(channels, width, seed=24, scale=0.5, dtype=weight_dtype)
    y = ops.causal_conv1d_silu(x, w)
    assert y.shape == (seq, channels) and y.dtype == BF16
    # independent: shifted copies summed oldest tap first in fp32 (zero history), then the roundings of §2.8
    acc = torch.zeros(seq, channels)
    for tap in range(width):
        shift = width - 1 - tap
        acc = acc + F.pad(x.float(), (0, 0, shift, 0))[:seq] * w[:, tap].float()
    expected = F.silu(acc.to(BF16)) if weight_dtype == BF16 else F.silu(acc).to(BF16)
    assert_bitwise(y, expected, "causal_conv1d_silu vs explicit taps")
    # causal: changing the input from t0 on leaves every earlier output alone
    t0 = 50
    x2 = x.clone()
    x2[t0:] = randn(seq - t0, channels, seed=25)
    y2 = ops.causal_conv1d_silu(x2, w)
    assert_bitwise(y2[:t0], y[:t0], "outputs before the change")
    assert (y2[t0:] != y[t0:]).any()


def test_l2norm_hf():
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    x = randn(71, 6, 32, seed=26, scale=2.0)
    y = ops.l2norm_hf(x)
    assert y.dtype == torch.float32
    assert_bitwise(y, l2norm(x.float(), dim=-1, eps=1e-6), "l2norm_hf vs HF l2norm")
    x64 = x.double()
    y64 = x64 / (x64.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    assert ((y.double() - y64).abs() <= 2**-22 * y64.abs()).all()  # a few fp32 ulps


def _fla_l2norm_fwd(monkeypatch):
    """FLA's `l2norm_fwd` on the CPU: needs the Triton interpreter, and an autotuner that does not time on a GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("FLA's Triton kernels run on the CPU only with TRITON_INTERPRET=1 set before import (nox sets it)")
    import triton.runtime.autotuner

    # every config times the same, so the first one runs (reference-math.md §6, workaround 1)
    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "_bench", lambda self, *a, **k: [1.0, 1.0, 1.0])
    from fla.modules.norm.l2norm import l2norm_fwd

    return l2norm_fwd


@pytest.mark.parametrize("dim", [32, 100, 128])
def test_l2norm_fla_matches_fla_kernel(monkeypatch, dim):
    """Against FLA 0.6.0's own kernel, under the Triton interpreter.

    The interpreter rounds fp32 to bf16 by truncation, not to nearest even as the GPU does, so the comparison reads
    the kernel's fp32 result (`output_dtype=torch.float32`) and rounds it here as the GPU store would. With inputs
    k/16 (|k| < 32) every sum of squares is exact in any order, so the remaining arithmetic must match bit for bit;
    with random inputs the kernel's summation order may move rstd by an fp32 ulp, so the bf16 result is within 1 ulp.
    """
    l2norm_fwd = _fla_l2norm_fwd(monkeypatch)
    exact = (torch.randint(-31, 32, (131, 3, dim), generator=gen(27)).float() / 16).to(BF16)
    fla_exact, _ = l2norm_fwd(exact, output_dtype=torch.float32)
    assert_bitwise(ops.l2norm_fla(exact, output_dtype=torch.float32), fla_exact, "l2norm_fla fp32 vs FLA")
    assert_bitwise(ops.l2norm_fla(exact), fla_exact.to(BF16), "l2norm_fla vs FLA")
    # dividing by the root instead of multiplying by its reciprocal is a different function
    x64 = exact.double()
    root = (x64.pow(2).sum(-1, keepdim=True).float() + 1e-6).double().sqrt().float()
    assert ((x64 / root.double()).float() != fla_exact).any()

    rand = randn(131, 3, dim, seed=28, scale=2.0)
    fla_rand, _ = l2norm_fwd(rand, output_dtype=torch.float32)
    assert bf16_ulps(ops.l2norm_fla(rand), fla_rand.to(BF16)).max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [32, 128])
def test_l2norm_fla_vs_fla_kernel_on_gpu(dim):
    """On the GPU FLA's kernel uses Triton's approximate `/` and `sqrt`: at most 1 bf16 ulp from l2norm_fla."""
    from fla.modules.norm.l2norm import l2norm_fwd

    x = randn(4099, 16, dim, seed=29, scale=2.0).cuda()
    fla, _ = l2norm_fwd(x)
    ours = ops.l2norm_fla(x)
    ulps = bf16_ulps(ours, fla)
    print(f"l2norm_fla vs FLA on GPU, K={dim}: {int((ulps > 0).sum())} of {ulps.numel()} differ")
    assert ulps.max() <= 1


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_gated_rmsnorm(weight_dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    o, z = randn(59, 6, 32, seed=30, scale=0.3), randn(59, 6, 32, seed=31, scale=2.0)
    w = (1.0 + 0.2 * torch.randn(32, generator=gen(32))).to(weight_dtype)
    y = ops.gated_rmsnorm(o, z, w, EPS)
    hf_norm = Qwen3_5RMSNormGated(32, eps=EPS)
    hf_norm.weight.data = w
    with torch.no_grad():
        assert_bitwise(y, hf_norm(o.reshape(-1, 32), z.reshape(-1, 32)).view_as(o), "vs Qwen3_5RMSNormGated")
    # independent: fp64 math with the HF rounding points made explicit
    o64 = o.double()
    n = (o64 / (o64.pow(2).mean(-1, keepdim=True) + EPS).sqrt()).to(BF16).double()  # round 1
    t = (w.double() * n).to(BF16).double() if weight_dtype == BF16 else w.double() * n  # round 2 (bf16 w only)
    expected = (t * z.double() * torch.sigmoid(z.double())).to(BF16)  # round 3
    assert bf16_ulps(y, expected).max() <= 1
    assert (y == expected).float().mean() > 0.99
    # FLA's fused gated norm rounds once, which is visibly another function
    once = (o64 / (o64.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w.double() * F.silu(z.double())).to(BF16)
    assert (y != once).any()


def test_rope_cos_sin():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    positions = torch.cat(
        [torch.arange(0, 131), torch.randint(131, TINY.max_position_embeddings, (37,), generator=gen(33))]
    )
    cos, sin = ops.rope_cos_sin(positions, TINY.rotary_dim, TINY.rope_theta)
    assert cos.shape == (168, TINY.rotary_dim) and cos.dtype == BF16
    rotary = Qwen3_5TextRotaryEmbedding(TINY.to_hf_config())
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=BF16), positions[None])
    assert_bitwise(cos, hf_cos[0], "cos vs Qwen3_5TextRotaryEmbedding")
    assert_bitwise(sin, hf_sin[0], "sin vs Qwen3_5TextRotaryEmbedding")
    # independent: fp64 cos / sin of the same fp32 angles
    half = TINY.rotary_dim // 2
    inv_freq64 = 1.0 / TINY.rope_theta ** (torch.arange(0, TINY.rotary_dim, 2, dtype=torch.float64) / TINY.rotary_dim)
    assert (
        (ops.rope_inv_freq(TINY.rotary_dim, TINY.rope_theta).double() - inv_freq64).abs() <= 2**-23 * inv_freq64
    ).all()
    angles = (positions[:, None].float() * ops.rope_inv_freq(TINY.rotary_dim, TINY.rope_theta)).double()
    assert bf16_ulps(cos[:, :half], angles.cos().to(BF16)).max() <= 1
    assert bf16_ulps(sin[:, half:], angles.sin().to(BF16)).max() <= 1
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])


def test_apply_partial_rope():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    seq, heads, head_dim, rotary_dim = 43, 5, 64, 16
    x = randn(seq, heads, head_dim, seed=34, scale=2.0)
    cos, sin = ops.rope_cos_sin(torch.arange(7, 7 + seq), rotary_dim, TINY.rope_theta)
    y = ops.apply_partial_rope(x, cos, sin)
    assert_bitwise(y[..., rotary_dim:], x[..., rotary_dim:], "pass-through dims")
    # independent: each product of two bf16 is exact in fp64, then the three roundings
    half = rotary_dim // 2
    x1, x2 = x[..., :half].double(), x[..., half:rotary_dim].double()
    c, s = cos[:, None, :half].double(), sin[:, None, :half].double()  # both halves of the tables are equal
    first = (x1 * c).to(BF16).double() + (-x2 * s).to(BF16).double()
    second = (x2 * c).to(BF16).double() + (x1 * s).to(BF16).double()
    assert_bitwise(y[..., :half], first.to(BF16), "first rotary half")
    assert_bitwise(y[..., half:rotary_dim], second.to(BF16), "second rotary half")
    # HF, in its [B, H, T, D] layout
    hf_q, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert_bitwise(y, hf_q[0].transpose(0, 1), "vs apply_rotary_pos_emb")


def test_attention_sdpa_against_fp64():
    """Causal GQA (query head h reads kv head h // 6) against fp64 softmax attention.

    SDPA rounds the probabilities and the output to bf16, so the error is within 2^-8 of |o| plus 2^-8 of max |v|.
    """
    seq, heads, kv_heads, head_dim = 83, 6, 1, 64
    q, k = randn(seq, heads, head_dim, seed=35), randn(seq, kv_heads, head_dim, seed=36)
    v = randn(seq, kv_heads, head_dim, seed=37)
    o = ops.attention_sdpa(q, k, v, head_dim**-0.5)
    assert o.shape == (seq, heads, head_dim) and o.dtype == BF16
    kk, vv = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * head_dim**-0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    o64 = torch.einsum("hts,shd->thd", scores.softmax(-1), vv)
    assert ((o.double() - o64).abs() <= 2**-8 * (o64.abs() + v.double().abs().max())).all()
    # the first token attends to itself only
    assert_bitwise(o[0], v[0].expand(heads, head_dim), "first token")


def _naive_gdn_fp64(q, k, v, g, beta):
    """Token-by-token gated delta rule in fp64 (the definition, independent of HF's chunked form)."""
    r = v.shape[1] // q.shape[1]
    q, k = (t.double().repeat_interleave(r, dim=1) for t in (q, k))
    q = q / q.norm(dim=-1, keepdim=True) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True)
    state = torch.zeros(v.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        update = (v[t].double() - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t].double()[:, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], update)
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out), state


def test_gdn_core_torch_against_recurrence_and_chunk_aligned_split():
    seq, hk, hv, dk, dv = 131, 2, 6, 32, 32
    q, k, v = randn(seq, hk, dk, seed=38), randn(seq, hk, dk, seed=39), randn(seq, hv, dv, seed=40)
    g, beta = ops.gdn_gates(
        randn(seq, hv, seed=41),
        randn(seq, hv, seed=42),
        torch.empty(hv).uniform_(1, 16, generator=gen(43)).log(),
        randn(hv, seed=44),
    )
    o, state = ops.gdn_core_torch(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == BF16 and state.dtype == torch.float32 and state.shape == (hv, dk, dv)
    o64, state64 = _naive_gdn_fp64(q, k, v, g, beta)
    assert ((o.double() - o64).abs() <= 2**-8 * o64.abs() + 1e-5).all()  # bf16 output rounding + fp32 chunk math
    assert ((state.double() - state64).abs() <= 1e-5).all()
    # continuing from the state of a chunk-aligned prefix reproduces the single pass bit for bit (§7: 64-aligned)
    for split in (64, 128):
        o1, s1 = ops.gdn_core_torch(q[:split], k[:split], v[:split], g[:split], beta[:split], output_final_state=True)
        o2, s2 = ops.gdn_core_torch(
            q[split:], k[split:], v[split:], g[split:], beta[split:], s1, output_final_state=True
        )
        assert_bitwise(torch.cat([o1, o2]), o, f"split at {split}")
        assert_bitwise(s2, state, f"final state, split at {split}")


def test_bad_inputs_raise():
    x = randn(5, 8, seed=45)
    with pytest.raises(ValueError, match="rmsnorm_1p"):
        ops.rmsnorm_1p(x, randn(7, seed=46), EPS)
    with pytest.raises(ValueError, match="causal_conv1d_silu"):
        ops.causal_conv1d_silu(x, randn(7, 4, seed=47))
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(x, x.float())
    with pytest.raises(ValueError, match="positions"):
        ops.rope_cos_sin(torch.arange(5, dtype=torch.int32), 16, 1e7)
    with pytest.raises(KeyError, match="in_proj_qkv"):
        ops.gdn_mixer(randn(5, TINY.hidden_size, seed=48), {}, "layers.0.linear_attn.", TINY)
