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
so there is no closed form to take all chunks at once. The rest is batched over every chunk.
:func:`gated_delta_step` is one token (generation). Both run in float32 (float64 for float64 inputs), outside autocast.

Shapes: q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, g, beta ``[B, H, T]``, state ``[B, H, Dk, Dv]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ltcx.ops.precision import compute_dtype, without_autocast
from ltcx.ops.ssd import decays
from ltcx.ops.written_backward import wants_written_backward

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
        G = g.cumsum(-1)  # [B, H, N, L]
        D = decays(g)  # [B, H, N, L, L]: e^{G_i - G_j} for j <= i
        # I + A: a unit-triangular solve reads only the strictly lower triangle, where this equals A
        T = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * D
        decay = G.exp()  # [B, H, N, L]: e^{G_i}
        # -W, not W: U = U0 + (-W) S is then one baddbmm whose backward scales nothing
        rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * -decay).unsqueeze(-1) * k], dim=-1)
        solved = torch.linalg.solve_triangular(T, rhs, upper=False, unitriangular=True)
        U0, W_neg = solved.split([dv, dk], dim=-1)
        P = (q @ k.transpose(-1, -2)) * D  # [B, H, N, L, L]
        k_end = D[..., -1, :].unsqueeze(-1) * k  # e^{G_L - G_j} k_j: D's last row
        end_decay = decay[..., -1, None, None]  # [B, H, N, 1, 1]: e^{G_L}

        S = q.new_zeros(batch, heads, dk, dv) if state is None else state.to(dtype)
        S0, U, S = _through_chunks(U0, W_neg, k_end, end_decay, S)
        o = scale * ((decay.unsqueeze(-1) * q) @ S0 + P @ U)
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


class _ChunkLoop(torch.autograd.Function):
    """:func:`_chunk_loop` with its backward written out. Substituting U, S_L = M S_0 + k_end^T U0 with the
    ``[Dk, Dk]`` map M = e^{G_L} I + k_end^T W_neg, so the gradient reaching a chunk's S_0 is

        g_S0 <- M^T g_SL + W_neg^T g_U + g_S0,

    one baddbmm per chunk in the reverse loop (M^T and the last two terms are taken for every chunk at once before
    it); the gradients of U0, W_neg, k_end and e^{G_L} are then products over every chunk at once, where autograd's
    graph ran some ten ops per chunk. Held to autograd of :func:`_chunk_loop` in float64."""

    @staticmethod
    def forward(ctx, U0, W_neg, k_end, end_decay, S):
        S0, U, S_last = _chunk_loop(U0, W_neg, k_end, end_decay, S)
        ctx.save_for_backward(W_neg, k_end, end_decay, S0, U)
        ctx.set_materialize_grads(False)  # a gradient not given (the final state unused) costs no zeros
        return S0, U, S_last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_S0, g_U, g_last):
        W_neg, k_end, end_decay, S0, U = ctx.saved_tensors
        g_S0 = torch.zeros_like(S0) if g_S0 is None else g_S0
        g_U = torch.zeros_like(U) if g_U is None else g_U
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
        g_end_decay = (g_after * S0).sum((-2, -1), keepdim=True)
        g_S = g_S.view(g_after.shape[:2] + g_after.shape[3:]) if ctx.needs_input_grad[4] else None
        return g_U0, g_W_neg, g_k_end, g_end_decay, g_S


def _through_chunks(U0, W_neg, k_end, end_decay, S) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_chunk_loop`: through :class:`_ChunkLoop` where ``wants_written_backward``."""
    inputs = (U0, W_neg, k_end, end_decay, S)
    if wants_written_backward(*inputs):
        return _ChunkLoop.apply(*inputs)
    return _chunk_loop(*inputs)


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
