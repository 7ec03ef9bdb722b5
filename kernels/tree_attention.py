"""Causal attention over the prefix tree's nodes with the keys read through the plan's key rows: no key layout.

Stage `core`'s attention runs FlashAttention-2's varlen forward over `plan.attention` (engine/plan.py `NodeAttention`):
each node's rows are the queries, its whole path the keys, so `attn_prep` writes k and v once per key entry (a shared
root once per node that sees it: customer_service's bucket 12,708 key entries for 1,152 rows). This kernel takes k
and v once per packed row and reads each node's path through `key_rows` (key entry j of sequence i is packed row
key_rows[cu_seqlens_k[i] + j]), so the prep writes N rows instead of K (issue 22, item 2).

Math, per sequence i (queries at the last n_q of its n_k key positions, bottom-right causal as FlashAttention's varlen
kernel), query row r at key position p_r = n_k − n_q + r, kv head h // (Hq / Hkv):
  s_rj = (q_r · k_j) · scale · log2(e)                 fp32 (bf16 dot operands on CUDA, fp32 holding them interpreted)
  over key blocks of BLOCK_N positions from the path start, keys j <= p_r only, online softmax in base 2:
  m ← max(m, max_j s_rj),  l ← l · 2^(m_old − m) + Σ_j 2^(s_rj − m),  acc ← acc · 2^(m_old − m) + bf16↓(2^(s − m)) · V
  o_r = bf16↓(acc / l)
The weights enter the P·V dot rounded to bf16 (as FlashAttention-2's kernel does), the denominator sums them unrounded.

Schedules (`schedule`, `SCHEDULES`), the same steps per row and so the same bits:
* "nodes": one program per (query block of a node, node, query head), as FlashAttention's varlen grid: a node of one
  row fills a 64-row block alone, and every node reads its path's shared prefix again.
* "row-blocks": one program per (64 consecutive query rows, query head), whatever nodes they belong to; for each key
  block the rows' nodes whose block holds the same key rows as the node before (a shared prefix) are attended in one
  step. Key-block steps counted on the bucketed plans (`measure.tree_attention_probe` prints them): drone 33 -> 32,
  customer_service 268 -> 145, context-512-choice-8 162 -> 95, jevbench/easy-intent-00 12 -> 17.

Exactness. Bounded against `engine.tree.blockwise_node_core` (fp32 throughout, 64-key blocks): |Δo| <= 3 · 2^-8 ·
max |v| per element (bf16's unit roundoff 2^-8 for one rounding of each weight in P·V and for the output's rounding
here and in the reference; o is a convex combination of v rows), tests/test_tree_attention.py. Bitwise
prefix-invariant: a row's result depends on its own q row and the keys at positions <= its own, in key blocks counted
from the path start; a step in which a row sees no key leaves it as it is (max unchanged, correction exactly 1,
weights 0; the running max starts finite, `NO_MAX`), so neither its node's other rows, the node's length, the
schedule, nor what shares the launch change its bits (up to the sign of an output that is exactly zero): a node's rows
equal the same rows of their whole path run as one sequence (tree vs flat), a sequence alone equals it in a batch, and
"row-blocks" equals "nodes" (tested on the CPU; tests/test_gpu_tree_attention.py on the H200, not yet run). Not yet
timed on the GPU: `measure.tree_attention_probe` times both schedules with `attn_prep` over the N rows against
FlashAttention-2 with `attn_prep` over the K key entries.

Versions:
* v2 (this file): v1 plus the "row-blocks" schedule; the running max starts at NO_MAX instead of -inf (v1's bits:
  the first key's correction is 0 either way). sm_90 (Triton 3.9 here): "nodes" 206 registers, no spills;
  "row-blocks" 255 registers, 68 bytes of spills (its group's key rows held as int32).
* v1: grid (query block, sequence, query head); K and V gathered per key block through `key_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.numerics import (
    LAUNCH_OPTIONS,
    check_tensor,
    ieee_quiet,
    kernel_mode,
    output_tensor,
    round_to_bf16,
    sequence_index,
    to_f32,
)

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): the softmax in base 2 (a jit global must be a constexpr)
BLOCK_M = 64  # query rows per program on CUDA (16 interpreted, for the interpreter's time; rows never share bits)
BLOCK_N = 64  # keys per block, counted from the path start: fixes every row's reduction order (prefix invariance)
SCHEDULES = ("nodes", "row-blocks")
SCHEDULE = "nodes"  # the engine's (`engine.tree.row_node_core`) until the H200 probe has timed both
NO_MAX = tl.constexpr(-1.0e30)  # the running max before any key: finite, below every score (`_attend_key_block`)


@triton.jit
def _attend_key_block(
    q_tile, k_ptr, v_ptr, kv_row, key_ok, visible, running_max, denominator, acc, qk_scale, i_kv,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TORCH_CPU: tl.constexpr,
):  # fmt: skip
    """One key block's online-softmax step for every query row of the tile: the keys' k and v rows `kv_row` [BLOCK_N]
    (`key_ok` the block's real keys), `visible` [BLOCK_M, BLOCK_N] the keys each row sees; returns the new running
    max, denominator and accumulator. The running max starts at NO_MAX, not -inf, so a row that sees no key of the
    block keeps its values (max unchanged, correction 2^0 = 1, weights 0) even before its first key; at its first key
    the correction 2^(NO_MAX - max) is 0, as 2^(-inf) would be."""
    dim = tl.arange(0, BLOCK_D)
    kv_offsets = (kv_row * KV_HEADS + i_kv)[:, None] * HEAD_DIM + dim[None, :]
    kv_mask = key_ok[:, None] & (dim < HEAD_DIM)[None, :]
    k_tile = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v_tile = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if TORCH_CPU:
        k_tile = to_f32(k_tile)
        v_tile = to_f32(v_tile)
    scores = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    correction = tl.exp2(running_max - new_max)
    weights = tl.exp2(scores - new_max[:, None])
    denominator = denominator * correction + tl.sum(weights, axis=1)
    if TORCH_CPU:
        weights_op = round_to_bf16(weights)
    else:
        weights_op = weights.to(tl.bfloat16)
    acc = acc * correction[:, None] + tl.dot(weights_op, v_tile)
    return new_max, denominator, acc


@triton.jit
def _load_queries(q_ptr, q_rows, row_ok, i_h, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  TORCH_CPU: tl.constexpr):  # fmt: skip
    """The query tile [BLOCK_M, BLOCK_D] of head i_h at the int64 rows `q_rows` (the dot operand: bf16 on CUDA, fp32
    interpreted), its element offsets and mask (the output's too), and the empty online-softmax state."""
    dim = tl.arange(0, BLOCK_D)
    offsets = (q_rows * HEADS + i_h)[:, None] * HEAD_DIM + dim[None, :]
    mask = row_ok[:, None] & (dim < HEAD_DIM)[None, :]
    q_tile = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    if TORCH_CPU:
        q_tile = to_f32(q_tile)
    running_max = tl.full([q_rows.shape[0]], NO_MAX, tl.float32)
    denominator = tl.zeros([q_rows.shape[0]], tl.float32)
    acc = tl.zeros([q_rows.shape[0], BLOCK_D], tl.float32)
    return q_tile, offsets, mask, running_max, denominator, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [Nq, Hq, D] bf16 contiguous
    k_ptr,  # [Nk, Hkv, D] bf16 contiguous: one row per packed row
    v_ptr,  # like k
    key_rows_ptr,  # [K] int32 or int64: the k/v row of each key entry
    cu_q_ptr,  # [S + 1] int32
    cu_k_ptr,  # [S + 1] int32
    out_ptr,  # [Nq, Hq, D] bf16 contiguous
    scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    """Schedule "nodes": one program per (query block of a node, node, query head), the node's key blocks in order."""
    i_m = tl.program_id(0)
    i_s = tl.program_id(1)
    i_h = tl.program_id(2)
    i_kv = i_h // (HEADS // KV_HEADS)
    q_start = tl.load(cu_q_ptr + i_s).to(tl.int64)
    num_q = (tl.load(cu_q_ptr + i_s + 1).to(tl.int64) - q_start).to(tl.int32)
    k_start = tl.load(cu_k_ptr + i_s).to(tl.int64)
    num_k = (tl.load(cu_k_ptr + i_s + 1).to(tl.int64) - k_start).to(tl.int32)
    if i_m * BLOCK_M < num_q:
        row = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = row < num_q
        position = num_k - num_q + row  # each query's key position
        q_tile, q_offsets, out_mask, running_max, denominator, acc = _load_queries(
            q_ptr, q_start + row, row_ok, i_h, HEADS, HEAD_DIM, BLOCK_D, TORCH_CPU
        )
        qk_scale = scale * LOG2E
        last_key = tl.minimum(num_k, num_k - num_q + (i_m + 1) * BLOCK_M)  # keys up to the block's last query
        for block_start in range(0, last_key, BLOCK_N):
            key = block_start + tl.arange(0, BLOCK_N)
            key_ok = key < num_k
            kv_row = tl.load(key_rows_ptr + k_start + key, mask=key_ok, other=0).to(tl.int64)
            visible = (key[None, :] <= position[:, None]) & key_ok[None, :]
            running_max, denominator, acc = _attend_key_block(
                q_tile, k_ptr, v_ptr, kv_row, key_ok, visible, running_max, denominator, acc, qk_scale, i_kv,
                KV_HEADS, HEAD_DIM, BLOCK_D, TORCH_CPU,
            )  # fmt: skip
        tl.store(out_ptr + q_offsets, (acc / denominator[:, None]).to(tl.bfloat16), mask=out_mask)


@triton.jit
def _tree_attention_rows_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    key_rows_ptr,
    cu_q_ptr,
    cu_k_ptr,
    out_ptr,
    scale,
    num_nodes,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    TORCH_CPU: tl.constexpr,
):
    """Schedule "row-blocks": one program per (block of BLOCK_M consecutive query rows, query head), whatever nodes
    they belong to. Key block b of the rows' paths, in order: the program's nodes whose block b holds the same key rows
    as the node before (a shared prefix's blocks) form one group, attended in one step in which the other rows see no
    key (a step that leaves them as they are); so each row goes through the steps of schedule "nodes", with the same
    key rows, and gets its bits."""
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_kv = i_h // (HEADS // KV_HEADS)
    num_rows = tl.load(cu_q_ptr + num_nodes)
    row = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row < num_rows
    node = sequence_index(cu_q_ptr, row, num_nodes, SEARCH_STEPS)
    q_start = tl.load(cu_q_ptr + node)
    num_q = tl.load(cu_q_ptr + node + 1) - q_start
    num_k = tl.load(cu_k_ptr + node + 1) - tl.load(cu_k_ptr + node)
    position = num_k - num_q + (row - q_start)  # each query's key position in its node's path
    first_node = tl.min(tl.where(row_ok, node, num_nodes), axis=0)
    last_node = tl.max(tl.where(row_ok, node, -1), axis=0)
    blocks = tl.max(tl.where(row_ok, position, -1), axis=0) // BLOCK_N + 1
    q_tile, q_offsets, out_mask, running_max, denominator, acc = _load_queries(
        q_ptr, row.to(tl.int64), row_ok, i_h, HEADS, HEAD_DIM, BLOCK_D, TORCH_CPU
    )
    qk_scale = scale * LOG2E
    offsets = tl.arange(0, BLOCK_N)
    for block in range(0, blocks):
        key = block * BLOCK_N + offsets
        group_rows = tl.zeros([BLOCK_N], tl.int32) - 1  # the current group's key rows (-1: past its path; int32)
        in_group = row < 0  # no row yet
        for n in range(first_node, last_node + 2):  # one past the last node: attend the last group
            real = n <= last_node
            k_start = tl.load(cu_k_ptr + n, mask=real, other=0)
            node_keys = tl.load(cu_k_ptr + n + 1, mask=real, other=0) - k_start
            node_rows = tl.load(key_rows_ptr + k_start + key, mask=key < node_keys, other=-1).to(tl.int32)
            differs = tl.max((node_rows != group_rows).to(tl.int32), axis=0) | (1 - real.to(tl.int32))
            reaches = tl.max(tl.where(in_group, position, -1), axis=0) >= block * BLOCK_N  # a row sees its keys
            if (n > first_node) & (differs == 1) & reaches:  # the group ends before node n: attend it
                key_ok = group_rows >= 0
                visible = in_group[:, None] & (key[None, :] <= position[:, None]) & key_ok[None, :]
                kv_row = tl.maximum(group_rows, 0).to(tl.int64)
                running_max, denominator, acc = _attend_key_block(
                    q_tile, k_ptr, v_ptr, kv_row, key_ok, visible, running_max, denominator, acc, qk_scale, i_kv,
                    KV_HEADS, HEAD_DIM, BLOCK_D, TORCH_CPU,
                )  # fmt: skip
            if differs == 1:
                in_group = row < 0
            group_rows = node_rows
            in_group = in_group | ((node == n) & row_ok)
    tl.store(out_ptr + q_offsets, (acc / denominator[:, None]).to(tl.bfloat16), mask=out_mask)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_rows: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    scale: float,
    *,
    schedule: str = SCHEDULE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention per sequence with its keys read through `key_rows` (module docstring): -> [Nq, Hq, D] bf16.

    q [Nq, Hq, D] bf16; k, v [Nk, Hkv, D] bf16 (one row per packed row), all contiguous, Hkv dividing Hq, D <= 256;
    key_rows [K] int32/int64, values in [0, Nk) (not checked: a device sync); cu_seqlens_q, cu_seqlens_k [S + 1] int32
    (sequence i: queries q rows cu_seqlens_q[i]..[i+1] - 1, keys key entries cu_seqlens_k[i]..[i+1] - 1, each
    sequence with 0 < queries <= keys or none of either; not checked); max_q >= every sequence's query count (the
    grid's query blocks, a host int: the plan's `max_q`). `schedule` (`SCHEDULES`, module docstring): "nodes" or
    "row-blocks" (the sequences' queries must then be q's rows from 0 on, cu_seqlens_q[0] = 0; the same bits).
    `out` [Nq, Hq, D] bf16 is written in place when given; rows outside every sequence are not written.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"tree_attention: schedule {schedule!r} is not one of {SCHEDULES}")
    device = q.device
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(
            f"tree_attention: q must be [Nq, Hq, D] and k [Nk, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    rows, heads, head_dim = q.shape
    kv_rows, kv_heads = k.shape[0], k.shape[1]
    if heads % kv_heads or head_dim > 256:
        raise ValueError(f"tree_attention: Hkv ({kv_heads}) must divide Hq ({heads}) and D ({head_dim}) be <= 256")
    check_tensor("tree_attention: q", q, dtype=torch.bfloat16, shape=(rows, heads, head_dim), device=device,
                 contiguous=True)  # fmt: skip
    for name, t in (("k", k), ("v", v)):
        check_tensor(f"tree_attention: {name}", t, dtype=torch.bfloat16, shape=(kv_rows, kv_heads, head_dim),
                     device=device, contiguous=True)  # fmt: skip
    check_tensor("tree_attention: key_rows", key_rows, dtype=(torch.int32, torch.int64), shape=(None,), device=device,
                 contiguous=True)  # fmt: skip
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(f"tree_attention: {name}", cu, dtype=torch.int32, shape=(None,), device=device, contiguous=True)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        shapes = f"{tuple(cu_seqlens_q.shape)}, {tuple(cu_seqlens_k.shape)}"
        raise ValueError(f"tree_attention: cu_seqlens_q and cu_seqlens_k must both be [S + 1], S >= 1; got {shapes}")
    o = output_tensor("tree_attention: out", out, (rows, heads, head_dim), torch.bfloat16, device)
    sequences = cu_seqlens_q.shape[0] - 1
    torch_cpu = kernel_mode(_tree_attention_kernel, device)
    block_m = 16 if torch_cpu else BLOCK_M
    tiles = {"HEADS": heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N,
             "BLOCK_D": triton.next_power_of_2(head_dim), "TORCH_CPU": torch_cpu,
             "num_warps": 4 if head_dim <= 128 else 8}  # fmt: skip
    args = (q, k, v, key_rows, cu_seqlens_q, cu_seqlens_k, o, scale)
    with ieee_quiet(torch_cpu):
        if schedule == "nodes" and max_q > 0:
            _tree_attention_kernel[(triton.cdiv(max_q, block_m), sequences, heads)](*args, **tiles, **LAUNCH_OPTIONS)
        elif schedule == "row-blocks" and rows > 0:
            _tree_attention_rows_kernel[(triton.cdiv(rows, block_m), heads)](
                *args, sequences, SEARCH_STEPS=(sequences - 1).bit_length(), **tiles, **LAUNCH_OPTIONS
            )
    return o
