"""GPU tests of the fused kernels (27B shapes, H200), and `bit_identity_table`, the per-kernel bit-identity table.

`bit_identity_table(activations, shapes)` runs every kernel whose inputs are in `activations` on NaN-poisoned
outputs, computes the same outputs with `reference.ops` on the same device, and returns one row per output:
    {"kernel", "output", "elements", "bit_identical", "share", "max_ulp", "max_abs_diff"}
(ulp = distance in representable values of the output dtype, bf16 or fp32). The coordinator calls it from a GPU
script on activations captured from the 27B reference forward (one sequence, or packed sequences with
"gdn_cu_seqlens"):

    from tests.test_gpu_kernels import bit_identity_table
    rows = bit_identity_table(activations, QWEN38_27B)

`activations` holds any of these groups (CUDA tensors, bf16 unless said; T rows; what to capture in parentheses):
* MLP: "mlp_gate_up" [T, 2I] (cat(gate_proj(x), up_proj(x), -1)).
* residual norm: "residual" [T, H] (the layer input), "delta" [T, H] (the mixer output), "norm_weight" [H]
  (post_attention_layernorm.weight).
* GDN prep: "gdn_proj" [T, P] (cat(in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x), -1)), "conv_weight"
  [C, W] (conv1d.weight.squeeze(1)), "A_log" [Hv], "dt_bias" [Hv], optional "gdn_cu_seqlens" [N + 1] int32 (packed
  sequences; default one sequence).
* GDN norm: "gdn_core_out" [T, Hv, V] (the chunk rule's output), "gdn_proj" (for z), "gdn_norm_weight" [V]
  (linear_attn.norm.weight).
* attention prep: "attn_proj" [T, 2·H·D + 2·Hkv·D] (cat(q_proj(x), k_proj(x), v_proj(x), -1)), "q_norm_weight",
  "k_norm_weight" [D], "cos", "sin" [T, r] (the rotary embedding's output for these positions).
* attention gate: "attn_core_out" [T, H, D] (the SDPA output, token-major), "attn_proj" (for the gate).
Extra keys are ignored; a group with a missing key is skipped. eps is `shapes.rms_norm_eps` (1e-6 for the GDN
l2norm, as FLA). `random_activations(shapes, seq_lens, device, seed)` builds such a dict from seeded random data at
realistic scales; the tests below run the table on it.

Expected exactness (reasons in each kernel module's docstring), asserted by the tests:
* bitwise: silu_mul, attention_gate, the new residual, gdn_prep v / beta / g, attn_prep v;
* one bf16 ulp at most, in at most 1e-4 of the elements: everything after a sum of squares (the normed residual,
  the gated norm, gdn_prep q / k, attn_prep q / k), because Triton sums in another order than torch;
* against FLA's own `l2norm_fwd` (the engine's real reference for q / k) the same bound, printed separately.
Synthetic data: the shares say nothing about model accuracy, only about fidelity to the reference ops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from reference import ops
from reference.shapes import QWEN38_27B, ModelShapes

GPU_ROWS = (1, 7, 63, 65, 277, 1000)
ONE_ULP_MIN_SHARE = 0.9999  # at most 1e-4 of the elements one ulp off (analysis: ~2^-15 per element of a row)

BITWISE = {
    ("silu_mul", "out"),
    ("attention_gate", "out"),
    ("residual_rmsnorm", "new_residual"),
    ("gdn_prep", "v"),
    ("gdn_prep", "beta"),
    ("gdn_prep", "g"),
    ("attn_prep", "v"),
}


# ---------------------------------------------------------------------------------------------------------------------
# Comparison


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bits of a bf16 / fp32 tensor as int64 in the order of the values (±0 both 0), so differences count ulps."""
    if t.dtype == torch.bfloat16:
        bits, magnitude_mask = t.view(torch.int16).to(torch.int64), 0x7FFF
    elif t.dtype == torch.float32:
        bits, magnitude_mask = t.view(torch.int32).to(torch.int64), 0x7FFFFFFF
    else:
        raise TypeError(f"compare: bf16 or fp32 expected, got {t.dtype}")
    magnitude = bits & magnitude_mask
    return torch.where(bits < 0, -magnitude, magnitude)


def compare(kernel: str, output: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    """One row of the table: bit-identical share, max ulp and max |diff| of `got` against `want` (same shape, dtype).
    A NaN left in `got` (an unwritten poisoned element) counts as not identical, with a huge ulp distance."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(
            f"{kernel}.{output}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
        )
    got_bits, want_bits = _ordered(got.contiguous()), _ordered(want.contiguous())
    identical = int((got_bits == want_bits).sum())
    elements = want.numel()
    ulps = (got_bits - want_bits).abs()
    diff = (got.float() - want.float()).abs()
    return {
        "kernel": kernel,
        "output": output,
        "elements": elements,
        "bit_identical": identical,
        "share": identical / max(1, elements),
        "max_ulp": int(ulps.max()) if elements else 0,
        "max_abs_diff": float(diff.nan_to_num(float("inf")).max()) if elements else 0.0,
    }


def format_table(rows: Sequence[dict]) -> str:
    lines = [f"{'kernel':<18} {'output':<13} {'elements':>10} {'bit-identical':>14} {'max ulp':>8} {'max |diff|':>11}"]
    for r in rows:
        lines.append(
            f"{r['kernel']:<18} {r['output']:<13} {r['elements']:>10} {100 * r['share']:>13.4f}% {r['max_ulp']:>8} "
            f"{r['max_abs_diff']:>11.3g}"
        )
    return "\n".join(lines)


def check_rows(rows: Sequence[dict], *, relaxed: Mapping[tuple[str, str], int] | None = None) -> None:
    """Assert the expected exactness of every row: bitwise for BITWISE outputs, else <= 1 ulp with share >= 0.9999.
    `relaxed` maps (kernel, output) to a max ulp that replaces the expectation (CPU-only departures)."""
    relaxed = relaxed or {}
    for r in rows:
        key = (r["kernel"], r["output"])
        label = f"{r['kernel']}.{r['output']}: {100 * r['share']:.4f}% bit-identical, max {r['max_ulp']} ulp"
        if key in relaxed:
            assert r["max_ulp"] <= relaxed[key], label
        elif key in BITWISE:
            assert r["bit_identical"] == r["elements"], label
        else:
            assert r["max_ulp"] <= 1 and r["share"] >= ONE_ULP_MIN_SHARE, label


# ---------------------------------------------------------------------------------------------------------------------
# Reference compositions (reference.ops, one sequence at a time)


def reference_gdn_prep(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    shapes: ModelShapes,
    *,
    qk_l2norm: bool = True,
) -> dict[str, torch.Tensor]:
    """q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv] from reference.ops, sequence by sequence (zero conv history)."""
    hk, hv = shapes.linear_num_key_heads, shapes.linear_num_value_heads
    dk, dv = shapes.linear_key_head_dim, shapes.linear_value_head_dim
    b_column = shapes.conv_dim + shapes.linear_value_dim
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in ("q", "k", "v", "g", "beta")}
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        if start == end:
            continue
        rows = end - start
        mixed = ops.causal_conv1d_silu(proj[start:end, : shapes.conv_dim], conv_weight)
        q, k, v = torch.split(mixed, [shapes.linear_key_dim, shapes.linear_key_dim, shapes.linear_value_dim], dim=-1)
        q, k = q.reshape(rows, hk, dk), k.reshape(rows, hk, dk)
        if qk_l2norm:
            q, k = ops.l2norm_fla(q), ops.l2norm_fla(k)
        b = proj[start:end, b_column : b_column + hv]
        a = proj[start:end, b_column + hv : b_column + 2 * hv]
        g, beta = ops.gdn_gates(a, b, A_log, dt_bias)
        for name, value in zip(parts, (q, k, v.reshape(rows, hv, dv), g, beta)):
            parts[name].append(value)
    return {name: torch.cat(values) for name, values in parts.items()}


def reference_attn_prep(
    proj: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shapes: ModelShapes,
) -> dict[str, torch.Tensor]:
    """q [T, H, D], k, v [T, Hkv, D] and gate [T, H·D] as `reference.ops.attention_mixer` forms them."""
    rows, heads, kv_heads, dim = proj.shape[0], shapes.num_attention_heads, shapes.num_key_value_heads, shapes.head_dim
    eps = shapes.rms_norm_eps
    query, gate = torch.chunk(proj[:, : 2 * heads * dim].reshape(rows, heads, 2 * dim), 2, dim=-1)
    k = proj[:, 2 * heads * dim : (2 * heads + kv_heads) * dim].reshape(rows, kv_heads, dim)
    v = proj[:, (2 * heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
    q = ops.apply_partial_rope(ops.rmsnorm_1p(query, q_norm_weight, eps), cos, sin)
    k = ops.apply_partial_rope(ops.rmsnorm_1p(k, k_norm_weight, eps), cos, sin)
    return {"q": q, "k": k, "v": v, "gate": gate.reshape(rows, heads * dim)}


# ---------------------------------------------------------------------------------------------------------------------
# The table


def _nan(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def _has(activations: Mapping[str, torch.Tensor], *keys: str) -> bool:
    return all(key in activations for key in keys)


def bit_identity_table(
    activations: Mapping[str, torch.Tensor], shapes: ModelShapes, *, kernels: Sequence[str] | None = None
) -> list[dict]:
    """Per-kernel, per-output bit identity of the fused kernels against reference.ops on `activations` (schema in
    the module docstring). `kernels` restricts the run to some of: silu_mul, residual_rmsnorm, gdn_prep,
    gated_rmsnorm, attn_prep, attention_gate. Outputs are NaN-poisoned before each kernel writes them."""
    import kernels as fused  # here, not at module level: collecting this file must not compile or interpret kernels

    wanted = set(kernels) if kernels is not None else None
    run = lambda name, *keys: (wanted is None or name in wanted) and _has(activations, *keys)  # noqa: E731
    eps = shapes.rms_norm_eps
    rows: list[dict] = []
    act = activations

    if run("silu_mul", "mlp_gate_up"):
        gate_up = act["mlp_gate_up"]
        inter = gate_up.shape[1] // 2
        out = fused.silu_mul(gate_up, out=_nan((gate_up.shape[0], inter), torch.bfloat16, gate_up.device))
        rows.append(compare("silu_mul", "out", out, ops.silu_mul(gate_up[:, :inter], gate_up[:, inter:])))

    if run("residual_rmsnorm", "residual", "delta", "norm_weight"):
        residual, delta, weight = act["residual"], act["delta"], act["norm_weight"]
        new_residual, normed = fused.residual_rmsnorm(
            residual,
            delta,
            weight,
            eps,
            out_residual=_nan(residual.shape, torch.bfloat16, residual.device),
            out_normed=_nan(residual.shape, torch.bfloat16, residual.device),
        )
        want_residual, want_normed = ops.residual_rmsnorm(residual, delta, weight, eps)
        rows.append(compare("residual_rmsnorm", "new_residual", new_residual, want_residual))
        rows.append(compare("residual_rmsnorm", "normed", normed, want_normed))

    if run("gdn_prep", "gdn_proj", "conv_weight", "A_log", "dt_bias"):
        proj = act["gdn_proj"]
        tokens, device = proj.shape[0], proj.device
        cu_seqlens = act.get("gdn_cu_seqlens", torch.tensor([0, tokens], dtype=torch.int32, device=device))
        hk, hv = shapes.linear_num_key_heads, shapes.linear_num_value_heads
        dk, dv = shapes.linear_key_head_dim, shapes.linear_value_head_dim
        poisoned = (
            _nan((1, tokens, hk, dk), torch.bfloat16, device),
            _nan((1, tokens, hk, dk), torch.bfloat16, device),
            _nan((1, tokens, hv, dv), torch.bfloat16, device),
            _nan((1, tokens, hv), torch.float32, device),
            _nan((1, tokens, hv), torch.bfloat16, device),
        )
        got = fused.gdn_prep(
            proj,
            act["conv_weight"],
            act["A_log"],
            act["dt_bias"],
            cu_seqlens,
            num_k_heads=hk,
            num_v_heads=hv,
            head_k_dim=dk,
            head_v_dim=dv,
            out=poisoned,
        )
        want = reference_gdn_prep(proj, act["conv_weight"], act["A_log"], act["dt_bias"], cu_seqlens, shapes)
        for name, tensor in zip(("q", "k", "v", "g", "beta"), got):
            rows.append(compare("gdn_prep", name, tensor[0], want[name]))

    if run("gated_rmsnorm", "gdn_core_out", "gdn_proj", "gdn_norm_weight"):
        o, weight = act["gdn_core_out"], act["gdn_norm_weight"]
        tokens, hv, dv = o.shape
        z = act["gdn_proj"][:, shapes.conv_dim : shapes.conv_dim + hv * dv]
        out = fused.gated_rmsnorm(o, z, weight, eps, out=_nan((tokens, hv * dv), torch.bfloat16, o.device))
        want = ops.gated_rmsnorm(o, z.reshape(tokens, hv, dv), weight, eps).reshape(tokens, hv * dv)
        rows.append(compare("gated_rmsnorm", "out", out, want))

    if run("attn_prep", "attn_proj", "q_norm_weight", "k_norm_weight", "cos", "sin"):
        proj = act["attn_proj"]
        tokens, device = proj.shape[0], proj.device
        heads, kv_heads, dim = shapes.num_attention_heads, shapes.num_key_value_heads, shapes.head_dim
        poisoned = (
            _nan((tokens, heads, dim), torch.bfloat16, device),
            _nan((tokens, kv_heads, dim), torch.bfloat16, device),
            _nan((tokens, kv_heads, dim), torch.bfloat16, device),
        )
        q, k, v = fused.attn_prep(
            proj,
            act["q_norm_weight"],
            act["k_norm_weight"],
            act["cos"],
            act["sin"],
            eps,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            out=poisoned,
        )
        want = reference_attn_prep(proj, act["q_norm_weight"], act["k_norm_weight"], act["cos"], act["sin"], shapes)
        for name, tensor in zip("qkv", (q, k, v)):
            rows.append(compare("attn_prep", name, tensor, want[name]))

    if run("attention_gate", "attn_core_out", "attn_proj"):
        attn, proj = act["attn_core_out"], act["attn_proj"]
        tokens, heads, dim = attn.shape
        gate = fused.attention_gate_view(proj, num_heads=heads, head_dim=dim)
        out = fused.attention_gate(attn, gate, out=_nan((tokens, heads * dim), torch.bfloat16, attn.device))
        want = ops.attention_gate(attn.reshape(tokens, heads * dim), gate.reshape(tokens, heads * dim))
        rows.append(compare("attention_gate", "out", out, want))

    return rows


def random_activations(
    shapes: ModelShapes, seq_lens: Sequence[int], device: torch.device | str, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded random activations in the `bit_identity_table` schema, at the scales of the synthetic model
    (unit-RMS projections, residual RMS ~0.5, (1 + w) offsets N(0, 0.1)); `a` is scaled so softplus meets its
    threshold of 20 and its exponential tail, `b` so sigmoid saturates. Packed sequences of `seq_lens` rows."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(seq_lens)

    def normal(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device=device) * std + mean).to(torch.bfloat16)

    hv, heads, dim = shapes.linear_num_value_heads, shapes.num_attention_heads, shapes.head_dim
    gdn_proj = normal(tokens, shapes.gdn_in_width)
    b_column = shapes.conv_dim + shapes.linear_value_dim
    gdn_proj[:, b_column : b_column + hv] = normal(tokens, hv, std=3.0)  # b: sigmoid into saturation
    gdn_proj[:, b_column + hv :] = normal(tokens, hv, std=10.0)  # a: softplus over 20 and deep in its tail
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens]).to(torch.int64)
    cos, sin = ops.rope_cos_sin(positions + 17, shapes.rotary_dim, shapes.rope_theta)
    offsets = torch.tensor([0, *seq_lens], device=device).cumsum(0).to(torch.int32)
    uniform = torch.rand(hv, generator=generator, device=device)
    return {
        "mlp_gate_up": normal(tokens, 2 * shapes.intermediate_size, std=2.0),
        "residual": normal(tokens, shapes.hidden_size, std=0.5),
        "delta": normal(tokens, shapes.hidden_size, std=0.3),
        "norm_weight": normal(shapes.hidden_size, std=0.1),
        "gdn_proj": gdn_proj,
        "gdn_cu_seqlens": offsets,
        "conv_weight": normal(shapes.conv_dim, shapes.linear_conv_kernel_dim, std=0.5),
        "A_log": torch.log(1 + 15 * uniform).to(torch.bfloat16).float(),  # fp32 as stored, bf16-representable
        "dt_bias": normal(hv, std=0.1, mean=1.0),
        "gdn_core_out": normal(tokens, hv, shapes.linear_value_head_dim, std=0.5),
        "gdn_norm_weight": normal(shapes.linear_value_head_dim, std=0.1, mean=1.0).float(),  # fp32 as stored
        "attn_proj": normal(tokens, shapes.attn_in_width),
        "q_norm_weight": normal(dim, std=0.1),
        "k_norm_weight": normal(dim, std=0.1),
        "cos": cos,
        "sin": sin,
        "attn_core_out": normal(tokens, heads, dim, std=0.5),
    }


# ---------------------------------------------------------------------------------------------------------------------
# GPU tests


def _require_compiled_kernels() -> None:
    import triton

    from kernels import activations

    if not isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were defined under TRITON_INTERPRET=1; the GPU tests need them compiled (unset it)")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_bit_identity_27b(rows: int) -> None:
    """Every kernel on one sequence of `rows` tokens at the 27B shapes, against reference.ops on the GPU."""
    _require_compiled_kernels()
    table = bit_identity_table(random_activations(QWEN38_27B, [rows], "cuda", seed=rows), QWEN38_27B)
    print(f"\n27B, {rows} rows\n{format_table(table)}")
    assert len(table) == 13
    check_rows(table)


@pytest.mark.gpu
def test_gpu_packed_sequences_27b() -> None:
    """gdn_prep over packed sequences (an empty one included) restarts the conv history at every sequence start."""
    _require_compiled_kernels()
    lens = [1, 7, 0, 63, 65, 277]
    table = bit_identity_table(random_activations(QWEN38_27B, lens, "cuda", seed=5), QWEN38_27B, kernels=["gdn_prep"])
    print(f"\n27B gdn_prep, packed {lens}\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_gated_rmsnorm_bf16_weight_27b() -> None:
    """The gated norm with a bf16 weight (transformers' from_pretrained(dtype=bf16) casts it): round 2 applies."""
    _require_compiled_kernels()
    act = random_activations(QWEN38_27B, [277], "cuda", seed=11)
    act["gdn_norm_weight"] = act["gdn_norm_weight"].to(torch.bfloat16)
    table = bit_identity_table(act, QWEN38_27B, kernels=["gated_rmsnorm"])
    print(f"\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_qk_l2norm_against_fla_27b() -> None:
    """gdn_prep's fused q/k l2norm against FLA's own l2norm_fwd on the unnormalised conv outputs: the numbers the
    engine's FLA call would otherwise compute inside `chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True)`."""
    _require_compiled_kernels()
    l2norm_fwd = pytest.importorskip("fla.modules.norm.l2norm").l2norm_fwd
    import kernels

    sh = QWEN38_27B
    act = random_activations(sh, [1, 63, 1000], "cuda", seed=3)
    dims = {
        "num_k_heads": sh.linear_num_key_heads,
        "num_v_heads": sh.linear_num_value_heads,
        "head_k_dim": sh.linear_key_head_dim,
        "head_v_dim": sh.linear_value_head_dim,
    }
    args = (act["gdn_proj"], act["conv_weight"], act["A_log"], act["dt_bias"], act["gdn_cu_seqlens"])
    q_raw, k_raw, *_ = kernels.gdn_prep(*args, qk_l2norm=False, **dims)
    q, k, *_ = kernels.gdn_prep(*args, qk_l2norm=True, **dims)
    table = [
        compare("gdn_prep vs FLA", "q", q, l2norm_fwd(q_raw)[0]),
        compare("gdn_prep vs FLA", "k", k, l2norm_fwd(k_raw)[0]),
    ]
    print(f"\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_batch_invariance_27b() -> None:
    """A row's bits do not depend on the other rows of the call (tile shapes are fixed by widths, not row counts):
    residual_rmsnorm and attn_prep on rows 0..R-1 equal the same rows inside a 1000-row call."""
    _require_compiled_kernels()
    import kernels

    sh = QWEN38_27B
    act = random_activations(sh, [1000], "cuda", seed=9)
    dims = {"num_heads": sh.num_attention_heads, "num_kv_heads": sh.num_key_value_heads, "head_dim": sh.head_dim}
    norm_weights = (act["q_norm_weight"], act["k_norm_weight"])
    full = kernels.residual_rmsnorm(act["residual"], act["delta"], act["norm_weight"], sh.rms_norm_eps)[1]
    full_q = kernels.attn_prep(act["attn_proj"], *norm_weights, act["cos"], act["sin"], sh.rms_norm_eps, **dims)[0]
    for count in (1, 7, 277):
        rows = slice(0, count)
        part = kernels.residual_rmsnorm(act["residual"][rows], act["delta"][rows], act["norm_weight"], sh.rms_norm_eps)
        assert torch.equal(part[1].view(torch.int16), full[rows].view(torch.int16)), count
        tables = (act["cos"][rows], act["sin"][rows])
        part_q = kernels.attn_prep(act["attn_proj"][rows], *norm_weights, *tables, sh.rms_norm_eps, **dims)[0]
        assert torch.equal(part_q.view(torch.int16), full_q[rows].view(torch.int16)), count
