"""Weights derived from parameters (a product, a sum, a rotation) kept between the decode steps of one generation.

A decode step runs the whole network for one token, so rebuilding a derived weight every step can cost as
much as the step's own attention. Inside ``keeping_derived(model)`` (``ltcx.generation`` enters it for each
generation) a derived value is kept on its module and reused until one of its parameters is a new tensor or was
written in place (seen through the version counter); leaving the scope drops every kept value. Outside the scope
(training, validation, any forward) it is rebuilt every call: the version counter cannot be trusted between calls,
because torch's fused AdamW (ltcx's optimizer on CPU and CUDA) and FSDP2's gathers write new values in place
without bumping it, and a value kept across them served a validation the weights of an earlier step. Nothing
writes weights during a generation (a sharded fit generates its samples from an unsharded copy), so within the
scope the counter only has to catch a deliberate in-place edit. With gradients on, or while compiling, it is
rebuilt every call in the scope too: it is part of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn as nn

T = TypeVar("T")

# Set in a module's __dict__ by keeping_derived: the number of open scopes over it.
_KEEPING = "_ltcx_keeping_derived"
_SLOT = "_derived_"


@contextmanager
def keeping_derived(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s modules keep their derived weights between no-grad calls. On leaving (the last of
    nested scopes over a module), each module's kept values are dropped, so nothing kept outlives the scope."""
    modules = list(model.modules())
    for module in modules:
        module.__dict__[_KEEPING] = module.__dict__.get(_KEEPING, 0) + 1
    try:
        yield
    finally:
        for module in modules:
            left = module.__dict__.get(_KEEPING, 1) - 1
            if left > 0:
                module.__dict__[_KEEPING] = left
                continue
            module.__dict__.pop(_KEEPING, None)
            for slot in [key for key in module.__dict__ if key.startswith(_SLOT)]:
                del module.__dict__[slot]


def derived_in_inference(
    module: nn.Module, name: str, params: Iterable[torch.Tensor | None], build: Callable[[], T]
) -> T:
    """``build()``, kept on ``module`` under ``name`` between no-grad calls inside ``keeping_derived`` while
    ``params`` are unchanged; built afresh on every other call.

    The value lives in the module's ``__dict__`` (never in its state_dict or its parameters).
    """
    state = module.__dict__
    if not state.get(_KEEPING) or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return build()
    key = tuple((id(p), p.data_ptr(), p._version, p.dtype, p.device) for p in params if p is not None)
    slot = _SLOT + name
    kept = state.get(slot)
    if kept is None or kept[0] != key:
        kept = (key, build())
        state[slot] = kept
    return kept[1]
