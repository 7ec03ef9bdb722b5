"""Admission by cost (engine/serve/admission.py): issue 23's 16.6 KB body and one four times its state are refused by
the activation-memory bound in well under 0.5 s, every public JevBench task and Open-Jev example is admitted on the
HF and the engine backbones, and the bound is derived from the device's memory. Tiny twin, synthetic weights: these
tests check the costs and answers of the server, never a decision.
"""

from __future__ import annotations

import io
import json
import time

import pytest

import engine.serve.admission as admission
from bench.amplification import long_state_body
from bench.jevbench import request_body
from engine.serve.admission import AdmissionBound, PlanCost, memory_bound, plan_bytes, row_bytes
from engine.server import DecisionServer, build_decision_model, parse_arguments
from engine.server import app_options as server_app_options
from reference.data import jevbench_tasks, open_jev_workloads
from reference.service import default_model
from reference.shapes import QWEN38_27B, TINY
from tests.server_client import post, short_request

GIB = 2**30
SMALL_HOST = (24 * GIB, 22 * GIB)  # the development machine: 23.5 GiB of host memory, about 21 GiB available


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(admission, "host_memory", lambda: SMALL_HOST)


def compiled(request: dict):
    one = default_model().compile(request)
    return one.candidates, one.groups


def public_requests() -> list[dict]:
    requests = [request_body(task, None) for task in jevbench_tasks(("easy", "original"))]
    requests += [workload["request"] for workload in open_jev_workloads().values()]
    assert len(requests) == 126
    return requests


def test_the_bound_is_an_eighth_of_the_memory_or_half_of_what_is_free(monkeypatch):
    monkeypatch.setattr(admission, "host_memory", lambda: (64 * GIB, 40 * GIB))
    assert memory_bound(default_model().backbone.device)[0] == 8 * GIB
    monkeypatch.setattr(admission, "host_memory", lambda: (64 * GIB, 10 * GIB))
    bound, source = memory_bound(default_model().backbone.device)
    assert bound == 5 * GIB and source == "min(1/8 of 64.0 GiB, 1/2 of 10.0 GiB free) of host memory"


def test_the_hf_cost_of_the_16_6_kb_body_matches_its_measured_8_5_gb():
    """The formula against issue 23's measurement: 16 padded candidates of 3,300 tokens, 8.5 GB on the tiny twin's
    hf_torch; the same state as one candidate (no mask), 61 MB measured, costs about as little."""
    bound = AdmissionBound(default_model().backbone, bound_bytes=GIB)
    need, plan = bound.largest(*compiled(json.loads(long_state_body())))
    assert plan.padded == (16, 3301) and 8.0e9 < need < 9.5e9
    one = json.loads(long_state_body())
    one["questions"] = {"q": {"type": "noul", "instructions": "Which?"}}
    assert bound.largest(*compiled(one))[0] < 100e6


def test_row_bytes_of_both_shapes():
    """4 (2 H + 3 I + W): the tiny twin 9,216 bytes per row, the 27B 315,776 (W = the GDN in-projection, 16,480)."""
    assert row_bytes(TINY) == 4 * (2 * 128 + 3 * 384 + 896)
    assert row_bytes(QWEN38_27B) == 4 * (2 * 5120 + 3 * 17408 + 16480) == 315_776
    assert plan_bytes(PlanCost(rows=10, gdn_chunks=2), TINY) == 10 * 9216 + 2 * 6 * 32 * 32 * 4 + 10 * 6 * 64 * 8


@pytest.mark.parametrize("scale", [1, 4])
def test_the_16_6_kb_body_and_four_times_its_state_are_refused_at_once(small_host, scale):
    """Before: the 16.6 KB body passed both budgets, used 8.5 GB and held the worker about 192 s. Now a 422 with the
    contract's shape and the numbers, in well under 0.5 s, and the server answers the next request."""
    with DecisionServer(default_model(), port=0, access_log=io.StringIO()) as served:
        served.start()
        start = time.perf_counter()
        status, _, answer = post(served, long_state_body(scale))
        elapsed = time.perf_counter() - start
        assert status == 422 and list(answer) == ["error"] and elapsed < 0.5
        assert answer["error"].startswith("request too large for this server: its largest forward needs about ")
        assert "MiB of activation memory (" in answer["error"] and "over the bound of 3,072 MiB" in answer["error"]
        assert post(served, short_request(1))[0] == 200


def test_every_public_request_is_admitted_on_hf_torch(small_host):
    bound = AdmissionBound.for_backbone(default_model().backbone)
    assert bound.bound_bytes == 3 * GIB
    needs = []
    for request in public_requests():
        candidates, groups = compiled(request)
        bound.admit(candidates, groups)
        needs.append(bound.largest(candidates, groups)[0])
    assert max(needs) < 0.2e9  # customer_service, 0.18 GB: far under the bound


@pytest.mark.parametrize("stage", ["merged", "tree"])
def test_every_public_request_is_admitted_on_engine_backbones(small_host, stage):
    """The flat (`merged`) and tree layouts' plans of the tiny twin, with the bound of a small host."""
    model = build_decision_model(stage, TINY.name)
    bound = AdmissionBound.for_backbone(model.backbone)
    assert bound is not None and bound.bound_bytes == 3 * GIB
    for request in public_requests():
        bound.admit(*compiled(request))
    tree_or_flat = bound.largest(*compiled(json.loads(long_state_body())))
    assert tree_or_flat[0] < 1e9  # no padding, no quadratic term: the 16.6 KB body is cheap for the engine


def test_a_request_over_an_explicit_bound_is_refused_and_a_stand_in_is_not_costed():
    bound = AdmissionBound.for_backbone(default_model().backbone, bound_bytes=1000)
    with pytest.raises(Exception) as caught:
        bound.admit(*compiled(short_request(1)))
    assert caught.value.status == 422 and "over the bound of 0 MiB (--activation-memory)" in caught.value.message
    assert AdmissionBound.for_backbone(object()) is None
    with pytest.raises(ValueError, match="must be positive"):
        AdmissionBound(default_model().backbone, bound_bytes=0)


def test_activation_memory_on_the_command_line():
    assert server_app_options(parse_arguments([]))["activation_memory"] is None
    assert server_app_options(parse_arguments(["--activation-memory", "1.5"]))["activation_memory"] == int(1.5 * GIB)
    with pytest.raises(SystemExit):
        parse_arguments(["--activation-memory", "0"])
