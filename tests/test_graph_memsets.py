"""Tests of the memset replacement (engine/graph_memsets.py): on the CPU, the fill view and value a memset's parameters
give; on the GPU, a graph whose memset nodes (cudaMemsetAsync and cudaMemset2DAsync captured between torch kernels)
become fill kernels: no memset node left, the same bytes after a replay as the captured graph's, on NaN-poisoned and
random buffers. The probe `measure.gemm_gap_probe` checks the same on the table's GEMMs (`table-memset-kernels`
bitwise against `table`)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.graph_memsets import MEMSET, FillView, fill_view_spec


def test_a_byte_memset_is_a_uint8_fill_of_its_width():
    assert fill_view_spec(4096, 0, 0, 1, 1000, 1) == FillView(4096, "uint8", 1, 1000, 1000, 0)
    assert fill_view_spec(4096, 0, 0x1FF, 1, 7, 1).value == 0xFF  # truncated to the element, as the memset does


def test_wider_memsets_fill_their_signed_integer():
    """torch fills int16 / int32, not uint16 / uint32: a value with the top bit set is that integer's negative."""
    assert fill_view_spec(0, 0, 0xFFFFFFFF, 4, 3, 1) == FillView(0, "int32", 1, 3, 3, -1)
    assert fill_view_spec(0, 0, 0x7FFFFFFF, 4, 3, 1).value == 0x7FFFFFFF
    assert fill_view_spec(0, 0, 0x18001, 2, 5, 1) == FillView(0, "int16", 1, 5, 5, -32767)


def test_a_2d_memset_strides_its_rows_by_the_pitch():
    assert fill_view_spec(256, 512, 3, 4, 10, 6) == FillView(256, "int32", 6, 10, 128, 3)
    with pytest.raises(ValueError, match="pitch"):
        fill_view_spec(256, 510, 3, 4, 10, 6)
    with pytest.raises(ValueError, match="element size"):
        fill_view_spec(256, 0, 3, 8, 10, 1)


def _cudart():
    from engine.graph_memsets import _runtime

    return _runtime()


@pytest.mark.gpu
def test_gpu_memset_nodes_become_fills_with_the_same_bytes():
    """kernel -> memset (1D, int32) -> kernel -> memset (2D, bytes, rows a pitch apart) -> kernel reading both: after
    the replacement no memset node is left, and a replay writes the captured graph's bits."""
    from engine.graph_memsets import memsets_as_kernels

    cuda = _cudart()
    drv = ctypes.CDLL("libcuda.so.1")
    device = torch.device("cuda")
    outputs = {}
    for replace in (False, True):
        gen = torch.Generator(device=device).manual_seed(5)  # the same inputs both times
        buf = torch.full((3000,), float("nan"), device=device)  # poisoned: what the memsets do not set stays NaN
        grid = torch.randn(37, 64, device=device, generator=gen)
        x = torch.randn(3000, device=device, generator=gen)
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            buf.mul_(2.0)
            raw = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            one = ctypes.c_uint(0x3F800000)  # 1.0f
            assert drv.cuMemsetD32Async(ctypes.c_uint64(buf.data_ptr() + 4 * 101), one, ctypes.c_size_t(1001), raw) == 0
            y = buf.nan_to_num(0.0) + x
            pitch, start = ctypes.c_size_t(grid.stride(0) * 4), ctypes.c_uint64(grid.data_ptr() + 4 * 3)
            byte, width, height = ctypes.c_ubyte(0x5A), ctypes.c_size_t(40), ctypes.c_size_t(30)
            assert drv.cuMemsetD2D8Async(start, pitch, byte, width, height, raw) == 0
            out = y.sum() + grid.sum() + buf[:2000].nan_to_num(7.0).sum()
        raw_graph = graph.raw_cuda_graph()
        assert [cuda.node_type(n) for n in cuda.nodes(raw_graph)].count(MEMSET) == 2
        if replace:
            assert memsets_as_kernels(raw_graph, device) == 2
            assert MEMSET not in [cuda.node_type(n) for n in cuda.nodes(raw_graph)]
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        outputs[replace] = [t.clone() for t in (out, buf, grid, y)]
    buf, grid = outputs[True][1], outputs[True][2]
    assert buf[101:1102].eq(1.0).all() and buf[:101].isnan().all() and buf[1102:].isnan().all()
    assert grid.view(torch.uint8)[:30, 12:52].eq(0x5A).all()  # the 2D memset's 40 bytes of each of its 30 rows
    for captured, replaced in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(captured.view(torch.int32), replaced.view(torch.int32))
