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
tokens or chunks; where a gradient is wanted (outside torch.compile) it runs as ``_Chunks``, its backward written
out. :func:`ssd_step` is one token (generation). Both run in float32 (float64 for float64 inputs), outside autocast.

Shapes: x ``[B, H, T, P]``, dt ``[B, H, T]``, A ``[H]``, B, C ``[B, T, N]``, state ``[B, H, P, N]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ltcx.ops.precision import compute_dtype, without_autocast
from ltcx.ops.written_backward import cumsum_backward, wants_written_backward

__all__ = ["decays", "decays_backward", "ssd_chunked", "ssd_step"]


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
        def padded(t: Tensor, dim: int) -> Tensor:  # zero steps appended along dim (none: no copy, no kernel)
            t = t.to(dtype)
            return F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, pad)) if pad else t

        # x contiguous once (it comes with its heads transposed), not copied by each product that reads it
        x = padded(x, 2).contiguous().unflatten(2, (chunks, size))  # [B, H, N, L, P]
        dt = padded(dt, 2).unflatten(2, (chunks, size))  # [B, H, N, L]
        B = padded(B, 1).unflatten(1, (chunks, size)).unsqueeze(1)  # [B, 1, N, L, Ns]
        C = padded(C, 1).unflatten(1, (chunks, size)).unsqueeze(1)
        first = x.new_zeros(batch, heads, 1, width, B.shape[-1]) if state is None else state.to(dtype).unsqueeze(2)
        inputs = (x, dt, A.to(dtype), B, C, first)
        y, final = _Chunks.apply(*inputs) if wants_written_backward(*inputs) else _chunks(*inputs)
    return y.flatten(2, 3)[:, :, :length].to(out_dtype), final


def _chunks(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, first: Tensor,
            keep: dict | None = None) -> tuple[Tensor, Tensor]:
    """The chunked dual form on chunks: x ``[B, H, N, L, P]``, dt ``[B, H, N, L]``, A ``[H]``, B, C
    ``[B, 1, N, L, Ns]``, the state before the first chunk ``[B, H, 1, P, Ns]`` -> (y ``[B, H, N, L, P]``, the state
    after the last chunk ``[B, H, P, Ns]``). ``keep``: a dict that receives what :class:`_Chunks`'s backward reads."""
    g = dt * A[:, None, None]  # [B, H, N, L]
    G = g.cumsum(-1)
    xdt = x * dt.unsqueeze(-1)
    # within each chunk, from the chunk's own inputs (C B^T once for all heads)
    D = decays(g)  # [B, H, N, L, L]; its last row: e^{G_L - G_j}
    M = (C @ B.transpose(-1, -2)) * D
    y = M @ xdt
    # each chunk's contribution to the state at its end, then every chunk boundary's state at once
    ends = xdt * D[..., -1, :].unsqueeze(-1)
    # B and C once per head: a product of them with a per-head tensor would copy them so anyway, forward and backward
    B_h, C_h = (t.expand(-1, x.shape[1], -1, -1, -1).contiguous() for t in (B, C))
    contribution = ends.transpose(-1, -2) @ B_h  # [B, H, N, P, Ns]
    # the state at each chunk boundary: the state given and every chunk's contribution, decayed by the chunks since
    joined = torch.cat([first, contribution], dim=2).flatten(-2)
    between = decays(F.pad(G[..., -1], (1, 0)))  # [B, H, N + 1, N + 1]
    # the chunks' starting states and the final one as two products: a slice of one would be copied by each reader
    S0 = (between[:, :, :-1] @ joined).unflatten(-1, contribution.shape[-2:])  # [B, H, N, P, Ns]
    final = (between[:, :, -1:] @ joined).view_as(first).squeeze(2)
    decay = G.exp()
    read = C_h @ S0.transpose(-1, -2)  # [B, H, N, L, P]
    if keep is not None:
        keep.update(D=D, M=M, xdt=xdt, ends=ends, B_h=B_h, C_h=C_h, joined=joined, between=between, S0=S0,
                    decay=decay, read=read)
    return y + decay.unsqueeze(-1) * read, final


def decays_backward(g_log: Tensor) -> Tensor:
    """The gradient of :func:`decays`'s steps 1..L-1 ``[..., L - 1]`` (step 0 is in no entry) from that of its
    entries' logarithms ``[..., L, L]`` (g_D D; 0 above the diagonal): step i is summed into the entries [i', j] with
    i' >= i > j, that is the sums over j <= i - 1 (a cumulative sum along the row) of the rows i' > i - 1."""
    return g_log.cumsum(-1).tril(-1).sum(-2)[..., :-1]


class _Chunks(torch.autograd.Function):
    """:func:`_chunks` with its backward written out (the chain rule through every line of its forward): each
    :func:`decays`' gradient from its entries' logarithms in one pass, a decay's and its product's gradients as one
    product (g_D D = g_M M), where autograd's graph ran the exp's, the masks' and each broadcast's passes apart. Held
    to autograd of :func:`_chunks` in float64."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, first):
        kept = {}
        y, final = _chunks(x, dt, A, B, C, first, keep=kept)
        ctx.save_for_backward(x, dt, A, B, C, *(kept[name] for name in _KEPT))
        ctx.set_materialize_grads(False)  # an unused final state costs no zeros
        return y, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_y, g_final):
        x, dt, A, B, C, *rest = ctx.saved_tensors
        D, M, xdt, ends, B_h, C_h, joined, between, S0, decay, read = rest
        # one copy where g_y comes strided (the layer reads y's heads transposed): every product below would copy it
        g_y = torch.zeros_like(xdt) if g_y is None else g_y.contiguous()
        # y = M xdt + e^G read, read = C S0^T
        g_read = g_y * decay.unsqueeze(-1)
        g_G = (g_y * read).sum(-1).mul_(decay)
        g_C = (g_read @ S0).sum(1, keepdim=True)
        g_S0 = g_read.transpose(-1, -2) @ C_h
        # states = between joined (joined: the state given, then the contributions)
        g_states = F.pad(g_S0, (0, 0, 0, 0, 0, 1)) if g_final is None else \
            torch.cat([g_S0, g_final.unsqueeze(2)], dim=2)
        g_states = g_states.flatten(-2)
        # the contributions' rows and the given state's apart: slices of one product would be copied for each product
        between_t = between.transpose(-1, -2)
        g_contribution = (between_t[:, :, 1:] @ g_states).unflatten(-1, S0.shape[-2:])
        g_first = (between_t[:, :, :1] @ g_states).unflatten(-1, S0.shape[-2:]) if ctx.needs_input_grad[5] else None
        g_log_between = (g_states @ joined.transpose(-1, -2)).mul_(between)
        g_G[..., -1].add_(decays_backward(g_log_between))
        # contribution = ends^T B, ends = xdt e^{G_L - G}
        g_ends = B_h @ g_contribution.transpose(-1, -2)
        g_B = (ends @ g_contribution).sum(1, keepdim=True)
        end_decay = D[..., -1, :]
        g_xdt = g_ends * end_decay.unsqueeze(-1)
        g_end_decay = (g_ends * xdt).sum(-1)
        # y's M xdt, M = (C B^T) D: D's gradient times D is M's times M
        g_M = g_y @ xdt.transpose(-1, -2)
        g_xdt += M.transpose(-1, -2) @ g_y
        g_CB = (g_M * D).sum(1, keepdim=True)
        g_log_D = g_M.mul_(M)
        g_log_D[..., -1, :].addcmul_(g_end_decay, end_decay)
        g_C += g_CB @ B
        g_B += g_CB.transpose(-1, -2) @ C
        # G = cumsum(g), g = dt A, xdt = x dt
        g_g = cumsum_backward(g_G)
        g_g[..., 1:].add_(decays_backward(g_log_D))
        g_x = g_xdt * dt.unsqueeze(-1)
        g_dt = torch.addcmul((g_xdt * x).sum(-1), g_g, A[:, None, None])
        g_A = (g_g * dt).sum((0, 2, 3))
        return g_x, g_dt, g_A, g_B, g_C, g_first


_KEPT = ("D", "M", "xdt", "ends", "B_h", "C_h", "joined", "between", "S0", "decay", "read")


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
