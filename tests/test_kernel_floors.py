"""`ablations.kernel_bytes` and `measure.kernel_floors`: the bytes-moved floors of the prep and element-wise kernels
(issue 22, item 3), on the drone bucket's sizes and on a small record built here."""

from __future__ import annotations

import pytest

from ablations import kernel_bytes
from ablations.timing import KERNEL_FAMILIES
from measure import kernel_floors
from reference.shapes import QWEN38_27B as S

N, L, K = 352, 1074, 2500  # the drone bucket r352-s1074-c8
GDN_ROW = (2 * 2048 + 6144) * 2 + 48 * (4 + 2)  # q, k, v bf16; g fp32, beta bf16


def test_bytes_per_call_at_the_drone_bucket():
    assert kernel_floors.bucket_sizes("r352-s1074-c8") == {"rows": N, "slots": L, "keys": K}
    assert kernel_bytes.residual_rmsnorm_bytes(N) == 4 * N * 5120 * 2 + 5120 * 2
    params = 10240 * 4 * 2 + 48 * 4 + 48 * 2  # conv weight bf16, A_log fp32, dt_bias bf16
    assert kernel_bytes.gdn_prep_bytes(N, N) == N * (10240 + 96) * 2 + params + N * 8 + N * GDN_ROW
    assert kernel_bytes.gdn_prep_bytes(N, L) == N * (10240 + 96) * 2 + params + L * 8 + L * GDN_ROW
    assert kernel_bytes.gather_slots_bytes(N, L) == N * GDN_ROW + L * 8 + L * GDN_ROW
    assert kernel_bytes.gated_rmsnorm_bytes(N) == 3 * N * 48 * 128 * 2 + N * 8 + 128 * 4
    q, kv = S.num_attention_heads * S.head_dim, S.num_key_value_heads * S.head_dim
    reads = N * (q + 2 * kv) * 2 + 2 * 256 * 2 + 2 * N * S.rotary_dim * 2 + K * 8
    assert kernel_bytes.attn_prep_bytes(N, K) == reads + N * q * 2 + K * 2 * kv * 2
    assert kernel_bytes.attention_gate_bytes(N) == 3 * N * 24 * 256 * 2
    assert kernel_bytes.silu_mul_bytes(N) == N * (2 * 17408 + 17408) * 2
    with pytest.raises(ValueError, match="no bucket"):
        kernel_floors.bucket_sizes("r1-s1-c1")


def test_every_kernel_of_ours_has_a_model():
    """Each name of the runner's `ours` family is exactly one kernel of KERNELS, and each kernel has a byte model."""
    assert all(sum(key in kernel for kernel in kernel_bytes.KERNELS) == 1 for key in KERNEL_FAMILIES["ours"])
    assert tuple(kernel_bytes.call_bytes(N, L, K)) == kernel_bytes.KERNELS


def test_floors_of_a_record():
    top = [{"name": "_silu_mul_kernel", "calls_per_forward": 64.0, "ms_per_forward": 0.64}]
    workload = {"id": "drone", "graph": {"bucket": "r352-s1074-c8"}, "top_kernels": top}
    eager = {"id": "long", "graph": {"bucket": None}, "top_kernels": []}
    record = {"ceilings": {"copy_tbps": 4.0}, "stages": [{"name": "core", "workloads": [workload, eager]}]}
    with pytest.raises(ValueError, match="no stage 'graphs'"):
        kernel_floors.floors(record)
    table = kernel_floors.floors(record, "core")
    assert [row["kernel"] for row in table] == list(kernel_bytes.KERNELS)
    assert {row["workload"] for row in table} == {"drone"}
    rows = {row["kernel"]: row for row in table}
    silu = rows["_silu_mul_kernel"]
    assert silu["floor_us"] == pytest.approx(kernel_bytes.silu_mul_bytes(N) / 4e12 * 1e6)
    assert silu["measured_us"] == pytest.approx(10.0) and silu["multiple"] == pytest.approx(10.0 / silu["floor_us"])
    assert all(row["measured_us"] is None and row["multiple"] is None for row in table if row is not silu)
    assert rows["_gdn_prep_kernel"]["bytes"] == kernel_bytes.gdn_prep_bytes(N, N)
    gather = rows["_gather_slots_kernel"]
    assert gather["per_row_floor_us"] == pytest.approx(kernel_bytes.gather_slots_bytes(N, N) / 4e12 * 1e6)
    assert gather["per_row_floor_us"] < gather["floor_us"]
    assert rows["_attn_prep_kernel"]["bytes"] == kernel_bytes.attn_prep_bytes(N, K)
    record["stages"][0]["registry"] = {"config": {"attention": "paged_fa4"}}  # stage `paged`: k and v at the rows
    paged = {row["kernel"]: row for row in kernel_floors.floors(record, "core")}
    assert paged["_attn_prep_kernel"]["bytes"] == kernel_bytes.attn_prep_bytes(N, N)
    assert paged["_gdn_prep_kernel"]["bytes"] == rows["_gdn_prep_kernel"]["bytes"]
    record["stages"][0]["registry"] = {"config": {"attention": "varlen_fa4", "gdn_core": "flashinfer"}}
    arena = {row["kernel"]: row for row in kernel_floors.floors(record, "core")}
    # stage `flashinfer_gdn`: drone's arena holds 602 rows (the probe's `arena_rows`, results/gdn-chunk/*e85e07c.json)
    # and the gather writes 64 slots more, with beta in fp32 (48 heads x 2 bytes a slot more)
    assert kernel_floors.arena_slots("drone", "r352-s1074-c8") == 602 + 64 == arena["_gather_slots_kernel"]["slots"]
    assert arena["_gather_slots_kernel"]["bytes"] == N * GDN_ROW + 666 * 8 + 666 * (GDN_ROW + 48 * 2)
    assert arena["_attn_prep_kernel"]["bytes"] == rows["_attn_prep_kernel"]["bytes"]
    # easy-intent-00's arena: 368 rows and 64 more would pass its bucket's 430 slots, where the plan stops the gather
    assert kernel_floors.arena_slots("jevbench/easy-intent-00", "r208-s430-c6") == 430


def test_the_gdn_core_budget_of_a_record():
    """The GDN core's budget for a non-GEMM target: the target less the other families, with this lab's kernels as
    measured, capped at 1.5x their floor and at their floor; us a GDN layer (48 in the 27B); the speed-up asked of
    the stage's core and of graphs'; none where the target leaves nothing."""
    silu_us = 20.0
    families = {"gemm": 20.0, "gdn_core": 3.0, "ours": 2.0, "attention_core": 0.4, "other": 0.1}
    top = [{"name": "_silu_mul_kernel", "calls_per_forward": 64.0, "ms_per_forward": 64 * silu_us / 1000}]
    core = {"id": "drone", "graph": {"bucket": "r352-s1074-c8"}, "top_kernels": top,
            "kernel_families": {name: {"ms_per_forward": ms} for name, ms in families.items()}}  # fmt: skip
    graphs = {"id": "drone", "kernel_families": {"gdn_core": {"ms_per_forward": 6.0}}}
    record = {"ceilings": {"copy_tbps": 4.0},
              "stages": [{"name": "graphs", "workloads": [graphs]}, {"name": "core", "workloads": [core]}]}  # fmt: skip
    floor_us = kernel_bytes.silu_mul_bytes(N) / 4e12 * 1e6
    rows = {row["ours"]: row for row in kernel_floors.gdn_core_budget(record, "core", {"drone": 5.0})}
    assert list(rows) == ["measured", "capped", "floor"]
    assert rows["measured"]["budget_ms"] == pytest.approx(5.0 - 0.5 - 2.0)
    assert rows["capped"]["ours_ms"] == pytest.approx(2.0 - 64 * (silu_us - 1.5 * floor_us) / 1000)
    assert rows["floor"]["ours_ms"] == pytest.approx(2.0 - 64 * (silu_us - floor_us) / 1000)
    for row in rows.values():
        assert row["budget_ms"] == pytest.approx(5.0 - 0.5 - row["ours_ms"])
        assert row["budget_us_a_layer"] == pytest.approx(1000 * row["budget_ms"] / 48)
        assert row["speedup_asked"] == pytest.approx(3.0 / row["budget_ms"])
        assert row["speedup_over_graphs"] == pytest.approx(6.0 / row["budget_ms"])
    hopeless = kernel_floors.gdn_core_budget(record, "core", {"drone": 2.0})[0]
    assert hopeless["budget_ms"] < 0 and hopeless["speedup_asked"] is None and hopeless["speedup_over_graphs"] is None
    with pytest.raises(ValueError, match="no workload 'long'"):
        kernel_floors.gdn_core_budget(record, "core", {"long": 5.0})
    with pytest.raises(SystemExit):
        kernel_floors.main(["record.json", "--budget", "drone:5"])


def test_the_forward_budget_of_a_record():
    """A forward target less the GEMMs and the time between kernels (median less GPU-busy) is the non-GEMM budget;
    with this lab's kernels at their floors, attention and the rest as measured, the rest of it is the GDN core's."""
    top = [{"name": "_silu_mul_kernel", "calls_per_forward": 64.0, "ms_per_forward": 64 * 20.0 / 1000}]
    families = {"gemm": 20.0, "gdn_core": 3.0, "ours": 2.0, "attention_core": 0.4, "other": 0.1}
    core = {
        "id": "drone",
        "graph": {"bucket": "r352-s1074-c8"},
        "top_kernels": top,
        "median_ms": 27.0,
        "gpu_busy_ms": 25.5,
        "kernel_families": {name: {"ms_per_forward": ms} for name, ms in families.items()},
    }
    record = {"ceilings": {"copy_tbps": 4.0}, "stages": [{"name": "core", "workloads": [core]}]}  # fmt: skip
    row = kernel_floors.forward_budget(record, "core", {"drone": 24.0})[0]
    assert row["between_kernels_ms"] == pytest.approx(1.5) and row["non_gemm_ms"] == pytest.approx(5.5)
    assert row["non_gemm_budget_ms"] == pytest.approx(24.0 - 20.0 - 1.5)
    floor = kernel_floors.gdn_core_budget(record, "core", {"drone": 2.5})[-1]
    assert floor["ours"] == "floor" and row["gdn_core_ms"] == 3.0
    assert row["gdn_core_budget_ms_others_at_floor"] == pytest.approx(floor["budget_ms"])
    assert floor["budget_ms"] == pytest.approx(2.5 - 0.5 - floor["ours_ms"])
    with pytest.raises(ValueError, match="no stage 'graphs'"):
        kernel_floors.forward_budget(record, "graphs", {"drone": 24.0})
    with pytest.raises(ValueError, match="no workload 'long'"):
        kernel_floors.forward_budget(record, "core", {"long": 24.0})
