"""The output head and the cross-entropy fused, a chunk of tokens at a time (after Liger-Kernel's fused linear
cross-entropy): training never holds the ``[N, V]`` logits, only one chunk's ``[chunk, V]``. The slow reference it
must equal is ``ltcx.ops.naive.fused_loss.linear_cross_entropy_reference``.

Forward, per chunk: logits = hidden_c W^T (+ b) computed in the input's dtype (under autocast: the autocast dtype,
as ``nn.Linear`` would) and read in float32 (float64 stays float64), their log-sum-exp and the target's logit; when
a gradient is wanted the same pass forms d loss / d logits = softmax - onehot (zero on ``IGNORE_INDEX`` rows) and
turns it at once into that chunk's rows of grad_hidden = dlogits W and its share of grad_W = dlogits^T hidden_c
(grad_b = column sums), so the backward only scales them by the incoming gradient. Every vocabulary row takes part,
the padded ones included, as in ``F.cross_entropy`` over the full logits.
"""

from __future__ import annotations

import torch

from ltcx.batches import IGNORE_INDEX

__all__ = ["chunked_linear_cross_entropy", "default_chunk"]

_CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MiB of float32, ~166 tokens at GPT-2's 50,304


def default_chunk(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size``: a chunk's float32 logits stay near 32 MiB."""
    return max(1, _CHUNK_ELEMENTS // vocab_size)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChunkLogits:
    """The logits of one chunk after another, in buffers made once per call: the chunks reuse them, where a fresh
    ``[chunk, V]`` tensor per chunk costs a CPU a fresh mmap (glibc maps allocations this large) and a page fault
    per page of it."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> None:
        rows = min(chunk, hidden.shape[0])
        self.product = hidden.new_empty((rows, weight.shape[0]))
        accumulate = _accumulate_dtype(hidden.dtype)
        self.logits = self.product if accumulate == hidden.dtype else self.product.new_empty(
            self.product.shape, dtype=accumulate)

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """h [n, C] -> float32 (float64) logits [n, V], the product rounded to the operands' dtype first; the
        buffer's first n rows, overwritten by the next call."""
        product = self.product[:h.shape[0]]
        if bias is None:
            torch.mm(h, weight.T, out=product)
        else:
            torch.addmm(bias, h, weight.T, out=product)
        return product if self.logits is self.product else self.logits[:h.shape[0]].copy_(product)


def _asked(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V], targets [n] -> (asked [n] bool, targets with 0 where not asked [n], their logits [n])."""
    asked = targets != IGNORE_INDEX
    safe = targets.masked_fill(~asked, 0)
    return asked, safe, logits.gather(1, safe[:, None]).squeeze(1)


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [n, V], targets [n] -> the summed loss of the asked targets (no gradient wanted)."""
    asked, _, target_logit = _asked(logits, targets)
    return ((torch.logsumexp(logits, dim=-1) - target_logit) * asked).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        acc = _accumulate_dtype(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # written by the first chunk's product (zeros when there is no chunk)
        grad_weight = (torch.empty if hidden.shape[0] else torch.zeros)(weight.shape, dtype=acc, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        chunk_logits = _ChunkLogits(hidden, weight, chunk)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits = chunk_logits(h, weight, bias)
            # log-sum-exp and softmax from one exp pass in the logits' memory: lse = max + log sum exp(z - max),
            # softmax = exp(z - max) / sum (logsumexp, then exp(z - lse), took two passes and a copy)
            asked, safe, target_logit = _asked(logits, t)  # read before the logits' memory is overwritten
            top = logits.amax(dim=-1, keepdim=True)
            dlogits = logits.sub_(top).exp_()
            sums = dlogits.sum(dim=-1, keepdim=True)
            lse = (top + sums.log()).squeeze(1)
            total += ((lse - target_logit) * asked).sum()
            # softmax - onehot on asked rows, 0 on the rest: the row scale zeroes them in the softmax's own pass (no
            # check of the targets on the host, which would wait for the device)
            keep = asked.to(dlogits.dtype)
            dlogits.mul_(keep[:, None] / sums)
            rows = torch.arange(t.shape[0], device=t.device)
            dlogits[rows, safe] -= keep
            grad_hidden[start:start + chunk] = (dlogits.to(hidden.dtype) @ weight).to(hidden.dtype)
            if start == 0:
                torch.mm(dlogits.T, h.to(acc), out=grad_weight)  # no zero-fill of [V, C] before the first chunk
            else:
                grad_weight.addmm_(dlogits.T, h.to(acc))
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.backed = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # The gradients were made in the forward; scaled here in their own memory (a fresh [V, C] tensor per step
        # costs a CPU its page faults), so a second backward through the same graph would scale them twice.
        if ctx.backed:
            raise RuntimeError("the fused head's loss takes one backward per forward (retain_graph is not supported); "
                               "compute the loss again for another backward")
        ctx.backed = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_total.to(grad_weight.dtype)
        grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
        grad_weight = grad_weight.mul_(scale).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(scale).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, C], weight [V, C], targets [N] (``IGNORE_INDEX`` where nothing is asked), bias [V] ->
    (summed cross-entropy of the asked targets, float32 or float64 [], their count []): ``F.cross_entropy(hidden
    W^T + b, targets, reduction="sum")`` without the [N, V] logits, ``chunk`` tokens at a time (None:
    ``default_chunk(V)``). Under autocast the product runs in the autocast dtype, as ``nn.Linear``'s would."""
    if chunk is None:
        chunk = default_chunk(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk ({chunk}) must be a positive number of tokens")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    count = (targets != IGNORE_INDEX).sum()
    with torch.autocast(device_type, enabled=False):
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (hidden, weight, bias))
        if needs_grad:
            return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk), count
        total = torch.zeros((), dtype=_accumulate_dtype(hidden.dtype), device=hidden.device)
        chunk_logits = _ChunkLogits(hidden, weight, chunk)
        for start in range(0, hidden.shape[0], chunk):
            logits = chunk_logits(hidden[start:start + chunk], weight, bias)
            total += _chunk_loss(logits, targets[start:start + chunk])
        return total, count
