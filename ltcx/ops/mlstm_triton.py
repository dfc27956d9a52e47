"""The mLSTM's parallel form from the empty state (:func:`ltcx.ops.mlstm.mlstm_parallel` with ``state=None``) as fused
Triton kernels (``mlstm_backend: triton``), flash-attention style: one launch forward, two backward, where the torch
forms launch some 140 kernels a layer.

With keys scaled by 1/sqrt(D), F = cumsum(log f) and, for j <= i, log D_ij = F_i - F_j + i~_j::

    m_i = max_j log D_ij,   P_ij = (q_i . k_j) exp(log D_ij - m_i),   s_i = sum_j P_ij,
    r_i = 1 / (max(|s_i|, exp(min(-m_i, 80))) + eps),   h_i = r_i sum_j P_ij v_j.

Forward: a program per (block of queries, batch row and head) runs over the key blocks up to the diagonal with a
running maximum (rescaling its sums as it rises) and writes h, m_i, s_i and the index j*_i of the row's maximum. The
[T, T] matrices never leave the chip.

Backward (P and r recomputed from the saved m_i, s_i; c_i = r_i sign(s_i) [|s_i| > floor_i] (dh_i . h_i))::

    dP_ij = r_i (dh_i . v_j) - c_i,   dS_ij = dP_ij exp(log D_ij - m_i),   dlogD_ij = dP_ij P_ij,
    dq_i = sum_j dS_ij k_j,   dk_j = sum_i dS_ij q_i,   dv_j = sum_i r_i P_ij dh_i.

The stabiliser does not cancel exactly (eps, the floor), and the torch forms differentiate through the maximum, so
m_i's gradient, dm_i = -sum_j dlogD_ij + (dh_i . h_i) r_i floor_i [floor_i >= |s_i|] [m_i >= -80], goes to
log D at (i, j*_i), as :class:`ltcx.ops.mlstm._ChunkOutputs` routes it. The query-block kernel runs first (dq, c_i,
dm_i and the row total of dlogD); the key-block kernel then gives dk, dv, the column totals (d i~_j) and dF_j = row
total - column total. The cumulative sum, the forget gate and the key scale stay in torch (autograd).

Runs on CUDA, or on a CPU under ``TRITON_INTERPRET=1`` set before anything imports triton (its library's reductions
are decorated at ``import triton``: ``tests/test_mlstm_triton.py`` runs its kernel tests in such a child). Computes in
float32 (float64 for float64 inputs; products in IEEE float32, not TF32). Under ``torch.compile`` the torch parallel
form runs (Dynamo traces it; Inductor fuses it).

Only the ``ltcx/ops/*_triton.py`` modules import Triton (``requirements-kernels.txt``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ltcx.errors import LtcxError
from ltcx.ops.mlstm import EPS, log_forget_gate, mlstm_parallel, state_dtype
from ltcx.ops.written_backward import wants_written_backward

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernels below run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""

IEEE: tl.constexpr = tl.constexpr("ieee")  # float32 products in float32, as torch's (not TF32)


@triton.jit
def _log_decay(F_rows, F_cols, I_cols, rows, cols, T):
    """log D [BLOCK, BLOCK] of these query rows and key columns, -inf above the diagonal and outside T."""
    real = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T) & (cols[None, :] < T)
    return tl.where(real, F_rows[:, None] - F_cols[None, :] + I_cols[None, :], float("-inf"))


@triton.jit
def _mlstm_forward_kernel(
    Q, K, V, LI, FC,  # q, k (scaled), v [B, H, T, D] strided; log i~, F [B, H, T] strided
    Hout, M, S, TOP,  # h [B, H, T, D] strided; m, s, j* [B H, T]
    T, H, D, eps,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    si_b, si_h, si_t, sf_b, sf_h, sf_t, so_b, so_h, so_t, so_d,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hh = (bh % H).to(tl.int64)
    rows = start + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    row_mask = rows < T
    d_mask = dd < D
    q = tl.load(Q + b * sq_b + hh * sq_h + rows[:, None] * sq_t + dd[None, :] * sq_d,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    F_rows = tl.load(FC + b * sf_b + hh * sf_h + rows * sf_t, mask=row_mask, other=0.0)
    dt = q.dtype
    m = tl.full((BLOCK,), float("-inf"), dt)
    s = tl.full((BLOCK,), 0.0, dt)
    top = tl.full((BLOCK,), 0, tl.int32)
    acc = tl.full((BLOCK, BLOCK_D), 0.0, dt)
    for key in range(0, tl.minimum(start + BLOCK, T), BLOCK):  # causal: no block above the diagonal
        cols = key + tl.arange(0, BLOCK)
        col_mask = cols < T
        tile = col_mask[:, None] & d_mask[None, :]
        k = tl.load(K + b * sk_b + hh * sk_h + cols[:, None] * sk_t + dd[None, :] * sk_d, mask=tile, other=0.0)
        v = tl.load(V + b * sv_b + hh * sv_h + cols[:, None] * sv_t + dd[None, :] * sv_d, mask=tile, other=0.0)
        I_cols = tl.load(LI + b * si_b + hh * si_h + cols * si_t, mask=col_mask, other=0.0)
        F_cols = tl.load(FC + b * sf_b + hh * sf_h + cols * sf_t, mask=col_mask, other=0.0)
        log_D = _log_decay(F_rows, F_cols, I_cols, rows, cols, T)
        block_max = tl.max(log_D, 1)
        # the first column holding the block's maximum; a later block takes over only where it is larger
        block_top = tl.min(tl.where(log_D == block_max[:, None], cols[None, :], 2147483647), 1)
        top = tl.where(block_max > m, block_top, top)
        # finite in every real row (it sees column 0 in the first block); rows past T get 0, not -inf - -inf
        m_new = tl.maximum(m, block_max)
        m_new = tl.where(row_mask, m_new, 0.0)
        alpha = tl.exp(m - m_new)
        P = tl.dot(q, tl.trans(k), input_precision=IEEE) * tl.exp(log_D - m_new[:, None])
        acc = tl.dot(P, v, acc=acc * alpha[:, None], input_precision=IEEE)
        s = s * alpha + tl.sum(P, 1)
        m = m_new
    floor = tl.exp(tl.minimum(-m, 80.0))  # ltcx.ops.mlstm._MAX_NEG_M
    r = 1.0 / (tl.maximum(tl.abs(s), floor) + eps)
    tl.store(Hout + b * so_b + hh * so_h + rows[:, None] * so_t + dd[None, :] * so_d, acc * r[:, None],
             mask=row_mask[:, None] & d_mask[None, :])
    tl.store(M + bh * T + rows, m, mask=row_mask)
    tl.store(S + bh * T + rows, s, mask=row_mask)
    tl.store(TOP + bh * T + rows, top, mask=row_mask)


@triton.jit
def _mlstm_backward_queries_kernel(
    Q, K, V, LI, FC, Hout, G, M, S,  # as the forward read and wrote them; G: dh [B, H, T, D] strided
    DQ, R, C, DM, ROW,  # dq [B, H, T, D] strided; r, c, dm, the row total of dlogD [B H, T]
    T, H, D, eps,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    si_b, si_h, si_t, sf_b, sf_h, sf_t, so_b, so_h, so_t, so_d, sg_b, sg_h, sg_t, sg_d,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hh = (bh % H).to(tl.int64)
    rows = start + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    row_mask = rows < T
    d_mask = dd < D
    tile_rows = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * sq_b + hh * sq_h + rows[:, None] * sq_t + dd[None, :] * sq_d, mask=tile_rows, other=0.0)
    h = tl.load(Hout + b * so_b + hh * so_h + rows[:, None] * so_t + dd[None, :] * so_d, mask=tile_rows, other=0.0)
    g = tl.load(G + b * sg_b + hh * sg_h + rows[:, None] * sg_t + dd[None, :] * sg_d, mask=tile_rows, other=0.0)
    F_rows = tl.load(FC + b * sf_b + hh * sf_h + rows * sf_t, mask=row_mask, other=0.0)
    m = tl.load(M + bh * T + rows, mask=row_mask, other=0.0)
    s = tl.load(S + bh * T + rows, mask=row_mask, other=0.0)
    # h = r num, r = 1 / (max(|s|, floor) + eps): |s|'s side gives s the gradient -c, the floor's side gives m extra
    floor = tl.exp(tl.minimum(-m, 80.0))
    r = 1.0 / (tl.maximum(tl.abs(s), floor) + eps)
    g_h = tl.sum(g * h, 1)
    above = tl.abs(s) > floor
    c = tl.where(above, tl.where(s > 0, r, -r) * g_h, 0.0)
    extra = tl.where((~above) & (m >= -80.0), g_h * r * floor, 0.0)  # clamp(-m, max=80) passes it where -m <= 80
    dq = tl.full((BLOCK, BLOCK_D), 0.0, q.dtype)
    row_sum = tl.full((BLOCK,), 0.0, q.dtype)
    for key in range(0, tl.minimum(start + BLOCK, T), BLOCK):
        cols = key + tl.arange(0, BLOCK)
        col_mask = cols < T
        tile = col_mask[:, None] & d_mask[None, :]
        k = tl.load(K + b * sk_b + hh * sk_h + cols[:, None] * sk_t + dd[None, :] * sk_d, mask=tile, other=0.0)
        v = tl.load(V + b * sv_b + hh * sv_h + cols[:, None] * sv_t + dd[None, :] * sv_d, mask=tile, other=0.0)
        I_cols = tl.load(LI + b * si_b + hh * si_h + cols * si_t, mask=col_mask, other=0.0)
        F_cols = tl.load(FC + b * sf_b + hh * sf_h + cols * sf_t, mask=col_mask, other=0.0)
        decay = tl.exp(_log_decay(F_rows, F_cols, I_cols, rows, cols, T) - m[:, None])
        P = tl.dot(q, tl.trans(k), input_precision=IEEE) * decay
        dP = r[:, None] * tl.dot(g, tl.trans(v), input_precision=IEEE) - c[:, None]
        dq = tl.dot(dP * decay, k, acc=dq, input_precision=IEEE)
        row_sum += tl.sum(dP * P, 1)
    tl.store(DQ + b * sq_b + hh * sq_h + rows[:, None] * sq_t + dd[None, :] * sq_d, dq, mask=tile_rows)
    tl.store(R + bh * T + rows, r, mask=row_mask)
    tl.store(C + bh * T + rows, c, mask=row_mask)
    tl.store(DM + bh * T + rows, extra - row_sum, mask=row_mask)
    tl.store(ROW + bh * T + rows, extra, mask=row_mask)  # the row's dlogD with dm added at j*: sum + dm


@triton.jit
def _mlstm_backward_keys_kernel(
    Q, K, V, LI, FC, G, M, TOP, R, C, DM, ROW,  # as the forward and the query-block kernel wrote them
    DK, DV, DI, DF,  # dk, dv [B, H, T, D] strided; d i~, dF [B H, T]
    T, H, D,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    si_b, si_h, si_t, sf_b, sf_h, sf_t, sg_b, sg_h, sg_t, sg_d,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    key = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    hh = (bh % H).to(tl.int64)
    cols = key + tl.arange(0, BLOCK)
    dd = tl.arange(0, BLOCK_D)
    col_mask = cols < T
    d_mask = dd < D
    tile_cols = col_mask[:, None] & d_mask[None, :]
    k = tl.load(K + b * sk_b + hh * sk_h + cols[:, None] * sk_t + dd[None, :] * sk_d, mask=tile_cols, other=0.0)
    v = tl.load(V + b * sv_b + hh * sv_h + cols[:, None] * sv_t + dd[None, :] * sv_d, mask=tile_cols, other=0.0)
    I_cols = tl.load(LI + b * si_b + hh * si_h + cols * si_t, mask=col_mask, other=0.0)
    F_cols = tl.load(FC + b * sf_b + hh * sf_h + cols * sf_t, mask=col_mask, other=0.0)
    dk = tl.full((BLOCK, BLOCK_D), 0.0, k.dtype)
    dv = tl.full((BLOCK, BLOCK_D), 0.0, k.dtype)
    col_sum = tl.full((BLOCK,), 0.0, k.dtype)
    for start in range(key, T, BLOCK):  # causal: the query blocks from the diagonal on
        rows = start + tl.arange(0, BLOCK)
        row_mask = rows < T
        tile = row_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + b * sq_b + hh * sq_h + rows[:, None] * sq_t + dd[None, :] * sq_d, mask=tile, other=0.0)
        g = tl.load(G + b * sg_b + hh * sg_h + rows[:, None] * sg_t + dd[None, :] * sg_d, mask=tile, other=0.0)
        F_rows = tl.load(FC + b * sf_b + hh * sf_h + rows * sf_t, mask=row_mask, other=0.0)
        m = tl.load(M + bh * T + rows, mask=row_mask, other=0.0)
        r = tl.load(R + bh * T + rows, mask=row_mask, other=0.0)
        c = tl.load(C + bh * T + rows, mask=row_mask, other=0.0)
        dm = tl.load(DM + bh * T + rows, mask=row_mask, other=0.0)
        top = tl.load(TOP + bh * T + rows, mask=row_mask, other=-1)
        decay = tl.exp(_log_decay(F_rows, F_cols, I_cols, rows, cols, T) - m[:, None])
        P = tl.dot(q, tl.trans(k), input_precision=IEEE) * decay
        dP = r[:, None] * tl.dot(g, tl.trans(v), input_precision=IEEE) - c[:, None]
        dk = tl.dot(tl.trans(dP * decay), q, acc=dk, input_precision=IEEE)
        dv = tl.dot(tl.trans(P * r[:, None]), g, acc=dv, input_precision=IEEE)
        # dlogD = dP P, and each row's dm at its maximum's column
        col_sum += tl.sum(dP * P + tl.where(top[:, None] == cols[None, :], dm[:, None], 0.0), 0)
    row_total = tl.load(ROW + bh * T + cols, mask=col_mask, other=0.0)
    tl.store(DK + b * sk_b + hh * sk_h + cols[:, None] * sk_t + dd[None, :] * sk_d, dk, mask=tile_cols)
    tl.store(DV + b * sv_b + hh * sv_h + cols[:, None] * sv_t + dd[None, :] * sv_d, dv, mask=tile_cols)
    # log D_ij = F_i - F_j + i~_j: i~_j gets the column's total, F_j the row's minus the column's
    tl.store(DI + bh * T + cols, col_sum, mask=col_mask)
    tl.store(DF + bh * T + cols, row_total - col_sum, mask=col_mask)


# ----------------------------------------------------------------------------- launches


def _blocks(D: int) -> tuple[int, int]:
    """(BLOCK, BLOCK_D): BLOCK queries by BLOCK keys a tile; wide heads take smaller tiles, to fit a GPU's registers
    and shared memory (tl.dot wants every side >= 16)."""
    block_d = max(16, triton.next_power_of_2(D))
    if block_d <= 64:
        return 64, block_d
    return (32 if block_d <= 256 else 16), block_d


def _launch_options(block_d: int) -> dict:
    """Wide heads: more warps (fewer values a thread, less spilling) and one stage (the loop's [BLOCK, BLOCK_D] tiles
    not multiplied in shared memory by pipelining)."""
    return dict(num_warps=4, num_stages=2) if block_d <= 64 else dict(num_warps=8, num_stages=1)


def _forward(q, k, v, log_i, F_cum, eps):
    """One launch -> (h ``[B, H, T, D]`` laid out as q, m, s ``[B H, T]``, j* ``[B H, T]`` int32)."""
    B, H, T, D = q.shape
    h = torch.empty_like(q)
    m, s = (q.new_empty(B * H, T) for _ in range(2))
    top = torch.empty(B * H, T, device=q.device, dtype=torch.int32)
    block, block_d = _blocks(D)
    _mlstm_forward_kernel[(triton.cdiv(T, block), B * H)](
        q, k, v, log_i, F_cum, h, m, s, top, T, H, D, eps,
        *q.stride(), *k.stride(), *v.stride(), *log_i.stride(), *F_cum.stride(), *h.stride(),
        BLOCK=block, BLOCK_D=block_d, **_launch_options(block_d),
    )
    return h, m, s, top


class _Parallel(torch.autograd.Function):
    """h of the parallel mLSTM from the empty state by the kernels: q, k (scaled), v ``[B, H, T, D]`` (any strides),
    log i~, F = cumsum(log f) ``[B, H, T]``, all in the compute dtype -> h ``[B, H, T, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, log_i, F_cum, eps):
        h, m, s, top = _forward(q, k, v, log_i, F_cum, eps)
        ctx.save_for_backward(q, k, v, log_i, F_cum, h, m, s, top)
        ctx.eps = eps
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_h):
        q, k, v, log_i, F_cum, h, m, s, top = ctx.saved_tensors
        B, H, T, D = q.shape
        block, block_d = _blocks(D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        r, c, dm, row, d_i, d_f = (m.new_empty(B * H, T) for _ in range(6))
        grid = (triton.cdiv(T, block), B * H)
        strides = (*q.stride(), *k.stride(), *v.stride(), *log_i.stride(), *F_cum.stride())
        _mlstm_backward_queries_kernel[grid](
            q, k, v, log_i, F_cum, h, g_h, m, s, dq, r, c, dm, row, T, H, D, ctx.eps,
            *strides, *h.stride(), *g_h.stride(), BLOCK=block, BLOCK_D=block_d, **_launch_options(block_d),
        )
        _mlstm_backward_keys_kernel[grid](
            q, k, v, log_i, F_cum, g_h, m, top, r, c, dm, row, dk, dv, d_i, d_f, T, H, D,
            *strides, *g_h.stride(), BLOCK=block, BLOCK_D=block_d, **_launch_options(block_d),
        )
        return dq, dk, dv, d_i.view(B, H, T), d_f.view(B, H, T), None


def check_runnable(device: torch.device) -> None:
    """Raise the one-line error for a device the kernels can not run on: CUDA, or any under ``TRITON_INTERPRET=1``."""
    if device.type != "cuda" and not INTERPRETED:
        raise LtcxError(f"mlstm_backend 'triton' runs on CUDA, not on {device.type}: use mlstm_backend: chunkwise on a "
                        "CPU, or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter")


def mlstm_parallel_triton(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, f_pre: Tensor, *,
                          forget_gate: str = "sigmoid", eps: float = EPS) -> Tensor:
    """``mlstm_parallel(q, k, v, i_pre, f_pre, None, forget_gate=..., eps=..., with_state=False)[0]`` by the kernels:
    q, k, v ``[B, H, T, D]`` (any strides; h comes back laid out as q, in q's dtype), i_pre, f_pre ``[B, H, T]``."""
    if torch.compiler.is_compiling() or q.shape[-2] == 0:  # Dynamo can not trace the launches: the torch form
        return mlstm_parallel(q, k, v, i_pre, f_pre, forget_gate=forget_gate, eps=eps, with_state=False)[0]
    check_runnable(q.device)
    cdt = state_dtype(q.dtype)
    log_f = log_forget_gate(f_pre.to(cdt), forget_gate)
    inputs = (q.to(cdt), k.to(cdt) * (1.0 / math.sqrt(q.shape[-1])), v.to(cdt), i_pre.to(cdt), log_f.cumsum(-1))
    if wants_written_backward(*inputs):
        h = _Parallel.apply(*inputs, eps)
    else:
        h = _forward(*inputs, eps)[0]
    return h.to(q.dtype)

