"""The engine backbone: the Qwen3.5 hybrid over packed rows with merged weights (stages `merged` and `fused`).

Layout. `prepare` packs every candidate's tokens back to back into rows `[T]` (no padding), with `cu_seqlens` (the
row where each candidate starts, int64 for FLA and int32 for our kernels), positions restarting at 0 per candidate and
the row of each candidate's last token. Rows are grouped into batches of at most `max_batch_rows` (a candidate is
never split), because the attention mask below grows with the square of a batch's rows.

Forward, per batch (`T` rows, `H` hidden; the attention mask and the RoPE tables are built in `prepare`):
```
x = embed[ids]                                         [T, H]
residual, normed = x, rmsnorm_1p(x)                    (input norm of layer 0)
per layer:
    proj = normed @ w_inᵀ                              one merged GEMM, [T, gdn_in_width] or [T, attn_in_width]
    GDN:  conv+SiLU per candidate -> q, k, v; g, beta; GDN core (varlen); gated RMSNorm with z; out_proj
    attn: q/k RMSNorm, partial RoPE, q/gate split; block-diagonal causal SDPA; sigmoid gate; o_proj
    residual, normed = residual + mixer_out, rmsnorm_1p(.)           (post-attention norm)
    m = silu_mul(normed @ w_gate_upᵀ); d = m @ w_downᵀ
    residual, normed = residual + d, rmsnorm_1p(.)                    (next layer's input norm, or the final norm)
return normed[last rows]                               [C, H]
```

Stages. `merged` (`fused=False`) runs every element-wise op as the reference composition of `reference/ops.py`, so each
op has HF's rounding points; only the GEMM grouping and the row layout differ from HF. `fused` (`fused=True`) runs
the Triton kernels of `kernels/` instead (residual add + RMSNorm, SiLU·mul, GDN input prep, gated RMSNorm, attention
prep, attention gate); each kernel states its exactness against the op it replaces.

GDN core (`gdn_core`, default by device):
* `"fla"` (CUDA default): FLA 0.6.0 `chunk_gated_delta_rule` over all rows at once with `cu_seqlens` (chunks restart at
  each candidate, so the chunk grid is the unpadded one) and precomputed `chunk_indices` (no host sync). Backend
  dispatch is pinned off (`reference.model` sets the FLA switches; checked at construction). q/k are L2-normalised
  with FLA's `l2norm_fwd` numerics: inside FLA (`use_qk_l2norm_in_kernel=True`) in `merged`, by the prep kernel in
  `fused`. This is the `hf_fla` numerics.
* `"torch"` (CPU default): HF's torch `torch_chunk_gated_delta_rule` (`reference.ops.gdn_core_torch`), one call per
  candidate, q/k normalised inside in fp32. This is the `hf_torch` numerics. It exists because FLA's chunk kernel is
  wrong for bf16 inputs under the Triton interpreter (reference-math.md §6): on the CPU the engine runs the GDN core
  in torch, not FLA.

Attention core: one `scaled_dot_product_attention` call per attention layer over all rows of the batch, with an
additive bf16 block-diagonal causal mask (0 where a row may see a key of its own candidate at or before it, -inf
elsewhere; built once in `prepare`) and k/v repeated to the query heads (as HF's `repeat_kv` does when it passes a
mask). One launch per layer (per-candidate calls would cost C launches), exact in real arithmetic; but the kernel's
tiling over keys differs from HF's padded batch (whose own layout depends on the batch's longest candidate), so the
output can differ from HF's by a few bf16 ulps on some rows: on the CPU this is the first op where `merged` departs
from `hf_torch` (tests/test_engine.py). The same mask shape generalises to the prefix tree. Cost: the kernel visits
all T x T key tiles, most of them fully masked.

Exactness of `merged` against `hf_torch` on the CPU (tiny twin, measured in tests/test_engine.py): merged GEMMs,
packed conv and per-candidate torch core are bitwise, so every state before the first attention layer is
bit-identical; from the attention SDPA on, relative RMSE per residual state is bounded there. On the GPU (27B,
tests/test_gpu_engine.py) cuBLAS may pick other algorithms for the merged widths and row counts than for HF's
separate, padded GEMMs, so `merged` vs `hf_fla` is measured and bounded, not assumed bitwise.

NVTX. With `nvtx_ranges=True`, each layer and each op family (`norm`, `in_proj`, `gdn_prep`, `gdn_core`,
`gated_norm`, `out_proj`, `attn_prep`, `attention`, `attn_gate`, `mlp`, ...) is an NVTX range (the `nvtx` package if
it imports, else `torch.cuda.nvtx` where CUDA is present); with the default `False` a shared no-op context is entered,
nothing else.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from engine.weights import AttentionLayerWeights, GDNLayerWeights, MergedWeights
from reference import ops
from reference.model import fla_settings
from reference.shapes import ModelShapes

GDN_CORES = ("fla", "torch")
FLA_CHUNK = 64  # FLA's chunk size for chunk_gated_delta_rule (its default)
MASK_ALIGN = 8  # attention-mask rows padded to 8 bf16 (16 bytes), as the CUDA SDPA kernels want


# ---------------------------------------------------------------------------------------------------------------------
# Layout


@dataclass
class PackedBatch:
    """Consecutive candidates packed into rows; every tensor on the device (host copies marked)."""

    lengths: tuple[int, ...]  # host: tokens per candidate
    token_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64, 0..len-1 per candidate
    cu_seqlens: Tensor  # [N + 1] int64: first row of each candidate, then T (FLA's varlen convention)
    cu_seqlens_i32: Tensor  # [N + 1] int32, the same (for the kernels)
    chunk_indices: Tensor  # [chunks, 2] int64: (candidate, chunk within it) per 64-row FLA chunk
    last_rows: Tensor  # [N] int64: the row of each candidate's last token
    conv_rows: Tensor  # [T + (W-1) N] int64: rows of [0 | proj] for the conv, W-1 zero rows (index 0) before each
    conv_keep: Tensor  # [T] int64: the conv-layout row of each packed row
    attn_mask: Tensor  # [1, 1, T, T] bf16 additive (0 / -inf), block-diagonal causal; 16-byte aligned rows
    rope_cos: Tensor  # [T, rotary_dim] bf16 RoPE tables at each row's position (`reference.ops.rope_cos_sin`)
    rope_sin: Tensor  # [T, rotary_dim] bf16

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Host (start, end) rows of each candidate."""
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n)
        return list(zip(starts[:-1], starts[1:]))


@dataclass
class PackedRows:
    """A request's candidates in batches, in candidate order."""

    batches: list[PackedBatch]
    num_candidates: int


def pack_batch(candidates: Sequence[Sequence[int]], shapes: ModelShapes, device: torch.device) -> PackedBatch:
    """Pack candidates (token id lists) into one batch: host arithmetic, one host-to-device copy, then the mask and
    the RoPE tables on the device (they depend on the layout only, so no forward recomputes them)."""
    lengths = [len(ids) for ids in candidates]
    num_rows, num_cands = sum(lengths), len(lengths)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(lengths_t, 0) - lengths_t  # [N]
    cu_seqlens = torch.cat([starts, torch.tensor([num_rows])])  # [N + 1]
    candidate_of_row = torch.repeat_interleave(torch.arange(num_cands), lengths_t)  # [T]
    positions = torch.arange(num_rows) - starts[candidate_of_row]
    chunks = [(c, j) for c, n in enumerate(lengths) for j in range(math.ceil(n / FLA_CHUNK))]
    chunk_indices = torch.tensor(chunks, dtype=torch.int64)  # [chunks, 2]
    # Conv layout: before each candidate W-1 zero rows, so each candidate's conv sees zero history, as alone.
    history = shapes.linear_conv_kernel_dim - 1
    conv_starts = starts + history * torch.arange(1, num_cands + 1)  # first conv-layout row of each candidate
    conv_keep = conv_starts[candidate_of_row] + positions  # [T]
    conv_rows = torch.zeros(num_rows + history * num_cands, dtype=torch.int64)
    conv_rows[conv_keep] = torch.arange(1, num_rows + 1)  # row r of proj is row r + 1 of [0 | proj]

    token_ids = torch.tensor([i for ids in candidates for i in ids], dtype=torch.int64)
    last_rows = cu_seqlens[1:] - 1
    chunk_indices = chunk_indices.flatten()
    parts = [token_ids, positions, cu_seqlens, last_rows, chunk_indices, conv_rows, conv_keep, candidate_of_row]
    flat = torch.cat(parts).to(device)  # the one host-to-device copy
    token_ids, positions, cu_seqlens, last_rows, chunk_indices, conv_rows, conv_keep, candidate_of_row = torch.split(
        flat, [p.numel() for p in parts]
    )

    padded = math.ceil(num_rows / MASK_ALIGN) * MASK_ALIGN
    rows = torch.arange(num_rows, device=device)
    visible = (candidate_of_row[:, None] == candidate_of_row[None, :]) & (rows[:, None] >= rows[None, :])  # [T, T]
    mask = torch.full((num_rows, padded), float("-inf"), dtype=torch.bfloat16, device=device)
    mask[:, :num_rows].masked_fill_(visible, 0.0)
    cos, sin = ops.rope_cos_sin(positions, shapes.rotary_dim, shapes.rope_theta, dtype=torch.bfloat16)
    return PackedBatch(
        lengths=tuple(lengths),
        token_ids=token_ids,
        positions=positions,
        cu_seqlens=cu_seqlens,
        cu_seqlens_i32=cu_seqlens.to(torch.int32),
        chunk_indices=chunk_indices.view(-1, 2),
        last_rows=last_rows,
        conv_rows=conv_rows,
        conv_keep=conv_keep,
        attn_mask=mask[:, :num_rows][None, None],
        rope_cos=cos,
        rope_sin=sin,
    )


# ---------------------------------------------------------------------------------------------------------------------
# NVTX ranges


class _Ranges:
    """`ranges(name)` -> an NVTX range context when enabled, else one shared no-op context (no allocation)."""

    def __init__(self, enabled: bool):
        self._off = contextlib.nullcontext()
        self._open: Callable[[str], contextlib.AbstractContextManager] | None = None
        if not enabled:
            return
        try:
            import nvtx

            self._open = lambda name: nvtx.annotate(name, domain="jevlab")
        except ImportError:
            if torch.cuda.is_available():
                self._open = torch.cuda.nvtx.range

    def __call__(self, name: str) -> contextlib.AbstractContextManager:
        return self._off if self._open is None else self._open(name)


# ---------------------------------------------------------------------------------------------------------------------
# GDN cores: (q, k, v, g, beta) of all rows -> o [T, Hv, V] bf16


def _fla_chunk_function() -> Callable:
    """FLA 0.6.0's Triton `chunk_gated_delta_rule`, with any backend-dispatch wrapper peeled off."""
    settings = fla_settings()
    dispatch_live = not settings["dispatch_disabled"]
    if dispatch_live and (settings["FLA_FLASH_QLA"] != "0" or settings["FLA_INTRACARD_CP"] not in (None, "0")):
        raise RuntimeError(
            f"FLA backend dispatch could pick FlashQLA or intra-card CP ({settings}); set FLA_FLASH_QLA=0 and leave "
            "FLA_INTRACARD_CP unset, or set FLA_DISABLE_BACKEND_DISPATCH=1 before anything imports fla"
        )
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return inspect.unwrap(chunk_gated_delta_rule)


def _gdn_core_fla(chunk_rule, q, k, v, g, beta, batch: PackedBatch, qk_normalised: bool) -> Tensor:
    """FLA varlen over all candidates at once. q, k [T, Hk, K] bf16; v [T, Hv, V]; g fp32, beta bf16 [T, Hv]."""
    o, _ = chunk_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        output_final_state=False,
        use_qk_l2norm_in_kernel=not qk_normalised,
        cu_seqlens=batch.cu_seqlens,
        chunk_indices=batch.chunk_indices,
    )
    return o[0]


def _gdn_core_torch(q, k, v, g, beta, batch: PackedBatch) -> Tensor:
    """HF's torch chunk rule, one call per candidate (it ignores cu_seqlens); q/k raw, normalised inside in fp32."""
    return torch.cat([ops.gdn_core_torch(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e])[0] for s, e in batch.bounds])


# ---------------------------------------------------------------------------------------------------------------------
# Element-wise stages: reference compositions (merged) and kernels (fused), one interface
#
#   residual_rmsnorm(residual [T, H], delta [T, H] | None, weight [H]) -> (new residual, normed) [T, H]
#   silu_mul(gate_up [T, 2I]) -> [T, I]
#   gdn_prep(proj [T, gdn_in_width], layer, batch) -> q, k [T, Hk, K], v [T, Hv, V] bf16; g fp32, beta bf16 [T, Hv];
#       z [T, Hv V] (a view of proj); q/k L2-normalised (FLA numerics) iff `qk_normalised`
#   gated_rmsnorm(o [T, Hv, V] contiguous, z [T, Hv V], weight [V]) -> [T, Hv V]
#   attn_prep(proj [T, attn_in_width], layer, cos, sin [T, r]) -> q [Hq, T, D], k, v [Hkv, T, D] (q/k normed and
#       roped), gate (whatever attention_gate takes)
#   attention_gate(attn [T, Hq, D], gate) -> [T, Hq D]


class _ReferenceOps:
    """The `merged` stage: `reference/ops.py` compositions, HF's rounding points."""

    qk_normalised = False  # q/k leave gdn_prep raw; the GDN core normalises them (FLA in-kernel, or torch in fp32)

    def __init__(self, shapes: ModelShapes):
        self.shapes = shapes

    def residual_rmsnorm(self, residual: Tensor, delta: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        return ops.residual_rmsnorm(residual, delta, weight, self.shapes.rms_norm_eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return ops.silu_mul(gate, up)

    def gdn_prep(self, proj: Tensor, layer: GDNLayerWeights, batch: PackedBatch):
        """Conv + SiLU over the conv layout (W-1 zero rows before each candidate: zero history), split, gates."""
        s = self.shapes
        t, hv = proj.shape[0], s.linear_num_value_heads
        qkv, z, b, a = proj.split([s.conv_dim, s.linear_value_dim, hv, hv], -1)
        spaced = F.pad(qkv, (0, 0, 1, 0)).index_select(0, batch.conv_rows)  # [T + (W-1) N, conv_dim]
        conv = ops.causal_conv1d_silu(spaced, layer.conv_weight).index_select(0, batch.conv_keep)  # [T, conv_dim]
        q, k, v = conv.split([s.linear_key_dim, s.linear_key_dim, s.linear_value_dim], -1)
        g, beta = ops.gdn_gates(a, b, layer.A_log, layer.dt_bias)
        q = q.view(t, s.linear_num_key_heads, s.linear_key_head_dim)
        k = k.view(t, s.linear_num_key_heads, s.linear_key_head_dim)
        return q, k, v.view(t, hv, s.linear_value_head_dim), g, beta, z

    def gated_rmsnorm(self, o: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        return ops.gated_rmsnorm(o, z.view(o.shape), weight, self.shapes.rms_norm_eps).flatten(1)

    def attn_prep(self, proj: Tensor, layer: AttentionLayerWeights, cos: Tensor, sin: Tensor):
        s = self.shapes
        t, hq, hkv, d = proj.shape[0], s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q_gate, k, v = proj.split([2 * hq * d, hkv * d, hkv * d], -1)
        query, gate = q_gate.view(t, hq, 2 * d).chunk(2, dim=-1)
        q = ops.apply_partial_rope(ops.rmsnorm_1p(query, layer.q_norm, s.rms_norm_eps), cos, sin)
        k = ops.apply_partial_rope(ops.rmsnorm_1p(k.view(t, hkv, d), layer.k_norm, s.rms_norm_eps), cos, sin)
        heads_first = (x.transpose(0, 1) for x in (q, k, v.view(t, hkv, d)))
        return *heads_first, gate.reshape(t, hq * d)

    def attention_gate(self, attn: Tensor, gate: Tensor) -> Tensor:
        return ops.attention_gate(attn.reshape(gate.shape), gate)


class _FusedOps:
    """The `fused` stage: the Triton kernels of `kernels/` (exactness per kernel in `kernels/__init__.py`)."""

    def __init__(self, shapes: ModelShapes, gdn_core: str):
        self.shapes = shapes
        # FLA takes q/k normalised by the prep kernel (its l2norm numerics); the torch core normalises in fp32 itself.
        self.qk_normalised = gdn_core == "fla"

    def residual_rmsnorm(self, residual: Tensor, delta: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        return kernels.residual_rmsnorm(residual, delta, weight, self.shapes.rms_norm_eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return kernels.silu_mul(gate_up)

    def gdn_prep(self, proj: Tensor, layer: GDNLayerWeights, batch: PackedBatch):
        s = self.shapes
        q, k, v, g, beta = kernels.gdn_prep(
            proj,
            layer.conv_weight,
            layer.A_log,
            layer.dt_bias,
            batch.cu_seqlens_i32,
            num_k_heads=s.linear_num_key_heads,
            num_v_heads=s.linear_num_value_heads,
            head_k_dim=s.linear_key_head_dim,
            head_v_dim=s.linear_value_head_dim,
            qk_l2norm=self.qk_normalised,
        )
        z = proj[:, s.conv_dim : s.conv_dim + s.linear_value_dim]
        return q[0], k[0], v[0], g[0], beta[0], z

    def gated_rmsnorm(self, o: Tensor, z: Tensor, weight: Tensor) -> Tensor:
        return kernels.gated_rmsnorm(o, z, weight, self.shapes.rms_norm_eps)

    def attn_prep(self, proj: Tensor, layer: AttentionLayerWeights, cos: Tensor, sin: Tensor):
        s = self.shapes
        dims = dict(num_heads=s.num_attention_heads, head_dim=s.head_dim)
        q, k, v = kernels.attn_prep(
            proj,
            layer.q_norm,
            layer.k_norm,
            cos,
            sin,
            s.rms_norm_eps,
            num_kv_heads=s.num_key_value_heads,
            layout="htd",
            **dims,
        )
        return q, k, v, kernels.attention_gate_view(proj, **dims)

    def attention_gate(self, attn: Tensor, gate: Tensor) -> Tensor:
        return kernels.attention_gate(attn, gate)


# ---------------------------------------------------------------------------------------------------------------------
# The backbone


class EngineBackbone:
    """A `Backbone` over packed rows with merged weights; `fused` switches the element-wise ops to the kernels."""

    def __init__(
        self,
        merged: MergedWeights,
        *,
        fused: bool,
        gdn_core: str | None = None,
        max_batch_rows: int = 8192,
        nvtx_ranges: bool = False,
    ):
        self.weights = merged
        self.shapes = merged.shapes
        self.device = merged.device
        self.name = "fused" if fused else "merged"
        self.gdn_core = gdn_core or ("fla" if self.device.type == "cuda" else "torch")
        if self.gdn_core not in GDN_CORES:
            raise ValueError(f"unknown gdn_core {self.gdn_core!r}; expected one of {GDN_CORES}")
        if self.gdn_core == "fla" and self.device.type == "cpu":
            raise ValueError(
                "gdn_core='fla' cannot run bf16 on the CPU: the Triton interpreter computes bf16 tl.dot wrongly "
                "(reference-math.md §6); use gdn_core='torch' on the CPU"
            )
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.max_batch_rows = max_batch_rows
        self._chunk_rule = _fla_chunk_function() if self.gdn_core == "fla" else None
        self._ops = _FusedOps(self.shapes, self.gdn_core) if fused else _ReferenceOps(self.shapes)
        self._range = _Ranges(nvtx_ranges)

    # -- Backbone protocol ---------------------------------------------------------------------------------------------

    def prepare(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> PackedRows:
        """Pack candidates into batches of at most `max_batch_rows` rows (one candidate may exceed it alone)."""
        if len(candidates) == 0:
            raise ValueError("no candidates")
        if len(groups) != len(candidates):
            raise ValueError(f"{len(groups)} groups for {len(candidates)} candidates")
        vocab = self.shapes.vocab_size
        for c, ids in enumerate(candidates):
            if len(ids) == 0:
                raise ValueError(f"candidate {c} has no tokens")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"candidate {c} has token ids outside [0, {vocab})")
        batches, current, rows = [], [], 0
        for ids in candidates:
            if current and rows + len(ids) > self.max_batch_rows:
                batches.append(current)
                current, rows = [], 0
            current.append(ids)
            rows += len(ids)
        batches.append(current)
        return PackedRows([pack_batch(b, self.shapes, self.device) for b in batches], len(candidates))

    @torch.no_grad()
    def forward(self, prepared: PackedRows) -> Tensor:
        """[C, hidden] bf16: the final-norm output at each candidate's last token, in candidate order."""
        return torch.cat([self._forward_batch(batch, None) for batch in prepared.batches])

    @torch.no_grad()
    def hidden_states(self, prepared: PackedRows) -> list[Tensor]:
        """num_layers + 2 entries [total real tokens, hidden] bf16: embedding, each layer output, final-norm output."""
        per_batch = []
        for batch in prepared.batches:
            states: list[Tensor] = []
            self._forward_batch(batch, states)
            per_batch.append(states)
        return [torch.cat(parts) for parts in zip(*per_batch)]

    # -- forward -------------------------------------------------------------------------------------------------------

    def _forward_batch(self, batch: PackedBatch, states: list[Tensor] | None) -> Tensor:
        """One batch's forward; appends every residual state to `states` when given. Returns [N, hidden]."""
        w, ops_, rng = self.weights, self._ops, self._range
        with rng("embedding"):
            x = F.embedding(batch.token_ids, w.embed)  # [T, H]
        with rng("norm"):
            residual, normed = ops_.residual_rmsnorm(x, None, w.layers[0].input_norm)
        if states is not None:
            states.append(x)
        for i, layer in enumerate(w.layers):
            gdn = isinstance(layer, GDNLayerWeights)
            with rng(f"layer {i:02d} {'gdn' if gdn else 'attn'}"):
                with rng("in_proj"):
                    proj = F.linear(normed, layer.w_in)  # [T, gdn_in_width | attn_in_width]
                mixed = self._gdn(proj, layer, batch) if gdn else self._attention(proj, layer, batch)
                with rng("norm"):
                    residual, normed = ops_.residual_rmsnorm(residual, mixed, layer.post_norm)
                with rng("mlp"):
                    act = ops_.silu_mul(F.linear(normed, layer.w_gate_up))  # [T, I]
                    down = F.linear(act, layer.w_down)  # [T, H]
                next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
                with rng("norm"):
                    residual, normed = ops_.residual_rmsnorm(residual, down, next_norm)
            if states is not None:
                states.append(residual)
        if states is not None:
            states.append(normed)
        return normed.index_select(0, batch.last_rows)  # [N, H]

    def _gdn(self, proj: Tensor, layer: GDNLayerWeights, batch: PackedBatch) -> Tensor:
        rng = self._range
        with rng("gdn_prep"):
            q, k, v, g, beta, z = self._ops.gdn_prep(proj, layer, batch)
        with rng("gdn_core"):
            if self._chunk_rule is not None:
                o = _gdn_core_fla(self._chunk_rule, q, k, v, g, beta, batch, self._ops.qk_normalised)
            else:
                o = _gdn_core_torch(q, k, v, g, beta, batch)  # [T, Hv, V]
        with rng("gated_norm"):
            y = self._ops.gated_rmsnorm(o, z, layer.out_norm)  # [T, Hv V]
        with rng("out_proj"):
            return F.linear(y, layer.w_out)

    def _attention(self, proj: Tensor, layer: AttentionLayerWeights, batch: PackedBatch) -> Tensor:
        rng = self._range
        with rng("attn_prep"):
            q, k, v, gate = self._ops.attn_prep(proj, layer, batch.rope_cos, batch.rope_sin)
        with rng("attention"):
            attn = _block_diagonal_sdpa(q, k, v, batch.attn_mask, self.shapes.head_dim**-0.5)  # [T, Hq, D]
        with rng("attn_gate"):
            y = self._ops.attention_gate(attn, gate)  # [T, Hq D]
        with rng("out_proj"):
            return F.linear(y, layer.w_out)


def _block_diagonal_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Causal attention within each candidate: q [Hq, T, D], k, v [Hkv, T, D] -> [T, Hq, D] bf16 (a strided view).

    k/v heads repeated to the query heads (head h reads kv head h // (Hq/Hkv)), one SDPA call with the additive
    block-diagonal causal mask [1, 1, T, T].
    """
    rep = q.shape[0] // k.shape[0]
    out = F.scaled_dot_product_attention(
        q[None],  # [1, Hq, T, D]
        k.repeat_interleave(rep, dim=0)[None],
        v.repeat_interleave(rep, dim=0)[None],
        attn_mask=mask,
        scale=scale,
    )
    return out[0].transpose(0, 1)
