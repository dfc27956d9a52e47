"""Attention as pure functions: causal grouped-query attention over a key/value sequence that may start with
cached positions; rotary embeddings; attention with persistent (position-free) slots and a sliding window."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of new queries over all keys, causal in absolute position.

    q: [B, H, T, D], the queries of the last T positions.
    k: [B, H_kv, P + T, D], v: [B, H_kv, P + T, D_v], keys and values of the P cached positions followed
    by the T new ones. H must be a multiple of H_kv; query head h reads KV head h // (H / H_kv).
    scale: of the scores; None = 1 / sqrt(D). key_mask [B, P + T] (bool, True = a real token; None = all real):
    no query sees a masked key, except a masked query its own (so its output stays finite). Returns [B, H, T, D_v].

    One call to ``scaled_dot_product_attention``: its ``is_causal`` aligns the mask to the top-left
    corner, which is right only without a cache, so with P > 0 the mask is built explicitly.
    """
    new_len, total_len = q.shape[-2], k.shape[-2]
    past_len = total_len - new_len
    gqa = q.shape[1] != k.shape[1]
    if key_mask is not None:
        key_pos = torch.arange(total_len, device=q.device)
        query_pos = torch.arange(past_len, total_len, device=q.device)
        causal = key_pos[None, :] <= query_pos[:, None]  # [T, P+T]
        allowed = causal & (key_mask[:, None, :] | (key_pos[None, :] == query_pos[:, None]))  # [B, T, P+T]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    if past_len == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa)
    if new_len == 1:  # one new query sees every key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    key_pos = torch.arange(total_len, device=q.device)
    query_pos = torch.arange(past_len, total_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [T, P+T], True = may attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding, rotate-half layout: x [..., T, D] (D even) at integer positions [T] (or [B, T],
    a row's own, for x [B, H, T, D]).

    Pair i of (x[..., i], x[..., i + D/2]) is rotated by the angle position * base^(-2i/D). The angles are
    computed in float64 from the absolute position, so a token gets bit-identical rotations whether it is
    embedded in a long prefill or in a one-token decode step.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = positions.to(device=x.device, dtype=torch.float64)[..., None] * inv_freq  # [T, D/2] or [B, T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if positions.dim() == 2:  # per-row positions [B, T]: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def padded_positions(mask: torch.Tensor, past_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions that count real tokens only: mask [B, T] of new tokens and past_mask [B, P] of the cached ones
    (bool, True = real) -> (positions [B, T], each token's number of real tokens before it in its row (a masked
    one gets its real predecessor's, finite and unused), key_mask [B, P + T] = [past_mask, mask])."""
    seen = past_mask.sum(1, keepdim=True)  # [B, 1]
    positions = (seen + mask.long().cumsum(1) - 1).clamp(min=0)
    return positions, torch.cat([past_mask, mask], dim=1)


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., T] and [..., L] absolute positions -> [..., T, L] bool, True where query i may see key j:
    i - window < j <= i."""
    offset = query_positions[..., :, None] - key_positions[..., None, :]
    return (offset >= 0) & (offset < window)


def attention_with_persistent(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v: torch.Tensor,
    persistent_k: torch.Tensor,
    persistent_v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention over position-free persistent slots and masked, rotary-embedded token keys.

    q, q_rot: [B, H, T, D] queries without and with RoPE; k_rot, v: [B, H_kv, L, D] token keys (with RoPE)
    and values; persistent_k, persistent_v: [H_kv, N_p, D] learned slots every query sees, scored with the
    unrotated query so they mean the same at every position; mask [T, L] bool, True = may attend.
    Query head h reads KV head h // (H / H_kv). Scale 1/sqrt(D). Returns [B, H, T, D].

    One SDPA call: queries [q_rot | q] against keys [k_rot | 0] (tokens) and [0 | persistent_k] (slots), so
    each score picks the right pair.
    """
    batch, kv_heads, length, dim = k_rot.shape
    slots = persistent_k.shape[1]
    persistent_k = persistent_k.to(k_rot.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
    persistent_v = persistent_v.to(v.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
    keys = torch.cat(
        [
            torch.cat([persistent_k.new_zeros(batch, kv_heads, slots, dim), persistent_k], dim=-1),
            torch.cat([k_rot, k_rot.new_zeros(batch, kv_heads, length, dim)], dim=-1),
        ],
        dim=2,
    )
    values = torch.cat([persistent_v, v], dim=2)
    full_mask = torch.cat([mask.new_ones(*mask.shape[:-1], slots), mask], dim=-1)
    return F.scaled_dot_product_attention(
        torch.cat([q_rot, q], dim=-1), keys, values, attn_mask=full_mask, dropout_p=dropout_p,
        scale=dim ** -0.5, enable_gqa=q.shape[1] != kv_heads,
    )


def sliding_window_attention(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v: torch.Tensor,
    persistent_k: torch.Tensor,
    persistent_v: torch.Tensor,
    position: int,
    window: int,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``attention_with_persistent`` under the sliding window, at a cost that grows with T x window, not T x L.

    q, q_rot [B, H, T, D]: queries at positions [P, P+T) (P = ``position``); k_rot, v [B, H_kv, L, D]: the keys
    at the L positions that end with the queries' (a cached prefix first); query i sees the keys at positions
    (p_i - window, p_i]. Returns [B, H, T, D].

    Where the keys are more than two windows, the queries run in blocks of ``window``, all in one call with the blocks
    folded into the batch, each block against the 2 window - 1 keys its queries can see (the first block's span
    padded before the first key, the last block after the last query; the padding is masked): the masked kernel then
    scores 2 window - 1 keys a query instead of all L. The same softmax over the same visible keys and slots as the
    single call, which shorter inputs keep.
    """
    batch, heads, length, dim = q.shape
    kv_heads, keys = k_rot.shape[1], k_rot.shape[2]
    device = q.device
    key_start = position + length - keys
    if keys <= 2 * window:
        mask = sliding_window_mask(torch.arange(position, position + length, device=device),
                                   torch.arange(key_start, position + length, device=device), window)
        return attention_with_persistent(q, q_rot, k_rot, v, persistent_k, persistent_v, mask, dropout_p)
    span, blocks = 2 * window - 1, -(-length // window)
    first = position - window + 1  # the first position any query sees; block b's span starts at first + b window
    if key_start < first:  # a longer cache than the window: keys no query sees
        k_rot, v = k_rot[:, :, first - key_start:], v[:, :, first - key_start:]
        keys, key_start = keys - (first - key_start), first
    padding = (0, 0, key_start - first, blocks * window - length)  # positions [first, first + (blocks + 1) window - 1)

    def spans(x: torch.Tensor) -> torch.Tensor:  # [B, H_kv, L, D] -> [B blocks, H_kv, span, D]
        windows = F.pad(x, padding).unfold(2, span, window)  # [B, H_kv, blocks, D, span]
        return windows.permute(0, 2, 1, 4, 3).reshape(batch * blocks, kv_heads, span, dim)

    def in_blocks(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B blocks, H, window, D]
        x = F.pad(x, (0, 0, 0, blocks * window - length)).unflatten(2, (blocks, window))
        return x.transpose(1, 2).reshape(batch * blocks, heads, window, dim)

    starts = first + window * torch.arange(blocks, device=device)  # [blocks]
    span_positions = starts[:, None] + torch.arange(span, device=device)  # [blocks, span]
    block_queries = starts[:, None] + window - 1 + torch.arange(window, device=device)  # [blocks, window]
    real_key = (span_positions >= key_start) & (span_positions < position + length)  # not padding
    mask = sliding_window_mask(block_queries, span_positions, window) & real_key[:, None, :]  # [blocks, window, span]
    mask = mask.expand(batch, -1, -1, -1).reshape(batch * blocks, 1, window, span)
    y = attention_with_persistent(in_blocks(q), in_blocks(q_rot), spans(k_rot), spans(v), persistent_k,
                                  persistent_v, mask, dropout_p)  # [B blocks, H, window, D]
    return y.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :length]
