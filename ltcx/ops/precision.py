"""Precision helpers for the fast forms that must run in float32 (or float64) whatever the model's dtype."""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def without_autocast(device: torch.device):
    """Matmuls inside run in the dtype of their inputs (float32), not autocast's bf16."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a Linear layer with ``dtype`` weights outputs on ``device`` here: autocast's for float32 weights
    where autocast is on, else ``dtype``."""
    if dtype == torch.float32 and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype
