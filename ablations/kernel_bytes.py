"""The bytes each of this lab's prep and element-wise kernels must move per call: the byte models behind
`measure.kernel_floors` (floors against a run record) and the tile sweeps of `ablations.probes` (GB/s of a tile).

The kernels are the engine's own (`ablations.timing.KERNEL_FAMILIES["ours"]`), each as `engine.backbone._FusedOps` calls
it in a bucketed `graphs` / `core` forward: a tree plan in the replicated GDN mode, the bucket's packed rows N, path
slots L and attention keys K. Bytes per call: each unique input element read once and each output element written once
(what reads hit in L2 or SMEM is not counted twice), in the dtypes the engine passes (activations and norm weights bf16,
the gated norm's weight and A_log fp32, index arrays int64); cu_seqlens offsets (a few dozen int32) are not counted. H
hidden, I intermediate; GDN Hk key heads of Dk dims, Hv value heads of Dv dims, conv_dim = 2·Hk·Dk + Hv·Dv, conv width
W; attention Hq query heads, Hkv key/value heads of D dims, rotary dims r.
* `_residual_rmsnorm_kernel` (128 of its 129 calls a forward: the post-mixer and post-MLP norms with a bf16 delta;
  the first layer's input norm reads no delta and writes no residual; the split-K form, which reads S fp32 partials
  instead of the delta, is not modelled): reads residual and delta N·H·2 each, the weight H·2; writes the new
  residual and the normed rows N·H·2 each.
* `_gdn_prep_kernel` (gdn_prep v4 and v5: each packed row prepared once, at its representative path slot or from its
  conv window): reads the projection's q|k|v, b, a N·(conv_dim + 2·Hv)·2 (z is left for the gated norm), the conv weight
  conv_dim·W·2, A_log Hv·4, dt_bias Hv·2 and one int64 index per output row (v4's slot; v5's W window rows are 24 bytes
  a row more, 0.06 % of the floor, not counted, nor v4's path-row indices of the taps); writes q, k, v bf16, g fp32,
  beta bf16 at the N rows N·((2·Hk·Dk + Hv·Dv)·2 + Hv·(4 + 2)). `gdn_prep_bytes(N, L)` is the floor of preparing all L
  path slots, by this kernel over every slot or by the pair prep + gather (`measure.prep_probe`).
* `_gather_slots_kernel`: reads the N rows of gdn_prep's five outputs and the L int64 slot rows, writes the outputs
  at the L path slots (row bytes as above). Stage `flashinfer_gdn` gathers into its hand-off arena instead: L is the
  arena's gathered slots (`engine.plan.GdnArena.gathered`, a workload's, not the bucket's), written with FlashInfer's
  gates (`linear_gates`: exp(g) fp32 and beta widened to fp32, Hv·2 bytes a slot more).
* `_gated_rmsnorm_kernel`: reads the GDN core's output at the N packed rows' representative slots N·Hv·Dv·2 (of its L
  slot rows), z N·Hv·Dv·2, the N int64 slot indices and the fp32 weight Dv·4; writes N·Hv·Dv·2.
* `_attn_prep_kernel` (tree key layout): reads the query halves, k and v N·(Hq·D + 2·Hkv·D)·2 (the gate half is read
  by the attention gate), the q and k norm weights 2·D·2, cos and sin N·r·2·2 and the K int64 key rows; writes q
  N·Hq·D·2 and k, v at the K key rows K·2·Hkv·D·2.
* `_attention_gate_kernel`: reads the attention output and the gate half of the projection N·Hq·D·2 each, writes
  N·Hq·D·2.
* `_silu_mul_kernel`: reads the gate|up GEMM output N·2I·2, writes N·I·2.
Synthetic weights do not change bytes.
"""

from __future__ import annotations

from reference.shapes import QWEN38_27B, ModelShapes

BF16, FP32, INT64 = 2, 4, 8
KERNELS = (
    "_residual_rmsnorm_kernel",
    "_gdn_prep_kernel",
    "_gather_slots_kernel",
    "_gated_rmsnorm_kernel",
    "_attn_prep_kernel",
    "_attention_gate_kernel",
    "_silu_mul_kernel",
)


def residual_rmsnorm_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Residual add + RMSNorm with a bf16 delta: reads residual, delta and the weight, writes residual and normed."""
    return 4 * rows * s.hidden_size * BF16 + s.hidden_size * BF16


def gdn_prep_row_bytes(s: ModelShapes = QWEN38_27B) -> int:
    """One row of gdn_prep's outputs: q, k [Hk·Dk] and v [Hv·Dv] bf16, g [Hv] fp32, beta [Hv] bf16."""
    return (2 * s.linear_key_dim + s.linear_value_dim) * BF16 + s.linear_num_value_heads * (FP32 + BF16)


def gdn_prep_bytes(rows: int, slots: int, s: ModelShapes = QWEN38_27B) -> int:
    """GDN prep from `rows` projection rows to `slots` output rows (the engine's call: slots = rows)."""
    hv = s.linear_num_value_heads
    params = s.conv_dim * s.linear_conv_kernel_dim * BF16 + hv * (FP32 + BF16)  # conv weight, A_log, dt_bias
    reads = rows * (s.conv_dim + 2 * hv) * BF16 + params + slots * INT64
    return reads + slots * gdn_prep_row_bytes(s)


def gather_slots_bytes(rows: int, slots: int, s: ModelShapes = QWEN38_27B, *, linear_gates: bool = False) -> int:
    """gdn_prep's outputs moved from `rows` packed rows to `slots` path slots, each slot's row index read once; with
    `linear_gates` beta is written as fp32."""
    written = gdn_prep_row_bytes(s) + (s.linear_num_value_heads * (FP32 - BF16) if linear_gates else 0)
    return rows * gdn_prep_row_bytes(s) + slots * INT64 + slots * written


def gated_rmsnorm_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Gated RMSNorm: reads o at each row's slot, z and the slot index, the fp32 weight [Dv]; writes the rows."""
    width = s.linear_value_dim
    return 3 * rows * width * BF16 + rows * INT64 + s.linear_value_head_dim * FP32


def attn_prep_bytes(rows: int, keys: int, s: ModelShapes = QWEN38_27B) -> int:
    """Attention prep: q over the rows, k and v at the `keys` key rows."""
    q_width, kv_width = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    params = 2 * s.head_dim * BF16  # q_norm, k_norm
    reads = rows * (q_width + 2 * kv_width) * BF16 + params + 2 * rows * s.rotary_dim * BF16 + keys * INT64
    writes = rows * q_width * BF16 + keys * 2 * kv_width * BF16
    return reads + writes


def attention_gate_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Attention gate: reads the attention output and the gate half, writes the gated rows [N, Hq·D]."""
    return 3 * rows * s.num_attention_heads * s.head_dim * BF16


def silu_mul_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """SiLU·mul: reads the gate|up rows [N, 2I], writes [N, I]."""
    return rows * 3 * s.intermediate_size * BF16


def call_bytes(
    rows: int, slots: int, keys: int, s: ModelShapes = QWEN38_27B, *, linear_gates: bool = False
) -> dict[str, int]:
    """Bytes per call of each kernel of KERNELS at N = rows, L = slots, K = keys (module docstring); `linear_gates`:
    the gather writes FlashInfer's gates (stage `flashinfer_gdn`, L its arena's gathered slots)."""
    return {
        "_residual_rmsnorm_kernel": residual_rmsnorm_bytes(rows, s),
        "_gdn_prep_kernel": gdn_prep_bytes(rows, rows, s),
        "_gather_slots_kernel": gather_slots_bytes(rows, slots, s, linear_gates=linear_gates),
        "_gated_rmsnorm_kernel": gated_rmsnorm_bytes(rows, s),
        "_attn_prep_kernel": attn_prep_bytes(rows, keys, s),
        "_attention_gate_kernel": attention_gate_bytes(rows, s),
        "_silu_mul_kernel": silu_mul_bytes(rows, s),
    }
