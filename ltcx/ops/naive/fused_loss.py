"""Slow reference for ``ltcx/ops/fused_loss.py``: the head's full ``[N, V]`` logits, then ``F.cross_entropy``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ltcx.batches import IGNORE_INDEX


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, C], weight [V, C], targets [N], bias [V] -> (summed cross-entropy over the targets not
    ``IGNORE_INDEX``, their count): the logits in full, read in float32 (float64 stays float64)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets != IGNORE_INDEX).sum()
