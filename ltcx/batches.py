"""What a batch is, for the data modules that make it and the model that reads it: a block ``LongTensor[B, T + 1]``
(text: every next token is a target) or a pair ``(inputs LongTensor[B, T], targets LongTensor[B, T])`` whose targets
are ``IGNORE_INDEX`` where nothing is asked (a recall task, ``ltcx/data/mqar.py``)."""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "split_batch"]

IGNORE_INDEX = -100  # a target nothing is asked of: left out of the loss and the accuracy (F.cross_entropy's default)


def split_batch(batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch -> ``(inputs [B, T], targets [B, T])``: a block ``[B, T + 1]`` is cut one token apart (targets are
    the next tokens); an ``(inputs, targets)`` pair is returned as it is."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :-1], batch[:, 1:]
    inputs, targets = batch
    return inputs, targets
