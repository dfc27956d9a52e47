"""Loss by position: the mean next-token loss at each position along a sequence, to see how a model does up to and
past the length it was trained on; its spans, the plot and the JSON of ``ltcx evaluate``.

Scored through ``target_log_probs`` (``scoring.py``). Pure: tensors and a backbone in, tensors out; the command line
(``ltcx/cli/evaluate.py``) loads models and data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ltcx.eval.scoring import target_log_probs

__all__ = ["PositionLoss", "context_spans", "plot_position_loss", "position_loss", "to_json"]


@dataclass
class PositionLoss:
    """Next-token loss summed over sequences at each position: ``loss_sum[t]`` over ``count[t]`` predictions of the
    token after input position t (t = 0: the prediction from the first token alone). Both [T], float64 / int64."""

    loss_sum: torch.Tensor
    count: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.loss_sum.shape[0])

    def mean(self, start: int = 0, end: int | None = None) -> float:
        """Mean loss over positions [start, end) (every prediction there weighted alike)."""
        end = self.length if end is None else min(end, self.length)
        count = int(self.count[start:end].sum())
        return float(self.loss_sum[start:end].sum()) / count if count else math.nan

    def buckets(self, size: int) -> list[dict]:
        """Consecutive position buckets of ``size`` tokens: ``[{"start", "end", "loss"}]`` (the last may be shorter)."""
        return [
            {"start": start, "end": min(start + size, self.length), "loss": self.mean(start, start + size)}
            for start in range(0, self.length, size)
        ]


def position_loss(
    backbone: nn.Module,
    blocks: Iterable[torch.Tensor],
    *,
    length: int,
    piece_len: int | None = None,
    batch_size: int | None = None,
) -> PositionLoss:
    """Mean next-token loss by position over token blocks, each at least ``length + 1`` tokens long.

    blocks: an iterable of LongTensor [B, >= length + 1] batches (or [>= length + 1] single blocks); the first
    ``length + 1`` tokens of each are scored: inputs ``block[:length]``, targets ``block[1:length + 1]``.
    batch_size: re-batch to at most this many sequences per forward (None: as given).
    """
    device = next(backbone.parameters()).device
    loss_sum = torch.zeros(length, dtype=torch.float64, device=device)
    count = torch.zeros(length, dtype=torch.long, device=device)
    for batch in _rebatch(blocks, batch_size):
        batch = batch[:, : length + 1].to(device)
        if batch.shape[1] < length + 1:
            raise ValueError(f"a block of {batch.shape[1]} tokens is shorter than length + 1 = {length + 1}")
        log_probs, _ = target_log_probs(backbone, batch[:, :-1], batch[:, 1:], piece_len)
        loss_sum -= log_probs.to(torch.float64).sum(0)
        count += batch.shape[0]
    return PositionLoss(loss_sum.cpu(), count.cpu())


def _rebatch(blocks: Iterable[torch.Tensor], batch_size: int | None) -> Iterable[torch.Tensor]:
    for batch in blocks:
        batch = batch if batch.dim() == 2 else batch[None]
        step = batch.shape[0] if batch_size is None else batch_size
        yield from batch.split(step)


def context_spans(context: int | None, length: int) -> list[tuple[int, int]]:
    """Position spans by multiples of the training ``context`` C up to ``length``: [0, C), [C, 2C), [2C, 4C), ...
    (the last cut at ``length``); one span [0, length) when the context is unknown."""
    if not context:
        return [(0, length)]
    spans, start, end = [], 0, context
    while start < length:
        spans.append((start, min(end, length)))
        start, end = end, 2 * end
    return spans


def plot_position_loss(results: Sequence[dict], path: str, bucket_size: int) -> None:
    """A PNG of mean loss against position, one line per result (``label``, ``buckets``), the training context of
    each marked by a dotted vertical line of its colour."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for result in results:
        centres = [(b["start"] + b["end"] - 1) / 2 for b in result["buckets"]]
        (line,) = axes.plot(centres, [b["loss"] for b in result["buckets"]], marker=".", label=result["label"])
        if result.get("train_context"):
            axes.axvline(result["train_context"], color=line.get_color(), linestyle=":", linewidth=1)
    axes.set_xlabel(f"position (tokens; buckets of {bucket_size})")
    axes.set_ylabel("mean next-token loss (nats)")
    axes.set_title("loss by position (dotted: training context)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120, format="png")
    plt.close(figure)


def to_json(results: Sequence[dict], settings: dict) -> str:
    """The JSON document ``ltcx evaluate`` writes (NaN, for an empty bucket, as null)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean({"settings": settings, "results": list(results)}), indent=2) + "\n"
