"""Where an op runs with its backward written out: the ops whose ``torch.autograd.Function`` (the sLSTM's ``_Scan``, the
mLSTM's ``_ChunkOutputs``, ``_ChunkOwn`` and ``_ChunkStarts``, Titans' ``_MemoryChunk`` and ``_MemoryGates``, RoPE's
``_Rotate``, l2norm's ``_L2Normalize``) wraps the op's own forward function and has a backward held to autograd of that
function in float64."""

from __future__ import annotations

import torch
from torch import Tensor


def wants_written_backward(*args: object) -> bool:
    """Whether an op runs as its Function rather than as its forward function under autograd: a gradient is wanted of
    a tensor among ``args``, and ``torch.compile`` is not tracing (Inductor fuses the differentiated forward itself).
    Without a gradient the forward function alone computes the same values and saves nothing for a backward."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(isinstance(x, Tensor) and x.requires_grad for x in args))
