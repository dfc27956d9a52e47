"""The causal depthwise convolution (ltcx/ops/conv.py) and its gradients against the convolution written out."""

import pytest
import torch

from ltcx.ops.conv import causal_depthwise_conv
from ltcx.ops.naive.conv import causal_conv_reference, masked_causal_conv_reference


def _inputs(kernel: int, dtype=torch.float64, weight_dtype=None, seed=0, length=9):
    g = torch.Generator().manual_seed(seed)
    batch, channels = 2, 5
    x = torch.randn(batch, length, channels, generator=g, dtype=torch.float64).to(dtype)
    buffer = torch.randn(batch, kernel - 1, channels, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(channels, 1, kernel, generator=g, dtype=torch.float64).to(weight_dtype or dtype)
    bias = torch.randn(channels, generator=g, dtype=torch.float64).to(weight_dtype or dtype)
    return x, buffer, weight, bias


@pytest.mark.parametrize("kernel", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 9])
@pytest.mark.parametrize("with_buffer", [False, True], ids=["start", "buffer"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_values_and_gradients_equal_the_convolution_written_out_float64(kernel, length, with_buffer, with_bias):
    """The output, the new buffer and the gradients of the input, the buffer, the weight and the bias equal those of
    the convolution written out step by step (autograd through ``causal_conv_reference``) in float64, for windows
    longer and shorter than the sequence."""
    x, buffer, weight, bias = _inputs(kernel, length=length)
    buffer, bias = (buffer if with_buffer else None), (bias if with_bias else None)
    leaves = [t.requires_grad_() for t in (x, weight) + ((buffer,) if with_buffer else ()) + ((bias,) if with_bias
                                                                                                else ())]
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype)

    out, new_buffer = causal_depthwise_conv(x, weight, bias, buffer)
    out_ref = causal_conv_reference(x, weight, bias, buffer)
    torch.testing.assert_close(out, out_ref, rtol=1e-13, atol=1e-13)
    before = buffer if with_buffer else x.new_zeros(2, kernel - 1, 5)
    assert torch.equal(new_buffer, torch.cat([before, x], 1)[:, x.shape[1]:])
    for leaf_grad, leaf_grad_ref in zip(torch.autograd.grad(out, leaves, cotangent),
                                        torch.autograd.grad(out_ref, leaves, cotangent)):
        assert leaf_grad_ref.numel() == 0 or leaf_grad_ref.abs().max() > 0  # a 1-tap buffer is empty
        torch.testing.assert_close(leaf_grad, leaf_grad_ref, rtol=1e-12, atol=1e-12)


def test_bf16_inputs_with_float32_weights_keep_the_references_dtypes():
    """bf16 inputs and float32 weights (autocast's mix): the output is float32 as the written-out form makes it, and
    each gradient has its leaf's dtype and the reference's values (to bf16 rounding for the inputs')."""
    x, buffer, weight, bias = _inputs(4, dtype=torch.bfloat16, weight_dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (x, buffer, weight, bias)]
    out, _ = causal_depthwise_conv(x, weight, bias, buffer)
    out_ref = causal_conv_reference(x, weight, bias, buffer)
    assert out.dtype == out_ref.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    for leaf, grad, grad_ref in zip(leaves, torch.autograd.grad(out, leaves, cotangent),
                                    torch.autograd.grad(out_ref, leaves, cotangent)):
        assert grad.dtype == grad_ref.dtype == leaf.dtype
        torch.testing.assert_close(grad, grad_ref, rtol=2e-2, atol=2e-2)


def test_a_pass_costs_the_same_few_ops_whatever_the_kernel_size():
    """Forward and backward are a fixed handful of ops for any K (a product and a sum over a window view, and their
    gradients), not a few per tap."""
    from ltcx.throughput import KernelCounter

    def ops(kernel):
        x, _, weight, bias = _inputs(kernel, dtype=torch.float32)
        leaves = [t.requires_grad_() for t in (x, weight, bias)]
        with KernelCounter() as counter:
            out, _ = causal_depthwise_conv(x, weight, bias)
            out.backward(torch.ones_like(out))
        assert all(leaf.grad is not None for leaf in leaves)
        return counter.total

    assert ops(1) == ops(4) == ops(8) <= 12


@pytest.mark.parametrize("kernel", [1, 2, 4])
@pytest.mark.parametrize("with_buffer", [False, True], ids=["start", "buffer"])
def test_a_mask_convolves_the_real_tokens_alone(kernel, with_buffer):
    """With a mask (left, right and inner gaps, a fully masked row), each real output equals the convolution of its
    row's real tokens alone after the buffer, and the new buffer holds the last K-1 real inputs (the buffer's tail
    where a row has fewer); gradients reach x, the buffer and the weight through real positions only."""
    x, buffer, weight, bias = _inputs(kernel)
    buffer = buffer if with_buffer else None
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 0], [0] * 9], dtype=torch.bool)
    mask = torch.cat([mask, torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)])
    x = torch.cat([x, x[:1]]).requires_grad_()
    buffer = None if buffer is None else torch.cat([buffer, buffer[:1]])
    out, new_buffer = causal_depthwise_conv(x, weight, bias, buffer, mask=mask)
    expected = masked_causal_conv_reference(x, weight, bias, buffer, mask)
    torch.testing.assert_close(out[mask], expected[mask], rtol=1e-13, atol=1e-13)
    assert torch.isfinite(out).all()
    before = torch.zeros(3, kernel - 1, 5, dtype=x.dtype) if buffer is None else buffer
    for b in range(3):
        history = torch.cat([before[b], x[b, mask[b]]])
        assert torch.equal(new_buffer[b], history[history.shape[0] - (kernel - 1):])
    (grad,) = torch.autograd.grad(out[mask].sum(), x)
    assert grad[~mask].abs().max() == 0 and grad[mask].abs().max() > 0
