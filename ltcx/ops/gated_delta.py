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
        def split(t: Tensor) -> Tensor:  # [B, H, T, ...] -> [B, H, N, L, ...], zero-padded
            t = t.to(dtype)
            t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
            return t.unflatten(2, (chunks, size))

        q, k, v, g, beta = map(split, (q, k, v, g, beta))
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
        end_decay = decay[..., -1, None, None]  # [B, H, N, 1, 1]

        # the loop takes each chunk's pieces from one unbind (backward: one stack), not by indexing (backward: a
        # zero-filled tensor per index), with batch and heads as one batch dim for baddbmm
        pieces = (U0, W_neg, k_end.transpose(-1, -2), end_decay)
        S = q.new_zeros(batch * heads, dk, dv) if state is None else state.to(dtype).flatten(0, 1)
        starts, writes = [], []
        for U0_n, W_neg_n, k_end_n, end_decay_n in zip(*(t.flatten(0, 1).unbind(1) for t in pieces)):
            U = torch.baddbmm(U0_n, W_neg_n, S)  # U0 - W S
            starts.append(S)
            writes.append(U)
            S = torch.baddbmm(end_decay_n * S, k_end_n, U)
        S0 = torch.stack(starts, dim=1).unflatten(0, (batch, heads))  # [B, H, N, Dk, Dv]
        U = torch.stack(writes, dim=1).unflatten(0, (batch, heads))
        S = S.unflatten(0, (batch, heads))
        o = scale * ((decay.unsqueeze(-1) * q) @ S0 + P @ U)
    return o.flatten(2, 3)[:, :, :length].to(out_dtype), S


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
