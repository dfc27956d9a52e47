"""Titans' neural memory (``ltcx/ops/titans.py``) as two fused Triton kernels: one launch for the forward over every
chunk of a call, one for its backward (spec section A.3.1).

One program per (batch row, memory head) loops over the call's pieces in order with the memory's weights W1 [dm, dk],
W2 [dk, dm], the momentum S1, S2 and the gradient point W1^s, W2^s held on chip. Per piece of n <= P tokens it does
what ``_chunk_forward`` does: the inner gradient at the piece's start weights W^s (closed form: z = k W1s^T,
h = GELU(z), delta2 = 2 (M(k) - v), delta1 = (delta2 W2s) * GELU'(z)), the step theta (divided by the curvature
kappa with ``normalize_step``), the piece's decay matrices from the in-kernel cumulative sums of the log gates
(A_t, E_t, D_t, C[t, i] = theta_i sum_{i<=j<=t} (A_t / A_j)(E_j / E_i)), the read

    pre = A (q W1^T) + D (q S1^T) - (C o q k^T) delta1,    y = q + A (GELU(pre) W2^T) + D (GELU(pre) S2^T)
                                                                   - (C o GELU(pre) h^T) delta2,

and the weights and momentum after the piece, A_n W + D_n S - delta^T (C[n-1] x), E_n S - delta^T (theta E_n / E x).

Pieces are at absolute positions, P tokens each: P = chunk_size for chunks up to ``MAX_PIECE`` tokens, else the
largest power of two dividing it (the weights inside a chunk are the same closed form over any split, since every
gradient in it is taken at W^s), and ``MAX_PIECE`` with no chunks (W^s never moves). W^s becomes the current weights
after a piece that ends on a multiple of chunk_size. Where a gradient is wanted the forward saves each piece's start
state (W1, W2, S1, S2: as many floats as autograd saves for the torch form) and the incoming W^s; the backward runs the
pieces in reverse, recomputes each piece's forward from its saved start, and carries the gradients of the weights,
momentum and gradient point on chip. ``tl.dot`` wants every dimension >= 16: rows, keys and hidden units are padded
with masks to powers of two >= 16 (zeros, which every product leaves zero).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .titans import MemoryState, chunk_sizes

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernels below run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""

MAX_PIECE = 64
"""the most tokens one piece's [n, n] decay matrices hold: longer chunks run as several pieces."""


def piece_size(chunk_size: int | None) -> int:
    """P, the length of the kernel's pieces: the chunk itself up to ``MAX_PIECE``, else the largest power of two
    dividing it (so chunk boundaries are piece boundaries), ``MAX_PIECE`` without chunks."""
    if chunk_size is None:
        return MAX_PIECE
    if chunk_size <= MAX_PIECE:
        return chunk_size
    return math.gcd(chunk_size, MAX_PIECE)


IEEE: tl.constexpr = tl.constexpr("ieee")  # float32 products in float32, as torch's (not TF32)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- shared pieces of both kernels


@triton.jit
def _load_matrix(ptr, s_r, s_c, rows, cols, mask):
    return tl.load(ptr + rows[:, None] * s_r + cols[None, :] * s_c, mask=mask, other=0.0)


@triton.jit
def _load_piece(q_base, k_base, v_base, sq_t, sq_d, sk_t, sk_d, sv_t, sv_d, lr_base, lm_base, st_base, slr_t, slm_t,
                sst_t, t, rk, valid, mask_nk):
    """A piece's inputs at tokens t ([BN], padded rows masked): Q, K, V [BN, BK] and the three gates [BN]."""
    Q = tl.load(q_base + t[:, None] * sq_t + rk[None, :] * sq_d, mask=mask_nk, other=0.0)
    K = tl.load(k_base + t[:, None] * sk_t + rk[None, :] * sk_d, mask=mask_nk, other=0.0)
    V = tl.load(v_base + t[:, None] * sv_t + rk[None, :] * sv_d, mask=mask_nk, other=0.0)
    lr = tl.load(lr_base + t * slr_t, mask=valid, other=0.0)
    lm = tl.load(lm_base + t * slm_t, mask=valid, other=0.0)
    stp = tl.load(st_base + t * sst_t, mask=valid, other=0.0)
    return Q, K, V, lr, lm, stp


@triton.jit
def _state_gradient(ptr, s_r, s_c, rows, cols, mask, BR: tl.constexpr, BC: tl.constexpr, GIVEN: tl.constexpr):
    """A state output's gradient [BR, BC]: loaded, or zeros for an output nothing read."""
    if GIVEN:
        return _load_matrix(ptr, s_r, s_c, rows, cols, mask)
    else:
        return tl.zeros((BR, BC), ptr.dtype.element_ty)


@triton.jit
def _piece_forward(Q, K, V, lr, lm, stp, valid, rn, n, W1, W2, S1, S2, W1s, W2s, NORMALIZE: tl.constexpr):
    """The closed form of one piece ([BN] rows, padded rows masked by ``valid``): every quantity the forward and
    the backward read, in the order the backward reads them."""
    # the inner gradient at the piece's gradient point
    z = tl.dot(K, tl.trans(W1s), input_precision=IEEE)  # [BN, BM]
    cdf_z = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))  # GELU(x) = x Phi(x), written out once for z and pre
    pdf_z = 0.3989422804014327 * tl.exp(-0.5 * z * z)
    h = z * cdf_z
    d2 = 2.0 * (K + tl.dot(h, tl.trans(W2s), input_precision=IEEE) - V)  # [BN, BK]
    back = tl.dot(d2, W2s, input_precision=IEEE)  # W2s^T delta2, [BN, BM]
    d1 = back * (cdf_z + z * pdf_z)
    e2 = tl.sum(d2 * d2, axis=1) + 1e-6
    d12 = tl.sum(d1 * d1, axis=1)
    k2 = tl.sum(K * K, axis=1)
    if NORMALIZE:
        kappa = tl.where(valid, tl.sum(h * h, axis=1) + k2 * d12 / e2, 1.0)
        theta = stp / kappa
    else:
        kappa = tl.full(stp.shape, 1.0, stp.dtype)
        theta = stp
    # the piece's decays from the cumulative log gates (padded rows carry log 1: they never reach a valid row)
    below = rn[:, None] >= rn[None, :]  # [t, j]: j <= t
    cA = tl.sum(tl.where(below, lr[None, :], 0.0), axis=1)
    cE = tl.sum(tl.where(below, lm[None, :], 0.0), axis=1)
    RA = tl.where(below, tl.exp(tl.where(below, cA[:, None] - cA[None, :], 0.0)), 0.0)  # A_t / A_j
    RE = tl.where(below, tl.exp(tl.where(below, cE[:, None] - cE[None, :], 0.0)), 0.0)  # E_j / E_i
    A = tl.exp(cA)
    E = tl.exp(cE)
    D = tl.sum(RA * E[None, :], axis=1)  # the weight of the incoming momentum in W_t
    G = tl.dot(RA, RE, input_precision=IEEE)  # C / theta
    C = G * theta[None, :]
    # the read y_t = M(q_t; W_t), W_t never formed
    QK = tl.dot(Q, tl.trans(K), input_precision=IEEE)
    Wr = C * QK
    pre = (A[:, None] * tl.dot(Q, tl.trans(W1), input_precision=IEEE)
           + D[:, None] * tl.dot(Q, tl.trans(S1), input_precision=IEEE) - tl.dot(Wr, d1, input_precision=IEEE))
    cdf_p = 0.5 * (1.0 + tl.math.erf(pre * 0.7071067811865476))
    hid = pre * cdf_p
    HH = tl.dot(hid, tl.trans(h), input_precision=IEEE)
    R = C * HH
    Y = (Q + A[:, None] * tl.dot(hid, tl.trans(W2), input_precision=IEEE)
         + D[:, None] * tl.dot(hid, tl.trans(S2), input_precision=IEEE) - tl.dot(R, d2, input_precision=IEEE))
    # the carry through the piece: its last row's coefficients
    last = rn == n - 1
    c = tl.sum(tl.where(last[:, None], C, 0.0), axis=0)  # C[n-1, i]
    a_n = tl.sum(tl.where(last, A, 0.0), axis=0)
    d_n = tl.sum(tl.where(last, D, 0.0), axis=0)
    e_n = tl.sum(tl.where(last, E, 0.0), axis=0)
    cE_n = tl.sum(tl.where(last, cE, 0.0), axis=0)
    ML = tl.exp(cE_n - cE)  # E_n / E_i
    m = theta * ML
    return (z, cdf_z, pdf_z, cdf_p, h, d2, back, d1, e2, d12, k2, kappa, theta, below, RA, RE, A, E, D, G, C, QK,
            Wr, pre, hid, HH, R, Y, last, c, a_n, d_n, e_n, ML, m)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _memory_forward_kernel(
    q_ptr, k_ptr, v_ptr, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    lr_ptr, lm_ptr, st_ptr, slr_b, slr_h, slr_t, slm_b, slm_h, slm_t, sst_b, sst_h, sst_t,
    w1_ptr, w2_ptr, s1_ptr, s2_ptr, w1s_ptr, w2s_ptr,
    sw1_b, sw1_h, sw1_r, sw1_c, sw2_b, sw2_h, sw2_r, sw2_c, ss1_b, ss1_h, ss1_r, ss1_c, ss2_b, ss2_h, ss2_r, ss2_c,
    sws1_b, sws1_h, sws1_r, sws1_c, sws2_b, sws2_h, sws2_r, sws2_c,
    y_ptr, sy_b, sy_h, sy_t, sy_d, out_ptr, saved_ptr,
    heads, length, position, n_pieces, first, piece, refresh,
    DK: tl.constexpr, DM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_S: tl.constexpr, REFRESH: tl.constexpr, SAVE: tl.constexpr,
):
    """One (row, head): y [B, H, T, dk]; out [6, B, H, dm * dk] = W1, W2, S1, S2, W1s, W2s after the call;
    saved [B * H, n_pieces + 1, 4, dm * dk]: each piece's start (W1, W2, S1, S2), then the incoming (W1s, W2s), for
    the backward (written only with SAVE)."""
    pid = tl.program_id(0)
    b = pid // heads
    hd = pid % heads
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, BM)
    mask_mk = (rm[:, None] < DM) & (rk[None, :] < DK)  # [BM, BK]
    mask_km = (rk[:, None] < DK) & (rm[None, :] < DM)  # [BK, BM]
    W1 = _load_matrix(w1_ptr + b * sw1_b + hd * sw1_h, sw1_r, sw1_c, rm, rk, mask_mk)
    W2 = _load_matrix(w2_ptr + b * sw2_b + hd * sw2_h, sw2_r, sw2_c, rk, rm, mask_km)
    if HAS_S:
        S1 = _load_matrix(s1_ptr + b * ss1_b + hd * ss1_h, ss1_r, ss1_c, rm, rk, mask_mk)
        S2 = _load_matrix(s2_ptr + b * ss2_b + hd * ss2_h, ss2_r, ss2_c, rk, rm, mask_km)
    else:  # M_0's zero momentum
        S1 = tl.zeros((BM, BK), W1.dtype)
        S2 = tl.zeros((BK, BM), W1.dtype)
    W1s = _load_matrix(w1s_ptr + b * sws1_b + hd * sws1_h, sws1_r, sws1_c, rm, rk, mask_mk)
    W2s = _load_matrix(w2s_ptr + b * sws2_b + hd * sws2_h, sws2_r, sws2_c, rk, rm, mask_km)

    size = DM * DK
    mk_offsets = rm[:, None] * DK + rk[None, :]  # W1-shaped [dm, dk], row-major
    km_offsets = rk[:, None] * DM + rm[None, :]  # W2-shaped [dk, dm]
    saved = saved_ptr + pid.to(tl.int64) * (n_pieces + 1) * 4 * size
    if SAVE:
        tl.store(saved + n_pieces * 4 * size + mk_offsets, W1s, mask=mask_mk)
        tl.store(saved + n_pieces * 4 * size + size + km_offsets, W2s, mask=mask_km)
    q_base = q_ptr + b * sq_b + hd * sq_h
    k_base = k_ptr + b * sk_b + hd * sk_h
    v_base = v_ptr + b * sv_b + hd * sv_h
    y_base = y_ptr + b * sy_b + hd * sy_h
    lr_base = lr_ptr + b * slr_b + hd * slr_h
    lm_base = lm_ptr + b * slm_b + hd * slm_h
    st_base = st_ptr + b * sst_b + hd * sst_h
    for i in range(n_pieces):
        start = tl.where(i == 0, 0, first + (i - 1) * piece)  # the first piece finishes the call's first chunk
        n = tl.minimum(tl.where(i == 0, first, piece), length - start)
        if SAVE:
            slot = saved + i * 4 * size
            tl.store(slot + mk_offsets, W1, mask=mask_mk)
            tl.store(slot + size + km_offsets, W2, mask=mask_km)
            tl.store(slot + 2 * size + mk_offsets, S1, mask=mask_mk)
            tl.store(slot + 3 * size + km_offsets, S2, mask=mask_km)
        t = start + rn
        valid = rn < n
        mask_nk = valid[:, None] & (rk[None, :] < DK)
        Q, K, V, lr, lm, stp = _load_piece(q_base, k_base, v_base, sq_t, sq_d, sk_t, sk_d, sv_t, sv_d, lr_base,
                                           lm_base, st_base, slr_t, slm_t, sst_t, t, rk, valid, mask_nk)
        (z, cdf_z, pdf_z, cdf_p, h, d2, back, d1, e2, d12, k2, kappa, theta, below, RA, RE, A, E, D, G, C, QK,
         Wr, pre, hid, HH, R, Y, last, c, a_n, d_n, e_n, ML, m) = _piece_forward(
            Q, K, V, lr, lm, stp, valid, rn, n, W1, W2, S1, S2, W1s, W2s, NORMALIZE)
        tl.store(y_base + t[:, None] * sy_t + rk[None, :] * sy_d, Y, mask=mask_nk)
        W1 = a_n * W1 + d_n * S1 - tl.dot(tl.trans(d1 * c[:, None]), K, input_precision=IEEE)
        W2 = a_n * W2 + d_n * S2 - tl.dot(tl.trans(d2 * c[:, None]), h, input_precision=IEEE)
        S1 = e_n * S1 - tl.dot(tl.trans(d1 * m[:, None]), K, input_precision=IEEE)
        S2 = e_n * S2 - tl.dot(tl.trans(d2 * m[:, None]), h, input_precision=IEEE)
        if REFRESH:  # a piece ending on a chunk boundary: the next gradients are taken at the weights after it
            boundary = (position + start + n) % refresh == 0
            W1s = tl.where(boundary, W1, W1s)
            W2s = tl.where(boundary, W2, W2s)

    out = out_ptr + pid.to(tl.int64) * size
    stride = tl.num_programs(0).to(tl.int64) * size  # between the six outputs
    tl.store(out + mk_offsets, W1, mask=mask_mk)
    tl.store(out + stride + km_offsets, W2, mask=mask_km)
    tl.store(out + 2 * stride + mk_offsets, S1, mask=mask_mk)
    tl.store(out + 3 * stride + km_offsets, S2, mask=mask_km)
    tl.store(out + 4 * stride + mk_offsets, W1s, mask=mask_mk)
    tl.store(out + 5 * stride + km_offsets, W2s, mask=mask_km)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _memory_backward_kernel(
    q_ptr, k_ptr, v_ptr, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    lr_ptr, lm_ptr, st_ptr, slr_b, slr_h, slr_t, slm_b, slm_h, slm_t, sst_b, sst_h, sst_t,
    saved_ptr, gy_ptr, sgy_b, sgy_h, sgy_t, sgy_d, gw1_ptr, gw2_ptr, gs1_ptr, gs2_ptr, gw1s_ptr, gw2s_ptr,
    sgw1_b, sgw1_h, sgw1_r, sgw1_c, sgw2_b, sgw2_h, sgw2_r, sgw2_c, sgs1_b, sgs1_h, sgs1_r, sgs1_c,
    sgs2_b, sgs2_h, sgs2_r, sgs2_c, sgws1_b, sgws1_h, sgws1_r, sgws1_c, sgws2_b, sgws2_h, sgws2_r, sgws2_c,
    grads_ptr, gstate_ptr, heads, length, position, n_pieces, first, piece, refresh,
    DK: tl.constexpr, DM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
    NORMALIZE: tl.constexpr, REFRESH: tl.constexpr, HAS_GY: tl.constexpr, GIVEN: tl.constexpr,
):
    """One (row, head), pieces in reverse. gy [B, H, T, dk]; gw1 ... gw2s: the gradients of the six state outputs
    (W1- or W2-shaped, any strides), read where bit i of GIVEN is set, else zeros; grads [6, B, H, T, dk] (q, k, v)
    then (log_retain, log_momentum, step) in its first T entries per row; gstate [6, B, H, dm * dk]: the gradients
    of the six state inputs."""
    pid = tl.program_id(0)
    b = pid // heads
    hd = pid % heads
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, BM)
    mask_mk = (rm[:, None] < DM) & (rk[None, :] < DK)
    mask_km = (rk[:, None] < DK) & (rm[None, :] < DM)
    size = DM * DK
    mk_offsets = rm[:, None] * DK + rk[None, :]
    km_offsets = rk[:, None] * DM + rm[None, :]
    programs = tl.num_programs(0).to(tl.int64)
    stride = programs * size
    # read in place, not gathered into one buffer on the host (a zero fill and a copy each: launches)
    gW1 = _state_gradient(gw1_ptr + b * sgw1_b + hd * sgw1_h, sgw1_r, sgw1_c, rm, rk, mask_mk, BM, BK,
                          (GIVEN & 1) != 0)
    gW2 = _state_gradient(gw2_ptr + b * sgw2_b + hd * sgw2_h, sgw2_r, sgw2_c, rk, rm, mask_km, BK, BM,
                          (GIVEN & 2) != 0)
    gS1 = _state_gradient(gs1_ptr + b * sgs1_b + hd * sgs1_h, sgs1_r, sgs1_c, rm, rk, mask_mk, BM, BK,
                          (GIVEN & 4) != 0)
    gS2 = _state_gradient(gs2_ptr + b * sgs2_b + hd * sgs2_h, sgs2_r, sgs2_c, rk, rm, mask_km, BK, BM,
                          (GIVEN & 8) != 0)
    gW1s = _state_gradient(gw1s_ptr + b * sgws1_b + hd * sgws1_h, sgws1_r, sgws1_c, rm, rk, mask_mk, BM, BK,
                           (GIVEN & 16) != 0)
    gW2s = _state_gradient(gw2s_ptr + b * sgws2_b + hd * sgws2_h, sgws2_r, sgws2_c, rk, rm, mask_km, BK, BM,
                           (GIVEN & 32) != 0)

    saved = saved_ptr + pid.to(tl.int64) * (n_pieces + 1) * 4 * size
    q_base = q_ptr + b * sq_b + hd * sq_h
    k_base = k_ptr + b * sk_b + hd * sk_h
    v_base = v_ptr + b * sv_b + hd * sv_h
    gy_base = gy_ptr + b * sgy_b + hd * sgy_h
    lr_base = lr_ptr + b * slr_b + hd * slr_h
    lm_base = lm_ptr + b * slm_b + hd * slm_h
    st_base = st_ptr + b * sst_b + hd * sst_h
    token_grads = length * DK * programs  # between the six per-token gradients
    g_base = grads_ptr + pid.to(tl.int64) * length * DK
    for ii in range(n_pieces):
        i = n_pieces - 1 - ii
        start = tl.where(i == 0, 0, first + (i - 1) * piece)  # the first piece finishes the call's first chunk
        n = tl.minimum(tl.where(i == 0, first, piece), length - start)
        ws_slot = n_pieces  # the incoming gradient point, unless a boundary inside the call has moved it
        if REFRESH:
            # the gradient point of pieces after this one, if this one ends a chunk, is the weights after it
            boundary = (position + start + n) % refresh == 0
            gW1 += tl.where(boundary, gW1s, 0.0)
            gW2 += tl.where(boundary, gW2s, 0.0)
            gW1s = tl.where(boundary, 0.0, gW1s)
            gW2s = tl.where(boundary, 0.0, gW2s)
            point = position + start
            point = point - point % refresh  # the last chunk start at or before this piece
            ws_slot = tl.where(point > position, (point - position - first) // piece + 1, n_pieces)
        slot = saved + i * 4 * size
        W1 = tl.load(slot + mk_offsets, mask=mask_mk, other=0.0)
        W2 = tl.load(slot + size + km_offsets, mask=mask_km, other=0.0)
        S1 = tl.load(slot + 2 * size + mk_offsets, mask=mask_mk, other=0.0)
        S2 = tl.load(slot + 3 * size + km_offsets, mask=mask_km, other=0.0)
        ws = saved + ws_slot * 4 * size
        W1s = tl.load(ws + mk_offsets, mask=mask_mk, other=0.0)
        W2s = tl.load(ws + size + km_offsets, mask=mask_km, other=0.0)
        t = start + rn
        valid = rn < n
        mask_nk = valid[:, None] & (rk[None, :] < DK)
        Q, K, V, lr, lm, stp = _load_piece(q_base, k_base, v_base, sq_t, sq_d, sk_t, sk_d, sv_t, sv_d, lr_base,
                                           lm_base, st_base, slr_t, slm_t, sst_t, t, rk, valid, mask_nk)
        (z, cdf_z, pdf_z, cdf_p, h, d2, back, d1, e2, d12, k2, kappa, theta, below, RA, RE, A, E, D, G, C, QK,
         Wr, pre, hid, HH, R, Y, last, c, a_n, d_n, e_n, ML, m) = _piece_forward(
            Q, K, V, lr, lm, stp, valid, rn, n, W1, W2, S1, S2, W1s, W2s, NORMALIZE)
        if HAS_GY:
            gY = tl.load(gy_base + t[:, None] * sgy_t + rk[None, :] * sgy_d, mask=mask_nk, other=0.0)
        else:
            gY = tl.zeros((BN, BK), Q.dtype)

        # the carry: W' = a_n W + d_n S - delta1^T (c k), S' = e_n S - delta1^T (m k) (and W2, S2 with delta2, h)
        gA_n = tl.sum(tl.sum(gW1 * W1, axis=1), axis=0) + tl.sum(tl.sum(gW2 * W2, axis=1), axis=0)
        gD_n = tl.sum(tl.sum(gW1 * S1, axis=1), axis=0) + tl.sum(tl.sum(gW2 * S2, axis=1), axis=0)
        gE_n = tl.sum(tl.sum(gS1 * S1, axis=1), axis=0) + tl.sum(tl.sum(gS2 * S2, axis=1), axis=0)
        X1 = tl.dot(d1, gW1, input_precision=IEEE)  # [BN, BK]
        X2 = tl.dot(d2, gW2, input_precision=IEEE)  # [BN, BM]
        Y1 = tl.dot(d1, gS1, input_precision=IEEE)
        Y2 = tl.dot(d2, gS2, input_precision=IEEE)
        gK = -c[:, None] * X1 - m[:, None] * Y1
        gH = -c[:, None] * X2 - m[:, None] * Y2
        g_c = -tl.sum(K * X1, axis=1) - tl.sum(h * X2, axis=1)
        g_m = -tl.sum(K * Y1, axis=1) - tl.sum(h * Y2, axis=1)
        gD1 = (-c[:, None] * tl.dot(K, tl.trans(gW1), input_precision=IEEE)
               - m[:, None] * tl.dot(K, tl.trans(gS1), input_precision=IEEE))  # [BN, BM]
        gD2 = (-c[:, None] * tl.dot(h, tl.trans(gW2), input_precision=IEEE)
               - m[:, None] * tl.dot(h, tl.trans(gS2), input_precision=IEEE))  # [BN, BK]
        nW1 = a_n * gW1
        nW2 = a_n * gW2
        nS1 = d_n * gW1 + e_n * gS1
        nS2 = d_n * gW2 + e_n * gS2

        # the read: y = q + A (hid W2^T) + D (hid S2^T) - R delta2, R = C o hid h^T, hid = GELU(pre)
        P2 = tl.dot(gY, W2, input_precision=IEEE)  # [BN, BM]
        P2s = tl.dot(gY, S2, input_precision=IEEE)
        gHid = A[:, None] * P2 + D[:, None] * P2s
        gA = tl.sum(P2 * hid, axis=1)
        gD = tl.sum(P2s * hid, axis=1)
        nW2 += tl.dot(tl.trans(gY), A[:, None] * hid, input_precision=IEEE)
        nS2 += tl.dot(tl.trans(gY), D[:, None] * hid, input_precision=IEEE)
        gR = -tl.dot(gY, tl.trans(d2), input_precision=IEEE)  # [BN, BN]
        gD2 -= tl.dot(tl.trans(R), gY, input_precision=IEEE)
        gC = gR * HH
        gHH = gR * C
        gHid += tl.dot(gHH, h, input_precision=IEEE)
        gH += tl.dot(tl.trans(gHH), hid, input_precision=IEEE)
        # pre = A (q W1^T) + D (q S1^T) - Wr delta1, Wr = C o q k^T
        gPre = gHid * (cdf_p + pre * 0.3989422804014327 * tl.exp(-0.5 * pre * pre))  # GELU'(pre)
        Z1 = tl.dot(gPre, W1, input_precision=IEEE)  # [BN, BK]
        Z1s = tl.dot(gPre, S1, input_precision=IEEE)
        gQ = gY + A[:, None] * Z1 + D[:, None] * Z1s
        gA += tl.sum(Z1 * Q, axis=1)
        gD += tl.sum(Z1s * Q, axis=1)
        nW1 += tl.dot(tl.trans(gPre), A[:, None] * Q, input_precision=IEEE)
        nS1 += tl.dot(tl.trans(gPre), D[:, None] * Q, input_precision=IEEE)
        gWr = -tl.dot(gPre, tl.trans(d1), input_precision=IEEE)
        gD1 -= tl.dot(tl.trans(Wr), gPre, input_precision=IEEE)
        gC += gWr * QK
        gQK = gWr * C
        gQ += tl.dot(gQK, K, input_precision=IEEE)
        gK += tl.dot(tl.trans(gQK), Q, input_precision=IEEE)

        # the coefficients: C = G theta_i, G = RA RE, m = theta ML, D = RA E, and the carry's last row
        gC += tl.where(last[:, None], g_c[None, :], 0.0)
        gTheta = tl.sum(gC * G, axis=0) + g_m * ML
        gG = gC * theta[None, :]
        gML = g_m * theta
        gA += tl.where(last, gA_n, 0.0)
        gD += tl.where(last, gD_n, 0.0)
        gRA = tl.dot(gG, tl.trans(RE), input_precision=IEEE) + gD[:, None] * E[None, :]
        gRE = tl.dot(tl.trans(RA), gG, input_precision=IEEE)
        tA = gRA * RA  # d/d(log A_t - log A_j)
        tE = gRE * RE
        gcA = gA * A + tl.sum(tA, axis=1) - tl.sum(tA, axis=0)
        gcE = (E * tl.sum(RA * gD[:, None], axis=0) + tl.sum(tE, axis=1) - tl.sum(tE, axis=0) - gML * ML
               + tl.where(last, tl.sum(gML * ML, axis=0) + gE_n * e_n, 0.0))
        gcA = tl.where(valid, gcA, 0.0)
        gcE = tl.where(valid, gcE, 0.0)
        g_lr = tl.sum(tl.where(below, gcA[:, None], 0.0), axis=0)  # sum over t >= l
        g_lm = tl.sum(tl.where(below, gcE[:, None], 0.0), axis=0)

        if NORMALIZE:  # theta = step / kappa, kappa = ||h||^2 + ||k||^2 ||delta1||^2 / e2
            g_st = gTheta / kappa
            gKap = -gTheta * theta / kappa
            gH += (2.0 * gKap)[:, None] * h
            gK += (2.0 * gKap * d12 / e2)[:, None] * K
            gD1 += (2.0 * gKap * k2 / e2)[:, None] * d1
            gD2 -= (2.0 * gKap * k2 * d12 / (e2 * e2))[:, None] * d2
        else:
            g_st = gTheta

        # the inner gradient at the gradient point: delta1 = (delta2 W2s) GELU'(z), delta2 = 2 (k + h W2s^T - v)
        gelu_z = cdf_z + z * pdf_z  # GELU'(z); GELU''(z) = phi(z) (2 - z^2)
        gBack = gD1 * gelu_z
        gZ = gD1 * back * pdf_z * (2.0 - z * z)
        gD2 += tl.dot(gBack, tl.trans(W2s), input_precision=IEEE)
        gW2s += tl.dot(tl.trans(d2), gBack, input_precision=IEEE)
        gK += 2.0 * gD2
        gV = -2.0 * gD2
        gH += 2.0 * tl.dot(gD2, W2s, input_precision=IEEE)
        gW2s += 2.0 * tl.dot(tl.trans(gD2), h, input_precision=IEEE)
        gZ += gH * gelu_z
        gK += tl.dot(gZ, W1s, input_precision=IEEE)
        gW1s += tl.dot(tl.trans(gZ), K, input_precision=IEEE)

        offsets = t[:, None] * DK + rk[None, :]
        tl.store(g_base + offsets, gQ, mask=mask_nk)
        tl.store(g_base + token_grads + offsets, gK, mask=mask_nk)
        tl.store(g_base + 2 * token_grads + offsets, gV, mask=mask_nk)
        tl.store(g_base + 3 * token_grads + t, g_lr, mask=valid)
        tl.store(g_base + 4 * token_grads + t, g_lm, mask=valid)
        tl.store(g_base + 5 * token_grads + t, g_st, mask=valid)
        gW1 = nW1
        gW2 = nW2
        gS1 = nS1
        gS2 = nS2

    gstate = gstate_ptr + pid.to(tl.int64) * size
    tl.store(gstate + mk_offsets, gW1, mask=mask_mk)
    tl.store(gstate + stride + km_offsets, gW2, mask=mask_km)
    tl.store(gstate + 2 * stride + mk_offsets, gS1, mask=mask_mk)
    tl.store(gstate + 3 * stride + km_offsets, gS2, mask=mask_km)
    tl.store(gstate + 4 * stride + mk_offsets, gW1s, mask=mask_mk)
    tl.store(gstate + 5 * stride + km_offsets, gW2s, mask=mask_km)


# ----------------------------------------------------------------------------- host side


class _Layout:
    """What both kernels are launched with: the pieces of a call and the block sizes."""

    def __init__(self, q: Tensor, dm: int, position: int, chunk_size: int | None, normalize: bool) -> None:
        self.batch, self.heads, self.length, self.dk = q.shape
        self.dm = dm
        self.piece = piece_size(chunk_size)
        sizes = chunk_sizes(position, self.length, self.piece)
        self.n_pieces, self.first = len(sizes), sizes[0]
        self.position, self.refresh = position, chunk_size or 1
        self.constants = dict(DK=self.dk, DM=dm, BN=_block(self.piece), BK=_block(self.dk), BM=_block(dm),
                              NORMALIZE=normalize, REFRESH=chunk_size is not None)
        self.num_warps = 4 if _block(self.dk) * _block(dm) <= 4096 else 8

    def scalars(self) -> tuple[int, ...]:
        return self.heads, self.length, self.position, self.n_pieces, self.first, self.piece, self.refresh


def _state_views(x: Tensor, layout: _Layout) -> list[Tensor]:
    """[6, B, H, dm * dk] -> W1, W2, S1, S2, W1s, W2s: W1-shaped [B, H, dm, dk], W2-shaped [B, H, dk, dm]."""
    w1_shape = (layout.batch, layout.heads, layout.dm, layout.dk)
    w2_shape = (layout.batch, layout.heads, layout.dk, layout.dm)
    return [part.view(w2_shape if index % 2 else w1_shape) for index, part in enumerate(x.unbind(0))]


def _strides(*tensors: Tensor) -> list[int]:
    return [s for x in tensors for s in x.stride()]


class _NeuralMemory(torch.autograd.Function):
    """Inputs: q, k, v [B, H, T, dk], log_retain, log_momentum, step [B, H, T], W1s, W2s, W1, W2 (W1-shaped
    [B, H, dm, dk], W2-shaped [B, H, dk, dm]), S1, S2 (None: zero momentum), position, chunk_size, normalize,
    save (a backward will run: the forward writes the piece starts it reads).
    Outputs: y [B, H, T, dk] and the state after the call, W1, W2, S1, S2, W1s, W2s."""

    @staticmethod
    def forward(ctx, q, k, v, log_retain, log_momentum, step, w1s, w2s, w1, w2, s1, s2, position, chunk_size,
                normalize, save):
        layout = _Layout(q, w1.shape[-2], position, chunk_size, normalize)
        batch, heads, length, dk = q.shape
        rows = batch * heads
        # y laid out [B, T, H, dk]: the caller's merge of the heads is then a view
        y = q.new_empty(batch, length, heads, dk).transpose(1, 2)
        out = q.new_empty(6, batch, heads, layout.dm * dk)
        saved = q.new_empty(rows, layout.n_pieces + 1, 4, layout.dm * dk) if save else q.new_empty(0)
        has_s = s1 is not None
        momentum = (s1, s2) if has_s else (w1, w2)  # pointers only, never read without HAS_S
        _memory_forward_kernel[(rows,)](
            q, k, v, *_strides(q, k, v), log_retain, log_momentum, step, *_strides(log_retain, log_momentum, step),
            w1, w2, *momentum, w1s, w2s, *_strides(w1, w2, *momentum, w1s, w2s),
            y, *y.stride(), out, saved, *layout.scalars(), HAS_S=has_s, SAVE=save, **layout.constants,
            num_warps=layout.num_warps,
        )
        ctx.save_for_backward(q, k, v, log_retain, log_momentum, step, saved)
        ctx.layout, ctx.has_s = layout, has_s
        ctx.set_materialize_grads(False)
        return (y, *_state_views(out, layout))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_y, *g_state):
        q, k, v, log_retain, log_momentum, step, saved = ctx.saved_tensors
        layout: _Layout = ctx.layout
        batch, heads, length, dk = q.shape
        given = sum(1 << index for index, g in enumerate(g_state) if g is not None)  # the kernel's GIVEN bits
        g_strides = [s for g in g_state for s in ((0,) * 4 if g is None else g.stride())]
        g_state = [saved if g is None else g for g in g_state]  # a pointer never read
        has_gy = g_y is not None
        gy = g_y if has_gy else q
        grads = q.new_empty(6, batch, heads, length, dk)
        gstate = q.new_empty(6, batch, heads, layout.dm * dk)
        _memory_backward_kernel[(batch * heads,)](
            q, k, v, *_strides(q, k, v), log_retain, log_momentum, step, *_strides(log_retain, log_momentum, step),
            saved, gy, *gy.stride(), *g_state, *g_strides, grads, gstate, *layout.scalars(), HAS_GY=has_gy,
            GIVEN=given,
            **layout.constants, num_warps=layout.num_warps,
        )
        g_q, g_k, g_v = grads[:3].unbind(0)
        g_gates = (x.flatten(-2)[..., :length] for x in grads[3:].unbind(0))  # each row's first T entries
        g_w1, g_w2, g_s1, g_s2, g_w1s, g_w2s = _state_views(gstate, layout)
        if not ctx.has_s:
            g_s1 = g_s2 = None
        return (g_q, g_k, g_v, *g_gates, g_w1s, g_w2s, g_w1, g_w2, g_s1, g_s2, None, None, None, None)


def neural_memory_triton(
    q: Tensor, k: Tensor, v: Tensor, log_retain: Tensor, log_momentum: Tensor, step: Tensor,
    state: MemoryState, position: int, chunk_size: int | None, normalize_step: bool = True, with_state: bool = True,
) -> tuple[Tensor, MemoryState | None]:
    """:func:`ltcx.ops.titans.neural_memory` (same arguments, same returns) in two kernel launches, forward and
    backward. Inputs may be any strided views (the expanded M_0 included); float32 or float64."""
    w1_start, w2_start, w1, w2, s1, s2 = state
    if q.shape[2] == 0:
        return q.new_zeros(q.shape), state if with_state else None
    inputs = (q, k, v, log_retain, log_momentum, step, w1_start, w2_start, w1, w2, s1, s2)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    y, w1, w2, s1, s2, w1s, w2s = _NeuralMemory.apply(*inputs, position, chunk_size, normalize_step, save)
    if not with_state:
        return y, None
    end = position + q.shape[2]
    at_boundary = chunk_size is not None and end % chunk_size == 0
    # at a chunk boundary the gradient point is the current weights: the same objects, as the torch form returns
    start = (w1, w2) if at_boundary else (w1s, w2s)
    return y, MemoryState(*start, w1, w2, s1, s2)
