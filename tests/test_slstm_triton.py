"""The sLSTM scan's fused Triton kernels (ltcx/ops/slstm_triton.py) on a CPU, in Triton's interpreter: against the
token-by-token reference (ltcx/ops/naive/slstm.py) and the torch form (ltcx/ops/slstm.py), float64 tight and float32
within F32_TOL, values and the gradients of every input; through the xLSTM model by ``slstm_backend``; and Triton
imported by nothing else.

The interpreter is chosen when ``@triton.jit`` decorates a kernel, i.e. when ltcx.ops.slstm_triton is imported:
this module imports it with ``TRITON_INTERPRET=1`` (reloading it if an earlier test imported it without)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from ltcx.errors import ConfigError, LtcxError  # noqa: E402
from ltcx.models.xlstm import XLSTM, XLSTMConfig  # noqa: E402
from ltcx.ops.naive.slstm import slstm_reference  # noqa: E402
from ltcx.ops.slstm import _Scan, _scan_loop, recurrent_weights, slstm_scan  # noqa: E402


def _interpreted():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("ltcx.ops.slstm_triton")
        return module if module.INTERPRETED else importlib.reload(module)
    finally:  # the kernels keep the interpreter; nothing else in this process should get it
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


st = _interpreted()
F64 = dict(rtol=1e-10, atol=1e-12)
F32_TOL = dict(rtol=1e-5, atol=2e-6)  # float32 kernel vs the float32 torch form (the same operations, other order)
H, B, Dh = 2, 2, 4


def _gates(T, forget_gate, dtype=torch.float64, seed=0, batch=B):
    g = torch.Generator().manual_seed(seed)
    gates_x = torch.randn(batch, T, 4, H, Dh, generator=g, dtype=torch.float64)
    gates_x[:, :, 1] += 2.0 if forget_gate == "sigmoid" else -0.5
    R = 0.5 * torch.randn(4, H, Dh, Dh, generator=g, dtype=torch.float64)
    return gates_x.to(dtype), R.to(dtype)


def _given_state(seed=1, dtype=torch.float64, batch=B):
    """A state (c, n, h, m) ``[B, H, Dh]`` as a scan leaves it: n >= 1, m finite."""
    g = torch.Generator().manual_seed(seed)
    c, h, m = (torch.randn(batch, H, Dh, generator=g, dtype=torch.float64) for _ in range(3))
    n = 1.0 + torch.rand(batch, H, Dh, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (c, n, h, m))


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("T", [1, 3, 7])
def test_scan_equals_the_reference_and_the_torch_form(forget_gate, T):
    gates_x, R = _gates(T, forget_gate)
    h, state = st.slstm_scan_triton(gates_x, R, forget_gate=forget_gate)
    assert h.shape == (B, T, H, Dh) and h.dtype == torch.float64
    assert all(s.shape == (B, H, Dh) and s.dtype == torch.float64 for s in state)
    torch.testing.assert_close(h, slstm_reference(gates_x, R, forget_gate), **F64)
    h_torch, state_torch = slstm_scan(gates_x, R, forget_gate=forget_gate)
    for got, want in zip((h, *state), (h_torch, *state_torch)):
        torch.testing.assert_close(got, want, **F64)
    # float32: the state stays float32, h comes back in the input's dtype
    gates32, R32 = gates_x.float(), R.float()
    h32, state32 = st.slstm_scan_triton(gates32, R32, forget_gate=forget_gate)
    h32_torch, state32_torch = slstm_scan(gates32, R32, forget_gate=forget_gate)
    assert h32.dtype == torch.float32 and all(s.dtype == torch.float32 for s in state32)
    for got, want in zip((h32, *state32), (h32_torch, *state32_torch)):
        torch.testing.assert_close(got, want, **F32_TOL)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_scan_in_pieces_with_the_state_equals_it_whole(forget_gate):
    """A carried state in and out: 9 steps as 4 + 1 + 4 give the whole scan's outputs and final state, and a given
    state continues as the torch form continues it."""
    gates_x, R = _gates(9, forget_gate)
    h, state = st.slstm_scan_triton(gates_x, R, forget_gate=forget_gate)
    pieces, carried = [], None
    for a, b in ((0, 4), (4, 5), (5, 9)):
        h_piece, carried = st.slstm_scan_triton(gates_x[:, a:b], R, carried, forget_gate=forget_gate)
        pieces.append(h_piece)
    torch.testing.assert_close(torch.cat(pieces, dim=1), h, **F64)
    for got, want in zip(carried, state):
        torch.testing.assert_close(got, want, **F64)
    given = _given_state()
    got = st.slstm_scan_triton(gates_x, R, given, forget_gate=forget_gate)
    want = slstm_scan(gates_x, R, given, forget_gate=forget_gate)
    for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(a, b, **F64)


def test_an_empty_scan_returns_the_state_it_was_given():
    gates_x, R = _gates(0, "sigmoid")
    h, state = st.slstm_scan_triton(gates_x, R)
    assert h.shape == (B, 0, H, Dh) and state[3].isneginf().all()


# ----------------------------------------------------------------------------- gradients


def _inputs(T, forget_gate, dtype, with_state, batch=B):
    """The scan's inputs as _Scan takes them: steps ``[T, H, B, 4 Dh]`` (strided, as the sLSTM block passes them),
    recurrent ``[H, Dh, 4 Dh]``, the given state ``[B, H, Dh]`` (or Nones)."""
    gates_x, R = _gates(T, forget_gate, torch.float64, seed=T, batch=batch)
    steps = gates_x.permute(3, 1, 0, 2, 4).reshape(H, T, batch, 4 * Dh).to(dtype).transpose(0, 1)
    state = _given_state(seed=T + 1, dtype=dtype, batch=batch) if with_state else (None,) * 4
    return [steps, recurrent_weights(R).to(dtype), *state]


def _run(scan, inputs, forget_gate, read, seed=3):
    """(outputs, gradients of every input that is a tensor) of the scan with cotangents on the outputs ``read``."""
    inputs = [x if x is None else x.detach().clone().requires_grad_() for x in inputs]
    outputs = scan(*inputs, forget_gate)
    g = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outputs]
    loss = sum((outputs[k] * cotangents[k]).sum() for k in read)
    given = [x for x in inputs if x is not None]
    return outputs, torch.autograd.grad(loss, given)


def _torch_scan(steps, recurrent, c0, n0, h0, m0, forget_gate):
    """_Scan in the layout _TritonScan takes (state ``[B, H, Dh]``, the empty one for None)."""
    if c0 is None:
        T, _, batch, _ = steps.shape
        c0, n0, h0 = (steps.new_zeros(batch, H, Dh) for _ in range(3))
        m0 = steps.new_full((batch, H, Dh), float("-inf"))
    hs, *final = _Scan.apply(steps, recurrent, *(s.transpose(0, 1) for s in (c0, n0, h0, m0)), forget_gate)
    return hs, *(s.transpose(0, 1) for s in final)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("read", ["all", "outputs only", "state only"])
@pytest.mark.parametrize("T", [1, 5, 9])
def test_backward_equals_the_torch_forms(forget_gate, read, T):
    """Float64: the gradients of the steps, of R's maps and of every part of a given state (c, n, h and m, which
    enters through the first step's forget gate) equal the torch form's written-out backward (_Scan) and autograd
    of its loop (_scan_loop), with cotangents on the outputs, the final state (m has none), or both."""
    read = {"all": [0, 1, 2, 3], "outputs only": [0], "state only": [1, 2, 3]}[read]
    inputs = _inputs(T, forget_gate, torch.float64, with_state=True)
    got, got_grads = _run(st._TritonScan.apply, inputs, forget_gate, read)
    for scan in (_torch_scan, _torch_scan_loop):
        want, want_grads = _run(scan, inputs, forget_gate, read)
        assert len(got_grads) == len(want_grads) == 6
        for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
            torch.testing.assert_close(a, b, **F64)
    assert not got[-1].requires_grad  # the stabiliser carries no gradient out


def _torch_scan_loop(steps, recurrent, c0, n0, h0, m0, forget_gate):
    hs, *final = _scan_loop(steps, recurrent, *(s.transpose(0, 1) for s in (c0, n0, h0, m0)), forget_gate)
    return hs, *(s.transpose(0, 1) for s in final)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_backward_from_the_empty_state_float32(forget_gate):
    """Float32 from the empty state (as training runs): outputs and gradients within F32_TOL of the torch form."""
    inputs = _inputs(7, forget_gate, torch.float32, with_state=False)
    got, got_grads = _run(st._TritonScan.apply, inputs, forget_gate, [0, 1, 2, 3])
    want, want_grads = _run(_torch_scan, inputs, forget_gate, [0, 1, 2, 3])
    assert len(got_grads) == 2 and all(g.dtype == torch.float32 for g in got_grads)
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        torch.testing.assert_close(a, b, **F32_TOL)


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_gradients_equal_the_unstabilised_equations(forget_gate):
    """Through slstm_scan_triton, whole and in two pieces with the state between them: the gradients of the gate
    inputs and of R equal autograd of the paper's unstabilised token-by-token equations in float64."""
    gates_x, R = _gates(9, forget_gate, seed=5)
    cotangent = torch.randn(B, 9, H, Dh, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def gradients(run):
        inputs = (gates_x.clone().requires_grad_(), R.clone().requires_grad_())
        return torch.autograd.grad((run(*inputs) * cotangent).sum(), inputs)

    def in_pieces(x, r):
        h1, state = st.slstm_scan_triton(x[:, :4], r, forget_gate=forget_gate)
        h2, _ = st.slstm_scan_triton(x[:, 4:], r, state, forget_gate=forget_gate)
        return torch.cat([h1, h2], dim=1)

    expected = gradients(lambda x, r: slstm_reference(x, r, forget_gate))
    for run in (lambda x, r: st.slstm_scan_triton(x, r, forget_gate=forget_gate)[0], in_pieces):
        for got, want in zip(gradients(run), expected):
            torch.testing.assert_close(got, want, **F64)


def test_maps_read_each_step_and_several_batch_blocks(monkeypatch):
    """The kernels' other paths: recurrent maps too large to keep on chip (read each step) and a batch split
    over programs (17 rows in blocks of 16, the last one mostly padding) give the same values and gradients."""
    monkeypatch.setattr(st, "MAPS_ON_CHIP_BYTES", 0)
    monkeypatch.setattr(st, "BATCH_BLOCK_MAX", 16)
    assert st._blocks(17, Dh, torch.float64) == (16, 16, False)
    inputs = _inputs(4, "sigmoid", torch.float64, with_state=True, batch=17)
    got, got_grads = _run(st._TritonScan.apply, inputs, "sigmoid", [0, 1, 2, 3])
    want, want_grads = _run(_torch_scan, inputs, "sigmoid", [0, 1, 2, 3])
    for a, b in zip(list(got) + list(got_grads), list(want) + list(want_grads)):
        torch.testing.assert_close(a, b, **F64)


# ----------------------------------------------------------------------------- where it runs


def test_refused_on_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(st, "INTERPRETED", False)
    gates_x, R = _gates(2, "sigmoid")
    with pytest.raises(LtcxError, match="slstm_backend: torch") as error:
        st.slstm_scan_triton(gates_x, R)
    assert "TRITON_INTERPRET=1" in str(error.value) and "\n" not in str(error.value)  # the model: test_fused_backends


def test_triton_is_imported_by_the_kernels_alone():
    """Only ltcx/ops/*_triton.py name Triton, and with Triton absent ltcx.lm imports and an xLSTM (torch backend)
    trains a step. (With Triton installed, torch._dynamo, which Lightning imports, loads it whatever ltcx does.)"""
    root = Path(__file__).resolve().parents[1]
    imports_triton = re.compile(r"^\s*(import|from)\s+triton\b", re.MULTILINE)
    naming = sorted(str(p.relative_to(root)) for p in (root / "ltcx").rglob("*.py")
                    if imports_triton.search(p.read_text()))
    assert "ltcx/ops/slstm_triton.py" in naming
    assert all(name.startswith("ltcx/ops/") and name.endswith("_triton.py") for name in naming), naming
    script = (
        "import sys; sys.modules['triton'] = None\n"  # as if not installed: `import triton` raises ImportError
        "import torch, ltcx.lm\n"
        "from ltcx.models.xlstm import XLSTM\n"
        "m = XLSTM(vocab_size=11, n_embd=8, n_layer=2, n_head=2, slstm_n_head=2, signature=(1, 1))\n"
        "m(torch.randint(0, 11, (1, 3)))[0].sum().backward()\n"
        "assert 'ltcx.ops.slstm_triton' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched (a kernel under the interpreter counts as the ops around it)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_launches_do_not_grow_with_the_length():
    """Forward and backward dispatch the same ops for 2 steps as for 9: the loop over time is inside the kernels."""
    def count(T):
        inputs = [x if x is None else x.detach().requires_grad_() for x in _inputs(T, "sigmoid", torch.float32, False)]
        with _CountOps() as forward:
            hs, *_ = st._TritonScan.apply(*inputs, "sigmoid")
        loss = hs.sum()
        with _CountOps() as backward:
            torch.autograd.grad(loss, inputs[:2])
        return forward.count, backward.count

    assert count(2) == count(9)


# ----------------------------------------------------------------------------- through the model


def _model(backend, dtype=torch.float64):
    torch.manual_seed(0)
    model = XLSTM(vocab_size=23, n_embd=16, n_layer=2, slstm_at=[1], n_head=2, slstm_n_head=2, chunk_size=4,
                  slstm_backend=backend).to(dtype)
    with torch.no_grad():  # gates away from their input-independent init, R away from 0: real gating and mixing
        for name, p in model.named_parameters():
            if "gate" in name or name.endswith(".R"):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_model_gives_the_torch_forms_logits_and_gradients(dtype, monkeypatch):
    """slstm_backend: triton against torch in one xLSTM with the same weights: the logits whole and fed in pieces
    with the state (a prompt, then one token at a time, as generation runs) and every parameter's gradient; the
    kernels run in every call."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels are interpreted (``st``): the model then runs them
    calls, kernel = [], st.slstm_scan_head_major_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(st, "slstm_scan_head_major_triton", counted)
    tol = F64 if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    fused, plain = _model("triton", dtype), _model("torch", dtype)
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(1))
    (fused_logits, _), (plain_logits, _) = fused(idx), plain(idx)
    torch.testing.assert_close(fused_logits, plain_logits, **tol)
    fused_logits.square().mean().backward()
    plain_logits.square().mean().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)
    with torch.no_grad():
        pieces, state = fused(idx[:, :4])
        pieces = [pieces]
        for t in range(4, 7):
            logits, state = fused(idx[:, t:t + 1], state)
            pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), plain_logits, **tol)
    assert len(calls) == 5  # the whole sequence, the prompt and three single tokens


def test_the_backend_is_checked_and_resumable():
    with pytest.raises(ConfigError, match="slstm_backend"):
        XLSTMConfig(slstm_backend="cuda")
    assert "slstm_backend" in XLSTM.resumable_fields  # the same function of the same weights


def test_under_torch_compile_the_scan_is_the_torch_forms():
    """Dynamo can not trace the kernels' launches: a compiled caller gets the torch form (traced, no graph break)."""
    gates_x, R = _gates(5, "sigmoid")
    compiled = torch.compile(lambda x, r: st.slstm_scan_triton(x, r)[0], backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(gates_x, R), slstm_scan(gates_x, R)[0], **F64)
