# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Where the time goes
#
# Reads the newest complete run record of a plan that ran its whole ladder, as the figures choose (default: the GPU
# plan, else any) from `results/runs/` and asks, per stage and workload: how much of the wall time the GPU was busy (the
# rest is launch and host overhead), how far each stage is from its floor, and which kernels take the time; then, from
# the newest GPU record (a newer partial run of the whole ladder included), the kernel time per family and the host's
# share of each headline forward. Runs headless (`python notebooks/where_the_time_goes.py`) or as a notebook (`jupytext
# --to notebook`). Synthetic weights: only timings and fidelity are meaningful.

# %%
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
import matplotlib.pyplot as plt
import pandas as pd

# The checkout: the working directory or the nearest folder above it that holds ablations/ (a Jupyter kernel runs in
# notebooks/ and defines no __file__).
REPO = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "ablations" / "records.py").is_file()), None)
if REPO is None:
    raise SystemExit(f"run from inside the jevlab checkout, not {Path.cwd()}")
RESULTS = Path(os.environ.get("JEVLAB_RESULTS", REPO / "results"))
PLAN = os.environ.get("JEVLAB_PLAN", "gpu-27b")
sys.path.insert(0, str(REPO))
from ablations.records import newest_records, notebook_record  # noqa: E402  (the figures' choice of records)

record = notebook_record(RESULTS / "runs", PLAN)  # the newest complete record of a whole ladder (headline, every stage)
machine = record["env"]["gpu"] or record["env"]["cpu"]
print(f"record: plan {record['plan']['name']} on {machine}, {record['env']['utc']}")

# %% [markdown]
# ## Busy share and distance from the floor

# %%
rows = []
for stage in record["stages"]:
    for w in stage["workloads"]:
        busy = w.get("gpu_busy_ms")
        rows.append(
            {
                "stage": stage["name"],
                "workload": w["id"],
                "rows": w["rows"],
                "median_ms": w["median_ms"],
                "gpu_busy_ms": busy,
                "busy_share": busy / w["median_ms"] if busy else None,
                "x_floor": w["floor_multiple"],
                "kernels": w["kernels_per_forward"],
            }
        )
table = pd.DataFrame(rows)
print(table.pivot(index="workload", columns="stage", values="median_ms").round(1).to_string())
print()
print(table.groupby("stage")[["busy_share", "x_floor", "kernels"]].median().round(2).to_string())

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, group in table.groupby("stage", sort=False):
    ax.scatter(group["rows"], group["median_ms"], label=name, s=18)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("rows computed per forward")
ax.set_ylabel("median ms, forward + head")
ax.set_title(f"{record['plan']['name']}: latency against rows (synthetic weights)")
ax.legend()
fig.tight_layout()

# %% [markdown]
# ## The heaviest kernels of the headline workload, per stage

# %%
headline = record["plan"]["headline"]
for stage in record["stages"]:
    for w in stage["workloads"]:
        if w["id"] == headline and w.get("top_kernels"):
            top = pd.DataFrame(w["top_kernels"])
            top["name"] = top["name"].str.slice(0, 60)
            busy = f"{w['kernels_per_forward']:.0f} kernels, {w['gpu_busy_ms']:.1f} ms busy"
            print(f"\n{stage['name']} / {headline}: {busy}")
            print(top.round(3).to_string(index=False))

# %% [markdown]
# ## Kernel time per family on the headline, newest GPU record (partial runs included)
#
# Kernel ms per family from one profiled call; `idle_ms` = median minus those kernels (launch gaps); `host_ms` = median
# host time until the timed call returned (close to the median: launch-bound). Then the host functions with the most
# own time in one cProfile'd call (cProfile slows Python down: read the shares).

# %%
FAMILY_ORDER = ("gemm", "gdn_core", "attention_core", "ours", "other")
gpu = [r for _, r in newest_records(RESULTS / "runs") if r["plan"]["device"] == "cuda"]
newest_gpu = max(gpu, key=lambda r: r["env"]["utc"]) if gpu else None
family_rows, profiles = [], {}
for stage in newest_gpu["stages"] if newest_gpu else []:
    w = next((w for w in stage["workloads"] if w["id"] == newest_gpu["plan"]["headline"]), None)
    if w is None or not w.get("kernel_families"):
        continue
    families = sorted(w["kernel_families"], key=lambda f: (FAMILY_ORDER + (f,)).index(f))
    ms_by_family = {f: w["kernel_families"][f]["ms_per_forward"] for f in families}
    family_rows.append(
        {
            "stage": stage["name"],
            "status": stage["status"],
            "median_ms": w["median_ms"],
            **ms_by_family,
            "idle_ms": max(0.0, w["median_ms"] - sum(ms_by_family.values())),
            "host_ms": w.get("host_median_ms"),
            "x_core": w.get("core_multiple"),
        }  # fmt: skip
    )
    if w.get("host_profile"):
        profiles[stage["name"]] = w["host_profile"]
if not family_rows:
    print("no GPU record with per-family kernel times under", RESULTS / "runs")
else:
    state = "complete run" if newest_gpu["complete"] else "PARTIAL run: stopped before completion"
    print(f"GPU record {newest_gpu['env']['utc']} ({state}), headline {newest_gpu['plan']['headline']}:")
    print(pd.DataFrame(family_rows).round(2).to_string(index=False))
    for name, profile in profiles.items():
        top = pd.DataFrame(profile["by_own_time"][:8])[["function", "calls", "own_ms", "cumulative_ms"]]
        print(f"\n{name}: host functions by own time (one profiled call, {profile['profiled_ms']:.1f} ms)")
        print(top.round(2).to_string(index=False))

# %% [markdown]
# ## Prep and element-wise kernels against their bytes floor
#
# The engine's own kernels (the `ours` family) on the newest GPU record with a bucketed `core` stage, else a bucketed
# `graphs` stage (partial runs included): per call, the measured time (the stage's top kernels: ms per forward / calls
# per forward) against the bytes-moved floor of `measure.kernel_floors` (each operand read and written once, over the
# record's copy ceiling), with issue 22's 1.5x the floor as a dash. A kernel outside the record's top kernels has no
# time. Synthetic weights: timings only.

# %%
import numpy as np

from ablations.records import all_records, stage_by_name
from measure.kernel_floors import floors

FLOOR_WORKLOADS = ("drone", "customer_service")
FLOOR_TARGET = 1.5


def floor_stage(record: dict) -> str | None:
    """`core` where the record timed it on bucketed workloads, else `graphs`, else None."""
    for name in ("core", "graphs"):
        stage = stage_by_name(record, name)
        workloads = stage["workloads"] if stage else []
        if any(isinstance((w.get("graph") or {}).get("bucket"), str) and w.get("top_kernels") for w in workloads):
            return name
    return None


gpu_records = [(path, r) for path, r in all_records(RESULTS / "runs") if r["plan"]["device"] == "cuda"]  # oldest first
with_core = [item for item in gpu_records if floor_stage(item[1]) == "core"]
with_graphs = [item for item in gpu_records if floor_stage(item[1]) == "graphs"]
floor_path, floor_record = (with_core or with_graphs or [(None, None)])[-1]
if floor_record is None:
    print("no GPU record with a bucketed core or graphs stage under", RESULTS / "runs")
else:
    stage_name = floor_stage(floor_record)
    floor_table = pd.DataFrame(floors(floor_record, stage_name))
    floor_table = floor_table[floor_table["workload"].isin(FLOOR_WORKLOADS)].reset_index(drop=True)
    floor_table[["measured_us", "multiple"]] = floor_table[["measured_us", "multiple"]].astype(float)
    floor_table["MB"] = floor_table["bytes"] / 1e6
    copy_tbps = floor_record["ceilings"]["copy_tbps"]
    print(f"GPU record {floor_path.name}, stage {stage_name}, copy ceiling {copy_tbps:.2f} TB/s")
    columns = ["workload", "bucket", "kernel", "MB", "floor_us", "per_row_floor_us", "measured_us", "multiple"]
    print(floor_table[columns].round(2).to_string(index=False))
    untimed = floor_table[floor_table["measured_us"].isna()]
    for workload, group in untimed.groupby("workload", sort=False):
        print(f"{workload}: not in top kernels: {', '.join(group['kernel'])}")

# %%
if floor_record is not None and len(floor_table):
    shown = list(floor_table.groupby("workload", sort=False))
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4.5), squeeze=False)
    for ax, (workload, group) in zip(axes[0], shown):
        x = np.arange(len(group))
        timed = group["measured_us"].notna().to_numpy()
        ax.bar(x - 0.2, group["floor_us"], width=0.4, label="floor (bytes / copy ceiling)")
        ax.bar(x[timed] + 0.2, group["measured_us"][timed], width=0.4, label="measured")
        for i in x[~timed]:
            ax.text(i + 0.2, 0.02, "not in top kernels", transform=ax.get_xaxis_transform(), rotation=90, fontsize=7,
                    ha="center", va="bottom")  # fmt: skip
        target = FLOOR_TARGET * group["floor_us"].to_numpy()
        ax.hlines(target, x - 0.4, x + 0.4, colors="k", linestyles="dashed", label=f"{FLOOR_TARGET}x floor")
        ax.set_xticks(x, [k.strip("_").removesuffix("_kernel") for k in group["kernel"]], rotation=40, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(f"{workload} ({group['bucket'].iloc[0]})")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"{floor_path.stem}, {stage_name}: our kernels against the bytes floor (synthetic weights)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))

# %% [markdown]
# ## What issue 22's non-GEMM targets ask of the GDN core
#
# On the same record, where its stage is `core`: the GDN core's budget for each workload's non-GEMM target (drone 5 ms,
# customer_service 15 ms a forward), the other non-GEMM families as measured and this lab's kernels three ways (as
# measured, each capped at 1.5x its floor, each at its floor), `measure.kernel_floors.gdn_core_budget`. Synthetic
# weights: timings only.

# %%
from measure.kernel_floors import gdn_core_budget

NON_GEMM_TARGETS = {"drone": 5.0, "customer_service": 15.0}
if floor_record is not None and stage_name == "core":
    timed_ids = {w["id"] for w in stage_by_name(floor_record, "core")["workloads"] if w.get("kernel_families")}
    targets = {w: ms for w, ms in NON_GEMM_TARGETS.items() if w in timed_ids}
    budget = pd.DataFrame(gdn_core_budget(floor_record, "core", targets))
    columns = ["workload", "target_ms", "ours", "ours_ms", "others_ms", "gdn_core_ms", "budget_ms", "budget_us_a_layer",
               "speedup_asked", "speedup_over_graphs"]  # fmt: skip
    print(f"GPU record {floor_path.name}: the GDN core's budget")
    print(budget[columns].round(2).to_string(index=False) if len(budget) else "none of the target workloads timed")
else:
    print("no GPU record with a bucketed core stage: no budget")

# %% [markdown]
# ## What the forward target leaves the non-GEMM kernels
#
# Drone's forward target (31 ms) less the stage's GEMMs and its time between kernels (the median forward less the
# GPU-busy time of the profiled calls), both as measured: the non-GEMM budget, and what of it the GDN core would have
# with this lab's other kernels at their floors, `measure.kernel_floors.forward_budget`. Synthetic weights: timings
# only.

# %%
from measure.kernel_floors import forward_budget

FORWARD_TARGETS = {"drone": 31.0}
if floor_record is not None and stage_name == "core":  # timed_ids: the budget cell's, on the same condition
    targets = {w: ms for w, ms in FORWARD_TARGETS.items() if w in timed_ids}
    forward = pd.DataFrame(forward_budget(floor_record, "core", targets))
    print(f"GPU record {floor_path.name}: what the forward target leaves")
    print(forward.round(2).to_string(index=False) if len(forward) else "none of the target workloads timed")
else:
    print("no GPU record with a bucketed core stage: no forward budget")
