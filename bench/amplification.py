"""Issues 15 and 23's amplification bodies: small requests that would expand into very many candidates, prompt tokens
or activation memory.

The first two are refused by the admission budgets of `reference.service` (422 before any prompt is built), the last by
the server's cost bound (engine/serve/admission.py: 422 before it is queued); the server tests, the service tests and
`bench.fuzz_server` (time to the 422 and the memory it costs) send them.
"""

from __future__ import annotations

import json


def amplification_body() -> bytes:
    """About 157 KB asking 16 choice questions of 255 options about one 102 KB state: 4,080 candidates that would
    repeat the state in every prompt (about 417 MB of prompt text)."""
    state = "The order arrived late and the customer asked for a refund. " * 1700
    options = {f"o{index}": "ok" for index in range(255)}
    question = {"type": "choice", "instructions": "Which?", "criteria": options}
    return json.dumps({"state": state, "questions": {f"q{index}": question for index in range(16)}}).encode()


def many_candidates_body() -> bytes:
    """About 970 KB asking 257 choice questions of 255 options: 65,535 candidates, inside the contract's 65,536."""
    options = {f"o{index}": "abc" for index in range(255)}
    question = {"type": "choice", "instructions": "Which?", "criteria": options}
    return json.dumps({"state": "s", "questions": {f"q{index}": question for index in range(257)}}).encode()


def long_state_body(scale: int = 1) -> bytes:
    """Issue 23's body: one choice question of 16 options about one state of `scale` x 16,300 characters (16.6 KB at
    scale 1). The token budget admits it (16 candidates of 3,300 tokens at scale 1, 13,080 at scale 4), but its cost
    does not: on the tiny twin's `hf_torch` at scale 1 it used 8.5 GB and held the worker for about 192 s."""
    sentence = "The order arrived late and the customer asked for a refund. "
    state = (sentence * (16300 * scale // len(sentence) + 1))[: 16300 * scale]
    question = {"type": "choice", "instructions": "Which?", "criteria": {f"o{index}": "ok" for index in range(16)}}
    return json.dumps({"state": state, "questions": {"q": question}}).encode()
