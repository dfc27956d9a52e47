"""Slow reference for ``ltcx/ops/ssd.py``: Mamba-2's selective SSM, one token at a time."""

from __future__ import annotations

import torch


def ssd_reference(x, dt, A, B, C, state=None):
    """h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t per head, written out per token. x [B, H, T, P],
    dt [B, H, T], A [H], B, C [B, T, N], state [B, H, P, N] (None: zeros) -> (y [B, H, T, P], final state), in x's
    dtype. Checks ``ssd_chunked`` and ``ssd_step``."""
    h = torch.zeros(*x.shape[:2], x.shape[-1], B.shape[-1], dtype=x.dtype) if state is None else state.to(x.dtype)
    outputs = []
    for t in range(x.shape[2]):
        decay = torch.exp(dt[:, :, t] * A)[..., None, None]
        h = decay * h + torch.einsum("bhp,bn->bhpn", dt[:, :, t, None] * x[:, :, t], B[:, t])
        outputs.append(torch.einsum("bhpn,bn->bhp", h, C[:, t]))
    return torch.stack(outputs, dim=2), h
