"""Hoisting a library's memset nodes in a captured CUDA graph off the kernel chain (CUDA only; ctypes, no new package).

Why. Some cuBLASLt algorithms of the GEMM table are preceded by a memset node that cuBLASLt puts in front of its
kernel (0.8 us on an H100), and a captured graph runs it in the stream's order: this lab's Triton kernel that writes
the GEMM's input, then the memset, then the GEMM. The memset and its two hand-offs cost 5-6 us of idle GPU before each
such call (engine/stages/gemm.md, "The idle before some cuBLASLt kernels": 0.4 ms of drone's forward, 0.7 of
customer_service's). The memset does not read the Triton kernel's output, so it may run beside it.

What `hoist_memsets(graph)` does to a graph (a `cudaGraph_t` before instantiation, e.g. `CUDAGraph(keep_graph=True)
.raw_cuda_graph()`): for every memset node M with one predecessor P and one successor G, where P and G are kernel nodes
and P is one of this lab's Triton kernels (its function name `_<name>_kernel`, as every kernel under kernels/ is
named), the edge P -> M is replaced by P's own predecessors -> M, and P -> G is added. M then runs beside P, after
everything that ran before P (the previous GEMM among it, the last one that could have used the workspace M clears),
and still before G. A Triton kernel never touches cuBLASLt's workspace, so nothing that runs beside M reads or writes
what it clears. Every other node and edge is left as captured; a graph without such memsets is returned unchanged.
Returns the number of memset nodes moved.

Exactness: the same kernels and memsets on the same addresses, each still after everything it reads: a replay's bits
are the captured graph's. Tests: which edges move, on made-up graphs (tests/test_graph_memsets.py, CPU); on the GPU
`measure.gemm_gap_probe` exits 1 unless its hoisted graph's output equals the captured one's bit for bit, and stage
gemm's GPU tests hold its graphs (which carry the moved memsets) bitwise against `graphs`
(tests/test_gpu_gemm_tuned.py).

The runtime API is called through ctypes on the libcudart torch loaded (CUDA 12.3+ for the edge-data signatures, whose
names CUDA 13 took over), the kernel names through the driver's `cuFuncGetName`; a node whose name cannot be read is
not touched.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
from collections.abc import Callable

MEMSET, KERNEL = 2, 0  # cudaGraphNodeType
LAB_KERNEL = re.compile(r"_[a-z0-9_]+_kernel")  # kernels/: `_residual_rmsnorm_kernel`, `_silu_mul_kernel`, ...


class _Runtime:
    """The few runtime and driver calls the hoist needs, with their CUDA 12.3+ / 13 signatures."""

    def __init__(self) -> None:
        self.rt = _load(("libcudart.so.13", "libcudart.so.12"), "libcudart.so*")
        self.drv = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        self._check(self.rt.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.v13 = version.value >= 13000  # CUDA 13 renamed the `_v2` edge-data calls to the base names
        if version.value < 12030:
            raise RuntimeError(f"hoist_memsets needs CUDA 12.3+ (edge data calls), runtime is {version.value}")

    def _fn(self, name: str):
        return getattr(self.rt, name if self.v13 else f"{name}_v2")

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned CUDA error {status}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t()
        self._check(self.rt.cudaGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cudaGraphGetNodes")
        array = (ctypes.c_void_p * count.value)()
        self._check(self.rt.cudaGraphGetNodes(ctypes.c_void_p(graph), array, ctypes.byref(count)), "cudaGraphGetNodes")
        return [int(n) for n in array[: count.value]]

    def edges(self, graph: int) -> list[tuple[int, int]]:
        get = self._fn("cudaGraphGetEdges")
        count = ctypes.c_size_t()
        self._check(get(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)), "cudaGraphGetEdges")
        sources, targets = (ctypes.c_void_p * count.value)(), (ctypes.c_void_p * count.value)()
        self._check(get(ctypes.c_void_p(graph), sources, targets, None, ctypes.byref(count)), "cudaGraphGetEdges")
        return [(int(a), int(b)) for a, b in zip(sources[: count.value], targets[: count.value], strict=True)]

    def node_type(self, node: int) -> int:
        kind = ctypes.c_int()
        self._check(self.rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        return kind.value

    def kernel_name(self, node: int) -> str | None:
        """The kernel's function name through the driver (its node params start with the CUfunction), or None."""
        params = (ctypes.c_void_p * 32)()  # larger than CUDA_KERNEL_NODE_PARAMS(_v2); only its first field is read
        get = getattr(self.drv, "cuGraphKernelNodeGetParams_v2", None) or self.drv.cuGraphKernelNodeGetParams
        if get(ctypes.c_void_p(node), params) != 0 or not params[0]:
            return None
        name = ctypes.c_char_p()
        if self.drv.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0])) != 0 or not name.value:
            return None
        return name.value.decode()

    def move_edges(self, graph: int, removed: list[tuple[int, int]], added: list[tuple[int, int]]) -> None:
        for call, pairs in (("cudaGraphRemoveDependencies", removed), ("cudaGraphAddDependencies", added)):
            if not pairs:
                continue
            sources = (ctypes.c_void_p * len(pairs))(*[a for a, _ in pairs])
            targets = (ctypes.c_void_p * len(pairs))(*[b for _, b in pairs])
            self._check(self._fn(call)(ctypes.c_void_p(graph), sources, targets, None, ctypes.c_size_t(len(pairs))),
                        call)  # fmt: skip


@functools.cache
def _runtime() -> _Runtime:
    return _Runtime()


def _load(names: tuple[str, ...], pattern: str) -> ctypes.CDLL:
    """The library by soname (the one torch already loaded), else the first match under torch's nvidia wheels."""
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    for path in sorted(glob.glob(os.path.join(site, "nvidia", "**", pattern), recursive=True)):
        return ctypes.CDLL(path)
    raise RuntimeError(f"no {names[0]} found (loaded or under {site}/nvidia)")


def memset_moves(
    nodes: list[int], edges: list[tuple[int, int]], kind: Callable[[int], int], name: Callable[[int], str | None]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(edges to remove, edges to add) that move each memset beside the lab's Triton kernel in front of it (module
    docstring), from a graph's `nodes`, its `edges` (a, b): b depends on a, each node's `kind` (cudaGraphNodeType) and
    a kernel node's function `name` (None when unknown). Pure: the CPU tests run it on made-up graphs."""
    preds: dict[int, list[int]] = {}
    succs: dict[int, list[int]] = {}
    for a, b in edges:
        succs.setdefault(a, []).append(b)
        preds.setdefault(b, []).append(a)
    removed, added = [], []
    for node in nodes:
        if kind(node) != MEMSET or len(preds.get(node, [])) != 1 or len(succs.get(node, [])) != 1:
            continue
        before, after = preds[node][0], succs[node][0]
        if kind(before) != KERNEL or kind(after) != KERNEL:
            continue
        label = name(before)
        if label is None or not LAB_KERNEL.fullmatch(label):
            continue
        removed.append((before, node))
        added += [(earlier, node) for earlier in preds.get(before, [])] + [(before, after)]
    return removed, added


def hoist_memsets(graph: int) -> int:
    """Move each library memset that follows one of this lab's Triton kernels beside it (module docstring); returns
    how many moved. `graph`: a cudaGraph_t address, not yet instantiated (or instantiated again afterwards)."""
    cuda = _runtime()
    removed, added = memset_moves(cuda.nodes(graph), cuda.edges(graph), cuda.node_type, cuda.kernel_name)
    cuda.move_edges(graph, removed, added)
    return len(removed)
