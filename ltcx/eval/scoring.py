"""The log-probability of each target token under a trained backbone, fed through the backbone's state in pieces
(memory bounded by the piece, not the sequence). Used by loss by position (``position_loss.py``) and by the
lm-evaluation-harness adapter (``harness.py``). Pure: tensors and a backbone in, tensors out.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["target_log_probs"]


@torch.no_grad()
def target_log_probs(
    backbone: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    piece_len: int | None = None,
    vocab_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs, targets [B, T] -> (log p(target | inputs up to it) [B, T], whether the target is the argmax [B, T]).

    The inputs are fed in consecutive pieces of ``piece_len`` tokens (None: whole) carrying the backbone's state, which
    the backbone contract makes equal to feeding them whole, so only one piece's logits [B, piece_len, V] are held at
    a time. The log-probabilities are over the whole (padded) vocabulary, as the training loss has them, in float32
    (float64 for a float64 model); ``vocab_limit`` keeps padding ids out of the argmax.
    """
    if piece_len is not None and piece_len < 1:
        raise ValueError(f"piece_len ({piece_len}) must be >= 1")
    length = inputs.shape[1]
    step = length if piece_len is None else piece_len
    state, log_probs, greedy = None, [], []
    for start in range(0, length, max(step, 1)):
        logits, state = backbone(inputs[:, start : start + step], state)  # [B, piece, V]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        piece_targets = targets[:, start : start + step, None]
        log_probs.append(logits.log_softmax(-1).gather(-1, piece_targets)[..., 0])
        greedy.append(logits[..., :vocab_limit].argmax(-1) == piece_targets[..., 0])
    if not log_probs:
        empty = inputs.new_zeros(inputs.shape, dtype=torch.float32)
        return empty, empty.bool()
    return torch.cat(log_probs, dim=1), torch.cat(greedy, dim=1)
