"""Slow references for ``ltcx/ops/titans.py`` (spec section A.2), sharing no formula with the fast code: the
inner gradient comes from ``torch.autograd.grad(create_graph=True)`` of the loss ||M(k; W^s) - v||^2, the
weights are explicit per token, and the chunk logic is the literal "refresh the gradient point every b
absolute positions". ``neural_memory`` and ``neural_memory_recurrent`` must equal ``reference_memory`` in
float64, outer gradients included."""

from __future__ import annotations

import math

import torch

KAPPA_EPS = 1e-6  # the epsilon in κ = ‖h‖² + ‖k‖²‖δ1‖² / (‖δ2‖² + ε), spec §A.2


def _gelu(x):
    """Exact GELU x Φ(x), written with erf; elementwise, any shape."""
    return 0.5 * x * (1.0 + torch.special.erf(x / math.sqrt(2.0)))


def _read(w1, w2, x):
    """M(x; W1, W2) = x + W2 GELU(W1 x) for x [..., n, dk], W1 [..., dm, dk], W2 [..., dk, dm].

    Returns (M(x), hidden GELU(W1 x) [..., n, dm])."""
    hidden = _gelu(torch.einsum("...mk,...nk->...nm", w1, x))
    return x + torch.einsum("...km,...nm->...nk", w2, hidden), hidden


def _autograd_step(w1, w2, k, v):
    """The token's inner gradient ∇_{W1, W2} ‖M(k; W) − v‖² by autograd (graph kept for the outer loop) and its
    curvature κ from those gradients: ‖∇W1‖² = ‖k‖²‖δ1‖², ‖h‖² from the forward, ‖δ2‖² = ‖2(M(k) − v)‖².

    w1, w2 [B, H, ...] the gradient point; k, v [B, H, 1, dk]. Returns (u1, u2, κ [B, H])."""
    if not w1.requires_grad:  # a constant gradient point (no outer gradient wanted): make it differentiable
        w1, w2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    out, hidden = _read(w1, w2, k)
    u1, u2 = torch.autograd.grad((out - v).pow(2).sum(), (w1, w2), create_graph=True)
    delta2_sq = (2.0 * (out - v)).pow(2).sum((-2, -1))
    kappa = hidden.pow(2).sum((-2, -1)) + u1.pow(2).sum((-2, -1)) / (delta2_sq + KAPPA_EPS)
    return u1, u2, kappa


def reference_memory(q, k, v, log_retain, log_momentum, step, w1_init, w2_init, chunk_size, normalize_step):
    """The token recurrence of spec §A.2, literally, from the initial state at position 0.

    for each token t: u_t = ∇ℓ(W^s; k_t, v_t); θ_t = step_t / κ_t (if normalize_step);
    S = η_t S − θ_t u_t; W = (1 − α_t) W + S; y_t = M(q_t; W); every chunk_size tokens W^s = W.
    q, k, v [B, H, T, dk]; log_retain = log(1 − α), log_momentum = log η, step θ (before κ) [B, H, T];
    w1_init [H, dm, dk], w2_init [H, dk, dm]; chunk_size b or None. Checks ``neural_memory`` and
    ``neural_memory_recurrent``.
    Returns (y [B, H, T, dk], (W1^s, W2^s, W1, W2, S1, S2))."""
    batch, _, length, _ = q.shape
    w1 = w1_init.expand(batch, *w1_init.shape)
    w2 = w2_init.expand(batch, *w2_init.shape)
    w1_start, w2_start = w1, w2
    s1, s2 = torch.zeros_like(w1), torch.zeros_like(w2)
    ys = []
    for t in range(length):
        u1, u2, kappa = _autograd_step(w1_start, w2_start, k[:, :, t : t + 1], v[:, :, t : t + 1])
        theta = step[:, :, t] / kappa if normalize_step else step[:, :, t]
        eta, retain = log_momentum[:, :, t].exp(), log_retain[:, :, t].exp()
        s1 = eta[..., None, None] * s1 - theta[..., None, None] * u1
        s2 = eta[..., None, None] * s2 - theta[..., None, None] * u2
        w1 = retain[..., None, None] * w1 + s1
        w2 = retain[..., None, None] * w2 + s2
        ys.append(_read(w1, w2, q[:, :, t : t + 1])[0])
        if chunk_size is not None and (t + 1) % chunk_size == 0:
            w1_start, w2_start = w1, w2
    return torch.cat(ys, dim=2), (w1_start, w2_start, w1, w2, s1, s2)


def paper_recurrence(q, k, v, log_retain, log_momentum, step, w1_init, w2_init, normalize_step):
    """Paper eq. 13–14 with no chunk logic at all: S_t = η_t S_{t−1} − θ_t ∇ℓ(M_{t−1}; x_t),
    M_t = (1 − α_t) M_{t−1} + S_t, y_t = M_t(q_t). Shapes as ``reference_memory`` (it is b = 1 there).
    Returns (y [B, H, T, dk], (W1, W2, S1, S2))."""
    batch = q.shape[0]
    w1 = w1_init.expand(batch, *w1_init.shape)
    w2 = w2_init.expand(batch, *w2_init.shape)
    s1, s2 = torch.zeros_like(w1), torch.zeros_like(w2)
    ys = []
    for t in range(q.shape[2]):
        u1, u2, kappa = _autograd_step(w1, w2, k[:, :, t : t + 1], v[:, :, t : t + 1])
        theta = (step[:, :, t] / kappa if normalize_step else step[:, :, t])[..., None, None]
        eta, retain = log_momentum[:, :, t].exp()[..., None, None], log_retain[:, :, t].exp()[..., None, None]
        s1, s2 = eta * s1 - theta * u1, eta * s2 - theta * u2
        w1, w2 = retain * w1 + s1, retain * w2 + s2
        ys.append(_read(w1, w2, q[:, :, t : t + 1])[0])
    return torch.cat(ys, dim=2), (w1, w2, s1, s2)


def gradients_at_init(q, k, v, log_retain, log_momentum, step, w1_init, w2_init, normalize_step):
    """"Every gradient at M_0" (b = ∞): all T inner gradients and κ in one batched autograd call at M_0 (one
    weight copy per token), then the linear momentum/decay recurrence. Shapes as ``reference_memory`` (it is
    chunk_size None there). Returns (y [B, H, T, dk], (W1, W2, S1, S2))."""
    batch, heads, length, _ = q.shape
    w1_tok = w1_init[None, :, None].expand(batch, heads, length, *w1_init.shape[1:]).clone().requires_grad_()
    w2_tok = w2_init[None, :, None].expand(batch, heads, length, *w2_init.shape[1:]).clone().requires_grad_()
    out, hidden = _read(w1_tok, w2_tok, k.unsqueeze(-2))  # [B, H, T, 1, dk]
    u1, u2 = torch.autograd.grad((out - v.unsqueeze(-2)).pow(2).sum(), (w1_tok, w2_tok))
    kappa = hidden.pow(2).sum((-2, -1)) + u1.pow(2).sum((-2, -1)) / (
        (2.0 * (out - v.unsqueeze(-2))).pow(2).sum((-2, -1)) + KAPPA_EPS)
    theta = (step / kappa if normalize_step else step)[..., None, None]
    w1, w2 = w1_init.expand(batch, *w1_init.shape), w2_init.expand(batch, *w2_init.shape)
    s1, s2 = torch.zeros_like(w1), torch.zeros_like(w2)
    ys = []
    for t in range(length):
        eta, retain = log_momentum[:, :, t].exp()[..., None, None], log_retain[:, :, t].exp()[..., None, None]
        s1, s2 = eta * s1 - theta[:, :, t] * u1[:, :, t], eta * s2 - theta[:, :, t] * u2[:, :, t]
        w1, w2 = retain * w1 + s1, retain * w2 + s2
        ys.append(_read(w1, w2, q[:, :, t : t + 1])[0])
    return torch.cat(ys, dim=2), (w1, w2, s1, s2)
