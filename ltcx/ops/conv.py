"""Depthwise causal convolution over time with a carried buffer (xLSTM's and Titans' short convolutions)."""

from __future__ import annotations

import torch
from torch import Tensor

from .written_backward import wants_written_backward


def causal_depthwise_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, buffer: Tensor | None = None, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """out_t = bias + sum_j weight[:, 0, j] * x_{t-K+1+j}, per channel, over time only.

    x [B, T, C]; weight [C, 1, K]; bias [C] or None; buffer [B, K-1, C]: the K-1 inputs before x (None =
    zeros, the start of a sequence). Returns (out [B, T, C], the new buffer [B, K-1, C]), so feeding a
    sequence in pieces equals feeding it whole. mask [B, T] (bool, True = a real token; None = all real): the
    convolution runs over the real tokens only, as if the masked ones were not there; a masked position's output
    is finite and meaningless, and the buffer keeps the last K-1 real inputs.
    """
    if mask is not None:
        return _masked_conv(x, weight, bias, buffer, mask)
    batch, _, channels = x.shape
    kernel = weight.shape[-1]
    if buffer is None:
        buffer = x.new_zeros(batch, kernel - 1, channels)
    padded = torch.cat([buffer.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    # contiguous: a tap read as a strided row of the [C, 1, K] weight makes every multiply (and its backward)
    # take the slow strided path
    taps = weight[:, 0].t().contiguous()  # [K, C]
    args = (padded, taps, bias, x.shape[1])
    out = _ShiftedSum.apply(*args) if wants_written_backward(*args) else _shifted_sum(*args)
    return out, padded[:, padded.shape[1] - (kernel - 1):]


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


def _shifted_sum(padded: Tensor, taps: Tensor, bias: Tensor | None, length: int) -> Tensor:
    """sum_j taps[j] * padded[:, j:j + length] (+ bias): padded [B, K-1+T, C], taps [K, C], bias [C] or None ->
    [B, T, C]. K shifted multiply-adds rather than F.conv1d(groups=C): the same sum, but its backward is plain
    element-wise work, where the grouped convolution's CPU backward is far slower at these widths. Differentiated
    by autograd, this is the oracle of ``_ShiftedSum``'s backward."""
    out = padded[:, :length] * taps[0]
    for j in range(1, taps.shape[0]):  # in place into the fresh sum: its old value is no product's input
        out.addcmul_(padded[:, j:j + length], taps[j])
    return out if bias is None else out + bias


class _ShiftedSum(torch.autograd.Function):
    """``_shifted_sum`` with its backward written out. Through autograd every tap's slice of ``padded`` has its own
    backward, a zero-filled tensor of padded's size with the slice copied in, and the engine adds the K of them;
    here the K products accumulate in place into one buffer, with no zero-filled tensor per tap."""

    @staticmethod
    def forward(ctx, padded: Tensor, taps: Tensor, bias: Tensor | None, length: int) -> Tensor:
        out = _shifted_sum(padded, taps, bias, length)
        ctx.save_for_backward(padded, taps)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        padded, taps = ctx.saved_tensors
        kernel, length = taps.shape[0], grad.shape[1]
        grad_padded = grad_taps = grad_bias = None
        if ctx.needs_input_grad[0]:  # padded[:, j + t] feeds out_t through taps[j]: one buffer, K in-place adds
            grad_padded = padded.new_empty(padded.shape)
            grad_padded[:, :kernel - 1].zero_()
            torch.mul(grad, taps[kernel - 1], out=grad_padded[:, kernel - 1:])  # rounded once to padded's dtype
            for j in range(kernel - 1):
                grad_padded[:, j:j + length].addcmul_(grad, taps[j])
        if ctx.needs_input_grad[1]:  # per channel, sum over batch and time of grad * the tap's slice
            product = torch.empty_like(grad)
            grad_taps = torch.stack([torch.mul(grad, padded[:, j:j + length], out=product).sum((0, 1))
                                     for j in range(kernel)]).to(taps.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 1)).to(ctx.bias_dtype)
        return grad_padded, grad_taps, grad_bias, None
