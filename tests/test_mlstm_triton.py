"""The parallel mLSTM's fused Triton kernels (ltcx/ops/mlstm_triton.py), run on the CPU by Triton's interpreter:
against the token-by-token reference (``mlstm_recurrent``) and the torch parallel form, float64 to 1e-10 and float32
within F32_TOL, values and the gradients of q, k, v and both gates (the floor's regime included); lengths within one
block, just past it and past two; a head dim that is not a power of two; both forget gates; through the xLSTM model
(``mlstm_backend: triton`` against ``chunkwise``, and its fallbacks); the one-line errors.

Triton's library reductions (``tl.sum``, ``tl.max``) are decorated at ``import triton``, so the kernel tests run in a
child pytest started with TRITON_INTERPRET=1 (``test_kernels_under_the_interpreter``), as tests/test_titans_triton.py's.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_passes_interpreted, interpreted_module
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.xlstm import XLSTM, XLSTMConfig
from ltcx.ops.mlstm import mlstm_parallel, mlstm_recurrent

F64 = dict(rtol=1e-10, atol=1e-12)
F32_TOL = 2e-5  # float32 against the float64 torch form, relative to the largest magnitude (float32 torch: 5e-6)
B, H, D = 2, 2, 6  # D = 6: BLOCK_D 16, masked lanes; queries and keys in blocks of 64

@pytest.fixture(scope="module")
def fused():
    """ltcx.ops.mlstm_triton with its kernels interpreted (``interpreted_module``)."""
    return interpreted_module("ltcx.ops.mlstm_triton")


def test_kernels_under_the_interpreter():
    """Every test of this file that needs ``fused``, in a child process started with TRITON_INTERPRET=1."""
    assert_passes_interpreted(__file__)


def _inputs(T, forget_gate="sigmoid", dtype=torch.float64, i_shift=0.0, head_dim=D, seed=0):
    """Leaves q, k, v ``[B, H, T, D]``, i_pre, f_pre ``[B, H, T]``; ``i_shift`` lowers the input gates (a negative
    stabiliser m, so that the floor exp(-m) wins the normaliser's maximum)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    i_pre = 2.0 * torch.randn(B, H, T, generator=g, dtype=torch.float64) + i_shift
    f_pre = torch.randn(B, H, T, generator=g, dtype=torch.float64) + (2.0 if forget_gate == "sigmoid" else -0.5)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, i_pre, f_pre)]


def _grads(h, inputs, seed=3):
    cotangent = torch.randn(h.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(h, inputs, cotangent.to(h.dtype))


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("T", [1, 5, 67, 133])  # blocks of 64: one, one, just past one, past two
def test_equals_the_reference_and_the_parallel_form(fused, forget_gate, T):
    inputs = _inputs(T, forget_gate)
    h = fused.mlstm_parallel_triton(*inputs, forget_gate=forget_gate)
    assert h.shape == (B, H, T, D) and h.dtype == torch.float64
    detached = [x.detach() for x in inputs]
    torch.testing.assert_close(h, mlstm_recurrent(*detached, forget_gate=forget_gate)[0], **F64)
    plain, _ = mlstm_parallel(*inputs, forget_gate=forget_gate, with_state=False)
    torch.testing.assert_close(h, plain, **F64)
    for got, want, name in zip(_grads(h, inputs), _grads(plain, inputs), ("q", "k", "v", "i_pre", "f_pre")):
        torch.testing.assert_close(got, want, **F64, msg=name)


@pytest.mark.parametrize("i_shift", [-6.0, -100.0])  # the floor exp(-m) wins; m < -80, where the floor is clamped
def test_gradients_where_the_floor_wins(fused, i_shift):
    inputs = _inputs(37, i_shift=i_shift, head_dim=20)
    h = fused.mlstm_parallel_triton(*inputs)
    plain, _ = mlstm_parallel(*inputs, with_state=False)
    torch.testing.assert_close(h, plain, **F64)
    for got, want, name in zip(_grads(h, inputs), _grads(plain, inputs), ("q", "k", "v", "i_pre", "f_pre")):
        torch.testing.assert_close(got, want, **F64, msg=name)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_float32_and_bfloat16_within_tolerance(fused, forget_gate):
    inputs = _inputs(67, forget_gate)
    want, _ = mlstm_parallel(*inputs, forget_gate=forget_gate, with_state=False)
    want_grads = _grads(want, inputs)
    single = [x.detach().float().requires_grad_() for x in inputs]
    h = fused.mlstm_parallel_triton(*single, forget_gate=forget_gate)
    assert h.dtype == torch.float32
    for got, ref in zip((h, *_grads(h, single)), (want, *want_grads)):
        assert (got.double() - ref).abs().max() <= F32_TOL * ref.abs().max()
    # bf16 inputs: computed in float32 from the rounded inputs, returned in bf16
    half = [x.detach().bfloat16() for x in inputs]
    h16 = fused.mlstm_parallel_triton(*half, forget_gate=forget_gate)
    assert h16.dtype == torch.bfloat16
    ref16, _ = mlstm_parallel(*half, forget_gate=forget_gate, with_state=False)
    torch.testing.assert_close(h16, ref16, rtol=1e-2, atol=1e-2)


def test_strided_heads_and_no_gradient(fused):
    """Heads as the block passes them (views of ``[B, T, H D]``) read in place; h comes back in their layout; without
    a gradient the forward alone runs, with the same values."""
    x = torch.randn(B, 67, H * D, dtype=torch.float64)
    q, k, v = (t.view(B, 67, H, D).transpose(1, 2) for t in (x, x.flip(1), 2 * x))
    gates = _inputs(67)[3:]
    h = fused.mlstm_parallel_triton(q, k, v, *gates)
    assert h.stride() == q.stride()
    torch.testing.assert_close(h, mlstm_parallel(q, k, v, *gates, with_state=False)[0], **F64)
    with torch.no_grad():
        torch.testing.assert_close(fused.mlstm_parallel_triton(q, k, v, *gates), h.detach(), rtol=0, atol=0)


def test_launches_do_not_grow_with_the_length(fused):
    """Forward and backward count the same kernels at 67 tokens as at 133: the blocks loop inside the kernels."""
    from ltcx.throughput import KernelCounter

    def count(T):
        inputs = _inputs(T, dtype=torch.float32)
        with KernelCounter() as counter:
            _grads(fused.mlstm_parallel_triton(*inputs), inputs)
        return counter.counts

    counts = count(67)
    assert counts == count(133)
    assert sum(n for name, n in counts.items() if name.startswith("triton:")) == 3


# ----------------------------------------------------------------------------- through the model


def _model(backend, dtype=torch.float64, forget_gate="sigmoid"):
    torch.manual_seed(0)
    model = XLSTM(vocab_size=23, n_embd=24, n_layer=2, slstm_at=[1], n_head=2, slstm_n_head=2, chunk_size=4,
                  proj_round_to=8, mlstm_backend=backend, forget_gate=forget_gate).to(dtype)
    with torch.no_grad():  # gates away from their input-independent init: real gating
        for name, p in model.named_parameters():
            if "gate" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_the_model_gives_the_chunkwise_logits_and_gradients(fused, forget_gate, monkeypatch):
    """mlstm_backend: triton against chunkwise in one xLSTM with the same weights (head dim 24, not a power of two):
    the training forward's logits and every parameter's gradient, the kernels run once a block."""
    model, plain = _model("triton", forget_gate=forget_gate), _model("chunkwise", forget_gate=forget_gate)
    model.load_state_dict(plain.state_dict())
    calls, kernel = [], fused.mlstm_parallel_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused, "mlstm_parallel_triton", counted)
    idx = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(1))
    (logits, _), (plain_logits, _) = model(idx, with_state=False), plain(idx, with_state=False)
    assert calls == [1]
    torch.testing.assert_close(logits, plain_logits, **F64)
    logits.square().mean().backward()
    plain_logits.square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **F64, msg=name)


def test_a_state_or_a_mask_runs_the_chunkwise_form(fused, monkeypatch):
    """A wanted final state, a carried state or a mask: the chunkwise form (the same function), the kernels not run."""
    model, plain = _model("triton"), _model("chunkwise")
    model.load_state_dict(plain.state_dict())
    monkeypatch.setattr(fused, "mlstm_parallel_triton", lambda *a, **kw: pytest.fail("the kernels ran"))
    idx = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        logits, state = model(idx[:, :5])
        torch.testing.assert_close(logits, plain(idx[:, :5])[0], rtol=0, atol=0)
        torch.testing.assert_close(model(idx[:, 5:], state)[0], plain(idx[:, 5:], plain(idx[:, :5])[1])[0], rtol=0,
                                   atol=0)
        torch.testing.assert_close(model(idx, mask=mask)[0], plain(idx, mask=mask)[0], rtol=0, atol=0)


def test_under_torch_compile_the_torch_parallel_form_runs(fused):
    """Dynamo can not trace the launches: a compiled caller gets the torch form (traced, no graph break), the model's
    training forward included."""
    inputs = [x.detach() for x in _inputs(5)]
    compiled = torch.compile(fused.mlstm_parallel_triton, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), mlstm_parallel(*inputs, with_state=False)[0], **F64)
    model, plain = _model("triton"), _model("chunkwise")
    model.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, _ = torch.compile(model, backend="eager", fullgraph=True)(idx, with_state=False)
    torch.testing.assert_close(logits, plain(idx, with_state=False)[0], **F64)


def test_refused_on_a_cpu_without_the_interpreter(fused, monkeypatch):
    """Called directly, the kernels refuse a CPU outside the interpreter (the model runs chunkwise there:
    tests/test_fused_backends.py)."""
    monkeypatch.setattr(fused, "INTERPRETED", False)
    with pytest.raises(LtcxError, match="mlstm_backend: chunkwise") as error:
        fused.mlstm_parallel_triton(*_inputs(3))
    assert "TRITON_INTERPRET=1" in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------- without the interpreter


def test_the_backend_is_checked_resumable_and_counted_as_the_parallel_form():
    with pytest.raises(ConfigError, match="mlstm_backend"):
        XLSTMConfig(mlstm_backend="cuda")
    assert "mlstm_backend" in XLSTM.resumable_fields  # the same function of the same weights
    fields = dict(vocab_size=11, n_embd=8, n_layer=1, n_head=2, slstm_at=[], chunk_size=4)
    flops = [XLSTM(**fields, mlstm_backend=b).forward_flops_per_token(9) for b in ("parallel", "triton")]
    assert flops[0] == flops[1]
