"""Slow reference for ``ltcx/ops/conv.py``: the causal depthwise convolution, one output step at a time."""

from __future__ import annotations

import torch


def causal_conv_reference(x, weight, bias=None, buffer=None):
    """out_t = bias + sum_j weight[c, 0, j] x_{t-K+1+j} per channel c, the inputs before x read from ``buffer``
    (zeros without one). x [B, T, C], weight [C, 1, K], bias [C], buffer [B, K-1, C] -> [B, T, C]. Checks
    ``causal_depthwise_conv``."""
    kernel = weight.shape[-1]
    before = torch.zeros_like(x[:, : kernel - 1]) if buffer is None else buffer.to(x.dtype)
    full = torch.cat([before, x], dim=1)
    out = torch.stack([sum(full[:, t + j] * weight[:, 0, j] for j in range(kernel)) for t in range(x.shape[1])], 1)
    return out if bias is None else out + bias
