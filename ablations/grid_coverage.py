"""How well the `graphs` bucket grid (engine/graphs.py) holds the request shapes it was chosen on.

    python -m ablations.grid_coverage [--out results/graphs/grid-coverage.json]

Workload sets: the public JevBench tiers (every task), the six Open-Jev requests, our two synthetic workloads, and
60 generated requests (seeded: 1-16 questions of 2-64 options over states of 0-16k tokens). Each request is
tokenized as the server does (`reference.service.request_candidates`) and split into batches as the `tree` stage
splits it (`engine.plan.split_questions`, the default row budget); per batch the cost rule picks the GDN mode, and
a replicated batch is held when some bucket fits it. Per set: plans, replicated plans, plans in the grid, and rows
and path slots padded / real over the plans held. Prints the table and writes it as JSON with the environment
(commit, versions, time: `ablations.envinfo`). CPU only, about 30 s.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from ablations import envinfo
from ablations.workloads import _count_state_tokens, resolve, synthetic_state
from engine.config import EngineConfig
from engine.graphs import default_grid, smallest_bucket
from engine.plan import Bucket, TreeLayout, split_questions, tree_layout
from engine.tree import GDN_CALL_COST_CHUNKS, cheaper_gdn_mode
from reference.service import request_candidates

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "graphs" / "grid-coverage.json"
GENERATED = 60


def generated_requests(count: int = GENERATED, seed: int = 0) -> list[dict]:
    """Seeded choice requests: 1-16 questions of 2-64 options over states of 0-16k tokens."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        questions = rng.choice([1, 1, 1, 2, 3, 4, 8, 12, 16])
        tokens = rng.choice([0, 50, 200, 500, 1000, 2000, 4000, 8000, 16000])
        state = synthetic_state(tokens, i, _count_state_tokens) if tokens else "ok"
        spec = {}
        for q in range(questions):
            options = rng.choice([2, 3, 4, 5, 8, 16, 32, 64])
            spec[f"q{q}"] = {
                "type": "choice",
                "instructions": f"Which option fits item {q}?",
                "criteria": {f"opt_{j:02d}": f"Take option {j} for item {q}." for j in range(options)},
            }
        requests.append({"state": state, "questions": spec})
    return requests


def layouts(request: dict) -> list:
    candidates, groups = request_candidates(request)
    batches = split_questions(candidates, groups, EngineConfig.max_batch_rows)
    return [tree_layout([candidates[c] for c in index], [groups[c] for c in index]) for index in batches]


def coverage_table(plans: Iterable[tuple[str, TreeLayout]], grid: Sequence[Bucket], call_cost_chunks: float) -> list:
    """Per workload group: plans, replicated plans, plans in the grid, rows and slots padded / real."""
    groups: dict[str, list] = {}
    for group, layout in plans:
        entry = None
        if cheaper_gdn_mode(layout.gdn_mode_costs(call_cost_chunks)) == "replicated":
            entry = (layout, smallest_bucket(layout, grid))
        groups.setdefault(group, []).append(entry)
    rows = []
    for group, items in groups.items():
        replicated = [i for i in items if i is not None]
        held = [(layout, b) for layout, b in replicated if b is not None]
        rows.append(
            {
                "group": group,
                "plans": len(items),
                "replicated": len(replicated),
                "in_grid": len(held),
                "rows_padded_per_real": sum(b.rows for _, b in held) / max(1, sum(lay.rows for lay, _ in held)),
                "slots_padded_per_real": sum(b.slots for _, b in held) / max(1, sum(lay.slots for lay, _ in held)),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    plans = []
    for group, names in (("jevbench", ["jevbench-all"]), ("open-jev", ["open-jev"]), ("synthetic", ["synthetic"])):
        for workload in resolve(names):
            plans += [(group, layout) for layout in layouts(workload.request)]
    for request in generated_requests():
        plans += [("generated", layout) for layout in layouts(request)]
    grid = default_grid()
    table = coverage_table(plans, grid, GDN_CALL_COST_CHUNKS)
    print(f"{'set':<10} {'plans':>6} {'replicated':>10} {'in grid':>8} {'rows x':>7} {'slots x':>7}")
    for row in table:
        print(
            f"{row['group']:<10} {row['plans']:>6} {row['replicated']:>10} {row['in_grid']:>8} "
            f"{row['rows_padded_per_real']:>7.3f} {row['slots_padded_per_real']:>7.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"env": envinfo.collect("cpu"), "buckets": len(grid), "sets": table}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
