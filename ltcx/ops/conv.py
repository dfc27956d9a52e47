"""Depthwise causal convolution over time with a carried buffer (xLSTM's and Titans' short convolutions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, buffer: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_t = bias + sum_j weight[:, 0, j] * x_{t-K+1+j}, per channel, over time only.

    x [B, T, C]; weight [C, 1, K]; bias [C] or None; buffer [B, K-1, C]: the K-1 inputs before x (None =
    zeros, the start of a sequence). Returns (out [B, T, C], the new buffer [B, K-1, C]), so feeding a
    sequence in pieces equals feeding it whole.
    """
    batch, _, channels = x.shape
    kernel = weight.shape[-1]
    if buffer is None:
        buffer = x.new_zeros(batch, kernel - 1, channels)
    padded = torch.cat([buffer.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    out = F.conv1d(padded.transpose(1, 2), weight, bias, groups=channels).transpose(1, 2)
    return out, padded[:, padded.shape[1] - (kernel - 1):]
