"""From final-norm hidden states to the Open-Jev answers (contract §3 and §6).

Math, per candidate c and per record with candidate scalars s_1..s_K and temperature T:

    s_c   = fp32(w . fp32(h_c) + b)                       the scalar head, one fp32 linear (hidden bf16, w and b fp32)
    logits: choice/score [s_1..s_K]; noul [0, s]          (order no/yes, so p_yes = sigmoid(s / T))
    p_i   = exp(l_i / T - m) / sum_j exp(l_j / T - m)     m = max_j l_j / T, in float64

The head runs in torch (`F.linear`, the op the original's `nn.Linear` calls), so its rounding is that of an fp32 GEMV on
the same device. The softmax is float64 Python math on the fp32 scalars (the original moves them to Python floats
before its softmax); the order of operations may differ from the original's `jev.metrics.softmax`, which is not public,
by a few float64 ulps, far below anything a decision or a printed probability can show.

Before formatting, probabilities are checked (each finite and in [0, 1], sum within 1e-6 of 1) and renormalised by
their sum. Sums use `math.fsum` (correctly rounded).

Answers: noul {"type", "noul": p_yes}; choice {"type", "choice": argmax key, "probabilities" in criteria order,
"confidence"}; score {"type", "score": sum_i i * p_i (the expected level, not the argmax), "probabilities" keyed
"0".."n-1", "confidence", "legend"}.
Argmax ties go to the first option in criteria order (the original's `max(range(K), key=p.__getitem__)`); JevBench's
own scorer instead breaks ties by the smallest label, which only matters for exact ties.

Confidences (inferred: the original's `jev/metrics.py` is not public; these are TypeSafe's documented formulas that
Open-Jev replicas use, contract §3):
    choice: (p_max - 1/K) / (1 - 1/K), 1.0 for K = 1, clipped below at 0 against rounding
    score:  max(0, 1 - E|i - mode| / MAD_uniform), mode = first argmax, MAD_uniform = mean_i |i - (n - 1)/2|
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from reference.prompts import Record

PROBABILITY_SUM_TOLERANCE = 1e-6


def head_scores(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor) -> torch.Tensor:
    """[C] fp32 scalars: fp32 linear of the bf16 hidden states [C, H] cast to fp32, weight fp32 [H], bias fp32 []."""
    if hidden.dtype != torch.bfloat16 or hidden.dim() != 2:
        raise ValueError(f"hidden must be bf16 [C, H], got {hidden.dtype} {tuple(hidden.shape)}")
    if head_weight.dtype != torch.float32 or tuple(head_weight.shape) != (hidden.shape[1],):
        got = f"{head_weight.dtype} {tuple(head_weight.shape)}"
        raise ValueError(f"head_weight must be fp32 [{hidden.shape[1]}], got {got}")
    if head_bias.dtype != torch.float32 or head_bias.dim() != 0:
        raise ValueError(f"head_bias must be a 0-dim fp32 tensor, got {head_bias.dtype} {tuple(head_bias.shape)}")
    weight = head_weight.to(hidden.device).unsqueeze(0)  # [1, H]
    bias = head_bias.to(hidden.device).reshape(1)  # [1]
    return F.linear(hidden.float(), weight, bias).squeeze(-1)  # [C]


def softmax(logits: Sequence[float], temperature: float) -> list[float]:
    """softmax(logits / T) in float64, max-subtracted."""
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and positive, got {temperature}")
    scaled = [float(value) / temperature for value in logits]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    total = math.fsum(weights)
    return [weight / total for weight in weights]


def record_probabilities(record: Record, scores: Sequence[float], temperature: float) -> list[float]:
    """Probabilities over `record.answer_keys` from the record's candidate scores (1 for noul, K otherwise)."""
    if len(scores) != record.candidate_count:
        raise ValueError(f"record {record.id!r} has {record.candidate_count} candidates, got {len(scores)} scores")
    if not all(math.isfinite(score) for score in scores):
        raise RuntimeError(f"record {record.id!r}: the head produced a non-finite score {list(scores)}")
    logits = [0.0, float(scores[0])] if record.kind == "noul" else [float(score) for score in scores]
    return softmax(logits, temperature)


def checked_probabilities(probabilities: Sequence[float]) -> list[float]:
    """The vector renormalised by its sum, after checking each entry finite in [0, 1] and the sum 1 within 1e-6."""
    values = [float(p) for p in probabilities]
    if not values or any(not math.isfinite(p) or not 0.0 <= p <= 1.0 for p in values):
        raise RuntimeError(f"probabilities must be finite and in [0, 1], got {values}")
    total = math.fsum(values)
    if abs(total - 1.0) > PROBABILITY_SUM_TOLERANCE:
        raise RuntimeError(f"probabilities must sum to 1 within {PROBABILITY_SUM_TOLERANCE}, got {total}")
    return [p / total for p in values]


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; ties go to the first."""
    return max(range(len(values)), key=values.__getitem__)


def choice_confidence(probabilities: Sequence[float]) -> float:
    """(p_max - 1/K) / (1 - 1/K): 0 for a uniform vector, 1 for a point mass (inferred formula, see module doc)."""
    count = len(probabilities)
    if count == 1:
        return 1.0
    uniform = 1.0 / count
    return max(0.0, (max(probabilities) - uniform) / (1.0 - uniform))


def score_confidence(probabilities: Sequence[float]) -> float:
    """max(0, 1 - E|i - mode| / MAD_uniform) over ordered levels (inferred formula, see module doc)."""
    count = len(probabilities)
    mode = argmax(probabilities)
    spread = math.fsum(p * abs(index - mode) for index, p in enumerate(probabilities))
    centre = (count - 1) / 2
    uniform_spread = math.fsum(abs(index - centre) for index in range(count)) / count
    return max(0.0, 1.0 - spread / uniform_spread)


def format_answer(record: Record, probabilities: Sequence[float]) -> dict[str, Any]:
    """The answer object of one question from its probabilities over `record.answer_keys`."""
    if len(probabilities) != len(record.answer_keys):
        raise ValueError(f"record {record.id!r}: {len(probabilities)} probabilities for {len(record.answer_keys)} keys")
    p = checked_probabilities(probabilities)
    if record.kind == "noul":
        return {"type": "noul", "noul": p[1]}
    named = dict(zip(record.answer_keys, p))
    if record.kind == "choice":
        return {
            "type": "choice",
            "choice": record.answer_keys[argmax(p)],
            "probabilities": named,
            "confidence": choice_confidence(p),
        }
    return {
        "type": "score",
        "score": math.fsum(index * value for index, value in enumerate(p)),
        "probabilities": named,
        "confidence": score_confidence(p),
        "legend": dict(record.legend),
    }


def answers(records: Sequence[Record], scores: Sequence[float], temperature: float) -> dict[str, dict[str, Any]]:
    """All answers, in record order, from the candidate scores in candidate order (records' candidates back to back)."""
    total = sum(record.candidate_count for record in records)
    if len(scores) != total:
        raise ValueError(f"{total} candidates in the records, got {len(scores)} scores")
    result, offset = {}, 0
    for record in records:
        own = scores[offset : offset + record.candidate_count]
        offset += record.candidate_count
        result[record.id] = format_answer(record, record_probabilities(record, own, temperature))
    return result
