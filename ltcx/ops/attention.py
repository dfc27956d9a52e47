"""Causal grouped-query attention over a key/value sequence that may start with cached positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of new queries over all keys, causal in absolute position.

    q: [B, H, T, D], the queries of the last T positions.
    k: [B, H_kv, P + T, D], v: [B, H_kv, P + T, D_v], keys and values of the P cached positions followed
    by the T new ones. H must be a multiple of H_kv; query head h reads KV head h // (H / H_kv).
    scale: of the scores; None = 1 / sqrt(D). Returns [B, H, T, D_v].

    One call to ``scaled_dot_product_attention``: its ``is_causal`` aligns the mask to the top-left
    corner, which is right only without a cache, so with P > 0 the mask is built explicitly.
    """
    new_len, total_len = q.shape[-2], k.shape[-2]
    past_len = total_len - new_len
    gqa = q.shape[1] != k.shape[1]
    if past_len == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa)
    if new_len == 1:  # one new query sees every key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    key_pos = torch.arange(total_len, device=q.device)
    query_pos = torch.arange(past_len, total_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [T, P+T], True = may attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
