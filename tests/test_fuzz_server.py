"""bench/fuzz_server.py: a small seeded campaign with no findings, the classifier's own checks, idle connections
at a smaller scale, and issue 15's amplification bodies against their time and memory targets."""

from __future__ import annotations

import pytest

from bench.fuzz_cases import FAMILIES, Case, generate_cases
from bench.fuzz_server import (
    AMPLIFICATION_TARGET_MB,
    AMPLIFICATION_TARGET_S,
    BURST_TARGET_MS,
    FINDING_CLASSES,
    IDLE_DELAY_TARGET_MS,
    Answer,
    Malformed,
    check_json,
    classify,
    parse_answers,
    run_amplification,
    run_burst,
    run_campaign,
    run_idle,
)
from bench.overhead import overhead_model
from reference.service import default_model
from reference.shapes import TINY

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def test_parse_answers_and_check_json_catch_what_they_should():
    """The classifier can fail: bytes that are not responses, a body on a HEAD answer, non-JSON where JSON is
    promised, a 5xx, an answer that is not its request's."""
    assert [answer.status for answer in parse_answers(OK + OK, [], True)[0]] == [200, 200]
    assert parse_answers(OK[:-1], [], False) == ([], True)  # one byte short: unfinished, not malformed
    for data, heads in [(OK[:-1], []), (b"HTTP/1.0 200 OK\r\n\r\n", []), (OK + b"junk", []), (OK, [True])]:
        with pytest.raises(Malformed):
            parse_answers(data, heads, True)  # a HEAD answer with a body: the body reads as junk after it
    plain = Answer(200, {"content-type": ["text/plain"]}, b"{}")
    assert check_json(plain, False) is not None and check_json(plain, True) is None
    assert check_json(Answer(422, {"content-type": ["application/json"]}, b'{"x": 1}'), False) is not None
    case = Case("pipelined", "2_requests", [(b"", 0.0)], expect=2, expected=[200, 404])
    result = {"answers": [Answer(200, {"content-type": ["application/json"]}, b"{}")] * 2, "ended": "open"}
    assert classify(case, dict(result, malformed=None), True, None) == ["mismatch"]
    failed = {"answers": [Answer(500, {"content-type": ["application/json"]}, b'{"error": "x"}')], "ended": "closed"}
    assert classify(Case("framing", "x", []), dict(failed, malformed=None), False, None) == ["crash", "server_error"]
    assert classify(Case("slow", "x", []), {"answers": [], "ended": "timeout", "malformed": None}, True, None) == [
        "hang"
    ]


def test_generated_cases_are_seeded_and_cover_every_family():
    first, again = generate_cases(120, 7, 8791), generate_cases(120, 7, 8791)
    assert [case.raw for case in first] == [case.raw for case in again]
    assert {case.family for case in first} == {*FAMILIES, "control"}
    assert sum(case.control for case in first) == 12


def test_a_small_campaign_finds_nothing():
    """200 cases and 20 controls, body and head timeouts of 0.3 s (the hang bound is then 2.3 s); every family, no
    finding of any class, every control 200 with the same answer, the server alive at the end."""
    campaign = run_campaign(200, 11, model=overhead_model(TINY), body_timeout_s=0.3)
    assert campaign["fuzz_cases"] == 200 and campaign["controls"] == 20
    assert all(campaign["families"][family]["cases"] >= 30 for family in FAMILIES)
    assert campaign["finding_counts"] == dict.fromkeys(FINDING_CLASSES, 0), campaign["findings"]
    assert campaign["families"]["control"]["statuses"] == {"200": 20}
    assert campaign["alive_at_end"]


def test_a_burst_of_twice_the_queue_is_503_at_once_and_the_depth_stays_bounded():
    """Issue 23: 16 clients at once on a queue of 8 behind a held worker: 8 wait and are answered 200, 8 are 503 within
    50 ms each of the server receiving them, the depth never above 8."""
    burst = run_burst(8, rounds=1)
    (one,) = burst["rounds"]
    assert one["statuses"] == {"200": 8, "503": 8} and one["depth_max"] == 8 == one["depth_while_held"]
    assert one["busy_server_ms"]["n"] == 8 and burst["busy_server_ms_max"] <= BURST_TARGET_MS and burst["meets_target"]


def test_idle_connections_cost_no_thread_and_no_delay():
    """300 idle connections (half silent, half an unfinished head): no thread more, and the P50 of 50 requests on new
    connections delayed by less than 50 ms. The requests take about 1 ms; the bound is the issue's target, far above
    what the machine's noise does to a P50 of 50 (the lead's tests share the two cores: measured +2 ms at most)."""
    idle = run_idle(300, model=overhead_model(TINY))
    assert idle["held_by_server"] == 300 and idle["held_after_the_requests"] == 300
    assert idle["statuses"] == {200: 100}
    threads = idle["threads"]["proc_status"]
    assert threads["during"] <= threads["before"], threads
    assert idle["p50_delay_ms"] < IDLE_DELAY_TARGET_MS, idle


def test_amplification_bodies_are_refused_fast_and_small():
    """Issue 15's two bodies and issue 23's two to the tiny twin: 422 in < 0.5 s, peak RSS growth and tracemalloc peak
    < 100 MB (measured on the 2-core machine: at most 0.21 s and 7.6 MB, for the 970 KB body). The admission bound is
    the one this 23.5 GiB machine derives (3 GiB), so that the test does not depend on the host's memory; every public
    request is admitted under it."""
    record = run_amplification(model=default_model(), repeats=2, activation_memory=3 * 2**30)
    assert record["admission"]["public_requests_admitted"] == record["admission"]["public_requests"] == 126
    for name, row in record["bodies"].items():
        assert [run["status"] for run in row["runs"]] == [422, 422], name
        assert row["max_seconds"] < AMPLIFICATION_TARGET_S, (name, row)
        assert row["max_peak_rss_growth_mb"] < AMPLIFICATION_TARGET_MB, (name, row)
        assert row["tracemalloc_peak_mb"] < AMPLIFICATION_TARGET_MB, (name, row)
