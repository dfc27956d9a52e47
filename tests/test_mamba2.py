"""Mamba-2's SSD (``ltcx/ops/ssd.py``) against its token-by-token reference (``ltcx/ops/naive/ssd.py``): float64 to
1e-12 (chunk sizes that divide the length and ones that do not, a state carried in and out, the gradient of every
input), float32 within a stated tolerance; against flash-linear-attention's simple-GLA recurrence (SSD with one group
is that recurrence) and through the bridge to its kernel (``ltcx/ops/fla_kernels.py``, the kernel replaced by that
recurrence: fla's Triton kernels do not run in Triton's CPU interpreter); the model's padding mask; its config
errors. The contract (pieces, decoding, gradients, FLOPs) is tests/test_contract.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    assert_flops_formula_counts_the_forward,
    assert_kernels_backend_runs_the_torch_form_off_cuda,
    assert_left_padded_batch_equals_each_prompt,
    assert_rel,
    assert_written_backward,
    input_gradients,
)
from ltcx.errors import ConfigError
from ltcx.models.mamba2 import Mamba2
from ltcx.ops import ssd
from ltcx.ops.naive.ssd import ssd_reference
from ltcx.ops.ssd import ssd_chunked, ssd_step

B, H, T, P, N = 2, 3, 13, 4, 5
F64_TOL = 1e-12  # max |error| / max |reference|
F32_TOL = 1e-5  # float32 against the float64 reference (measured ~1e-7 at these shapes)

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(dtype=torch.float64, length=T, seed=0, grad=False):
    """x, dt > 0, A < 0, B, C, a state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, length, P, generator=gen, dtype=dtype)
    dt = F.softplus(torch.randn(B, H, length, generator=gen, dtype=dtype))
    A = -torch.rand(H, generator=gen, dtype=dtype) * 2
    Bm = torch.randn(B, length, N, generator=gen, dtype=dtype)
    C = torch.randn(B, length, N, generator=gen, dtype=dtype)
    state = torch.randn(B, H, P, N, generator=gen, dtype=dtype)
    return [t.requires_grad_(grad) for t in (x, dt, A, Bm, C, state)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunk", [1, 3, 4, 13, 64])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_equals_the_recurrence_in_float64(chunk, carried):
    x, dt, A, Bm, C, state = inputs()
    state = state if carried else None
    y, final = ssd_chunked(x, dt, A, Bm, C, state, chunk_size=chunk)
    ref_y, ref_final = ssd_reference(x, dt, A, Bm, C, state)
    assert rel(y, ref_y) < F64_TOL and rel(final, ref_final) < F64_TOL


def test_steps_equal_the_recurrence_and_pieces_continue():
    x, dt, A, Bm, C, state = inputs()
    ref_y, ref_final = ssd_reference(x, dt, A, Bm, C, state)
    h, outputs = state, []
    for t in range(T):
        y, h = ssd_step(x[:, :, t], dt[:, :, t], A, Bm[:, t], C[:, t], h)
        outputs.append(y)
    assert rel(torch.stack(outputs, 2), ref_y) < F64_TOL and rel(h, ref_final) < F64_TOL
    first, h = ssd_chunked(x[:, :, :5], dt[:, :, :5], A, Bm[:, :5], C[:, :5], state, chunk_size=4)
    rest, h = ssd_chunked(x[:, :, 5:], dt[:, :, 5:], A, Bm[:, 5:], C[:, 5:], h, chunk_size=4)
    assert rel(torch.cat([first, rest], 2), ref_y) < F64_TOL and rel(h, ref_final) < F64_TOL


@pytest.mark.parametrize("chunk", [4, 5])
def test_gradients_of_every_input_equal_the_recurrences(chunk):
    fast = input_gradients(lambda *a: ssd_chunked(*a, chunk_size=chunk), inputs(grad=True))
    slow = input_gradients(ssd_reference, inputs(grad=True))
    for name, got, want in zip(("x", "dt", "A", "B", "C", "state"), fast, slow):
        assert rel(got, want) < 1e-11, name


@pytest.mark.parametrize("final_used", [False, True])
def test_the_written_backward_equals_autograd_of_the_chunked_form(final_used, monkeypatch):
    """``_Chunks`` against autograd of ``_chunks`` in float64 (every input: x, dt, A, B, C, the state in; the final
    state's gradient given or not), then ``ssd_chunked`` through it against the same function left to autograd: 13
    steps in chunks of 5, a state in and out, every input's gradient."""
    gen = torch.Generator().manual_seed(5)
    x, dt, A, Bm, C, state = inputs()
    chunked = [x[:, :, :12].unflatten(2, (3, 4)), dt[:, :, :12].unflatten(2, (3, 4)), A,
               *(t[:, :12].unflatten(1, (3, 4)).unsqueeze(1) for t in (Bm, C)), state.unsqueeze(2)]
    cotangents = [torch.randn(B, H, 3, 4, P, generator=gen, dtype=torch.float64),
                  torch.randn(B, H, P, N, generator=gen, dtype=torch.float64)][:2 if final_used else 1]
    count = len(cotangents)
    assert_written_backward(lambda *a: ssd._Chunks.apply(*a)[:count], lambda *a: ssd._chunks(*a)[:count], chunked,
                            cotangents)

    def through(written):  # ssd_chunked with its backward written out or left to autograd
        monkeypatch.setattr(ssd, "wants_written_backward", lambda *a: written)
        return input_gradients(lambda *a: ssd_chunked(*a, chunk_size=5), inputs(grad=True))

    for name, got, want in zip(("x", "dt", "A", "B", "C", "state"), through(True), through(False)):
        assert_rel(got, want, what=name)


def test_float32_within_tolerance_of_the_float64_reference():
    """The values and every input's gradient (the written backward's, in float32)."""
    tensors = inputs(length=70, grad=True)
    ref_y, ref_final = ssd_reference(*tensors)
    ref_grads = torch.autograd.grad(ref_y.sum() + ref_final.sum(), tensors)
    singles = [t.detach().float().requires_grad_() for t in tensors]
    y, final = ssd_chunked(*singles, chunk_size=16)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    assert rel(y.double(), ref_y) < F32_TOL and rel(final.double(), ref_final) < F32_TOL
    grads = torch.autograd.grad(y.sum() + final.sum(), singles)
    assert all(rel(a.double(), b) < F32_TOL for a, b in zip(grads, ref_grads))


def test_float32_keeps_its_digits_across_many_chunks_of_strong_decay():
    """400 steps of log-decay about -3 (1,200 in all) in 100 chunks: each decay between chunk boundaries is summed
    from its own steps, so float32 stays within tolerance where differences of running sums would lose digits."""
    x, dt, A, Bm, C, state = inputs(length=400)
    dt = dt + 1.0
    ref_y, ref_final = ssd_reference(x, dt, A - 1.0, Bm, C, state)
    y, final = ssd_chunked(*(t.float() for t in (x, dt, A - 1.0, Bm, C, state)), chunk_size=4)
    assert rel(y.double(), ref_y) < F32_TOL and rel(final.double(), ref_final) < F32_TOL


def as_simple_gla(x, dt, A, Bm, C):
    """SSD's inputs as fla's simple GLA takes them ([B, T, H, D], float32): q = C, k = B per head, v = dt x,
    g = dt A."""
    q, k = (t.unsqueeze(2).expand(-1, -1, H, -1).float() for t in (C, Bm))
    return q, k, (x * dt.unsqueeze(-1)).transpose(1, 2).float(), (dt * A[:, None]).transpose(1, 2).float()


def test_equals_flash_linear_attentions_simple_gla_recurrence():
    """fla's naive simple-GLA recurrence (float32) with state [N, P]: ltcx's [P, N] transposed."""
    fla_sgla = pytest.importorskip("fla.ops.simple_gla.naive")
    x, dt, A, Bm, C, state = inputs()
    y, final = ssd_chunked(x, dt, A, Bm, C, state, chunk_size=4)
    fla_y, fla_final = fla_sgla.naive_recurrent_simple_gla(
        *as_simple_gla(x, dt, A, Bm, C), scale=1.0, initial_state=state.transpose(-1, -2).float())
    assert rel(fla_y.transpose(1, 2).double(), y) < F32_TOL
    assert rel(fla_final.transpose(-1, -2).double(), final) < F32_TOL


def test_the_kernel_bridge_passes_fla_its_conventions(monkeypatch):
    """``ssd_fla`` with fla's chunk kernel replaced by fla's recurrence: the layouts, q = C and k = B over the heads,
    v = dt x, g = dt A, scale 1 and the [P, N] state (``state_v_first``) agree with ltcx's form."""
    fla_sgla = pytest.importorskip("fla.ops.simple_gla")
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    from ltcx.ops.fla_kernels import ssd_fla

    def recurrent(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, state_v_first=False):
        assert state_v_first
        y, final = naive_recurrent_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state.transpose(-1, -2),
                                              output_final_state=output_final_state)
        return y, final.transpose(-1, -2)

    monkeypatch.setattr(fla_sgla, "chunk_simple_gla", recurrent)
    tensors = inputs()
    y, final = ssd_fla(*(t.float() for t in tensors))
    ref_y, ref_final = ssd_reference(*tensors)
    assert rel(y.double(), ref_y) < F32_TOL and rel(final.double(), ref_final) < F32_TOL


def tiny(**overrides):
    torch.manual_seed(0)
    return Mamba2(vocab_size=64, n_embd=16, n_layer=2, n_head=4, head_dim=8, d_state=4,
                  **{"chunk_size": 4, **overrides}).double().eval()


def test_a_left_padded_batch_equals_each_prompt_alone_and_decodes_on():
    """mask: dt = 0 at a padded position (decay e^0 = 1, no input) and the convolution skips it, so each row's real
    logits, its state and the decoding after it are the prompt's alone."""
    assert_left_padded_batch_equals_each_prompt(tiny())


@pytest.mark.parametrize("length,chunk", [(13, 4), (16, 8), (5, 64)])
def test_the_flops_formula_counts_every_product_of_the_forward(length, chunk):
    """forward_flops_per_token = FlopCounterMode's count per token (chunks that divide the length, that do not, and
    one chunk longer than it)."""
    assert_flops_formula_counts_the_forward(tiny(chunk_size=chunk), length)


def test_backend_kernels_off_cuda_runs_the_torch_form(capsys):
    assert_kernels_backend_runs_the_torch_form_off_cuda(tiny(), tiny(backend="kernels"), capsys)


@pytest.mark.parametrize("fields,named", [
    (dict(d_state=0), "d_state (0) must be a positive integer"),
    (dict(head_dim=2.5), "head_dim (2.5) must be a positive integer"),
    (dict(backend="mamba_ssm"), "backend ('mamba_ssm') must be one of"),
])
def test_config_errors_name_the_field_and_the_rule(fields, named):
    with pytest.raises(ConfigError) as error:
        Mamba2(vocab_size=64, **fields)
    assert named in str(error.value) and "\n" not in str(error.value)
