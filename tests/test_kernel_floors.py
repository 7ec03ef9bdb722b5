"""`measure.kernel_floors`: the bytes-moved floors of the prep and element-wise kernels (issue 22, item 3), on the
drone bucket's sizes and on a small record built here."""

from __future__ import annotations

import pytest

from measure import kernel_floors
from reference.shapes import QWEN38_27B as S


def test_bytes_per_call_at_the_drone_bucket():
    assert kernel_floors.bucket_sizes("r352-s1074-c8") == {"rows": 352, "slots": 1074, "keys": 2500}
    assert kernel_floors.silu_mul_bytes(352) == 352 * (2 * 17408 + 17408) * 2
    proj_read = 352 * (10240 + 96) * 2 + 10240 * 4 * 2 + 1074 * 8
    assert kernel_floors.gdn_prep_bytes(352, 1074) == proj_read + 1074 * ((2 * 2048 + 6144) * 2 + 48 * 6)
    q, kv = S.num_attention_heads * S.head_dim, S.num_key_value_heads * S.head_dim
    reads = 352 * (q + 2 * kv) * 2 + 2 * 352 * S.rotary_dim * 2 + 2500 * 8
    assert kernel_floors.attn_prep_bytes(352, 2500) == reads + 352 * q * 2 + 2500 * 2 * kv * 2
    with pytest.raises(ValueError, match="no bucket"):
        kernel_floors.bucket_sizes("r1-s1-c1")


def test_floors_of_a_record():
    top = [{"name": "_silu_mul_kernel", "calls_per_forward": 64.0, "ms_per_forward": 0.64}]
    workload = {"id": "drone", "graph": {"bucket": "r352-s1074-c8"}, "top_kernels": top}
    eager = {"id": "long", "graph": {"bucket": None}, "top_kernels": []}
    record = {"ceilings": {"copy_tbps": 4.0}, "stages": [{"name": "graphs", "workloads": [workload, eager]}]}
    rows = {row["kernel"]: row for row in kernel_floors.floors(record)}
    assert set(rows) == set(kernel_floors.KERNELS) and {row["workload"] for row in rows.values()} == {"drone"}
    silu = rows["_silu_mul_kernel"]
    assert silu["floor_us"] == pytest.approx(kernel_floors.silu_mul_bytes(352) / 4e12 * 1e6)
    assert silu["measured_us"] == pytest.approx(10.0) and silu["multiple"] == pytest.approx(10.0 / silu["floor_us"])
    assert rows["_gdn_prep_kernel"]["measured_us"] is None and rows["_gdn_prep_kernel"]["multiple"] is None
    assert rows["_gdn_prep_kernel"]["per_row_floor_us"] < rows["_gdn_prep_kernel"]["floor_us"]
