"""LTC attention as pure tensor functions: modal basis, time constants and the factorised fast form; the
explicit reference it must equal is ``ltcx.ops.naive.ltc.ltc_attention_reference``.

Notation: B batch, H query heads, G key/value heads (H a multiple of G; query head h reads KV head
h // (H / G)), T time, D head_dim, M decay modes per KV head.

The score of query i and key j <= i is

    s_ij = q_i^T M_{i-j} k_j / sqrt(D),   M_Delta = I + sum_m (exp(-Delta / tau_m) - 1) u_m u_m^T,

with orthonormal modes u_m. The fast form never builds a T x T metric: it rotates q and k into an
orthogonal basis Q = [U, U_perp] whose first M columns are the modes and scales those M coordinates
around a fixed centre c,

    q''_i = Q^T q_i,  coordinate m times exp(-(i - c) / tau_m)
    k''_j = Q^T k_j,  coordinate m times exp(+(j - c) / tau_m)

so that q''_i . k''_j = q_i^T M_{i-j} k_j exactly, and ONE causal scaled_dot_product_attention does
the rest. Scaling separate coordinates (instead of the seed's q' = q + sum_m (e_m - 1)(q.u_m) u_m,
whose e^6-sized modal terms cancel against the ordinary part; tests/test_ltc.py shows it far worse
than plain attention in bf16) keeps every term of the dot product at its own magnitude, so bf16
rounding hurts no more than in plain attention. With c = (block_size - 1) / 2 and
tau >= tau_min = block_size / 12 the exponents stay within +-6.

Two equivalent ways to rotate: ``ltc_transform`` rotates q and k themselves (cheap for a few new
tokens, used while decoding); ``rotate_projection`` folds Q^T into the projection weights once per
call (cheap for long sequences, used for training and prefill), after which ``scale_modes`` scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ltcx.ops.attention import causal_gqa_attention
from ltcx.ops.precision import compute_dtype, without_autocast

# tau = tau_min / sigmoid(z) with z clamped to this range: above it sigmoid rounds to 1 in float32 (tau
# would equal tau_min), below it tau is so large (> 1e13 tau_min) that the mode is the identity anyway,
# and the clamp keeps tau finite so no inf/NaN reaches the exponents or the gradients.
LOGIT_RANGE = (-30.0, 15.0)


def centre(block_size: int) -> float:
    """The fixed centre of the exponents, (block_size - 1) / 2: keys cached at one call stay valid later."""
    return (block_size - 1) / 2


def modal_basis(modal_matrix: torch.Tensor) -> torch.Tensor:
    """Orthogonal basis per KV head whose first M columns are the decay modes.

    modal_matrix: [G, D, M], learned and unconstrained -> Q [G, D, D] (float32 or float64), with
    Q[..., :M] = U, the QR orthonormalisation of the modal matrix (u_m^T u_n = delta_mn), and
    Q[..., M:] an orthonormal completion derived from it (no parameters).

    The completion C is computed without gradient (from a complete QR of the detached matrix) and
    Q = QR([A, C]). The score depends on the completion only through Q_perp Q_perp^T = I - U U^T,
    which holds for any full-rank C, so the gradient with respect to A is exact.
    """
    _, head_dim, modes = modal_matrix.shape
    a = modal_matrix.to(compute_dtype(modal_matrix.dtype))
    with without_autocast(a.device):
        if modes < head_dim:
            with torch.no_grad():
                completion = torch.linalg.qr(a.detach(), mode="complete").Q[..., modes:]
            a = torch.cat([a, completion], dim=-1)
        return torch.linalg.qr(a).Q


def time_constants(logits: torch.Tensor, tau_min: float) -> torch.Tensor:
    """tau = tau_min / sigmoid(z) > tau_min, computed in float32 (or float64).

    logits z: [..., M] = offsets r + controller output delta(x_0) -> tau [..., M].
    """
    z = logits.to(compute_dtype(logits.dtype)).clamp(*LOGIT_RANGE)
    return tau_min / torch.sigmoid(z)


def rotate_projection(weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Fold the rotation into a projection: rows of head n become Q_g^T W_n (g = n's KV head).

    weight: [N * D, C] (a bias [N * D] works too) with N = G or a multiple; basis: [G, D, D].
    Returns the same shape in weight's dtype: x @ result^T = Q^T (W x) per head, exactly in exact
    arithmetic, and costs N D^2 C multiply-adds once instead of N D^2 per token.
    """
    groups, head_dim = basis.shape[0], basis.shape[-1]
    shape = weight.shape
    dtype = compute_dtype(weight.dtype)
    with without_autocast(weight.device):
        w = weight.to(dtype).reshape(groups, -1, head_dim, shape[-1] if weight.dim() == 2 else 1)
        rotated = basis.to(dtype).transpose(-1, -2)[:, None] @ w  # [G, N/G, D, C]
    return rotated.reshape(shape).to(weight.dtype)


def scale_modes(
    x: torch.Tensor,
    tau: torch.Tensor,
    start: int | torch.Tensor,
    centre: float,
    is_query: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scale the first M coordinates of already rotated queries or keys.

    x: [B, N, T, D] in the modal basis at absolute positions [start, start + T) (or ``start`` [B, T]: each row's
    own positions, a padded batch's), N = G or a multiple; tau: [B, G, M]. Queries get exp(-(i - c) / tau_m),
    keys exp(+(j - c) / tau_m). Done in float32 (float64 for float64 input) with autocast off; returns
    ``out_dtype`` (default x's dtype).
    """
    batch, heads, length, head_dim = x.shape
    groups, modes = tau.shape[1], tau.shape[2]
    dtype = compute_dtype(x.dtype)
    with without_autocast(x.device):
        rates = (-1.0 if is_query else 1.0) / tau.to(dtype)  # [B, G, M]
        if isinstance(start, torch.Tensor):  # per-row positions [B, T]
            offsets = start.to(dtype) - centre
            scales = torch.exp(offsets[:, None, :, None] * rates[:, :, None, :])  # [B, G, T, M]
        elif length == 1:  # a decode step: one offset, no position tensor (fewer small ops per step)
            scales = torch.exp(rates * (start - centre)).unsqueeze(2)  # [B, G, 1, M]
        else:
            offsets = torch.arange(start, start + length, device=x.device, dtype=dtype) - centre  # [T]
            scales = torch.exp(offsets[:, None] * rates[:, :, None, :])  # [B, G, T, M]
        if modes < head_dim:  # the other coordinates keep scale 1
            scales = F.pad(scales, (0, head_dim - modes), value=1.0)
        out = x.to(dtype).view(batch, groups, heads // groups, length, head_dim) * scales[:, :, None]
    return out.reshape(batch, heads, length, head_dim).to(out_dtype or x.dtype)


def scale_modes_step(
    q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor, position: int, centre: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale_modes`` of one new token's query and key at ``position`` (a decode step), in one pass.

    q: [B, H, 1, D], k: [B, G, 1, D] in the modal basis; tau: [B, G, M]. The query's scales exp(-(i - c) / tau)
    and the key's exp(+(i - c) / tau) share their exponent, so they cost one division, one product and two exps,
    with the same float operations as ``scale_modes`` (equal bit for bit). Returns (q, k) in their own dtypes.
    """
    batch, heads, _, head_dim = q.shape
    groups, modes = tau.shape[1], tau.shape[2]
    dtype = compute_dtype(q.dtype)
    with without_autocast(q.device):
        exponent = (1.0 / tau.to(dtype) * (position - centre)).unsqueeze(2)  # [B, G, 1, M]: (i - c) / tau
        key_scales, query_scales = torch.exp(exponent), torch.exp(-exponent)
        if modes < head_dim:  # the other coordinates keep scale 1
            key_scales = F.pad(key_scales, (0, head_dim - modes), value=1.0)
            query_scales = F.pad(query_scales, (0, head_dim - modes), value=1.0)
        q_scaled = q.to(dtype).view(batch, groups, heads // groups, head_dim) * query_scales
        k_scaled = k.to(dtype) * key_scales
    return q_scaled.view(batch, heads, 1, head_dim).to(q.dtype), k_scaled.to(k.dtype)


def ltc_transform(
    x: torch.Tensor,
    basis: torch.Tensor,
    tau: torch.Tensor,
    start: int,
    centre: float,
    is_query: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate queries or keys into the modal basis and scale the modal coordinates.

    x: [B, N, T, D] at absolute positions [start, start + T); N = G for keys, N = H for queries.
    basis: [B, G, D, D] from ``modal_basis``; tau: [B, G, M].
    Returns [B, N, T, D] in ``out_dtype`` (default x's dtype); the work is done in float32 (float64 for
    float64 input) with autocast off, then cast once.
    """
    batch, heads, length, head_dim = x.shape
    groups = basis.shape[1]
    dtype = compute_dtype(x.dtype)
    with without_autocast(x.device):
        rotated = x.to(dtype).view(batch, groups, heads // groups, length, head_dim) @ basis.to(dtype)[:, :, None]
        rotated = rotated.view(batch, heads, length, head_dim)
    return scale_modes(rotated, tau, start, centre, is_query, out_dtype or x.dtype)  # not rotated's float32


def ltc_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    basis: torch.Tensor,
    tau: torch.Tensor,
    centre: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal LTC attention of a whole sequence starting at position 0, factorised: one SDPA call.

    q: [B, H, T, D]; k, v: [B, G, T, D]; basis: [G, D, D] or [B, G, D, D]; tau: [B, G, M].
    Returns [B, H, T, D] in v's dtype: q and k may come in float32 and are cast to v's dtype only after
    the transform.
    """
    if basis.dim() == 3:
        basis = basis.expand(q.shape[0], -1, -1, -1)
    q2 = ltc_transform(q, basis, tau, 0, centre, is_query=True, out_dtype=v.dtype)
    k2 = ltc_transform(k, basis, tau, 0, centre, is_query=False, out_dtype=v.dtype)
    return causal_gqa_attention(q2, k2, v, dropout_p=dropout_p)


# ----------------------------------------------------------------------------------------------------
# Slow, obviously-correct forms (tests and documentation)


def decay_metric(modes: torch.Tensor, tau: torch.Tensor, delta: torch.Tensor | float) -> torch.Tensor:
    """M_Delta = I + sum_m (exp(-Delta / tau_m) - 1) u_m u_m^T.

    modes U: [G, D, M] orthonormal columns; tau: [B, G, M]; delta: a number or a tensor of key ages
    of any shape S -> [B, G, *S, D, D].
    """
    delta = torch.as_tensor(delta, dtype=tau.dtype, device=tau.device)
    extra = delta.dim()
    tau_b = tau.reshape(tau.shape[:2] + (1,) * extra + tau.shape[2:])  # [B, G, 1.., M]
    lam = torch.exp(-delta[..., None] / tau_b)  # [B, G, *S, M]
    u = modes.reshape(modes.shape[:1] + (1,) * extra + modes.shape[1:])  # [G, 1.., D, M]
    eye = torch.eye(modes.shape[1], dtype=modes.dtype, device=modes.device)
    return eye + torch.einsum("bg...m,g...dm,g...em->bg...de", lam - 1, u, u)
