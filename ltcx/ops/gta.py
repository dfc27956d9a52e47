"""Grouped-head latent attention (GTA, Sun et al. 2025, arXiv 2506.17286) as pure tensor functions.

Notation: B batch, G query heads (one attention map per group of output heads), n_k key heads, n_c
latent value heads, T new positions after P cached ones, d_k key width, d_l latent width, W = C / G the
output width of one group (its S = H / G output heads side by side), e = W / d_l the expand factor.

For group g, with key head kappa(g) = g // (G / n_k) and latent head nu(g) = g // (G / n_c):

    o_g = softmax(q_g k_kappa^T / sqrt(d_k) + causal) c_nu            [T, d_l]
    u_g = o_g D_g,   D_g = J_e + B_g                                   [T, W]

J_e is e identities side by side ([I I ... I], d_l x W) and B_g a learned offset. The decoder is linear
and acts after attention: sum_j a_ij (c_j D_g) = (sum_j a_ij c_j) D_g, so the latent c is attended once
per group and cached as it is, never decoded per key token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ltcx.ops.attention import causal_gqa_attention


def latent_attention(q: torch.Tensor, k: torch.Tensor, latent: torch.Tensor, dropout_p: float = 0.0,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each group's query over shared keys and latent values, scaled by 1 / sqrt(d_k).

    q: [B, G, T, d_k] the queries of the last T positions; k: [B, n_k, P + T, d_k];
    latent: [B, n_c, P + T, d_l]. G must be a multiple of n_k and of n_c. key_mask [B, P + T] or None: as
    ``causal_gqa_attention``'s (masked keys left out). Returns o [B, G, T, d_l].
    One new token (a decode step) takes ``latent_attention_step``; every other call one fused SDPA call.
    """
    if q.shape[2] == 1 and dropout_p == 0.0 and key_mask is None:
        return latent_attention_step(q, k, latent)
    n_key, n_latent = k.shape[1], latent.shape[1]
    if n_key != n_latent:  # SDPA's GQA wants one head count for keys and values: repeat both to their lcm
        heads = math.lcm(n_key, n_latent)
        k = k.repeat_interleave(heads // n_key, dim=1)
        latent = latent.repeat_interleave(heads // n_latent, dim=1)
    key_dim, latent_dim = q.shape[-1], latent.shape[-1]
    if key_dim != latent_dim:
        # The fused (flash) kernels want one width for q, k and v; otherwise the math path materialises
        # [B, G, T, P + T] weights (and is slower for a decode step on CPU). Zero columns add
        # nothing to q.k, and padded value columns are cut off.
        width = max(key_dim, latent_dim)
        q, k = F.pad(q, (0, width - key_dim)), F.pad(k, (0, width - key_dim))
        latent = F.pad(latent, (0, width - latent_dim))
    o = causal_gqa_attention(q, k, latent, dropout_p=dropout_p, scale=key_dim**-0.5, key_mask=key_mask)
    return o[..., :latent_dim]


def expand_identity(groups: int, latent_dim: int, width: int, **tensor_options) -> torch.Tensor:
    """J_e for every group: [G, d_l, W], e = W / d_l identities side by side."""
    eye = torch.eye(latent_dim, **tensor_options)
    return eye.repeat(1, width // latent_dim).expand(groups, -1, -1).contiguous()


def decode_latent(o: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """o [B, G, T, d_l] attended latents, decoder D [G, d_l, W] -> u [B, T, G * W], group-major columns:
    einsum('bgtv,gvw->btgw'), as one bmm over the G groups with B * T rows each (a matmul broadcast over
    [B, G] would first copy D B times)."""
    batch, groups, length, latent_dim = o.shape
    u = torch.bmm(o.transpose(0, 1).reshape(groups, batch * length, latent_dim), decoder)  # [G, B T, W]
    return u.view(groups, batch, length, -1).permute(1, 2, 0, 3).reshape(batch, length, -1)


def latent_attention_step(q: torch.Tensor, k: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """Attention of one new token's G queries over every key (no mask): q [B, G, 1, d_k], k [B, n_k, P, d_k],
    latent [B, n_c, P, d_l] -> o [B, G, 1, d_l].

    The groups sharing a key head are rows of one product with it (groups are contiguous in g, so
    [B, G, 1, P] views as [B, n_k, G / n_k, P] and as [B, n_c, G / n_c, P]): each cached key and latent is read
    once per step, not repeated per group nor padded to one width as the SDPA path needs.
    """
    batch, groups, _, key_dim = q.shape
    n_key, n_latent, latent_dim = k.shape[1], latent.shape[1], latent.shape[-1]
    rows = q.reshape(batch * n_key, groups // n_key, key_dim)  # the groups reading key head kappa, as rows
    scores = torch.bmm(rows, k.reshape(batch * n_key, -1, key_dim).transpose(1, 2)).mul_(key_dim**-0.5)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # bf16 scores: softmax in float32
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(latent.dtype)  # [B n_k, G / n_k, P]
    latent_rows = latent.reshape(batch * n_latent, -1, latent_dim)
    o = torch.bmm(weights.view(batch * n_latent, groups // n_latent, -1), latent_rows)  # [B n_c, G / n_c, d_l]
    return o.view(batch, groups, 1, latent_dim)
