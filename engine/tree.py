"""Layer pieces over the packed rows of a `TreePlan` (engine/plan.py): conv, GDN core and attention on the tree.

Row-wise ops (GEMMs, norms, gates, MLP) need nothing from the tree: they run once per packed row. What does need it:

* the GDN causal depthwise conv reads the 3 previous rows of each row's own path (its ancestors), not the previous
  packed rows: the kernels read it through the plan's `ConvInput` layouts (the reference over the tree is
  `reference.tree.tree_conv1d_silu`).
* `tree_gdn_core`: the recurrent GDN core over a `GdnSchedule` of the plan: `replicated` (every candidate's full
  path) or `handoff` (root once to its last 64-token boundary, fp32 state handed to the branches, the straddling chunk
  recomputed per branch). `core` is any varlen GDN function with FLA's `chunk_gated_delta_rule` signature.
* attention: one varlen sequence per node whose queries are the node's rows and whose keys are its path
  (`plan.attention`), with the cores `flash_node_core` (FlashAttention-2) and `flash4_node_core` (FlashAttention-4)
  over keys laid out per node, `flash4_paged_node_core` (FlashAttention-4 reading the packed rows through the page
  table of `page_keys`) on CUDA, and `blockwise_node_core` / `blockwise_paged_node_core` anywhere (`node_core` picks
  one for a config's `attention`). The other ways of running attention over a tree (masked SDPA, FlexAttention,
  gathered paths) are references, in `reference/tree.py`.

Exactness against the unshared run with the same kernels (a plan from `plan_flat`). A shared row has one value in
the tree but one copy per candidate in the flat run, so "bitwise" needs every kernel of the flat run to be
prefix-invariant: a row's result may depend only on its own sequence up to itself, not on the sequence's length, its
later rows or its neighbours in the batch.
* conv: bitwise (each output uses the same 4 inputs in the same order).
* GDN core: bitwise in both modes when the core is prefix-invariant and an initial state handed over at a multiple
  of 64 reproduces the one-pass run (both measured for HF's torch chunk function on the CPU, fp32 and bf16,
  tests/test_tree.py; FLA on the H200: tests/test_gpu_tree.py).
* attention: `paths` and `nodes` modes are bitwise when their core is prefix-invariant (`blockwise_causal_attention`
  is, by construction, also with queries at the end of their keys; FlashAttention-2's and -4's varlen forwards are by
  their schedules, checked on the GPU; per-sequence SDPA on the CPU is not, measured); `mask` mode is bounded (a row's
  keys sit at other offsets of a longer key axis, so the reduction order changes).
* GEMMs are not here: their results can depend on the number of rows M, which the tree changes (measured in the
  tests: bf16 CPU GEMMs are row-count invariant on the tiny twin with oneDNN off, as `engine.stages.prepare_process`
  sets it, tests/test_stages.py; on the H200 see tests/test_gpu_tree.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.plan import NodeAttention, TreePlan
from reference import ops


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
    chunk_offsets: bool = False,
    **core_kwargs,
) -> torch.Tensor:
    """Gated DeltaNet core over the tree. Packed rows: q, k [N, H, K]; v [N, HV, V]; g (fp32), beta [N, HV].

    Returns o [N, HV, V] in q's dtype (written into `out` if given; every row is written, as the plan guarantees).
    Runs `core` once per call of `plan.gdn[mode]`, each over its sequences gathered from the packed rows
    ([1, T, ...] with cu_seqlens); states pass between calls in fp32. `core_kwargs` go to every call (e.g.
    use_qk_l2norm_in_kernel=True). `core` defaults to `torch_chunk_core`. `chunk_offsets`: pass each call's
    `chunk_offsets` to the core (`kernels.gdn_core.FlaForwardCore` takes them; FLA's own function does not).
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
            **({"chunk_offsets": call.chunk_offsets} if chunk_offsets else {}),
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
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's varlen `chunk_gated_delta_rule` signature over HF's torch chunk function, one sequence at a time.

    q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV]; initial_state [S, HV, K, V] fp32. Returns o [1, T, HV, V]
    in q's dtype and the final states [S, HV, K, V] fp32 (or None). Chunks of 64 restart at each sequence start.
    Each sequence runs `reference.ops.gdn_core_torch` (HF's numerics: q/k L2-normalised in fp32 inside, q scaled by
    K^-0.5, fp32 throughout, output rounded once), so q/k must come raw: use_qk_l2norm_in_kernel=True.
    `chunk_indices` and `chunk_offsets` (FLA's precomputed chunk layout) are accepted for the signature and not
    needed here. Empty sequences (a bucketed plan's) give no rows and their initial state (or zeros) as final state;
    slots after the last sequence (a bucket's trailing slots) are left zero.
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
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    finals = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if start == end:
            state = initial_state[i].float() if initial_state is not None else None
            if output_final_state:
                shape = (v.shape[2], k.shape[-1], v.shape[-1])
                finals.append(state if state is not None else torch.zeros(shape, device=q.device))
            continue
        o_i, s_i = ops.gdn_core_torch(
            q[0, start:end],
            k[0, start:end],
            v[0, start:end],
            g[0, start:end],
            beta[0, start:end],
            initial_state=None if initial_state is None else initial_state[i],
            output_final_state=output_final_state,
        )
        out[0, start:end] = o_i
        finals.append(s_i)
    return out, torch.stack(finals) if output_final_state else None


def blockwise_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
    block: int = 64,
    *,
    cu_seqlens_k_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention per packed sequence whose reduction order is fixed by position (prefix-invariant).

    q [Tq, Hq, D], k and v [Tk, Hkv, D] -> [Tq, Hq, D] in q's dtype. Sequence i's queries are q rows
    cu_seqlens_cpu[i]:[i+1] and its keys k rows cu_seqlens_k_cpu[i]:[i+1] (default: the same bounds); the queries are
    the LAST positions of the keys (bottom-right causal alignment, as FlashAttention's varlen kernel): with n_q queries
    and n_k keys, query j sits at position n_k - n_q + j and sees keys 0..n_k - n_q + j.
    fp32 throughout: keys in `block`-row blocks counted from the sequence start, queries placed in the blocks of their
    positions (zero rows fill the rest); key block j updates every query block >= j with an online softmax (running
    max, denominator, accumulator), the diagonal block masked causally; o = accumulator / denominator, rounded once.
    Row i's result depends only on keys <= its position, never on the sequence's length, later rows or which other
    queries are present, so a row shared by several candidates gets the same bits in each and in any node layout
    (per-sequence SDPA on the CPU does not: tests/test_tree.py measures it). Reference speed; CUDA uses FlashAttention.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    groups = num_heads // k.shape[1]
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    q_bounds = cu_seqlens_cpu.tolist()
    k_bounds = q_bounds if cu_seqlens_k_cpu is None else cu_seqlens_k_cpu.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # rows after the last sequence stay zero
    for (q_start, q_end), (k_start, k_end) in zip(zip(q_bounds[:-1], q_bounds[1:]), zip(k_bounds[:-1], k_bounds[1:])):
        num_q, num_k = q_end - q_start, k_end - k_start
        if num_q == num_k == 0:  # a bucketed plan's rowless node
            continue
        if not 0 < num_q <= num_k:
            raise ValueError(f"a sequence has {num_q} queries for {num_k} keys: need 0 < queries <= keys")
        nb = -(-num_k // block)
        offset = num_k - num_q  # position of the first query
        b0 = offset // block  # first query block
        q_full = F.pad(q[q_start:q_end].float(), (0, 0, 0, 0, offset - b0 * block, nb * block - num_k))
        qb = _blocks(q_full, nb - b0, block)  # [nb - b0, heads, block, D] fp32: query blocks b0..nb-1
        kb, vb = (_blocks(t[k_start:k_end].float(), nb, block) for t in (k, v))
        kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        m = torch.full((nb - b0, num_heads, block), float("-inf"), device=q.device)
        denom = torch.zeros(nb - b0, num_heads, block, device=q.device)
        acc = torch.zeros(nb - b0, num_heads, block, head_dim, device=q.device)
        for j in range(nb):
            first = max(j, b0) - b0  # local index of the first query block key block j updates
            s = (qb[first:] @ kb[j].transpose(-1, -2)) * scale  # [blocks, Hq, block, block]
            if j >= b0:
                s[0] = s[0].masked_fill(~causal, float("-inf"))
            m_new = torch.maximum(m[first:], s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            corr = torch.exp(m[first:] - m_new)
            denom[first:] = denom[first:] * corr + p.sum(-1)
            acc[first:] = acc[first:] * corr[..., None] + p @ vb[j]
            m[first:] = m_new
        o = (acc / denom[..., None]).transpose(1, 2).reshape((nb - b0) * block, num_heads, head_dim)
        out[q_start:q_end] = o[offset - b0 * block : offset - b0 * block + num_q].to(q.dtype)
    return out


def _blocks(t: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[L, H, D] -> [nb, H, block, D] fp32, zero-padded at the end."""
    t = F.pad(t.float(), (0, 0, 0, 0, 0, nb * block - t.shape[0]))
    return t.view(nb, block, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()


def blockwise_node_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: NodeAttention, scale: float):
    """Node-wise varlen causal attention with `blockwise_causal_attention` (any device; the CPU's core).

    q [Nq, Hq, D] (the queries of `layout`'s sequences), k and v [K, Hkv, D] (its key rows, gathered) -> [Nq, Hq, D].
    """
    return blockwise_causal_attention(q, k, v, layout.cu_seqlens_q_cpu, scale, cu_seqlens_k_cpu=layout.cu_seqlens_k_cpu)


def flash_node_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: NodeAttention, scale: float):
    """Node-wise varlen causal attention with FlashAttention-2's varlen forward (torch's build, CUDA, bf16).

    Same arguments as `blockwise_node_core`. One launch for all sequences; GQA read natively (query head h uses kv
    head h // (Hq/Hkv)); causal masks align at the bottom right when a sequence has fewer queries than keys. No
    split-KV for queries longer than one row, so a row's result is the online softmax over its key blocks (64-key
    tiles from the sequence start) in a fixed order: prefix-invariant by construction, checked on the H200
    (tests/test_gpu_tree.py).
    """
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_q, layout.max_k, 0.0, True, False, scale=scale
    )
    return out[0]


def flash4_node_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: NodeAttention, scale: float):
    """Node-wise varlen causal attention with FlashAttention-4's varlen forward (`flash-attn-4` 4.0.0b40, CUDA, bf16).

    Same arguments as `blockwise_node_core`. One launch for all sequences, causal aligned at the bottom right, GQA
    read natively. Pinned, so that nothing about a row's arithmetic depends on the lengths beside it: one split
    (`num_splits=1`: no split-KV combine) and the query heads of a key/value head packed into one tile
    (`pack_gqa=True`, the package's own choice at head dim 256 on sm_90). On sm_90 at head dim 256 the package then
    picks one kernel whatever the lengths (128 query rows x 80 keys, warpgroup MMA, key blocks from the sequence
    start, visited last to first): a row's result depends only on its keys up to itself, so the core is
    prefix-invariant and a sequence's bits do not depend on what shares its launch; checked on the GPU
    (measure/attention_core_probe.py, tests/test_gpu_tree.py). Blackwell's kernels choose tiles and 2-CTA pairs from
    the lengths: nothing is claimed there until measured. The kernel compiles on its first call (CUTLASS's Python
    DSL); the output rows after the last sequence are not written.
    """
    return flash4_varlen(q, k, v, layout, scale)


@dataclass(frozen=True)
class PagedKeys:
    """A `NodeAttention` whose keys stay in the packed rows: each node's path as one-row pages (FlashAttention-4's
    paged form of the key layout, `attention="paged_fa4"`).

    page_table [S, max(1, max_k)] int32: row i holds sequence i's key rows (`nodes.key_rows[cu_seqlens_k[i]:
    cu_seqlens_k[i+1]]`), then its last key row again (never read); seqused_k [S] int32: its key count. Built on the
    device from the plan's arrays by `page_keys`, once per forward (inside the bucket's CUDA graph)."""

    nodes: NodeAttention
    page_table: torch.Tensor
    seqused_k: torch.Tensor


def page_keys(nodes: NodeAttention) -> PagedKeys:
    """The page table of `nodes` on its device: a gather of its key rows, no host work (so a CUDA graph captures it)."""
    bounds = nodes.cu_seqlens_k.long()
    starts, ends = bounds[:-1], bounds[1:]
    columns = torch.arange(max(1, nodes.max_k), device=bounds.device)
    last = (ends - 1).clamp(min=0, max=max(0, nodes.num_keys - 1))  # an empty sequence's entries: some key, never read
    entries = torch.minimum(starts[:, None] + columns[None, :], last[:, None])
    table = nodes.key_rows.index_select(0, entries.flatten()).view(entries.shape).to(torch.int32)
    return PagedKeys(nodes=nodes, page_table=table, seqused_k=(ends - starts).to(torch.int32))


def blockwise_paged_node_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PagedKeys, scale: float):
    """`blockwise_node_core` over `keys`' nodes with k and v [N, Hkv, D] at the packed rows: the key rows gathered
    (the CPU's core for `paged_fa4`; the prep writes a key row's values at its packed row bit for bit, so this is
    `blockwise_node_core` on the key layout)."""
    rows = keys.nodes.key_rows
    return blockwise_node_core(q, k.index_select(0, rows), v.index_select(0, rows), keys.nodes, scale)


def flash4_paged_node_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PagedKeys, scale: float):
    """`flash4_node_core` with k and v [N, Hkv, D] at the packed rows, read through `keys.page_table` as pages of one
    row ([N, 1, Hkv, D]) and `keys.seqused_k` (issue 22, item 2: a shared prefix's k and v written once, not once per
    node that sees it). The same pins (one split, packed query heads); the key blocks come through the package's
    cp.async paged loads instead of TMA. Every row got `flash4_node_core`'s bits on an H100 (campaign 70, 4b0a42c:
    measure/attention_core_probe.py "flash4-paged"; tests/test_gpu_gdn_chunk.py, stage `paged` against `core`)."""
    return flash4_varlen(q, k.unsqueeze(1), v.unsqueeze(1), keys.nodes, scale, keys=keys)


def flash4_varlen(q, k, v, nodes: NodeAttention, scale: float, *, pack_gqa: bool | None = True, keys=None):
    """One FlashAttention-4 varlen forward over `nodes`' sequences, causal, one split (`num_splits=1`), query heads
    packed per key/value head as `pack_gqa` says (the engine's cores pin True; None leaves it to the package's
    heuristic): k and v in the key layout (`cu_seqlens_k`), or with `keys` (`PagedKeys`) pages [P, page, Hkv, D] read
    through its page table and `seqused_k`. Returns the output [Nq, Hq, D]."""
    if keys is None:
        key_layout = {"cu_seqlens_k": nodes.cu_seqlens_k}
    else:
        key_layout = {"seqused_k": keys.seqused_k, "page_table": keys.page_table}
    out = flash4_varlen_function()(
        q, k, v, cu_seqlens_q=nodes.cu_seqlens_q, max_seqlen_q=nodes.max_q, max_seqlen_k=nodes.max_k,
        softmax_scale=scale, causal=True, num_splits=1, pack_gqa=pack_gqa, **key_layout,
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def flash4_varlen_function() -> Callable:
    """FlashAttention-4's `flash_attn_varlen_func` (imported once per process: every eager call asks for it), or a
    RuntimeError that says how to install it."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError as error:
        raise RuntimeError(
            "attention='varlen_fa4' and 'paged_fa4' need FlashAttention-4 on CUDA (`pip install "
            f"'flash-attn-4[cu13]==4.0.0b40'`, in jevlab's `gpu` dependency group): {error}"
        ) from error
    return flash_attn_varlen_func


def node_core(attention: str, device: torch.device) -> Callable:
    """The node-wise attention core of a config's varlen `attention` on a device: FlashAttention-2 (`"varlen"`),
    FlashAttention-4 (`"varlen_fa4"`) or FlashAttention-4 through a page table (`"paged_fa4"`, which takes `PagedKeys`
    and k, v at the packed rows) on CUDA; on any other device the blockwise core, of the same signature."""
    cores = {
        "varlen": (flash_node_core, blockwise_node_core),
        "varlen_fa4": (flash4_node_core, blockwise_node_core),
        "paged_fa4": (flash4_paged_node_core, blockwise_paged_node_core),
    }
    if attention not in cores:
        raise ValueError(f"attention {attention!r} has no node-wise core; the varlen ones are {list(cores)}")
    cuda_core, other_core = cores[attention]
    if torch.device(device).type != "cuda":
        return other_core
    if cuda_core is not flash_node_core:
        flash4_varlen_function()  # refuse at build time, not at the first forward
    return cuda_core
