"""Slow references for ``ltcx/ops/attention.py``: softmax attention with a loop over batch, head and query
(``causal_gqa_attention``), RoPE as explicit 2x2 rotation matrices (``apply_rope``), and attention with
persistent slots under any visibility rule, one query at a time (``attention_with_persistent``)."""

from __future__ import annotations

import math

import torch


def naive_attention(q, k, v):
    """Softmax attention written out: query i of the last T positions attends keys j <= its position,
    out_i = sum_{j <= P + i} softmax_j(q_i . k_j / sqrt(D)) v_j, query head h reading KV head h // (H / G).

    q [B, H, T, D]; k, v [B, G, P + T, D] (P cached positions first) -> [B, H, T, D]. Checks
    ``causal_gqa_attention``."""
    batch, n_head, new_len, dim = q.shape
    group = n_head // k.shape[1]
    past_len = k.shape[2] - new_len
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(n_head):
            kh, vh = k[b, h // group], v[b, h // group]
            for i in range(new_len):
                pos = past_len + i
                scores = torch.stack([q[b, h, i] @ kh[j] / math.sqrt(dim) for j in range(pos + 1)])
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = (weights[:, None] * vh[: pos + 1]).sum(0)
    return out


def rope_matrix(position: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The [dim, dim] rotation of rotate-half RoPE at one position: dimension pair (i, i + dim/2) is turned by the
    angle position · base^(−2i/dim) with the 2×2 matrix [[cos, −sin], [sin, cos]]."""
    rot = torch.zeros(dim, dim, dtype=torch.float64)
    half = dim // 2
    for i in range(half):
        angle = position * base ** (-2.0 * i / dim)
        c, s = math.cos(angle), math.sin(angle)
        rot[i, i], rot[i, i + half] = c, -s
        rot[i + half, i], rot[i + half, i + half] = s, c
    return rot


def reference_rope(x: torch.Tensor, positions: list[int], base: float = 10000.0) -> torch.Tensor:
    """x [..., T, D]: token t multiplied by rope_matrix(positions[t]), x_t -> R(p_t) x_t; returns [..., T, D]
    float64. Checks ``apply_rope``."""
    return torch.stack([x[..., t, :] @ rope_matrix(p, x.shape[-1], base).T for t, p in enumerate(positions)], -2)


def reference_attention(q, k, v, persistent_k, persistent_v, query_positions, key_positions, visible, base=10000.0):
    """Per query, the explicit list of keys it sees: every persistent slot, scored with the unrotated query, then
    every token key j with visible(i, j) (absolute positions), scored with RoPE'd query and key; softmax of
    scores / √D; weighted sum of the matching values. Query head h reads KV head h // (H / H_kv).

    q [B, H, T, D]; k, v [B, H_kv, L, D]; persistent_k, persistent_v [H_kv, N_p, D]; query_positions (T) and
    key_positions (L) absolute positions; visible(i, j) -> bool on indices -> [B, H, T, D]. Checks
    ``attention_with_persistent`` (with ``apply_rope`` and ``sliding_window_mask``)."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i, qpos in enumerate(query_positions):
                q_rot = rope_matrix(qpos, dim, base) @ q[b, h, i]
                scores = [q[b, h, i] @ persistent_k[g, p] for p in range(persistent_k.shape[1])]
                values = [persistent_v[g, p] for p in range(persistent_k.shape[1])]
                for j, kpos in enumerate(key_positions):
                    if visible(i, j):
                        scores.append(q_rot @ (rope_matrix(kpos, dim, base) @ k[b, g, j]))
                        values.append(v[b, g, j])
                weights = torch.softmax(torch.stack(scores) / math.sqrt(dim), dim=0)
                out[b, h, i] = (weights[:, None] * torch.stack(values)).sum(0)
    return out
