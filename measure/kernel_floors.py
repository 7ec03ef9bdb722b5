"""Bytes-moved floors of the prep and element-wise kernels, against their measured time in a run record (issue 22).

    python -m measure.kernel_floors RECORD.json        # writes results/kernel-floors/<record stem>.json

A kernel that streams its operands once can take no less than (bytes read + bytes written) / the copy ceiling the
record measured (`ceilings.copy_tbps`, which counts a copy's reads and writes). The bytes per call, from the shapes
and the call's sizes (the `graphs` stage's bucket: packed rows N, path slots L, attention keys K), each unique input
element read once and each output element written once (what reads hit in L2 or SMEM is not counted twice):
* `_gdn_prep_kernel` (replicated mode: the projection read through the paths' row index, every path slot written;
  since gdn_prep v4 the kernel writes each packed row once and `_gather_slots_kernel` the path slots, so the floor is
  that of the pair and the measured time the prep kernel's alone): reads N·(conv_dim + 2·Hv)·2 (q|k|v, b, a of the
  projection; z is left for the gated norm), the conv weight and the L int64 row indices; writes
  L·((2·Hk·K + Hv·V)·2 + Hv·(4 + 2)) (q, k, v bf16, g fp32, beta bf16). Also given per packed row (L = N): the floor
  of a core that read packed rows instead of replicated paths.
* `_attn_prep_kernel` (tree key layout): reads N·(H·D + 2·Hkv·D)·2 (query halves, k, v; the gate half is read later
  by the attention gate) and cos, sin N·r·2·2 and the K int64 key rows; writes q N·H·D·2 and k, v at the K key rows
  K·2·Hkv·D·2. Also given with K = N (keys written once per row: the prefix-once attention of issue 22, item 2).
* `_silu_mul_kernel`: reads N·2I·2, writes N·I·2.
The measured time per call is the record's `top_kernels` entry of the `graphs` stage (ms per forward / calls per
forward) where the kernel is among the workload's top kernels, else None. Synthetic weights do not change bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reference.shapes import QWEN38_27B, ModelShapes

REPO = Path(__file__).resolve().parents[1]
BF16, FP32, INT64 = 2, 4, 8
KERNELS = ("_gdn_prep_kernel", "_attn_prep_kernel", "_silu_mul_kernel")


def gdn_prep_bytes(rows: int, slots: int, s: ModelShapes = QWEN38_27B) -> int:
    hv = s.linear_num_value_heads
    reads = rows * (s.conv_dim + 2 * hv) * BF16 + s.conv_dim * s.linear_conv_kernel_dim * BF16 + slots * INT64
    writes = slots * ((2 * s.linear_key_dim + s.linear_value_dim) * BF16 + hv * (FP32 + BF16))
    return reads + writes


def attn_prep_bytes(rows: int, keys: int, s: ModelShapes = QWEN38_27B) -> int:
    q_width, kv_width = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    reads = rows * (q_width + 2 * kv_width) * BF16 + 2 * rows * s.rotary_dim * BF16 + keys * INT64
    writes = rows * q_width * BF16 + keys * 2 * kv_width * BF16
    return reads + writes


def silu_mul_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    return rows * 3 * s.intermediate_size * BF16


def bucket_sizes(name: str) -> dict[str, int]:
    """Rows, path slots and attention keys of a bucket of the `graphs` grid, by its name (e.g. r352-s1074-c8)."""
    from engine.graphs import default_grid

    for bucket in default_grid():
        if bucket.name == name:
            return {"rows": bucket.rows, "slots": bucket.slots, "keys": bucket.keys}
    raise ValueError(f"no bucket {name!r} in the graphs grid")


def floors(record: dict, stage: str = "graphs") -> list[dict]:
    """One row per (workload served by a bucket, kernel): bytes, floor us, measured us per call and the multiple."""
    tbps = record["ceilings"]["copy_tbps"]
    timed = next((s for s in record["stages"] if s["name"] == stage), None)
    if timed is None:
        raise ValueError(f"the record has no stage {stage!r}")
    rows = []
    for workload in timed["workloads"]:
        bucket = (workload.get("graph") or {}).get("bucket")
        if bucket is None:
            continue
        size = bucket_sizes(bucket)
        n, slots, keys = size["rows"], size["slots"], size["keys"]
        measured = {k["name"]: k["ms_per_forward"] / k["calls_per_forward"] for k in workload.get("top_kernels", [])}
        cases = {
            "_gdn_prep_kernel": (gdn_prep_bytes(n, slots), gdn_prep_bytes(n, n)),
            "_attn_prep_kernel": (attn_prep_bytes(n, keys), attn_prep_bytes(n, n)),
            "_silu_mul_kernel": (silu_mul_bytes(n), silu_mul_bytes(n)),
        }
        for kernel, (nbytes, per_row_bytes) in cases.items():
            floor_us = nbytes / (tbps * 1e12) * 1e6
            call_ms = measured.get(kernel)
            rows.append({
                "workload": workload["id"], "bucket": bucket, "kernel": kernel, "bytes": nbytes,
                "floor_us": floor_us, "per_row_floor_us": per_row_bytes / (tbps * 1e12) * 1e6,
                "measured_us": None if call_ms is None else 1000.0 * call_ms,
                "multiple": None if call_ms is None else 1000.0 * call_ms / floor_us,
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.kernel_floors", description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="a run record with a timed `graphs` stage")
    parser.add_argument("--stage", default="graphs")
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    table = floors(record, args.stage)
    print(f"{'workload':<32} {'kernel':<18} {'MB':>8} {'floor us':>9} {'per-row':>8} {'measured':>9} {'x floor':>8}")
    for row in table:
        measured = "-" if row["measured_us"] is None else f"{row['measured_us']:.1f}"
        multiple = "-" if row["multiple"] is None else f"{row['multiple']:.2f}"
        print(f"{row['workload']:<32} {row['kernel']:<18} {row['bytes'] / 1e6:8.2f} {row['floor_us']:9.2f} "
              f"{row['per_row_floor_us']:8.2f} {measured:>9} {multiple:>8}")  # fmt: skip
    out = REPO / "results" / "kernel-floors" / f"{args.record.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"record": args.record.name, "stage": args.stage, "copy_tbps": record["ceilings"]["copy_tbps"],
            "rows": table}  # fmt: skip
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
