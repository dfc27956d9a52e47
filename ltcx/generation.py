"""Sampling for every backbone, driven by its state: prefill the prompt once, then one token a step. Tokens in,
tokens out (``generate``), text in, text out (``generate_texts``), and either (``continue_prompt``, what
``LanguageModel.generate`` runs)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

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
    context = backbone.max_seq_len
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
    mask: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens [B] one step at a time for prompts [B, T0].

    The prompt is fed once; each later step feeds only the last token with the backbone's state (KV cache
    or recurrent state). ``mask`` [B, T0] (True = a real token; None = all real) lets prompts of different lengths
    share the batch, padded anywhere (``pad_prompts``: on the left): each row continues its real tokens as if alone.
    A row that produced ``stop_token`` keeps yielding it; the loop ends when every
    row has stopped or ``max_new_tokens`` were produced. Non-finite logits (damaged weights) raise ``LtcxError``.
    """
    lengths = [prompt.shape[1]] if mask is None else mask.sum(dim=1).tolist()
    check_generation_args(backbone, max(lengths) if min(lengths) else 0, max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    with keeping_derived(backbone):  # derived weights built once for all steps, dropped when the generation ends
        if mask is None:
            logits, state = backbone(prompt, None)
            last = logits[:, -1]  # [B, V]
        else:
            logits, state = backbone(prompt, None, mask=mask.to(device=prompt.device, dtype=torch.bool))
            last_real = prompt.shape[1] - 1 - mask.flip(1).to(torch.uint8).argmax(dim=1).to(prompt.device)
            last = logits[torch.arange(prompt.shape[0], device=prompt.device), last_real]  # each row's last real
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for step in range(max_new_tokens):
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
            last = logits[:, -1]


def generate(backbone: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """prompts [B, T0] (``mask=`` [B, T0] for padded ones, as ``stream_tokens``) -> prompts followed by the generated
    tokens [B, T0 + n] (n <= max_new_tokens)."""
    new = list(stream_tokens(backbone, prompt, max_new_tokens, **sampling))
    return torch.cat([prompt, torch.stack(new, dim=1)], dim=1) if new else prompt


def pad_prompts(encoded: Sequence[Sequence[int]], pad_id: int,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token lists of any lengths -> (ids [B, T0] padded on the left with ``pad_id``, mask [B, T0]; None where every
    list has T0 tokens), one batch for ``stream_tokens``."""
    width = max(len(ids) for ids in encoded)
    batch = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.bool)
    for row, ids in enumerate(encoded):
        if ids:
            batch[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, width - len(ids):] = True
    return batch.to(device), None if bool(mask.all()) else mask.to(device)


def generate_texts(
    backbone: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    stop_at_eot: bool = True,
    **sampling,
) -> list[str]:
    """Complete each prompt; all share one batch, padded on the left with a mask (by token length for a backbone that
    takes no mask, ``takes_mask``). Returns prompt + completion."""
    device = next(backbone.parameters()).device
    encoded = [tokenizer.encode(p) for p in prompts]
    texts: list[str] = [""] * len(prompts)
    for rows in prompt_batches([len(ids) for ids in encoded], takes_mask(backbone)):
        batch, mask = pad_prompts([encoded[i] for i in rows], tokenizer.eot_id, device)
        out = generate(backbone, batch, max_new_tokens, stop_token=tokenizer.eot_id if stop_at_eot else None,
                       vocab_limit=tokenizer.vocab_size, mask=mask, **sampling)
        for row, new in zip(rows, out[:, batch.shape[1]:].tolist()):
            if stop_at_eot and tokenizer.eot_id in new:
                new = new[:new.index(tokenizer.eot_id)]
            texts[row] = tokenizer.decode(encoded[row] + new)
    return texts


def takes_mask(backbone: nn.Module) -> bool:
    """Whether ``backbone`` takes a padding mask (``Backbone.takes_mask``)."""
    return bool(getattr(backbone, "takes_mask", False))


def prompt_batches(lengths: Sequence[int], masked: bool) -> list[list[int]]:
    """The indices of prompts of ``lengths`` that share a batch: all of them where the backbone takes a padding mask
    (``masked``), else those of equal length."""
    if masked:
        return [list(range(len(lengths)))]
    by_length: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        by_length.setdefault(length, []).append(i)
    return list(by_length.values())


def generation_tokenizer(tokenizer: Any, saved_name: Any, data_tokenizer: Any, model_vocab: int | None,
                         required: bool) -> Any:
    """The tokenizer to generate with: ``tokenizer`` (a ``Tokenizer`` or a name for ``get_tokenizer``); else the one
    the model's file named (``saved_name``: only gpt2, bytes or a hub id, never a folder a file names); else the data
    module's. Checked against the model's vocabulary; None when none is known and ``required`` is false."""
    from ltcx.tokenizers import get_tokenizer, stored_tokenizer_name, vocab_fits

    if tokenizer is None and saved_name is not None:
        tokenizer = stored_tokenizer_name(
            saved_name, "the file this model was loaded from names tokenizer",
            "ltcx loads no tokenizer folder a file names; if you trust it, pass generate(..., tokenizer=FOLDER)",
        )
    if tokenizer is None:
        tokenizer = data_tokenizer
    if tokenizer is None:
        if required:
            raise LtcxError("generate() from text needs a tokenizer and this model knows none (it was not loaded "
                            "from an ltcx checkpoint or export): pass tokenizer='gpt2' (the one it was trained with)")
        return None
    if isinstance(tokenizer, str):
        tokenizer = get_tokenizer(tokenizer)
    if model_vocab is not None and not vocab_fits(tokenizer.vocab_size, model_vocab):
        raise LtcxError(f"tokenizer {tokenizer.name!r} ({tokenizer.vocab_size} ids) does not fit the model's "
                        f"vocabulary of {model_vocab}: pass the tokenizer it was trained with")
    return tokenizer


def continue_prompt(backbone: nn.Module, prompt: str | list[str] | torch.Tensor, max_new_tokens: int,
                    tokenizer: Any = None, saved_name: Any = None, data_tokenizer: Any = None,
                    stop_at_eot: bool = True, **sampling) -> str | list[str] | torch.Tensor:
    """``prompt`` continued by up to ``max_new_tokens`` tokens: a str -> a str, a list of str -> a list of str (each
    cut before the end-of-text token), token ids [B, T0] -> ids [B, T0 + n] (rows that stopped earlier padded with
    the end-of-text id). The tokenizer is ``generation_tokenizer``'s choice: text needs one; ids use it to stop at
    end-of-text and to keep to the tokenizer's ids in a padded vocabulary."""
    model_vocab = getattr(getattr(backbone, "config", None), "vocab_size", None)

    def find_tokenizer(required: bool) -> Any:
        return generation_tokenizer(tokenizer, saved_name, data_tokenizer, model_vocab, required)

    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 2 or prompt.dtype != torch.long:
            raise LtcxError(f"prompt ids must be a LongTensor [B, T], not {prompt.dtype} of shape "
                            f"{list(prompt.shape)}: use ids[None] for one sequence")
        found = find_tokenizer(False)
        device = next(backbone.parameters()).device
        return generate(backbone, prompt.to(device), max_new_tokens,
                        stop_token=found.eot_id if found is not None and stop_at_eot else None,
                        vocab_limit=found.vocab_size if found is not None else None, **sampling)
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise LtcxError("prompt must be a str, a non-empty list of str or a LongTensor of ids [B, T]")
    completed = generate_texts(backbone, find_tokenizer(True), texts, max_new_tokens, stop_at_eot, **sampling)
    return completed[0] if isinstance(prompt, str) else completed
