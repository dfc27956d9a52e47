"""Slow reference for ``ltcx/ops/ltc.py``: LTC attention with the T x T x D x D decay metric built in full."""

from __future__ import annotations

import math

import torch

from ltcx.ops.ltc import decay_metric


def ltc_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor, tau: torch.Tensor
) -> torch.Tensor:
    """The equation written out: s_ij = q_i^T M_{i-j} k_j / sqrt(D) with a T x T x D x D metric.

    q: [B, H, T, D]; k, v: [B, G, T, D]; modes U: [G, D, M] orthonormal; tau: [B, G, M] -> [B, H, T, D].
    Memory is O(B G T^2 D^2): small shapes only.
    """
    heads, length, head_dim = q.shape[1], q.shape[2], q.shape[3]
    groups = k.shape[1]
    pos = torch.arange(length, device=q.device)
    age = (pos[:, None] - pos[None, :]).clamp(min=0).to(q.dtype)  # [T, T]; j > i is masked below
    metric = decay_metric(modes, tau, age)  # [B, G, T, T, D, D]
    group_of_head = torch.arange(heads, device=q.device) // (heads // groups)
    metric = metric[:, group_of_head]  # [B, H, T, T, D, D]
    k_h, v_h = k[:, group_of_head], v[:, group_of_head]
    scores = torch.einsum("bhid,bhijde,bhje->bhij", q, metric, k_h) / math.sqrt(head_dim)
    causal = pos[None, :] <= pos[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_h
