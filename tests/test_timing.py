"""Timing helpers (ablations/timing.py) on the CPU: interval unions, trace kernel stats and families, host profiles,
sample summaries, floors, ceilings, NVTX layer ranges.
"""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
import torch

from ablations import timing


def test_union_length_counts_overlaps_once():
    assert timing.union_length([]) == 0
    assert timing.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.75), (10, 10)]) == 4.0
    assert timing.union_length([(4, 9), (0, 1), (2, 5)]) == 8.0


def test_kernel_stats_from_a_chrome_trace():
    trace = [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "norm", "ts": 5, "dur": 10},  # overlaps gemm: busy 0..15
        {"cat": "kernel", "name": "gemm", "ts": 20, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 40, "dur": 100},
        {"cat": "kernel", "name": "Memset (Device)", "ts": 40, "dur": 100},
        {"cat": "gpu_memset", "name": "Memset (Unknown)", "ts": 17, "dur": 1},  # in the gap before the second gemm
        {"cat": "gpu_user_annotation", "name": "forward", "ts": 0, "dur": 1000},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},
    ]
    stats = timing.kernel_stats(trace, calls=2)
    assert stats.kernels_per_forward == 1.5
    assert stats.gpu_busy_ms == pytest.approx(25 / 2 / 1e3)
    assert [k["name"] for k in stats.top_kernels] == ["gemm", "norm"]
    assert stats.top_kernels[0] == {"name": "gemm", "calls_per_forward": 1.0, "ms_per_forward": 0.01}
    assert stats.families["gemm"] == {"calls_per_forward": 1.0, "ms_per_forward": 0.01}
    assert stats.families["other"] == {"calls_per_forward": 0.5, "ms_per_forward": 0.005}
    assert stats.core_ms == pytest.approx(0.01)
    assert stats.idle_ms == pytest.approx(5 / 2 / 1e3)  # 15..20 between norm's end and the second gemm
    assert stats.top_gaps == [{"after": "norm", "before": "gemm", "gaps_per_forward": 0.5, "ms_per_forward": 0.0025}]
    assert stats.non_kernel == {  # not kernels, so not in busy time: the memset sits in the gap it explains
        "gpu_memcpy: Memcpy HtoD": {"calls_per_forward": 0.5, "ms_per_forward": pytest.approx(0.05)},
        "kernel: Memset (Device)": {"calls_per_forward": 0.5, "ms_per_forward": pytest.approx(0.05)},
        "gpu_memset: Memset (Unknown)": {"calls_per_forward": 0.5, "ms_per_forward": pytest.approx(0.0005)},
    }


def test_kernel_gaps_merge_overlaps_and_rank_the_pairs():
    """Idle time is counted from the furthest end reached, so a kernel inside another's interval opens no gap, and a
    gap is named by the kernel that reached furthest before it; pairs rank by their idle time per call."""
    kernels = [
        {"name": "a", "ts": 0, "dur": 10},
        {"name": "b", "ts": 2, "dur": 3},  # inside a: no gap, and a stays the kernel before the next gap
        {"name": "c", "ts": 14, "dur": 6},  # 4 after a
        {"name": "a", "ts": 21, "dur": 9},  # 1 after c
        {"name": "c", "ts": 34, "dur": 1},  # 4 after a
        {"name": "d", "ts": 45, "dur": 5},  # 10 after c
    ]
    idle_ms, gaps = timing.kernel_gaps(kernels, calls=2)
    assert idle_ms == pytest.approx((4 + 1 + 4 + 10) / 2 / 1e3)
    assert [(g["after"], g["before"], g["gaps_per_forward"]) for g in gaps] == [("c", "d", 0.5), ("a", "c", 1.0),
                                                                              ("c", "a", 0.5)]  # fmt: skip
    assert gaps[1]["ms_per_forward"] == pytest.approx(8 / 2 / 1e3)
    assert timing.kernel_gaps([], calls=1) == (0.0, [])


@pytest.mark.parametrize(
    "name, family",
    [
        ("nvjet_sm90_tst_256x152_64x4_2x1_v_bz_coopA_TNT", "gemm"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3", "gemm"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn_core"),
        ("chunk_gated_delta_rule_fwd_kkt_solve_kernel", "gdn_core"),
        ("recompute_w_u_fwd_kernel", "gdn_core"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 128, 64, 4>>", "attention_core"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention_core"),
        (  # FlashAttention-4 (CUTLASS's Python DSL: "cutlass" as the GEMMs' names, "flash" first)
            "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensorptrbf16gmem"
            "align16o6i64div8i64div81i64div48_tensor000o111012_tensor000o111012_tensorptrbf16_gm_0",
            "attention_core",
        ),
        (  # FlashInfer's GDN kernel (stage flashinfer_gdn): "flash" in its name too, "delta_rule" first
            "kernel_cutlass_kernel_flashinfergdn_kernelsdelta_rule_dsldelta_rule_sm90_FullyFusedDeltaRuleSm90_object_at"
            "__tensorptrf32gmemalign16o1_tensorptrf32gmemalign16o1_CopyAtom_ThrID10_TVLayoutSr_0",
            "gdn_core",
        ),
        ("_gdn_chunk_fwd_kernel", "gdn_core"),
        ("_attention_gate_kernel", "ours"),
        ("_residual_rmsnorm_kernel", "ours"),
        ("_gdn_prep_kernel", "ours"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>", "other"),
        ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel_generic", "other"),
    ],
)
def test_kernel_family_of_real_kernel_names(name, family):
    """Names as they appear in H200 and H100 profiles (results/runs/*.json top_kernels, the tree gate JSON)."""
    assert timing.kernel_family(name) == family


def test_kernel_families_cover_every_kernel_once():
    rng = random.Random(3)
    names = ["nvjet_a", "chunk_fwd_kernel_o", "flash_fwd", "_silu_mul_kernel", "elementwise_kernel"]
    trace = [{"cat": "kernel", "name": rng.choice(names), "ts": i * 10, "dur": rng.uniform(1, 9)} for i in range(200)]
    stats = timing.kernel_stats(trace, calls=4)
    assert set(stats.families) == set(timing.FAMILIES)
    assert sum(f["calls_per_forward"] for f in stats.families.values()) == stats.kernels_per_forward
    total_ms = sum(e["dur"] for e in trace) / 4 / 1e3
    assert sum(f["ms_per_forward"] for f in stats.families.values()) == pytest.approx(total_ms, rel=1e-12)
    core = sum(stats.families[f]["ms_per_forward"] for f in ("gemm", "gdn_core", "attention_core"))
    assert stats.core_ms == pytest.approx(core, rel=1e-12) and 0 < core < total_ms


def test_host_profile_names_the_function_that_takes_the_time():
    def slow_part() -> float:
        return sum(i * i for i in range(200_000))

    def call() -> None:
        slow_part()
        sorted(range(1000))

    profile = timing.host_profile(call, top=5)
    assert profile["profiled_ms"] > 0
    assert any("slow_part" in row["function"] for row in profile["by_cumulative_time"][:3])
    own = [row["own_ms"] for row in profile["by_own_time"]]
    assert own == sorted(own, reverse=True) and len(own) <= 5
    assert all(row["cumulative_ms"] <= profile["profiled_ms"] * 1.5 for row in profile["by_cumulative_time"])


def test_samples_summary_matches_numpy():
    rng = random.Random(7)
    values = [rng.uniform(1, 50) for _ in range(31)]
    summary = timing.Samples(values).summary()
    assert summary["median_ms"] == statistics.median(values)
    assert summary["p10_ms"] == pytest.approx(np.percentile(values, 10), rel=1e-12)
    assert summary["p90_ms"] == pytest.approx(np.percentile(values, 90), rel=1e-12)
    assert summary["runs"] == 31 and summary["samples_ms"] == values
    assert summary["host_median_ms"] is None
    with_host = timing.Samples(values, host_ms=[v / 2 for v in values]).summary()
    assert with_host["host_median_ms"] == statistics.median(values) / 2


def test_time_calls_on_the_cpu_samples_every_run_after_warmup():
    calls = []
    samples = timing.time_calls(lambda: calls.append(sum(range(1000))), device="cpu", warmup=2, runs=4)
    assert len(calls) == 6 and len(samples.samples_ms) == 4 and all(s > 0 for s in samples.samples_ms)
    with pytest.raises(ValueError):
        timing.time_calls(lambda: None, device="cpu", warmup=0, runs=0)


def test_floors_are_the_larger_of_streaming_and_compute():
    ceilings = {"copy_tbps": 2.0, "bf16_tflops": 1000.0}
    # 2 GB at 2 TB/s = 1 ms; 2e11 flop at 1e15 = 0.2 ms
    few = timing.floors(2 * 10**9, 10**9, rows=100, ceilings=ceilings)
    assert few["weight_floor_ms"] == pytest.approx(1.0) and few["compute_floor_ms"] == pytest.approx(0.2)
    assert few["floor_ms"] == pytest.approx(1.0)
    many = timing.floors(2 * 10**9, 10**9, rows=1000, ceilings=ceilings)
    assert many["floor_ms"] == pytest.approx(2.0) == many["compute_floor_ms"]


def test_ceilings_on_the_cpu_are_positive_rates():
    ceilings = timing.measure_ceilings("cpu", copy_bytes=1 << 20, gemm_n=256, runs=3)
    assert ceilings["copy_tbps"] > 0 and ceilings["bf16_tflops"] > 0 and ceilings["read_tbps"] > 0
    assert len(ceilings["copy_samples_ms"]) == len(ceilings["gemm_samples_ms"]) == len(ceilings["read_samples_ms"]) == 3


def test_ceilings_are_the_best_of_their_probes():
    """Streaming: the larger of the read-only and the copy rate; bf16: the best of the cube and the model's shapes."""
    shapes = {"wide": (512, 64), "deep": (64, 512)}
    ceilings = timing.measure_ceilings("cpu", copy_bytes=1 << 20, gemm_n=64, runs=3, gemm_shapes=shapes, shape_rows=96)
    assert ceilings["stream_tbps"] == max(ceilings["copy_tbps"], ceilings["read_tbps"])
    assert set(ceilings["bf16_shape_tflops"]) == set(shapes) and ceilings["shape_rows"] == 96
    assert ceilings["bf16_tflops"] == max(ceilings["bf16_cube_tflops"], *ceilings["bf16_shape_tflops"].values())
    assert timing.streaming_tbps({"copy_tbps": 2.0}) == 2.0  # a record from before the read-only probe


def test_a_time_under_its_floor_is_a_finding():
    ceilings = {"copy_tbps": 2.0, "stream_tbps": 2.5, "bf16_tflops": 1000.0}
    assert timing.below_floor(1.0, 1.0, ceilings) is None
    finding = timing.below_floor(0.9, 1.0, ceilings)
    assert finding.startswith("0.9 ms is under its floor 1 ms") and "2.5 TB/s" in finding
    assert timing.floors(2 * 10**9, 10**9, rows=1, ceilings=ceilings)["weight_floor_ms"] == pytest.approx(0.8)


def test_layer_ranges_find_layers_and_their_op_families():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.input_layernorm = torch.nn.Identity(), torch.nn.Identity()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])
            self.norm = torch.nn.Identity()

    names = [name for name, _ in timing._layer_modules(Model())]
    assert names == ["layer 0", "layer 0 mlp", "layer 0 input_layernorm", "layer 1", "layer 1 mlp",
                     "layer 1 input_layernorm"]  # fmt: skip
    with timing.layer_ranges(Model(), enabled=False) as count:
        assert count == 0
    with timing.nvtx_range("nothing", enabled=False):
        pass


def test_layer_ranges_hooks_leave_inputs_and_outputs_alone(monkeypatch):
    """nvtx push/pop return the range depth; a hook that passed it on would replace the module's input or output
    (this broke every timed workload of the first H200 run)."""
    import torch

    from ablations import timing

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: 1)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: 0)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(5, 8)
    expected = model(x)

    class Holder:
        pass

    holder = Holder()
    holder.model = model
    with timing.layer_ranges(holder, True) as count:
        got = model(x)
    assert count > 0
    assert torch.equal(got, expected)
