"""The ladder plans (ablations/plans.py and ablations/plans/*.toml) on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

from ablations.plans import check_plan, load_plan, plan_names
from ablations.workloads import (
    HEADLINE,
    resolve,
)
from engine.stages import in_ladder_order


@pytest.mark.parametrize("name", ["gpu-27b", "cpu-tiny"])
def test_plans_load_and_name_known_stages_and_workloads(name):
    assert name in plan_names()
    plan = load_plan(name)
    in_ladder_order(plan.stages)
    workload_ids = [w.id for w in resolve(plan.workloads)]
    assert plan.headline == HEADLINE and plan.headline in workload_ids
    assert len(workload_ids) == len(set(workload_ids))
    if plan.device == "cuda":
        assert plan.timing.min_runs >= 30 and plan.timing.timer == "cuda-events"
        assert set(workload_ids) >= {"drone", "customer_service", "synthetic-1024-choice-32", "long-10k-choice-5"}
    else:
        assert plan.timing.timer == "perf-counter" and "long-10k-choice-5" not in workload_ids


def test_check_plan_rejects_inconsistent_plans():
    plan = load_plan("gpu-27b")
    with pytest.raises(ValueError, match="at least 30 runs"):
        check_plan(dataclasses.replace(plan, timing=dataclasses.replace(plan.timing, min_runs=5)))
    with pytest.raises(ValueError, match="reference must be an HF stage"):
        check_plan(dataclasses.replace(plan, reference="merged"))
    with pytest.raises(ValueError, match="times with 'perf-counter'"):
        check_plan(dataclasses.replace(load_plan("cpu-tiny"), timing=plan.timing))
    with pytest.raises(ValueError, match="cannot run on cpu"):
        check_plan(dataclasses.replace(load_plan("cpu-tiny"), reference="hf_fla"))
    with pytest.raises(ValueError, match="unknown plan"):
        load_plan("gpu-999b")
