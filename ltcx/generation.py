"""Sampling for every backbone, driven by its state: prefill the prompt once, then one token a step."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn

from ltcx.errors import LtcxError
from ltcx.models.inference_cache import keeping_derived


def filter_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """logits [B, V] -> temperature-scaled logits [B, V] with excluded tokens at -inf.

    vocab_limit: ids >= this are never produced (the padded part of a vocabulary).
    top_k: keep the k most likely tokens. top_p: keep the smallest set whose probability reaches p.
    """
    logits = logits.float() / temperature
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] of the last position -> next token ids [B]; temperature 0 is greedy.

    A temperature so small that logits / temperature overflows float32 (1e-40) is greedy too, in the rows where it
    overflows: that is sampling's limit as the temperature goes to 0 (softmax would give NaN there).
    """
    if temperature == 0:
        return filter_logits(logits, 1.0, None, None, vocab_limit).argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p, vocab_limit), dim=-1)
    overflowed = ~torch.isfinite(probs).all(dim=-1)  # [B]
    if bool(overflowed.any()):
        greedy = filter_logits(logits[overflowed], 1.0, None, None, vocab_limit).argmax(dim=-1)
        probs[overflowed] = nn.functional.one_hot(greedy, probs.shape[-1]).to(probs.dtype)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_generation_args(
    backbone: nn.Module, prompt_len: int, max_new_tokens: int, temperature: float, top_k, top_p
) -> None:
    if prompt_len < 1:
        raise LtcxError("the prompt is empty: give at least one token of prompt text")
    if max_new_tokens < 0:
        raise LtcxError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    if not 0 <= temperature < math.inf:
        raise LtcxError(f"temperature ({temperature}) must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise LtcxError(f"top_k ({top_k}) must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise LtcxError(f"top_p ({top_p}) must be in (0, 1]")
    context = getattr(backbone, "max_seq_len", None)
    if context is not None and prompt_len + max_new_tokens > context:
        raise LtcxError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) is {prompt_len + max_new_tokens}"
            f" tokens, more than the model's context of {context}; shorten the prompt or lower max_new_tokens"
        )


@torch.no_grad()
def stream_tokens(
    backbone: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | None = None,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens [B] one step at a time for prompts [B, T0] of equal length.

    The prompt is fed once; each later step feeds only the last token with the backbone's state (KV cache
    or recurrent state). A row that produced ``stop_token`` keeps yielding it; the loop ends when every
    row has stopped or ``max_new_tokens`` were produced. Non-finite logits (damaged weights) raise ``LtcxError``.
    """
    check_generation_args(backbone, prompt.shape[1], max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    with keeping_derived(backbone):  # derived weights built once for all steps, dropped when the generation ends
        logits, state = backbone(prompt, None)
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for step in range(max_new_tokens):
            last = logits[:, -1]  # [B, V]
            # Damaged weights: multinomial would raise a traceback, and greedy would print garbage.
            if not bool(torch.isfinite(last).all()):
                raise LtcxError(
                    f"the model's logits are not finite at generated token {step + 1}: its weights are damaged or "
                    "diverged; sample from an earlier checkpoint"
                )
            token = sample_next(last, temperature, top_k, top_p, vocab_limit, generator)
            if stop_token is not None:
                token = token.masked_fill(finished, stop_token)
                finished |= token == stop_token
            yield token
            if step + 1 == max_new_tokens or (stop_token is not None and bool(finished.all())):
                return
            logits, state = backbone(token[:, None], state)


def generate(backbone: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """prompts [B, T0] -> prompts followed by the generated tokens [B, T0 + n] (n <= max_new_tokens)."""
    new = list(stream_tokens(backbone, prompt, max_new_tokens, **sampling))
    return torch.cat([prompt, torch.stack(new, dim=1)], dim=1) if new else prompt


def generate_texts(
    backbone: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    stop_at_eot: bool = True,
    **sampling,
) -> list[str]:
    """Complete each prompt; prompts of equal token length share one batch. Returns prompt + completion."""
    device = next(backbone.parameters()).device
    encoded = [tokenizer.encode(p) for p in prompts]
    texts: list[str | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    for rows in by_length.values():
        batch = torch.tensor([encoded[i] for i in rows], dtype=torch.long, device=device)
        out = generate(
            backbone,
            batch,
            max_new_tokens,
            stop_token=tokenizer.eot_id if stop_at_eot else None,
            vocab_limit=tokenizer.vocab_size,
            **sampling,
        )
        for row, ids in zip(rows, out.tolist()):
            if stop_at_eot and tokenizer.eot_id in ids[len(encoded[row]) :]:
                ids = ids[: ids.index(tokenizer.eot_id, len(encoded[row]))]
            texts[row] = tokenizer.decode(ids)
    return texts  # type: ignore[return-value]
