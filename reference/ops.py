"""Naive PyTorch references of every op the fused kernels replace, with the bf16 rounding points of the HF path.

"The HF path" is transformers 5.23 `models/qwen3_5/modeling_qwen3_5.py` with its torch fallbacks (reference-math.md
§8, "HF-torch"): torch conv, torch chunk gated delta rule, torch gated norm, SDPA attention. Each function repeats
HF's sequence of torch ops and dtypes, so on the same device and the same shapes it returns the same bits as the HF
module (tests/test_ops.py proves it layer by layer on the tiny twin). Fast kernels state their exactness against
these functions.

Notation: bf16↓ is a rounding to bf16 (round to nearest even); values not marked are fp32. Layout is one sequence,
row-major: `[T, hidden]`, `[T, heads, head_dim]`. Parameters are looked up by their HF state-dict names
(`layers.{i}.linear_attn.in_proj_qkv.weight`, ...), as in `DecisionWeights.backbone`.

Where reference-math.md and the installed 5.23 code differ, this module follows the code:
* FLA's l2norm computes `rstd = 1 / sqrt(Σx² + eps)` and then `x * rstd` (the doc and HELPERS write `x / sqrt(...)`,
  which differs in the last fp32 bit).
* HF 5.23 calls SDPA without repeating k/v: `enable_gqa=True` whenever the query heads outnumber the kv heads, no mask
  and `is_causal=True` for an unpadded prefill (`integrations/sdpa_attention.py`).
* The GDN causal conv runs in the conv weight's dtype: two roundings with a bf16 weight (§2.8), one with an fp32 weight.
* RoPE `inv_freq` is a buffer HF computes in fp32 when the module is built; `model.to(torch.bfloat16)` would round it
  to bf16 (`from_pretrained(dtype=torch.bfloat16)` keeps it fp32, which is what `rope_cos_sin` reproduces).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from reference.shapes import ModelShapes

# ---------------------------------------------------------------------------------------------------------------------
# Norms and residual stream


GDN_CHUNK_SIZE = 64  # chunk length of HF's torch_chunk_gated_delta_rule and of FLA's chunk_gated_delta_rule


def rmsnorm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (`Qwen3_5RMSNorm`): y = bf16↓( x_f · rsqrt(mean(x_f²) + eps) · (1 + w_f) ).

    x [..., D] (bf16), weight [D] (offset from 1, any float dtype). One rounding, to x's dtype, at the end.
    """
    _check_last_dim(x, weight, "rmsnorm_1p")
    x_f = x.float()
    normed = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def residual_add(residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Decoder residual add: bf16↓(residual + delta), [T, hidden] bf16. One rounding of the exact sum (torch adds the
    two bf16 in fp32, which loses nothing the bf16 rounding would keep)."""
    if residual.shape != delta.shape or residual.dtype != delta.dtype:
        raise ValueError(
            f"residual_add: residual {tuple(residual.shape)} {residual.dtype} and delta {tuple(delta.shape)} "
            f"{delta.dtype} must match"
        )
    return residual + delta


def residual_rmsnorm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add then zero-centred RMSNorm, as a fused kernel would do it: returns (new_residual, normed).

    new_residual = bf16↓(residual + delta) (or residual itself when delta is None: the first layer's input norm);
    normed = rmsnorm_1p(new_residual, weight, eps). Both [T, hidden] bf16.
    """
    new_residual = residual if delta is None else residual_add(residual, delta)
    return new_residual, rmsnorm_1p(new_residual, weight, eps)


def splitk_delta(partials: torch.Tensor) -> torch.Tensor:
    """The split-K GEMM's reduction: delta = bf16↓( p_0 + p_1 + ... + p_{S-1} ) of partials [S, T, hidden] fp32.

    Not an HF op: a GEMM split over S slices of K returns S fp32 partial sums, and this is how they are reduced, in
    fp32, strictly in split order (each + one IEEE fp32 add, never a tree), then rounded once. Returns [T, hidden] bf16.
    """
    if partials.ndim != 3 or partials.dtype != torch.float32 or partials.shape[0] < 1:
        raise ValueError(f"splitk_delta: partials must be [S >= 1, T, hidden] fp32, got {tuple(partials.shape)}")
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total.to(torch.bfloat16)


def residual_rmsnorm_splitk(
    residual: torch.Tensor, partials: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual_rmsnorm` whose delta is the split-K reduction `splitk_delta(partials)`: (new_residual, normed)."""
    return residual_rmsnorm(residual, splitk_delta(partials), weight, eps)


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (`Qwen3_5RMSNormGated`, HF torch path), per value head of V dims.

    o, z [..., V] bf16; weight [V] (plain scale, not 1 + w; bf16 or fp32 as loaded).
    n = bf16↓( o_f · rsqrt(mean(o_f²) + eps) )            round 1
    t = w · n: bf16↓ when w is bf16 (round 2); fp32 when w is fp32 (exact promotion)
    y = bf16↓( t_f · silu(z_f) )                          round 3 (silu of fp32 z, in fp32)
    FLA's FusedRMSNormGated rounds once instead, so it differs from this by about one bf16 ulp.
    Round 1 is `rms_normalize`, rounds 2 and 3 `gated_rmsnorm_tail` (ablations/bit_identity.py reruns the tail on
    an n moved by one ulp).
    """
    _check_last_dim(o, weight, "gated_rmsnorm")
    if z.shape != o.shape:
        raise ValueError(f"gated_rmsnorm: z {tuple(z.shape)} must have o's shape {tuple(o.shape)}")
    return gated_rmsnorm_tail(rms_normalize(o, eps), z, weight)


def rms_normalize(o: torch.Tensor, eps: float) -> torch.Tensor:
    """Round 1 of `gated_rmsnorm`: n = bf16↓( o_f · rsqrt(mean(o_f²) + eps) ), [..., V] in o's dtype."""
    o_f = o.float()
    return (o_f * torch.rsqrt(o_f.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)


def gated_rmsnorm_tail(normed: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rounds 2 and 3 of `gated_rmsnorm` on its n [..., V]: y = bf16↓( t · silu(z_f) ), t = w · n (bf16↓ when w is
    bf16, fp32 when w is fp32); y in n's dtype."""
    scaled = weight * normed
    return (scaled * F.silu(z.float())).to(normed.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Element-wise gates


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU middle of the MLP: bf16↓( bf16↓(silu(gate)) · up ). gate, up [T, I] bf16; silu evaluated in fp32."""
    _check_same(gate, up, "silu_mul")
    return F.silu(gate) * up


def attention_gate(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output gate: bf16↓( attn · bf16↓(sigmoid(gate)) ). attn, gate [T, H·D] bf16; sigmoid in fp32."""
    _check_same(attn, gate, "attention_gate")
    return attn * torch.sigmoid(gate)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength per token and value head: returns (g fp32 [T, Hv], beta bf16 [T, Hv]).

    a, b [T, Hv] bf16 (in_proj_a / in_proj_b outputs); A_log, dt_bias [Hv] (bf16 or fp32 as loaded).
    beta = bf16↓(sigmoid(b))                                  (bf16 op, fp32 inside)
    g = -exp(A_log_f) · softplus(a_f + dt_bias)               fp32, never rounded; softplus is x itself above 20
    """
    if a.shape != b.shape or a.shape[-1:] != A_log.shape or A_log.shape != dt_bias.shape:
        raise ValueError(
            f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, "
            f"dt_bias {tuple(dt_bias.shape)} do not fit [T, Hv] / [Hv]"
        )
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


# ---------------------------------------------------------------------------------------------------------------------
# GDN pieces


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of the GDN qkv channels (HF `causal_conv1d_fn`, torch path), one sequence.

    x [T, C] bf16, weight [C, W] (conv1d.weight squeezed). y[t, c] = silu( Σ_w x[t - W + 1 + w, c] · weight[c, w] ),
    x = 0 before t = 0 (no history). F.conv1d runs in the weight's dtype: with a bf16 weight the conv output is
    bf16↓ and the SiLU (fp32 inside) bf16↓ again; with an fp32 weight both are fp32 and the result is bf16↓ once.
    The conv sees the same channel-minor layout as in HF ([1, C, T] view of [T, C]).
    """
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d_silu: expected x [T, C] and weight [C, W], got {x.shape} and {weight.shape}")
    seq_len, channels = x.shape
    out = F.conv1d(
        x.t().unsqueeze(0).to(weight.dtype),  # [1, C, T]
        weight.unsqueeze(1),  # [C, 1, W]
        padding=weight.shape[1] - 1,
        groups=channels,
    )[:, :, :seq_len]
    return F.silu(out).to(x.dtype)[0].t().contiguous()  # [T, C]


def l2norm_hf(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """q/k L2 norm of the HF torch GDN paths (transformers >= 5.20): x_f · rsqrt(Σ x_f² + eps), fp32, not rounded.

    x [..., K] (bf16 or fp32) -> fp32 [..., K]. The sum runs over the last, contiguous dim as in HF.
    """
    x_f = x.float()
    return x_f * torch.rsqrt((x_f * x_f).sum(dim=-1, keepdim=True) + eps)


def l2norm_fla(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q/k L2 norm of FLA 0.6.0's chunk path (`fla.modules.norm.l2norm.l2norm_fwd`).

    x [..., K] -> output_dtype (default x's dtype, so bf16 for bf16 q/k) [..., K]:
    rstd = 1 / sqrt(Σ x_f² + eps) (fp32), y = bf16↓(x_f · rstd). The kernel sums in its own order (a Triton tree on
    GPU, numpy under TRITON_INTERPRET) and on GPU Triton's default `/` and `sqrt` are the approximate PTX
    instructions, so FLA's rstd can differ from this one in the last fp32 bits; the bf16 outputs then differ by at
    most one ulp, rarely (tests/test_ops.py measures it).
    """
    x_f = x.float()
    sum_sq = (x_f * x_f).sum(dim=-1, keepdim=True) + eps  # fp32 [..., 1]
    root = sum_sq.double().sqrt().float()  # IEEE sqrt rounded to fp32 (fp64 then fp32 rounds correctly)
    rstd = (1.0 / root.double()).float()  # IEEE 1 / root rounded to fp32
    return (x_f * rstd).to(output_dtype or x.dtype)


def _check_gdn_shapes(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor) -> None:  # fmt: skip
    """Raise unless q, k are [T, Hk, K], v [T, Hv, V] with Hk dividing Hv, and g, beta [T, Hv]."""
    seq_len, num_k_heads, _ = q.shape
    if k.shape != q.shape or v.shape[0] != seq_len or v.shape[1] % num_k_heads:
        raise ValueError(f"{name}: q {q.shape}, k {k.shape}, v {v.shape} do not fit [T, Hk, K] / [T, Hv, V]")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"{name}: g {g.shape} and beta {beta.shape} must be [T, Hv] = {tuple(v.shape[:2])}")


def gdn_core_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over one sequence: HF's own `torch_chunk_gated_delta_rule` (chunk 64), never FLA.

    q, k [T, Hk, K] bf16; v [T, Hv, V] bf16 (value head j reads q/k head j // (Hv/Hk)); g [T, Hv] fp32;
    beta [T, Hv] bf16; initial_state [Hv, K, V] fp32 or None (zeros).
    All math in fp32: q, k = l2norm_hf(q, k); q ·= K^-0.5; per token S ← exp(g_t) S + k_t ((v_t − Sᵀk_t) β_t)ᵀ,
    o_t = Sᵀ q_t, evaluated chunk-wise (UT transform by a unit-triangular solve). Returns (bf16↓(o) [T, Hv, V],
    final state fp32 [Hv, K, V] when output_final_state else None). HF picks FLA's kernel for this op whenever `fla`
    imports; this function always calls the torch function underneath the hub-kernel wrapper.
    """
    _check_gdn_shapes("gdn_core_torch", q, k, v, g, beta)
    chunk_rule = _hf_torch_function("torch_chunk_gated_delta_rule")
    o, state = chunk_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=None if initial_state is None else initial_state[None],
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], None if state is None else state[0]


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token, fp32 throughout: the oracle of the chunked kernels.

    q, k [T, Hk, K] (already L2-normalised, as the engine's prep kernel leaves them), v [T, Hv, V], g [T, Hv] (log
    decay), beta [T, Hv], any float dtype (upcast to fp32); value head j reads q/k head j // (Hv/Hk); initial_state
    [Hv, K, V] or None (zeros); scale defaults to K^-0.5. Per token (FLA's naive_recurrent_gated_delta_rule):
    S ← exp(g_t) S;  v'_t = β_t (v_t − Sᵀ k_t);  S ← S + k_t v'_tᵀ;  o_t = scale · Sᵀ q_t.
    Returns (o [T, Hv, V] fp32, final state [Hv, K, V] fp32); nothing is rounded.
    """
    _check_gdn_shapes("gdn_recurrent", q, k, v, g, beta)
    seq_len, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    groups = num_v_heads // num_k_heads
    q, k = (t.float().repeat_interleave(groups, dim=1) for t in (q, k))
    v, g, beta = v.float(), g.float(), beta.float()
    scale = key_dim**-0.5 if scale is None else scale
    state = torch.zeros(num_v_heads, key_dim, value_dim, device=q.device)
    if initial_state is not None:
        state = state + initial_state.float()
    out = torch.empty(seq_len, num_v_heads, value_dim, device=q.device)
    for t in range(seq_len):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = scale * torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


# ---------------------------------------------------------------------------------------------------------------------
# Attention pieces


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """fp32 [rotary_dim / 2]: 1 / theta^(2i / rotary_dim), computed on the CPU as HF does when it builds the model."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    dtype: torch.dtype = torch.bfloat16,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (`Qwen3_5TextRotaryEmbedding` for text-only positions): returns (cos, sin) [T, rotary_dim] dtype.

    freqs = float(p) · inv_freq (fp32 [T, rotary_dim / 2]); cos, sin = bf16↓(cos / sin of [freqs | freqs]).
    For text all three mrope position rows are equal, so HF's interleaved-mrope recomposition is the identity and
    `mrope_section` plays no part. positions [T] int64 on the device where the tables are wanted.
    """
    if positions.ndim != 1 or positions.dtype != torch.int64:
        raise ValueError(f"rope_cos_sin: positions must be [T] int64, got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq is None:  # a caller that captures CUDA graphs passes its device copy (no host copy in the forward)
        inv_freq = rope_inv_freq(rotary_dim, theta).to(positions.device)
    freqs = positions[:, None].float() * inv_freq  # [T, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `apply_rotary_pos_emb` on the first rotary_dim dims of each head (NeoX rotate_half pairs d, d + r/2).

    x [T, H, D] bf16; cos, sin [T, r] bf16. out[..., :r] = bf16↓( bf16↓(x_r·cos) + bf16↓(rotate_half(x_r)·sin) ),
    with rotate_half(x_r) = [−x_r[r/2:], x_r[:r/2]]; out[..., r:] = x[..., r:] unchanged.
    """
    return rope_with_partner(x, x, cos, sin)


def rope_with_partner(x: torch.Tensor, partner: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_partial_rope` with rotate_half read from `partner` (x's shape) instead of x:
    out[..., :r] = bf16↓( bf16↓(x_r·cos) + bf16↓(rotate_half(partner_r)·sin) ), out[..., r:] = x[..., r:].
    apply_partial_rope(x) is rope_with_partner(x, x); ablations/bit_identity.py moves x and partner apart by one ulp.
    """
    rotary_dim = cos.shape[-1]
    if x.ndim != 3 or cos.shape != (x.shape[0], rotary_dim) or sin.shape != cos.shape or rotary_dim > x.shape[-1]:
        raise ValueError(f"apply_partial_rope: x {x.shape} must be [T, H, D] and cos, sin [T, r <= D]")
    if partner.shape != x.shape:
        raise ValueError(f"rope_with_partner: partner {partner.shape} must have x's shape {x.shape}")
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, r]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-partner[..., half:rotary_dim], partner[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal GQA attention of one unpadded sequence, called as HF 5.23 calls SDPA: [T, H, D] bf16 out.

    q [T, H, D], k, v [T, Hkv, D] bf16; query head h reads kv head h // (H / Hkv). softmax(scaling · q kᵀ, causal) v
    by torch's SDPA (fp32 softmax and accumulation inside, output bf16↓), `enable_gqa=True` when H > Hkv, no mask.
    """
    if q.ndim != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention_sdpa: q {q.shape}, k {k.shape}, v {v.shape} do not fit [T, H, D] / [T, Hkv, D]")
    seq_len, num_heads, head_dim = q.shape
    gqa = {"enable_gqa": True} if num_heads > k.shape[1] else {}
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=None,
        dropout_p=0.0,
        scale=scaling,
        is_causal=seq_len > 1,
        **gqa,
    )
    return out[0].transpose(0, 1).contiguous()  # [T, H, D]


# ---------------------------------------------------------------------------------------------------------------------
# Compositions: mixers, MLP, decoder layer, backbone (one sequence, no cache)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear without bias: x [T, K] bf16 · weightᵀ [N, K] -> bf16↓ [T, N] (fp32 accumulate in the BLAS)."""
    return F.linear(x, weight)


def mlp(x: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """`Qwen3_5MLP`: down( silu_mul(gate(x), up(x)) ). x [T, hidden] bf16 -> [T, hidden] bf16."""
    hidden = silu_mul(
        linear(x, _param(params, prefix + "gate_proj.weight")), linear(x, _param(params, prefix + "up_proj.weight"))
    )
    return linear(hidden, _param(params, prefix + "down_proj.weight"))


def gdn_mixer(x: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str, shapes: ModelShapes) -> torch.Tensor:
    """`Qwen3_5GatedDeltaNet.forward` without cache: x [T, hidden] bf16 (input-normed) -> [T, hidden] bf16.

    qkv = conv_silu(in_proj_qkv x) split [q | k | v]; z = in_proj_z x; (g, beta) = gdn_gates(in_proj_a x,
    in_proj_b x); o = gdn_core_torch(q, k, v, g, beta); out = out_proj( gated_rmsnorm(o, z) ).
    """
    seq_len = x.shape[0]
    hk, hv = shapes.linear_num_key_heads, shapes.linear_num_value_heads
    dk, dv = shapes.linear_key_head_dim, shapes.linear_value_head_dim
    qkv = linear(x, _param(params, prefix + "in_proj_qkv.weight"))  # [T, 2·Hk·K + Hv·V]
    z = linear(x, _param(params, prefix + "in_proj_z.weight")).view(seq_len, hv, dv)
    b = linear(x, _param(params, prefix + "in_proj_b.weight"))  # [T, Hv]
    a = linear(x, _param(params, prefix + "in_proj_a.weight"))  # [T, Hv]
    qkv = causal_conv1d_silu(qkv, _param(params, prefix + "conv1d.weight").squeeze(1))
    q, k, v = torch.split(qkv, [shapes.linear_key_dim, shapes.linear_key_dim, shapes.linear_value_dim], dim=-1)
    g, beta = gdn_gates(a, b, _param(params, prefix + "A_log"), _param(params, prefix + "dt_bias"))
    o, _ = gdn_core_torch(q.reshape(seq_len, hk, dk), k.reshape(seq_len, hk, dk), v.reshape(seq_len, hv, dv), g, beta)
    o = gated_rmsnorm(o, z, _param(params, prefix + "norm.weight"), shapes.rms_norm_eps)  # [T, Hv, V]
    return linear(o.reshape(seq_len, hv * dv), _param(params, prefix + "out_proj.weight"))


def attention_mixer(
    x: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    prefix: str,
    shapes: ModelShapes,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`Qwen3_5Attention.forward` without cache (SDPA): x [T, hidden] bf16 (input-normed) -> [T, hidden] bf16.

    q_proj output per head is [query D | gate D]; q = rope(q_norm(query)), k = rope(k_norm(k_proj x)), v = v_proj x;
    out = o_proj( attention_gate(attention_sdpa(q, k, v, D^-0.5), gate) ). cos, sin [T, rotary_dim] bf16.
    """
    seq_len = x.shape[0]
    heads, kv_heads, head_dim = shapes.num_attention_heads, shapes.num_key_value_heads, shapes.head_dim
    eps = shapes.rms_norm_eps
    query, gate = torch.chunk(
        linear(x, _param(params, prefix + "q_proj.weight")).view(seq_len, heads, 2 * head_dim), 2, dim=-1
    )
    q = rmsnorm_1p(query, _param(params, prefix + "q_norm.weight"), eps)  # [T, H, D]
    k = linear(x, _param(params, prefix + "k_proj.weight")).view(seq_len, kv_heads, head_dim)
    k = rmsnorm_1p(k, _param(params, prefix + "k_norm.weight"), eps)
    v = linear(x, _param(params, prefix + "v_proj.weight")).view(seq_len, kv_heads, head_dim)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    attn = attention_sdpa(q, k, v, head_dim**-0.5).reshape(seq_len, heads * head_dim)
    gated = attention_gate(attn, gate.reshape(seq_len, heads * head_dim))
    return linear(gated, _param(params, prefix + "o_proj.weight"))


# ---------------------------------------------------------------------------------------------------------------------
# Compositions of the fused prep kernels (packed rows, one sequence at a time)


def gdn_prep(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    shapes: ModelShapes,
    *,
    qk_l2norm: bool = True,
) -> dict[str, torch.Tensor]:
    """The composition `kernels.gdn_prep` replaces, over packed rows: proj [T, P] bf16 (the merged in-projection) and
    cu_seqlens [S + 1] -> q, k [T, Hk, K], v [T, Hv, V] bf16, g fp32, beta bf16 [T, Hv], sequence by sequence (zero
    conv history): `causal_conv1d_silu`, split, `l2norm_fla` on q / k (when qk_l2norm), `gdn_gates` on a / b.
    The kernel's exactness against it: tests/test_kernels.py, tests/test_gpu_kernels.py (`ablations.bit_identity`)."""
    hk, hv = shapes.linear_num_key_heads, shapes.linear_num_value_heads
    dk, dv = shapes.linear_key_head_dim, shapes.linear_value_head_dim
    b_column = shapes.conv_dim + shapes.linear_value_dim
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in ("q", "k", "v", "g", "beta")}
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        if start == end:
            continue
        rows = end - start
        mixed = causal_conv1d_silu(proj[start:end, : shapes.conv_dim], conv_weight)
        q, k, v = torch.split(mixed, [shapes.linear_key_dim, shapes.linear_key_dim, shapes.linear_value_dim], dim=-1)
        q, k = q.reshape(rows, hk, dk), k.reshape(rows, hk, dk)
        if qk_l2norm:
            q, k = l2norm_fla(q), l2norm_fla(k)
        b = proj[start:end, b_column : b_column + hv]
        a = proj[start:end, b_column + hv : b_column + 2 * hv]
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        for name, value in zip(parts, (q, k, v.reshape(rows, hv, dv), g, beta)):
            parts[name].append(value)
    return {name: torch.cat(values) for name, values in parts.items()}


def attn_prep(
    proj: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shapes: ModelShapes,
) -> dict[str, torch.Tensor]:
    """q [T, H, D], k, v [T, Hkv, D] and gate [T, H·D] as `reference.attention_mixer` forms them, and
    q_normed, k_normed: q and k before RoPE (the n of `rope_flips`)."""
    rows, heads, kv_heads, dim = proj.shape[0], shapes.num_attention_heads, shapes.num_key_value_heads, shapes.head_dim
    eps = shapes.rms_norm_eps
    query, gate = torch.chunk(proj[:, : 2 * heads * dim].reshape(rows, heads, 2 * dim), 2, dim=-1)
    k = proj[:, 2 * heads * dim : (2 * heads + kv_heads) * dim].reshape(rows, kv_heads, dim)
    v = proj[:, (2 * heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
    q_normed, k_normed = rmsnorm_1p(query, q_norm_weight, eps), rmsnorm_1p(k, k_norm_weight, eps)
    q, k = apply_partial_rope(q_normed, cos, sin), apply_partial_rope(k_normed, cos, sin)
    return {"q": q, "k": k, "v": v, "gate": gate.reshape(rows, heads * dim), "q_normed": q_normed, "k_normed": k_normed}


def decoder_layer(
    x: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    layer: int,
    shapes: ModelShapes,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """`Qwen3_5DecoderLayer`: h = x + mixer(norm_in(x)); out = h + mlp(norm_post(h)); bf16 [T, hidden] in and out."""
    prefix = f"layers.{layer}."
    eps = shapes.rms_norm_eps
    _, normed = residual_rmsnorm(x, None, _param(params, prefix + "input_layernorm.weight"), eps)
    if shapes.layer_types[layer] == "linear_attention":
        mixed = gdn_mixer(normed, params, prefix + "linear_attn.", shapes)
    else:
        mixed = attention_mixer(normed, params, prefix + "self_attn.", shapes, cos, sin)
    h, normed = residual_rmsnorm(x, mixed, _param(params, prefix + "post_attention_layernorm.weight"), eps)
    return residual_add(h, mlp(normed, params, prefix + "mlp."))


def backbone_hidden_states(
    input_ids: torch.Tensor, params: Mapping[str, torch.Tensor], shapes: ModelShapes
) -> list[torch.Tensor]:
    """`Qwen3_5TextModel` on one sequence (positions 0..T-1, no padding, no cache), every residual state kept.

    input_ids [T] int64 -> [embedding, layer 0 out, ..., layer L-1 out, final-norm out], each [T, hidden] bf16:
    the `Backbone.hidden_states` convention for a single candidate.
    """
    if input_ids.ndim != 1:
        raise ValueError(f"backbone_hidden_states: input_ids must be [T], got {tuple(input_ids.shape)}")
    x = F.embedding(input_ids, _param(params, "embed_tokens.weight"))  # [T, hidden]
    positions = torch.arange(input_ids.shape[0], device=input_ids.device)
    cos, sin = rope_cos_sin(positions, shapes.rotary_dim, shapes.rope_theta, dtype=x.dtype)
    states = [x]
    for layer in range(shapes.num_layers):
        x = decoder_layer(x, params, layer, shapes, cos, sin)
        states.append(x)
    states.append(rmsnorm_1p(x, _param(params, "norm.weight"), shapes.rms_norm_eps))
    return states


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


@functools.cache
def _hf_torch_function(name: str) -> Callable:
    """The torch fallback under HF's hub-kernel wrapper (which resolves to FLA / causal-conv1d when they import)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    function = inspect.unwrap(getattr(modeling_qwen3_5, name))
    if function.__code__.co_filename != modeling_qwen3_5.__file__:
        raise RuntimeError(f"{name}: expected the torch function of {modeling_qwen3_5.__file__}, got {function}")
    return function


def _param(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return params[name]
    except KeyError:
        raise KeyError(f"parameter {name!r} missing (HF Qwen3_5TextModel state-dict names expected)") from None


def _check_last_dim(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    if weight.ndim != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} must be [D] with D = x.shape[-1] = {x.shape[-1]}")


def _check_same(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{op}: inputs {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype} must match")
