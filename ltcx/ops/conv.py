"""Depthwise causal convolution over time with a carried buffer (xLSTM's and Titans' short convolutions)."""

from __future__ import annotations

import torch


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
    length = x.shape[1]
    # K shifted multiply-adds rather than F.conv1d(groups=C): the same sum, but its backward is plain
    # element-wise work, where the grouped convolution's CPU backward is ~100x slower at these widths.
    # contiguous: a tap read as a strided row of the [C, 1, K] weight makes every multiply (and its backward)
    # take the slow strided path, ~4x the time
    taps = weight[:, 0].t().contiguous()  # [K, C]
    out = padded[:, :length] * taps[0]
    for j in range(1, kernel):
        out = torch.addcmul(out, padded[:, j:j + length], taps[j])
    if bias is not None:
        out = out + bias
    return out, padded[:, padded.shape[1] - (kernel - 1):]
