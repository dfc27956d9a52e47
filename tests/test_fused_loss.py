"""The chunked head + cross-entropy (ltcx/ops/fused_loss.py) against the full logits' F.cross_entropy
(ltcx/ops/naive/fused_loss.py): loss and gradients of hidden, weight and bias, IGNORE_INDEX, ragged and ignored
chunks, bf16 autocast; and every backbone's forward_hidden + output_head against its forward."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from ltcx.batches import IGNORE_INDEX
from ltcx.metrics import cross_entropy
from ltcx.models import catalog
from ltcx.ops.fused_loss import chunked_linear_cross_entropy
from ltcx.ops.naive.fused_loss import linear_cross_entropy_reference


def _problem(dtype, n=37, c=16, v=53, bias=True, ignore=(3, 4, 5, 20)):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, c, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, c, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[list(ignore)] = IGNORE_INDEX
    return hidden, weight, b, targets


def _loss_and_grads(fn, hidden, weight, bias, targets, **kw):
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    for x in inputs:
        x.grad = None
    total, count = fn(hidden, weight, targets, bias, **kw)
    (total / count * 1.7).backward()  # an upstream gradient other than 1
    return total.detach(), count, [x.grad.clone() for x in inputs]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 100])  # 5 and 8 do not divide 37; 100 > N
def test_float64_equals_the_full_logits(chunk, bias):
    problem = _problem(torch.float64, bias=bias)
    want, want_count, want_grads = _loss_and_grads(linear_cross_entropy_reference, *problem)
    got, count, grads = _loss_and_grads(chunked_linear_cross_entropy, *problem, chunk=chunk)
    assert got.dtype == torch.float64 and int(count) == int(want_count) == 33
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_float32_within_rounding():
    problem = _problem(torch.float32, n=300, c=64, v=1000)
    want, _, want_grads = _loss_and_grads(linear_cross_entropy_reference, *problem)
    got, _, grads = _loss_and_grads(chunked_linear_cross_entropy, *problem, chunk=64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_two_losses_in_a_row_each_get_their_own_gradients_and_a_second_backward_is_refused():
    """The chunks share one logits buffer and the backward scales the forward's gradients in place: a second
    forward starts from nothing of the first, and a second backward through one graph (which would scale twice)
    is one line instead of a wrong gradient."""
    problem = _problem(torch.float64)
    want = _loss_and_grads(linear_cross_entropy_reference, *problem)
    for _ in range(2):
        got = _loss_and_grads(chunked_linear_cross_entropy, *problem, chunk=8)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    hidden, weight, bias, targets = problem
    total, _ = chunked_linear_cross_entropy(hidden, weight, targets, bias, chunk=8)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        total.backward()


def test_ignored_chunks_contribute_nothing():
    """Whole chunks of IGNORE_INDEX give no loss and no gradient; the asked rows match the reference."""
    hidden, weight, bias, targets = _problem(torch.float64, n=20, ignore=range(0, 12))
    got, count, grads = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, bias, targets, chunk=4)
    want, _, want_grads = _loss_and_grads(linear_cross_entropy_reference, hidden, weight, bias, targets)
    assert int(count) == 8
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.all(grads[0][:12] == 0)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_all_ignored_is_zero_with_no_gradient():
    hidden, weight, bias, targets = _problem(torch.float64, n=6, ignore=range(6))
    total, count = chunked_linear_cross_entropy(hidden, weight, targets, bias, chunk=4)
    total.backward()
    assert float(total.detach()) == 0.0 and int(count) == 0
    assert all(torch.all(x.grad == 0) for x in (hidden, weight, bias))


def test_without_grad_gives_the_same_loss():
    hidden, weight, bias, targets = _problem(torch.float64)
    with torch.no_grad():
        total, _ = chunked_linear_cross_entropy(hidden, weight, targets, bias, chunk=6)
    want, _ = linear_cross_entropy_reference(hidden, weight, targets, bias)
    assert not total.requires_grad
    torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-12)


def test_bf16_autocast_rounds_the_logits_as_the_head_does():
    """Under bf16 autocast the product is bf16 (as nn.Linear's), read in float32; gradients reach the float32
    parameters in float32."""
    hidden, weight, bias, targets = _problem(torch.float32, n=64, c=32, v=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _, want_grads = _loss_and_grads(linear_cross_entropy_reference, hidden, weight, bias, targets)
        got, _, grads = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, bias, targets, chunk=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same bf16 logits, summed in float32
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)  # bf16 products of the gradient


def test_a_bad_chunk_is_refused():
    hidden, weight, bias, targets = _problem(torch.float32)
    with pytest.raises(ValueError, match="chunk"):
        chunked_linear_cross_entropy(hidden, weight, targets, bias, chunk=0)


SHAPES = [(name, shape) for name in catalog.names() for shape in catalog.get(name).shapes()]


@pytest.mark.parametrize("name,shape", SHAPES, ids=[f"{n}-{s}" for n, s in SHAPES])
def test_forward_is_the_head_of_forward_hidden(name, shape):
    torch.manual_seed(0)
    model = catalog.build_tiny(name, variant=shape, vocab_size=61).eval()
    idx = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        hidden, _ = model.forward_hidden(idx)
        head = model.output_head()
        assert hidden.shape == (2, 9, head.in_features) and head.out_features == 61
        assert torch.equal(head(hidden), logits)


# -- LanguageModel: the fused loss against the full logits' -------------------------------------------------


def _lm_and_batch(name="gpt"):
    from ltcx.lm import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(catalog.build_tiny(name, vocab_size=67))
    return model, torch.randint(0, 67, (3, 12), generator=torch.Generator().manual_seed(1))


def _full_logits_loss(model, inputs, targets):
    return cross_entropy(model.backbone(inputs)[0], targets)


@pytest.mark.parametrize("name", ["gpt", "xlstm"])
def test_training_loss_and_gradients_equal_the_full_logits(name):
    model, batch = _lm_and_batch(name)
    params = dict(model.named_parameters())
    model.loss(batch).backward()
    fused = {n: p.grad.clone() for n, p in params.items()}
    fused_loss = model.loss(batch).detach()
    model.zero_grad()
    full = _full_logits_loss(model, batch[:, :-1], batch[:, 1:])
    full.backward()
    torch.testing.assert_close(fused_loss, full.detach(), rtol=1e-6, atol=1e-6)
    for n, p in params.items():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_measurement_scripts_step_takes_the_fused_or_the_full_path():
    """ltcx.throughput.loss_step (scripts/benchmark.py, scripts/gpu_check.py, the study's timing pass): "fused" is
    ``LanguageModel.loss``, "full" the full logits' cross-entropy (in float32, ``ltcx.metrics.cross_entropy``); the two
    take the same step to float32 rounding."""
    import contextlib
    import copy

    from ltcx.throughput import loss_step

    model, batch = _lm_and_batch("gpt")
    twin = copy.deepcopy(model)
    with mock.patch.object(model, "loss", wraps=model.loss) as loss:
        loss_step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), contextlib.nullcontext())()
    assert loss.call_count == 1
    with mock.patch.object(twin, "loss") as not_called:
        loss_step(twin, batch, torch.optim.SGD(twin.parameters(), lr=0.1), contextlib.nullcontext(), "full")()
    assert not_called.call_count == 0
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="'fused' or 'full'"):
        loss_step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), contextlib.nullcontext(), "logits")


def test_pair_batches_ignore_targets_and_predict_scores_each_block():
    model, batch = _lm_and_batch()
    inputs, targets = batch[:, :-1], batch[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX
    targets[2] = IGNORE_INDEX
    with torch.no_grad():
        torch.testing.assert_close(model.loss((inputs, targets)), _full_logits_loss(model, inputs, targets))
        logits = model.backbone(inputs)[0].float()
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        want = per_token.sum(1) / (targets != IGNORE_INDEX).sum(1).clamp(min=1)
        torch.testing.assert_close(model.predict_step((inputs, targets), 0), want)
        assert float(model.predict_step((inputs, targets), 0)[2]) == 0.0


def test_a_module_that_is_not_a_backbone_is_refused_naming_the_base_class():
    """The loss, generation and FSDP rely on ``Backbone``'s contract: a bare module keeping only ``forward`` is
    refused before anything runs."""
    from ltcx.errors import ConfigError
    from ltcx.lm import LanguageModel

    class LogitsOnly(torch.nn.Module):
        def forward(self, idx, state=None):
            return torch.zeros(*idx.shape, 11), None

    with pytest.raises(ConfigError, match=r"LogitsOnly.*ltcx\.models\.base\.Backbone"):
        LanguageModel(LogitsOnly())


def test_no_tokens_is_a_zero_loss_with_zero_gradients():
    hidden = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    total, count = chunked_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    total.backward()
    assert total.item() == 0 and count.item() == 0
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and hidden.grad.shape == (0, 8)
