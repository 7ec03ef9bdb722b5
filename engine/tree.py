"""Layer pieces over the packed rows of a `TreePlan` (engine/plan.py): conv, GDN core and attention on the tree.

Row-wise ops (GEMMs, norms, gates, MLP) need nothing from the tree: they run once per packed row. What does need it:

* `tree_conv1d_silu`: the GDN causal depthwise conv reads the 3 previous rows of each row's own path (its ancestors),
  not the previous packed rows. Math (HF torch path, F.conv1d in the weight's dtype): y = sum_k w[:, k] * x[t-3+k]
  as an fp32 multiply-add chain in k order, rounded to the weight's dtype (bf16 for the model), then silu (fp32
  inside) rounded again; zero history before position 0.
* `tree_gdn_core`: the recurrent GDN core over a `GdnSchedule` of the plan: `replicated` (every candidate's full
  path) or `handoff` (root once to its last 64-token boundary, fp32 state handed to the branches, the straddling chunk
  recomputed per branch). `core` is any varlen GDN function with FLA's `chunk_gated_delta_rule` signature.
* `tree_attention`: full attention where each row sees its ancestors and the earlier rows of its own node
  (`mode="mask"`, SDPA with a boolean mask built on the device, or FlexAttention on CUDA), or the same varlen causal
  attention as the flat run over each candidate's gathered path (`mode="paths"`).

Exactness against the unshared run with the same kernels (a plan from `plan_flat`). A shared row has one value in
the tree but one copy per candidate in the flat run, so "bitwise" needs every kernel of the flat run to be
prefix-invariant: a row's result may depend only on its own sequence up to itself, not on the sequence's length, its
later rows or its neighbours in the batch.
* conv: bitwise (each output uses the same 4 inputs in the same order).
* GDN core: bitwise in both modes when the core is prefix-invariant and an initial state handed over at a multiple
  of 64 reproduces the one-pass run (both measured for HF's torch chunk function on the CPU, fp32 and bf16,
  tests/test_tree.py; FLA on the H200: tests/test_gpu_tree.py).
* attention: `paths` mode is bitwise when its core is prefix-invariant (`blockwise_causal_attention` is, by
  construction; per-sequence SDPA on the CPU is not, measured); `mask` mode is bounded (a row's keys sit at other
  offsets of a longer key axis, so the reduction order changes).
* GEMMs are not here: their results can depend on the number of rows M, which the tree changes (measured in the
  tests: bf16 CPU GEMMs were row-count invariant on the tiny twin; on the H200 see tests/test_gpu_tree.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.plan import TreePlan
from reference import ops

# Fixed cost of one GDN core call in units of 64-token chunks of one sequence (launch latency of FLA's ~6 kernels
# against their per-chunk work). 32 makes the two extra calls of `handoff` pay once replication would cost more
# than ~4096 extra tokens, the threshold open-jev-fast uses for its state path; calibrate with tests/test_gpu_tree.py.
GDN_CALL_COST_CHUNKS = 32


def gather_paths(x: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """[N, ...] packed rows -> [sum(candidate_lens), ...]: every candidate's path back to back (shared rows copied).

    For a flat plan the paths are the rows: x itself is returned, no copy.
    """
    return x if plan.kind == "flat" else x.index_select(0, plan.path_rows)


def scatter_rows(y: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """[sum(candidate_lens), ...] path rows -> [N, ...] packed rows, each from its representative slot (flat: y)."""
    return y if plan.kind == "flat" else y.index_select(0, plan.row_slot)


def tree_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """Causal depthwise conv + SiLU over the tree. x [N, C] (bf16 or fp32), weight [C, W] -> [N, C] in x's dtype.

    Row n convolves the pre-conv rows at positions p-W+1..p of its own path (`plan.conv_rows`), zeros before 0.
    Rounding as `reference.ops.causal_conv1d_silu`: conv and silu each rounded to the weight's dtype, then x's.
    """
    num_rows, channels = x.shape
    if num_rows != plan.num_rows:
        raise ValueError(f"x has {num_rows} rows, the plan {plan.num_rows}")
    if weight.shape != (channels, plan.conv_rows.shape[1]):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not fit x [{num_rows}, {channels}] and the plan")
    x_ext = torch.cat([x, x.new_zeros(1, channels)])  # row N is the zero history
    w = weight.float()
    acc = torch.zeros(num_rows, channels, dtype=torch.float32, device=x.device)
    for k in range(w.shape[1]):
        acc = torch.addcmul(acc, x_ext.index_select(0, plan.conv_rows[:, k]).float(), w[:, k])
    return F.silu(acc.to(weight.dtype)).to(x.dtype)


def tree_gdn_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: TreePlan,
    *,
    mode: str = "replicated",
    core: Callable | None = None,
    out: torch.Tensor | None = None,
    **core_kwargs,
) -> torch.Tensor:
    """Gated DeltaNet core over the tree. Packed rows: q, k [N, H, K]; v [N, HV, V]; g (fp32), beta [N, HV].

    Returns o [N, HV, V] in q's dtype (written into `out` if given; every row is written, as the plan guarantees).
    Runs `core` once per call of `plan.gdn[mode]`, each over its sequences gathered from the packed rows
    ([1, T, ...] with cu_seqlens); states pass between calls in fp32. `core_kwargs` go to every call (e.g.
    use_qk_l2norm_in_kernel=True). `core` defaults to `torch_chunk_core`.
    """
    core = torch_chunk_core if core is None else core
    if mode not in plan.gdn:
        raise ValueError(f"unknown GDN tree mode {mode!r}; known: {sorted(plan.gdn)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.shape[0] != plan.num_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, the plan {plan.num_rows}")
    num_v_heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    if out is None:
        out = torch.empty(plan.num_rows, num_v_heads, v_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (plan.num_rows, num_v_heads, v_dim) or out.dtype != q.dtype:
        raise ValueError(f"out must be [{plan.num_rows}, {num_v_heads}, {v_dim}] {q.dtype}")
    bank = [torch.zeros(1, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)]
    for call in plan.gdn[mode].calls:
        if call.rows_start is not None:
            span = slice(call.rows_start, call.rows_start + call.num_tokens)
            seq = [t[span].unsqueeze(0) for t in (q, k, v, g, beta)]
        else:
            seq = [t.index_select(0, call.rows).unsqueeze(0) for t in (q, k, v, g, beta)]
        init = None if call.init_state is None else torch.cat(bank).index_select(0, call.init_state)
        o_call, final = core(
            *seq,
            initial_state=init,
            output_final_state=call.keep_final,
            cu_seqlens=call.cu_seqlens,
            cu_seqlens_cpu=call.cu_seqlens_cpu,
            chunk_indices=call.chunk_indices,
            **core_kwargs,
        )
        if call.keep_final:
            bank.append(final.float())
        if call.out_start is not None:
            slot, row = call.out_start
            count = len(call.out_rows)
            out[row : row + count] = o_call[0, slot : slot + count]
        else:
            out.index_copy_(0, call.out_rows, o_call[0].index_select(0, call.out_slots))
    return out


def gdn_mode_costs(plan: TreePlan, call_cost_chunks: float = GDN_CALL_COST_CHUNKS) -> dict[str, float]:
    """Estimated GDN core cost per mode: chunks of work plus a fixed cost per call."""
    return {mode: s.chunks + call_cost_chunks * len(s.calls) for mode, s in plan.gdn.items()}


def choose_gdn_mode(plan: TreePlan, call_cost_chunks: float = GDN_CALL_COST_CHUNKS) -> str:
    """`handoff` where it is estimated cheaper than `replicated` (long shared prefixes, several branches)."""
    costs = gdn_mode_costs(plan, call_cost_chunks)
    return "handoff" if costs["handoff"] < costs["replicated"] else "replicated"


def torch_chunk_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's varlen `chunk_gated_delta_rule` signature over HF's torch chunk function, one sequence at a time.

    q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV]; initial_state [S, HV, K, V] fp32. Returns o [1, T, HV, V]
    in q's dtype and the final states [S, HV, K, V] fp32 (or None). Chunks of 64 restart at each sequence start.
    Each sequence runs `reference.ops.gdn_core_torch` (HF's numerics: q/k L2-normalised in fp32 inside, q scaled by
    K^-0.5, fp32 throughout, output rounded once), so q/k must come raw: use_qk_l2norm_in_kernel=True.
    `chunk_indices` (FLA's precomputed chunk layout) is accepted for the signature and not needed here.
    """
    if not use_qk_l2norm_in_kernel:
        raise ValueError("the torch core L2-normalises q/k itself (HF numerics): pass use_qk_l2norm_in_kernel=True")
    if scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError("HF's torch chunk function only supports scale = K ** -0.5")
    if cu_seqlens is None:
        raise ValueError("torch_chunk_core takes packed sequences: pass cu_seqlens")
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences need batch size 1, got {q.shape[0]}")
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()).tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_i, s_i = ops.gdn_core_torch(
            q[0, start:end],
            k[0, start:end],
            v[0, start:end],
            g[0, start:end],
            beta[0, start:end],
            initial_state=None if initial_state is None else initial_state[i],
            output_final_state=output_final_state,
        )
        outs.append(o_i)
        finals.append(s_i)
    return torch.cat(outs)[None], torch.stack(finals) if output_final_state else None


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreePlan,
    scale: float,
    *,
    mode: str = "mask",
    backend: str = "sdpa",
    core: Callable | None = None,
) -> torch.Tensor:
    """Attention over the tree. q [N, Hq, D], k and v [N, Hkv, D] (GQA: query head h reads kv head h // (Hq/Hkv)).

    mode "mask": every row attends to its ancestor nodes and to its own node up to itself, backend "sdpa" (boolean
    [N, N] mask built on the device once per plan and cached there: memory N^2 bytes) or "flex" (FlexAttention block
    mask, compiled, CUDA). Bounded against the flat run. mode "paths": `core(q, k, v, cu_seqlens_cpu, scale)`
    (varlen causal attention, default `sdpa_varlen_causal`) over the gathered paths, each packed row read from its
    representative path; bitwise against the flat run with the same `core` when that core is prefix-invariant.
    Returns [N, Hq, D] in q's dtype (mask mode: a strided view).
    """
    num_rows, num_heads, _ = q.shape
    if num_rows != plan.num_rows or k.shape[0] != num_rows or v.shape[0] != num_rows:
        raise ValueError(f"q/k/v rows {num_rows}/{k.shape[0]}/{v.shape[0]} do not match the plan's {plan.num_rows}")
    if num_heads % k.shape[1] != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {k.shape[1]} kv heads")
    if mode == "paths":
        core = sdpa_varlen_causal if core is None else core
        o = core(gather_paths(q, plan), gather_paths(k, plan), gather_paths(v, plan), plan.path_cu_seqlens_cpu, scale)
        return scatter_rows(o, plan)
    if mode != "mask":
        raise ValueError(f"unknown tree attention mode {mode!r}; known: 'mask', 'paths'")
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, N, D]
    if backend == "sdpa":
        groups = num_heads // k.shape[1]
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=plan.attention_mask, scale=scale)
    elif backend == "flex":
        o = _flex_attention()(qh, kh, vh, block_mask=plan.flex_block_mask, scale=scale, enable_gqa=True)
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


def blockwise_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_cpu: torch.Tensor, scale: float, block: int = 64
) -> torch.Tensor:
    """Causal attention per packed sequence whose reduction order is fixed by position (prefix-invariant).

    q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D] in q's dtype. fp32 throughout: queries and keys in `block`-row
    blocks counted from the sequence start; key block j updates every query block >= j with an online softmax (running
    max, denominator, accumulator), the diagonal block masked causally; o = accumulator / denominator, rounded once.
    Row i's result depends only on rows <= i of its own sequence, never on the sequence's length or later rows, so a
    row shared by several candidates gets the same bits in each (per-sequence SDPA on the CPU does not:
    tests/test_tree.py measures it). Reference speed; the GPU uses flash kernels.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    groups = num_heads // k.shape[1]
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    bounds = cu_seqlens_cpu.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        nb = -(-length // block)
        qb, kb, vb = (_blocks(t[start:end], nb, block) for t in (q, k, v))  # [nb, heads, block, D] fp32
        kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        m = torch.full((nb, num_heads, block), float("-inf"), device=q.device)
        denom = torch.zeros(nb, num_heads, block, device=q.device)
        acc = torch.zeros(nb, num_heads, block, head_dim, device=q.device)
        for j in range(nb):
            s = (qb[j:] @ kb[j].transpose(-1, -2)) * scale  # [nb - j, Hq, block, block]
            s[0] = s[0].masked_fill(~causal, float("-inf"))
            m_new = torch.maximum(m[j:], s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            corr = torch.exp(m[j:] - m_new)
            denom[j:] = denom[j:] * corr + p.sum(-1)
            acc[j:] = acc[j:] * corr[..., None] + p @ vb[j]
            m[j:] = m_new
        o = (acc / denom[..., None]).transpose(1, 2).reshape(nb * block, num_heads, head_dim)[:length]
        outs.append(o.to(q.dtype))
    return torch.cat(outs)


def _blocks(t: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[L, H, D] -> [nb, H, block, D] fp32, zero-padded at the end."""
    t = F.pad(t.float(), (0, 0, 0, 0, 0, nb * block - t.shape[0]))
    return t.view(nb, block, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()


@functools.cache
def _flex_attention():
    """flex_attention compiled once (uncompiled it materializes the full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
