"""Readout math on hand-computed cases: head, temperature softmax, noul sigmoid, expected level, confidences, formats.

Float64 comparisons use rel=1e-14 (a few ulps: the implementation subtracts the max before exp, the hand values do not).
"""

from __future__ import annotations

import math

import pytest
import torch

from reference.prompts import Record
from reference.readout import (
    answers,
    argmax,
    checked_probabilities,
    choice_confidence,
    format_answer,
    head_scores,
    record_probabilities,
    score_confidence,
    softmax,
)

T27B = 2.5343690298472983
ULPS = 1e-14


def choice_record(keys=("a", "b", "c"), rid="pick") -> Record:
    return Record(rid, "choice", "s", "q", tuple(f"{k}: d" for k in keys), tuple(keys), None)


def score_record(levels=("low", "mid", "high"), rid="level") -> Record:
    keys = tuple(str(i) for i in range(len(levels)))
    return Record(rid, "score", "s", "q", tuple(levels), keys, dict(zip(keys, levels)))


def noul_record(rid="yesno") -> Record:
    return Record(rid, "noul", "s", "q", ("no", "yes"), ("false", "true"), None)


# ---------------------------------------------------------------- head


def test_head_matches_an_fp32_linear_bitwise_and_float64_closely():
    g = torch.Generator().manual_seed(7)
    hidden = (torch.randn(5, 131, generator=g) * 3).to(torch.bfloat16)  # odd width
    weight = torch.randn(131, generator=g) * 0.05
    bias = torch.tensor(-0.375)
    scores = head_scores(hidden, weight, bias)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    linear = torch.nn.Linear(131, 1, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight.unsqueeze(0))
        linear.bias.copy_(bias.reshape(1))
        assert torch.equal(scores, linear(hidden.float()).squeeze(-1))
    exact = hidden.double() @ weight.double() + bias.double()
    # fp32 accumulation of 131 products of magnitude <= ~0.6: error well under 1e-5.
    assert (scores.double() - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("hidden", "weight", "bias"),
    [
        (torch.ones(2, 4), torch.ones(4), torch.tensor(0.0)),  # fp32 hidden
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), torch.tensor(0.0)),
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(5), torch.tensor(0.0)),
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), torch.tensor([0.0])),
        (torch.ones(4, dtype=torch.bfloat16), torch.ones(4), torch.tensor(0.0)),
    ],
)
def test_head_rejects_wrong_dtypes_and_shapes(hidden, weight, bias):
    with pytest.raises(ValueError):
        head_scores(hidden, weight, bias)


# ---------------------------------------------------------------- softmax and noul


def test_three_way_softmax():
    assert softmax([1.0, 2.0, 3.0], 1.0) == pytest.approx(
        [0.09003057317038046, 0.24472847105479767, 0.6652409557748219], rel=ULPS
    )
    assert softmax([1.0, 2.0, 3.0], 2.0) == pytest.approx(
        [0.1863237232258476, 0.30719588571849843, 0.506480391055654], rel=ULPS
    )
    assert softmax([0.5, 0.5], 3.0) == [0.5, 0.5]


def test_softmax_is_shift_invariant_and_stable():
    assert softmax([1000.0, 1001.0, 1002.0], 1.0) == pytest.approx(softmax([0.0, 1.0, 2.0], 1.0), rel=ULPS)
    assert softmax([-1e4, 1e4], 1.0) == [0.0, 1.0]


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_softmax_rejects_bad_temperature(temperature):
    with pytest.raises(ValueError):
        softmax([1.0, 2.0], temperature)


@pytest.mark.parametrize(("s", "p_yes"), [(1.3, 0.6254973437037287), (-0.7, 0.43138493781646736), (0.0, 0.5)])
def test_noul_is_sigmoid_of_s_over_t(s, p_yes):
    p = record_probabilities(noul_record(), [s], T27B)
    assert p[1] == pytest.approx(p_yes, rel=ULPS)
    assert p[1] == pytest.approx(1 / (1 + math.exp(-s / T27B)), rel=ULPS)
    assert p[0] == pytest.approx(1 - p_yes, rel=ULPS)


def test_noul_extremes_do_not_overflow():
    assert record_probabilities(noul_record(), [5e4], 1.0) == [0.0, 1.0]
    assert record_probabilities(noul_record(), [-5e4], 1.0) == [1.0, 0.0]


def test_record_probabilities_checks_counts_and_finiteness():
    with pytest.raises(ValueError, match="has 3 candidates, got 2 scores"):
        record_probabilities(choice_record(), [1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="has 1 candidates, got 2 scores"):
        record_probabilities(noul_record(), [1.0, 2.0], 1.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        record_probabilities(choice_record(), [1.0, float("nan"), 0.0], 1.0)


# ---------------------------------------------------------------- probability check


def test_probability_check_renormalises():
    p = checked_probabilities([0.2, 0.3, 0.5000005])  # sum off by 5e-7: accepted
    assert math.fsum(p) == pytest.approx(1.0, abs=1e-15)
    assert p[2] == pytest.approx(0.5000005 / 1.0000005, rel=ULPS)


@pytest.mark.parametrize(
    "probabilities",
    [
        [0.2, 0.3, 0.500002],
        [0.5, 0.499998],
        [float("nan"), 1.0],
        [1.5, -0.5],
        [-1e-9, 1.0 + 1e-9],
        [float("inf"), 0.0],
        [],
    ],
)
def test_probability_check_rejects(probabilities):
    with pytest.raises(RuntimeError):
        checked_probabilities(probabilities)


# ---------------------------------------------------------------- confidences and argmax


def test_choice_confidence():
    assert choice_confidence([0.2, 0.5, 0.3]) == pytest.approx(0.25, rel=ULPS)  # (0.5 - 1/3) / (2/3)
    assert choice_confidence([0.1, 0.9]) == pytest.approx(0.8, rel=ULPS)
    assert choice_confidence([1.0]) == 1.0
    assert choice_confidence([0.25] * 4) == 0.0
    assert choice_confidence([0.0, 1.0, 0.0]) == 1.0


def test_score_confidence():
    # n = 3: MAD_uniform = (1 + 0 + 1) / 3; mode 2; E|i - 2| = 0.1*2 + 0.2*1 = 0.4; 1 - 0.4 / (2/3) = 0.4
    assert score_confidence([0.1, 0.2, 0.7]) == pytest.approx(0.4, rel=ULPS)
    # n = 4: MAD_uniform = (1.5 + 0.5 + 0.5 + 1.5) / 4 = 1; mode 1; E|i - 1| = 0.1 + 0.2 + 0.1*2 = 0.5
    assert score_confidence([0.1, 0.6, 0.2, 0.1]) == pytest.approx(0.5, rel=ULPS)
    # spread beyond the uniform's: clipped at 0 (1 - 0.7 / (2/3) < 0)
    assert score_confidence([0.2, 0.3, 0.5]) == 0.0
    assert score_confidence([0.0, 0.0, 1.0, 0.0]) == 1.0


def test_argmax_ties_go_to_the_first():
    assert argmax([0.25, 0.375, 0.375]) == 1
    assert argmax([0.5, 0.5]) == 0


# ---------------------------------------------------------------- answer formats


def test_noul_answer_format():
    answer = format_answer(noul_record(), [0.25, 0.75])
    assert answer == {"type": "noul", "noul": 0.75}
    assert list(answer) == ["type", "noul"]


def test_choice_answer_format_keeps_criteria_order():
    record = choice_record(keys=("zeta", "alpha", "mid"))
    answer = format_answer(record, [0.2, 0.5, 0.3])
    assert list(answer) == ["type", "choice", "probabilities", "confidence"]
    assert answer["type"] == "choice" and answer["choice"] == "alpha"
    assert list(answer["probabilities"]) == ["zeta", "alpha", "mid"]
    assert answer["probabilities"] == pytest.approx({"zeta": 0.2, "alpha": 0.5, "mid": 0.3}, rel=ULPS)
    assert answer["confidence"] == pytest.approx(0.25, rel=ULPS)


def test_choice_tie_picks_the_first_in_criteria_order():
    assert format_answer(choice_record(keys=("b", "a", "c")), [0.4, 0.4, 0.2])["choice"] == "b"


def test_score_answer_format():
    record = score_record(levels=("none", {"label": "some"}, ["lots"]))
    answer = format_answer(record, [0.1, 0.2, 0.7])
    assert list(answer) == ["type", "score", "probabilities", "confidence", "legend"]
    assert answer["score"] == pytest.approx(0.0 * 0.1 + 1 * 0.2 + 2 * 0.7, rel=ULPS)  # expected level 1.6, not argmax 2
    assert list(answer["probabilities"]) == ["0", "1", "2"]
    assert answer["confidence"] == pytest.approx(0.4, rel=ULPS)
    assert answer["legend"] == {"0": "none", "1": {"label": "some"}, "2": ["lots"]}


def test_answers_split_scores_by_record_in_order():
    records = [choice_record(rid="c"), noul_record(rid="n"), score_record(levels=("lo", "hi"), rid="s")]
    scores = [0.5, -1.0, 2.0, 1.1, 0.3, -0.4]
    result = answers(records, scores, T27B)
    assert list(result) == ["c", "n", "s"]
    assert list(result["c"]["probabilities"].values()) == pytest.approx(softmax([0.5, -1.0, 2.0], T27B), rel=ULPS)
    assert result["n"]["noul"] == pytest.approx(1 / (1 + math.exp(-1.1 / T27B)), rel=ULPS)
    p_hi = 1 / (1 + math.exp(-(-0.4 - 0.3) / T27B))
    assert result["s"]["score"] == pytest.approx(p_hi, rel=ULPS)
    with pytest.raises(ValueError, match="6 candidates in the records, got 5 scores"):
        answers(records, scores[:5], T27B)
