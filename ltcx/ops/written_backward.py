"""Where an op runs with its backward written out: each ``torch.autograd.Function`` in ``ltcx/ops/`` that wraps an op's
own forward function, with a backward held to autograd of that function in float64 by the op's tests."""

from __future__ import annotations

import torch
from torch import Tensor


def wants_written_backward(*args: object) -> bool:
    """Whether an op runs as its Function rather than as its forward function under autograd: a gradient is wanted of
    a tensor among ``args``, and ``torch.compile`` is not tracing (Inductor fuses the differentiated forward itself).
    Without a gradient the forward function alone computes the same values and saves nothing for a backward."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(isinstance(x, Tensor) and x.requires_grad for x in args))


def cumsum_backward(grad: Tensor, dim: int = -1) -> Tensor:
    """The gradient of ``x.cumsum(dim)``'s input from that of its output: each step's sum over the outputs at and
    after it (a cumulative sum taken from the end)."""
    return grad.flip(dim).cumsum(dim).flip(dim)
