"""lm-evaluation-harness (the ``lm_eval`` package, 0.4.x) adapter: ``LtcxLM`` scores and generates with any ltcx
backbone, so ``lm_eval.simple_evaluate(model=LtcxLM(...), tasks=[...])`` runs the harness's tasks on it.

- ``loglikelihood``: context + continuation fed once (in pieces through the state, ``target_log_probs``), the
  continuation's log-probability summed; requests batched longest first, right-padded (every backbone is causal, so
  padding after a row changes none of its scores). A model with a context limit sees the last ``max_seq_len + 1``
  tokens, as the harness's own HF model does.
- ``loglikelihood_rolling``: the harness's rolling windows of the model's context (one window for a model without a
  limit, whose state carries any length), each token predicted once.
- ``generate_until``: greedy (or sampled, with ``do_sample``) through ``ltcx.generation.stream_tokens``, the one
  sampling loop, stopping at the end-of-text token or any ``until`` string; prompts of any lengths share a batch
  (padded on the left, with the backbones' padding mask).

Imports ``lm_eval`` at the top: only ``ltcx lm-eval`` imports this module, so ``ltcx --help`` never loads it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ltcx.errors import LtcxError
from ltcx.eval.scoring import target_log_probs
from ltcx.generation import pad_prompts, stream_tokens, takes_mask
from ltcx.tokenizers import Tokenizer

__all__ = ["LtcxLM"]

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until tasks that set none


class LtcxLM(TemplateLM):
    """An ``lm_eval.api.model.LM`` around an ltcx backbone and its tokenizer.

    Args:
        backbone: keeps the contract ``logits, state = backbone(idx, state)``; moved to ``device``, in eval mode.
        tokenizer: the tokenizer it was trained with (``ltcx.tokenizers``); its end-of-text id is the prefix of an
            empty context and of rolling windows, as the end of the previous document was in training.
        batch_size: sequences per forward.
        piece_len: tokens per forward, the state carried between pieces (None: whole sequences).
        name: the model's name in the harness's results (e.g. the checkpoint path).
    """

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
        piece_len: int | None = None,
        name: str = "ltcx",
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise LtcxError(f"--batch_size ({batch_size}) must be >= 1")
        self._device = torch.device(device)
        self.backbone = backbone.to(self._device).eval()
        self.text_tokenizer = tokenizer  # not `tokenizer`: the harness reads that as a chat-template holder
        self.batch_size = batch_size
        self.piece_len = piece_len
        self.name = name
        self.max_length: int | None = backbone.max_seq_len  # None: no context limit

    # -- what TemplateLM needs ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.text_tokenizer.eot_id

    @property
    def tokenizer_name(self) -> str:
        return self.text_tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text_tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text_tokenizer.decode(tokens)

    def get_model_info(self) -> dict:
        """Recorded in the harness's results under ``config``."""
        return {"model": self.name, "backbone": type(self.backbone).__name__, "tokenizer": self.tokenizer_name}

    # -- scoring -------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """``(key, context ids, continuation ids)`` -> ``(sum of the continuation's log-probabilities, whether each of
        its tokens is the argmax)``; a key (the request's text) is cached by the harness's cache hook."""
        rows = []  # (request index, input ids, target ids, continuation length)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:  # nothing to score: the log-probability of the empty string
                results[i] = (0.0, True)
                continue
            whole = context + continuation
            if self.max_length is not None:
                whole = whole[-(self.max_length + 1) :]
            if len(continuation) > len(whole) - 1:
                raise LtcxError(
                    f"an lm_eval request's continuation of {len(continuation)} tokens does not fit the model's context "
                    f"of {self.max_length} tokens: leave out that task, or evaluate a model with a longer context"
                )
            rows.append((i, whole[:-1], whole[1:], len(continuation)))
        rows.sort(key=lambda row: -len(row[1]))  # similar lengths share a batch: little padding
        batches = [rows[s : s + self.batch_size] for s in range(0, len(rows), self.batch_size)]
        for batch in tqdm(batches, desc="loglikelihood", disable=disable_tqdm):
            length = len(batch[0][1])
            inputs = torch.zeros(len(batch), length, dtype=torch.long)
            targets = torch.zeros(len(batch), length, dtype=torch.long)
            for r, (_, row_inputs, row_targets, _) in enumerate(batch):
                inputs[r, : len(row_inputs)] = torch.tensor(row_inputs)
                targets[r, : len(row_targets)] = torch.tensor(row_targets)
            log_probs, greedy = target_log_probs(
                self.backbone, inputs.to(self._device), targets.to(self._device), self.piece_len,
                vocab_limit=self.text_tokenizer.vocab_size,
            )
            for r, (i, row_inputs, _, scored) in enumerate(batch):
                span = slice(len(row_inputs) - scored, len(row_inputs))  # the continuation's targets
                answer = (float(log_probs[r, span].double().sum()), bool(greedy[r, span].all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-probability after the end-of-text token, every token predicted once."""
        windows, owners = [], []
        for i, (string,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(string)
            window_len = self.max_length or max(len(tokens), 1)  # no limit: one window, the state carries it
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, window_len, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, scores):
            totals[owner] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until an ``until`` string, the end-of-text token or ``max_gen_toks`` tokens;
        the text returned stops before the first ``until`` string."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        prepared = []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sampled = bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
            sampling = dict(
                temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
                top_k=kwargs.get("top_k") if sampled else None,
                top_p=kwargs.get("top_p") if sampled else None,
            )
            ids = self.tok_encode(context) or [self.eot_token_id]
            if self.max_length is not None:  # keep the end of the prompt and room for the answer, as HF models do
                max_new = min(max_new, self.max_length - 1)
                ids = ids[-(self.max_length - max_new) :]
            prepared.append((ids, until, max_new, sampling))
            by_length = () if takes_mask(self.backbone) else (len(ids),)  # without a padding mask: equal lengths
            groups[(max_new, tuple(sorted(sampling.items())), *by_length)].append(i)
        results: list[str | None] = [None] * len(requests)
        size = self.batch_size
        for rows in groups.values():
            rows.sort(key=lambda i: -len(prepared[i][0]))  # similar lengths share a batch: little padding
        chunks = [rows[s : s + size] for rows in groups.values() for s in range(0, len(rows), size)]
        for rows in tqdm(chunks, desc="generate_until", disable=disable_tqdm):
            _, _, max_new, sampling = prepared[rows[0]]
            prompt, mask = pad_prompts([prepared[i][0] for i in rows], self.eot_token_id, self._device)
            new: list[list[int]] = [[] for _ in rows]
            done = [False] * len(rows)
            for token in stream_tokens(
                self.backbone, prompt, max_new, stop_token=self.eot_token_id,
                vocab_limit=self.text_tokenizer.vocab_size, mask=mask, **sampling,
            ):
                for r, value in enumerate(token.tolist()):
                    if done[r]:
                        continue
                    if value == self.eot_token_id:
                        done[r] = True
                        continue
                    new[r].append(value)
                    until = prepared[rows[r]][1]
                    done[r] = bool(until) and any(stop in self.tok_decode(new[r]) for stop in until)
                if all(done):
                    break
            for r, i in enumerate(rows):
                text = self.tok_decode(new[r])
                for stop in prepared[i][1]:
                    text = text.split(stop, 1)[0] if stop else text
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]
