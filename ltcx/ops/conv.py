"""Depthwise causal convolution over time with a carried buffer (xLSTM's and Titans' short convolutions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_depthwise_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, buffer: Tensor | None = None, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """out_t = bias + sum_j weight[:, 0, j] * x_{t-K+1+j}, per channel, over time only.

    x [B, T, C]; weight [C, 1, K]; bias [C] or None; buffer [B, K-1, C]: the K-1 inputs before x (None =
    zeros, the start of a sequence). Returns (out [B, T, C], the new buffer [B, K-1, C]), so feeding a
    sequence in pieces equals feeding it whole. mask [B, T] (bool, True = a real token; None = all real): the
    convolution runs over the real tokens only, as if the masked ones were not there; a masked position's output
    is finite and meaningless, and the buffer keeps the last K-1 real inputs.

    The sum is one product of the taps with a sliding-window view (``unfold``) of the padded input, summed over the
    window: a few large ops whatever K, forward and backward (autograd's: the two products' gradients, a sum for the
    taps, ``unfold_backward`` for the input), rather than a few small ops per tap. F.conv1d(groups=C) computes the
    same sum, but its CPU backward is far slower at these widths.
    """
    if mask is not None:
        return _masked_conv(x, weight, bias, buffer, mask)
    kernel = weight.shape[-1]
    # at a sequence's start one pad (its backward one copy) rather than a zero buffer and a cat
    padded = F.pad(x, (0, 0, kernel - 1, 0)) if buffer is None else torch.cat([buffer.to(x.dtype), x], dim=1)
    windows = padded.unfold(1, kernel, 1)  # [B, T, C, K], a view: windows[:, t, :, j] = padded[:, t + j]
    # flatten, not weight[:, 0]: a view whose gradient is a view too (a select's backward fills a zero tensor)
    out = (windows * weight.flatten(1)).sum(-1)
    return out if bias is None else out + bias, padded[:, padded.shape[1] - (kernel - 1):]


def _masked_conv(x: Tensor, weight: Tensor, bias: Tensor | None, buffer: Tensor | None,
                 mask: Tensor) -> tuple[Tensor, Tensor]:
    """``causal_depthwise_conv`` over the real tokens only: each row of [buffer, x] is reordered (stably) to
    [masked inputs, buffer, real inputs], convolved from zeros, and the outputs put back in place; a real token's
    window then holds the real inputs (and the buffer) before it, whatever lies between them."""
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    if buffer is None:
        buffer = x.new_zeros(batch, kernel - 1, channels)
    combined = torch.cat([buffer.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    rank = torch.cat([mask.new_ones(batch, kernel - 1, dtype=torch.long), 2 * mask.long()], dim=1)
    order = torch.argsort(rank, dim=1, stable=True)  # masked (0), buffer (1), real (2)
    gather = order.unsqueeze(-1).expand(-1, -1, channels)
    reordered = combined.gather(1, gather)
    out_reordered, _ = causal_depthwise_conv(reordered, weight, bias)
    out = torch.empty_like(out_reordered).scatter_(1, gather, out_reordered)
    return out[:, kernel - 1:], reordered[:, length:]
