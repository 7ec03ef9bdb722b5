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
# Reads the newest complete run record of a plan (default: the GPU plan, else any) from `results/runs/` and asks,
# per stage and workload: how much of the wall time the GPU was busy (the rest is launch and host overhead), how far
# each stage is from its floor, and which kernels take the time. Runs headless
# (`python notebooks/where_the_time_goes.py`) or as a notebook (`jupytext --to notebook`). Synthetic weights: only
# timings and fidelity are meaningful.

# %%
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
import matplotlib.pyplot as plt
import pandas as pd

REPO = Path.cwd() if (Path.cwd() / "results").is_dir() else Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("JEVLAB_RESULTS", REPO / "results"))
PLAN = os.environ.get("JEVLAB_PLAN", "gpu-27b")

records = [json.loads(p.read_text()) for p in sorted((RESULTS / "runs").glob("*.json"))]
records = [r for r in records if r.get("complete")]
chosen = [r for r in records if r["plan"]["name"] == PLAN] or records
if not chosen:
    raise SystemExit(f"no complete run record under {RESULTS / 'runs'}")
record = max(chosen, key=lambda r: r["env"]["utc"])
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
