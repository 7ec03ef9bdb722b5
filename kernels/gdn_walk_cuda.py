"""The tree walk of `kernels.gdn_chunk` as a CUDA C++ kernel (`kernels/gdn_walk.cu`), compiled by NVRTC through CuPy
and launched on torch's current stream (so it is captured into CUDA graphs like the Triton launches).

    gdn_walk_cuda(q, k, v, g, beta, o, solved, cu_seqlens, walk, bank, flags, rows, scale)

What it replaces: the second launch of `gdn_chunk_forward` (`_gdn_chunk_fwd_kernel` with TREE and bf16 rounding points),
with `gdn_chunk_forward(..., walk_kernel="cuda")`. The solve launch, its T, the flags it zeroes and the dummy rows of o
it writes are the same. Why CUDA: the Triton walk runs one program per (sequence, value head, value block of 64) with
the state in registers at 255 registers, two programs an SM, and every Triton-level change to its chunk latency failed
(ablations/attempts.toml, `gdn-chunk-walk-*`); here one CTA per (sequence, value head) holds the head's whole state
[128, 128] in the registers of eight state warps (so w is computed once per head, not once per value block), four
output warps compute each chunk's output beside the state chain, and every dot is an mma.sync from ldmatrix'ed shared
memory (the roles, buffers and barriers in the .cu file's header).

Inputs (as `gdn_chunk_forward` checked them): q, k [R, Hk, K] bf16, v [R, Hv, V] bf16, g [R, Hv] fp32, beta [R, Hv]
bf16 (R packed input rows); o [T, Hv, V] bf16 (the output, written in place at the T slots); solved [T, Hv, 64] bf16
(the solve launch's T); cu_seqlens [N + 1], walk [N, 8] and rows [T] (each slot's input row, or None: slot = row)
int64; bank [N + 1, Hv, K, V] fp32 (the published states); flags int32 [1 + (N + 1) · Hv] (the ticket counter, then
one flag per (bank slot, value head)), zeroed by the solve launch. Requires K = V = 128, 16-byte aligned tensors, a
CUDA device with CuPy. `supports` says whether a call qualifies; `gdn_chunk_forward` refuses the option otherwise.

Rounding points: those of `kernels.gdn_chunk` (bf16 K β, K̃, Ṽ, w, u, Sb, the masked Q Kᵀ, v', its decayed copy, o;
fp32 state and v'), at the same places; 2^x is `ex2.approx.ftz.f32` as Triton's `tl.exp2`. Not bitwise with the
Triton walk: the dots accumulate in mma.sync's order (m16n8k16 steps along K) where Triton's wgmma takes k16 steps of
a different instruction, and γ's in-chunk cumsum is a warp scan of row pairs. Exactness: bounded against the fp32
oracle like the Triton walk (tests/test_gpu_gdn_chunk.py, `test_cuda_walk_*`); bitwise: batching, padding (the
sequences' bits depend on their own rows only: one CTA per sequence and head, no cross-CTA reduction), the tree walk
against the same kernel without sharing (every path from its first chunk) at every representative slot, five runs,
graph replay = eager. No CPU test: NVRTC and mma.sync need a GPU; the CPU suite runs the Triton walk, whose math this
kernel mirrors step for step.

Versions: the .cu file's header.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("gdn_walk.cu")
THREADS = 384  # the .cu file's (STATE_WARPS + OUTPUT_WARPS) * 32
CHUNK = 64
PAD = 8  # bf16 elements of padding per shared row (the .cu file's LDS and LDT)


def shared_bytes(key_dim: int, value_dim: int) -> int:
    """Dynamic shared memory of one CTA (the .cu file's layout): nine [64, K + 8] bf16 tiles (K and Q twice, V, K̃
    (later the decayed v'), Ṽ, v', w), Sb [K, V + 8] bf16, T [64, 72] bf16 twice, five [64] fp32 gate rows (γ and 2^γ
    twice, β), [64] int64 input rows twice and the ticket."""
    tiles = 9 * CHUNK * (key_dim + PAD) * 2 + key_dim * (value_dim + PAD) * 2 + 2 * CHUNK * (CHUNK + PAD) * 2
    return tiles + 5 * CHUNK * 4 + 2 * CHUNK * 8 + 16


def supports(q: torch.Tensor, v: torch.Tensor, *tensors: torch.Tensor | None) -> str | None:
    """None when the CUDA walk can run this call, else why not."""
    if q.device.type != "cuda":
        return "the CUDA walk runs on CUDA devices only"
    if q.shape[2] != 128 or v.shape[2] != 128:
        return f"the CUDA walk is built for K = V = 128, got K = {q.shape[2]}, V = {v.shape[2]}"
    for t in (q, v, *tensors):
        if t is not None and t.data_ptr() % 16:
            return "the CUDA walk needs 16-byte aligned tensors (vector loads)"
    return None


@functools.cache
def _kernel(key_dim: int, value_dim: int, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        code = f"#define KEY_DIM {key_dim}\n#define VALUE_DIM {value_dim}\n" + SOURCE.read_text()
        function = cupy.RawModule(code=code, options=("--std=c++17",)).get_function("gdn_walk_kernel")
        function.max_dynamic_shared_size_bytes = shared_bytes(key_dim, value_dim)
    return function


def _pointer(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def gdn_walk_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    o: torch.Tensor,
    solved: torch.Tensor,
    cu_seqlens: torch.Tensor,
    walk: torch.Tensor,
    bank: torch.Tensor,
    flags: torch.Tensor,
    rows: torch.Tensor | None,
    scale: float,
) -> None:
    """One launch of N · Hv CTAs (each takes a ticket: the walk's k-th group of Hv tickets runs sequence walk[k, 0])
    on torch's current stream. Inputs: module docstring; `gdn_chunk_forward` checks them."""
    import cupy

    key_heads, key_dim = q.shape[1], q.shape[2]
    value_heads, value_dim = v.shape[1], v.shape[2]
    for name, t in (("cu_seqlens", cu_seqlens), ("walk", walk), ("rows", rows)):
        if t is not None and t.dtype != torch.int64:
            raise ValueError(f"gdn_walk_cuda: {name} must be int64, got {t.dtype}")
    function = _kernel(key_dim, value_dim, q.device.index or 0)
    args = (
        *(_pointer(t) for t in (q, k, v, g, beta, o, solved, cu_seqlens, walk, bank, flags, rows)),
        np.float32(scale),
        np.int32(key_heads),
        np.int32(value_heads),
    )
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream, q.device.index or 0):
        function((walk.shape[0] * value_heads,), (THREADS,), args, shared_mem=shared_bytes(key_dim, value_dim))
