"""Helpers for the per-call state that backbones return (KV caches, recurrent states)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class RowStates:
    """A batch's state kept as one state per row (batch 1 each; None for a row that has seen no real token yet): for
    a backbone whose rows of a padded batch sit at positions of their own that its batched state can not hold
    (Titans' memory chunks and MAC segments start at each row's own multiples)."""

    rows: tuple


def state_batch_size(state: Any) -> int:
    """The number of rows of a state (-1 for one holding no tensor)."""
    if isinstance(state, RowStates):
        return len(state.rows)
    sizes: list[int] = []
    map_state_tensors(state, lambda t: sizes.append(t.shape[0]) or t)
    return sizes[0] if sizes else -1


def map_state_tensors(state: Any, fn) -> Any:
    """Apply ``fn`` to every tensor inside a (nested) state of tuples, lists, dicts and dataclasses."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {f.name: map_state_tensors(getattr(state, f.name), fn) for f in dataclasses.fields(state)}
        return dataclasses.replace(state, **changes)
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple
        return type(state)(*(map_state_tensors(s, fn) for s in state))
    if isinstance(state, (list, tuple)):
        return type(state)(map_state_tensors(s, fn) for s in state)
    if isinstance(state, dict):
        return {key: map_state_tensors(value, fn) for key, value in state.items()}
    return state


def model_dtype(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """``dtype``, or the dtype of the model's first floating-point parameter (what ``state_bytes`` counts in)."""
    if dtype is not None:
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def reorder_state(state: Any, index: torch.Tensor) -> Any:
    """Select (reorder, repeat or drop) batch rows of every tensor in ``state``: row b becomes old row index[b].

    Every tensor of a state is batch-first, so this serves beam search and expanding one prompt to many
    samples for every architecture (``RowStates``: its rows selected).
    """
    if isinstance(state, RowStates):
        return RowStates(tuple(state.rows[i] for i in index.tolist()))
    return map_state_tensors(state, lambda t: t.index_select(0, index.to(t.device)))
