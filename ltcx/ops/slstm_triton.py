"""The sLSTM scan of :mod:`ltcx.ops.slstm` as two fused Triton kernels (``slstm_backend: triton``): one launch runs
the whole recurrence forward, one runs it backward, where the torch form launches some ten kernels a step each way.

Each program owns one head and a block of batch rows (``BLOCK_B``, at least 16: ``tl.dot``'s smallest tile) and loops
over time inside the kernel with the state c, n, h, m ``[BLOCK_B, Dh]`` in registers and the head's four recurrent
maps ``R_g [Dh, Dh]`` loaded once (when they fit on chip, else read from cache each step: ``MAPS_ON_CHIP_BYTES``). The
equations are :func:`ltcx.ops.slstm._cell`'s and the backward is :class:`ltcx.ops.slstm._Scan`'s, with the
stabiliser m carrying no gradient (as there). Per step the forward keeps what the backward reads: the
pre-activations and c, n, m after the step; the backward recomputes the gates from them, so the values it uses are
the forward's own. R's gradient, a sum over all steps, is one product after the backward kernel.

Launches: forward 1; backward 1 plus R's product. Grid ``(H, ceil(B / BLOCK_B))``.

Runs on CUDA, or on a CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter, read when this module is imported:
that is how ``tests/test_slstm_triton.py`` checks it against the torch form and the token-by-token reference, float64
included). Under ``torch.compile`` the scan is the torch form's (Dynamo traces it; Inductor fuses it).

What the interpreter can not confirm, a GPU must: the compiled kernels' numerics (tl.exp's float32 approximation,
tl.dot without TF32), their resource use and their speed.

Only the ``ltcx/ops/*_triton.py`` modules import Triton (``requirements-kernels.txt``; PyTorch's CUDA build brings
its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ltcx.errors import LtcxError
from ltcx.ops.mlstm import FORGET_GATES, state_dtype
from ltcx.ops.slstm import SLSTMState, recurrent_weights, slstm_init_state, slstm_scan_head_major
from ltcx.ops.written_backward import wants_written_backward

INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernels below run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""

MAPS_ON_CHIP_BYTES = 64 * 1024
"""The four recurrent maps are loaded once and held on chip across the loop up to this size (a 64 x 64 head in
float32; Triton stages tl.dot's operands in shared memory, all four at once); larger ones are read from cache each
step, one map's tile on chip at a time, so that the program fits a GPU's shared memory."""
BATCH_BLOCK_MAX = 64
"""The most batch rows one program runs (more rows: more programs per head)."""


# ----------------------------------------------------------------------------- element-wise pieces
# The kernels call Triton's builtins only (tl.full, not tl.zeros or tl.sigmoid): the standard library's @jit helpers
# are decorated when triton is imported, which Lightning does before a test can set TRITON_INTERPRET, and the
# interpreter can not call them compiled.


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _log_forget(f, EXP_FORGET: tl.constexpr):
    """log f: f~ for the exponential forget gate, else logsigmoid(f~) = min(f~, 0) - log(1 + exp(-|f~|))."""
    if EXP_FORGET:
        return f
    else:
        return tl.minimum(f, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(f)))


@triton.jit
def _gate_map(maps, g: tl.constexpr, offs, mask, col_stride, Dh, LOADED: tl.constexpr):
    """R_g ``[BLOCK_D, BLOCK_D]`` (rows: h_{t-1}'s units, columns: the gate's): ``maps`` itself when the maps were
    loaded once (a tuple of four tiles), else loaded now from ``maps``, the head's base pointer."""
    if LOADED:
        return maps[g]
    else:
        return tl.load(maps + offs + g * Dh * col_stride, mask=mask, other=0.0)


@triton.jit
def _load_maps(rec, offs, mask, col_stride, Dh, LOADED: tl.constexpr):
    if LOADED:
        return (tl.load(rec + offs, mask=mask, other=0.0),
                tl.load(rec + offs + Dh * col_stride, mask=mask, other=0.0),
                tl.load(rec + offs + 2 * Dh * col_stride, mask=mask, other=0.0),
                tl.load(rec + offs + 3 * Dh * col_stride, mask=mask, other=0.0))
    else:
        return rec


@triton.jit
def _program_tiles(rec, B, Dh, s_rh, s_rk, s_rw, MAPS_LOADED: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """This program's head, batch rows rb and units rd, the [BLOCK_B, BLOCK_D] mask of real lanes, and the head's
    recurrent maps (the offsets and mask of one map, and the maps: ``_load_maps``)."""
    head = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rd = tl.arange(0, BLOCK_D)
    mask = (rb < B)[:, None] & (rd < Dh)[None, :]
    map_mask = (rd < Dh)[:, None] & (rd < Dh)[None, :]
    map_offs = rd[:, None] * s_rk + rd[None, :] * s_rw
    return head, rb, rd, mask, map_offs, map_mask, _load_maps(rec + head * s_rh, map_offs, map_mask, s_rw, Dh,
                                                              MAPS_LOADED)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _scan_forward_kernel(
    steps, rec, c0, n0, h0, m0,  # steps [T, H, B, 4 Dh] strided; rec [H, Dh, 4 Dh] strided; state [B, H, Dh]
    hs, cs, ns, ms, pre,  # [H, T + 1, B, Dh] (slot 0: the state before the first step); pre [H, T, B, 4 Dh]
    c_out, n_out, h_out, m_out,  # [B, H, Dh]
    T, B, H, Dh,
    s_st, s_sh, s_sb, s_sw, s_rh, s_rk, s_rw,
    HAS_STATE: tl.constexpr, SAVE: tl.constexpr, EXP_FORGET: tl.constexpr, MAPS_LOADED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head, rb, rd, mask, map_offs, map_mask, maps = _program_tiles(rec, B, Dh, s_rh, s_rk, s_rw, MAPS_LOADED, BLOCK_B,
                                                                  BLOCK_D)

    state_offs = rb[:, None] * (H * Dh) + head * Dh + rd[None, :]  # [B, H, Dh]
    if HAS_STATE:
        c = tl.load(c0 + state_offs, mask=mask, other=0.0)
        n = tl.load(n0 + state_offs, mask=mask, other=1.0)
        h = tl.load(h0 + state_offs, mask=mask, other=0.0)
        m = tl.load(m0 + state_offs, mask=mask, other=0.0)
    else:  # the empty state; m = -inf only where a unit is real (padded lanes stay finite)
        c = tl.full((BLOCK_B, BLOCK_D), 0.0, hs.dtype.element_ty)
        n = tl.where(mask, 0.0, 1.0).to(hs.dtype.element_ty)
        h = tl.full((BLOCK_B, BLOCK_D), 0.0, hs.dtype.element_ty)
        m = tl.where(mask, float("-inf"), 0.0).to(hs.dtype.element_ty)

    buf_offs = rb[:, None] * Dh + rd[None, :]  # within one step of a [H, T + 1, B, Dh] buffer
    buf_step = B * Dh
    buf_head = head * (T + 1) * buf_step
    tl.store(hs + buf_head + buf_offs, h, mask=mask)
    if SAVE:
        tl.store(cs + buf_head + buf_offs, c, mask=mask)
        tl.store(ns + buf_head + buf_offs, n, mask=mask)
        tl.store(ms + buf_head + buf_offs, m, mask=mask)
    pre_offs = rb[:, None] * (4 * Dh) + rd[None, :]
    pre_step = pre + head * T * (4 * Dh) * B
    x_offs = rb[:, None] * s_sb + rd[None, :] * s_sw
    x_step = steps + head * s_sh
    gate = Dh * s_sw
    out_step = head * (T + 1) * buf_step
    for _ in range(T):  # the recurrence: pre = x_t + h_{t-1} R, then _cell's stabilised update
        out_step += buf_step
        pi = tl.dot(h, _gate_map(maps, 0, map_offs, map_mask, s_rw, Dh, MAPS_LOADED),
                    acc=tl.load(x_step + x_offs, mask=mask, other=0.0), input_precision="ieee")
        pf = tl.dot(h, _gate_map(maps, 1, map_offs, map_mask, s_rw, Dh, MAPS_LOADED),
                    acc=tl.load(x_step + x_offs + gate, mask=mask, other=0.0), input_precision="ieee")
        pz = tl.dot(h, _gate_map(maps, 2, map_offs, map_mask, s_rw, Dh, MAPS_LOADED),
                    acc=tl.load(x_step + x_offs + 2 * gate, mask=mask, other=0.0), input_precision="ieee")
        po = tl.dot(h, _gate_map(maps, 3, map_offs, map_mask, s_rw, Dh, MAPS_LOADED),
                    acc=tl.load(x_step + x_offs + 3 * gate, mask=mask, other=0.0), input_precision="ieee")
        log_f_m = _log_forget(pf, EXP_FORGET) + m
        m = tl.maximum(log_f_m, pi)
        ip = tl.exp(pi - m)
        fp = tl.exp(log_f_m - m)
        c = fp * c + ip * _tanh(pz)
        n = fp * n + ip
        h = tl.where(mask, _sigmoid(po) * c / n, 0.0)  # padded lanes stay out of the next product
        tl.store(hs + out_step + buf_offs, h, mask=mask)
        if SAVE:
            tl.store(cs + out_step + buf_offs, c, mask=mask)
            tl.store(ns + out_step + buf_offs, n, mask=mask)
            tl.store(ms + out_step + buf_offs, m, mask=mask)
            tl.store(pre_step + pre_offs, pi, mask=mask)
            tl.store(pre_step + pre_offs + Dh, pf, mask=mask)
            tl.store(pre_step + pre_offs + 2 * Dh, pz, mask=mask)
            tl.store(pre_step + pre_offs + 3 * Dh, po, mask=mask)
        pre_step += 4 * Dh * B
        x_step += s_st
    tl.store(c_out + state_offs, c, mask=mask)
    tl.store(n_out + state_offs, n, mask=mask)
    tl.store(h_out + state_offs, h, mask=mask)
    tl.store(m_out + state_offs, m, mask=mask)


@triton.jit
def _scan_backward_kernel(
    rec, hs, cs, ns, ms, pre,  # as the forward wrote them
    g_hs, g_c, g_n, g_h,  # g_hs [T, H, B, Dh] strided; the final state's [B, H, Dh]
    g_pre, g_c0, g_n0, g_h0, g_m0,  # g_pre [H, T, B, 4 Dh]; the given state's [B, H, Dh]
    T, B, H, Dh,
    s_rh, s_rk, s_rw, s_gt, s_gh, s_gb, s_gd,
    HAS_G_HS: tl.constexpr, HAS_G_C: tl.constexpr, HAS_G_N: tl.constexpr, HAS_G_H: tl.constexpr,
    EXP_FORGET: tl.constexpr, MAPS_LOADED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head, rb, rd, mask, map_offs, map_mask, maps = _program_tiles(rec, B, Dh, s_rh, s_rk, s_rw, MAPS_LOADED, BLOCK_B,
                                                                  BLOCK_D)
    dt = hs.dtype.element_ty

    state_offs = rb[:, None] * (H * Dh) + head * Dh + rd[None, :]
    # the gradients of c and n carried back from the step after, and of h through the next step's product
    g_cn_c = tl.full((BLOCK_B, BLOCK_D), 0.0, dt)
    g_cn_n = tl.full((BLOCK_B, BLOCK_D), 0.0, dt)
    g_h_next = tl.full((BLOCK_B, BLOCK_D), 0.0, dt)
    if HAS_G_C:
        g_cn_c = tl.load(g_c + state_offs, mask=mask, other=0.0)
    if HAS_G_N:
        g_cn_n = tl.load(g_n + state_offs, mask=mask, other=0.0)
    if HAS_G_H:
        g_h_next = tl.load(g_h + state_offs, mask=mask, other=0.0)

    buf_offs = rb[:, None] * Dh + rd[None, :]
    buf_step = B * Dh
    prev_step = head * (T + 1) * buf_step + T * buf_step  # slot t of [H, T + 1, B, Dh]: the state before step t
    pre_offs = rb[:, None] * (4 * Dh) + rd[None, :]
    pre_step = head * T * (4 * Dh) * B + (T - 1) * (4 * Dh) * B
    g_offs = rb[:, None] * s_gb + rd[None, :] * s_gd
    g_step = g_hs + head * s_gh + (T - 1) * s_gt
    for _ in range(T):  # t = T - 1 .. 0: _Scan.backward's step
        prev_step -= buf_step
        new_step = prev_step + buf_step
        g_ht = g_h_next
        if HAS_G_HS:
            g_ht += tl.load(g_step + g_offs, mask=mask, other=0.0)
        pi = tl.load(pre + pre_step + pre_offs, mask=mask, other=0.0)
        pf = tl.load(pre + pre_step + pre_offs + Dh, mask=mask, other=0.0)
        pz = tl.load(pre + pre_step + pre_offs + 2 * Dh, mask=mask, other=0.0)
        po = tl.load(pre + pre_step + pre_offs + 3 * Dh, mask=mask, other=0.0)
        c_prev = tl.load(cs + prev_step + buf_offs, mask=mask, other=0.0)
        n_prev = tl.load(ns + prev_step + buf_offs, mask=mask, other=1.0)
        m_prev = tl.load(ms + prev_step + buf_offs, mask=mask, other=0.0)
        n_t = tl.load(ns + new_step + buf_offs, mask=mask, other=1.0)
        m_t = tl.load(ms + new_step + buf_offs, mask=mask, other=0.0)
        h_t = tl.load(hs + new_step + buf_offs, mask=mask, other=0.0)
        # the forward's gates, recomputed from its pre-activations and stabilisers
        log_f = _log_forget(pf, EXP_FORGET)
        ip = tl.exp(pi - m_t)
        fp = tl.exp(log_f + m_prev - m_t)
        tz = _tanh(pz)
        so = _sigmoid(po)
        if EXP_FORGET:
            d_forget = fp
        else:
            d_forget = fp * _sigmoid(-pf)
        # h = so c / n
        g_cn_c += g_ht * so / n_t
        g_cn_n -= g_ht * h_t / n_t
        gi = tl.where(mask, (g_cn_c * tz + g_cn_n) * ip, 0.0)
        gf = tl.where(mask, (g_cn_c * c_prev + g_cn_n * n_prev) * d_forget, 0.0)
        gz = tl.where(mask, g_cn_c * ip * (1.0 - tz * tz), 0.0)
        go = tl.where(mask, g_ht * h_t * (1.0 - so), 0.0)
        tl.store(g_pre + pre_step + pre_offs, gi, mask=mask)
        tl.store(g_pre + pre_step + pre_offs + Dh, gf, mask=mask)
        tl.store(g_pre + pre_step + pre_offs + 2 * Dh, gz, mask=mask)
        tl.store(g_pre + pre_step + pre_offs + 3 * Dh, go, mask=mask)
        # h_{t-1} fed this step's pre-activations through R: g_pre R^T
        g_h_next = tl.dot(gi, tl.trans(_gate_map(maps, 0, map_offs, map_mask, s_rw, Dh, MAPS_LOADED)),
                          input_precision="ieee")
        g_h_next = tl.dot(gf, tl.trans(_gate_map(maps, 1, map_offs, map_mask, s_rw, Dh, MAPS_LOADED)),
                          acc=g_h_next, input_precision="ieee")
        g_h_next = tl.dot(gz, tl.trans(_gate_map(maps, 2, map_offs, map_mask, s_rw, Dh, MAPS_LOADED)),
                          acc=g_h_next, input_precision="ieee")
        g_h_next = tl.dot(go, tl.trans(_gate_map(maps, 3, map_offs, map_mask, s_rw, Dh, MAPS_LOADED)),
                          acc=g_h_next, input_precision="ieee")
        g_cn_c *= fp
        g_cn_n *= fp
        pre_step -= 4 * Dh * B
        g_step -= s_gt
    # the given state's gradients; m_0 enters through the first step's f' = exp(log f_1 + m_0 - m_1) alone
    c_first = tl.load(cs + prev_step + buf_offs, mask=mask, other=0.0)
    n_first = tl.load(ns + prev_step + buf_offs, mask=mask, other=0.0)
    tl.store(g_c0 + state_offs, g_cn_c, mask=mask)
    tl.store(g_n0 + state_offs, g_cn_n, mask=mask)
    tl.store(g_h0 + state_offs, g_h_next, mask=mask)
    tl.store(g_m0 + state_offs, g_cn_c * c_first + g_cn_n * n_first, mask=mask)


# ----------------------------------------------------------------------------- launches


def _blocks(B: int, Dh: int, dtype: torch.dtype) -> tuple[int, int, bool]:
    """(BLOCK_B, BLOCK_D, whether the four maps stay on chip across the loop)."""
    block_d = max(16, triton.next_power_of_2(Dh))
    block_b = max(16, min(BATCH_BLOCK_MAX, triton.next_power_of_2(B)))
    itemsize = torch.finfo(dtype).bits // 8
    return block_b, block_d, 4 * block_d * block_d * itemsize <= MAPS_ON_CHIP_BYTES


def _launch_options(block_d: int) -> dict:
    """One stage: the loop's loads wait on the recurrence, and Triton's pipelining would multiply the maps' buffers in
    shared memory. More warps for wider heads: fewer values per thread, so the compiler spills less."""
    return dict(num_stages=1, num_warps=min(16, max(4, block_d // 4)))


def _forward(steps: Tensor, rec: Tensor, state: SLSTMState | None, forget_gate: str, save: bool):
    """One launch of the forward kernel -> (hs ``[H, T + 1, B, Dh]`` with h_0 in slot 0, (c, n, h, m) ``[B, H, Dh]``
    after the last step, the saved (cs, ns, ms ``[H, T + 1, B, Dh]``, pre ``[H, T, B, 4 Dh]``) or None)."""
    T, H, B, width = steps.shape
    Dh = width // 4
    buf = dict(device=steps.device, dtype=steps.dtype)
    hs = torch.empty(H, T + 1, B, Dh, **buf)
    cs, ns, ms = (torch.empty(H, T + 1, B, Dh, **buf) if save else hs for _ in range(3))
    pre = torch.empty(H, T, B, width, **buf) if save else hs
    final = [torch.empty(B, H, Dh, **buf) for _ in range(4)]
    given = state if state is not None else (hs,) * 4  # not read without a state
    block_b, block_d, maps_loaded = _blocks(B, Dh, steps.dtype)
    _scan_forward_kernel[(H, triton.cdiv(B, block_b))](
        steps, rec, *given, hs, cs, ns, ms, pre, *final, T, B, H, Dh, *steps.stride(), *rec.stride(),
        HAS_STATE=state is not None, SAVE=save, EXP_FORGET=forget_gate == "exp", MAPS_LOADED=maps_loaded,
        BLOCK_B=block_b, BLOCK_D=block_d, **_launch_options(block_d),
    )
    return hs, tuple(final), ((cs, ns, ms, pre) if save else None)


class _TritonScan(torch.autograd.Function):
    """:class:`ltcx.ops.slstm._Scan` with both loops fused: the same inputs and outputs (steps ``[T, H, B, 4 Dh]``,
    recurrent ``[H, Dh, 4 Dh]``, the given state ``[B, H, Dh]`` each or None) -> (h ``[T, H, B, Dh]``, c, n, h, m
    ``[B, H, Dh]``), with m non-differentiable."""

    @staticmethod
    def forward(ctx, steps, recurrent, c0, n0, h0, m0, forget_gate):
        state = None if c0 is None else (c0, n0, h0, m0)
        hs, final, (cs, ns, ms, pre) = _forward(steps, recurrent, state, forget_gate, save=True)
        ctx.save_for_backward(recurrent, hs, cs, ns, ms, pre)
        ctx.forget_gate = forget_gate
        ctx.mark_non_differentiable(final[3])
        ctx.set_materialize_grads(False)  # an output nothing reads gets None: no zeros made or read
        return hs[:, 1:].transpose(0, 1), *final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_hs, g_c, g_n, g_h, _g_m):
        recurrent, hs, cs, ns, ms, pre = ctx.saved_tensors
        H, T, B, width = pre.shape
        Dh = width // 4
        g_pre = torch.empty_like(pre)
        given = [torch.empty(B, H, Dh, device=pre.device, dtype=pre.dtype) for _ in range(4)]  # c0, n0, h0, m0
        g_final = [g if g is None else g.contiguous() for g in (g_c, g_n, g_h)]
        block_b, block_d, maps_loaded = _blocks(B, Dh, pre.dtype)
        _scan_backward_kernel[(H, triton.cdiv(B, block_b))](
            recurrent, hs, cs, ns, ms, pre,
            *(g if g is not None else hs for g in (g_hs, *g_final)),
            g_pre, *given, T, B, H, Dh, *recurrent.stride(), *(g_hs.stride() if g_hs is not None else (0,) * 4),
            HAS_G_HS=g_hs is not None, HAS_G_C=g_c is not None, HAS_G_N=g_n is not None, HAS_G_H=g_h is not None,
            EXP_FORGET=ctx.forget_gate == "exp", MAPS_LOADED=maps_loaded, BLOCK_B=block_b, BLOCK_D=block_d,
            **_launch_options(block_d),
        )
        # R's gradient: the sum over steps of h_{t-1}^T g_pre_t, h_0 in the buffer's slot 0
        g_recurrent = torch.bmm(hs[:, :-1].reshape(H, T * B, Dh).transpose(1, 2), g_pre.view(H, T * B, width))
        wants = ctx.needs_input_grad[2:6]
        return (g_pre.transpose(0, 1), g_recurrent, *(g if w else None for g, w in zip(given, wants)), None)


def check_runnable(device: torch.device) -> None:
    """Raise the one-line error for a device the kernels can not run on: CUDA, or any under ``TRITON_INTERPRET=1``."""
    if device.type != "cuda" and not INTERPRETED:
        raise LtcxError(f"slstm_backend 'triton' runs on CUDA, not on {device.type}: use slstm_backend: torch on a "
                        "CPU, or set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter")


def slstm_scan_head_major_triton(
    steps: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid",
    recurrent: Tensor | None = None,
) -> tuple[Tensor, SLSTMState]:
    """:func:`ltcx.ops.slstm.slstm_scan_head_major` by the fused kernels: the same arguments and returns (steps
    ``[T, H, B, 4 Dh]`` any strides, R ``[4, H, Dh, Dh]``, state each ``[B, H, Dh]`` -> h ``[T, H, B, Dh]`` in steps'
    dtype and the state after the last step, float32, float64 for float64 steps)."""
    if forget_gate not in FORGET_GATES:
        raise ValueError(f"forget_gate ({forget_gate!r}) must be one of {FORGET_GATES}")
    if torch.compiler.is_compiling():  # Dynamo can not trace these launches: the torch form, fused by Inductor
        return slstm_scan_head_major(steps, R, state, forget_gate=forget_gate, recurrent=recurrent)
    check_runnable(steps.device)
    T, H, B, width = steps.shape
    Dh = width // 4
    cdt = state_dtype(steps.dtype)
    if T == 0:
        return steps.new_zeros(0, H, B, Dh), (state if state is not None else
                                              slstm_init_state(B, H, Dh, device=steps.device, dtype=cdt))
    recurrent = (recurrent_weights(R) if recurrent is None else recurrent).to(cdt)
    given = (None,) * 4 if state is None else tuple(s.to(cdt).contiguous() for s in state)
    inputs = (steps.to(cdt), recurrent, *given)
    if wants_written_backward(*inputs):
        hs, *final = _TritonScan.apply(*inputs, forget_gate)
    else:
        hs, final, _ = _forward(inputs[0], recurrent, None if state is None else given, forget_gate, save=False)
        hs = hs[:, 1:].transpose(0, 1)
    return hs.to(steps.dtype), tuple(final)


def slstm_scan_triton(
    gates_x: Tensor, R: Tensor, state: SLSTMState | None = None, *, forget_gate: str = "sigmoid"
) -> tuple[Tensor, SLSTMState]:
    """:func:`ltcx.ops.slstm.slstm_scan` by the fused kernels: gates_x ``[B, T, 4, H, Dh]`` -> h ``[B, T, H, Dh]``."""
    B, T, _, H, Dh = gates_x.shape
    steps = gates_x.permute(1, 3, 0, 2, 4).reshape(T, H, B, 4 * Dh)
    h, state = slstm_scan_head_major_triton(steps, R, state, forget_gate=forget_gate)
    return h.permute(2, 0, 1, 3), state
