"""An inference cache of weights derived from parameters (a product, a sum, a rotation), rebuilt only when a
parameter changes.

A decode step runs the whole network for one token, so rebuilding a derived weight every step can cost as
much as the step's own attention. In inference the derived value is kept on the module and reused until one
of its parameters is a new tensor or was written in place (seen through the version counter; a write through
``.data`` is not seen). With gradients on, or while compiling, it is rebuilt every call: it is part of the
graph; and in a module sharded by FSDP2 (``ltcx.sharding``), whose gathers write new values without a new version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.nn as nn

T = TypeVar("T")

# Set in a module's __dict__ by ltcx.sharding.shard_backbone: FSDP2 gathers new values into the same unsharded
# tensors without bumping their version counters, so a kept value could not be told stale there.
DERIVED_NOT_KEPT = "_ltcx_derived_not_kept"


def derived_in_inference(
    module: nn.Module, name: str, params: Iterable[torch.Tensor | None], build: Callable[[], T]
) -> T:
    """``build()``, kept on ``module`` under ``name`` between inference calls while ``params`` are unchanged.

    The value lives in the module's ``__dict__`` (never in its state_dict or its parameters).
    """
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or module.__dict__.get(DERIVED_NOT_KEPT):
        return build()
    key = tuple((id(p), p.data_ptr(), p._version, p.dtype, p.device) for p in params if p is not None)
    slot = f"_derived_{name}"
    kept = module.__dict__.get(slot)
    if kept is None or kept[0] != key:
        kept = (key, build())
        module.__dict__[slot] = kept
    return kept[1]
