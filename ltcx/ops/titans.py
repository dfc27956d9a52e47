"""Titans' neural long-term memory (Behrouz, Zhong, Mirrokni 2025, arXiv 2501.00663, eq. 11-18) as pure
tensor functions: the token recurrence (decode step) and the chunkwise "dual" form used for training.

Notation: B batch, H memory heads, T time, dk head width, dm hidden width of the memory MLP, b chunk size.

The memory of one head is a residual two-layer MLP whose weights W = (W1 [dm, dk], W2 [dk, dm]) are the
state:

    M(x; W) = x + W2 GELU(W1 x)                        (GELU exact, erf)

It is written by gradient descent on l(W; k, v) = ||M(k; W) - v||^2 with momentum and forgetting, the
gradient taken at the weights W^s of the current chunk start (chunks at absolute positions 0, b, 2b, ...;
paper eq. 16-18 and App. C: "inter-chunk non-linear, intra-chunk linear"):

    u_t = grad l(W^s; k_t, v_t)          S = eta_t S - theta_t u_t          W = (1 - alpha_t) W + S
    y_t = M(q_t; W)                      (write-then-read: W includes token t)
    after token p (0-based) with (p + 1) % b == 0:  W^s = W

b = 1 is eq. 13-14 exactly (gradient at M_{t-1}); chunk_size None keeps every gradient at the initial
weights. The analytic gradient of the loss at W^s: z = W1 k, h = GELU(z), o = k + W2 h,

    delta2 = 2 (o - v),  delta1 = (W2^T delta2) * GELU'(z),   grad_W2 = delta2 h^T,  grad_W1 = delta1 k^T.

With the default step normalisation theta_t is divided by kappa_t = ||h||^2 + ||k||^2 ||delta1||^2 /
||delta2||^2, the curvature of the loss along the token's own error, so a step of theta shrinks that error
by about (1 - 2 theta) whatever the scale of h (spec section A.4; the paper leaves theta free).

Inside a chunk every gradient is a function of the chunk-start weights alone, so the weights at each
token are a linear combination of the base weights, the carried momentum and the chunk's gradients:

    W_t = A_t W^b + D_t S^b - sum_{i<=t} C[t, i] u_i,   C[t, i] = theta_i sum_{i<=j<=t} (A_t / A_j)(E_j / E_i)

(A, E cumulative products of 1 - alpha and eta; D_t = sum_j (A_t / A_j) E_j). ``neural_memory`` uses it
to compute a whole chunk with matmuls and never materialises per-token weights; the Python loop runs over
chunks only (T / b steps).
Its backward is written out by hand (``_MemoryChunk``), held to autograd of the same forward in float64.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .written_backward import wants_written_backward


class MemoryState(NamedTuple):
    """State of the memory of every sequence and head; all tensors batch-first.

    w1_start [B, H, dm, dk], w2_start [B, H, dk, dm]: the weights at the current chunk start (W^s, the
    point where gradients are taken). w1, w2: the current weights W. s1, s2: the momentum S, or None before the
    first token (M_0's zero momentum, which the first chunk then leaves out of every product and carry).
    """

    w1_start: Tensor
    w2_start: Tensor
    w1: Tensor
    w2: Tensor
    s1: Tensor | None
    s2: Tensor | None


def initial_memory_state(w1_init: Tensor, w2_init: Tensor, batch_size: int) -> MemoryState:
    """The learned initial weights M_0 (w1_init [H, dm, dk], w2_init [H, dk, dm]) expanded (not copied) over
    the batch, and zero momentum (None: no tensor, nothing of it computed)."""
    w1 = w1_init.unsqueeze(0).expand(batch_size, *w1_init.shape)
    w2 = w2_init.unsqueeze(0).expand(batch_size, *w2_init.shape)
    return MemoryState(w1, w2, w1, w2, None, None)


def memory_gates(gates: Tensor, heads: int, scale: float, coupled: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The per-token gates from their pre-activations: gates [B, T, 3H] (alpha, eta, theta blocks of H) ->
    (log_retain = log(1 - alpha_t) = logsigmoid(-alpha), log_momentum = log eta_t = logsigmoid(eta),
    step = scale sigmoid(theta) [sigmoid(-eta) if ``coupled``]), each [B, H, T].

    Under autograd it runs as ``_MemoryGates``: differentiated op by op the backward is a dozen small ops and a
    stack of the three gradients; written out, six ops writing into one gradient."""
    if wants_written_backward(gates):
        return _MemoryGates.apply(gates, heads, scale, coupled)
    return _gates_and_saved(gates, heads, scale, coupled)[:3]


def _gates_and_saved(gates: Tensor, heads: int, scale: float, coupled: bool):
    """``memory_gates``' forward op by op -> (log_retain, log_momentum, step, sigmoid(theta), sigmoid(-eta) or None)."""
    alpha, eta, theta = gates.unflatten(-1, (3, heads)).permute(2, 0, 3, 1)  # [B, H, T] views
    negated = -gates.unflatten(-1, (3, heads))[..., :2, :].permute(2, 0, 3, 1)  # -alpha, -eta in one op
    log_retain, log_momentum = F.logsigmoid(negated[0]), F.logsigmoid(eta)
    kept_theta = torch.sigmoid(theta)
    step = scale * kept_theta
    kept_eta = None
    if coupled:
        kept_eta = torch.sigmoid(negated[1])
        step = step * kept_eta
    return log_retain, log_momentum, step, kept_theta, kept_eta


class _MemoryGates(torch.autograd.Function):
    """``memory_gates`` with its backward written out. With g_r, g_m, g_s the gradients of the three outputs and
    t = g_s step: d alpha = -g_r sigmoid(alpha) = g_r expm1(log_retain), d theta = t (1 - sigmoid(theta)),
    d eta = g_m sigmoid(-eta) - t sigmoid(eta) = lerp(-t, g_m, sigmoid(-eta)) (coupled; else g_m sigmoid(-eta),
    sigmoid(-eta) = -expm1(log_momentum))."""

    @staticmethod
    def forward(ctx, gates: Tensor, heads: int, scale: float, coupled: bool):
        log_retain, log_momentum, step, kept_theta, kept_eta = _gates_and_saved(gates, heads, scale, coupled)
        ctx.save_for_backward(log_retain, log_momentum, step, kept_theta, kept_eta)
        return log_retain, log_momentum, step

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_retain: Tensor, grad_momentum: Tensor, grad_step: Tensor):
        log_retain, log_momentum, step, kept_theta, kept_eta = ctx.saved_tensors
        batch, heads, length = log_retain.shape
        grad = log_retain.new_empty(batch, length, 3, heads)
        d_alpha, d_eta, d_theta = grad.permute(2, 0, 3, 1)  # written in place: the gradient of gates [B, T, 3H]
        torch.mul(grad_retain, torch.expm1(log_retain), out=d_alpha)
        t = grad_step * step
        torch.addcmul(t, t, kept_theta, value=-1, out=d_theta)
        if kept_eta is None:
            torch.mul(grad_momentum, torch.expm1(log_momentum), out=d_eta).neg_()
        else:
            torch.lerp(t.neg_(), grad_momentum, kept_eta, out=d_eta)
        return grad.flatten(2), None, None, None


def _times_gelu_derivative(x: Tensor, z: Tensor) -> Tensor:
    """x * GELU'(z) = x (Phi(z) + z phi(z)) in one kernel (aten's ``gelu_backward``), where writing GELU' out took
    seven passes over z's size; GELU' itself is never materialised."""
    return torch.ops.aten.gelu_backward(x, z)


def memory_apply(w1: Tensor, w2: Tensor, x: Tensor) -> Tensor:
    """M(x) = x + W2 GELU(W1 x) per head: w1 [B, H, dm, dk], w2 [B, H, dk, dm], x [B, H, n, dk] -> [B, H, n, dk].

    Weights the same for every row (M_0) may come without the batch dim, w1 [H, dm, dk] and w2 [H, dk, dm]: then one
    product per head over all rows' tokens, where broadcasting them would copy them for each row (and sum each
    row's gradient back).
    """
    if w1.dim() == 3:
        batch, heads, n, dk = x.shape
        rows = x.transpose(0, 1).reshape(heads, batch * n, dk)
        y = rows + F.gelu(rows @ w1.transpose(-1, -2)) @ w2.transpose(-1, -2)
        return y.view(heads, batch, n, dk).transpose(0, 1)
    return x + F.gelu(x @ w1.transpose(-1, -2)) @ w2.transpose(-1, -2)


def memory_loss_gradients(w1: Tensor, w2: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token pieces of the gradient of ||M(k) - v||^2 at (w1, w2).

    k, v [B, H, n, dk] -> (h [B, H, n, dm], delta1 [B, H, n, dm], delta2 [B, H, n, dk]) with
    grad_W1 = delta1 k^T and grad_W2 = delta2 h^T for each token.
    """
    z = k @ w1.transpose(-1, -2)
    h = F.gelu(z)
    delta2 = 2.0 * (k + h @ w2.transpose(-1, -2) - v)
    delta1 = _times_gelu_derivative(delta2 @ w2, z)
    return h, delta1, delta2


def step_curvature(k: Tensor, h: Tensor, delta1: Tensor, delta2: Tensor) -> Tensor:
    """kappa [B, H, n] = ||h||^2 + ||k||^2 ||delta1||^2 / (||delta2||^2 + 1e-6): the Rayleigh quotient of the
    Gauss-Newton curvature of the token's loss along its own error (the 1e-6 guards a perfect fit)."""
    k2, h2 = k.square().sum(-1), h.square().sum(-1)
    return h2 + k2 * delta1.square().sum(-1) / (delta2.square().sum(-1) + 1e-6)


def _segment_sums(x: Tensor) -> Tensor:
    """x [..., n] -> [..., n, n] with [t, j] = sum_{l=j+1..t} x_l for j <= t and -inf above the diagonal.

    Built by a masked cumulative sum (not as a difference of cumulative sums) so each entry is summed
    only over its own span: exp() of it is then exactly a ratio of cumulative products, never 0/0.
    """
    n = x.shape[-1]
    spans = x.unsqueeze(-1).expand(*x.shape, n)  # [..., l, j] = x_l
    below = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    sums = spans.masked_fill(~below, 0.0).cumsum(dim=-2)
    return sums.masked_fill(~below.logical_or(torch.eye(n, dtype=torch.bool, device=x.device)), float("-inf"))


def _step_sizes(step: Tensor, k: Tensor, h: Tensor, delta1: Tensor, delta2: Tensor, normalize: bool) -> Tensor:
    return step / step_curvature(k, h, delta1, delta2) if normalize else step


class _Piece(NamedTuple):
    """What a piece of n tokens needs that no memory state changes (computed for all pieces of a size at once);
    batch and heads flattened into one leading dim [BH].

    decay [BH, n, n]: C[t, i] / theta_i = sum_{i<=j<=t} (A_t / A_j)(E_j / E_i); qk [BH, n, n] = q k^T;
    a_q, d_q [BH, n, dk] = A_t q_t, D_t q_t; a, d [BH, n, 1] = A_t, D_t; momentum_last [BH, n] = E_n / E_i;
    ends [BH, 3, 1, 1] = (A_n, D_n, E_n), the carry of (W, S) through the piece.
    """

    decay: Tensor
    qk: Tensor
    a_q: Tensor
    d_q: Tensor
    a: Tensor
    d: Tensor
    momentum_last: Tensor
    ends: Tensor


def _pieces(q: Tensor, k: Tensor, log_retain: Tensor, log_momentum: Tensor, sizes: list[int]) -> list[_Piece]:
    """The state-free part of every piece (q, k [BH, T, dk], gates [BH, T]): pieces of one size batched as
    [BH, N, n, ...], then unbound."""
    runs = [(n, len(list(group))) for n, group in itertools.groupby(sizes)]
    spans = [n * count for n, count in runs]
    pieces: list[_Piece] = []
    for (n, count), q_r, k_r, retain_r, momentum_r in zip(
        runs, q.split(spans, dim=1), k.split(spans, dim=1), log_retain.split(spans, dim=-1),
        log_momentum.split(spans, dim=-1),
    ):
        q_r, k_r = q_r.unflatten(1, (count, n)), k_r.unflatten(1, (count, n))  # [BH, N, n, dk]
        retain_r, momentum_r = retain_r.unflatten(-1, (count, n)), momentum_r.unflatten(-1, (count, n))
        retain = torch.exp(retain_r.cumsum(-1))  # A_t
        momentum = torch.exp(momentum_r.cumsum(-1))  # E_t
        retain_ratio = torch.exp(_segment_sums(retain_r))  # [t, j] = A_t / A_j
        momentum_ratio = torch.exp(_segment_sums(momentum_r))  # [j, i] = E_j / E_i
        carried = (retain_ratio @ momentum.unsqueeze(-1)).squeeze(-1)  # D_t: weight of the incoming momentum
        a, d = retain.unsqueeze(-1), carried.unsqueeze(-1)
        ends = torch.stack([retain[..., -1], carried[..., -1], momentum[..., -1]], dim=-1)[..., None, None]
        fields = (retain_ratio @ momentum_ratio, q_r @ k_r.transpose(-1, -2), a * q_r, d * q_r, a, d,
                  momentum_ratio[..., -1, :], ends)
        pieces += [_Piece(*piece) for piece in zip(*(x.unbind(1) for x in fields))]
    return pieces


def _chunk_forward(
    q: Tensor, k: Tensor, kv2: Tensor, k2: Tensor, step: Tensor, piece: _Piece, w1s_t: Tensor | None,
    w2s_t: Tensor | None, weights: tuple[Tensor, Tensor, Tensor, Tensor], normalize: bool, with_state: bool = True,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor] | None, dict[str, Tensor]]:
    """n tokens of one chunk (all gradients at the chunk start) in closed form -> (y [BH, n, dk], weights after it,
    the intermediates ``_MemoryChunk.backward`` reads). ``with_state`` False leaves the weights after it out (None):
    a call's last chunk whose state the caller discards (a training loss): four products and the weight-size passes.

    Batch and heads are one leading dim [BH], so every product is one ``bmm``/``baddbmm``. The weights are carried
    transposed, weights = (W1^T, S1^T [BH, dk, dm], W2^T, S2^T [BH, dm, dk]), so that every product reads them as
    its right operand; w1s_t = W1^T and w2s_t = W2^T at the chunk start, None where the start is the current
    weights (a chunk boundary); kv2 = 2 (k - v), k2 = ||k||^2. S1^T = S2^T = None is zero momentum (M_0's): its
    terms are left out.
    """
    w1_t, s1_t, w2_t, s2_t = weights
    momentum = s1_t is not None
    if w1s_t is None:
        w1s_t, w2s_t = w1_t, w2_t
    z = torch.bmm(k, w1s_t)
    h = F.gelu(z)
    delta2 = torch.baddbmm(kv2, h, w2s_t, alpha=2.0)  # 2 (M(k) - v)
    back = torch.bmm(delta2, w2s_t.transpose(-1, -2))  # W2^T delta2
    delta1 = _times_gelu_derivative(back, z)
    saved = dict(z=z, h=h, delta2=delta2, back=back, delta1=delta1)
    if normalize:  # theta / kappa, kappa as step_curvature with ||k||^2 computed once for all chunks
        error2 = delta2.square().sum(-1) + 1e-6
        hidden2, delta1_2 = h.square().sum(-1), delta1.square().sum(-1)
        kappa = hidden2 + k2 * delta1_2 / error2
        theta = step / kappa
        saved.update(error2=error2, delta1_2=delta1_2, kappa=kappa)
    else:
        theta = step
    coeff = piece.decay * theta.unsqueeze(-2)  # C [BH, n, n], lower-triangular

    # y_t = M(q_t; W_t) without forming W_t: W1_t q_t and W2_t GELU(W1_t q_t) expanded by the closed form. Each
    # further term accumulates in place (baddbmm_) into a product nothing saved for the backward reads, where an
    # out-of-place baddbmm would first copy it.
    write = coeff * piece.qk
    pre = torch.bmm(piece.a_q, w1_t)
    if momentum:
        pre.baddbmm_(piece.d_q, s1_t)
    pre.baddbmm_(write, delta1, alpha=-1.0)
    hidden = F.gelu(pre)
    hh = torch.bmm(hidden, h.transpose(-1, -2))
    read = coeff * hh
    y = torch.baddbmm(q, piece.a * hidden, w2_t)
    if momentum:
        y.baddbmm_(piece.d * hidden, s2_t)
    y.baddbmm_(read, delta2, alpha=-1.0)

    # State after the chunk's last token: rank-n corrections of the carried weights and momentum, accumulated in
    # place into A_n W + D_n S and E_n S.
    last_coeff = coeff[..., -1, :].unsqueeze(-1)  # C[n, i]
    last_momentum = (theta * piece.momentum_last).unsqueeze(-1)  # theta_i E_n / E_i
    saved.update(theta=theta, coeff=coeff, write=write, pre=pre, hidden=hidden, hh=hh, read=read,
                 last_coeff=last_coeff, last_momentum=last_momentum)
    if not with_state:
        return y, None, saved
    a_n, d_n, e_n = piece.ends.unbind(1)  # [BH, 1, 1] each
    if momentum:
        new_w1, new_w2 = (s1_t * d_n).addcmul_(a_n, w1_t), (s2_t * d_n).addcmul_(a_n, w2_t)
        new_s1 = (s1_t * e_n).baddbmm_((k * last_momentum).transpose(-1, -2), delta1, alpha=-1.0)
        new_s2 = (s2_t * e_n).baddbmm_((h * last_momentum).transpose(-1, -2), delta2, alpha=-1.0)
    else:  # zero momentum: A_n W, and S the chunk's own gradients alone
        new_w1, new_w2 = w1_t * a_n, w2_t * a_n
        new_s1 = torch.bmm((k * -last_momentum).transpose(-1, -2), delta1)
        new_s2 = torch.bmm((h * -last_momentum).transpose(-1, -2), delta2)
    new_w1.baddbmm_((k * last_coeff).transpose(-1, -2), delta1, alpha=-1.0)
    new_w2.baddbmm_((h * last_coeff).transpose(-1, -2), delta2, alpha=-1.0)
    return y, (new_w1, new_s1, new_w2, new_s2), saved


def _memory_chunk_autograd(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``_chunk_forward`` differentiated by autograd, the same argument order as ``_MemoryChunk.apply``: the oracle
    of the hand-written backward (and what ``torch.compile`` traces)."""
    q, k, kv2, k2, step, *fields, w1s_t, w2s_t, w1_t, s1_t, w2_t, s2_t, normalize, with_state = args
    y, weights, _ = _chunk_forward(q, k, kv2, k2, step, _Piece(*fields), w1s_t, w2s_t, (w1_t, s1_t, w2_t, s2_t),
                                   normalize, with_state)
    return (y, *(weights or (None,) * 4))


_SAVED = ("z", "h", "delta2", "back", "delta1", "theta", "coeff", "write", "pre", "hidden", "hh", "read",
          "last_coeff", "last_momentum")
_SAVED_NORMALIZED = ("error2", "delta1_2", "kappa")


class _MemoryChunk(torch.autograd.Function):
    """``_chunk_forward`` with its backward written out (the chain rule through every line above, each product's
    gradient one ``bmm``): autograd's graph of the chunk runs some 90 nodes, most of them small elementwise
    kernels and broadcast reductions. Inputs: q, k, kv2, k2, step, the eight ``_Piece`` fields, w1s_t, w2s_t,
    W1^T, S1^T, W2^T, S2^T, normalize, with_state; outputs y and the four carried weights after the chunk (None
    without the state)."""

    @staticmethod
    def forward(ctx, q, k, kv2, k2, step, *rest):
        *fields, w1s_t, w2s_t, w1_t, s1_t, w2_t, s2_t, normalize, with_state = rest
        piece = _Piece(*fields)
        y, weights, saved = _chunk_forward(q, k, kv2, k2, step, piece, w1s_t, w2s_t, (w1_t, s1_t, w2_t, s2_t),
                                           normalize, with_state)
        names = _SAVED + (_SAVED_NORMALIZED if normalize else ())
        ctx.normalize, ctx.start_is_current = normalize, w1s_t is None
        ctx.set_materialize_grads(False)  # an output nothing reads gets None: its terms are skipped, not zero-filled
        starts = (w1_t, w2_t) if w1s_t is None else (w1s_t, w2s_t)
        ctx.save_for_backward(k, k2, step, *fields, *starts, w1_t, s1_t, w2_t, s2_t, *(saved[n] for n in names))
        return (y, *(weights or (None,) * 4))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_y, g_w1, g_s1, g_w2, g_s2):
        k, k2, step, *rest = ctx.saved_tensors
        piece, rest = _Piece(*rest[:8]), rest[8:]
        w1s_t, w2s_t, w1_t, s1_t, w2_t, s2_t = rest[:6]
        names = _SAVED + (_SAVED_NORMALIZED if ctx.normalize else ())
        x = dict(zip(names, rest[6:]))
        delta1, delta2, h, hidden, coeff = x["delta1"], x["delta2"], x["h"], x["hidden"], x["coeff"]
        a_n, d_n, e_n = piece.ends.unbind(1)
        mt = lambda t: t.transpose(-1, -2)  # noqa: E731
        if g_y is None:  # the read unused (a state-only objective)
            g_y = torch.zeros_like(k)

        def dot(u: Tensor, v: Tensor) -> Tensor:  # <u, v> per batch row, [BH, 1, 1]
            return (u * v).sum((-1, -2), keepdim=True)

        # the carried state: new_w = d_n S + a_n W - X^T delta, new_s = e_n S - Y^T delta. A training step's last
        # chunk has no gradient on it (set_materialize_grads(False): None, not zeros): its terms are left out.
        momentum = s1_t is not None  # else zero momentum: nothing depends on D_n, E_n, D_t q or D_t
        needs_s1, _, needs_s2 = ctx.needs_input_grad[-5:-2]  # S1^T, W2^T, S2^T (then normalize, with_state)
        wants_s = needs_s1 or needs_s2  # not for a momentum without a gradient (or none)
        last_coeff, last_momentum = x["last_coeff"], x["last_momentum"]  # [BH, n, 1]
        carried = (g_w1, g_s1, g_w2, g_s2)
        if all(g is None for g in carried):
            g_ends = g_momentum_last = g_last_coeff = None
            gw1_t = gw2_t = gs1_t = gs2_t = g_delta1 = g_delta2 = g_k = g_h = g_last_momentum = None
        else:  # a state gradient missing beside the others (only the weights read on) is zero
            g_w1, g_s1, g_w2, g_s2 = (torch.zeros_like(w) if g is None else g
                                      for g, w in zip(carried, (w1_t, w1_t, w2_t, w2_t)))
            g_retained = dot(g_w1, w1_t) + dot(g_w2, w2_t)
            if momentum:
                g_ends = torch.stack([g_retained, dot(g_w1, s1_t) + dot(g_w2, s2_t),
                                      dot(g_s1, s1_t) + dot(g_s2, s2_t)], dim=1)
            else:
                zero = torch.zeros_like(g_retained)
                g_ends = torch.stack([g_retained, zero, zero], dim=1)
            gw1_t, gw2_t = g_w1 * a_n, g_w2 * a_n
            if wants_s:
                gs1_t, gs2_t = (g_w1 * d_n).addcmul_(g_s1, e_n), (g_w2 * d_n).addcmul_(g_s2, e_n)
            else:
                gs1_t = gs2_t = None
            g_xk, g_yk = -torch.bmm(delta1, mt(g_w1)), -torch.bmm(delta1, mt(g_s1))  # d/d(k c), d/d(k m) [BH, n, dk]
            g_xh, g_yh = -torch.bmm(delta2, mt(g_w2)), -torch.bmm(delta2, mt(g_s2))  # d/d(h c), d/d(h m) [BH, n, dm]
            g_delta1 = torch.bmm(k * last_coeff, g_w1).add_(torch.bmm(k * last_momentum, g_s1)).neg_()
            g_delta2 = torch.bmm(h * last_coeff, g_w2).add_(torch.bmm(h * last_momentum, g_s2)).neg_()
            g_k = g_xk * last_coeff + g_yk * last_momentum
            g_h = g_xh * last_coeff + g_yh * last_momentum
            g_last_coeff = (g_xk * k).sum(-1) + (g_xh * h).sum(-1)  # [BH, n]
            g_last_momentum = (g_yk * k).sum(-1) + (g_yh * h).sum(-1)

        # the read y = q + (A hidden) W2^T + (D hidden) S2^T - (C * hidden h^T) delta2
        g_ah = torch.bmm(g_y, mt(w2_t))
        g_dh = torch.bmm(g_y, mt(s2_t)) if momentum else None
        gw2_t = _add_product(gw2_t, mt(piece.a * hidden), g_y)
        if wants_s:
            gs2_t = _add_product(gs2_t, mt(piece.d * hidden), g_y)
        g_read = -torch.bmm(g_y, mt(delta2))  # [BH, n, n]
        g_delta2 = _add_product(g_delta2, mt(x["read"]), g_y, alpha=-1.0)
        g_hh = g_read * coeff
        g_coeff = g_read * x["hh"]
        g_hidden = g_ah * piece.a
        if momentum:
            g_hidden.add_(g_dh * piece.d)
        g_hidden.baddbmm_(g_hh, h)
        g_h = _add_product(g_h, mt(g_hh), hidden)
        g_a = (g_ah * hidden).sum(-1, keepdim=True)
        g_d = (g_dh * hidden).sum(-1, keepdim=True) if momentum else None
        g_pre = _times_gelu_derivative(g_hidden, x["pre"])
        g_a_q = torch.bmm(g_pre, mt(w1_t))
        g_d_q = torch.bmm(g_pre, mt(s1_t)) if momentum else None
        gw1_t = _add_product(gw1_t, mt(piece.a_q), g_pre)
        if wants_s:
            gs1_t = _add_product(gs1_t, mt(piece.d_q), g_pre)
        g_write = -torch.bmm(g_pre, mt(delta1))
        g_delta1 = _add_product(g_delta1, mt(x["write"]), g_pre, alpha=-1.0)
        g_coeff.addcmul_(g_write, piece.qk)
        g_qk = g_write * coeff
        if g_last_coeff is not None:
            g_coeff[..., -1, :] += g_last_coeff

        # coeff = decay * theta_i; last_momentum = theta * E_n / E_i
        theta = x["theta"]
        g_decay = g_coeff * theta.unsqueeze(-2)
        g_theta = (g_coeff * piece.decay).sum(-2)
        if g_last_momentum is not None:
            g_theta.addcmul_(g_last_momentum, piece.momentum_last)
            g_momentum_last = g_last_momentum * theta
        if ctx.normalize:  # theta = step / kappa, kappa = ||h||^2 + k2 ||delta1||^2 / error2
            kappa, error2, delta1_2 = x["kappa"], x["error2"], x["delta1_2"]
            g_step = g_theta / kappa
            g_kappa = -g_theta * theta / kappa
            g_k2 = g_kappa * delta1_2 / error2
            g_h.add_(h * (2.0 * g_kappa).unsqueeze(-1))
            g_delta1.add_(delta1 * (2.0 * g_kappa * k2 / error2).unsqueeze(-1))
            g_delta2.add_(delta2 * (-2.0 * g_kappa * k2 * delta1_2 / error2.square()).unsqueeze(-1))
        else:
            g_step, g_k2 = g_theta, None

        # the gradient at the chunk start: delta1 = (delta2 W2) * GELU'(z), delta2 = kv2 + 2 h W2^T, h = GELU(z)
        z = x["z"]
        g_back = _times_gelu_derivative(g_delta1, z)
        gelu_second = torch.exp(z.square() * -0.5).mul_(1.0 / math.sqrt(2.0 * math.pi)).mul_(2.0 - z.square())
        g_z = g_delta1 * x["back"] * gelu_second  # through GELU'(z)
        # where the start is the current weights, its gradients accumulate into theirs (no separate tensor to add)
        g_delta2.baddbmm_(g_back, w2s_t)
        gw2s_t = gw2_t.baddbmm_(mt(g_back), delta2) if ctx.start_is_current else torch.bmm(mt(g_back), delta2)
        g_kv2 = g_delta2
        g_h.baddbmm_(g_delta2, mt(w2s_t), alpha=2.0)
        gw2s_t.baddbmm_(mt(h), g_delta2, alpha=2.0)
        g_z.add_(_times_gelu_derivative(g_h, z))
        g_k = _add_product(g_k, g_z, mt(w1s_t))
        gw1s_t = gw1_t.baddbmm_(mt(k), g_z) if ctx.start_is_current else torch.bmm(mt(k), g_z)
        g_starts = (None, None) if ctx.start_is_current else (gw1s_t, gw2s_t)
        g_fields = (g_decay, g_qk, g_a_q, g_d_q, g_a, g_d, g_momentum_last, g_ends)
        return (g_y, g_k, g_kv2, g_k2, g_step, *g_fields, *g_starts, gw1_t, gs1_t, gw2_t, gs2_t, None, None)


def _add_product(total: Tensor | None, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """total + alpha a @ b (batched), in place into total; the product alone where total is None (no term yet)."""
    if total is None:
        product = torch.bmm(a, b)
        return product if alpha == 1.0 else product.mul_(alpha)
    return total.baddbmm_(a, b, alpha=alpha)


def _memory_chunk(
    q: Tensor, k: Tensor, kv2: Tensor, k2: Tensor, step: Tensor, piece: _Piece, w1s_t: Tensor, w2s_t: Tensor,
    weights: tuple[Tensor, Tensor, Tensor, Tensor], normalize: bool, with_state: bool = True,
) -> tuple[Tensor, tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]]:
    """One chunk (``_chunk_forward``) with the hand-written backward where one is wanted
    (``wants_written_backward``): (y [BH, n, dk], weights after it: four Nones without ``with_state``)."""
    # the start is the current weights (a boundary): passed once, as None; the caller keeps the tensors, since a
    # call that ends mid-chunk returns the start it began with
    if w1s_t is weights[0] and w2s_t is weights[2]:
        w1s_t = w2s_t = None
    args = (q, k, kv2, k2, step, *piece, w1s_t, w2s_t, *weights, normalize, with_state)
    y, *weights = (_MemoryChunk.apply if wants_written_backward(*args) else _memory_chunk_autograd)(*args)
    return y, tuple(weights)


def neural_memory(
    q: Tensor, k: Tensor, v: Tensor, log_retain: Tensor, log_momentum: Tensor, step: Tensor,
    state: MemoryState, position: int, chunk_size: int | None, normalize_step: bool = True, with_state: bool = True,
) -> tuple[Tensor, MemoryState | None]:
    """Write every token into the memory and read it back (write-then-read), chunk by chunk in closed form.

    q, k, v [B, H, T, dk] (queries, keys, values per head); log_retain = log(1 - alpha_t) [B, H, T];
    log_momentum = log eta_t [B, H, T]; step [B, H, T] = theta_t before the curvature normalisation;
    state: the memory after ``position`` tokens; chunk_size: b, or None for a gradient point that never moves.
    Returns y [B, H, T, dk] with y_t = M(q_t; W_t), and the state after the T tokens (None with ``with_state``
    False: the last chunk's carry is not computed, for a caller that discards it).

    Chunks are at absolute positions, so a call that starts mid-chunk first finishes that chunk: the result
    does not depend on how a sequence is split into calls. What no state changes (the decay matrices, q k^T,
    the query scalings, 2 (k - v), ||k||^2) is computed for all chunks at once before the loop.
    """
    w1_start, w2_start, w1, w2, s1, s2 = state
    batch, heads, length, _ = q.shape
    if length == 0:
        return q.new_zeros(q.shape), state if with_state else None
    sizes = chunk_sizes(position, length, chunk_size)
    q, k, v, log_retain, log_momentum, step = (x.flatten(0, 1) for x in (q, k, v, log_retain, log_momentum, step))
    # contiguous: the in-place products of _memory_chunk would loop over the batch on a transposed layout
    weights = tuple(None if x is None else x.transpose(-1, -2).flatten(0, 1).contiguous() for x in (w1, s1, w2, s2))
    if w1_start is w1 and w2_start is w2:  # at a chunk boundary (or M_0): the same tensors, no second copy
        w1s_t, w2s_t = weights[0], weights[2]
    else:
        w1s_t, w2s_t = (x.transpose(-1, -2).flatten(0, 1) for x in (w1_start, w2_start))
    pieces = _pieces(q, k, log_retain, log_momentum, sizes)
    kv2, k2 = 2.0 * (k - v), k.square().sum(-1)
    # torch.split, not slicing in the loop: the backward of a split is one concatenation, where each
    # slice's backward would fill a zero tensor of the whole sequence (quadratic in the number of chunks).
    per_chunk = zip(*(x.split(sizes, dim=1) for x in (q, k, kv2)), *(x.split(sizes, dim=-1) for x in (k2, step)))
    outputs = []
    for index, (n, piece, (q_c, k_c, kv2_c, k2_c, step_c)) in enumerate(zip(sizes, pieces, per_chunk)):
        carry = with_state or index + 1 < len(sizes)  # the next chunk reads the weights after this one
        y, weights = _memory_chunk(q_c, k_c, kv2_c, k2_c, step_c, piece, w1s_t, w2s_t, weights, normalize_step, carry)
        outputs.append(y)
        position += n
        if chunk_size is not None and position % chunk_size == 0:
            w1s_t, w2s_t = weights[0], weights[2]

    y = torch.cat(outputs, dim=1).unflatten(0, (batch, heads))
    if not with_state:
        return y, None

    def unflat(x: Tensor) -> Tensor:  # [BH, r, c] -> [B, H, c, r]
        return x.unflatten(0, (batch, heads)).transpose(-1, -2)

    w1, s1, w2, s2 = (unflat(x) for x in weights)
    # the start is the current weights at a boundary: the same objects, as the recurrent form returns
    start = (w1, w2) if w1s_t is weights[0] else (unflat(w1s_t), unflat(w2s_t))
    return y, MemoryState(*start, w1, w2, s1, s2)


def chunk_sizes(position: int, length: int, chunk_size: int | None) -> list[int]:
    """Lengths of the pieces that ``length`` tokens starting at absolute ``position`` fall into when chunks
    start at multiples of ``chunk_size`` (None: one piece): e.g. (6, 10, 4) -> [2, 4, 4]."""
    if chunk_size is None:
        return [length]
    sizes, end = [], position + length
    while position < end:
        n = min(chunk_size - position % chunk_size, end - position)
        sizes.append(n)
        position += n
    return sizes


def neural_memory_recurrent(
    q: Tensor, k: Tensor, v: Tensor, log_retain: Tensor, log_momentum: Tensor, step: Tensor,
    state: MemoryState, position: int | Tensor, chunk_size: int | None, normalize_step: bool = True,
    with_state: bool = True, mask: Tensor | None = None,
) -> tuple[Tensor, MemoryState | None]:
    """The same function as :func:`neural_memory`, token by token with explicit weights (the decode step).

    With ``mask`` [B, T] (True = a real token), a padded batch: rows at positions of their own, position [B] each
    row's tokens before the call (its chunks start at its own multiples of b). A masked step neither writes nor
    decays the memory, nor adds the momentum (every part of the state, the chunk start included, stays as it was)
    and does not count as a position; its y reads the unchanged memory. The momentum then comes back as a tensor
    (zeros where it was None). For prompts and decoding: the training forms (one shared position) take no mask.
    """
    w1_start, w2_start, w1, w2, s1, s2 = state
    if mask is not None:  # a masked step keeps the momentum it had: one to keep
        s1 = torch.zeros_like(w1) if s1 is None else s1
        s2 = torch.zeros_like(w2) if s2 is None else s2
    outputs = []
    for t in range(q.shape[2]):
        q_t, k_t, v_t = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]  # [B, H, 1, dk]
        h, delta1, delta2 = memory_loss_gradients(w1_start, w2_start, k_t, v_t)
        theta = _step_sizes(step[..., t:t + 1], k_t, h, delta1, delta2, normalize_step).unsqueeze(-1)  # [B, H, 1, 1]
        retain, momentum = (x[..., t:t + 1].exp().unsqueeze(-1) for x in (log_retain, log_momentum))
        written_s1 = -theta * (delta1.transpose(-1, -2) @ k_t) + (0.0 if s1 is None else momentum * s1)
        written_s2 = -theta * (delta2.transpose(-1, -2) @ h) + (0.0 if s2 is None else momentum * s2)
        if mask is None:
            s1, s2 = written_s1, written_s2
            w1, w2 = retain * w1 + s1, retain * w2 + s2
            position += 1
            if chunk_size is not None and position % chunk_size == 0:
                w1_start, w2_start = w1, w2
        else:
            real = mask[:, t].view(-1, 1, 1, 1)
            s1, s2 = torch.where(real, written_s1, s1), torch.where(real, written_s2, s2)
            w1, w2 = torch.where(real, retain * w1 + s1, w1), torch.where(real, retain * w2 + s2, w2)
            position = position + mask[:, t].long()
            if chunk_size is not None:
                boundary = (real.flatten() & (position % chunk_size == 0)).view(-1, 1, 1, 1)
                w1_start, w2_start = torch.where(boundary, w1, w1_start), torch.where(boundary, w2, w2_start)
        outputs.append(memory_apply(w1, w2, q_t))
    y = torch.cat(outputs, dim=2) if outputs else q.new_zeros(q.shape)
    return y, MemoryState(w1_start, w2_start, w1, w2, s1, s2) if with_state else None
