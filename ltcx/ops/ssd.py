"""Mamba-2's state space duality layer (SSD; Dao & Gu 2024, arXiv 2405.21060): a selective SSM whose state matrix is
a scalar times the identity per head.

Per head, with the state h ``[P, N]`` (mamba_ssm's layout), a log-decay g_t = dt_t A (A < 0, dt_t > 0) and B_t, C_t
``[N]`` shared by the heads (one group):

    h_t = e^{g_t} h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t

dt_t = 0 leaves the state as it was (a padded position).

:func:`ssd_chunked` is the training form, the paper's chunked dual form: within a chunk of L steps with cumulative
log-decays G (from the chunk's start) and the state S_0 before it,

    Y = (C B^T o D) diag(dt) X + diag(e^G) C S_0^T,    D_ij = e^{G_i - G_j} for j <= i, else 0

the chunks' own state contributions (diag(dt e^{G_L - G}) X)^T B are summed into each chunk's starting state by one
product with the [N + 1, N + 1] matrix of decays between chunk boundaries (scalar decays commute): no loop over
tokens or chunks. :func:`ssd_step` is one token (generation). Both run in float32 (float64 for float64 inputs),
outside autocast.

Shapes: x ``[B, H, T, P]``, dt ``[B, H, T]``, A ``[H]``, B, C ``[B, T, N]``, state ``[B, H, P, N]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ltcx.ops.precision import compute_dtype, without_autocast

__all__ = ["decays", "ssd_chunked", "ssd_step"]


def decays(g: Tensor) -> Tensor:
    """exp(g_{j+1} + ... + g_i) for j <= i, else 0: per-step log-decays g [..., L] -> [..., L, L]. Each entry is
    summed from its own steps, not taken as a difference of running sums, which would lose float32 digits once the
    sums grow large (mamba_ssm's segsum). An entry above the diagonal sums no steps (0, so exp cannot overflow) and
    is zeroed after exp: no masks to build."""
    size = g.shape[-1]
    steps = g.unsqueeze(-1).expand(*g.shape, size).tril(-1)  # [i, j]: g_i where i > j, else 0
    return steps.cumsum(-2).exp().tril()


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor | None = None,
                chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The SSD recurrence over T steps in chunks of ``chunk_size`` (the last one padded with steps that change
    nothing) -> (y ``[B, H, T, P]`` in x's dtype, final state ``[B, H, P, N]`` float32 or float64)."""
    batch, heads, length, width = x.shape
    out_dtype, dtype = x.dtype, compute_dtype(x.dtype)
    size = min(chunk_size, length)
    chunks = -(-length // size)
    pad = chunks * size - length
    with without_autocast(x.device):
        x = F.pad(x.to(dtype), (0, 0, 0, pad)).unflatten(2, (chunks, size))  # [B, H, N, L, P]
        dt = F.pad(dt.to(dtype), (0, pad)).unflatten(2, (chunks, size))  # [B, H, N, L]
        B = F.pad(B.to(dtype), (0, 0, 0, pad)).unflatten(1, (chunks, size)).unsqueeze(1)  # [B, 1, N, L, Ns]
        C = F.pad(C.to(dtype), (0, 0, 0, pad)).unflatten(1, (chunks, size)).unsqueeze(1)
        g = dt * A.to(dtype)[:, None, None]  # [B, H, N, L]
        G = g.cumsum(-1)
        xdt = x * dt.unsqueeze(-1)
        # within each chunk, from the chunk's own inputs (C B^T once for all heads)
        D = decays(g)  # [B, H, N, L, L]; its last row: e^{G_L - G_j}
        y = ((C @ B.transpose(-1, -2)) * D) @ xdt
        # each chunk's contribution to the state at its end, then every chunk boundary's state at once
        contribution = (xdt * D[..., -1, :].unsqueeze(-1)).transpose(-1, -2) @ B  # [B, H, N, P, Ns]
        first = x.new_zeros(batch, heads, 1, *contribution.shape[-2:]) if state is None else \
            state.to(dtype).unsqueeze(2)
        # the state at each chunk boundary: the state given and every chunk's contribution, decayed by the chunks since
        states = decays(F.pad(G[..., -1], (1, 0))) @ torch.cat([first, contribution], dim=2).flatten(-2)
        states = states.unflatten(-1, contribution.shape[-2:])
        y = y + G.exp().unsqueeze(-1) * (C @ states[:, :, :-1].transpose(-1, -2))
    return y.flatten(2, 3)[:, :, :length].to(out_dtype), states[:, :, -1]


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One step: x ``[B, H, P]``, dt ``[B, H]``, A ``[H]``, B, C ``[B, N]`` -> (y ``[B, H, P]`` in x's dtype, new
    state)."""
    out_dtype, dtype = x.dtype, compute_dtype(x.dtype)
    with without_autocast(x.device):
        x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
        h = x.new_zeros(*x.shape, B.shape[-1]) if state is None else state.to(dtype)
        h = (dt * A).exp()[..., None, None] * h + (dt.unsqueeze(-1) * x).unsqueeze(-1) * B[:, None, None, :]
        y = (h @ C[:, None, :, None]).squeeze(-1)
    return y.to(out_dtype), h
