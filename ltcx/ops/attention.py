"""Attention as pure functions: causal grouped-query attention over a key/value sequence that may start with
cached positions; rotary embeddings; attention with persistent (position-free) slots and a sliding window."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ltcx.ops.written_backward import wants_written_backward


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


class RopeTables(NamedTuple):
    """The rotation of every position of a call, shared by its layers and by queries and keys: cos [T, D] and the
    signed sin [T, D] = [-sin | sin] of the angles (or [B, 1, T, D], a row's own, broadcast over the heads)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def at(self, piece: slice) -> RopeTables:
        """The tables of the positions ``piece`` of the call's (views)."""
        return RopeTables(self.cos[..., piece, :], self.sin[..., piece, :])


def rope_tables(positions: torch.Tensor, dim: int, dtype: torch.dtype, base: float = 10000.0) -> RopeTables:
    """Rotary tables for integer positions [T] (or [B, T]) and head width ``dim`` (even), in ``dtype``, on the
    positions' device.

    Pair i of (x[..., i], x[..., i + D/2]) turns by the angle position * base^(-2i/D). The angles are computed in
    float64 from the absolute position, then cast, so a token gets bit-identical rotations whether it is embedded in
    a long prefill or in a one-token decode step.
    """
    half = dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [T, D/2] or [B, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)
    if positions.dim() == 2:  # per-row positions [B, T]: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return RopeTables(cos, sin)


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotary position embedding, rotate-half layout: x [..., T, D] rotated by ``rope`` (``rope_tables`` of its T
    positions, in x's dtype) -> [..., T, D]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), x1, x2 the halves of D.

    Through ``_Rotate`` (the same forward, its backward written out) where a gradient is wanted
    (``wants_written_backward``), else ``_rotate``."""
    if wants_written_backward(x) and rope.cos.dtype == x.dtype:
        return _Rotate.apply(x, rope.cos, rope.sin)
    return _rotate(x, rope.cos, rope.sin)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [x2 | x1] on the last dim."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + [x2 | x1] [-sin | sin]: separate products and sum (no fused multiply-add), so every call rounds a
    token alike, whatever its length or whether a gradient is wanted. Differentiated by autograd, the oracle of
    ``_Rotate``'s backward."""
    return x * cos + _swap_halves(x) * sin


class _Rotate(torch.autograd.Function):
    """``_rotate`` with its backward in three ops (a flip, a product, a fused multiply-add), where autograd takes four
    or five: the rotation's transpose, the rotation by the opposite angles, g cos + swap(g sin) = g cos - swap(g) sin
    (swap(sin) = -sin). The tables get no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return torch.addcmul(grad * cos, _swap_halves(grad), sin, value=-1), None, None


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


def slot_keys_values(persistent_k: torch.Tensor, persistent_v: torch.Tensor, batch: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent slots [H_kv, N_p, D] as ``attend_with_slots`` reads them: keys [0 | persistent_k]
    [B, H_kv, N_p, 2D] and values [B, H_kv, N_p, D] (expanded over the batch, not copied)."""
    dim = persistent_k.shape[-1]
    keys = F.pad(persistent_k.to(dtype), (dim, 0))  # unsqueezed, so at batch 1 the backward sums nothing
    return keys[None].expand(batch, -1, -1, -1), persistent_v.to(dtype)[None].expand(batch, -1, -1, -1)


def with_slot_columns(mask: torch.Tensor, slots: int) -> torch.Tensor:
    """mask [..., T, L] over token keys -> [..., T, N_p + L], the N_p slot columns (every query sees them) first."""
    return torch.cat([mask.new_ones(*mask.shape[:-1], slots), mask], dim=-1)


def attend_with_slots(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """``attention_with_persistent`` on its parts as a caller making them once for many calls holds them:
    query [q_rot | q] [B, H, T, 2D]; keys and values, the pieces of the key axis in order (joined here): the slots'
    from ``slot_keys_values``, then token keys [k_rot | 0] [B, H_kv, ., 2D] and values [B, H_kv, ., D];
    mask [..., T, N_p + L] (``with_slot_columns``). Returns [B, H, T, D]."""
    dim = values[0].shape[-1]
    return F.scaled_dot_product_attention(
        query, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, dropout_p=dropout_p,
        scale=dim ** -0.5, enable_gqa=query.shape[1] != values[0].shape[1],
    )


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
    slot_k, slot_v = slot_keys_values(persistent_k, persistent_v, k_rot.shape[0], k_rot.dtype)
    return attend_with_slots(torch.cat([q_rot, q], dim=-1), [slot_k, F.pad(k_rot, (0, k_rot.shape[-1]))],
                             [slot_v, v], with_slot_columns(mask, persistent_k.shape[1]), dropout_p)


class WindowPlan(NamedTuple):
    """The geometry of ``sliding_window_attention`` for one shape of call, the same for every layer of a model's
    call: L token keys for T queries (their offsets fix it, not the position). Single call (blocks 0): mask
    [T, N_p + L]. In blocks: the first ``trim`` keys dropped (no query sees them), key padding (before, after) on
    the time axis, ``blocks`` blocks of ``window`` queries against spans of ``span`` keys, mask
    [B blocks, 1, window, N_p + span]."""

    window: int
    blocks: int
    span: int
    trim: int
    key_padding: tuple[int, int]
    mask: torch.Tensor


def window_plan(position: int, length: int, keys: int, window: int, slots: int, batch: int,
                device: torch.device) -> WindowPlan:
    """The ``WindowPlan`` of ``length`` queries at positions [P, P + T) (P = ``position``) over the ``keys`` keys
    that end with theirs, the window ``window``, N_p = ``slots``, batch B."""
    key_start = position + length - keys
    if keys <= 2 * window:
        mask = sliding_window_mask(torch.arange(position, position + length, device=device),
                                   torch.arange(key_start, position + length, device=device), window)
        return WindowPlan(window, 0, 0, 0, (0, 0), with_slot_columns(mask, slots))
    span, blocks = 2 * window - 1, -(-length // window)
    first = position - window + 1  # the first position any query sees; block b's span starts at first + b window
    trim = max(first - key_start, 0)  # a longer cache than the window: keys no query sees
    key_start += trim
    starts = first + window * torch.arange(blocks, device=device)  # [blocks]
    span_positions = starts[:, None] + torch.arange(span, device=device)  # [blocks, span]
    block_queries = starts[:, None] + window - 1 + torch.arange(window, device=device)  # [blocks, window]
    real_key = (span_positions >= key_start) & (span_positions < position + length)  # not padding
    mask = sliding_window_mask(block_queries, span_positions, window) & real_key[:, None, :]  # [blocks, window, span]
    mask = with_slot_columns(mask, slots).expand(batch, -1, -1, -1).reshape(batch * blocks, 1, window, slots + span)
    key_padding = (key_start - first, blocks * window - length)  # to positions [first, first + (blocks + 1) window - 1)
    return WindowPlan(window, blocks, span, trim, key_padding, mask)


def sliding_window_attention(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v: torch.Tensor,
    persistent_k: torch.Tensor,
    persistent_v: torch.Tensor,
    plan: WindowPlan,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``attention_with_persistent`` under the sliding window, at a cost that grows with T x window, not T x L.

    q, q_rot [B, H, T, D]: queries at positions [P, P+T); k_rot, v [B, H_kv, L, D]: the keys at the L positions
    that end with the queries' (a cached prefix first); query i sees the keys at positions (p_i - window, p_i].
    ``plan``: ``window_plan`` of this shape (T, L, window, N_p, B), made once for many calls. Returns [B, H, T, D].

    Where the keys are more than two windows, the queries run in blocks of ``window``, all in one call with the blocks
    folded into the batch, each block against the 2 window - 1 keys its queries can see (the first block's span
    padded before the first key, the last block after the last query; the padding is masked): the masked kernel then
    scores 2 window - 1 keys a query instead of all L. The same softmax over the same visible keys and slots as the
    single call, which shorter inputs keep.
    """
    batch, heads, length, dim = q.shape
    kv_heads, window = k_rot.shape[1], plan.window
    query = torch.cat([q_rot, q], dim=-1)  # [B, H, T, 2D]
    if not plan.blocks:
        slot_k, slot_v = slot_keys_values(persistent_k, persistent_v, batch, k_rot.dtype)
        return attend_with_slots(query, [slot_k, F.pad(k_rot, (0, dim))], [slot_v, v], plan.mask, dropout_p)
    blocks, span = plan.blocks, plan.span
    slot_k, slot_v = slot_keys_values(persistent_k, persistent_v, batch * blocks, k_rot.dtype)
    if plan.trim:
        k_rot, v = k_rot[:, :, plan.trim:], v[:, :, plan.trim:]

    def spans(x: torch.Tensor, extra: int) -> torch.Tensor:  # [B, H_kv, L, D] -> [B blocks, H_kv, span, D + extra]
        windows = F.pad(x, (0, extra, *plan.key_padding)).unfold(2, span, window)  # [B, H_kv, blocks, D', span]
        return windows.permute(0, 2, 1, 4, 3).reshape(batch * blocks, kv_heads, span, dim + extra)

    after = blocks * window - length  # [B, H, T, 2D] -> [B blocks, H, window, 2D]
    query = (F.pad(query, (0, 0, 0, after)) if after else query).unflatten(2, (blocks, window))
    query = query.transpose(1, 2).reshape(batch * blocks, heads, window, 2 * dim)
    y = attend_with_slots(query, [slot_k, spans(k_rot, dim)], [slot_v, spans(v, 0)], plan.mask,
                          dropout_p)  # [B blocks, H, window, D]
    return y.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :length]
