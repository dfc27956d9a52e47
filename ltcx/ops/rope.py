"""Rotary position embedding (Su et al. 2021), half-split layout as in LLaMA and the official GTA code."""

from __future__ import annotations

import torch


def rotary_embedding(x: torch.Tensor, start: int, base: float = 10000.0) -> torch.Tensor:
    """x [B, H, T, D] at positions [start, start + T), D even -> x with each pair (i, i + D/2) rotated
    by the angle position * base^(-2i / D). Angles are computed in float32 (float64 for float64 x)."""
    length, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** (-torch.arange(half, dtype=dtype, device=x.device) / half)
    angles = torch.arange(start, start + length, dtype=dtype, device=x.device)[:, None] * inv_freq  # [T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
