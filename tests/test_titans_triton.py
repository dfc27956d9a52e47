"""Titans' memory as fused Triton kernels (``ltcx/ops/titans_triton.py``), run on the CPU by Triton's interpreter,
against the token-by-token reference (``ltcx/ops/naive/titans.py``) and the torch form (``neural_memory``): float64
to 1e-12, float32 within a stated tolerance; chunks of 1, 2, 4 and none, lengths no chunk divides, a state carried
in and out, the gradient of every input.

Triton chooses between compiling and interpreting when ``@triton.jit`` decorates a function, and its own library
(``tl.zeros``, ``tl.sum``, ...) is decorated at ``import triton``, which ``import torch._dynamo`` (any ltcx model)
already does: TRITON_INTERPRET=1 must be set before the process imports anything. So a plain run of this file runs
the kernel tests in a child pytest with it set (``test_kernels_under_the_interpreter``), and skips them in itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import REL_TOL, assert_passes_interpreted, assert_rel, interpreted_module
from ltcx.errors import ConfigError
from ltcx.models.titans import NeuralMemory, Titans, TitansConfig
from ltcx.ops.naive.titans import reference_memory
from ltcx.ops.titans import MemoryState, initial_memory_state, neural_memory

B, H, DK, DM = 2, 2, 4, 8
FLOAT32_TOL = 1e-5  # float32 against the float64 reference, relative to the largest magnitude (either form: ~5e-7)

pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def fused():
    """ltcx.ops.titans_triton with its kernels interpreted (``interpreted_module``)."""
    return interpreted_module("ltcx.ops.titans_triton")


def test_kernels_under_the_interpreter():
    """Every test of this file that needs ``fused``, in a child process started with TRITON_INTERPRET=1."""
    assert_passes_interpreted(__file__)


def _inputs(length: int, chunk_size: int | None, normalize_step: bool = True, dtype=torch.float64, seed: int = 0):
    """Leaves q, k, v [B, H, T, dk] (unit q, k), log_retain, log_momentum, step [B, H, T] from the spec's gates, and
    M_0: w1_init [H, dm, dk], w2_init [H, dk, dm]."""
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, length, DK, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, length, DK, generator=g, dtype=dtype)
    retain, momentum, rate = (torch.randn(B, H, length, generator=g, dtype=dtype) for _ in range(3))
    log_retain, log_momentum = F.logsigmoid(-(retain - 3.0)), F.logsigmoid(momentum)
    step = torch.sigmoid(rate) * torch.sigmoid(-momentum) / (chunk_size or 1)
    if not normalize_step:  # a raw theta: small enough not to diverge at b = 1
        step = step / 4.0
    w1_init = torch.randn(H, DM, DK, generator=g, dtype=dtype) / math.sqrt(DK)
    w2_init = torch.randn(H, DK, DM, generator=g, dtype=dtype) / math.sqrt(DM)
    return [x.requires_grad_() for x in (q, k, v, log_retain, log_momentum, step, w1_init, w2_init)]


def _objective(y, state) -> torch.Tensor:
    """A loss that reads every output: fixed random weights on y [B, H, T, dk] and on each tensor of the state."""
    g = torch.Generator().manual_seed(1)
    return sum((x * torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)).sum() for x in (y, *state))


def _run(memory_fn, inputs, pieces, chunk_size, normalize_step):
    """The memory over the pieces' lengths, the state carried between calls -> (y [B, H, T, dk], final state, the
    gradients of the objective with respect to every input)."""
    q, k, v, log_retain, log_momentum, step, w1_init, w2_init = inputs
    state, ys, position = initial_memory_state(w1_init, w2_init, B), [], 0
    for n in pieces:
        part = (x[:, :, position:position + n] for x in (q, k, v, log_retain, log_momentum, step))
        y, state = memory_fn(*part, state, position, chunk_size, normalize_step)
        ys.append(y)
        position += n
    y = torch.cat(ys, dim=2)
    return y, state, torch.autograd.grad(_objective(y, state), inputs)


NAMES = ("q", "k", "v", "log_retain", "log_momentum", "step", "w1_init", "w2_init")


def _assert_all_rel(actual, expected, tol):
    (y, state, grads), (y_ref, state_ref, grads_ref) = actual, expected
    assert_rel(y, y_ref, tol, "y")
    for name, a, e in zip(MemoryState._fields, state, state_ref):
        assert_rel(a, e, tol, f"state.{name}")
    for name, a, e in zip(NAMES, grads, grads_ref):
        assert_rel(a, e, tol, f"grad {name}")


CASES = [(1, True, 6), (2, True, 9), (2, False, 9), (4, True, 13), (4, False, 13), (None, True, 13)]


@pytest.mark.parametrize(("chunk_size", "normalize_step", "length"), CASES,
                         ids=[f"b={b}-{'kappa' if n else 'raw'}-T={t}" for b, n, t in CASES])
def test_fused_equals_token_loop_reference_float64(fused, chunk_size, normalize_step, length):
    """Values, the final state and every input's gradient equal the literal token recurrence's (spec A.2)."""
    inputs = _inputs(length, chunk_size, normalize_step)
    actual = _run(fused.neural_memory_triton, inputs, [length], chunk_size, normalize_step)

    def reference(*args):
        return reference_memory(*args, chunk_size, normalize_step)

    y, state = reference(*inputs)
    expected = (y, state, torch.autograd.grad(_objective(y, state), inputs))
    _assert_all_rel(actual, expected, REL_TOL)


# pieces starting and ending mid-chunk, one crossing two boundaries (its gradient point moves inside the call)
@pytest.mark.parametrize("pieces", [[3, 6, 4], [1, 12], [8, 5]], ids=str)
def test_carried_state_in_and_out_equals_the_torch_form(fused, pieces):
    """A sequence fed in calls, the state (mid-chunk gradient point, momentum) carried between them: every call's
    outputs and state and every gradient through the carried states equal the torch form fed the same way."""
    inputs = _inputs(sum(pieces), 4)
    actual = _run(fused.neural_memory_triton, inputs, pieces, 4, True)
    _assert_all_rel(actual, _run(neural_memory, inputs, pieces, 4, True), REL_TOL)
    _assert_all_rel(actual, _run(neural_memory, inputs, [sum(pieces)], 4, True), REL_TOL)


@pytest.mark.parametrize("read", [(0,), (3, 4), (1, 2, 5)], ids=str)
def test_a_loss_reading_some_of_the_state(fused, read):
    """The backward kernel reads each state output's gradient where it has one and takes zeros where nothing read
    that output: the inputs' gradients equal the torch form's for a loss on y and some of the final state."""
    inputs = _inputs(9, 4)
    grads = []
    for memory_fn in (fused.neural_memory_triton, neural_memory):
        q, k, v, log_retain, log_momentum, step, w1_init, w2_init = inputs
        y, state = memory_fn(q, k, v, log_retain, log_momentum, step, initial_memory_state(w1_init, w2_init, B), 0,
                             4, True)
        grads.append(torch.autograd.grad(_objective(y, [state[i] for i in read]), inputs))
    for name, a, e in zip(NAMES, *grads):
        assert_rel(a, e, REL_TOL, f"grad {name}")


@pytest.mark.parametrize("chunk_size", [4, None], ids=lambda b: f"b={b}")
def test_chunks_longer_than_a_piece_run_as_several(fused, monkeypatch, chunk_size):
    """A chunk longer than MAX_PIECE runs as pieces of its largest power-of-two divisor (without chunks, of
    MAX_PIECE), the gradient point moving only at chunk boundaries: the same function."""
    monkeypatch.setattr(fused, "MAX_PIECE", 2)
    assert fused.piece_size(chunk_size) == 2
    inputs = _inputs(13, chunk_size)
    actual = _run(fused.neural_memory_triton, inputs, [5, 8], chunk_size, True)
    _assert_all_rel(actual, _run(neural_memory, inputs, [13], chunk_size, True), REL_TOL)


def test_float32_within_tolerance_of_the_float64_reference(fused):
    """In float32 the kernels keep the torch form's accuracy: within FLOAT32_TOL of the float64 reference."""
    inputs64 = _inputs(13, 4)
    expected = _run(neural_memory, inputs64, [13], 4, True)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    _assert_all_rel(_run(fused.neural_memory_triton, inputs32, [6, 7], 4, True), expected, FLOAT32_TOL)
    _assert_all_rel(_run(neural_memory, inputs32, [6, 7], 4, True), expected, FLOAT32_TOL)


def test_without_gradients_or_state(fused):
    """Without a gradient wanted (no piece starts saved) and without the state: the same read."""
    inputs = _inputs(5, 2)
    state = initial_memory_state(inputs[6], inputs[7], B)
    with torch.no_grad():
        y, none = fused.neural_memory_triton(*inputs[:6], state, 0, 2, True, with_state=False)
        expected, _ = neural_memory(*inputs[:6], state, 0, 2, True)
    assert none is None
    assert_rel(y, expected, REL_TOL, "y")


# ----------------------------------------------------------------------------- through the model


def _tiny(**overrides) -> Titans:
    args = dict(vocab_size=32, n_embd=16, n_layer=2, variant="mag", n_head=2, n_kv_head=1, mlp_hidden=24, window=4,
                n_persistent=2, mem_heads=2, mem_head_dim=8, mem_hidden=8, memory_chunk_size=4)
    return Titans(**{**args, **overrides})


class _Launches:
    """Counts the launches of a kernel (wraps the interpreted function's ``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_model_with_the_triton_backend_equals_the_torch_form(fused, monkeypatch):
    """A tiny MAG model: logits, the carried state and every parameter's gradient equal the torch form's, fed whole
    and in two calls; each memory layer's training call is one forward and one backward launch."""
    torch.manual_seed(0)
    reference = _tiny().double()
    model = _tiny(memory_backend="triton").double()
    model.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 32, (B, 11))
    forward, backward = _Launches(fused._memory_forward_kernel), _Launches(fused._memory_backward_kernel)
    monkeypatch.setattr(fused, "_memory_forward_kernel", forward)
    monkeypatch.setattr(fused, "_memory_backward_kernel", backward)
    for net in (reference, model):
        logits, _ = net(idx)
        logits.square().sum().backward()
    layers = sum(isinstance(m, NeuralMemory) for m in model.modules())
    assert (forward.count, backward.count) == (layers, layers)
    assert_rel(model(idx)[0], reference(idx)[0], REL_TOL, "logits")
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert_rel(p.grad, p_ref.grad, REL_TOL, f"grad {name}")
    with torch.no_grad():
        first, state = model(idx[:, :6])
        second, state = model(idx[:, 6:], state)
        first_ref, state_ref = reference(idx[:, :6])
        second_ref, _ = reference(idx[:, 6:], state_ref)
    assert_rel(torch.cat([first, second], 1), torch.cat([first_ref, second_ref], 1), REL_TOL, "logits in two calls")


def test_memory_backend_is_checked(monkeypatch):
    with pytest.raises(ConfigError, match="memory_backend"):
        TitansConfig(memory_backend="cuda")
    # where the kernels run, and the torch form elsewhere: tests/test_fused_backends.py
