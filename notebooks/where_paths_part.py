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
# # Where the code paths part
#
# Reads the newest complete run record of a plan that ran its whole ladder, as the figures choose (default: the GPU
# plan, else any) and asks where each stage stops being bit-identical: against the plan's reference (per residual state
# of the headline request), and against the stage it builds on (per workload: `vs_builds_on` where the record has it,
# else equal probabilities). Then, from the newest `results/gpu/*-gemm-rows.json`, which GEMMs change their bits with
# the number of rows in the call: the reason `tree` can depart from `fused` on the GPU. Runs headless (`python
# notebooks/where_paths_part.py`) or as a notebook (`jupytext --to notebook`). Synthetic weights: every number here is
# fidelity between code paths, none is accuracy.

# %%
import json
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
from ablations.records import notebook_record  # noqa: E402  (the figures' choice of records)

record = notebook_record(RESULTS / "runs", PLAN)  # the newest complete record of a whole ladder (headline, every stage)
machine = record["env"]["gpu"] or record["env"]["cpu"]
print(
    f"record: plan {record['plan']['name']} on {machine}, {record['env']['utc']}, commit {record['env']['git_commit']}"
)
headline, reference = record["plan"]["headline"], record["plan"]["reference"]

# %% [markdown]
# ## Against the reference, state by state (headline request)

# %%
rows = []
for stage in record["stages"]:
    w = next((w for w in stage["workloads"] if w["id"] == headline), None)
    states = (w or {}).get("state_rel_rmse")
    if states:
        rows.append(
            {
                "stage": stage["name"],
                "first departing state": str(w.get("first_departing_state")),
                "layer 1": states[1],
                "middle": states[len(states) // 2],
                "final norm": states[-1],
            }
        )
if rows:
    print(f"relative RMSE against {reference} per residual state, {headline}:")
    print(pd.DataFrame(rows).set_index("stage").to_string(float_format=lambda x: f"{x:.2e}"))
else:
    print("this record has no per-state comparison (older runner)")

# %% [markdown]
# ## Against the stage each one builds on, workload by workload

# %%
by_name = {stage["name"]: stage for stage in record["stages"]}
rows = []
for stage in record["stages"]:
    base_name = stage["registry"]["builds_on"]
    base = by_name.get(base_name)
    for w in stage["workloads"] if base else []:
        mine_base = next((b for b in base["workloads"] if b["id"] == w["id"]), None)
        versus = w.get("vs_builds_on")
        if versus is not None and versus.get("bitwise") is not None:
            same, source = versus["bitwise"], "hidden bits"
        elif mine_base is not None and w.get("probabilities") and mine_base.get("probabilities"):
            same, source = w["probabilities"] == mine_base["probabilities"], "probabilities"
        else:
            continue
        rows.append(
            {"stage": stage["name"], "builds on": base_name, "workload": w["id"], "rows": w["rows"],
             "its rows": mine_base["rows"] if mine_base else None, "identical": same, "compared by": source}
        )  # fmt: skip
identity = pd.DataFrame(rows)
if len(identity):
    summary = identity.groupby(["stage", "builds on"])["identical"].agg(["sum", "count"])
    print(summary.rename(columns={"sum": "identical", "count": "workloads"}).to_string())
    bitwise = [s["name"] for s in record["stages"] if s["registry"]["exactness"].get("level") == "bitwise"]
    parted = identity[~identity["identical"] & identity["stage"].isin(bitwise)]
    print(f"\nworkloads where a stage declared bitwise ({', '.join(bitwise) or 'none'}) is not identical:")
    print(parted.to_string(index=False) if len(parted) else "none")

# %% [markdown]
# ## Which GEMMs depend on the row count (newest GPU test)

# %%
gemm_files = sorted((RESULTS / "gpu").glob("*-gemm-rows.json"))
if gemm_files:
    runs = json.loads(gemm_files[-1].read_text())
    print(f"GPU test: {gemm_files[-1].name}")
    frames = []
    for setting in ("default", "no_workspace"):
        cases = runs[setting]
        frame = pd.DataFrame(cases)
        frame["setting"] = setting
        frames.append(frame)
    gemms = pd.concat(frames)
    gemms["rows"] = gemms["flat_rows"].astype(str) + ">" + gemms["tree_rows"].astype(str)
    shares = gemms.pivot_table(index=["gemm", "rows"], columns="setting", values="equal_row_share")
    print(shares.to_string(float_format=lambda x: f"{x:.3f}"))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for setting, group in gemms.groupby("setting"):
        ax.scatter(group["tree_us"], group["gemm"], label=f"{setting}", s=18, alpha=0.7)
    ax.set_xlabel("µs of the small (tree-row) call")
    ax.set_title("GEMM time per setting (cuBLAS default vs no workspace)")
    ax.legend()
    fig.tight_layout()
    plt.show()
else:
    print("no results/gpu/*-gemm-rows.json yet")
