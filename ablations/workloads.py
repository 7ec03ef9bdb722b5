"""The requests the ladder is timed on, as Open-Jev request objects (`{"state", "questions"}`).

| id | what | questions / candidates |
|---|---|---|
| `drone` | Open-Jev community drone request: the headline "example request", 971 tokens | 3 / 7 |
| `customer_service` | Open-Jev workflow request, 4,637 tokens | 8 / 8 |
| `context-{128,512}-choice-{2,8}` | Open-Jev scaling requests: 128 / 512-token state, 2 / 8 options | 1 / 2, 8 |
| `synthetic-1024-choice-32` | ours: a state of exactly 1,024 tokens, a 32-option choice | 1 / 32 |
| `long-10k-choice-5` | ours: a 1,950-token state, one 5-option question, 10,095 tokens in all | 1 / 5 |
| `jevbench/<task id>` | one JevBench public task, sent as JevBench sends it (question id "decision") | 1 / 1-6 |

`long-10k-choice-5` has the shape of JevBench's long_policy tasks (hard-sol-b-long_policy-01: 10,722 tokens over 4
candidates, about 2.6k shared). Token counts are the Qwen chat-templated candidates summed.

Groups: `open-jev` (the six recorded requests), `synthetic` (our two), `jevbench` (the timing panel: the first task of
each family of each tier in file order, 4 easy + 6 original = 10 tasks, one per family so every question type and
family shape is timed without timing all 120), `jevbench-all` (every easy and original task), `all` (open-jev +
synthetic + jevbench).

Our synthetic states are seeded text from a small operations-log vocabulary, extended word by word until the Qwen
tokenizer counts exactly the target number of state tokens (the state rendered as the prompt renders it: a string
passes unchanged), so the request is the same on every machine. The Open-Jev requests and JevBench tasks are read
from the shared data (reference/data.py), never copied into the repository.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from reference.data import jevbench_tasks, open_jev_workloads

HEADLINE = "drone"
OPEN_JEV_IDS = (
    "drone",
    "customer_service",
    "context-128-choice-2",
    "context-128-choice-8",
    "context-512-choice-2",
    "context-512-choice-8",
)
JEVBENCH_TIERS = ("easy", "original")


@dataclass(frozen=True)
class Workload:
    id: str
    group: str  # "open-jev" | "synthetic" | "jevbench"
    description: str
    request: dict[str, Any]  # an Open-Jev request object


@dataclass(frozen=True)
class SyntheticSpec:
    description: str
    state_tokens: int
    options: int
    seed: int
    instructions: str
    option_key: str  # format of the option keys, {i} = option index
    option_text: str  # format of the option descriptions


SYNTHETIC = {
    "synthetic-1024-choice-32": SyntheticSpec(
        description="ours: a 1,024-token operations log and one 32-option choice (many candidates on a long state)",
        state_tokens=1024,
        options=32,
        seed=1024,
        instructions="Which dock should receive the next inbound pallet, given the operations log?",
        option_key="dock_{i:02d}",
        option_text="Send the next inbound pallet to dock {i:02d}.",
    ),
    "long-10k-choice-5": SyntheticSpec(
        description="ours: one 5-option question on a 1,950-token log, 10,095 tokens over its 5 candidates "
        "(the shape of JevBench's long_policy tasks)",
        state_tokens=1950,
        options=5,
        seed=10_000,
        instructions="Which lane should the night shift close first, given everything the operations log reports?",
        option_key="lane_{i}",
        option_text="Close lane {i} first and move its traffic to the neighbouring lanes.",
    ),
}

_UNITS = ("Dock", "Bay", "Lane", "Gate", "Zone", "Ramp")
_EVENTS = (
    "received {n} pallets of {item}",
    "dispatched {n} crates of {item}",
    "reported a delay of {n} minutes",
    "passed the hourly safety check",
    "logged {n} scanned parcels of {item}",
    "was cleared after a spill of {item}",
    "asked for {n} more handlers",
    "closed for {n} minutes for cleaning",
    "returned {n} damaged boxes of {item}",
)
_ITEMS = ("tiles", "cables", "flour", "paint", "valves", "glass", "paper", "bolts", "seeds", "lamps")
_FILLER = " and"  # one token after a word: tops the state up to the exact count


def _log_sentence(rng: random.Random) -> str:
    event = rng.choice(_EVENTS).format(n=rng.randint(2, 90), item=rng.choice(_ITEMS))
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return f"At {clock} {rng.choice(_UNITS)} {rng.randint(1, 40):02d} {event}."


def synthetic_state(tokens: int, seed: int, count_tokens: Callable[[str], int]) -> str:
    """Seeded operations-log text of exactly `tokens` tokens by `count_tokens`."""
    if tokens < 8:
        raise ValueError(f"a synthetic state needs at least 8 tokens, got {tokens}")
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < tokens:  # every word is at least one token, so this is always enough
        words += _log_sentence(rng).split(" ")
    low, high = 1, len(words)  # largest prefix of words whose text has <= tokens tokens
    while low < high:
        mid = (low + high + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= tokens:
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    count = count_tokens(text)
    while count < tokens:
        text += _FILLER
        count = count_tokens(text)
    if count != tokens:
        raise RuntimeError(f"could not build a state of exactly {tokens} tokens (got {count}, seed {seed})")
    return text


def _count_state_tokens(text: str) -> int:
    from reference.tokenizer import default_prompt_tokenizer

    return default_prompt_tokenizer().count_tokens(text)


def synthetic_workload(workload_id: str) -> Workload:
    spec = SYNTHETIC[workload_id]
    state = synthetic_state(spec.state_tokens, spec.seed, _count_state_tokens)
    criteria = {spec.option_key.format(i=i): spec.option_text.format(i=i) for i in range(spec.options)}
    question = {"type": "choice", "instructions": spec.instructions, "criteria": criteria}
    return Workload(workload_id, "synthetic", spec.description, {"state": state, "questions": {"decision": question}})


def open_jev_workload(workload_id: str) -> Workload:
    row = open_jev_workloads()[workload_id]
    description = (
        f"Open-Jev {row['kind']} {workload_id}: {row['question_count']} questions, {row['candidate_sequences']} "
        f"candidates, {row['logical_input_tokens']:,} tokens recorded upstream"
    )
    return Workload(workload_id, "open-jev", description, row["request"])


def jevbench_question(task: dict) -> dict[str, Any]:
    """The question as JevBench's adapter builds it: type, instructions, and criteria when the task has them."""
    question = task["question"]
    built = {"type": question["type"], "instructions": question["instructions"]}
    if question.get("criteria") is not None:
        built["criteria"] = question["criteria"]
    return built


def jevbench_workload(task: dict) -> Workload:
    description = f"JevBench {task['id']} ({task['family']}, {task['question']['type']})"
    request = {"state": task["state"], "questions": {"decision": jevbench_question(task)}}
    return Workload(f"jevbench/{task['id']}", "jevbench", description, request)


@cache
def _jevbench_all() -> tuple[Workload, ...]:
    return tuple(jevbench_workload(task) for task in jevbench_tasks(JEVBENCH_TIERS))


def jevbench_panel() -> list[Workload]:
    """The timing panel: the first task of each (tier, family) in file order."""
    panel, seen = [], set()
    for tier in JEVBENCH_TIERS:
        for task in jevbench_tasks((tier,)):
            if (tier, task["family"]) not in seen:
                seen.add((tier, task["family"]))
                panel.append(jevbench_workload(task))
    return panel


def group_ids(group: str) -> list[str]:
    if group == "open-jev":
        return list(OPEN_JEV_IDS)
    if group == "synthetic":
        return list(SYNTHETIC)
    if group == "jevbench":
        return [w.id for w in jevbench_panel()]
    if group == "jevbench-all":
        return [w.id for w in _jevbench_all()]
    if group == "all":
        return group_ids("open-jev") + group_ids("synthetic") + group_ids("jevbench")
    raise ValueError(f"unknown workload group {group!r}")


GROUPS = ("open-jev", "synthetic", "jevbench", "jevbench-all", "all")


def get_workload(workload_id: str) -> Workload:
    if workload_id in OPEN_JEV_IDS:
        return open_jev_workload(workload_id)
    if workload_id in SYNTHETIC:
        return synthetic_workload(workload_id)
    if workload_id.startswith("jevbench/"):
        for workload in _jevbench_all():
            if workload.id == workload_id:
                return workload
    known = [*OPEN_JEV_IDS, *SYNTHETIC, "jevbench/<task id>", *GROUPS]
    raise ValueError(f"unknown workload {workload_id!r}; known: {known}")


def resolve(names: Sequence[str]) -> list[Workload]:
    """Workloads for ids and group names, in the order given, each once."""
    ids: list[str] = []
    for name in names:
        for workload_id in group_ids(name) if name in GROUPS else [name]:
            if workload_id not in ids:
                ids.append(workload_id)
    return [get_workload(workload_id) for workload_id in ids]
