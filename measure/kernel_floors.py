"""Bytes-moved floors of the prep and element-wise kernels, against their measured time in a run record (issue 22).

    python -m measure.kernel_floors RECORD.json                # the `graphs` stage: results/kernel-floors/<stem>.json
    python -m measure.kernel_floors RECORD.json --stage core   # results/kernel-floors/<stem>-core.json
    python -m measure.kernel_floors RECORD.json --stage core --budget drone=5,customer_service=15   # and the budgets

A kernel that streams its operands once can take no less than (bytes read + bytes written) / the copy ceiling the
record measured (`ceilings.copy_tbps`, which counts a copy's reads and writes). The kernels are the engine's own
(`ablations.timing.KERNEL_FAMILIES["ours"]`), each as `engine.backbone._FusedOps` calls it in a bucketed `graphs` /
`core` forward: a tree plan in the replicated GDN mode, the bucket's packed rows N, path slots L and attention keys K.
Bytes per call: each unique input element read once and each output element written once (what reads hit in L2 or
SMEM is not counted twice), in the dtypes the engine passes (activations and norm weights bf16, the gated norm's
weight and A_log fp32, index arrays int64); cu_seqlens offsets (a few dozen int32) are not counted. H hidden, I
intermediate; GDN Hk key heads of Dk dims, Hv value heads of Dv dims, conv_dim = 2·Hk·Dk + Hv·Dv, conv width W;
attention Hq query heads, Hkv key/value heads of D dims, rotary dims r.
* `_residual_rmsnorm_kernel` (128 of its 129 calls a forward: the post-mixer and post-MLP norms with a bf16 delta;
  the first layer's input norm reads no delta and writes no residual; the split-K form, which reads S fp32 partials
  instead of the delta, is not modelled): reads residual and delta N·H·2 each, the weight H·2; writes the new
  residual and the normed rows N·H·2 each.
* `_gdn_prep_kernel` (gdn_prep v4 and v5: each packed row prepared once, at its representative path slot or from its
  conv window): reads the projection's q|k|v, b, a N·(conv_dim + 2·Hv)·2 (z is left for the gated norm), the conv weight
  conv_dim·W·2, A_log Hv·4, dt_bias Hv·2 and one int64 index per output row (v4's slot; v5's W window rows are 24 bytes
  a row more, 0.06 % of the floor, not counted, nor v4's path-row indices of the taps); writes q, k, v bf16, g fp32,
  beta bf16 at the N rows N·((2·Hk·Dk + Hv·Dv)·2 + Hv·(4 + 2)). `gdn_prep_bytes(N, L)` is the floor of preparing all L
  path slots, by this kernel over every slot or by the pair prep + gather (`measure.prep_probe`).
* `_gather_slots_kernel`: reads the N rows of gdn_prep's five outputs and the L int64 slot rows, writes the outputs
  at the L path slots (row bytes as above).
* `_gated_rmsnorm_kernel`: reads the GDN core's output at the N packed rows' representative slots N·Hv·Dv·2 (of its L
  slot rows), z N·Hv·Dv·2, the N int64 slot indices and the fp32 weight Dv·4; writes N·Hv·Dv·2.
* `_attn_prep_kernel` (tree key layout): reads the query halves, k and v N·(Hq·D + 2·Hkv·D)·2 (the gate half is read
  by the attention gate), the q and k norm weights 2·D·2, cos and sin N·r·2·2 and the K int64 key rows; writes q
  N·Hq·D·2 and k, v at the K key rows K·2·Hkv·D·2.
* `_attention_gate_kernel`: reads the attention output and the gate half of the projection N·Hq·D·2 each, writes
  N·Hq·D·2.
* `_silu_mul_kernel`: reads the gate|up GEMM output N·2I·2, writes N·I·2.
`per_row_floor_us` is the same model at L = K = N: the floor if the GDN core and the attention read packed rows
instead of the replicated paths and keys (prefix-once attention, issue 22, item 2).

`--budget drone=5,customer_service=15` (issue 22's non-GEMM targets, ms a forward): what the GDN core may take in
each named workload for its target, `gdn_core_budget`: the target less the stage's other non-GEMM kernel families
(attention, the rest) as measured and this lab's kernels (`ours`) three ways: as measured, each kernel of KERNELS
capped at `CAP` x its floor (issue 22, item 3), and each at its floor; as ms a forward, us a GDN layer, and the
speed-up it asks of the stage's GDN core and of `graphs`' (FLA's) where the record timed `graphs` too.
The measured time per call is the record's `top_kernels` entry of the stage (ms per forward / calls per forward: an
average over the calls of a forward) where the kernel is among the workload's top kernels (10 in records before
2026-12-04, 24 since), else None. Synthetic weights do not change bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reference.shapes import QWEN38_27B, ModelShapes

REPO = Path(__file__).resolve().parents[1]
BF16, FP32, INT64 = 2, 4, 8
KERNELS = (
    "_residual_rmsnorm_kernel",
    "_gdn_prep_kernel",
    "_gather_slots_kernel",
    "_gated_rmsnorm_kernel",
    "_attn_prep_kernel",
    "_attention_gate_kernel",
    "_silu_mul_kernel",
)


def residual_rmsnorm_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Residual add + RMSNorm with a bf16 delta: reads residual, delta and the weight, writes residual and normed."""
    return 4 * rows * s.hidden_size * BF16 + s.hidden_size * BF16


def gdn_prep_row_bytes(s: ModelShapes = QWEN38_27B) -> int:
    """One row of gdn_prep's outputs: q, k [Hk·Dk] and v [Hv·Dv] bf16, g [Hv] fp32, beta [Hv] bf16."""
    return (2 * s.linear_key_dim + s.linear_value_dim) * BF16 + s.linear_num_value_heads * (FP32 + BF16)


def gdn_prep_bytes(rows: int, slots: int, s: ModelShapes = QWEN38_27B) -> int:
    """GDN prep from `rows` projection rows to `slots` output rows (the engine's call: slots = rows)."""
    hv = s.linear_num_value_heads
    params = s.conv_dim * s.linear_conv_kernel_dim * BF16 + hv * (FP32 + BF16)  # conv weight, A_log, dt_bias
    reads = rows * (s.conv_dim + 2 * hv) * BF16 + params + slots * INT64
    return reads + slots * gdn_prep_row_bytes(s)


def gather_slots_bytes(rows: int, slots: int, s: ModelShapes = QWEN38_27B) -> int:
    """gdn_prep's outputs moved from `rows` packed rows to `slots` path slots, each slot's row index read once."""
    return rows * gdn_prep_row_bytes(s) + slots * INT64 + slots * gdn_prep_row_bytes(s)


def gated_rmsnorm_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Gated RMSNorm: reads o at each row's slot, z and the slot index, the fp32 weight [Dv]; writes the rows."""
    width = s.linear_value_dim
    return 3 * rows * width * BF16 + rows * INT64 + s.linear_value_head_dim * FP32


def attn_prep_bytes(rows: int, keys: int, s: ModelShapes = QWEN38_27B) -> int:
    """Attention prep: q over the rows, k and v at the `keys` key rows."""
    q_width, kv_width = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    params = 2 * s.head_dim * BF16  # q_norm, k_norm
    reads = rows * (q_width + 2 * kv_width) * BF16 + params + 2 * rows * s.rotary_dim * BF16 + keys * INT64
    writes = rows * q_width * BF16 + keys * 2 * kv_width * BF16
    return reads + writes


def attention_gate_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """Attention gate: reads the attention output and the gate half, writes the gated rows [N, Hq·D]."""
    return 3 * rows * s.num_attention_heads * s.head_dim * BF16


def silu_mul_bytes(rows: int, s: ModelShapes = QWEN38_27B) -> int:
    """SiLU·mul: reads the gate|up rows [N, 2I], writes [N, I]."""
    return rows * 3 * s.intermediate_size * BF16


def call_bytes(rows: int, slots: int, keys: int, s: ModelShapes = QWEN38_27B) -> dict[str, int]:
    """Bytes per call of each kernel of KERNELS at N = rows, L = slots, K = keys (module docstring)."""
    return {
        "_residual_rmsnorm_kernel": residual_rmsnorm_bytes(rows, s),
        "_gdn_prep_kernel": gdn_prep_bytes(rows, rows, s),
        "_gather_slots_kernel": gather_slots_bytes(rows, slots, s),
        "_gated_rmsnorm_kernel": gated_rmsnorm_bytes(rows, s),
        "_attn_prep_kernel": attn_prep_bytes(rows, keys, s),
        "_attention_gate_kernel": attention_gate_bytes(rows, s),
        "_silu_mul_kernel": silu_mul_bytes(rows, s),
    }


def bucket_sizes(name: str) -> dict[str, int]:
    """Rows, path slots and attention keys of a bucket of the `graphs` grid, by its name (e.g. r352-s1074-c8)."""
    from engine.graphs import default_grid

    for bucket in default_grid():
        if bucket.name == name:
            return {"rows": bucket.rows, "slots": bucket.slots, "keys": bucket.keys}
    raise ValueError(f"no bucket {name!r} in the graphs grid")


def floors(record: dict, stage: str = "graphs") -> list[dict]:
    """One row per (workload served by a bucket, kernel of KERNELS): bytes, floor us, per-row floor us, measured us
    per call and the multiple (None where the kernel is not among the workload's top kernels)."""
    tbps = record["ceilings"]["copy_tbps"]
    timed = next((s for s in record["stages"] if s["name"] == stage), None)
    if timed is None:
        raise ValueError(f"the record has no stage {stage!r}")
    rows = []
    for workload in timed["workloads"]:
        bucket = (workload.get("graph") or {}).get("bucket")
        if not isinstance(bucket, str):  # eager (None), or several batches (a list)
            continue
        size = bucket_sizes(bucket)
        n, slots, keys = size["rows"], size["slots"], size["keys"]
        measured = {k["name"]: k["ms_per_forward"] / k["calls_per_forward"] for k in workload.get("top_kernels", [])}
        per_row = call_bytes(n, n, n)
        for kernel, nbytes in call_bytes(n, slots, keys).items():
            floor_us = nbytes / (tbps * 1e12) * 1e6
            call_ms = measured.get(kernel)
            rows.append({
                "workload": workload["id"], "bucket": bucket, "kernel": kernel, "bytes": nbytes,
                "floor_us": floor_us, "per_row_floor_us": per_row[kernel] / (tbps * 1e12) * 1e6,
                "measured_us": None if call_ms is None else 1000.0 * call_ms,
                "multiple": None if call_ms is None else 1000.0 * call_ms / floor_us,
            })  # fmt: skip
    return rows


CAP = 1.5  # issue 22, item 3: each prep and element-wise kernel within 1.5x its floor


def gdn_core_budget(record: dict, stage: str, targets: dict[str, float], s: ModelShapes = QWEN38_27B) -> list[dict]:
    """One row per workload of `targets` (id -> non-GEMM target, ms a forward) and way of counting this lab's other
    kernels ("measured", "capped": each of KERNELS at most CAP x its floor, "floor"): their ms a forward and the GDN
    core's budget (ms a forward, us a GDN layer, and the speed-up over the stage's GDN core and `graphs`' it asks; a
    budget <= 0 asks the impossible and has no speed-up). Families and kernel times from the record's stage."""
    gdn_layers = s.layer_types.count("linear_attention")
    table = {(row["workload"], row["kernel"]): row for row in floors(record, stage)}  # raises without the stage
    timed = {st["name"]: {w["id"]: w for w in st["workloads"]} for st in record["stages"]}
    out = []
    for workload_id, target in targets.items():
        workload = timed[stage].get(workload_id)
        if workload is None:
            raise ValueError(f"the record's {stage!r} has no workload {workload_id!r}")
        families = {name: f["ms_per_forward"] for name, f in workload["kernel_families"].items()}
        gdn, ours = families["gdn_core"], families["ours"]
        others = sum(ms for name, ms in families.items() if name not in ("gemm", "gdn_core", "ours"))
        fla = (timed.get("graphs", {}).get(workload_id) or {}).get("kernel_families", {}).get("gdn_core", {})
        calls = {k["name"]: k["calls_per_forward"] for k in workload.get("top_kernels", [])}
        saved = {"measured": 0.0, "capped": 0.0, "floor": 0.0}
        for kernel in KERNELS:
            row = table.get((workload_id, kernel))
            if row is None or row["measured_us"] is None:
                continue
            per_forward = calls[kernel] / 1000.0
            saved["capped"] += per_forward * max(0.0, row["measured_us"] - CAP * row["floor_us"])
            saved["floor"] += per_forward * (row["measured_us"] - row["floor_us"])
        for way, less in saved.items():
            budget = target - others - (ours - less)
            out.append({
                "workload": workload_id, "target_ms": target, "ours": way, "ours_ms": ours - less,
                "others_ms": others, "gdn_core_ms": gdn, "budget_ms": budget,
                "budget_us_a_layer": 1000.0 * budget / gdn_layers,
                "speedup_asked": gdn / budget if budget > 0 else None,
                "graphs_gdn_core_ms": fla.get("ms_per_forward"),
                "speedup_over_graphs": fla["ms_per_forward"] / budget if budget > 0 and fla else None,
            })  # fmt: skip
    return out


def _targets(text: str) -> dict[str, float]:
    """`drone=5,customer_service=15` -> {"drone": 5.0, "customer_service": 15.0}."""
    try:
        return {name: float(ms) for name, ms in (pair.split("=") for pair in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WORKLOAD=MS[,WORKLOAD=MS...], got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.kernel_floors", description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="a run record with a timed `graphs` or `core` stage")
    parser.add_argument("--stage", default="graphs", help="the bucketed stage whose kernel times are read")
    parser.add_argument(
        "--budget",
        type=_targets,
        default={},
        metavar="WORKLOAD=MS,...",
        help="non-GEMM targets (ms a forward): the GDN core's budget for each (module docstring)",
    )
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    table = floors(record, args.stage)
    print(f"{'workload':<32} {'kernel':<24} {'MB':>8} {'floor us':>9} {'per-row':>8} {'measured':>9} {'x floor':>8}")
    for row in table:
        measured = "-" if row["measured_us"] is None else f"{row['measured_us']:.1f}"
        multiple = "-" if row["multiple"] is None else f"{row['multiple']:.2f}"
        print(f"{row['workload']:<32} {row['kernel']:<24} {row['bytes'] / 1e6:8.2f} {row['floor_us']:9.2f} "
              f"{row['per_row_floor_us']:8.2f} {measured:>9} {multiple:>8}")  # fmt: skip
    budgets = gdn_core_budget(record, args.stage, args.budget) if args.budget else []
    if budgets:
        print(f"\n{'workload':<32} {'target':>7} {'ours':<9} {'ours ms':>8} {'others':>7} {'GDN core':>9} "
              f"{'budget':>7} {'us/layer':>9} {'faster':>7} {'vs graphs':>10}")  # fmt: skip
    for row in budgets:
        asked = "-" if row["speedup_asked"] is None else f"{row['speedup_asked']:.2f}x"
        graphs = "-" if row["speedup_over_graphs"] is None else f"{row['speedup_over_graphs']:.2f}x"
        print(f"{row['workload']:<32} {row['target_ms']:7.2f} {row['ours']:<9} {row['ours_ms']:8.3f} "
              f"{row['others_ms']:7.3f} {row['gdn_core_ms']:9.3f} {row['budget_ms']:7.3f} "
              f"{row['budget_us_a_layer']:9.1f} {asked:>7} {graphs:>10}")  # fmt: skip
    suffix = "" if args.stage == "graphs" else f"-{args.stage}"
    out = REPO / "results" / "kernel-floors" / f"{args.record.stem}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"record": args.record.name, "stage": args.stage, "copy_tbps": record["ceilings"]["copy_tbps"],
            "rows": table}  # fmt: skip
    if budgets:
        body["gdn_core_budget"] = budgets
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
