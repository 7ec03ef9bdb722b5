"""References over a prefix-tree plan (engine/plan.py) that the engine does not run: what its tests compare with.

* `gather_paths` / `scatter_rows`: packed rows to every candidate's path (shared rows copied) and back.
* `tree_conv1d_silu`: the GDN causal depthwise conv over each row's own path (its ancestors), not the previous packed
  rows. Math (HF torch path, F.conv1d in the weight's dtype): y = sum_k w[:, k] * x[t-3+k] as an fp32 multiply-add
  chain in k order, rounded to the weight's dtype (bf16 for the model), then silu (fp32 inside) rounded again; zero
  history before position 0. Bitwise against the flat run (each output uses the same 4 inputs in the same order).
* `tree_attention`: full attention where each row sees its ancestors and the earlier rows of its own node
  (`mode="mask"`: SDPA with a boolean mask, `attention_mask`, or FlexAttention on CUDA, `flex_block_mask`; bounded
  against the flat run), the same varlen causal attention as the flat run over each candidate's gathered path
  (`mode="paths"`), or the engine's node layout (`mode="nodes"`); the last two are bitwise against the flat run with a
  prefix-invariant core. tests/test_tree.py and tests/test_gpu_tree.py hold the measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from reference import ops


def attention_mask(plan) -> torch.Tensor:
    """[N, N] bool on the plan's device, True where row i attends to row j (`TreePlan.visible`)."""
    idx = torch.arange(plan.num_rows, device=plan.device)
    return plan.visible(idx[:, None], idx[None, :])


def flex_block_mask(plan):
    """FlexAttention BlockMask of `TreePlan.visible`, built on the plan's device."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        lambda b, h, i, j: plan.visible(i, j), None, None, plan.num_rows, plan.num_rows, device=plan.device
    )


def gather_paths(x: torch.Tensor, plan) -> torch.Tensor:
    """[N, ...] packed rows -> [sum(candidate_lens), ...]: every candidate's path back to back (shared rows copied).

    For a flat plan the paths are the rows: x itself is returned, no copy.
    """
    return x if plan.kind == "flat" else x.index_select(0, plan.path_rows)


def scatter_rows(y: torch.Tensor, plan) -> torch.Tensor:
    """[sum(candidate_lens), ...] path rows -> [N, ...] packed rows, each from its representative slot (flat: y)."""
    return y if plan.kind == "flat" else y.index_select(0, plan.row_slot)


def tree_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, plan) -> torch.Tensor:
    """Causal depthwise conv + SiLU over the tree. x [N, C] (bf16 or fp32), weight [C, W] -> [N, C] in x's dtype.

    Row n convolves the pre-conv rows at positions p-W+1..p of its own path (`plan.conv_taps`), zeros before 0.
    Rounding as `reference.ops.causal_conv1d_silu`: conv and silu each rounded to the weight's dtype, then x's.
    """
    num_rows, channels = x.shape
    if num_rows != plan.num_rows:
        raise ValueError(f"x has {num_rows} rows, the plan {plan.num_rows}")
    if weight.shape != (channels, plan.conv_taps.shape[1]):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not fit x [{num_rows}, {channels}] and the plan")
    x_ext = torch.cat([x, x.new_zeros(1, channels)])  # row N is the zero history
    conv_rows = plan.conv_taps.to(x.device)
    w = weight.float()
    acc = torch.zeros(num_rows, channels, dtype=torch.float32, device=x.device)
    for k in range(w.shape[1]):
        acc = torch.addcmul(acc, x_ext.index_select(0, conv_rows[:, k]).float(), w[:, k])
    return F.silu(acc.to(weight.dtype)).to(x.dtype)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    scale: float,
    *,
    mode: str = "mask",
    backend: str = "sdpa",
    core: Callable | None = None,
) -> torch.Tensor:
    """Attention over the tree. q [N, Hq, D], k and v [N, Hkv, D] (GQA: query head h reads kv head h // (Hq/Hkv)).

    mode "mask": every row attends to its ancestor nodes and to its own node up to itself, backend "sdpa" (boolean
    [N, N] mask built on the device: memory N^2 bytes) or "flex" (FlexAttention block
    mask, compiled, CUDA). Bounded against the flat run. mode "paths": `core(q, k, v, cu_seqlens_cpu, scale)`
    (varlen causal attention, default `sdpa_varlen_causal`) over the gathered paths, each packed row read from its
    representative path; bitwise against the flat run with the same `core` when that core is prefix-invariant.
    mode "nodes": one varlen sequence per node (`plan.attention`: the node's rows as queries, its path as keys),
    `core(q, k_gathered, v_gathered, plan.attention, scale)` (required: one of the engine's node cores,
    engine/tree.py); every packed row is computed once (no path copies of the queries) and, with a prefix-invariant
    core, bitwise against the flat run of the same core. Returns [N, Hq, D] in q's dtype (mask mode: a strided view).
    """
    num_rows, num_heads, _ = q.shape
    if num_rows != plan.num_rows or k.shape[0] != num_rows or v.shape[0] != num_rows:
        raise ValueError(f"q/k/v rows {num_rows}/{k.shape[0]}/{v.shape[0]} do not match the plan's {plan.num_rows}")
    if num_heads % k.shape[1] != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {k.shape[1]} kv heads")
    if mode == "nodes":
        layout = plan.attention
        if not layout.keys_are_rows:
            k, v = k.index_select(0, layout.key_rows), v.index_select(0, layout.key_rows)
        if core is None:
            raise ValueError("mode 'nodes' takes the node core to run (e.g. engine.tree.blockwise_node_core)")
        return core(q, k, v, layout, scale)
    if mode == "paths":
        core = sdpa_varlen_causal if core is None else core
        o = core(gather_paths(q, plan), gather_paths(k, plan), gather_paths(v, plan), plan.path_cu_seqlens_cpu, scale)
        return scatter_rows(o, plan)
    if mode != "mask":
        raise ValueError(f"unknown tree attention mode {mode!r}; known: 'mask', 'paths', 'nodes'")
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, N, D]
    if backend == "sdpa":
        groups = num_heads // k.shape[1]
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attention_mask(plan), scale=scale)
    elif backend == "flex":
        o = _flex_attention()(qh, kh, vh, block_mask=flex_block_mask(plan), scale=scale, enable_gqa=True)
    else:
        raise ValueError(f"unknown tree attention backend {backend!r}; known: 'sdpa', 'flex'")
    return o[0].transpose(0, 1)


def sdpa_varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_cpu: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention per packed sequence as HF calls SDPA (`reference.ops.attention_sdpa`, GQA, no mask).

    q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]. One SDPA call per sequence.
    """
    bounds = cu_seqlens_cpu.tolist()
    return torch.cat([ops.attention_sdpa(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(bounds[:-1], bounds[1:])])


@functools.cache
def _flex_attention():
    """flex_attention compiled once (uncompiled it materializes the full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
