"""Slow reference for ``ltcx/ops/gated_delta.py``: the gated delta rule, one token at a time."""

from __future__ import annotations

import torch


def gated_delta_reference(q, k, v, g, beta, state=None, scale=None):
    """S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = scale S_t^T q_t, written out per token.
    q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T], state [B, H, Dk, Dv] (None: zeros), scale (None:
    Dk^-1/2) -> (o [B, H, T, Dv], final state), in the inputs' dtype. Checks ``gated_delta_chunked`` and
    ``gated_delta_step``."""
    dk, dv = k.shape[-1], v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    S = torch.zeros(*k.shape[:2], dk, dv, dtype=v.dtype) if state is None else state.to(v.dtype)
    eye = torch.eye(dk, dtype=v.dtype)
    outputs = []
    for t in range(k.shape[2]):
        kt, bt = k[:, :, t], beta[:, :, t, None, None]
        transition = g[:, :, t, None, None].exp() * (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2))
        S = transition @ S + bt * kt.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outputs, dim=2), S
