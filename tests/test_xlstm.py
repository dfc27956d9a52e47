"""xLSTM: ops (parallel / chunkwise / recurrent mLSTM, sLSTM cell) against slow references, and the
model's token recurrence against its parallel forms, init and sizes (the backbone contract: tests/test_contract.py).

Where the seed repo (seeds/001) is wrong, a test here says so: its conv runs across features instead
of time, its normaliser clamps the signed n.q at 1 instead of max(|n.q|, exp(-m)), its forget gate is
an unbounded exp, its recurrent weights start as std-1 noise, its loss runs the recurrence over the
batch, and it loops over every token in training.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_written_backward, mlstm_inputs
from ltcx.errors import ConfigError
from ltcx.models import xlstm as xlstm_module
from ltcx.models.inference_cache import keeping_derived
from ltcx.models.xlstm import XLSTM, CausalConv1d, HeadwiseLinear, XLSTMConfig
from ltcx.ops import mlstm as mlstm_module
from ltcx.ops.mlstm import (
    EPS,
    FORGET_GATES,
    _chunk,
    _chunk_own,
    _chunk_starts,
    _ChunkOutputs,
    _ChunkOwn,
    _ChunkStarts,
    log_forget_gate,
    mlstm_chunkwise,
    mlstm_parallel,
    mlstm_recurrent,
    mlstm_step,
)
from ltcx.ops.naive.mlstm import mlstm_parallel_naive
from ltcx.ops.naive.slstm import slstm_reference
from ltcx.ops.slstm import _Scan, _scan_loop, recurrent_weights, slstm_scan, slstm_scan_head_major, slstm_step

F64 = dict(rtol=1e-9, atol=1e-9)
F32_REL_TOL = 5e-4  # float32 forms vs the float64 recurrence: max |err| <= 5e-4 * max |h|


# ----------------------------------------------------------------------------- helpers


pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("one_thread")]  # tiny tensors: see conftest.py


def _assert_states_close(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


def _tiny_model(dtype=torch.float64, **overrides) -> XLSTM:
    kw = dict(vocab_size=37, n_embd=32, n_layer=3, slstm_at=[1], n_head=2, slstm_n_head=2,
              chunk_size=4, qkv_proj_blocksize=4)
    kw.update(overrides)
    torch.manual_seed(0)
    model = XLSTM(**kw).to(dtype).eval()
    # perturb the gate parameters away from their (input-independent) init so the tests see real gating
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name or name.endswith(".R") or "skip" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


# ----------------------------------------------------------------------------- mLSTM ops


@pytest.mark.parametrize("f_bias", [8.0, -3.0, 0.0], ids=["strong-forget", "weak-forget", "mid-forget"])
@pytest.mark.parametrize("with_state", [False, True], ids=["empty-state", "initial-state"])
def test_mlstm_forms_agree_float64(f_bias, with_state):
    q, k, v, i_pre, f_pre = mlstm_inputs(f_bias=f_bias)
    state = None
    if with_state:  # a realistic non-zero state: the recurrence run over an unrelated prefix
        pq, pk, pv, pi, pf = mlstm_inputs(T=9, f_bias=f_bias, seed=1)
        _, state = mlstm_recurrent(pq, pk, pv, pi, pf)
        assert state[0].abs().max() > 0 and torch.isfinite(state[2]).all()
    h_rec, s_rec = mlstm_recurrent(q, k, v, i_pre, f_pre, state)
    h_par, s_par = mlstm_parallel(q, k, v, i_pre, f_pre, state)
    torch.testing.assert_close(h_par, h_rec, **F64)
    _assert_states_close(s_par, s_rec, **F64)
    for chunk in (1, 4, 8, 36, 37, 64):  # divides T=37 or not, smaller and larger than T
        h_ch, s_ch = mlstm_chunkwise(q, k, v, i_pre, f_pre, state, chunk_size=chunk)
        torch.testing.assert_close(h_ch, h_rec, **F64)
        _assert_states_close(s_ch, s_rec, **F64)


@pytest.mark.parametrize("chunk", [3, 4, 12], ids=["partial-last-chunk", "chunks-cover-T", "one-chunk-and-a-part"])
@pytest.mark.parametrize("with_state", [False, True], ids=["empty-state", "carried-state"])
def test_mlstm_chunkwise_gradients_equal_the_recurrence_float64(chunk, with_state):
    """Gradients of every input (q, k, v, both gates, and each part of a carried state C, n, m), through h and the
    returned state, equal autograd of the token-by-token recurrence: the carry across chunks (the closed form over
    chunks, its stabiliser the running maximum) differentiated as the recurrence is."""
    q, k, v, i_pre, f_pre = mlstm_inputs(T=16, f_bias=1.0)
    state = ()
    if with_state:
        _, state = mlstm_recurrent(*mlstm_inputs(T=5, f_bias=1.0, seed=1))
    g = torch.Generator().manual_seed(4)
    cotangents = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
                  (q.shape, (2, 3, 8, 8), (2, 3, 8), (2, 3))]

    def grads(form):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, i_pre, f_pre, *state)]
        h, final = form(*leaves[:5], tuple(leaves[5:]) or None)
        loss = sum((x * c).sum() for x, c in zip((h, *final), cotangents))
        return torch.autograd.grad(loss, leaves)

    got = grads(functools.partial(mlstm_chunkwise, chunk_size=chunk))
    want = grads(mlstm_recurrent)
    assert len(got) == (8 if with_state else 5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)


def test_mlstm_chunkwise_many_strongly_decaying_chunks_float32():
    """40 chunks whose forget gates decay hard (log f ~ -3 a step): values, state and gradients in float32 within
    tolerance of the float64 recurrence (the carry's log weights are sums over up to 39 chunks)."""
    args64 = mlstm_inputs(B=1, H=2, T=123, D=8, f_bias=-3.0)
    cot = torch.randn(args64[0].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(form, args):
        leaves = [x.clone().requires_grad_() for x in args]
        h, state = form(*leaves)
        return h, state, torch.autograd.grad((h * cot.to(h.dtype)).sum() + state[0].sum(), leaves)

    h_ref, s_ref, g_ref = run(mlstm_recurrent, args64)
    h, s, g = run(functools.partial(mlstm_chunkwise, chunk_size=3), [x.float() for x in args64])
    assert (h.double() - h_ref).abs().max() <= F32_REL_TOL * h_ref.abs().max()
    for x, ref in zip((*s[:2], *g), (*s_ref[:2], *g_ref)):
        assert (x.double() - ref).abs().max() <= F32_REL_TOL * ref.abs().max()
    torch.testing.assert_close(s[2].double(), s_ref[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["parallel", "chunkwise-one-block", "chunkwise"])
def test_mlstm_empty_state_leaves_its_terms_out_exactly(form):
    """From no state (None), the forms leave the empty state's terms out (their weight is exp(-inf) = 0): outputs,
    state and every input's gradient equal those from an explicit zero state (C = 0, n = 0, m = -inf) to the bit, in
    float32. "chunkwise" (two full chunks and a partial one): the zero state's column in the product over chunks
    changes the backward products' shapes, so its gradients agree to float32 rounding, finite."""
    from ltcx.ops.mlstm import mlstm_init_state

    inputs = [x.float().requires_grad_() for x in mlstm_inputs(T=12)]
    chunk_size = {"parallel": None, "chunkwise-one-block": 16, "chunkwise": 5}[form]
    call = mlstm_parallel if chunk_size is None else functools.partial(mlstm_chunkwise, chunk_size=chunk_size)
    cotangent = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3))
    results = []
    for state in (None, mlstm_init_state(2, 3, 8)):
        h, (C, n, m) = call(*inputs, state)
        grads = torch.autograd.grad((h * cotangent).sum() + C.sum() + n.sum(), inputs)
        results.append((h, C, n, m, *grads))
    for index, (got, expected) in enumerate(zip(*results)):
        if form == "chunkwise" and index >= 4:
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, expected)


def test_mlstm_exponential_forget_gate_forms_agree():
    q, k, v, i_pre, f_pre = mlstm_inputs(f_bias=-0.5)
    h_rec, s_rec = mlstm_recurrent(q, k, v, i_pre, f_pre, forget_gate="exp")
    for h, s in (mlstm_parallel(q, k, v, i_pre, f_pre, forget_gate="exp"),
                 mlstm_chunkwise(q, k, v, i_pre, f_pre, chunk_size=5, forget_gate="exp")):
        torch.testing.assert_close(h, h_rec, **F64)
        _assert_states_close(s, s_rec, **F64)


@pytest.mark.parametrize("f_bias", [8.0, -3.0])
def test_mlstm_forms_float32_within_tolerance(f_bias):
    args64 = mlstm_inputs(T=150, D=16, f_bias=f_bias)
    h_ref, s_ref = mlstm_recurrent(*args64)
    args32 = [x.float() for x in args64]
    scale = h_ref.abs().max()
    for h, s in (mlstm_parallel(*args32), mlstm_chunkwise(*args32, chunk_size=64),
                 mlstm_chunkwise(*args32, chunk_size=7), mlstm_recurrent(*args32)):
        assert h.dtype == torch.float32 and all(x.dtype == torch.float32 for x in s)  # states kept in float32
        assert (h.double() - h_ref).abs().max() <= F32_REL_TOL * scale
        assert (s[0].double() - s_ref[0]).abs().max() <= F32_REL_TOL * s_ref[0].abs().max()


def test_mlstm_bf16_inputs_keep_float32_state():
    q, k, v, i_pre, f_pre = mlstm_inputs(T=20, dtype=torch.float32)
    h, (C, n, m) = mlstm_chunkwise(*(x.bfloat16() for x in (q, k, v)), i_pre, f_pre, chunk_size=8)
    assert h.dtype == torch.bfloat16 and C.dtype == n.dtype == m.dtype == torch.float32
    h_ref, _ = mlstm_chunkwise(q, k, v, i_pre, f_pre, chunk_size=8)
    assert (h.float() - h_ref).abs().max() <= 0.05 * h_ref.abs().max()


def test_mlstm_parallel_equals_formula_written_out():
    """log D_ij = sum_{l=j+1..i} log f_l + i~_j, m_i = max_j log D_ij, C = (q k^T/sqrt(d)) exp(log D - m),
    h_i = sum_j C_ij v_j / (max(|sum_j C_ij|, exp(-m_i)) + eps), built with plain loops."""
    q, k, v, i_pre, f_pre = mlstm_inputs(B=1, H=1, T=6, D=3, f_bias=1.0, seed=3)
    q, k, v, i_pre, f_pre = q[0, 0], k[0, 0], v[0, 0], i_pre[0, 0], f_pre[0, 0]
    h_ref = mlstm_parallel_naive(q, k, v, i_pre, f_pre)
    h, _ = mlstm_parallel(q[None, None], k[None, None], v[None, None], i_pre[None, None], f_pre[None, None])
    torch.testing.assert_close(h[0, 0], h_ref, **F64)


def test_mlstm_stabilised_equals_unstabilised_recurrence_and_normaliser_uses_abs():
    """Without eps the stabiliser cancels: h_t = C_t^T q_t / max(|n_t . q_t|, 1) with the plain
    C_t = f_t C + exp(i~_t) k v^T, n_t = f_t n + exp(i~_t) k. The seed clamps the *signed* n.q at 1
    instead, which is wrong whenever n.q < -1: this case has such steps."""
    g = torch.Generator().manual_seed(5)
    T, D = 8, 4
    k = torch.randn(T, D, generator=g, dtype=torch.float64)
    q = -2.0 * k.cumsum(0)  # q anti-aligned with the accumulated keys: n.q strongly negative
    v = torch.randn(T, D, generator=g, dtype=torch.float64)
    i_pre = torch.randn(T, generator=g, dtype=torch.float64)
    f_pre = torch.randn(T, generator=g, dtype=torch.float64) + 2.0
    ks = k / math.sqrt(D)
    C = torch.zeros(D, D, dtype=torch.float64)
    n = torch.zeros(D, dtype=torch.float64)
    h_ref, seed_h, negative = [], [], 0
    for t in range(T):
        f, i = torch.sigmoid(f_pre[t]), torch.exp(i_pre[t])
        C = f * C + i * torch.outer(ks[t], v[t])
        n = f * n + i * ks[t]
        nq = n @ q[t]
        negative += int(nq < -1)
        h_ref.append(C.T @ q[t] / torch.clamp(nq.abs(), min=1.0))
        seed_h.append(C.T @ q[t] / torch.clamp(nq, min=1.0))
    h_ref, seed_h = torch.stack(h_ref), torch.stack(seed_h)
    assert negative > 0
    args = [x[None, None] for x in (q, k, v, i_pre, f_pre)]
    for h, _ in (mlstm_parallel(*args, eps=0.0), mlstm_chunkwise(*args, chunk_size=3, eps=0.0),
                 mlstm_recurrent(*args, eps=0.0)):
        torch.testing.assert_close(h[0, 0], h_ref, **F64)
        assert not torch.allclose(h[0, 0], seed_h)


def test_mlstm_step_matches_one_token_parallel():
    q, k, v, i_pre, f_pre = mlstm_inputs(T=1)
    h_step, s_step = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, 0], f_pre[:, :, 0])
    h_par, s_par = mlstm_parallel(q, k, v, i_pre, f_pre)
    torch.testing.assert_close(h_step, h_par[:, :, 0], **F64)
    _assert_states_close(s_step, s_par, **F64)


def test_mlstm_chunkwise_long_float32_is_finite_with_finite_gradients():
    q, k, v, i_pre, f_pre = (x.requires_grad_() for x in mlstm_inputs(B=1, H=2, T=300, D=8, f_bias=6.0,
                                                                      dtype=torch.float32))
    h, (C, n, m) = mlstm_chunkwise(q, k, v, 5.0 * i_pre, f_pre, chunk_size=64)
    (h.square().mean() + C.mean()).backward()
    for x in (h, C, n, m, q.grad, k.grad, v.grad, i_pre.grad, f_pre.grad):
        assert torch.isfinite(x).all()


# ----------------------------------------------------------------------------- sLSTM ops


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("state", ["empty", "given", "stacked chunks"])
@pytest.mark.parametrize("L", [1, 7])
def test_mlstm_chunk_backward_equals_autograd_of_its_forward(forget_gate, state, L):
    """The chunk's hand-written backward (``_ChunkOutputs``) against autograd of the same forward (``_chunk``), float64:
    the gradients of q, k, v, both gates and every part of a given state (C, n, and the stabiliser m, which enters
    through the carried state's weight). "stacked chunks" is the chunkwise form's call: three chunks at once, the first
    from the empty state (m = -inf, C = n = 0), the others from given states."""
    g = torch.Generator().manual_seed(5)
    B, H, D = 2, 3, 4
    lead = (B, H, 3) if state == "stacked chunks" else (B, H)
    q, k, v = (torch.randn(*lead, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    log_i = torch.randn(*lead, L, generator=g, dtype=torch.float64)
    f_pre = torch.randn(*lead, L, generator=g, dtype=torch.float64) + (3.0 if forget_gate == "sigmoid" else -0.2)
    log_f = log_forget_gate(f_pre, forget_gate)
    given = () if state == "empty" else (torch.randn(*lead, D, D, generator=g, dtype=torch.float64),
                                         torch.randn(*lead, D, generator=g, dtype=torch.float64),
                                         torch.randn(*lead, generator=g, dtype=torch.float64))
    if state == "stacked chunks":
        given[0][:, :, 0], given[1][:, :, 0], given[2][:, :, 0] = 0.0, 0.0, float("-inf")
    cotangent = torch.randn(*lead, L, D, generator=g, dtype=torch.float64)

    extra = (*(() if given else (None,) * 3), EPS)
    _, got_grads = assert_written_backward(_ChunkOutputs.apply, _chunk, (q, k, v, log_i, log_f, *given), [cotangent],
                                           *extra)
    if state == "stacked chunks":
        assert torch.isfinite(got_grads[-1]).all() and (got_grads[-1][:, :, 0] == 0).all()


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("L", [1, 6])
def test_mlstm_chunk_own_backward_equals_autograd_of_its_forward(forget_gate, L):
    """Each chunk's own state contribution with its hand-written backward (``_ChunkOwn``) against autograd of the same
    forward (``_chunk_own``), float64: the gradients of k, v and both gates through C, n, m and the chunk's total log
    decay, four chunks at once."""
    g = torch.Generator().manual_seed(8)
    lead, D = (2, 3, 4), 3
    k, v = (torch.randn(*lead, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    log_i = 2.0 * torch.randn(*lead, L, generator=g, dtype=torch.float64)
    f_pre = torch.randn(*lead, L, generator=g, dtype=torch.float64) + (2.0 if forget_gate == "sigmoid" else -0.3)
    log_f = log_forget_gate(f_pre, forget_gate)
    cotangents = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
                  ((*lead, D, D), (*lead, D), lead, lead)]

    assert_written_backward(_ChunkOwn.apply, _chunk_own, (k, v, log_i, log_f), cotangents)


@pytest.mark.parametrize("given", ["empty", "state", "empty state given"])
@pytest.mark.parametrize("extra_row", [False, True], ids=["N-starts", "and-the-end"])
def test_mlstm_chunk_starts_backward_equals_autograd_of_its_forward(given, extra_row):
    """The chunk starts' hand-written backward (``_ChunkStarts``) against autograd of the same forward
    (``_chunk_starts``), float64: the gradients of every column's C, n, m (a given state's column included) and of the
    chunks' log decays, through C, n and m of every row. "empty state given": its column has m = -inf, so row 0 has
    no finite weight (C = n = 0, no gradient, no NaN)."""
    g = torch.Generator().manual_seed(6)
    B, H, N, D = 2, 3, 4, 3
    columns = N + (given != "empty")
    C_loc = torch.randn(B, H, columns, D, D, generator=g, dtype=torch.float64)
    n_loc = torch.randn(B, H, columns, D, generator=g, dtype=torch.float64)
    m_loc = 3.0 * torch.randn(B, H, columns, generator=g, dtype=torch.float64)
    b_last = -4.0 * torch.rand(B, H, N, generator=g, dtype=torch.float64)
    if given == "empty state given":
        C_loc[:, :, 0], n_loc[:, :, 0], m_loc[:, :, 0] = 0.0, 0.0, float("-inf")
    rows = N + extra_row
    cotangents = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
                  ((B, H, rows, D, D), (B, H, rows, D), (B, H, rows))]

    got, got_grads = assert_written_backward(_ChunkStarts.apply, _chunk_starts, (C_loc, n_loc, m_loc, b_last),
                                             cotangents, rows)
    assert all(torch.isfinite(grad).all() for grad in got_grads)
    if given == "empty state given":
        assert (got[0][:, :, 0] == 0).all() and (got_grads[2][:, :, 0] == 0).all()


def test_mlstm_chunk_under_autocast_is_autograds(monkeypatch):
    """Under bf16 autocast the chunks' products (and those of their own states and starts) run in bf16, which the
    written-out backwards (float32) would not mirror: there the chunkwise form's gradients are autograd's; outside
    autocast they are the written-out backwards'."""
    inputs = mlstm_inputs(2, 2, 12, 8, dtype=torch.float32, seed=3)
    for function in (mlstm_module._ChunkOutputs, mlstm_module._ChunkStarts, mlstm_module._ChunkOwn):
        monkeypatch.setattr(function, "apply", lambda *args: pytest.fail("the written-out backward"))

    def grads(autocast: bool):
        leaves = [x.clone().requires_grad_() for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h, _ = mlstm_chunkwise(*leaves, chunk_size=4, with_state=False)
        return torch.autograd.grad(h.float().square().sum(), leaves)

    assert all(torch.isfinite(g).all() for g in grads(autocast=True))
    with pytest.raises(pytest.fail.Exception, match="the written-out backward"):
        grads(autocast=False)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_slstm_cell_equals_token_by_token_transcription(forget_gate):
    g = torch.Generator().manual_seed(7)
    B, T, H, Dh = 2, 13, 3, 4
    gates_x = torch.randn(B, T, 4, H, Dh, generator=g, dtype=torch.float64)
    gates_x[:, :, 1] += 2.0 if forget_gate == "sigmoid" else -0.5
    R = 0.5 * torch.randn(4, H, Dh, Dh, generator=g, dtype=torch.float64)
    h, state = slstm_scan(gates_x, R, forget_gate=forget_gate)
    torch.testing.assert_close(h, slstm_reference(gates_x, R, forget_gate), rtol=1e-10, atol=1e-12)
    assert (state[1] >= 1.0 - 1e-12).all()  # stabilised normaliser n_t >= 1
    # in pieces with the state == whole, and the step == one-token scan
    h1, s1 = slstm_scan(gates_x[:, :5], R, forget_gate=forget_gate)
    h2, s2 = slstm_scan(gates_x[:, 5:], R, s1, forget_gate=forget_gate)
    torch.testing.assert_close(torch.cat([h1, h2], 1), h, **F64)
    _assert_states_close(s2, state, **F64)
    h_step, _ = slstm_step(gates_x[:, 5], R, s1, forget_gate=forget_gate)
    torch.testing.assert_close(h_step, h2[:, 0], **F64)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_slstm_scan_gradients_equal_the_unstabilised_equations(forget_gate):
    """The scan's stabiliser m carries no gradient (ltcx/ops/slstm.py ``_cell``): the gradients of the inputs and of
    R still equal autograd of the paper's unstabilised equations in float64, whole and fed in two pieces with the
    state between them (where m crosses from one call to the next)."""
    g = torch.Generator().manual_seed(9)
    B, T, H, Dh = 2, 11, 3, 4
    gates_x = torch.randn(B, T, 4, H, Dh, generator=g, dtype=torch.float64)
    gates_x[:, :, 1] += 2.0 if forget_gate == "sigmoid" else -0.5
    R = 0.5 * torch.randn(4, H, Dh, Dh, generator=g, dtype=torch.float64)
    cotangent = torch.randn(B, T, H, Dh, generator=g, dtype=torch.float64)

    def gradients(run):
        inputs = (gates_x.clone().requires_grad_(), R.clone().requires_grad_())
        return torch.autograd.grad((run(*inputs) * cotangent).sum(), inputs)

    def in_pieces(x, r):
        h1, state = slstm_scan(x[:, :4], r, forget_gate=forget_gate)
        h2, _ = slstm_scan(x[:, 4:], r, state, forget_gate=forget_gate)
        return torch.cat([h1, h2], dim=1)

    expected = gradients(lambda x, r: slstm_reference(x, r, forget_gate))
    for run in (lambda x, r: slstm_scan(x, r, forget_gate=forget_gate)[0], in_pieces):
        for got, want in zip(gradients(run), expected):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("outputs_read", ["all", "outputs only", "state only"])
@pytest.mark.parametrize("T", [1, 9])
def test_slstm_scan_backward_equals_autograd_of_its_loop(forget_gate, outputs_read, T):
    """The scan's hand-written backward (``_Scan``) against autograd of the same loop (``_scan_loop``), float64: the
    gradients of the steps, of R's rearranged maps and of every part of a given state (c, n, h and the stabiliser m,
    which enters through the first step's forget gate), with cotangents on the outputs, on the final state, or both."""
    g = torch.Generator().manual_seed(11)
    H, B, Dh = 3, 2, 4
    steps = torch.randn(T, H, B, 4 * Dh, generator=g, dtype=torch.float64)
    steps[..., Dh:2 * Dh] += 2.0 if forget_gate == "sigmoid" else -0.5
    recurrent = recurrent_weights(0.5 * torch.randn(4, H, Dh, Dh, generator=g, dtype=torch.float64))
    c0, h0, m0 = (torch.randn(H, B, Dh, generator=g, dtype=torch.float64) for _ in range(3))
    n0 = 1.0 + torch.rand(H, B, Dh, generator=g, dtype=torch.float64)
    cotangents = [torch.randn(T, H, B, Dh, generator=g, dtype=torch.float64)]
    cotangents += [torch.randn(H, B, Dh, generator=g, dtype=torch.float64) for _ in range(3)]  # c, n, h
    read = {"all": [0, 1, 2, 3], "outputs only": [0], "state only": [1, 2, 3]}[outputs_read]

    def run(scan):
        inputs = [x.clone().requires_grad_() for x in (steps, recurrent, c0, n0, h0, m0)]
        outputs = scan(*inputs, forget_gate)
        loss = sum((outputs[k] * cotangents[k]).sum() for k in read)
        return outputs, torch.autograd.grad(loss, inputs)

    (got, got_grads), (want, want_grads) = run(_Scan.apply), run(_scan_loop)
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert not got[-1].requires_grad  # the stabiliser carries no gradient out, as in the loop


def test_slstm_gate_biases_are_added_in_float32_under_bf16_autocast(monkeypatch):
    """Under bf16 autocast the sLSTM block's input products run in bf16, but its gate biases (the forget gates' +5..-7)
    are added in float32, as NX-AI's cell adds them: an input's contribution far below bf16's step at the bias
    (1/32 at 5) still reaches the scan."""
    model = _tiny_model(dtype=torch.float32)
    block = model.blocks[1]
    with torch.no_grad():
        block.gate_bias.fill_(5.0)
        block.w_in.fill_(1e-4)
    seen = {}

    def capture(steps, *args, **kwargs):
        seen["steps"] = steps
        return original(steps, *args, **kwargs)

    original = xlstm_module.slstm_scan_head_major
    monkeypatch.setattr(xlstm_module, "slstm_scan_head_major", capture)
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    steps = seen["steps"]
    assert steps.dtype == torch.float32
    assert (steps != 5.0).float().mean() > 0.9  # the products survive beside the bias


def test_slstm_memory_mixing_stays_within_heads():
    g = torch.Generator().manual_seed(8)
    gates_x = torch.randn(1, 6, 4, 2, 3, generator=g, dtype=torch.float64)
    R = torch.randn(4, 2, 3, 3, generator=g, dtype=torch.float64)
    h, _ = slstm_scan(gates_x, R)
    gates_x2 = gates_x.clone()
    gates_x2[:, :, :, 1] += 1.0  # only head 1's inputs change
    h2, _ = slstm_scan(gates_x2, R)
    torch.testing.assert_close(h2[:, :, 0], h[:, :, 0], rtol=0, atol=0)
    assert not torch.allclose(h2[:, :, 1], h[:, :, 1])


# ----------------------------------------------------------------------------- model contract


@pytest.mark.parametrize("backend", ["chunkwise", "parallel"])
def test_model_token_recurrence_equals_the_parallel_forms_float64(backend):
    """forward_recurrent (every block token by token: the recurrence as written) gives the chunkwise and parallel
    forms' logits (pieces with the state == whole: tests/test_contract.py, for each catalogued backend)."""
    model = _tiny_model(mlstm_backend=backend)
    assert model.config.block_types == ["m", "s", "m"] and model.max_seq_len is None
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, state = model(idx)
        assert logits.shape == (2, 16, 37) and logits.dtype == torch.float64
        step_logits, step_state = model.forward_recurrent(idx)
        torch.testing.assert_close(step_logits, logits, **F64)
        _assert_states_close([t for blk in step_state for t in blk], [t for blk in state for t in blk], **F64)


def test_mlstm_block_equals_its_equations_written_out():
    """The mLSTM block (xLSTM paper, Fig. 10 / NX-AI's mLSTMLayer) from its parameters, every map written out
    (block-diagonal q/k/v as dense block_diag matrices, the causal conv as a sum over taps, one mLSTM head at a time
    by the formula's loops), float64: catches a swapped gate, a wrong input to a projection, a missing skip."""
    from ltcx.ops.naive.mlstm import mlstm_parallel_naive

    model = _tiny_model()
    block = model.blocks[0]
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    B, T, E, H = 2, 7, block.norm.normalized_shape[0], block.n_head
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        got, _ = block(x)

    def linear(layer, u):
        return u @ layer.weight.t() + (0 if layer.bias is None else layer.bias)

    def dense(headwise):  # [n, out, in] blocks -> the [out, in] block-diagonal matrix
        return torch.block_diag(*headwise.weight)

    want = torch.empty_like(x)
    with torch.no_grad():
        for b in range(B):
            u = F.layer_norm(x[b], (E,), block.norm.weight, block.norm.bias, block.norm.eps)
            up = linear(block.proj_up, u)
            inner = up.shape[-1] // 2
            x_m, z = up[:, :inner], up[:, inner:]
            taps = block.conv.weight[:, 0]  # [I, K]: out_t = bias + sum_j taps[:, j] x_{t-K+1+j}
            K = taps.shape[1]
            conv = torch.stack([block.conv.bias + sum(taps[:, j] * x_m[t - K + 1 + j] for j in range(K)
                                                      if t - K + 1 + j >= 0) for t in range(T)])
            x_c = conv * torch.sigmoid(conv)
            q, k, v = x_c @ dense(block.q_proj).t(), x_c @ dense(block.k_proj).t(), x_m @ dense(block.v_proj).t()
            qkv = torch.cat([q, k, v], dim=-1)
            i_pre, f_pre = linear(block.igate, qkv), linear(block.fgate, qkv)  # [T, H]
            Dh = inner // H
            heads = [mlstm_parallel_naive(q[:, s], k[:, s], v[:, s], i_pre[:, j], f_pre[:, j])
                     for j, s in enumerate(slice(j * Dh, (j + 1) * Dh) for j in range(H))]
            normed = torch.cat([F.layer_norm(h, (Dh,), eps=block.out_norm.eps) for h in heads], dim=-1)
            normed = normed * block.out_norm.weight + (0 if block.out_norm.bias is None else block.out_norm.bias)
            out = (normed + block.skip * x_c) * (z * torch.sigmoid(z))
            want[b] = x[b] + linear(block.proj_down, out)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_slstm_block_equals_its_equations_written_out():
    """The sLSTM block and its gated feed-forward (xLSTM paper, Fig. 9) from its parameters, written out head by
    head: i, f from the convolved input, z, o from the normed input, the unstabilised recurrence of the paper
    (slstm_reference), the per-head norm, then x + W_down(GELU(gate) * up). float64."""
    model = _tiny_model()
    block = model.blocks[1]
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    B, T, E, H, Dh = 2, 7, block.norm.normalized_shape[0], block.n_head, block.head_dim
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        got, _ = block(x)
        xn = F.layer_norm(x, (E,), block.norm.weight, block.norm.bias, block.norm.eps)
        taps, K = block.conv.weight[:, 0], block.conv.weight.shape[-1]  # out_t = bias + sum_j taps[:, j] x_{t-K+1+j}
        padded = torch.cat([xn.new_zeros(B, K - 1, E), xn], dim=1)
        conv = block.conv.bias + sum(taps[:, j] * padded[:, j:j + T] for j in range(K))
        x_c = conv * torch.sigmoid(conv)
        gates = torch.empty(B, T, 4, H, Dh, dtype=torch.float64)
        for j in range(H):
            heads = slice(j * Dh, (j + 1) * Dh)
            i_f = x_c[..., heads] @ block.w_in[0, j]  # [B, T, 2 Dh]: i~, f~ from the convolved input
            z_o = xn[..., heads] @ block.w_in[1, j]  # z~, o~ from the normed input
            for g, part in enumerate((i_f[..., :Dh], i_f[..., Dh:], z_o[..., :Dh], z_o[..., Dh:])):
                gates[:, :, g, j] = part + block.gate_bias[g, j]
        h = slstm_reference(gates, block.R, block.forget_gate)  # [B, T, H, Dh]
        normed = F.layer_norm(h, (Dh,), eps=block.out_norm.eps).flatten(-2) * block.out_norm.weight
        y = x + normed + (0 if block.out_norm.bias is None else block.out_norm.bias)
        up = F.linear(F.layer_norm(y, (E,), block.ffn_norm.weight, block.ffn_norm.bias, block.ffn_norm.eps),
                      block.ffn_up.weight, block.ffn_up.bias)
        u, gate = up.chunk(2, dim=-1)
        want = y + F.linear(F.gelu(gate) * u, block.ffn_down.weight, block.ffn_down.bias)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_generation_keeps_the_rearranged_recurrence_until_r_changes():
    """Within a generation (``keeping_derived``) the sLSTM block keeps R rearranged ([H, Dh, 4 Dh]) between decode
    steps; a write into R rebuilds it, so the next step equals a model built with the new R; leaving the scope
    drops it."""
    model = _tiny_model()
    block = model.blocks[1]
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), keeping_derived(model):
        _, state = model(idx[:, :5])
        model(idx[:, 5:], state)
        kept = block.__dict__["_derived_recurrent"][1]
        model(idx[:, 5:], state)
        assert block.__dict__["_derived_recurrent"][1] is kept
        block.R.add_(0.05)
        model(idx[:, 5:], state)
        fresh = _tiny_model()
        fresh.load_state_dict(model.state_dict())
        _, fresh_state = fresh(idx[:, :5])
        expected, _ = fresh(idx[:, 5:], fresh_state)
        assert block.__dict__["_derived_recurrent"][1] is not kept
    assert "_derived_recurrent" not in block.__dict__
    _, prefix_state = model(idx[:, :5])  # the prefix under the new R too (gradients on: nothing kept)
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, 5:], prefix_state)[0], expected, **F64)


def test_model_float32_stepwise_close_to_full():
    model = _tiny_model(dtype=torch.float32)
    idx = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        step, _ = model.forward_recurrent(idx)
    assert (step - full).abs().max() <= 1e-4 * full.abs().max()


def test_causal_conv_runs_over_time_not_features():
    """The seed's conv mixes the features of one time step; this one is depthwise over time:
    an impulse at time t0 moves outputs t0 .. t0+K-1 of that channel only."""
    conv = CausalConv1d(channels=5, kernel_size=4).double()
    x = torch.zeros(1, 10, 5, dtype=torch.float64)
    x[0, 3, 2] = 1.0
    base, _ = conv(torch.zeros_like(x))
    y, _ = conv(x)
    moved = (y - base).abs() > 0
    assert moved[0, :, [0, 1, 3, 4]].sum() == 0
    assert moved[0, :, 2].nonzero().flatten().tolist() == [3, 4, 5, 6]
    # streamed with its buffer == whole
    y1, buf = conv(x[:, :4])
    y2, _ = conv(x[:, 4:], buf)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, **F64)


@pytest.mark.parametrize("dim,block", [(32, 4), (52, 4), (24, 2), (64, 32)])
def test_headwise_product_equals_the_blocks_one_by_one(dim, block):
    """``HeadwiseLinear``'s batched product over the blocks equals each block's own product, y[n] = W[n] x[n], and so
    do the gradients of the input and the weight (autograd of the block-by-block form), in float64; an input that is
    a view (the up-projection's half, as the v map reads it) gives the same."""
    torch.manual_seed(0)
    layer = HeadwiseLinear(dim, block).double()
    assert layer.weight.shape == (dim // block, block, block)  # [blocks, out, in]: checkpoints depend on it
    wide = torch.randn(3, 5, 2 * dim, dtype=torch.float64, requires_grad=True)
    x = wide[..., dim:]
    y = layer(x)
    want = torch.cat([x[..., n * block:(n + 1) * block] @ layer.weight[n].t() for n in range(dim // block)], -1)
    torch.testing.assert_close(y, want, **F64)
    cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for got, ref in zip(torch.autograd.grad(y, (wide, layer.weight), cotangent),
                        torch.autograd.grad(want, (wide, layer.weight), cotangent)):
        torch.testing.assert_close(got, ref, **F64)


def test_training_forward_never_uses_the_token_loop(monkeypatch):
    """mLSTM training (T > 1) runs chunkwise; only one-token calls may use the recurrent step."""
    def forbidden(*args, **kwargs):
        raise AssertionError("mlstm_step called in a T > 1 forward")

    monkeypatch.setattr(xlstm_module, "mlstm_step", forbidden)
    model = _tiny_model(dtype=torch.float32)
    model(torch.zeros(2, 10, dtype=torch.long))


def test_loss_falls_on_a_copy_task():
    """Each sample is a random 5-token block repeated three times; the loss is taken on the repeats,
    which only memory can predict (chance: log 16 = 2.77). A tiny mLSTM + sLSTM model must learn
    the copy in a few hundred CPU steps, without NaN."""
    torch.manual_seed(0)
    V, P, B = 16, 5, 32
    model = XLSTM(vocab_size=V, n_embd=32, n_layer=2, slstm_at=[1], n_head=2, slstm_n_head=2,
                  chunk_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(200):
        seq = torch.randint(0, V, (B, P)).repeat(1, 3)  # [B, 15]
        logits, _ = model(seq[:, :-1])
        loss = F.cross_entropy(logits[:, P - 1 :].reshape(-1, V), seq[:, P:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
        losses.append(loss.item())
    assert losses[0] > 2.5
    assert sum(losses[-10:]) / 10 < 0.5, losses[-10:]


# ----------------------------------------------------------------------------- config and API


def test_config_validation_messages():
    cases = [
        (dict(n_embd=32, n_head=3), r"n_head \(3\) must divide the mLSTM inner dimension \(64"),
        (dict(n_embd=30, slstm_n_head=4, n_head=4), r"slstm_n_head \(4\) must divide n_embd \(30\)"),
        (dict(signature=(0, 0)), r"signature \(\[0, 0\]\) must be two non-negative integers"),
        (dict(n_layer=3, slstm_at=[3]), r"slstm_at \(\[3\]\) must hold block positions in \[0, n_layer=3\)"),
        (dict(slstm_at=[1, 1]), r"slstm_at \(\[1, 1\]\) must not repeat"),
        (dict(chunk_size=0), r"chunk_size \(0\) must be a positive integer"),
        (dict(forget_gate="relu"), r"forget_gate \('relu'\) must be one of"),
        (dict(mlstm_backend="cuda"), r"mlstm_backend \('cuda'\) must be one of"),
        (dict(n_embd=32, qkv_proj_blocksize=5), r"qkv_proj_blocksize \(5\) must divide"),
        (dict(dropout=1.0), r"dropout \(1.0\) must be in \[0, 1\)"),
        (dict(vocab_size=0), r"vocab_size \(0\) must be a positive integer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            XLSTMConfig(**kwargs)
    with pytest.raises(ValueError, match="n_head"):  # ConfigError is a ValueError
        XLSTM(n_embd=32, n_head=3)


def test_block_pattern_from_signature_or_positions():
    assert XLSTMConfig(n_layer=8, signature=(7, 1)).block_types == ["m"] * 7 + ["s"]
    assert XLSTMConfig(n_layer=10, signature=[3, 1]).block_types == list("mmmsmmmsmm")
    assert XLSTMConfig(n_layer=4, slstm_at=[0, 2]).block_types == list("smsm")
    assert XLSTMConfig(n_layer=3, signature=(0, 1)).block_types == list("sss")


def test_weight_decay_groups_and_init():
    model = XLSTM(vocab_size=50, n_embd=32, n_layer=3, slstm_at=[2], n_head=2, slstm_n_head=2)
    names = dict(model.named_parameters())
    no_decay = model.no_weight_decay_param_names()
    assert no_decay <= names.keys()
    for expected in ("embedding.weight", "norm.weight", "blocks.0.igate.bias", "blocks.0.fgate.bias",
                     "blocks.0.skip", "blocks.0.out_norm.weight", "blocks.2.gate_bias", "blocks.2.ffn_norm.weight"):
        assert expected in no_decay, expected
    for decayed in ("blocks.0.proj_up.weight", "blocks.0.proj_down.weight", "blocks.2.R", "blocks.2.w_in"):
        assert decayed not in no_decay, decayed
    # tied head: counted once
    assert model.head.weight is model.embedding.weight
    assert model.parameter_count() == sum(p.numel() for p in names.values())
    # the sigmoid forget gate is bounded (the seed's was an unbounded exp): log f <= 0
    assert model.config.forget_gate == "sigmoid"


def test_initialisation_follows_the_reference_implementation():
    """Standard deviations and biases of every parameter group as in NX-AI's xlstm (module docstring): small
    init sqrt(2 / (5 E)) with the embedding width E (also for the 4-wide block-diagonal q/k/v, which had about
    10x that before), wang init 2 / (L sqrt(E)) into the residual stream, R = 0, the sLSTM forget-gate
    power law from +5 to -7 (steeper exponent in deeper blocks), mLSTM forget biases 3..6."""
    torch.manual_seed(0)
    E, L = 256, 4
    model = XLSTM(vocab_size=512, n_embd=E, n_layer=L, slstm_at=[1, 3], n_head=4, slstm_n_head=4)
    small, wang = math.sqrt(2 / (5 * E)), 2 / L / math.sqrt(E)
    m, s = model.blocks[0], model.blocks[3]
    groups = {
        "embedding": (model.embedding.weight, small), "mLSTM up": (m.proj_up.weight, small),
        "q": (m.q_proj.weight, small), "k": (m.k_proj.weight, small), "v": (m.v_proj.weight, small),
        "mLSTM down": (m.proj_down.weight, wang), "sLSTM input": (s.w_in, small),
        "ffn up": (s.ffn_up.weight, small), "ffn down": (s.ffn_down.weight, wang),
    }
    for name, (weight, std) in groups.items():
        assert weight.mean().abs() < 0.1 * std, name
        assert weight.std().item() == pytest.approx(std, rel=0.05), name
    assert m.q_proj.weight.std() < 0.05  # the block-size rule gave sqrt(2 / 20) = 0.32
    for block in (model.blocks[1], s):
        assert not block.R.any()
        assert not block.gate_bias[[0, 2, 3]].any()
    d = E // 4
    units = torch.arange(d) / (d - 1)
    torch.testing.assert_close(model.blocks[1].gate_bias[1, 0], 5 - 12 * units ** (0.3 + 1.3 / 3))
    torch.testing.assert_close(s.gate_bias[1, 2], 5 - 12 * units ** 1.6)  # the last block: exponent 0.3 + 1.3
    assert s.gate_bias[1].max() == 5.0 and s.gate_bias[1].min() == -7.0
    torch.testing.assert_close(m.fgate.bias.detach(), torch.linspace(3.0, 6.0, 4))
    assert not m.fgate.weight.any() and not m.igate.weight.any()
    assert m.igate.bias.abs().max() < 0.5  # N(0, 0.1)
    # the up-projections are rounded up to multiples of 64, as in the reference
    assert model.config.mlstm_inner_dim == 512 and model.config.ffn_dim == 384
    assert XLSTMConfig(n_embd=404).mlstm_inner_dim == 832 and XLSTMConfig(n_embd=404).ffn_dim == 576
    assert XLSTMConfig(n_embd=408, proj_round_to=8).ffn_dim == 544


def test_reference_config_parameter_count():
    """configs/xlstm.yaml: 7:1 mLSTM:sLSTM, width 404 (inner 832, feed-forward 576), 8 blocks, vocab 50,304,
    tied embeddings -> 28,664,616 parameters (GQA baseline: 28,758,912)."""
    with torch.device("meta"):
        model = XLSTM(vocab_size=50304, n_embd=404, n_layer=8, signature=(7, 1))
    assert model.config.block_types == ["m"] * 7 + ["s"]
    assert model.parameter_count() == 28_664_616


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "step"])
@pytest.mark.parametrize("forget_gate", FORGET_GATES)
def test_masked_mlstm_steps_are_identity_steps(form, forget_gate):
    """With a padding mask (a gap, a fully masked row), each row's real outputs and final state are those of its real
    steps alone after the given state (float64); a row with no real step keeps its state; every h is finite."""
    q, k, v, i_pre, f_pre = mlstm_inputs(B=3, T=11)
    _, given = mlstm_chunkwise(*mlstm_inputs(B=3, T=5, seed=1), chunk_size=4)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1], [1] * 5 + [0] * 6, [0] * 11], dtype=torch.bool)
    for start in (None, given):
        if form == "step":
            h, state = [], start
            for t in range(11):
                h_t, state = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i_pre[:, :, t], f_pre[:, :, t], state,
                                        forget_gate=forget_gate, mask=mask[:, t])
                h.append(h_t)
            h = torch.stack(h, dim=2)
        else:
            fn = mlstm_parallel if form == "parallel" else functools.partial(mlstm_chunkwise, chunk_size=3)
            h, state = fn(q, k, v, i_pre, f_pre, start, forget_gate=forget_gate, mask=mask)
        assert torch.isfinite(h).all()
        for b in range(3):
            real = mask[b]
            row_start = None if start is None else tuple(s[b:b + 1] for s in start)
            inputs = (x[b:b + 1, :, real] for x in (q, k, v, i_pre, f_pre))
            alone_h, alone_state = mlstm_recurrent(*inputs, row_start, forget_gate=forget_gate)
            torch.testing.assert_close(h[b:b + 1, :, real], alone_h, rtol=1e-10, atol=1e-12)
            for part, alone_part in zip(state, alone_state):
                torch.testing.assert_close(part[b:b + 1], alone_part, rtol=1e-10, atol=1e-12)


def test_masked_slstm_steps_leave_the_state_as_it_was():
    """slstm_scan_head_major with a padding mask: each row's real outputs and final state are those of its real steps
    alone (float64); masked steps output the kept h."""
    g = torch.Generator().manual_seed(0)
    T, H, B, Dh = 9, 2, 3, 4
    steps = torch.randn(T, H, B, 4 * Dh, generator=g, dtype=torch.float64)
    R = 0.3 * torch.randn(4, H, Dh, Dh, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 1], [1] * 4 + [0] * 5, [0] * 9], dtype=torch.bool)
    h, state = slstm_scan_head_major(steps, R, mask=mask)
    assert torch.isfinite(h).all()
    for b in range(B):
        real = mask[b]
        alone_h, alone_state = slstm_scan_head_major(steps[real][:, :, b:b + 1], R)
        torch.testing.assert_close(h[real][:, :, b:b + 1], alone_h, rtol=1e-12, atol=1e-12)
        if real.any():
            for part, alone_part in zip(state, alone_state):
                torch.testing.assert_close(part[b:b + 1], alone_part, rtol=1e-12, atol=1e-12)
    assert torch.equal(state[2][2], torch.zeros(H, Dh))  # the fully masked row: still the empty state
