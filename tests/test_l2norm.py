"""The L2 normalisation (ltcx/ops/l2norm.py): its written backward against autograd of ``F.normalize``."""

import pytest
import torch
import torch.nn.functional as F

from ltcx.ops.l2norm import l2_normalize


def _vectors(shape, dtype):
    """Random vectors with, along the last dim, one zero, one below eps = 0.5, one exactly at it, and a tiny one."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat = x.view(-1, shape[-1])
    flat[0] = 0
    flat[1] *= 0.1 / flat[1].norm()
    flat[2] = 0
    flat[2, 0] = 0.5
    flat[3] *= 1e-9
    return x.to(dtype).requires_grad_()


@pytest.mark.parametrize("shape", [(4, 1), (5, 3), (2, 3, 4, 8)], ids=str)
@pytest.mark.parametrize("eps", [1e-12, 0.5])
def test_values_and_gradient_equal_autograd_of_f_normalize_float64(shape, eps):
    """The values equal ``F.normalize(x, dim=-1, eps)`` bit for bit, and the gradient of x equals autograd's through
    it in float64, for norms above, at, below eps and zero."""
    x = _vectors(shape, torch.float64)
    cotangent = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, y_ref = l2_normalize(x, eps), F.normalize(x, dim=-1, eps=eps)
    assert y.grad_fn is not None and "L2Normalize" in type(y.grad_fn).__name__
    assert torch.equal(y, y_ref)
    (grad,), (grad_ref,) = torch.autograd.grad(y, x, cotangent), torch.autograd.grad(y_ref, x, cotangent)
    assert grad_ref.abs().max() > 0
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12 * grad_ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_keeps_the_dtype_and_autograds_values(dtype):
    """In float32 and bf16 the values are ``F.normalize``'s bit for bit and the gradient has x's dtype and autograd's
    values to the dtype's rounding."""
    x = _vectors((3, 6, 16), dtype)
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, y_ref = l2_normalize(x, 1e-6), F.normalize(x, dim=-1, eps=1e-6)
    assert torch.equal(y, y_ref)
    (grad,), (grad_ref,) = torch.autograd.grad(y, x, cotangent), torch.autograd.grad(y_ref, x, cotangent)
    assert grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grad, grad_ref, rtol=tol, atol=tol * grad_ref.abs().max().item())


def test_without_a_gradient_it_is_f_normalize():
    """With no gradient wanted the plain ``F.normalize`` runs (nothing saved for a backward)."""
    x = torch.randn(3, 8)
    y = l2_normalize(x, 1e-6)
    assert y.grad_fn is None and torch.equal(y, F.normalize(x, dim=-1, eps=1e-6))


def test_a_pass_takes_fewer_ops_than_autograd_of_f_normalize():
    """Forward and backward together dispatch fewer kernel-launching ops than ``F.normalize`` under autograd."""
    from ltcx.throughput import KernelCounter

    def ops(normalize):
        x = torch.randn(2, 3, 8, requires_grad=True)
        with KernelCounter() as counter:
            normalize(x).backward(torch.ones(2, 3, 8))
        assert x.grad is not None
        return counter.total

    assert ops(lambda x: l2_normalize(x, 1e-6)) < ops(lambda x: F.normalize(x, dim=-1, eps=1e-6)) - 4
