"""The issues' targets as data (`TARGETS`: issue, stage, metric, limit, text), evaluated on a run record by `evaluate`.

A target is met when its metric, measured on the record's headline workload (or by the record's probes), is at
most its limit (a stage the record did not time is measured on the newest follow-up record of the plan that did,
and the note names it); missed when it is above; not measured when the record lacks the metric (stage not timed,
CPU run, no probe) or the limit. A limit is a number, or a stage's name: then it is the same metric of that stage in
the same record. Each metric (`METRICS`) returns the value, how the table shows it and a note that says where it
comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ablations.records import DASH, headline_of, measured, ms, sci, stage_by_name

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"
NO_FAMILIES_SHORT = "no per-family kernel times in this record (older runner or CPU run)"
NO_PROBES = "not measured by the runner yet (this record has no probes)"


@dataclass(frozen=True)
class Target:
    id: str
    issue: int
    stage: str
    metric: str  # a key of METRICS
    limit: float | str  # a number, or the stage whose same metric is the limit
    text: str
    device: str | None = None  # only on plans of this device
    workload: str | None = None  # the workload it is measured on (default: the record's headline)


TARGETS = (
    Target("fused_kernels", 4, "fused", "kernels_per_forward", 700, "kernels per fused forward <= 700"),
    Target("fused_core_multiple", 4, "fused", "core_multiple", 1.10,
           "fused median <= 1.10 × its core kernel time (GEMM + GDN core + attention core)"),
    Target("fused_fidelity", 4, "fused", "max_abs_dp", "hf_torch",
           "fused max |dp| vs the reference <= hf_torch's max |dp| in the same record"),
    Target("tree_gemm_multiple", 5, "tree", "gemm_multiple", 1.25, "tree median <= 1.25 × its GEMM kernel time"),
    Target("tree_rows_share", 5, "tree", "rows_share", 0.45, "tree rows <= 45 % of the unshared packed rows"),
    Target("tree_bitwise_vs_fused", 5, "tree", "workloads_differing", 0,
           "tree answers bit-identical to fused (tree off) on every workload of the record"),
    Target("tree_handoff_core_time", 5, "tree", "handoff_busy_ratio", 1.30,
           "GDN-core kernel time with state hand-off <= 1.3 × prefilling the context once (4k-token single question, "
           "5 candidates; the runner's gdn_handoff probe)", device="cuda"),
    Target("graphs_drone_ms", 13, "graphs", "median_ms", 41.0, "graphs median on drone <= 41 ms", device="cuda"),
    Target("graphs_easy_fact_ms", 13, "graphs", "median_ms", 19.0, "graphs median on jevbench/easy-fact-00 <= 19 ms",
           device="cuda", workload="jevbench/easy-fact-00"),
    Target("graphs_vs_hf_fla", 13, "graphs", "time_share_of_hf_fla", 1 / 3.5,
           "graphs >= 3.5x faster than hf_fla on drone (median / hf_fla's median <= 0.286)", device="cuda"),
    Target("graphs_padding_cost", 13, "graphs", "exact_graph_multiple", 1.10,
           "graphs median <= 1.10x the exact-plan graph replay on every workload served by a graph", device="cuda"),
    Target("graphs_bitwise_vs_tree", 13, "graphs", "workloads_differing", 0,
           "graphs answers bit-identical to tree on every workload of the record"),
    Target("gemm_bitwise_vs_graphs", 20, "gemm", "workloads_differing", 0,
           "gemm answers bit-identical to graphs on every workload of the record"),
    Target("core_drone_non_gemm_ms", 22, "core", "non_gemm_ms", 5.0,
           "core kernel time outside the GEMMs on drone <= 5.0 ms", device="cuda"),
    Target("core_drone_ms", 22, "core", "median_ms", 31.0, "core median on drone <= 31 ms", device="cuda"),
    Target("core_customer_service_non_gemm_ms", 22, "core", "non_gemm_ms", 15.0,
           "core kernel time outside the GEMMs on customer_service <= 15 ms", device="cuda",
           workload="customer_service"),
    Target("core_long_context_vs_graphs", 22, "core", "median_ms", "graphs",
           "core median on long-10k-choice-5 <= graphs' median in the same record", device="cuda",
           workload="long-10k-choice-5"),
    Target("core_fidelity", 22, "core", "max_abs_dp", "fused",
           "core max |dp| vs the reference <= fused's max |dp| in the same record"),
)  # fmt: skip


@dataclass
class Measure:
    value: float | None
    shown: str = DASH
    note: str = ""
    limit: float | None = None  # set by metrics whose limit is another stage's measurement
    limit_text: str | None = None


Followups = Sequence[tuple[Path, dict]]


def kernels_per_forward(record: dict, target: Target, followups: Followups) -> Measure:
    w, why = headline_of(record, target.stage)
    kernels = None if w is None else w.get("kernels_per_forward")
    if kernels is None:
        return Measure(None, note=why or "no CUDA kernels counted (CPU run)")
    return Measure(kernels, f"{kernels:,.0f}")


def kernel_multiple(record: dict, target: Target, followups: Followups) -> Measure:
    """median / kernel ms, kernels "core" (GEMM + GDN core + attention core) or "gemm" by the metric's name."""
    kind = target.metric.removesuffix("_multiple")
    w, why = headline_of(record, target.stage)
    multiple = None if w is None else w.get(target.metric)
    if multiple is None:
        return Measure(None, note=why or NO_FAMILIES_SHORT)
    kernel_ms = w[f"{kind}_ms"]
    note = f"median {ms(w['median_ms'])} ms, {'core' if kind == 'core' else 'GEMM'} kernels {ms(kernel_ms)} ms"
    busy = w.get("gpu_busy_ms")
    if busy is not None and kernel_ms:  # what the multiple would be with no host time in the way
        note += f"; GPU busy {ms(busy)} ms = {busy / kernel_ms:.2f}× (the multiple if launches cost nothing)"
    return Measure(multiple, f"{multiple:.2f}×", note)


def max_abs_dp(record: dict, target: Target, followups: Followups) -> Measure:
    """The stage's max |dp| against the reference, with the limit stage's max |dp| as the limit."""
    (mine, why), (theirs, their_why) = headline_of(record, target.stage), headline_of(record, target.limit)
    dp, limit = (None if w is None else w.get("max_abs_dp") for w in (mine, theirs))
    reference = record["plan"]["reference"]
    if reference == target.limit:
        note, limit = f"{reference} is this plan's reference: its own max |dp| is 0 by construction", None
    elif dp is not None and limit is not None:
        tally = _fidelity_tally(record, target.stage, target.limit) + _state_tally(mine, theirs, target)
        note = f"against {reference}{tally}; synthetic weights: fidelity only, not accuracy"
    else:
        note = why or their_why or "max |dp| not recorded"
    limit_text = f"{sci(limit)} ({target.limit})" if limit is not None else DASH
    return Measure(dp, sci(dp), note, limit, limit_text)


def _state_tally(mine: dict, theirs: dict, target: Target) -> str:
    """ ", hidden states: <stage> no farther than <limit stage> at k of n residual states", or "" without them."""
    a, b = mine.get("state_rel_rmse"), theirs.get("state_rel_rmse")
    if not a or not b or len(a) != len(b):
        return ""
    closer = sum(x <= y for x, y in zip(a, b, strict=True))
    return f", hidden states: {target.stage} no farther than {target.limit} at {closer} of {len(a)} residual states"


def _fidelity_tally(record: dict, name: str, other: str) -> str:
    """ ", <name> <= <other> on k of n workloads" over every workload where both have a max |dp|, or ""."""
    stage, other_stage = stage_by_name(record, name), stage_by_name(record, other)
    if stage is None or other_stage is None:
        return ""
    pairs = []
    for w in stage["workloads"]:
        t = measured(other_stage, w["id"])
        if t is not None and w.get("max_abs_dp") is not None and t.get("max_abs_dp") is not None:
            pairs.append(w["max_abs_dp"] <= t["max_abs_dp"])
    return f", {name} <= {other} on {sum(pairs)} of {len(pairs)} workloads" if pairs else ""


def _workload_of(record: dict, target: Target) -> tuple[dict | None, str]:
    if target.workload is None:
        return headline_of(record, target.stage)
    stage = stage_by_name(record, target.stage)
    w = measured(stage, target.workload) if stage else None
    return w, "" if w is not None else f"{target.stage} not timed on {target.workload} here"


def median_ms(record: dict, target: Target, followups: Followups) -> Measure:
    """The stage's median on the target's workload; a stage name as the limit is that stage's median on the same
    workload in the same record."""
    w, why = _workload_of(record, target)
    if w is None:
        return Measure(None, note=why)
    note = f"p10-p90 {ms(w['p10_ms'])}-{ms(w['p90_ms'])} ms" if w.get("p10_ms") is not None else ""
    graph = w.get("graph") or {}
    if graph:
        note += f"; bucket {graph.get('bucket')}, graph {'hit' if graph.get('hit') else 'miss'}"
    measure = Measure(w["median_ms"], f"{ms(w['median_ms'])} ms", note.lstrip("; "))
    if isinstance(target.limit, str):
        other = stage_by_name(record, target.limit)
        theirs = measured(other, w["id"]) if other else None
        measure.limit = None if theirs is None else theirs["median_ms"]
        measure.limit_text = DASH if theirs is None else f"{ms(theirs['median_ms'])} ms ({target.limit})"
        if theirs is None:
            measure.note = f"{target.limit} not timed on {w['id']} in the same record"
    return measure


def non_gemm_ms(record: dict, target: Target, followups: Followups) -> Measure:
    """Kernel time per forward outside the GEMM family (our kernels, the GDN and attention cores, the rest): the
    profiled call's per-family sums (ablations/timing.py, `KERNEL_FAMILIES`)."""
    w, why = _workload_of(record, target)
    families = None if w is None else w.get("kernel_families")
    if not families:
        return Measure(None, note=why or NO_FAMILIES_SHORT)
    outside = {name: f["ms_per_forward"] for name, f in families.items() if name != "gemm"}
    value = sum(outside.values())
    note = (
        ", ".join(f"{name} {ms(v)}" for name, v in outside.items())
        + f" ms; GEMMs {ms(families['gemm']['ms_per_forward'])} ms"
    )
    return Measure(value, f"{ms(value)} ms", note)


def time_share_of_hf_fla(record: dict, target: Target, followups: Followups) -> Measure:
    (mine, why), (theirs, their_why) = headline_of(record, target.stage), headline_of(record, "hf_fla")
    if mine is None or theirs is None:
        return Measure(None, note=why or their_why)
    share = mine["median_ms"] / theirs["median_ms"]
    speedup = theirs["median_ms"] / mine["median_ms"]
    note = f"{ms(mine['median_ms'])} vs {ms(theirs['median_ms'])} ms: {speedup:.2f}x faster"
    return Measure(share, f"{share:.3f} ({speedup:.2f}x)", note)


def exact_graph_multiple(record: dict, target: Target, followups: Followups) -> Measure:
    """The largest median / exact-plan graph replay over the workloads a graph served (`exact_graph_ms`)."""
    stage = stage_by_name(record, target.stage)
    pairs = [(w["id"], w["median_ms"] / w["exact_graph_ms"]) for w in (stage or {}).get("workloads", [])
             if w.get("exact_graph_ms") and (w.get("graph") or {}).get("hit")]  # fmt: skip
    if not pairs:
        return Measure(None, note=f"no {target.stage} workload with an exact-plan graph time here")
    worst_id, worst = max(pairs, key=lambda p: p[1])
    return Measure(worst, f"{worst:.2f}x", f"worst {worst_id}; over {len(pairs)} workloads served by a graph")


def rows_share(record: dict, target: Target, followups: Followups) -> Measure:
    """The stage's rows over the unshared rows: `merged`'s or else `fused`'s packed rows, else the request's tokens."""
    w, why = headline_of(record, target.stage)
    for name in ("merged", "fused"):
        unshared_w, _ = headline_of(record, name)
        if unshared_w is not None:
            unshared, basis = unshared_w["rows"], f"{name}'s packed rows"
            break
    else:
        headline = record["plan"]["headline"]
        unshared = next(x["tokens"] for x in record["workloads"] if x["id"] == headline)
        basis = f"the {headline} request's tokens"
    if w is None:
        return Measure(None, note=why)
    share = w["rows"] / unshared
    return Measure(share, f"{share:.1%} ({w['rows']:,} of {unshared:,} rows)", f"unshared rows: {basis}")


def _followup_comparison(followups: Followups, name: str, workload_id: str) -> tuple[Path, dict] | None:
    """The first follow-up record whose stage `name` compared `workload_id` with the stage it builds on."""
    for path, other in followups:
        stage = stage_by_name(other, name)
        for w in stage["workloads"] if stage else []:
            versus = w.get("vs_builds_on") or {}
            if w["id"] == workload_id and versus.get("bitwise") is not None:
                return path, versus
    return None


def workloads_differing(record: dict, target: Target, followups: Followups) -> Measure:
    """Workloads where the stage's answers are not bit-identical to `fused`'s: from `vs_builds_on` (hidden bits and
    probabilities), or, in records older than it, from equal probabilities. A workload on which the stage errored in
    this record is taken from the first of `followups` (newer records of the plan, e.g. a rerun of the fixed stage)
    that compares it, and named in the note; without one it counts as not bit-identical."""
    from engine.stages import get_stage

    base_name = get_stage(target.stage).builds_on
    tree, fused = stage_by_name(record, target.stage), stage_by_name(record, base_name)
    compared, differing, worst, from_probabilities = 0, [], 0.0, False
    for w in tree["workloads"] if tree else []:
        base = measured(fused, w["id"]) if fused else None
        versus = w.get("vs_builds_on")
        if versus is not None and versus.get("bitwise") is not None:
            same, dp = versus["bitwise"], versus["max_abs_dp"]
        elif base is not None and w.get("probabilities") is not None and base.get("probabilities") is not None:
            pairs = [(a, b) for mine, theirs in zip(w["probabilities"], base["probabilities"])
                     for a, b in zip(mine, theirs)]  # fmt: skip
            same, dp, from_probabilities = all(a == b for a, b in pairs), max(abs(a - b) for a, b in pairs), True
        else:
            continue
        compared += 1
        if not same:
            differing.append(w["id"])
            worst = max(worst, dp)
    errored, errored_notes = 0, []
    for error in tree.get("workload_errors", []) if tree else []:
        here = f"{target.stage} errored on {error['id']}"
        later = _followup_comparison(followups, target.stage, error["id"])
        if later is None:
            errored += 1
            errored_notes.append(f"{here} ({error['error']}), not compared")
            continue
        path, versus = later
        compared += 1
        if versus["bitwise"]:
            errored_notes.append(f"{here} here ({error['error']}); bitwise in runs/{path.name}")
        else:
            differing.append(error["id"])
            worst = max(worst, versus["max_abs_dp"])
            errored_notes.append(f"{here} here ({error['error']}); compared in runs/{path.name}")
    if not compared and not errored:
        return Measure(None, note=f"{target.stage} or {base_name} not timed here")
    note = f"differ: {', '.join(differing)} (max |dp| {sci(worst)})" if differing else "every workload compared"
    if from_probabilities:
        note += "; from equal probabilities (record older than vs_builds_on)"
    shown = f"{compared - len(differing)} of {compared + errored} workloads"
    return Measure(len(differing) + errored, shown, "; ".join([note, *errored_notes]))


def probes_of(record: dict, followups: Followups) -> tuple[dict, Path | None]:
    """The record's probes, else those of the newest follow-up that has any (a newer, smaller run of the same plan)
    with that record's path; ({}, None) when none has."""
    if record.get("probes"):
        return record["probes"], None
    for path, other in sorted(followups, key=lambda f: f[1]["env"]["utc"], reverse=True):
        if other.get("probes"):
            return other["probes"], path
    return {}, None


def handoff_busy_ratio(record: dict, target: Target, followups: Followups) -> Measure:
    """GPU kernel time of the hand-off schedule over prefilling once, from the `gdn_handoff` probe (`probes_of`)."""
    found, source = probes_of(record, followups)
    probe = found.get("gdn_handoff")
    if probe is None:
        return Measure(None, note=NO_PROBES)
    if probe["error"]:
        return Measure(None, note=f"the gdn_handoff probe failed: {probe['error']}")
    ratio, busy = probe["gpu_busy_handoff_over_prefill"], probe["gpu_busy_ms"]
    note = (
        f"probe gdn_handoff{'' if source is None else f' of {source.parent.name}/{source.name}'}: kernel ms per call "
        f"{busy['handoff']:.3f} vs {busy['prefill']:.3f}; wall time of back-to-back calls "
        f"{probe['handoff_over_prefill']:.2f}× (host launch time dominates at this size)"
    )
    return Measure(ratio, f"{ratio:.2f}×", note)


def _times(limit: float) -> str:
    return f"{limit:.2f}×"


# metric -> (how it is measured, how a numeric limit is written)
METRICS: dict[str, tuple[Callable[[dict, Target, Followups], Measure], Callable[[Any], str]]] = {
    "kernels_per_forward": (kernels_per_forward, str),
    "core_multiple": (kernel_multiple, _times),
    "gemm_multiple": (kernel_multiple, _times),
    "max_abs_dp": (max_abs_dp, sci),
    "rows_share": (rows_share, lambda limit: f"{limit:.0%}"),
    "workloads_differing": (workloads_differing, lambda limit: f"{limit} differing"),
    "handoff_busy_ratio": (handoff_busy_ratio, _times),
    "median_ms": (median_ms, lambda limit: f"{limit:g} ms"),
    "non_gemm_ms": (non_gemm_ms, lambda limit: f"{limit:g} ms"),
    "time_share_of_hf_fla": (time_share_of_hf_fla, lambda limit: f"{limit:.3f}"),
    "exact_graph_multiple": (exact_graph_multiple, _times),
}


def stage_record(record: dict, stage: str, followups: Followups) -> tuple[dict, Path | None]:
    """The record to measure `stage`'s targets on: `record` when it timed the stage, else the newest follow-up that
    did (a later, smaller run of the plan: its ratios compare stages within that run), with its path."""
    timed = stage_by_name(record, stage)
    if timed is not None and timed.get("status") == "ok":
        return record, None
    for path, other in sorted(followups, key=lambda f: f[1]["env"]["utc"], reverse=True):
        later = stage_by_name(other, stage)
        if later is not None and later.get("status") == "ok":
            return other, path
    return record, None


def evaluate(record: dict, followups: Followups = ()) -> list[dict[str, Any]]:
    """Each target that applies to the record's plan: {id, issue, what, value, limit, measured (shown), limit_text,
    outcome (met / missed / not measured), note}. `followups`: newer records of the same plan (see
    `workloads_differing`)."""
    rows = []
    for target in TARGETS:
        if target.device not in (None, record["plan"]["device"]):
            continue
        measure, limit_format = METRICS[target.metric]
        source, source_path = stage_record(record, target.stage, followups)
        m = measure(source, target, followups)
        if source_path is not None:
            m.note = f"from runs/{source_path.name} (a later run of the plan that timed {target.stage})" + (
                f"; {m.note}" if m.note else ""
            )
        limit = m.limit if isinstance(target.limit, str) else target.limit
        if m.value is None or limit is None:
            outcome = NOT_MEASURED
        else:
            outcome = MET if m.value <= limit else MISSED
        limit_text = (m.limit_text or DASH) if isinstance(target.limit, str) else limit_format(target.limit)
        rows.append({"id": target.id, "issue": target.issue, "what": target.text, "value": m.value, "limit": limit,
                     "measured": m.shown if m.value is not None else DASH, "limit_text": limit_text,
                     "outcome": outcome, "note": m.note})  # fmt: skip
    return rows
