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
``n_t >= 1``, so ``c / n`` never divides by zero). A padding mask ``[B, T]`` (True = a real token) makes each
masked step an identity step: c, n, h and m stay as they were (the step's output is the kept h).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .mlstm import log_forget_gate, state_dtype
from .written_backward import wants_written_backward

SLSTMState = tuple[Tensor, Tensor, Tensor, Tensor]


def slstm_init_state(
    batch_size: int, n_head: int, head_dim: int, device=None, dtype: torch.dtype = torch.float32
) -> SLSTMState:
    """The empty state: c = n = h = 0 and m = -inf, each ``[B, H, Dh]``."""
    shape = (batch_size, n_head, head_dim)
    zeros = torch.zeros(shape, device=device, dtype=dtype)
    return zeros, zeros.clone(), zeros.clone(), torch.full(shape, float("-inf"), device=device, dtype=dtype)


def _cell(pre: Tensor, c: Tensor, n: Tensor, m: Tensor, forget_gate: str) -> tuple[SLSTMState, tuple[Tensor, ...]]:
    """The stabilised update from the four pre-activations pre ``[..., 4 Dh]`` (i, f, z, o side by side) and the state
    c, n, m ``[..., Dh]`` -> ((c, n, h, m) after the step, the activations (i', f', tanh z~, sigmoid o~) that the
    hand-written backward reads).

    The stabiliser m carries no gradient: c and n are the unstabilised C and N times exp(-m), so h = o c / n, and the
    next step from (c, n, m), are the same for any m, and their derivative along m is zero. Leaving it out of the
    graph drops a maximum's backward and m's chain from every step; tests/test_xlstm.py holds the gradients to the
    unstabilised equations' in float64."""
    i_pre, f_pre, z_pre, o_pre = pre.chunk(4, dim=-1)
    log_f_m = log_forget_gate(f_pre, forget_gate) + m  # log f_t + m_{t-1}, read twice
    m_new = torch.maximum(log_f_m.detach(), i_pre.detach())
    ip = torch.exp(i_pre - m_new)
    fp = torch.exp(log_f_m - m_new)
    tz, so = torch.tanh(z_pre), torch.sigmoid(o_pre)
    c = torch.addcmul(fp * c, ip, tz)
    n = torch.addcmul(ip, fp, n)
    h = so * (c / n)
    return (c, n, h, m_new), (ip, fp, tz, so)


def _scan_loop(
    steps: Tensor, recurrent: Tensor, c: Tensor, n: Tensor, h: Tensor, m: Tensor, forget_gate: str,
    record: list | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The recurrence over steps ``[T, H, B, 4 Dh]`` from (c, n, h, m) ``[H, B, Dh]`` with recurrent ``[H, Dh, 4 Dh]``
    -> (h of every step ``[T, H, B, Dh]``, a view of ``[H, T, B, Dh]``; c, n, h, m after the last), differentiable by
    autograd. ``record``: a list that gets each step's (pre-activations, c and n after it, activations) for
    :class:`_Scan`'s backward."""
    hs = []
    for gates_t in steps.unbind(0):  # sLSTM's own recurrence: the only token loop in a training path
        pre = torch.baddbmm(gates_t, h, recurrent)
        (c, n, h, m), acts = _cell(pre, c, n, m, forget_gate)
        hs.append(h)
        if record is not None:
            record.append((pre, c, n, *acts))
    return torch.stack(hs, dim=1).transpose(0, 1), c, n, h, m


def _masked_scan_loop(
    steps: Tensor, recurrent: Tensor, c: Tensor, n: Tensor, h: Tensor, m: Tensor, forget_gate: str, mask: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_scan_loop` where the steps that ``mask`` ``[B, T]`` marks False leave (c, n, h, m) as they were."""
    hs = []
    for gates_t, real in zip(steps.unbind(0), mask.t()[:, None, :, None].unbind(0)):  # real [1, B, 1]
        (c_new, n_new, h_new, m_new), _ = _cell(torch.baddbmm(gates_t, h, recurrent), c, n, m, forget_gate)
        c, n, h, m = (torch.where(real, new, old) for new, old in zip((c_new, n_new, h_new, m_new), (c, n, h, m)))
        hs.append(h)
    return torch.stack(hs, dim=1).transpose(0, 1), c, n, h, m


class _Scan(torch.autograd.Function):
    """:func:`_scan_loop` with its backward written out: the forward records no graph, and the backward's loop over
    the steps runs six ops a step (the recurrent product, the carried gradients of c and n, the step's gate gradients),
    everything else batched over all steps before and after it, where autograd's backward ran some 25 kernels a step.
    Per step, from g_h (the output's gradient plus R's product of the next step's gate gradients) and the gradients
    g_c, g_n carried back from the next step (times its f'):

        g_c += g_h so / n        g_n -= g_h h / n        (h = so c / n)
        g_i~ = (g_c tanh z~ + g_n) i'                    g_f~ = (g_c c_{t-1} + g_n n_{t-1}) df'/df~
        g_z~ = g_c i' (1 - tanh^2 z~)                   g_o~ = g_h h (1 - so)

    with df'/df~ = f' sigmoid(-f~) for the sigmoid forget gate and f' for the exponential one (m held fixed: see
    :func:`_cell`).

    What the backward reads is kept head-major over time, ``[H, T, B, ...]``, so that R's gradient is a product over
    all steps and the steps' gradient has the layout the sLSTM block projects them in, with no copy of either."""

    @staticmethod
    def forward(ctx, steps, recurrent, c0, n0, h0, m0, forget_gate):
        record: list = []
        hs, c, n, h, m = _scan_loop(steps, recurrent, c0, n0, h0, m0, forget_gate, record)
        pre, cs, ns, ip, fp, tz, so = zip(*record)
        # [H, T, B, ...] each; c and n with the state before the first step ([H, T + 1, B, Dh]): each step reads both
        ip, fp, tz, so = (torch.stack(x, dim=1) for x in (ip, fp, tz, so))
        cs, ns = torch.stack([c0, *cs], dim=1), torch.stack([n0, *ns], dim=1)
        # d f' / d f~ = f' d log f / d f~: f' sigmoid(-f~) for the sigmoid gate, f' for the exponential one; kept in
        # place of the pre-activations, four times its size, which the backward would read for it alone
        Dh = ip.shape[-1]
        d_forget = fp if forget_gate != "sigmoid" else torch.stack(
            [p.narrow(-1, Dh, Dh) for p in pre], dim=1).neg_().sigmoid_().mul_(fp)
        ctx.save_for_backward(recurrent, h0, cs, ns, hs.transpose(0, 1), ip, fp, tz, so, d_forget)
        ctx.mark_non_differentiable(m)
        ctx.set_materialize_grads(False)  # a final state nothing reads gets None: no zeros added
        return hs, c, n, h, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_hs, g_c, g_n, g_h, _g_m):
        recurrent, h0, cs, ns, hs, ip, fp, tz, so, d_forget = ctx.saved_tensors  # [H, T, B, ...]
        H, T, B, Dh = ip.shape
        width = 4 * Dh
        (c0, c_prev, c_new), (n0, n_prev, n_new) = ((x[:, 0], x[:, :-1], x[:, 1:]) for x in (cs, ns))
        # Each step's coefficients, all steps at once, each written where the loop reads it.
        # h = so c / n: per unit of g_h, g_c gains so / n and g_n gains -h / n
        per_gh = ip.new_empty(2, H, T, B, Dh)
        torch.div(so, n_new, out=per_gh[0])
        torch.div(hs, n_new, out=per_gh[1]).neg_()
        # the step's gate gradients (i, f, z, o) per unit of g_c (i, f, z), of g_n (i, f) and of g_h (o)
        per_gc = ip.new_empty(H, T, B, 3, Dh)
        torch.mul(tz, ip, out=per_gc[..., 0, :])
        torch.mul(c_prev, d_forget, out=per_gc[..., 1, :])
        torch.addcmul(ip, per_gc[..., 0, :], tz, value=-1.0, out=per_gc[..., 2, :])  # i' (1 - tanh^2 z~)
        per_gn = ip.new_empty(H, T, B, 2, Dh)
        per_gn[..., 0, :] = ip
        torch.mul(n_prev, d_forget, out=per_gn[..., 1, :])
        per_go = torch.addcmul(hs, hs, so, value=-1.0)  # h (1 - so) = so (1 - so) c / n
        g_pre = ip.new_empty(H, T, B, 4, Dh)
        carried = ip.new_zeros(2, H, B, Dh)  # the gradients of (c, n) from the steps after
        if g_c is not None:
            carried[0] = g_c
        if g_n is not None:
            carried[1] = g_n
        g_hs = hs.new_zeros(T, H, B, Dh) if g_hs is None else g_hs
        recurrent_t = recurrent.transpose(-1, -2)
        g_h_t = g_hs[-1] if g_h is None else g_hs[-1] + g_h
        for t in range(T - 1, -1, -1):
            if t < T - 1:  # h_t also fed the next step's pre-activations through R
                g_h_t = torch.baddbmm(g_hs[t], g_pre[:, t + 1].view(H, B, width), recurrent_t)
            g_cn = carried.addcmul_(g_h_t, per_gh[:, :, t])
            g_gates = g_pre[:, t]
            torch.mul(g_cn[0].unsqueeze(-2), per_gc[:, t], out=g_gates[..., :3, :])
            g_gates[..., :2, :].addcmul_(g_cn[1].unsqueeze(-2), per_gn[:, t])
            torch.mul(g_h_t, per_go[:, t], out=g_gates[..., 3, :])
            carried = g_cn.mul_(fp[:, t])
        g_pre = g_pre.view(H, T * B, width)
        # R's gradient: the sum over steps of h_{t-1}^T g_pre_t, the first step's from h_0
        g_recurrent = torch.bmm(h0.transpose(1, 2), g_pre[:, :B])
        g_recurrent.baddbmm_(hs[:, :-1].reshape(H, (T - 1) * B, Dh).transpose(1, 2), g_pre[:, B:])
        g_steps = g_pre.view(H, T, B, width).transpose(0, 1)
        # a given state's gradients only where it wants them (training starts from the empty state: none)
        _, _, wants_c0, wants_n0, wants_h0, wants_m0, _ = ctx.needs_input_grad
        g_h0 = torch.bmm(g_pre[:, :B], recurrent_t) if wants_h0 else None
        # m_0 enters through f'_1 = exp(log f_1 + m_0 - m_1) alone
        g_m0 = carried[0] * c0 + carried[1] * n0 if wants_m0 else None
        return (g_steps, g_recurrent, carried[0] if wants_c0 else None, carried[1] if wants_n0 else None, g_h0, g_m0,
                None)


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
    recurrent: Tensor | None = None, mask: Tensor | None = None,
) -> tuple[Tensor, SLSTMState]:
    """:func:`slstm_scan` on its inputs as the loop reads them: steps ``[T, H, B, 4 Dh]`` (any strides; per step and
    head the four gates' input parts side by side, i, f, z, o); returns h ``[T, H, B, Dh]`` (dtype of steps) and the
    state (each ``[B, H, Dh]``). A block that projects its input straight into this layout skips slstm_scan's copy.
    ``recurrent``: ``recurrent_weights(R)`` when the caller keeps it (else built here). ``mask`` ``[B, T]`` or None:
    masked steps leave the state as it was (the module's docstring), in a loop without the written backward.

    Inside the loop everything is head-major ``[H, B, ...]``: the recurrent part of a step is one ``baddbmm`` of
    h ``[H, B, Dh]`` with ``[H, Dh, 4 Dh]`` onto that step's input part, and the steps' inputs come from one
    ``unbind``. Where a gradient is wanted the loop runs inside :class:`_Scan`, whose backward is written out (held
    to autograd of :func:`_scan_loop` in float64); without one, and under ``torch.compile``, the loop itself.
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
    inputs = (steps.to(cdt), recurrent, c, n, h, m)
    if mask is not None:
        hs, c, n, h, m = _masked_scan_loop(*inputs, forget_gate, mask.to(steps.device))
        return hs.to(steps.dtype), tuple(s.transpose(0, 1) for s in (c, n, h, m))
    scan = _Scan.apply if wants_written_backward(*inputs) else _scan_loop
    hs, c, n, h, m = scan(*inputs, forget_gate)
    return hs.to(steps.dtype), tuple(s.transpose(0, 1) for s in (c, n, h, m))
