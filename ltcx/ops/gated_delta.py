"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464), Gated DeltaNet's token mixer.

Per head, with the state S ``[Dk, Dv]`` (flash-linear-attention's layout), a decay a_t = exp(g_t) (g_t <= 0) and a
write strength b_t in (0, 1):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = scale S_t^T q_t

that is, decay, then move the value read at k_t towards v_t by b_t (the delta rule). b_t = 0 and g_t = 0 leave the
state as it was (a padded position).

:func:`gated_delta_chunked` is the training form. In a chunk of L steps with cumulative log-decays G_i (from the
chunk's start) and the state S_0 before it, the writes u_j = b_j (v_j - S_{j-1}'^T k_j) (S' the decayed state) solve
the unit lower-triangular system (the WY representation; "UT transform")

    (I + A) U = diag(b) V - diag(b e^G) K S_0,    A_jm = b_j e^{G_j - G_m} k_j . k_m  (m < j)

so U = U0 - W S_0 with U0 = T^-1 diag(b) V and W = T^-1 diag(b e^G) K computed for every chunk at once. Then

    O = scale (diag(e^G) Q S_0 + (Q K^T o D) U),    S_L = e^{G_L} S_0 + (diag(e^{G_L - G}) K)^T U

(D_ij = e^{G_i - G_j} for j <= i, else 0). Only the state's passage from chunk to chunk, U = U0 - W S_0 and S_L, runs
in a loop over the chunks: each chunk's S_0 is the last one's S_L through a [Dk, Dk] map that depends on the data,
so there is no closed form to take all chunks at once. The rest is batched over every chunk. Where a gradient is
wanted (outside torch.compile) it runs as ``_Rule``, its backward written out.
:func:`gated_delta_step` is one token (generation). Both run in float32 (float64 for float64 inputs), outside autocast.

Shapes: q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, g, beta ``[B, H, T]``, state ``[B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ltcx.ops.precision import compute_dtype, without_autocast
from ltcx.ops.ssd import decays, decays_backward
from ltcx.ops.written_backward import cumsum_backward, wants_written_backward

__all__ = ["gated_delta_chunked", "gated_delta_step"]


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                        chunk_size: int = 64, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule over T steps in chunks of ``chunk_size`` (the last one padded with steps that change
    nothing) -> (o ``[B, H, T, Dv]`` in v's dtype, final state ``[B, H, Dk, Dv]`` float32 or float64)."""
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)
    size = min(chunk_size, length)
    chunks = -(-length // size)
    pad = chunks * size - length
    with without_autocast(q.device):
        def split(t: Tensor) -> Tensor:  # [B, H, T, ...] -> [B, H, N, L, ...], zero-padded (no pad: no copy)
            t = t.to(dtype)
            if pad:
                t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
            return t.unflatten(2, (chunks, size))

        q, k, v, g, beta = map(split, (q, k, v, g, beta))
        # q and k come with their heads transposed: one copy each (none if padded), not one by each product
        q, k = q.contiguous(), k.contiguous()
        S = q.new_zeros(batch, heads, dk, dv) if state is None else state.to(dtype)
        inputs = (q, k, v, g, beta, S, scale)
        o, S = _Rule.apply(*inputs) if wants_written_backward(*inputs) else _rule(*inputs)
    return o.flatten(2, 3)[:, :, :length].to(out_dtype), S


def _chunk_loop(U0: Tensor, W_neg: Tensor, k_end: Tensor, end_decay: Tensor,
                S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The state's passage from chunk to chunk: U = U0 - W S_0 and S_L = e^{G_L} S_0 + k_end^T U, chunk after chunk.
    U0 ``[B, H, N, L, Dv]``, W_neg = -W ``[B, H, N, L, Dk]``, k_end = diag(e^{G_L - G}) K ``[B, H, N, L, Dk]``,
    end_decay = e^{G_L} ``[B, H, N, 1, 1]``, S the state before the first chunk ``[B, H, Dk, Dv]`` -> (S_0 of every
    chunk ``[B, H, N, Dk, Dv]``, U ``[B, H, N, L, Dv]``, the state after the last chunk ``[B, H, Dk, Dv]``)."""
    batch, heads = S.shape[:2]
    # each chunk's pieces from one unbind (backward: one stack), not by indexing (backward: a zero-filled tensor per
    # index), with batch and heads as one batch dim for baddbmm
    pieces = (U0, W_neg, k_end.transpose(-1, -2), end_decay)
    S = S.flatten(0, 1)
    starts, writes = [], []
    for U0_n, W_neg_n, k_end_n, end_decay_n in zip(*(t.flatten(0, 1).unbind(1) for t in pieces)):
        U = torch.baddbmm(U0_n, W_neg_n, S)  # U0 - W S
        starts.append(S)
        writes.append(U)
        S = torch.baddbmm(end_decay_n * S, k_end_n, U)
    S0 = torch.stack(starts, dim=1).unflatten(0, (batch, heads))
    U = torch.stack(writes, dim=1).unflatten(0, (batch, heads))
    return S0, U, S.unflatten(0, (batch, heads))


def _rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, scale: float,
          keep: dict | None = None) -> tuple[Tensor, Tensor]:
    """The chunked form on chunks: q, k ``[B, H, N, L, Dk]``, v ``[B, H, N, L, Dv]``, g, beta ``[B, H, N, L]``, the
    state before the first chunk ``[B, H, Dk, Dv]`` -> (o ``[B, H, N, L, Dv]``, the state after the last chunk).
    ``keep``: a dict that receives what :class:`_Rule`'s backward reads."""
    dv, dk = v.shape[-1], k.shape[-1]
    G = g.cumsum(-1)  # [B, H, N, L]
    D = decays(g)  # [B, H, N, L, L]: e^{G_i - G_j} for j <= i
    # I + A: a unit-triangular solve reads only the strictly lower triangle, where this equals A
    KK = k @ k.transpose(-1, -2)
    T = beta.unsqueeze(-1) * KK * D
    decay = G.exp()  # [B, H, N, L]: e^{G_i}
    # -W, not W: U = U0 + (-W) S is then one baddbmm whose backward scales nothing
    neg_beta_decay = beta * -decay
    rhs = torch.cat([beta.unsqueeze(-1) * v, neg_beta_decay.unsqueeze(-1) * k], dim=-1)
    solved = torch.linalg.solve_triangular(T, rhs, upper=False, unitriangular=True)
    U0, W_neg = solved.split([dv, dk], dim=-1)
    P = (q @ k.transpose(-1, -2)) * D  # [B, H, N, L, L]
    k_end = D[..., -1, :].unsqueeze(-1) * k  # e^{G_L - G_j} k_j: D's last row
    end_decay = decay[..., -1, None, None]  # [B, H, N, 1, 1]: e^{G_L}
    S0, U, S = _chunk_loop(U0, W_neg, k_end, end_decay, S)
    read = decay.unsqueeze(-1) * q
    if keep is not None:
        keep.update(D=D, KK=KK, T=T, decay=decay, neg_beta_decay=neg_beta_decay, solved=solved, P=P, k_end=k_end,
                    S0=S0, U=U, read=read)
    return scale * (read @ S0 + P @ U), S


def _chunk_loop_backward(W_neg, k_end, end_decay, S0, U, g_S0, g_U, g_last) -> tuple[Tensor, ...]:
    """The gradients of :func:`_chunk_loop`'s inputs (U0, W_neg, k_end, end_decay, S) from those of its outputs
    (``g_last`` None: the final state unused). Substituting U, S_L = M S_0 + k_end^T U0 with the ``[Dk, Dk]`` map
    M = e^{G_L} I + k_end^T W_neg, so the gradient reaching a chunk's S_0 is

        g_S0 <- M^T g_SL + W_neg^T g_U + g_S0,

    one baddbmm per chunk in the reverse loop (M^T and the last two terms taken for every chunk at once before it);
    the other gradients are then products over every chunk at once."""
    W_t = W_neg.transpose(-1, -2)
    M_t = W_t @ k_end  # [B, H, N, Dk, Dk]
    M_t.diagonal(dim1=-2, dim2=-1).add_(end_decay.squeeze(-1))
    own = torch.baddbmm(g_S0.flatten(0, 2), W_t.flatten(0, 2), g_U.flatten(0, 2)).view(S0.shape)
    # the reverse loop: g_S after each chunk, from the last (the final state's gradient) backwards
    g_S, after = None if g_last is None else g_last.flatten(0, 1), []
    for M_t_n, own_n in zip(M_t.flatten(0, 1).unbind(1)[::-1], own.flatten(0, 1).unbind(1)[::-1]):
        after.append(g_S)
        g_S = own_n if g_S is None else torch.baddbmm(own_n, M_t_n, g_S)
    after[0] = torch.zeros_like(g_S) if after[0] is None else after[0]
    g_after = torch.stack(after[::-1], dim=1).view(S0.shape)  # [B, H, N, Dk, Dv]
    # U = U0 + W_neg S_0 and S_L = end_decay S_0 + k_end^T U
    g_U0 = torch.baddbmm(g_U.flatten(0, 2), k_end.flatten(0, 2), g_after.flatten(0, 2)).view(U.shape)
    g_W_neg = g_U0 @ S0.transpose(-1, -2)
    g_k_end = U @ g_after.transpose(-1, -2)
    g_end_decay = (g_after * S0).sum((-2, -1))  # [B, H, N]
    return g_U0, g_W_neg, g_k_end, g_end_decay, g_S.view(g_after.shape[:2] + g_after.shape[3:])


class _Rule(torch.autograd.Function):
    """:func:`_rule` with its backward written out (the chain rule through every line of its forward): the state's
    reverse passage one baddbmm per chunk (:func:`_chunk_loop_backward`), the triangular solve's gradient one
    transposed solve, each decay's gradient times the decay as its product's gradient times the product (g_D D =
    g_P P), and :func:`decays`' gradient from its entries' logarithms in one pass, where autograd's graph ran some
    ten ops per chunk in the loop and each mask's, exp's and broadcast's passes apart. Held to autograd of
    :func:`_rule` in float64."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S, scale):
        kept = {}
        o, S_last = _rule(q, k, v, g, beta, S, scale, keep=kept)
        ctx.save_for_backward(q, k, v, beta, *(kept[name] for name in _KEPT))
        ctx.scale = scale
        ctx.set_materialize_grads(False)  # an unused final state costs no zeros
        return o, S_last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_o, g_last):
        q, k, v, beta, *rest = ctx.saved_tensors
        D, KK, T, decay, neg_beta_decay, solved, P, k_end, S0, U, read = rest
        dv, dk = v.shape[-1], k.shape[-1]
        # o = scale (read S0 + P U), read = e^G q (g_o contiguous: each product below would copy a strided one)
        g_o = torch.zeros_like(U) if g_o is None else g_o.contiguous() * ctx.scale
        g_read = g_o @ S0.transpose(-1, -2)
        g_P = g_o @ U.transpose(-1, -2)
        g_U0, g_W_neg, g_k_end, g_end_decay, g_S = _chunk_loop_backward(
            solved[..., dv:], k_end, decay[..., -1, None, None], S0, U, read.transpose(-1, -2) @ g_o,
            P.transpose(-1, -2) @ g_o, g_last)
        g_q = g_read * decay.unsqueeze(-1)
        g_decay = (g_read * q).sum(-1)
        g_decay[..., -1].add_(g_end_decay)
        # k_end = D[L] k, P = (q k^T) D: D's gradient times D is P's times P
        D_last = D[..., -1, :]
        g_k = g_k_end * D_last.unsqueeze(-1)
        g_D_last = (g_k_end * k).sum(-1)
        g_qk = g_P * D
        g_log_D = g_P.mul_(P)
        g_log_D[..., -1, :].addcmul_(g_D_last, D_last)
        g_q = torch.baddbmm(g_q.flatten(0, 2), g_qk.flatten(0, 2), k.flatten(0, 2)).view(q.shape)
        g_k = torch.baddbmm(g_k.flatten(0, 2), g_qk.flatten(0, 2).transpose(-1, -2), q.flatten(0, 2))
        # solved = T^-1 rhs, T unit lower triangular: rhs's gradient T^-T g_solved, T's -(g_rhs solved^T) strictly
        # below the diagonal (h below: its negation)
        g_rhs = torch.linalg.solve_triangular(T.transpose(-1, -2), torch.cat([g_U0, g_W_neg], dim=-1), upper=True,
                                              unitriangular=True)
        h = (g_rhs @ solved.transpose(-1, -2)).tril_(-1)
        # T = beta (k k^T) D
        h_D = h * D
        neg_g_beta = (h_D * KK).sum(-1)  # beta's gradient through T, negated
        g_log_D.addcmul_(h, T, value=-1)
        h_KK = h_D * beta.unsqueeze(-1)  # -(k k^T)'s gradient
        g_k = torch.baddbmm(g_k, (h_KK + h_KK.transpose(-1, -2)).flatten(0, 2), k.flatten(0, 2), alpha=-1)
        g_k = g_k.view(k.shape)
        # rhs = [beta v, (beta * -decay) k]
        g_rv, g_rk = g_rhs.split([dv, dk], dim=-1)
        g_v = g_rv * beta.unsqueeze(-1)
        g_k.addcmul_(g_rk, neg_beta_decay.unsqueeze(-1))
        g_neg_beta_decay = (g_rk * k).sum(-1)
        g_beta = torch.addcmul((g_rv * v).sum(-1) - neg_g_beta, g_neg_beta_decay, decay, value=-1)
        g_decay.addcmul_(g_neg_beta_decay, beta, value=-1)
        # decay = e^G, G = cumsum(g), and D = decays(g)
        g_G = g_decay.mul_(decay)
        g_g = cumsum_backward(g_G)
        g_g[..., 1:].add_(decays_backward(g_log_D))
        return g_q, g_k, g_v, g_g, g_beta, g_S if ctx.needs_input_grad[5] else None, None


_KEPT = ("D", "KK", "T", "decay", "neg_beta_decay", "solved", "P", "k_end", "S0", "U", "read")


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
                     scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One step: q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g, beta ``[B, H]`` -> (o ``[B, H, Dv]`` in v's dtype, new
    state)."""
    dk = k.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)
    with without_autocast(q.device):
        q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
        S = q.new_zeros(*k.shape, v.shape[-1]) if state is None else state.to(dtype)
        S = g.exp()[..., None, None] * S
        u = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ S).squeeze(-2))  # [B, H, Dv]
        S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
        o = scale * (q.unsqueeze(-2) @ S).squeeze(-2)
    return o.to(out_dtype), S
