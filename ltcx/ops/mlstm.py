"""mLSTM (matrix-memory LSTM, Beck et al. 2024, arXiv 2405.04517) as pure tensor functions.

Three forms of one recurrence, all stabilised the same way and all with the same ``eps``:

* :func:`mlstm_parallel`   -- the whole sequence at once, O(T^2) memory (like attention);
* :func:`mlstm_chunkwise`  -- parallel inside chunks, (C, n, m) carried between chunks;
* :func:`mlstm_step`       -- one token, the recurrent form used in generation
  (:func:`mlstm_recurrent` loops it over a sequence; a reference, not a training path).

Shapes: q, k, v ``[B, H, T, D]``; input / forget gate pre-activations ``[B, H, T]``.
State ``(C, n, m)``: ``C [B, H, D, D]`` (indexed ``[key, value]``, so ``h = q @ C``),
``n [B, H, D]``, ``m [B, H]``; C and n are stored divided by ``exp(m)``. The state is kept
in float32 (float64 when the inputs are float64). The empty state has ``m = -inf``, so an
empty state contributes exactly nothing and every form computes the same stabiliser
``m_t = max_j log D_tj`` as the parallel formula.

Keys are scaled by ``1/sqrt(D)`` inside every function here; callers pass raw keys.

The recurrence (per batch element and head), ``log f = logsigmoid(f~)`` (or ``f~`` for the
exponential forget gate)::

    m_t = max(log f_t + m_{t-1}, i~_t)
    C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) k_t v_t^T
    n_t = exp(log f_t + m_{t-1} - m_t) n_{t-1} + exp(i~_t - m_t) k_t
    h_t = C_t^T q_t / (max(|n_t . q_t|, exp(-m_t)) + eps)

A padding mask ``[B, T]`` (True = a real token) makes each masked step an identity step: no input
(``i~ = MASKED_LOG_I``, whose weight ``exp(i~ - m)`` is exactly 0 beside any real input or carried state) and no
forgetting (``log f = 0``); a row with no real token in the call keeps its state as it was. A masked step's h is
finite and meaningless.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .written_backward import cumsum_backward, wants_written_backward

MLSTMState = tuple[Tensor, Tensor, Tensor]

EPS = 1e-6
"""Added to the normaliser in all three forms (so they agree to rounding)."""

_MAX_NEG_M = 80.0
"""``exp(-m)`` is evaluated as ``exp(min(-m, 80))``: identical unless m < -80, where it keeps
the floor finite (an infinite floor gives 0 * inf = NaN in the backward pass)."""

FORGET_GATES = ("sigmoid", "exp")

MASKED_LOG_I = -1e30
"""A masked step's input-gate pre-activation: finite (the empty state's -inf beside it would give NaN), and so far
below any real one that its weight rounds to 0 wherever a real input or a carried state is present."""


def log_forget_gate(f_pre: Tensor, forget_gate: str = "sigmoid") -> Tensor:
    """log f from the forget-gate pre-activation: logsigmoid (bounded, f <= 1) or identity (exp gate)."""
    if forget_gate == "sigmoid":
        return F.logsigmoid(f_pre)
    if forget_gate == "exp":
        return f_pre
    raise ValueError(f"forget_gate ({forget_gate!r}) must be one of {FORGET_GATES}")


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States and gate arithmetic run in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mlstm_init_state(
    batch_size: int, n_head: int, head_dim: int, device=None, dtype: torch.dtype = torch.float32
) -> MLSTMState:
    """The empty state: C = 0 ``[B, H, D, D]``, n = 0 ``[B, H, D]``, m = -inf ``[B, H]``."""
    C = torch.zeros(batch_size, n_head, head_dim, head_dim, device=device, dtype=dtype)
    n = torch.zeros(batch_size, n_head, head_dim, device=device, dtype=dtype)
    m = torch.full((batch_size, n_head), float("-inf"), device=device, dtype=dtype)
    return C, n, m


def _normaliser(den: Tensor, m: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(1 / (max(|den|, exp(-m)) + eps), exp(-m)): h is num times the first; den and m [...].

    A reciprocal on [...] and a product over num's size: a division's backward makes four passes over num's size (g /
    d, and g num / d^2 with its negation) where the product's makes two."""
    floor = torch.exp(torch.clamp(-m, max=_MAX_NEG_M))
    return torch.reciprocal(torch.maximum(den.abs(), floor) + eps), floor


def _normalise(num: Tensor, den: Tensor, m: Tensor, eps: float) -> Tensor:
    """h = num / (max(|den|, exp(-m)) + eps); num [..., D], den and m [...]."""
    return num * _normaliser(den, m, eps)[0].unsqueeze(-1)


def _prepare(q, k, v, i_pre, f_pre, state, forget_gate, mask=None):
    """Cast to the state dtype, scale keys, take log f, and cast the initial state (None stays None: the empty
    state's terms are left out, and its zero ``[B, H, D, D]`` is made only where a form carries it); masked steps
    (mask ``[B, T]`` False) get no input and no forgetting.

    q, k and v come out contiguous: a block's heads are views of ``[B, T, H D]`` (``[B, H, T, D]`` with T's stride
    H D), which every batched product here, forward and backward, would otherwise copy to make B and H one batch
    dim: one copy each here instead."""
    D = q.shape[-1]
    cdt = state_dtype(q.dtype)
    q, k, v = q.to(cdt).contiguous(), k.to(cdt).contiguous() * (1.0 / math.sqrt(D)), v.to(cdt).contiguous()
    log_i = i_pre.to(cdt)
    log_f = log_forget_gate(f_pre.to(cdt), forget_gate)
    if mask is not None:
        masked = ~mask[:, None, :]  # [B, 1, T]
        log_i, log_f = log_i.masked_fill(masked, MASKED_LOG_I), log_f.masked_fill(masked, 0.0)
    return q, k, v, log_i, log_f, None if state is None else tuple(s.to(cdt) for s in state)


def _kept_where_unseen(new: MLSTMState, given: MLSTMState | None, q: Tensor, mask: Tensor | None) -> MLSTMState:
    """``new``, except in the rows of ``mask`` ``[B, T]`` with no real token, which keep ``given`` (the empty state
    for None): their masked steps would otherwise leave finite traces weighted exp(MASKED_LOG_I)."""
    if mask is None:
        return new
    old = _state_or_empty(given, q)
    seen = mask.any(dim=1)  # [B]
    return tuple(torch.where(seen.view(-1, *([1] * (n.dim() - 1))), n, o) for n, o in zip(new, old))


def _state_or_empty(state: MLSTMState | None, q: Tensor) -> MLSTMState:
    """``state``, or the empty state for q ``[B, H, T, D]`` in q's dtype (already the state dtype) where it is None."""
    if state is not None:
        return state
    B, H, _, D = q.shape
    return mlstm_init_state(B, H, D, device=q.device, dtype=q.dtype)


def _chunk(q, k, v, log_i, log_f, C0, n0, m0, eps, keep=None):
    """Outputs h ``[..., L, D]`` of one block of steps, given the state before it (its state after:
    :func:`_chunk_state`).

    Any leading dims ``[...]`` (e.g. ``[B, H]`` or ``[B, H, N]`` for N chunks at once).
    q, k (scaled), v ``[..., L, D]``; log_i, log_f ``[..., L]``; C0 ``[..., D, D]``,
    n0 ``[..., D]``, m0 ``[...]``, or all three None for the empty state (C = 0, n = 0, m = -inf), whose terms
    are exactly zero (weight exp(-inf) = 0) and are left out. ``keep``: a dict that receives what
    :class:`_ChunkOutputs`'s backward reads.

    The stabiliser's row maximum takes ``max`` with its indices, not ``amax``: on a tie its gradient (h depends on m
    through eps and the floor alone) goes to one of the maxima, as the hand-written backward routes it.
    """
    L = q.shape[-2]
    empty = C0 is None
    b = log_f.cumsum(-1)  # [..., L]   b_t = sum_{l<=t} log f_l
    # log D_tj = sum_{l=j+1..t} log f_l + i~_j  for j <= t
    log_D = b.unsqueeze(-1) - b.unsqueeze(-2) + log_i.unsqueeze(-2)  # [..., L, L]
    above = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    log_D = log_D.masked_fill_(above, float("-inf"))  # in place: nothing reads the sum before the mask
    m_intra, top = log_D.max(-1)  # [..., L]  stabiliser = running max (with the carried state's weight, below)
    m = m_intra
    if not empty:
        log_prev = b + m0.unsqueeze(-1)  # [..., L]  log weight of the carried state at step t
        m = torch.maximum(m_intra, log_prev)
    decay = torch.exp(log_D - m.unsqueeze(-1))  # [..., L, L], 0 above the diagonal
    S = (q @ k.transpose(-1, -2)) * decay
    num, den = S @ v, S.sum(-1)  # [..., L, D], [..., L] = n_t . q_t
    if not empty:
        w_prev = torch.exp(log_prev - m)  # [..., L]
        q_C0, q_n0 = q @ C0, (q @ n0.unsqueeze(-1)).squeeze(-1)
        num = torch.addcmul(num, w_prev.unsqueeze(-1), q_C0)
        den = torch.addcmul(den, w_prev, q_n0)
    reciprocal, floor = _normaliser(den, m, eps)
    if keep is not None:
        keep.update(m=m, m_intra=m_intra, top=top, decay=decay, S=S, num=num, den=den, reciprocal=reciprocal,
                    floor=floor)
        if not empty:
            keep.update(log_prev=log_prev, w_prev=w_prev, q_C0=q_C0, q_n0=q_n0)
    return num * reciprocal.unsqueeze(-1)


def _chunk_state(k, v, log_i, log_f, C0, n0, m0) -> MLSTMState:
    """(C, n, m) after the block of :func:`_chunk` (same arguments): the last row of its D weights every input, and
    its stabiliser is the last row's (the same values as the outputs' last stabiliser)."""
    b = log_f.cumsum(-1)
    log_last = b[..., -1:] - b + log_i  # [..., L]  log D_Lj, as _chunk's last row
    m_last = log_last.amax(-1)
    if C0 is not None:
        log_prev = b[..., -1] + m0  # the carried state's log weight at the last step
        m_last = torch.maximum(m_last, log_prev)
    w_in = torch.exp(log_last - m_last.unsqueeze(-1))  # [..., L]
    kw = k * w_in.unsqueeze(-1)
    C, n = kw.transpose(-1, -2) @ v, kw.sum(-2)
    if C0 is not None:
        carry = torch.exp(log_prev - m_last)  # [...]
        C, n = carry[..., None, None] * C0 + C, carry.unsqueeze(-1) * n0 + n
    return C, n, m_last


def _split_maximum(half: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The gradient of ``torch.maximum(a, b)``, given halved (``half``), split between a and b as autograd splits it
    (all to the larger, half each on a tie): half (1 + s) and half (1 - s) for s = sign(a - b), exact (0, the half or
    the whole). a - b must not be NaN: a and b are never the same infinity here."""
    s = torch.sign(a - b)
    return torch.addcmul(half, half, s), torch.addcmul(half, half, s, value=-1)


class _ChunkOutputs(torch.autograd.Function):
    """h of :func:`_chunk` with its backward written out (the chain rule through every line of the forward): its
    ``[..., L, L]`` tensors take two products and two sums where autograd's graph of the chunk ran some 40 nodes
    (masks, broadcast sums, the exp's and the two products' separate passes), and it keeps two of them where autograd
    kept three. Held to autograd of :func:`_chunk` in float64. Inputs as ``_chunk``'s (C0, n0, m0 None: the empty
    state)."""

    @staticmethod
    def forward(ctx, q, k, v, log_i, log_f, C0, n0, m0, eps):
        kept = {}
        h = _chunk(q, k, v, log_i, log_f, C0, n0, m0, eps, keep=kept)
        ctx.empty = C0 is None
        names = _KEPT + (() if ctx.empty else _KEPT_STATE)
        ctx.save_for_backward(q, k, v, C0, n0, *(kept[name] for name in names))
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_h):
        q, k, v, C0, n0, *rest = ctx.saved_tensors
        x = dict(zip(_KEPT + (() if ctx.empty else _KEPT_STATE), rest))
        m, decay, S, num, den, reciprocal, floor = (x[name] for name in
                                                    ("m", "decay", "S", "num", "den", "reciprocal", "floor"))
        # one copy where g_h comes strided (a block reads h's heads transposed): every product below would copy it
        g_h = g_h.contiguous()
        # h = num r, r = 1 / (max(|den|, floor) + eps), floor = exp(min(-m, 80)); the maximum gets -g_r r^2
        g_num = g_h * reciprocal.unsqueeze(-1)
        g_r = (g_h * num).sum(-1)
        g_abs, g_floor = _split_maximum(g_r * reciprocal.square() * -0.5, den.abs(), floor)
        g_den = g_abs * den.sign()
        # m's gradient is gathered negated (g_neg_m = -g_m) until its split: floor's is -g_floor floor, where
        # clamp(-m, max=80) passes it (-m <= 80)
        g_neg_m = (g_floor * floor).masked_fill_(m < -_MAX_NEG_M, 0.0)
        # num = S v (+ w_prev q C0), den = S 1 (+ w_prev q n0)
        g_S = torch.baddbmm(g_den.unsqueeze(-1).expand(*S.shape).flatten(0, -3), g_num.flatten(0, -3),
                            v.flatten(0, -3).transpose(-1, -2)).view(S.shape)
        g_v = S.transpose(-1, -2) @ g_num
        g_C0 = g_n0 = g_m0 = None
        if not ctx.empty:
            w_prev = x["w_prev"]
            g_q_C0 = g_num * w_prev.unsqueeze(-1)
            g_q_n0 = g_den * w_prev
            g_w_prev = torch.addcmul((g_num * x["q_C0"]).sum(-1), g_den, x["q_n0"])
            g_q = torch.baddbmm((g_q_n0.unsqueeze(-1) * n0.unsqueeze(-2)).flatten(0, -3), g_q_C0.flatten(0, -3),
                                C0.transpose(-1, -2).flatten(0, -3)).view(q.shape)
            # a given state's gradients only where it wants them (the chunkwise form's carried states do)
            wants_C0, wants_n0, wants_m0 = ctx.needs_input_grad[5:8]
            g_C0 = q.transpose(-1, -2) @ g_q_C0 if wants_C0 else None
            g_n0 = (q.transpose(-1, -2) @ g_q_n0.unsqueeze(-1)).squeeze(-1) if wants_n0 else None
            g_log_prev = g_w_prev * w_prev  # w_prev = exp(log_prev - m)
            g_neg_m.add_(g_log_prev)
        # S = (q k^T) decay, decay = exp(log_D - m): the masked entries have decay 0 and S 0, so no gradient
        g_qk = g_S * decay
        g_log_D = g_S.mul_(S)  # g_S is read no more
        g_rows = g_log_D.sum(-1)
        g_neg_m.add_(g_rows)
        if ctx.empty:
            g_q = g_qk @ k
        else:
            g_q.flatten(0, -3).baddbmm_(g_qk.flatten(0, -3), k.flatten(0, -3))
        g_k = g_qk.transpose(-1, -2) @ q
        # m = maximum(m_intra, log_prev) (m_intra alone for the empty state); m_intra = log_D[t, top_t]
        if ctx.empty:
            g_m_intra = g_neg_m.neg_()
        else:
            g_m_intra, g_to_prev = _split_maximum(g_neg_m * -0.5, x["m_intra"], x["log_prev"])
            g_log_prev = g_log_prev + g_to_prev
        # log_D[t, j] = b_t - b_j + i_j: b_t gets the rows' sums, b_j and i_j the columns'
        g_cols = g_log_D.sum(-2).scatter_add_(-1, x["top"], g_m_intra)
        g_log_i = g_cols
        g_b = g_rows + g_m_intra - g_cols
        if not ctx.empty:
            g_b = g_b + g_log_prev  # log_prev = b + m0
            g_m0 = g_log_prev.sum(-1) if wants_m0 else None
        g_log_f = cumsum_backward(g_b)  # b = cumsum(log f)
        return g_q, g_k, g_v, g_log_i, g_log_f, g_C0, g_n0, g_m0, None


_KEPT = ("m", "m_intra", "top", "decay", "S", "num", "den", "reciprocal", "floor")
_KEPT_STATE = ("log_prev", "w_prev", "q_C0", "q_n0")


def _chunk_outputs(q, k, v, log_i, log_f, C0, n0, m0, eps):
    """h of :func:`_chunk`: through :class:`_ChunkOutputs` where ``wants_written_backward``, except under autocast,
    whose bf16 products the written-out backward (float32) would not mirror."""
    inputs = (q, k, v, log_i, log_f, C0, n0, m0, eps)
    if wants_written_backward(*inputs) and not torch.is_autocast_enabled(q.device.type):
        return _ChunkOutputs.apply(*inputs)
    return _chunk(*inputs)


def mlstm_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: MLSTMState | None = None,
    *,
    forget_gate: str = "sigmoid",
    eps: float = EPS,
    with_state: bool = True,
    mask: Tensor | None = None,
) -> tuple[Tensor, MLSTMState | None]:
    """Stabilised parallel mLSTM over the whole sequence, continuing from ``state``.

    q, k, v ``[B, H, T, D]``, i_pre, f_pre ``[B, H, T]``, mask ``[B, T]`` or None (the module's docstring). Returns h
    ``[B, H, T, D]`` (dtype of q) and the final state (None with ``with_state`` False: not computed, for a caller that
    discards it). The initial state enters as an extra "column" with log weight ``sum_{l<=t} log f_l + m_0`` (``-inf``
    for the empty state).
    """
    out_dtype = q.dtype
    q, k, v, log_i, log_f, state = _prepare(q, k, v, i_pre, f_pre, state, forget_gate, mask)
    if q.shape[-2] == 0:
        return q.to(out_dtype), _state_or_empty(state, q) if with_state else None
    given = state or (None,) * 3
    h = _chunk_outputs(q, k, v, log_i, log_f, *given, eps)
    if not with_state:
        return h.to(out_dtype), None
    return h.to(out_dtype), _kept_where_unseen(_chunk_state(k, v, log_i, log_f, *given), state, q, mask)


def _chunk_own(k, v, log_i, log_f, keep=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each block's own contribution to the state after it, from the empty state: C ``[..., D, D]`` and n ``[..., D]``
    scaled by exp(-m), m ``[...]`` (the largest log weight of its inputs; ``max`` with its index, as the written
    backward routes its gradient), and its total log decay ``[...]``; k (scaled), v ``[..., L, D]``, log_i, log_f
    ``[..., L]``. ``keep``: a dict that receives what :class:`_ChunkOwn`'s backward reads."""
    b = log_f.cumsum(-1)
    b_last = b[..., -1]
    log_w = b_last.unsqueeze(-1) - b + log_i  # [..., L]  log weight of input j at the block's end
    m, top = log_w.max(-1)
    weight = torch.exp(log_w - m.unsqueeze(-1))
    kw = k * weight.unsqueeze(-1)
    if keep is not None:
        keep.update(top=top, weight=weight, kw=kw)
    return kw.transpose(-1, -2) @ v, kw.sum(-2), m, b_last


class _ChunkOwn(torch.autograd.Function):
    """:func:`_chunk_own` with its backward written out (the chain rule through every line of its forward): the
    maximum's gradient scattered to its index, the state's two products one baddbmm and one bmm, the cumulative sum's
    reverse taken once. Held to autograd of :func:`_chunk_own` in float64."""

    @staticmethod
    def forward(ctx, k, v, log_i, log_f):
        kept = {}
        outputs = _chunk_own(k, v, log_i, log_f, keep=kept)
        ctx.save_for_backward(k, v, *(kept[name] for name in ("top", "weight", "kw")))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_C, g_n, g_m, g_b_last):
        k, v, top, weight, kw = ctx.saved_tensors
        # C = kw^T v, n = kw summed over the block
        g_kw = torch.baddbmm(g_n.unsqueeze(-2).expand(*kw.shape).flatten(0, -3), v.flatten(0, -3),
                             g_C.transpose(-1, -2).flatten(0, -3)).view(kw.shape)
        g_v = kw @ g_C
        # kw = k weight, weight = exp(log_w - m), m = log_w[top]
        g_k = g_kw * weight.unsqueeze(-1)
        g_log_w = (g_kw * k).sum(-1).mul_(weight)
        g_top = g_m - g_log_w.sum(-1)
        g_log_w.scatter_add_(-1, top.unsqueeze(-1), g_top.unsqueeze(-1))
        # log_w = b_last - b + log_i, b = cumsum(log f), b_last = b at the last step: log f_t enters every b_s, s >= t
        g_b_last = g_b_last + g_log_w.sum(-1)
        g_log_f = g_b_last.unsqueeze(-1) - cumsum_backward(g_log_w)
        return g_k, g_v, g_log_w, g_log_f


def _chunk_own_states(k, v, log_i, log_f) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_chunk_own`: through :class:`_ChunkOwn` where ``wants_written_backward``, except under autocast, whose
    bf16 products the written-out backward (float32) would not mirror."""
    if wants_written_backward(k, v, log_i, log_f) and not torch.is_autocast_enabled(k.device.type):
        return _ChunkOwn.apply(k, v, log_i, log_f)
    return _chunk_own(k, v, log_i, log_f)


def _chunk_starts(C_loc, n_loc, m_loc, b_last, rows: int, keep=None) -> MLSTMState:
    """The states (C, n, m) before chunks 0..rows-1 (row N: after the last chunk) in closed form, from each column's
    contribution: C_loc ``[B, H, columns, D, D]`` and n_loc ``[B, H, columns, D]`` scaled by exp(-m_loc), m_loc
    ``[B, H, columns]``: the N chunks' own, after the state before chunk 0 where one is given (columns N + 1; N: the
    empty state); b_last ``[B, H, N]``, the chunks' total log decays. Returns ``[B, H, rows, D, D]``,
    ``[B, H, rows, D]``, ``[B, H, rows]``. ``keep``: a dict that receives what :class:`_ChunkStarts`'s backward reads.

    The state before chunk k sums chunk j < k's contribution with log weight ``b_last[j+1..k-1].sum() + m_loc[j]``
    and the given state's with ``b_last[0..k-1].sum() + m``: one ``[rows, columns]`` weight matrix per batch element
    and head, -inf where a column is not before the row, its row maximum the stabiliser (the carry recurrence's running
    maximum, unrolled; ``max`` with its indices, as the written backward routes its gradient), applied to every
    column's (C, n) as one product over the chunks. The segment sums are a cumulative sum down the rows of masked
    copies of b_last (Mamba-2's segsum), not differences of one running sum, which would lose float32 precision over
    many strongly decaying chunks. A row with no finite weight (before chunk 0 from the empty state) gets C = n = 0
    and the dtype's lowest m: weight exp(-inf - lowest) = 0, with no inf - inf.
    """
    N, columns = b_last.shape[-1], m_loc.shape[-1]
    first = columns - N  # 1: the given state's column, before the chunks'
    # later[k, c]: column c is not before row k; later[k, c + 1]: b_last[k - 1] is not in column c's sum for row k
    later = torch.ones(rows, columns + 1, dtype=torch.bool, device=m_loc.device).triu(first)
    decay_rows = F.pad(b_last, (1, rows - 1 - N))  # [B, H, rows]  row k holds b_last[k - 1] (row 0: 0, never summed)
    decays = decay_rows.unsqueeze(-1).masked_fill(later[:, 1:], 0.0).cumsum(-2)  # [B, H, rows, columns]
    log_w = (decays + m_loc.unsqueeze(-2)).masked_fill_(later[:, :-1], float("-inf"))
    m_top, top = log_w.max(-1)  # [B, H, rows]
    m = m_top.clamp(min=torch.finfo(log_w.dtype).min)
    w = torch.exp(log_w - m.unsqueeze(-1))  # 0 where -inf
    if keep is not None:
        keep.update(later=later, top=top, m=m, w=w)
    C = (w @ C_loc.flatten(-2)).unflatten(-1, C_loc.shape[-2:])
    return C, w @ n_loc, m


class _ChunkStarts(torch.autograd.Function):
    """:func:`_chunk_starts` with its backward written out (the chain rule through every line of its forward): the
    maximum's gradient scattered to its index and the masks applied once, where autograd's graph passes over the
    weights for each mask, the clamp and the maximum, and sums each broadcast. Held to autograd of
    :func:`_chunk_starts` in float64; a given state's column is joined before it (its gradient: the join's)."""

    @staticmethod
    def forward(ctx, C_loc, n_loc, m_loc, b_last, rows):
        kept = {}
        C, n, m = _chunk_starts(C_loc, n_loc, m_loc, b_last, rows, keep=kept)
        ctx.save_for_backward(C_loc, n_loc, *(kept[name] for name in ("later", "top", "m", "w")))
        ctx.N = b_last.shape[-1]
        return C, n, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_C, g_n, g_m):
        C_loc, n_loc, later, top, m, w = ctx.saved_tensors
        rows, N = w.shape[-2], ctx.N
        # C = w C_loc, n = w n_loc: products over the columns
        g_C = g_C.flatten(-2)
        C_flat = C_loc.flatten(-2)
        g_w = torch.baddbmm((g_n @ n_loc.transpose(-1, -2)).flatten(0, -3), g_C.flatten(0, -3),
                            C_flat.transpose(-1, -2).flatten(0, -3)).view(w.shape)
        w_t = w.transpose(-1, -2)
        g_C_loc = (w_t @ g_C).view(C_loc.shape)
        g_n_loc = w_t @ g_n
        # w = exp(log_w - m); m = clamp(log_w[top]): no gradient where a row has no finite weight
        g_log_w = g_w.mul_(w)
        g_top = (g_m - g_log_w.sum(-1)).masked_fill_(m == torch.finfo(m.dtype).min, 0.0)
        g_log_w.scatter_add_(-1, top.unsqueeze(-1), g_top.unsqueeze(-1))
        # log_w = decays + m_loc where the column is before the row (masked entries: w = 0, no maximum)
        g_m_loc = g_log_w.sum(-2)
        # decays = cumsum down the rows of b_last[k - 1] where it is in the column's sum
        g_sums = cumsum_backward(g_log_w, -2).masked_fill_(later[:, 1:], 0.0)
        g_b_last = F.pad(g_sums.sum(-1), (-1, N + 1 - rows))  # row k held b_last[k - 1]
        return g_C_loc, g_n_loc, g_m_loc, g_b_last, None


def _starts_of_chunks(C_loc, n_loc, m_loc, b_last, state, rows: int) -> MLSTMState:
    """:func:`_chunk_starts` of the chunks' own contributions (``[B, H, N, ...]``) and ``state`` (None: the empty
    state, whose column is left out): through :class:`_ChunkStarts` where ``wants_written_backward``, except under
    autocast, whose bf16 products the written-out backward (float32) would not mirror."""
    if state is not None:
        C_loc, n_loc, m_loc = (torch.cat([s.unsqueeze(2), x], dim=2) for s, x in zip(state, (C_loc, n_loc, m_loc)))
    inputs = (C_loc, n_loc, m_loc, b_last, rows)
    if wants_written_backward(*inputs) and not torch.is_autocast_enabled(C_loc.device.type):
        return _ChunkStarts.apply(*inputs)
    return _chunk_starts(*inputs)


def mlstm_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: MLSTMState | None = None,
    *,
    chunk_size: int = 64,
    forget_gate: str = "sigmoid",
    eps: float = EPS,
    with_state: bool = True,
    mask: Tensor | None = None,
) -> tuple[Tensor, MLSTMState | None]:
    """Chunkwise mLSTM: O(T L) memory for chunk length L; any T (the last chunk may be short).

    1. every full chunk's own contribution to the state is computed at once (all chunks in parallel,
       :func:`_chunk_own`);
    2. every chunk's starting state at once, in closed form over the chunks (:func:`_chunk_starts`);
    3. all full chunks' outputs are computed at once from their starting states;
    4. a trailing partial chunk is one more parallel block.
    A sequence of at most one chunk is one parallel block (:func:`mlstm_parallel`'s form).
    Shapes, ``with_state`` and ``mask`` as :func:`mlstm_parallel`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    if q.shape[-2] <= chunk_size:  # one block: the parallel form, without the carry and the chunk-state detour
        return mlstm_parallel(q, k, v, i_pre, f_pre, state, forget_gate=forget_gate, eps=eps, with_state=with_state,
                              mask=mask)
    out_dtype = q.dtype
    q, k, v, log_i, log_f, state = _prepare(q, k, v, i_pre, f_pre, state, forget_gate, mask)
    B, H, T, D = q.shape
    L = chunk_size
    N = T // L  # at least 1

    def chunks(x: Tensor) -> Tensor:  # [B, H, T, ...] -> [B, H, N, L, ...]
        # no slice where the chunks cover T: a slice's backward zero-fills a tensor of x's size and copies into it
        return (x if N * L == T else x[:, :, : N * L]).reshape(B, H, N, L, *x.shape[3:])

    qc, kc, vc, ic, fc = map(chunks, (q, k, v, log_i, log_f))
    C_loc, n_loc, m_loc, b_last = _chunk_own_states(kc, vc, ic, fc)  # [B, H, N, D, D], [B, H, N, D], [B, H, N] x2

    # the state before each full chunk, and after the last one where the returned state or a trailing chunk wants it
    rows = N + 1 if with_state or T > N * L else N
    C0, n0, m0 = _starts_of_chunks(C_loc, n_loc, m_loc, b_last, state, rows)
    if rows > N:
        (C0, C), (n0, n), (m0, m) = (x.split([N, 1], dim=2) for x in (C0, n0, m0))
        C0, C, n, m = C0.contiguous(), C.squeeze(2), n.squeeze(2), m.squeeze(2)
    h = _chunk_outputs(qc, kc, vc, ic, fc, C0, n0, m0, eps)  # [B, H, N, L, D]
    h = h.reshape(B, H, N * L, D)
    if T > N * L:
        s = N * L
        tail_inputs = (k[:, :, s:], v[:, :, s:], log_i[:, :, s:], log_f[:, :, s:], C, n, m)
        tail = _chunk_outputs(q[:, :, s:], *tail_inputs, eps)
        final = _kept_where_unseen(_chunk_state(*tail_inputs), state, q, mask) if with_state else None
        return torch.cat([h, tail], dim=2).to(out_dtype), final
    return h.to(out_dtype), _kept_where_unseen((C, n, m), state, q, mask) if with_state else None


def mlstm_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: MLSTMState | None = None,
    *,
    forget_gate: str = "sigmoid",
    eps: float = EPS,
    mask: Tensor | None = None,
) -> tuple[Tensor, MLSTMState]:
    """One recurrent step. q, k, v ``[B, H, D]``; i_pre, f_pre ``[B, H]``; mask ``[B]`` or None (False: the row's
    state stays as it was, its h meaningless). Returns h ``[B, H, D]``, state."""
    out_dtype = q.dtype
    B, H, D = q.shape
    cdt = state_dtype(q.dtype)
    q, k, v = q.to(cdt), k.to(cdt) * (1.0 / math.sqrt(D)), v.to(cdt)
    i_pre = i_pre.to(cdt)
    log_f = log_forget_gate(f_pre.to(cdt), forget_gate)
    if state is None:
        state = mlstm_init_state(B, H, D, device=q.device, dtype=cdt)
    C, n, m = (s.to(cdt) for s in state)
    m_new = torch.maximum(log_f + m, i_pre)
    fp = torch.exp(log_f + m - m_new)  # [B, H]
    ip = torch.exp(i_pre - m_new)
    # C' = f' C + (i' k) v^T in two passes over the [D, D] matrices (a new one, then an update of it in place),
    # where the four of f' C + i' (k v^T) dominated a decode step
    ik = ip.unsqueeze(-1) * k
    C = (C * fp[..., None, None]).addcmul_(ik.unsqueeze(-1), v.unsqueeze(-2))
    n = torch.addcmul(ik, fp.unsqueeze(-1), n)
    num = (q.unsqueeze(-2) @ C).squeeze(-2)  # [B, H, D]
    den = (q * n).sum(-1)  # [B, H]
    h = _normalise(num, den, m_new, eps)
    if mask is not None:
        return h.to(out_dtype), _kept_where_unseen((C, n, m_new), state, q, mask[:, None])
    return h.to(out_dtype), (C, n, m_new)


def mlstm_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: MLSTMState | None = None,
    *,
    forget_gate: str = "sigmoid",
    eps: float = EPS,
) -> tuple[Tensor, MLSTMState]:
    """:func:`mlstm_step` looped over T (reference / benchmark only). Shapes as :func:`mlstm_parallel`."""
    hs = []
    for t in range(q.shape[2]):
        h, state = mlstm_step(
            q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], f_pre[:, :, t], state, forget_gate=forget_gate, eps=eps
        )
        hs.append(h)
    if state is None:
        B, H, _, D = q.shape
        state = mlstm_init_state(B, H, D, device=q.device, dtype=state_dtype(q.dtype))
    return torch.stack(hs, dim=2) if hs else q, state
