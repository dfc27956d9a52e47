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


def _cell(pre: Tensor, c: Tensor, n: Tensor, m: Tensor, forget_gate: str) -> SLSTMState:
    """The stabilised update from the four pre-activations pre ``[..., 4 Dh]`` (i, f, z, o side by side) and the state
    c, n, m ``[..., Dh]`` -> (c, n, h, m) after the step.

    The stabiliser m carries no gradient: c and n are the unstabilised C and N times exp(-m), so h = o c / n, and the
    next step from (c, n, m), are the same for any m, and their derivative along m is zero. Leaving it out of the
    graph drops a maximum's backward and m's chain from every step (the sLSTM block 1.1x faster at the recall grid's
    shape); tests/test_xlstm.py holds the gradients to the unstabilised equations' in float64."""
    i_pre, f_pre, z_pre, o_pre = pre.chunk(4, dim=-1)
    log_f_m = log_forget_gate(f_pre, forget_gate) + m  # log f_t + m_{t-1}, read twice
    m_new = torch.maximum(log_f_m.detach(), i_pre.detach())
    ip = torch.exp(i_pre - m_new)
    fp = torch.exp(log_f_m - m_new)
    c = torch.addcmul(fp * c, ip, torch.tanh(z_pre))
    n = torch.addcmul(ip, fp, n)
    h = torch.sigmoid(o_pre) * (c / n)
    return c, n, h, m_new


def recurrent_weights(R: Tensor) -> Tensor:
    """R ``[4, H, Dh, Dh]`` -> ``[H, Dh, 4 Dh]`` in the state dtype: per head the four gates' maps side by side, so
    the recurrent part of all four gates is one product per step (a decoder may keep it between steps)."""
    H, Dh = R.shape[1], R.shape[2]
    return R.to(state_dtype(R.dtype)).permute(1, 2, 0, 3).reshape(H, Dh, 4 * Dh)


def slstm_step(
    gates_x: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid"
) -> tuple[Tensor, SLSTMState]:
    """One step. gates_x ``[B, 4, H, Dh]`` (W x + b), R ``[4, H, Dh, Dh]``. Returns h ``[B, H, Dh]``, state."""
    h, state = slstm_scan(gates_x.unsqueeze(1), R, state, forget_gate=forget_gate)
    return h[:, 0], state


def slstm_scan(
    gates_x: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid"
) -> tuple[Tensor, SLSTMState]:
    """Run the recurrence over time. gates_x ``[B, T, 4, H, Dh]``; returns h ``[B, T, H, Dh]`` (dtype of gates_x).
    :func:`slstm_scan_head_major` on the same steps laid out head-major."""
    B, T, _, H, Dh = gates_x.shape
    steps = gates_x.permute(1, 3, 0, 2, 4).reshape(T, H, B, 4 * Dh)
    h, state = slstm_scan_head_major(steps, R, state, forget_gate=forget_gate)
    return h.permute(2, 0, 1, 3), state  # [T, H, B, Dh] -> [B, T, H, Dh]


def slstm_scan_head_major(
    steps: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid",
    recurrent: Tensor | None = None,
) -> tuple[Tensor, SLSTMState]:
    """:func:`slstm_scan` on its inputs as the loop reads them: steps ``[T, H, B, 4 Dh]`` (any strides; per step and
    head the four gates' input parts side by side, i, f, z, o); returns h ``[T, H, B, Dh]`` (dtype of steps) and the
    state (each ``[B, H, Dh]``). A block that projects its input straight into this layout skips slstm_scan's copy.
    ``recurrent``: ``recurrent_weights(R)`` when the caller keeps it (else built here).

    Inside the loop everything is head-major ``[H, B, ...]``: the recurrent part of a step is one ``baddbmm`` of
    h ``[H, B, Dh]`` with ``[H, Dh, 4 Dh]`` onto that step's input part, and the steps' inputs come from one
    ``unbind`` (whose backward is one stack, where indexing each step would zero-fill a [T, ...] gradient per step).
    """
    T, H, B, width = steps.shape
    Dh = width // 4
    cdt = state_dtype(steps.dtype)
    if state is None:
        state = slstm_init_state(B, H, Dh, device=steps.device, dtype=cdt)
    c, n, h, m = (s.to(cdt).transpose(0, 1) for s in state)  # [H, B, Dh]
    if T == 0:
        return steps.new_zeros(0, H, B, Dh), state
    recurrent = (recurrent_weights(R) if recurrent is None else recurrent).to(cdt)
    hs = []
    for gates_t in steps.to(cdt).unbind(0):  # sLSTM's own recurrence: the only token loop in a training path
        c, n, h, m = _cell(torch.baddbmm(gates_t, h, recurrent), c, n, m, forget_gate)
        hs.append(h)
    return torch.stack(hs, dim=0).to(steps.dtype), tuple(s.transpose(0, 1) for s in (c, n, h, m))
