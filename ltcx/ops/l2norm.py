"""L2 normalisation over the last dim with its backward written out (Titans' and Gated DeltaNet's queries and keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .written_backward import wants_written_backward


def l2_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """x / max(||x||, eps) over the last dim: ``F.normalize(x, dim=-1, eps=eps)``, x [..., D] -> [..., D].

    Under autograd it runs as ``_L2Normalize``: differentiated op by op (the norm, the clamp, the division) the
    backward is a dozen small ops; written out, half as many."""
    return _L2Normalize.apply(x, eps) if wants_written_backward(x) else F.normalize(x, dim=-1, eps=eps)


class _L2Normalize(torch.autograd.Function):
    """``F.normalize(x, dim=-1, eps)`` with its backward written out. With n = ||x|| and y = x / max(n, eps), the
    gradient g of y gives x the gradient (g - y (g . y)) / n where n >= eps (there autograd's clamp passes the
    norm's gradient, n = eps included), and g / eps where n < eps (the clamped norm is a constant)."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        norm = x.norm(2, -1, keepdim=True)  # F.normalize's own ops, so the values are its own
        clamped = norm.clamp_min(eps)
        y = x / clamped
        ctx.save_for_backward(y, norm, clamped)
        ctx.eps, ctx.dtype = eps, x.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        y, norm, clamped = ctx.saved_tensors
        along = (grad * y).sum(-1, keepdim=True).masked_fill_(norm < ctx.eps, 0)  # g . y; 0 where clamped
        return torch.addcmul(grad, y, along, value=-1).div_(clamped).to(ctx.dtype), None
