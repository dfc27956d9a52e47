"""Evaluation scores of a split over every rank's batches: loss, perplexity, bits per byte and recall accuracy."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric, SumMetric

from ltcx.batches import IGNORE_INDEX

__all__ = ["EvalScores", "cross_entropy"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> mean cross-entropy (float32) over the targets not ``IGNORE_INDEX``: the
    full logits' loss (training fuses the head with it instead, ``Backbone.forward`` with targets)."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


class EvalScores(nn.Module):
    """One evaluation split's scores, over every rank's batches: the mean loss; the recall accuracy of pair batches
    that leave targets out; the target tokens; and, given the bytes per token id, the nats and the bytes for bits per
    byte (summed nats / ln 2 / the UTF-8 bytes the targets decode to). Metric states only: nothing in a state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.loss, self.recall_acc = MeanMetric(), MeanMetric()
        self.nats, self.tokens, self.bytes = (SumMetric().set_dtype(torch.float64) for _ in range(3))
        self.recall_scored = False

    def update(self, loss: torch.Tensor, correct: torch.Tensor | None, targets: torch.Tensor,
               token_bytes: torch.Tensor | None) -> None:
        """``loss``: the batch's mean over its asked targets ``[B, T]``; ``token_bytes``: ``[V]`` or None."""
        asked = targets != IGNORE_INDEX
        count = asked.sum()
        self.loss.update(loss, weight=targets.shape[0])
        self.tokens.update(count)
        if correct is not None:
            self.recall_acc.update(correct.float().mean(), weight=correct.numel())
            self.recall_scored = True
        if token_bytes is not None:
            self.nats.update(loss.double() * count)
            self.bytes.update(token_bytes[targets.clamp(min=0)].masked_fill(~asked, 0).sum())

    def log_to(self, module: L.LightningModule, prefix: str, bpb: bool) -> dict[str, int]:
        """Log ``{prefix}/loss``, ``/ppl``, ``/bpb`` (``bpb``), ``/recall_acc`` (pair batches) and reset; returns the
        tokens (and bytes) counted."""
        loss = self.loss.compute()
        module.log(f"{prefix}/loss", loss, prog_bar=prefix == "val")
        module.log(f"{prefix}/ppl", torch.exp(loss))
        counts = {"tokens": int(self.tokens.compute())}
        if bpb:
            total = self.bytes.compute()
            counts["bytes"] = int(total)
            if counts["bytes"] > 0:
                module.log(f"{prefix}/bpb", self.nats.compute() / math.log(2) / total)
        if self.recall_scored:  # every rank reads the same kind of batches: all of them take this branch
            module.log(f"{prefix}/recall_acc", self.recall_acc.compute(), prog_bar=prefix == "val")
        for metric in (self.loss, self.recall_acc, self.nats, self.tokens, self.bytes):
            metric.reset()
        self.recall_scored = False
        return counts
