"""sLSTM (scalar-memory LSTM with exponential gating, Beck et al. 2024) as pure tensor functions.

The caller computes the input part of all four gate pre-activations for every step in one
matmul (``W x + b``, shape ``[B, T, 4, H, Dh]``, gate order i, f, z, o); only the recurrent
part ``R h_{t-1}`` runs in the loop over time. R is block-diagonal: ``[4, H, Dh, Dh]``, so
memory mixes within a head, never across heads. No host synchronisation inside the loop.

Per unit, with ``log f = logsigmoid(f~)`` (or ``f~`` for the exponential forget gate)::

    m_t = max(log f_t + m_{t-1}, i~_t)
    i'  = exp(i~_t - m_t),  f' = exp(log f_t + m_{t-1} - m_t)
    c_t = f' c_{t-1} + i' tanh(z~_t)
    n_t = f' n_{t-1} + i'
    h_t = sigmoid(o~_t) * c_t / n_t

State ``(c, n, h, m)``, each ``[B, H, Dh]``, float32 (float64 for float64 inputs). The empty
state has ``m = -inf`` so the first step needs no special case (then ``n_1 = 1``; by induction
``n_t >= 1``, so ``c / n`` never divides by zero).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .mlstm import log_forget_gate, state_dtype

SLSTMState = tuple[Tensor, Tensor, Tensor, Tensor]


def slstm_init_state(
    batch_size: int, num_heads: int, head_dim: int, device=None, dtype: torch.dtype = torch.float32
) -> SLSTMState:
    """The empty state: c = n = h = 0 and m = -inf, each ``[B, H, Dh]``."""
    shape = (batch_size, num_heads, head_dim)
    zeros = torch.zeros(shape, device=device, dtype=dtype)
    return zeros, zeros.clone(), zeros.clone(), torch.full(shape, float("-inf"), device=device, dtype=dtype)


def slstm_step(
    gates_x: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid"
) -> tuple[Tensor, SLSTMState]:
    """One step. gates_x ``[B, 4, H, Dh]`` (W x + b), R ``[4, H, Dh, Dh]``. Returns h ``[B, H, Dh]``, state."""
    B, _, H, Dh = gates_x.shape
    cdt = state_dtype(gates_x.dtype)
    if state is None:
        state = slstm_init_state(B, H, Dh, device=gates_x.device, dtype=cdt)
    c, n, h, m = (s.to(cdt) for s in state)
    # recurrent contribution, per gate and head: h_{t-1} [B, H, Dh] @ R[g, h] [Dh, Dh]
    pre = gates_x.to(cdt) + torch.einsum("bhd,ghde->bghe", h, R.to(cdt))
    i_pre, f_pre, z_pre, o_pre = pre.unbind(1)
    log_f = log_forget_gate(f_pre, forget_gate)
    m_new = torch.maximum(log_f + m, i_pre)
    ip = torch.exp(i_pre - m_new)
    fp = torch.exp(log_f + m - m_new)
    c = fp * c + ip * torch.tanh(z_pre)
    n = fp * n + ip
    h = torch.sigmoid(o_pre) * (c / n)
    return h, (c, n, h, m_new)


def slstm_scan(
    gates_x: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid"
) -> tuple[Tensor, SLSTMState]:
    """Run the recurrence over time. gates_x ``[B, T, 4, H, Dh]``; returns h ``[B, T, H, Dh]`` (dtype of gates_x)."""
    B, T, _, H, Dh = gates_x.shape
    if state is None:
        state = slstm_init_state(B, H, Dh, device=gates_x.device, dtype=state_dtype(gates_x.dtype))
    hs = []
    for t in range(T):  # sLSTM's own recurrence: the only token loop in a training path
        h, state = slstm_step(gates_x[:, t], R, state, forget_gate=forget_gate)
        hs.append(h)
    out = torch.stack(hs, dim=1) if hs else gates_x.new_zeros(B, 0, H, Dh)
    return out.to(gates_x.dtype), state
