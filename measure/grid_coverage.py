"""How well the `graphs` bucket grid (engine/graphs.py) holds the request shapes it was chosen on.

    python -m measure.grid_coverage [--out results/graphs/grid-coverage.json]

Workload sets: the public JevBench tiers (every task), the six Open-Jev requests, our two synthetic workloads, and 60
generated requests (seeded: 1-16 questions of 2-64 options over states of 0-16k tokens). Each request is tokenized as
the server does (`reference.service.request_candidates`) and split into batches as the `tree` stage splits it
(`engine.planner.split_questions`, the default row budget); per batch the cost rule picks the GDN mode, and a replicated
batch is held when some bucket fits it. Per set and grid: plans, replicated plans, plans in the grid, and padded / real
of every capacity over the plans held (rows, path slots, sequences, GDN chunks, attention nodes and keys, read rows: sum
of the buckets' over sum of the requests'). Three grids: `default_grid()`, the grid it replaced (`grid_to_1152`: the
same classes and factors over the rows sizes of before, 1,152 after 1,024; 264 buckets) and the first grid
(`previous_grid`: one candidate capacity per rows size, 8 / 16 / 32, and slot factors 1, 2, 3, 5; 124 buckets), so the
record holds all three. Per grid also its bucket count and the FLA solve buffers its arenas keep at the 27B shapes
(slots x linear value heads x 64 bf16 per bucket: the one per-bucket buffer that grows with the slots, computed from the
shapes, not measured). Prints the table and writes it as JSON with the environment (commit, versions, time:
`ablations.envinfo`). CPU only, about 30 s.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from ablations import envinfo
from ablations.workloads import _count_state_tokens, resolve, synthetic_state
from engine.config import EngineConfig
from engine.graphs import GridIndex, candidate_capacity, default_grid, grid_bucket
from engine.plan import CHUNK_SIZE, Bucket, TreeLayout, tree_layout
from engine.planner import GDN_CALL_COST_CHUNKS, cheaper_gdn_mode, split_questions
from reference.service import request_candidates
from reference.shapes import QWEN38_27B

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "graphs" / "grid-coverage.json"
GENERATED = 60
CAPACITIES = ("rows", "slots", "sequences", "chunks", "nodes", "keys", "candidates")


# The rows sizes of the grids before 2026-12-06: every 64 to 1,024, then 1,152 and 1,280 (31 sizes).
ROWS_TO_1152 = (*range(64, 257, 16), *range(288, 513, 32), *range(576, 1025, 64), 1152, 1280)


def previous_grid() -> tuple[Bucket, ...]:
    """The first grid: at every rows size of `ROWS_TO_1152` the largest candidate class only, slot factors 1, 2, 3
    and 5 (124 buckets; the H200 runs of the stage's first records used it)."""
    return tuple(grid_bucket(rows, factor) for rows in ROWS_TO_1152 for factor in (1, 2, 3, 5))


def grid_to_1152() -> tuple[Bucket, ...]:
    """The grid `default_grid()` replaced on 2026-12-06: its classes and slot factors over `ROWS_TO_1152` (264
    buckets), whose 128-row step above 1,024 put customer_service's 1,032 rows in a 1,152-row bucket."""
    return default_grid(ROWS_TO_1152)


def real_sizes(layout: TreeLayout) -> dict[str, int]:
    """A request's own size of every bucket capacity (its sequences are its candidates' paths)."""
    return {
        "rows": layout.rows,
        "slots": layout.slots,
        "sequences": len(layout.candidate_lens),
        "chunks": layout.chunks,
        "nodes": layout.nodes,
        "keys": layout.keys,
        "candidates": len(layout.candidate_lens),
    }


def solve_buffer_bytes(grid: Sequence[Bucket]) -> int:
    """Bytes of the FLA solve buffers of every bucket's arena at the 27B shapes: [slots, value heads, 64] bf16."""
    return sum(b.slots * QWEN38_27B.linear_num_value_heads * CHUNK_SIZE * 2 for b in grid)


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
    """Per workload group: plans, replicated plans, plans in the grid, padded / real of every capacity."""
    index = GridIndex(grid)
    groups: dict[str, list] = {}
    for group, layout in plans:
        entry = None
        if cheaper_gdn_mode(layout.gdn_mode_costs(call_cost_chunks)) == "replicated":
            entry = (layout, index.smallest(layout))
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
                "padded_per_real": {
                    name: sum(getattr(b, name) for _, b in held) / sum(real_sizes(lay)[name] for lay, _ in held)
                    if held
                    else None
                    for name in CAPACITIES
                },
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.grid_coverage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    plans = []
    for group, names in (("jevbench", ["jevbench-all"]), ("open-jev", ["open-jev"]), ("synthetic", ["synthetic"])):
        for workload in resolve(names):
            plans += [(group, layout) for layout in layouts(workload.request)]
    for request in generated_requests():
        plans += [("generated", layout) for layout in layouts(request)]
    grids = {"default": default_grid(), "to_1152": grid_to_1152(), "previous": previous_grid()}
    record = {"env": envinfo.collect("cpu"), "grids": {}}
    header = " ".join(f"{name[:6]:>6}" for name in CAPACITIES)
    for grid_name, grid in grids.items():
        table = coverage_table(plans, grid, GDN_CALL_COST_CHUNKS)
        largest = max(grid, key=lambda b: b.rows)
        print(f"grid {grid_name}: {len(grid)} buckets, largest {largest.rows} rows, solve buffers at 27B "
              f"{solve_buffer_bytes(grid) / 2**30:.2f} GiB; padded / real per capacity")  # fmt: skip
        print(f"{'set':<10} {'plans':>6} {'replic':>6} {'held':>5} {header}")
        for row in table:
            ratios = " ".join("     -" if v is None else f"{v:>6.3f}" for v in row["padded_per_real"].values())
            print(f"{row['group']:<10} {row['plans']:>6} {row['replicated']:>6} {row['in_grid']:>5} {ratios}")
        record["grids"][grid_name] = {
            "buckets": len(grid),
            "largest_rows": largest.rows,
            "largest_candidates": max(candidate_capacity(b.rows) for b in grid),
            "solve_buffer_bytes_27b": solve_buffer_bytes(grid),
            "sets": table,
        }
    envinfo.write_json(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
