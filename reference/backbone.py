"""The one seam between the request pipeline and a forward pass.

A backbone turns tokenized candidates into the final-norm hidden state at each candidate's last token. The reference
(HF transformers) and every engine stage implement it, so the request pipeline, the head and the readout are shared
and every comparison is on the same tokens, head and readout.

`prepare` does everything that is not the forward (padding or packing, the prefix-tree plan, host-to-device copies), so
the ablation runner can time `forward` alone with inputs already on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from reference.shapes import ModelShapes


class Backbone(Protocol):
    name: str
    shapes: ModelShapes
    device: torch.device

    def prepare(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> Any:
        """Lay out candidates (token ids) for `forward`. `groups[c]` is the question index of candidate c."""
        ...

    def forward(self, prepared: Any) -> torch.Tensor:
        """[C, hidden] bf16: the final-RMSNorm output at each candidate's last token, in candidate order."""
        ...


def check_candidates(candidates: Sequence[Sequence[int]], groups: Sequence[int], vocab_size: int) -> None:
    """Raise ValueError unless there is at least one candidate, one group per candidate, and every candidate has
    tokens inside the vocabulary."""
    if len(candidates) == 0:
        raise ValueError("no candidates")
    if len(groups) != len(candidates):
        raise ValueError(f"{len(groups)} groups for {len(candidates)} candidates")
    for c, ids in enumerate(candidates):
        if len(ids) == 0:
            raise ValueError(f"candidate {c} has no tokens")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"candidate {c} has token ids outside [0, {vocab_size})")


def last_hidden(backbone: Backbone, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> torch.Tensor:
    return backbone.forward(backbone.prepare(candidates, groups))
