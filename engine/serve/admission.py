"""Admission by cost: a request is refused (422) before it is queued when its largest forward would need more
activation memory than this server allows, computed from the tokenized lengths (no plan is built, no forward runs).

The plans a request needs are the batches its backbone's `prepare` makes of it:
* `reference.model.HFBackbone` (`hf_torch`, `hf_fla`): consecutive candidates in batches of `batch_size`, each padded to
  its longest, B candidates of L tokens: N = B * L rows;
* `engine.backbone.EngineBackbone`, tree layout (`tree`, `graphs`, `gemm`): the request's prefix tree when it holds at
  most `max_batch_rows` rows or has one question, else `engine.planner.split_questions`' batches of whole questions; per
  batch N = its tree rows and G = its GDN chunks when every candidate path runs the core (`TreeLayout.rows`,
  `TreeLayout.chunks`: the replicated mode, the dearer of the two);
* `EngineBackbone`, flat layout (`merged`, `fused`): consecutive candidates while the batch holds at most
  `max_batch_rows` rows (a candidate is never split), N = its tokens, G = the chunks of its candidates.
Any other backbone (a stand-in of the tests) is not costed: the token and candidate budgets alone admit it.

Activation bytes of one plan, with the model's shapes (H hidden, I MLP width, W the wider in-projection of the two
mixers: GDN 2 Hk Dk + 2 Hv Dv + 2 Hv, attention 2 Hq D + 2 Hkv D; Hq query heads of width D):
```
bytes(plan) = N * 4 * (2 H + 3 I + W)            one layer's widest live set per row at fp32 width: residual and
                                                  normed stream, gate_up and its product, the in-projection
            + G * Hv * Dk * Dv * 4                 the GDN core's chunk states of one layer (engine; fp32)
            + N * Hq * 64 * 8                      the engine's attention over 64-key blocks (fp32 scores and weights)
            + B * Hq * L^2 * 8                     HF on the CPU, a batch whose candidates differ in length: the padded
                                                  batch's attention mask sends SDPA to its math path, which holds fp32
                                                  scores and weights for every (query, key) pair
```
Layers run one after another and free their activations, so a forward's peak is its largest plan's bytes. The HF
quadratic term is measured on the 2-core development CPU (tiny twin): one 16,300-character state with 16 options
(16 candidates of 3,300 tokens, lengths differing by a token) used 8.5 GB (issue 23), the formula says 8.9 GB; the
same state as one candidate (no padding, no mask) 61 MB. On CUDA, SDPA's memory-efficient kernel takes the mask
without materializing the scores, so the term is left out there. The 27B terms are an estimate, to be checked against
`torch.cuda.max_memory_allocated` on the H200 (the GPU steps of issue 23).

The bound: `memory_bound(device)` = min(total / 8, available / 2) of the device's memory when the server starts (after
the model loaded and, for `graphs`, the grid was captured): on CUDA the GPU's total and `torch.cuda.mem_get_info`'s free
bytes, on the CPU the host's physical memory and `MemAvailable` (/proc/meminfo). An eighth of the total leaves the
27B's weights (about 54 GB bf16) and graph pool plus one forward's activations well inside an H200 (139 GiB: a bound
of 17.4 GiB), and refuses the 8.9 GB body above on a host of less than 70 GB; half of what is free keeps a crowded
device from being promised memory it does not have. A server's allocator then holds at most the memory it held after
start plus the bound, under any load: the worker runs one forward at a time, a batched forward holds at most
`max_batch_rows` rows, and an admitted request's largest plan is within the bound. Every public JevBench task and
Open-Jev example needs at most 0.18 GB on the tiny twin's `hf_torch` (customer_service, 8 candidates of up to 600
tokens), far under
the bound of any device (tests/test_server_admission.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.plan import tree_layout
from engine.planner import split_questions
from reference.ops import GDN_CHUNK_SIZE
from reference.request import RequestError
from reference.shapes import ModelShapes

if TYPE_CHECKING:  # imported where a backbone exists: importing them here would import the kernels before
    # `engine.stages.prepare_process` has prepared the process (the Triton interpreter on the CPU)
    from engine.backbone import EngineBackbone
    from reference.model import HFBackbone

ATTENTION_BLOCK_KEYS = 64  # keys per block of the engine's CPU attention (engine.tree.blockwise_node_core)
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class PlanCost:
    """One forward batch of a request: N rows, G GDN chunks, and for an HF padded batch B candidates of L tokens."""

    rows: int
    gdn_chunks: int = 0
    padded: tuple[int, int] | None = None  # (B, L) of an HF batch whose candidates differ in length, on the CPU


def row_bytes(shapes: ModelShapes) -> int:
    """Bytes per row of one layer's widest live set at fp32 width: 4 (2 H + 3 I + W) (module docstring)."""
    gdn_in = 2 * shapes.linear_num_key_heads * shapes.linear_key_head_dim
    gdn_in += 2 * shapes.linear_num_value_heads * shapes.linear_value_head_dim + 2 * shapes.linear_num_value_heads
    attn_in = 2 * shapes.num_attention_heads * shapes.head_dim + 2 * shapes.num_key_value_heads * shapes.head_dim
    return 4 * (2 * shapes.hidden_size + 3 * shapes.intermediate_size + max(gdn_in, attn_in))


def plan_bytes(plan: PlanCost, shapes: ModelShapes) -> int:
    """The activation bytes of one plan (the formula of the module docstring)."""
    total = plan.rows * row_bytes(shapes)
    state = shapes.linear_num_value_heads * shapes.linear_key_head_dim * shapes.linear_value_head_dim * 4
    total += plan.gdn_chunks * state
    if plan.padded is None:
        total += plan.rows * shapes.num_attention_heads * ATTENTION_BLOCK_KEYS * 8
    else:
        batch, length = plan.padded
        total += batch * shapes.num_attention_heads * length * length * 8
    return total


def _first(pair: tuple[int, PlanCost]) -> int:
    return pair[0]


def _chunks(lengths: Sequence[int]) -> int:
    return sum(-(-n // GDN_CHUNK_SIZE) for n in lengths)


def hf_plans(backbone: HFBackbone, candidates: Sequence[Sequence[int]]) -> list[PlanCost]:
    """`HFBackbone.prepare`'s padded batches: consecutive candidates, `batch_size` at a time."""
    plans = []
    for start in range(0, len(candidates), backbone.batch_size):
        lengths = [len(ids) for ids in candidates[start : start + backbone.batch_size]]
        longest = max(lengths)
        masked = backbone.device.type == "cpu" and min(lengths) != longest
        plans.append(PlanCost(len(lengths) * longest, padded=(len(lengths), longest) if masked else None))
    return plans


def engine_plans(
    backbone: EngineBackbone, candidates: Sequence[Sequence[int]], groups: Sequence[int]
) -> list[PlanCost]:
    """`EngineBackbone.prepare`'s batches, from the host-only layouts of `engine.plan` (no plan is built)."""
    limit = backbone.max_batch_rows
    if backbone.tree:
        whole = tree_layout(candidates, groups)
        if whole.rows <= limit or len(whole.question_lens) == 1:
            return [PlanCost(whole.rows, whole.chunks)]
        plans = []
        for index in split_questions(candidates, groups, limit):
            layout = tree_layout([candidates[c] for c in index], [groups[c] for c in index])
            plans.append(PlanCost(layout.rows, layout.chunks))
        return plans
    batches: list[list[int]] = [[]]
    for ids in candidates:
        if batches[-1] and sum(batches[-1]) + len(ids) > limit:
            batches.append([])
        batches[-1].append(len(ids))
    return [PlanCost(sum(lengths), _chunks(lengths)) for lengths in batches]


def _costed_classes() -> tuple[type, ...]:
    """`reference.model.HFBackbone` and `engine.backbone.EngineBackbone`, those of them whose module is imported."""
    found = []
    for module, name in (("reference.model", "HFBackbone"), ("engine.backbone", "EngineBackbone")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory: physical pages, and `MemAvailable` (free pages where unreadable)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = page * os.sysconf("SC_AVPHYS_PAGES")
    return total, available


def memory_bound(device: torch.device) -> tuple[int, str]:
    """min(total / 8, available / 2) of `device`'s memory now, and a few words that say where it came from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{torch.cuda.get_device_name(device)}"
    else:
        total, free = host_memory()
        where = "host memory"
    bound = min(total // 8, free // 2)
    return bound, f"min(1/8 of {total / 2**30:.1f} GiB, 1/2 of {free / 2**30:.1f} GiB free) of {where}"


class AdmissionBound:
    """Refuses a request whose largest forward needs more than `bound_bytes` of activation memory (module docstring).

    `for_backbone(backbone)` costs the backbones it knows (None for any other); `bound_bytes` defaults to
    `memory_bound(backbone.device)`, read once, when the bound is made (the server: after the model was built)."""

    def __init__(self, backbone: HFBackbone | EngineBackbone, bound_bytes: int | None = None):
        self.backbone = backbone
        self.shapes = backbone.shapes
        if bound_bytes is None:
            self.bound_bytes, self.source = memory_bound(backbone.device)
        else:
            self.bound_bytes, self.source = bound_bytes, "--activation-memory"
        if self.bound_bytes < 1:
            raise ValueError(f"the activation memory bound must be positive, got {self.bound_bytes} bytes")

    @classmethod
    def for_backbone(cls, backbone: object, bound_bytes: int | None = None) -> AdmissionBound | None:
        """The bound of a backbone this module costs, else None. The two classes are looked up among the modules
        already imported (a backbone of a class whose module was never imported is not one), so that costing never
        imports the kernels or FLA itself."""
        if isinstance(backbone, _costed_classes()):
            return cls(backbone, bound_bytes)
        return None

    def plans(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> list[PlanCost]:
        if hasattr(self.backbone, "batch_size"):  # HFBackbone (EngineBackbone has `max_batch_rows` instead)
            return hf_plans(self.backbone, candidates)
        return engine_plans(self.backbone, candidates, groups)

    def largest(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> tuple[int, PlanCost]:
        """The activation bytes of the request's largest plan, and that plan."""
        return max(((plan_bytes(plan, self.shapes), plan) for plan in self.plans(candidates, groups)), key=_first)

    def admit(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> None:
        """Raise RequestError (422) when the request's largest plan is over the bound."""
        need, plan = self.largest(candidates, groups)
        if need > self.bound_bytes:
            raise RequestError(
                422,
                f"request too large for this server: its largest forward needs about {need / 2**20:,.0f} MiB of "
                f"activation memory ({plan.rows:,} rows), over the bound of {self.bound_bytes / 2**20:,.0f} MiB "
                f"({self.source})",
            )

    def describe(self) -> dict:
        """For /health and /metrics: the bound in bytes and where it came from."""
        return {"activation_bound_bytes": self.bound_bytes, "source": self.source}
