"""Slow reference for ``ltcx/ops/conv.py``: the causal depthwise convolution, one output step at a time."""

from __future__ import annotations

import torch


def causal_conv_reference(x, weight, bias=None, buffer=None):
    """out_t = bias + sum_j weight[c, 0, j] x_{t-K+1+j} per channel c, the inputs before x read from ``buffer``
    (zeros without one). x [B, T, C], weight [C, 1, K], bias [C], buffer [B, K-1, C] -> [B, T, C]. Checks
    ``causal_depthwise_conv``."""
    kernel = weight.shape[-1]
    before = x.new_zeros(x.shape[0], kernel - 1, x.shape[2]) if buffer is None else buffer.to(x.dtype)
    full = torch.cat([before, x], dim=1)
    out = torch.stack([sum(full[:, t + j] * weight[:, 0, j] for j in range(kernel)) for t in range(x.shape[1])], 1)
    return out if bias is None else out + bias


def masked_causal_conv_reference(x, weight, bias=None, buffer=None, mask=None):
    """``causal_conv_reference`` over each row's real tokens alone (mask [B, T], True = real): the real inputs of a
    row, gathered in order, convolved after its buffer, and put back at their positions; masked positions are 0.
    Checks ``causal_depthwise_conv(..., mask=)``."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        real = mask[b].nonzero().flatten()
        if len(real):
            row_buffer = None if buffer is None else buffer[b:b + 1]
            out[b, real] = causal_conv_reference(x[b:b + 1, real], weight, bias, row_buffer)[0]
    return out
