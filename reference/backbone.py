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


def last_hidden(backbone: Backbone, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> torch.Tensor:
    return backbone.forward(backbone.prepare(candidates, groups))
