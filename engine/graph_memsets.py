"""A library's memset nodes in a captured CUDA graph replaced by kernels that write the same bytes (CUDA only; ctypes).

Why. Some cuBLASLt algorithms of the GEMM table put a memset node in front of their kernel (0.8 us on an H100), and
the GPU sits idle 5-6 us before each such GEMM in the engine's graphs, against 0.3-0.5 us before `F.linear`'s kernels
(engine/stages/gemm.md, "The idle before some cuBLASLt kernels": 0.4 ms of drone's forward, 0.7 of
customer_service's). Moving the memset beside the Triton kernel before it left the idle as it was (attempt
`graph-memsets-beside-the-norm`); what is left of the memset's part is the node's kind: a memset node, not a kernel,
in a chain of kernels. Here each memset node becomes a kernel node (torch's fill kernel over the memset's own bytes),
so the chain is kernels only. Measured on an H100 (campaign 66, 9bdfdda: `measure.gemm_gap_probe`, variant
`table-memset-kernels`): the 5.6-5.9 us before the gate_up GEMM became 1.8-1.9 us (norm, fill kernel of 1.0 us, GEMM),
the idle of a layer's MLP half 7.5 -> 2.6-3.0 us, `F.linear`'s; in the forward (425c013) `core`'s idle between kernels
fell to `graphs`' (drone 0.34 ms against 0.68-0.70). `engine.graphs.capture_forward` applies it to every graph.

What `memsets_as_kernels(graph, device)` does to a graph (a `cudaGraph_t` before instantiation, e.g.
`CUDAGraph(keep_graph=True).raw_cuda_graph()`): for every memset node M, the fill `view.fill_(value)` of a torch view
over M's destination (its pitch, element size, width and height) is captured into the graph after M's predecessors
(`cudaStreamBeginCaptureToGraph`), the new node gets M's successors, and M is destroyed. Every other node and edge is
left as captured. Returns the number of memset nodes replaced.

Exactness: the same bytes get the same value at the same point of the graph's order (after everything M waited for,
before everything that waited for M): a replay's bits are the captured graph's. Tests: the view and the value of a
memset's parameters (`fill_view_spec`, tests/test_graph_memsets.py, CPU); on the GPU `measure.gemm_gap_probe` exits 1
unless `table-memset-kernels`' output equals `table`'s bit for bit.

The runtime API is called through ctypes on the libcudart torch loaded (CUDA 12.3+ for the capture into an existing
graph).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from dataclasses import dataclass

MEMSET = 2  # cudaGraphNodeType
CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
DTYPE_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32"}  # a memset's element size -> the torch dtype the fill writes


class _MemsetParams(ctypes.Structure):
    _fields_ = [  # cudaMemsetParams
        ("dst", ctypes.c_void_p),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


@dataclass(frozen=True)
class FillView:
    """The torch view a memset writes: `height` rows of `width` elements of `dtype`, rows `row_stride` elements
    apart, starting at `dst`; every element set to `value` (the memset's value as that dtype's integer)."""

    dst: int
    dtype: str
    height: int
    width: int
    row_stride: int
    value: int


def fill_view_spec(dst: int, pitch: int, value: int, element_size: int, width: int, height: int) -> FillView:
    """The fill that writes what `cudaMemsetParams(dst, pitch, value, elementSize, width, height)` writes: width and
    height in elements, pitch in bytes (CUDA's 2D memset). The value is truncated to the element size, as the memset
    does, and read as the signed integer of the fill's dtype (int16, int32: torch fills those, not uint16 / uint32)."""
    if element_size not in DTYPE_OF_SIZE:
        raise ValueError(f"memset element size {element_size} is not 1, 2 or 4")
    if height > 1 and pitch % element_size:
        raise ValueError(f"memset pitch {pitch} is not a multiple of its element size {element_size}")
    bits = 8 * element_size
    value &= (1 << bits) - 1
    if element_size > 1 and value >= 1 << (bits - 1):
        value -= 1 << bits
    row_stride = pitch // element_size if height > 1 else width
    return FillView(dst, DTYPE_OF_SIZE[element_size], height, width, row_stride, value)


class _Runtime:
    """The few runtime calls the replacement needs, with their CUDA 12.3+ / 13 signatures."""

    def __init__(self) -> None:
        self.rt = _load(("libcudart.so.13", "libcudart.so.12"), "libcudart.so*")
        version = ctypes.c_int()
        self._check(self.rt.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.v13 = version.value >= 13000  # CUDA 13 renamed the `_v2` edge-data calls to the base names
        if version.value < 12030:
            raise RuntimeError(
                f"memsets_as_kernels needs CUDA 12.3+ (capture into a graph), runtime is {version.value}"
            )

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

    def _neighbours(self, call: str, node: int) -> list[int]:
        get = self._fn(call)
        count = ctypes.c_size_t()
        self._check(get(ctypes.c_void_p(node), None, None, ctypes.byref(count)), call)
        array = (ctypes.c_void_p * count.value)()
        self._check(get(ctypes.c_void_p(node), array, None, ctypes.byref(count)), call)
        return [int(n) for n in array[: count.value]]

    def predecessors(self, node: int) -> list[int]:
        return self._neighbours("cudaGraphNodeGetDependencies", node)

    def successors(self, node: int) -> list[int]:
        return self._neighbours("cudaGraphNodeGetDependentNodes", node)

    def node_type(self, node: int) -> int:
        kind = ctypes.c_int()
        self._check(self.rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        return kind.value

    def memset_params(self, node: int) -> _MemsetParams:
        params = _MemsetParams()
        self._check(self.rt.cudaGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(params)), "memset params")
        return params

    def capture_after(self, graph: int, stream: int, after: list[int]) -> None:
        deps = (ctypes.c_void_p * max(1, len(after)))(*after)
        self._check(
            self.rt.cudaStreamBeginCaptureToGraph(
                ctypes.c_void_p(stream), ctypes.c_void_p(graph), deps, None, ctypes.c_size_t(len(after)),
                ctypes.c_int(CAPTURE_RELAXED),
            ),
            "cudaStreamBeginCaptureToGraph",
        )  # fmt: skip

    def end_capture(self, stream: int) -> None:
        out = ctypes.c_void_p()
        self._check(self.rt.cudaStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(out)), "cudaStreamEndCapture")

    def add_edges(self, graph: int, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        sources = (ctypes.c_void_p * len(pairs))(*[a for a, _ in pairs])
        targets = (ctypes.c_void_p * len(pairs))(*[b for _, b in pairs])
        call = "cudaGraphAddDependencies"
        self._check(self._fn(call)(ctypes.c_void_p(graph), sources, targets, None, ctypes.c_size_t(len(pairs))), call)

    def destroy(self, node: int) -> None:
        self._check(self.rt.cudaGraphDestroyNode(ctypes.c_void_p(node)), "cudaGraphDestroyNode")


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


class _DeviceSpan:
    """Device memory as `__cuda_array_interface__` (version 3), so that torch can view it without a copy."""

    def __init__(self, view: FillView, device) -> None:
        import torch

        itemsize = torch.empty((), dtype=getattr(torch, view.dtype)).element_size()
        typestr = {"uint8": "|u1", "int16": "<i2", "int32": "<i4"}[view.dtype]
        self.__cuda_array_interface__ = {
            "shape": (view.height, view.width),
            "strides": (view.row_stride * itemsize, itemsize),
            "typestr": typestr,
            "data": (view.dst, False),
            "version": 3,
        }


def memsets_as_kernels(graph: int, device) -> int:
    """Replace every memset node of `graph` (a cudaGraph_t address, not instantiated) by a fill kernel node that
    writes the same bytes at the same point of the order (module docstring); returns how many were replaced."""
    import torch

    cuda = _runtime()
    stream = torch.cuda.Stream(device)
    replaced = 0
    for node in cuda.nodes(graph):
        if cuda.node_type(node) != MEMSET:
            continue
        p = cuda.memset_params(node)
        view = fill_view_spec(p.dst, p.pitch, p.value, p.elementSize, p.width, p.height)
        target = torch.as_tensor(_DeviceSpan(view, device), device=device)
        before, after = cuda.predecessors(node), cuda.successors(node)
        existing = set(cuda.nodes(graph))
        cuda.capture_after(graph, stream.cuda_stream, before)
        try:
            with torch.cuda.stream(stream):
                target.fill_(view.value)
        finally:
            cuda.end_capture(stream.cuda_stream)
        added = [n for n in cuda.nodes(graph) if n not in existing]
        if len(added) != 1:
            raise RuntimeError(f"the fill replacing a memset captured {len(added)} nodes, not one")
        cuda.add_edges(graph, [(added[0], succ) for succ in after])
        cuda.destroy(node)
        replaced += 1
    return replaced
