"""Issue 15's amplification bodies: small requests that would expand into very many candidates or prompt tokens.

Both are refused by the admission budgets of `reference.service` (422 before any prompt is built); the server tests,
the service tests and `ablations.fuzz_server` (time to the 422 and the memory it costs) send them.
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
