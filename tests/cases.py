"""Shared test builders and cases (not a test module: pytest collects `test_*.py` only). A test module imports what
it shares from here, never from another test module.

* `random_activations(shapes, seq_lens, device, seed)`: seeded random activations in the `bit_identity_table` schema
  (`ablations/bit_identity.py`); `gdn_dims(shapes)`: the head counts and sizes `kernels.gdn_prep` takes;
  `check_row_indexed_kernels(...)`: the row-indexed launches against gathered copies, and `check_prep_ways(...)`:
  `measure.prep_probe`'s ways against the kernels over every path slot and key (tests/test_kernels.py on the CPU,
  tests/test_gpu_kernels.py at 27B shapes).
* `gdn_chunk_inputs(...)`, `gdn_chunk_oracle(...)`, `gdn_chunk_bounds(...)`: packed inputs of the fused GDN kernel, the
  fp32 token-by-token oracle per sequence, and the error bounds against it, derived in `gdn_chunk_bounds`
  (tests/test_gdn_chunk.py on the CPU, tests/test_gpu_gdn_chunk.py at 27B shapes).
* `check_bf16_rounding_matches_torch(device)`: `kernels.numerics`' bf16 rounding against torch's conversion,
  interpreted on the CPU (tests/test_kernels.py) and compiled on CUDA (tests/test_gpu_kernels.py).
* `write_tiny_checkpoint(root)`: a tiny-twin base checkpoint and an Open-Jev LoRA package (tests/test_weights.py,
  tests/test_gpu_reference.py); `clone_weights`, `LORA_TARGETS`.
* `counting(function, calls, key)`: a wrapper that counts calls (tests/test_model.py, tests/test_gpu_reference.py).
* `amplification_body()`, `many_candidates_body()`: the two bodies of issue 15 that made the server build gigabytes
  before its 422 (tests/test_service.py, tests/test_server.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import statistics
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from safetensors.torch import save_file

from ablations import records
from kernels import numerics
from reference import ops
from reference.model import build_hf_model
from reference.shapes import TINY, ModelShapes
from reference.weights import synthetic_weights

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj"]

# ---------------------------------------------------------------------------------------------------------------------
# Kernels


# the path lengths of drone's bucket r352-s1074-c8 (empty and one-row dummy paths included), and the GPU GDN cores'
# length sets: that bucket and a 1,000-token sequence beside a short one
DRONE_BUCKET_PATHS = (149, 146, 147, 132, 134, 132, 131, 15, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0)
GDN_LENGTH_SETS = {"drone-bucket": DRONE_BUCKET_PATHS, "long-1000": (1000, 65)}


def gdn_chunk_inputs(lengths, dims, seed: int, device="cpu", correlated: bool = False):
    """Packed inputs of the fused GDN kernel for sequences of `lengths`: (q, k, v, g, beta, cu_seqlens, h0).

    dims = (Hk, Hv, K, V). q/k L2-normalised with FLA's numerics (what the prep kernel hands the core), v random,
    g = -exp(A_log) softplus(a + dt_bias) per value head, beta = sigmoid(b) in bf16, nonzero fp32 initial states.
    `correlated`: keys near one shared direction, beta near 1 and slow decay (a badly conditioned solve)."""
    hk, hv, key_dim, value_dim = dims
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    k_raw = randn(tokens, hk, key_dim)
    if correlated:
        k_raw = 0.3 * k_raw + randn(1, hk, key_dim)
    q = ops.l2norm_fla(randn(tokens, hk, key_dim).bfloat16(), output_dtype=torch.bfloat16)
    k = ops.l2norm_fla(k_raw.bfloat16(), output_dtype=torch.bfloat16)
    v = randn(tokens, hv, value_dim).bfloat16()
    a_log = torch.log(torch.rand(hv, generator=gen, device=device) * 15 + 1)
    g = -torch.exp(a_log) * torch.nn.functional.softplus(randn(tokens, hv) - 4 + randn(hv))
    beta = torch.sigmoid(randn(tokens, hv) + (4.0 if correlated else 0.0)).bfloat16()
    if correlated:
        g = g * 0.05
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64, device=device)
    h0 = 0.5 * randn(len(lengths), hv, key_dim, value_dim)
    return q, k, v, g.float(), beta, cu, h0


def gdn_chunk_oracle(q, k, v, g, beta, cu, h0) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.ops.gdn_recurrent` per sequence: (o [T, Hv, V] fp32, final states [N, Hv, K, V] fp32)."""
    bounds = cu.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, final = ops.gdn_recurrent(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], h0[i])
        outs.append(o)
        finals.append(final)
    return torch.cat(outs), torch.stack(finals)


def engines_27b(specs: dict) -> dict:
    """Engines on one set of 27B synthetic weights (seed 0), held once: name -> `build_engine` of a stage name or a
    config; every engine with a graph cache captures its buckets on first use (a GPU module fixture's body)."""
    from engine.stages import build_engine
    from engine.weights import MergedWeights
    from reference.shapes import QWEN38_27B

    merged = MergedWeights.from_decision_weights(synthetic_weights(QWEN38_27B, seed=0, device="cuda"))
    built = {name: build_engine(merged, spec) for name, spec in specs.items()}
    for engine in built.values():
        if engine.graphs is not None:
            engine.graphs.capture_on_miss = True
    return built


def workload_answer(engine, workload_id: str) -> torch.Tensor:
    """The head's rows of one ladder workload's request through `engine` (a copy)."""
    from ablations.workloads import get_workload
    from reference.service import request_candidates

    candidates, groups = request_candidates(get_workload(workload_id).request)
    return engine.forward(engine.prepare(candidates, groups)).clone()


def gdn_chunk_bounds(key_dim: int, chunks: int) -> dict[str, float]:
    """Relative-RMSE bounds of `kernels.gdn_chunk` against the fp32 oracle, for head dim K and sequences of at most
    `chunks` 64-row chunks, from first-order rounding-error counts (never fitted to a measurement):

    * "fp32" (`bf16_points=False`): each fp32 operation rounds once (u = 2^-24) and a dot of n terms is off by at
      most n·u of the sum of its terms' magnitudes (Higham's γ_n). On the dependency path of one output element:
      dots of n = K (kkt, v' = u - w S, Q S, Q Kᵀ: 4K), of n = 64 (10 solve dots, w, u, the intra-chunk output: 14·64),
      the in-chunk cumsum (64), and per chunk the state update and its use (2·(64 + K) each, at most `chunks`).
      The bound is that count times u, relative to the terms' magnitudes, which for unit q, k, |T| entries, |β| and
      decays <= 1 are of the output's own size. K = 32, 3 chunks: 1,664 u = 9.9e-5.
    * "bf16" (FLA's rounding points): each bf16↓ perturbs its tensor by at most u = 2^-8 relatively. On the path of one
      output: o, the causal Q Kᵀ block, the stored v', the bf16 state Sb, u, w, T, V β and K β (twice) in its own
      chunk (10), and each earlier chunk's decayed v' and Sb (2 per chunk). To first order with unit amplification:
      (10 + 2·(chunks - 1))·u; 3 chunks: 0.055. (FLA's chunk test allows 5e-3 in fp16, whose u is 8x smaller.)
    """
    fp32_terms = 4 * key_dim + 14 * 64 + 64 + 2 * chunks * (64 + key_dim)
    return {"fp32": fp32_terms * 2.0**-24, "bf16": (10 + 2 * (chunks - 1)) * 2.0**-8}


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


def gdn_dims(shapes: ModelShapes) -> dict[str, int]:
    """The head counts and sizes `kernels.gdn_prep` takes, of a model's shapes."""
    return {
        "num_k_heads": shapes.linear_num_key_heads,
        "num_v_heads": shapes.linear_num_value_heads,
        "head_k_dim": shapes.linear_key_head_dim,
        "head_v_dim": shapes.linear_value_head_dim,
    }


@triton.jit
def _bf16_rounding_kernel(x_ptr, rounded_ptr, widened_ptr, n, BLOCK: tl.constexpr):
    """`numerics.to_bf16` (bf16) and `numerics.round_to_bf16` (its value as fp32) of n fp32 values."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(rounded_ptr + offsets, numerics.to_bf16(x), mask=offsets < n)
    tl.store(widened_ptr + offsets, numerics.round_to_bf16(x), mask=offsets < n)


def check_bf16_rounding_matches_torch(device: str) -> None:
    """`kernels.numerics.to_bf16` and `round_to_bf16` equal torch's fp32 -> bf16 conversion on `device` (nearest, ties
    to even) on 2^16 random bit patterns, 4,096 exact ties, ±0, ±inf, NaN, subnormals, values that carry into the
    exponent and the largest finite values (which overflow to inf); NaN compares as NaN (payloads are not claimed).
    On the CPU the kernel runs interpreted (bit arithmetic), on CUDA compiled (the hardware conversion)."""
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=generator, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(-(2**15), 2**15, (4096,), generator=generator) * 65536 + 0x8000).to(torch.int32)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0 + 2**-8, 255.99],
        dtype=torch.float32,
    )
    x = torch.cat([random_bits.view(torch.float32), ties.view(torch.float32), special]).to(device)
    rounded = torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=device)
    widened = torch.full(x.shape, float("nan"), dtype=torch.float32, device=device)
    _bf16_rounding_kernel[(triton.cdiv(x.numel(), 4096),)](x, rounded, widened, x.numel(), BLOCK=4096)
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(rounded.isnan(), nan) and torch.equal(widened.isnan(), nan)
    assert torch.equal(rounded[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(widened[~nan].view(torch.int32), want[~nan].float().view(torch.int32))


def every_bf16(device: torch.device | str) -> torch.Tensor:
    """The 65,536 bf16 bit patterns (±0, subnormals, ±inf and NaNs included), in bit order, as a bf16 tensor."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(device)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor, what: str) -> None:
    """Every element's bits equal, NaN where the other is NaN (payloads are not claimed); the message names inputs."""
    got, want, inputs = got.flatten(), want.flatten(), inputs.flatten()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN at other elements, inputs {inputs[got.isnan() != nan][:8]}"
    differ = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not differ.any(), f"{what}: {int(differ.sum())} elements differ from torch, inputs {inputs[differ][:8]}"


def check_gates_on_every_bf16_input(shapes: ModelShapes, device: str) -> None:
    """The rounded gates of `kernels.numerics` (`silu_bf16`, `sigmoid_bf16`) inside the kernels that call them, on every
    bf16 input, against torch on `device`, bit for bit (NaN as NaN): silu_mul's silu (gate = every pattern, up = 1, so
    the output is the rounded silu itself) against `F.silu`; attention_gate's sigmoid (attn = 1) against
    `torch.sigmoid`; gdn_prep's v (every row a sequence of its own and the conv's last tap 1, the others 0, so the conv
    is the input itself: -0 left out, which the conv's sum turns into +0) against `F.silu`, and its beta (b = every k-th
    pattern, as many as the rows hold: beta is `sigmoid_bf16` as attention_gate's) against `torch.sigmoid`. Compiled
    (CUDA) this is the proof of the gates' fast path: the inputs are bf16 values, so 2^16 cases are all of them.
    Interpreted (CPU) it checks the exact path, which is all the interpreter runs."""
    import kernels

    x = every_bf16(device)
    silu, sigmoid = torch.nn.functional.silu(x), torch.sigmoid(x)
    ones = torch.ones_like(x)
    columns = 1024
    gate_up = torch.cat([x.view(-1, columns), ones.view(-1, columns)], dim=1)
    _assert_bitwise(kernels.silu_mul(gate_up), silu, x, "silu_mul's silu")
    _assert_bitwise(kernels.attention_gate(ones.view(-1, columns), x.view(-1, columns)), sigmoid, x,
                    "attention_gate's sigmoid")  # fmt: skip
    dims = gdn_dims(shapes)
    hv, value_width = dims["num_v_heads"], dims["num_v_heads"] * dims["head_v_dim"]
    rows = math.ceil(x.numel() / value_width)
    generator = torch.Generator(device=device).manual_seed(11)
    proj = torch.randn(rows, shapes.gdn_in_width, generator=generator, device=device).to(torch.bfloat16)
    v_patterns = torch.where(x.view(torch.int16) == -(2**15), torch.zeros_like(x), x)  # -0: the conv gives +0
    v_column, b_column = shapes.conv_dim - value_width, shapes.conv_dim + shapes.linear_value_dim
    proj[:, v_column : shapes.conv_dim] = v_patterns.repeat(2)[: rows * value_width].view(rows, value_width)
    proj[:, b_column : b_column + hv] = x[:: x.numel() // (rows * hv)][: rows * hv].view(rows, hv)
    conv_weight = torch.zeros(shapes.conv_dim, shapes.linear_conv_kernel_dim, dtype=torch.bfloat16, device=device)
    conv_weight[:, -1] = 1.0
    zeros, sequence_starts = torch.zeros(hv, device=device), torch.arange(rows + 1, device=device)
    _, _, v, _, beta = kernels.gdn_prep(proj, conv_weight, zeros, zeros, sequence_starts, **dims)
    v_inputs, b_inputs = proj[:, v_column : shapes.conv_dim], proj[:, b_column : b_column + hv]
    _assert_bitwise(v, torch.nn.functional.silu(v_inputs), v_inputs, "gdn_prep's v")
    _assert_bitwise(beta, torch.sigmoid(b_inputs), b_inputs, "gdn_prep's beta")


def check_row_indexed_kernels(
    shapes: ModelShapes,
    device: str,
    *,
    source_rows: int,
    path_lens: Sequence[int],
    out_rows: int,
    keys: int,
    seed: int,
    index_dtype: torch.dtype,
) -> None:
    """gdn_prep through `rows` (and at output `slots`, and from the slots' windows as `taps`), gated_rmsnorm through
    `o_rows` and attn_prep through `key_rows` (the prefix tree's paths, read without a gather) against the same kernels
    on index_select-gathered copies: bit for bit, every output written (NaN-poisoned `out`). Random indices with
    repeats; the paths (packed as `path_lens`, an empty one allowed) and the keys may be longer than the `source_rows`
    they index, the `out_rows` shorter."""
    import kernels

    act = random_activations(shapes, [source_rows], device, seed=seed)
    generator = torch.Generator(device=device).manual_seed(seed)

    def index(count: int) -> torch.Tensor:
        return torch.randint(0, source_rows, (count,), generator=generator, device=device).to(index_dtype)

    rows = index(sum(path_lens))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(path_lens)], dtype=torch.int32, device=device)
    args = (act["conv_weight"], act["A_log"], act["dt_bias"], cu_seqlens)
    gathered = kernels.gdn_prep(act["gdn_proj"].index_select(0, rows), *args, **gdn_dims(shapes))
    poisoned = tuple(torch.full_like(t, float("nan")) for t in gathered)
    indexed = kernels.gdn_prep(act["gdn_proj"], *args, rows=rows, out=poisoned, **gdn_dims(shapes))
    for name, got, want in zip("q k v g beta".split(), indexed, gathered):
        assert not got.isnan().any() and torch.equal(got, want), name
    slots = torch.randint(0, len(rows), (out_rows,), generator=generator, device=device).to(index_dtype)
    slots[-1] = len(rows) - 1  # the last conv-input row; random ones (with repeats) before it
    poisoned = tuple(
        torch.full((1, out_rows, *t.shape[2:]), float("nan"), dtype=t.dtype, device=device) for t in gathered
    )
    at_slots = kernels.gdn_prep(act["gdn_proj"], *args, rows=rows, slots=slots, out=poisoned, **gdn_dims(shapes))
    for name, got, want in zip("q k v g beta".split(), at_slots, gathered):  # each slot's row, its own history
        assert not got.isnan().any() and torch.equal(got, want[:, slots.long()]), f"{name} at slots"
    # the same rows from their windows given as proj rows (`taps`); before a sequence's start: -1 or source_rows
    start = cu_seqlens.long()[torch.searchsorted(cu_seqlens.long(), slots.long(), right=True) - 1]
    history = act["conv_weight"].shape[1] - 1
    window = slots.long()[:, None] - torch.arange(history, -1, -1, device=device)  # oldest first
    outside = torch.where(torch.arange(out_rows, device=device) % 2 == 0, -1, source_rows)[:, None]
    taps = torch.where(window >= start[:, None], rows.long()[window.clamp(min=0)], outside).to(index_dtype)
    assert history == 3 and (taps < 0).any() and (taps == source_rows).any()
    poisoned = tuple(torch.full_like(t, float("nan")) for t in at_slots)
    tapped = kernels.gdn_prep(act["gdn_proj"], *args[:3], None, taps=taps, out=poisoned, **gdn_dims(shapes))
    for name, got, want in zip("q k v g beta".split(), tapped, at_slots):
        assert not got.isnan().any() and torch.equal(got, want), f"{name} from taps"

    o, weight = act["gdn_core_out"], act["gdn_norm_weight"]  # o [source_rows, Hv, V]
    z = act["gdn_proj"][:out_rows, shapes.conv_dim : shapes.conv_dim + shapes.linear_value_dim]  # row-strided slice
    o_rows = index(out_rows)
    want = kernels.gated_rmsnorm(o.index_select(0, o_rows), z, weight, shapes.rms_norm_eps)
    out = torch.full_like(want, float("nan"))
    got = kernels.gated_rmsnorm(o, z, weight, shapes.rms_norm_eps, o_rows=o_rows, out=out)
    assert got is out and not got.isnan().any() and torch.equal(got, want)

    key_rows = index(keys)
    prep_args = (act["attn_proj"], act["q_norm_weight"], act["k_norm_weight"], act["cos"], act["sin"])
    heads = {"num_heads": shapes.num_attention_heads, "num_kv_heads": shapes.num_key_value_heads}
    prep_dims = heads | {"head_dim": shapes.head_dim}
    q_full, k_full, v_full = kernels.attn_prep(*prep_args, shapes.rms_norm_eps, **prep_dims)
    sizes = (q_full.shape, (keys, *k_full.shape[1:]), (keys, *v_full.shape[1:]))
    poisoned = tuple(torch.full(size, float("nan"), dtype=torch.bfloat16, device=device) for size in sizes)
    q, k, v = kernels.attn_prep(*prep_args, shapes.rms_norm_eps, key_rows=key_rows, out=poisoned, **prep_dims)
    assert not any(t.isnan().any() for t in (q, k, v))
    assert torch.equal(q, q_full) and torch.equal(k, k_full[key_rows]) and torch.equal(v, v_full[key_rows])


def check_prep_ways(workload_id: str, shapes: ModelShapes, device: str) -> None:
    """`measure.prep_probe`'s ways on the workload's bucketed plan (moved to `device`) at `shapes`: each way that
    prepares a packed row once (gdn_prep from the plan's `conv_taps` and at `plan.row_slot`, each then gathered;
    attn_prep over the rows, then gathered at the key rows) equals the kernel over every path slot and key entry (the
    first way), bit for bit on the real candidates' slots and keys, and writes no NaN."""
    from ablations.probes import equal_share
    from measure.prep_probe import bucketed_plan, prep_ways

    host, layout = bucketed_plan(workload_id)
    plan = host.to(device)
    assert len(plan.conv_paths.rows) > plan.num_rows  # shared rows: the ways differ in work
    for kernel, (ways, pairs) in prep_ways(plan, layout, shapes).items():
        every_slot, *once = (fn() for fn in ways.values())
        assert len(once) == (2 if kernel == "gdn_prep" else 1), kernel
        for outputs in once:
            assert not any(t.isnan().any() for t in outputs), kernel
            shares = [equal_share(a, b) for a, b in pairs(every_slot, outputs)]
            assert shares == [1.0] * len(shares), (kernel, shares)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints


def clone_weights(weights):
    return dataclasses.replace(weights, backbone={k: v.clone() for k, v in weights.backbone.items()})


def _write_base(base_dir, weights) -> None:
    """Two safetensors shards with the multimodal key prefix plus non-backbone tensors, an index and a config.json."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    base_dir.mkdir()
    Qwen3_5Config(text_config=TINY.to_hf_config().to_dict()).save_pretrained(base_dir)
    names = list(weights.backbone)
    shards = {
        "model-00001-of-00002.safetensors": {f"model.language_model.{n}": weights.backbone[n] for n in names[:40]},
        "model-00002-of-00002.safetensors": {f"model.language_model.{n}": weights.backbone[n] for n in names[40:]},
    }
    shards["model-00002-of-00002.safetensors"] |= {
        "lm_head.weight": torch.ones(4, TINY.hidden_size, dtype=torch.bfloat16),
        "model.visual.patch_embed.proj.weight": torch.ones(3, dtype=torch.bfloat16),
        "mtp.fc.weight": torch.ones(2, dtype=torch.bfloat16),
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, base_dir / file)
        weight_map |= dict.fromkeys(tensors, file)
    (base_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_package(package_dir, base) -> None:
    """model.json, temperature.json, head.pt and a PEFT LoRA adapter (non-zero B) trained on nothing."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    package_dir.mkdir()
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    with torch.random.fork_rng():
        torch.manual_seed(5)  # PEFT draws A from the global generator
        peft_model = get_peft_model(build_hf_model(clone_weights(base)), config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):  # PEFT starts B at zero; make s·B@A about 10% of W (in std)
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                std = 0.1 * module.get_base_layer().weight.float().std() / (2 * math.sqrt(8) * a.std())
                b.copy_(torch.randn(b.shape, generator=generator) * std)
    peft_model.save_pretrained(package_dir / "adapter")
    head = torch.nn.Linear(TINY.hidden_size, 1, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) / math.sqrt(TINY.hidden_size))
        head.bias.fill_(0.25)
    torch.save(head.state_dict(), package_dir / "head.pt")
    (package_dir / "temperature.json").write_text(json.dumps({"temperature": 1.75}))
    meta = {
        "model_id": "jevlab/tiny-twin",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "max_length": 4096,
        "lora_rank": 8,
        "method": "independent_candidate_lora_nll_brier",
    }
    (package_dir / "model.json").write_text(json.dumps(meta))


def write_tiny_checkpoint(root) -> dict:
    """A tiny-twin base checkpoint and an Open-Jev package on it under `root` (also used by the GPU tests)."""
    base = synthetic_weights(TINY, seed=3)
    _write_base(root / "base", base)
    _write_package(root / "package", base)
    return {"base": base, "base_dir": root / "base", "package_dir": root / "package"}


# ---------------------------------------------------------------------------------------------------------------------
# Call counting


def counting(function, calls: dict, key: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return function(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------------------------------
# Run records (ablations/records.py): numbers made up for the schema tests only


def small_record(**changes) -> dict:
    """A valid complete record of one timed stage on one workload (numbers made up for the schema test only)."""
    samples = [10.5, 10.0, 11.25, 10.25, 12.0]
    record = {
        "schema": records.SCHEMA,
        "complete": True,
        "plan": {"name": "cpu-tiny", "device": "cpu", "shapes": "tiny", "reference": "hf_torch",
                 "baseline": "hf_torch", "headline": "drone", "timer": "perf-counter", "warmup": 1, "runs": 5},
        "env": {"gpu": None, "driver": None, "torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": None,
                "git_commit": "0123456789abcdef", "git_dirty": False, "utc": "2026-11-30T10:00:00Z", "device": "cpu"},
        "weights": {"synthetic": True, "method": "synthetic_weights", "linear_params": 2_057_216},
        "ceilings": {"copy_tbps": 0.01, "bf16_tflops": 0.1},
        "workloads": [{"id": "drone", "questions": 3, "candidates": 7, "tokens": 971}],
        "stages": [{
            "name": "hf_torch", "status": "ok", "reason": None,
            "gate": {"node": "tests/test_x.py::test_y", "outcome": "green", "exit_code": 0},
            "workloads": [{"id": "drone", "rows": 971, "median_ms": statistics.median(samples),
                           "p10_ms": float(np.percentile(samples, 10)), "p90_ms": float(np.percentile(samples, 90)),
                           "samples_ms": samples, "kernels_per_forward": None, "gpu_busy_ms": None, "floor_ms": 1.5,
                           "max_abs_dp": 0.0, "hidden_rel_rmse": 0.0}],
        }],
        "attempts": [],
    }  # fmt: skip
    record.update(changes)
    return record


def first_stage(record: dict) -> dict:
    return record["stages"][0]


def first_timed(record: dict) -> dict:
    return record["stages"][0]["workloads"][0]


def bit_identity_result(**changes) -> dict:
    """A `record["bit_identity"]` of two rows (numbers made up for the schema tests only)."""
    rows = [
        {"layer": 0, "kernel": "silu_mul", "output": "out", "elements": 1000, "bit_identical": 1000, "share": 1.0,
         "max_ulp": 0, "max_abs_diff": 0.0, "unwritten": 0, "expected": "bitwise", "as_expected": True},
        {"layer": 3, "kernel": "attn_prep", "output": "q", "elements": 1000, "bit_identical": 999, "share": 0.999,
         "max_ulp": 1, "max_abs_diff": 4.9e-4, "unwritten": 0, "expected": "<= 1 ulp in >= 99.99 %",
         "as_expected": False},
    ]  # fmt: skip
    result = {"workload": "drone", "reference": "hf_torch", "candidates": 7, "tokens": 971, "interpreter": True,
              "layers": [{"index": 0, "type": "linear_attention"}, {"index": 3, "type": "full_attention"}],
              "note": "CPU: interpreter", "error": None, "seconds": 1.0, "rows": rows}  # fmt: skip
    result.update(changes)
    return result
