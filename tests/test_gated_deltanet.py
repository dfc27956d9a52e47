"""Gated DeltaNet's gated delta rule (``ltcx/ops/gated_delta.py``) against its token-by-token reference
(``ltcx/ops/naive/gated_delta.py``): float64 to 1e-12 (chunk sizes that divide the length and ones that do not, a
state carried in and out, the gradient of every input), float32 within a stated tolerance; against
flash-linear-attention's own recurrence and through the bridge to its kernels (``ltcx/ops/fla_kernels.py``, its
kernel replaced by that recurrence: fla's Triton kernels do not run in Triton's CPU interpreter); the model's padding
mask; its config errors. The contract (pieces, decoding, gradients, FLOPs) is tests/test_contract.py's."""

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
from ltcx.models.gated_deltanet import GatedDeltaNet
from ltcx.ops import gated_delta
from ltcx.ops.gated_delta import gated_delta_chunked, gated_delta_step
from ltcx.ops.naive.gated_delta import gated_delta_reference

B, H, T, DK, DV = 2, 3, 13, 8, 6
F64_TOL = 1e-12  # max |error| / max |reference|
F32_TOL = 1e-5  # float32 against the float64 reference (measured ~1e-7 at these shapes)

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(dtype=torch.float64, length=T, seed=0, grad=False):
    """q, k (L2-normed, as the layer makes them), v, g (<= 0), beta in (0, 1), a state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, DK, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, H, length, DK, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, length, DV, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(B, H, length, generator=gen, dtype=dtype))
    beta = torch.rand(B, H, length, generator=gen, dtype=dtype)
    state = torch.randn(B, H, DK, DV, generator=gen, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v, g, beta, state)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunk", [1, 3, 4, 13, 64])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_equals_the_recurrence_in_float64(chunk, carried):
    q, k, v, g, beta, state = inputs()
    state = state if carried else None
    o, final = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    ref_o, ref_final = gated_delta_reference(q, k, v, g, beta, state)
    assert rel(o, ref_o) < F64_TOL and rel(final, ref_final) < F64_TOL


def test_steps_equal_the_recurrence_and_pieces_continue():
    q, k, v, g, beta, state = inputs()
    ref_o, ref_final = gated_delta_reference(q, k, v, g, beta, state)
    S, outputs = state, []
    for t in range(T):
        o, S = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], S)
        outputs.append(o)
    assert rel(torch.stack(outputs, 2), ref_o) < F64_TOL and rel(S, ref_final) < F64_TOL
    first, S = gated_delta_chunked(*(t[:, :, :5] for t in (q, k, v, g, beta)), state, chunk_size=4)
    rest, S = gated_delta_chunked(*(t[:, :, 5:] for t in (q, k, v, g, beta)), S, chunk_size=4)
    assert rel(torch.cat([first, rest], 2), ref_o) < F64_TOL and rel(S, ref_final) < F64_TOL


@pytest.mark.parametrize("chunk", [4, 5])
def test_gradients_of_every_input_equal_the_recurrences(chunk):
    fast = input_gradients(lambda *a: gated_delta_chunked(*a, chunk_size=chunk), inputs(grad=True))
    slow = input_gradients(gated_delta_reference, inputs(grad=True))
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), fast, slow):
        assert rel(got, want) < 1e-11, name


@pytest.mark.parametrize("final_used", [False, True])
def test_the_written_backward_equals_autograd_of_the_chunked_form(final_used, monkeypatch):
    """``_Rule`` against autograd of ``_rule`` in float64 (every input: q, k, v, g, beta, the state in; the final
    state's gradient given or not), then ``gated_delta_chunked`` through it against the same function left to
    autograd: 13 steps in chunks of 5, a state in and out, every input's gradient."""
    gen = torch.Generator().manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    *steps, state = inputs()
    chunked = [t[:, :, :12].unflatten(2, (3, 4)) for t in steps] + [state]
    cotangents = [randn(B, H, 3, 4, DV), randn(B, H, DK, DV)][:2 if final_used else 1]
    count = len(cotangents)
    assert_written_backward(lambda *a: gated_delta._Rule.apply(*a)[:count],
                            lambda *a: gated_delta._rule(*a)[:count], chunked, cotangents, DK ** -0.5)

    def through(written):  # gated_delta_chunked with its backward written out or left to autograd
        monkeypatch.setattr(gated_delta, "wants_written_backward", lambda *a: written)
        return input_gradients(lambda *a: gated_delta_chunked(*a, chunk_size=5), inputs(grad=True))

    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), through(True), through(False)):
        assert_rel(got, want, what=name)


def test_float32_within_tolerance_of_the_float64_reference():
    """The values and every input's gradient (the written backward's, in float32)."""
    tensors = inputs(length=70, grad=True)
    ref_o, ref_final = gated_delta_reference(*tensors)
    ref_grads = torch.autograd.grad(ref_o.sum() + ref_final.sum(), tensors)
    singles = [t.detach().float().requires_grad_() for t in tensors]
    o, final = gated_delta_chunked(*singles, chunk_size=16)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert rel(o.double(), ref_o) < F32_TOL and rel(final.double(), ref_final) < F32_TOL
    grads = torch.autograd.grad(o.sum() + final.sum(), singles)
    assert all(rel(a.double(), b) < F32_TOL for a, b in zip(grads, ref_grads))


def test_equals_flash_linear_attentions_recurrence():
    """fla's own naive recurrence (it computes in float32): the same rule, scale and state layout."""
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta, state = inputs()
    o, final = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=4)

    def tokens_first(t):
        return t.transpose(1, 2).float()

    fla_o, fla_final = fla_gdr.naive_recurrent_gated_delta_rule(
        *map(tokens_first, (q, k, v, beta, g)), initial_state=state.float(), output_final_state=True)
    assert rel(fla_o.transpose(1, 2).double(), o) < F32_TOL and rel(fla_final.double(), final) < F32_TOL


def test_the_kernel_bridge_passes_fla_its_conventions(monkeypatch):
    """``gated_delta_fla`` with fla's chunk kernel replaced by fla's recurrence (the same arguments' meaning): the
    layouts, the log-space decay, beta after its sigmoid and the state in and out agree with ltcx's form."""
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    from ltcx.ops.fla_kernels import gated_delta_fla

    def recurrent(q, k, v, g, beta, initial_state=None, output_final_state=False):
        return fla_gdr.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=initial_state,
                                                        output_final_state=output_final_state)

    monkeypatch.setattr(fla_gdr, "chunk_gated_delta_rule", recurrent)
    q, k, v, g, beta, state = inputs()
    o, final = gated_delta_fla(*(t.float() for t in (q, k, v, g, beta, state)))
    ref_o, ref_final = gated_delta_reference(q, k, v, g, beta, state)
    assert rel(o.double(), ref_o) < F32_TOL and rel(final.double(), ref_final) < F32_TOL


def tiny(**overrides):
    torch.manual_seed(0)
    return GatedDeltaNet(vocab_size=64, n_embd=16, n_layer=2, n_head=2, head_dim=4, mlp_hidden=32,
                         **{"chunk_size": 4, **overrides}).double().eval()


def test_a_left_padded_batch_equals_each_prompt_alone_and_decodes_on():
    """mask: a padded position writes nothing and decays nothing (b = 0, g = 0) and the convolution skips it, so
    each row's real logits, its state and the decoding after it are the prompt's alone."""
    assert_left_padded_batch_equals_each_prompt(tiny())


@pytest.mark.parametrize("length,chunk", [(13, 4), (16, 8), (5, 64)])
def test_the_flops_formula_counts_every_product_of_the_forward(length, chunk):
    """forward_flops_per_token = FlopCounterMode's count per token (chunks that divide the length, that do not, and
    one chunk longer than it)."""
    assert_flops_formula_counts_the_forward(tiny(chunk_size=chunk), length)
    assert tiny(backend="kernels").forward_flops_per_token(100) == tiny(chunk_size=64).forward_flops_per_token(100)


def test_backend_kernels_off_cuda_runs_the_torch_form(capsys):
    assert_kernels_backend_runs_the_torch_form_off_cuda(tiny(), tiny(backend="kernels"), capsys)


@pytest.mark.parametrize("fields,named", [
    (dict(head_dim=0), "head_dim (0) must be a positive integer"),
    (dict(head_v_dim=-2), "head_v_dim (-2) must be a positive integer"),
    (dict(backend="triton"), "backend ('triton') must be one of"),
    (dict(chunk_size=True), "chunk_size (True) must be a positive integer"),
])
def test_config_errors_name_the_field_and_the_rule(fields, named):
    with pytest.raises(ConfigError) as error:
        GatedDeltaNet(vocab_size=64, **fields)
    assert named in str(error.value) and "\n" not in str(error.value)
