"""Recall past the training length: needle in a haystack over lengths x depths, and MQAR over lengths (pairs kept,
and pairs scaled with the length), scored by a trained backbone fed through its state in pieces
(``scoring.target_log_probs``: memory bounded by the piece, plus whatever state the architecture carries).

A cell's accuracy is exact match: a needle sequence counts when every digit of its passkey is the argmax (greedy
decoding would write it), an MQAR query when its value is (as ``val/recall_acc``). Each cell also reports the mean
log-probability of its answer tokens (nats), which moves before accuracy does. The sequences of one length are the
same at every depth (the batch's seed is ``(seed, split, length, batch)``), so depths are compared on paired data.
A backbone with a context limit (``max_seq_len``) is scored up to it; the longer lengths are left out, named in one
line (``ScoreGrid.note``, printed to stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from ltcx.batches import IGNORE_INDEX
from ltcx.data.mqar import SPLITS, TEST, mqar_batch
from ltcx.data.niah import check_niah, needle_position, needle_task, niah_batch
from ltcx.errors import ConfigError
from ltcx.eval.scoring import target_log_probs

__all__ = ["DEPTHS", "FACTORS", "ScoreGrid", "evaluate_mqar", "evaluate_niah", "lengths_within_context"]

FACTORS = (1, 2, 4, 8)  # lengths L, 2L, 4L, 8L
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class ScoreGrid:
    """Scores per cell: ``(length, depth)`` for the needle, ``(length, num_kv_pairs)`` for MQAR."""

    accuracy: dict[tuple, float] = field(default_factory=dict)  # exact-match accuracy in [0, 1]
    log_prob: dict[tuple, float] = field(default_factory=dict)  # mean log p of the answer tokens (nats)
    count: dict[tuple, int] = field(default_factory=dict)  # answers scored (sequences, or MQAR queries)
    note: str | None = None  # the context-limit line, when lengths were left out


def lengths_within_context(backbone: nn.Module, lengths: Sequence[int]) -> tuple[list[int], str | None]:
    """The lengths a backbone can read whole, and the one line naming where it stops (None: all of them)."""
    limit = getattr(backbone, "max_seq_len", None)
    kept = [n for n in lengths if limit is None or n <= limit]
    if len(kept) == len(lengths):
        return kept, None
    left = ", ".join(str(n) for n in lengths if n not in kept)
    return kept, (f"ltcx: {type(backbone).__name__} stops at its context limit of {limit} tokens (max_seq_len, "
                  f"learned positions): lengths {left} not evaluated")


def _device(backbone: nn.Module) -> torch.device:
    parameter = next(backbone.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _score_batch(
    backbone: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, per_sequence: bool, piece_len: int | None,
    vocab_limit: int | None,
) -> tuple[int, int, float, int]:
    """-> (answers exactly right, answers, summed log p of the answer tokens, answer tokens)."""
    device = _device(backbone)
    inputs, targets = inputs.to(device), targets.to(device)
    asked = targets != IGNORE_INDEX
    log_p, right = target_log_probs(backbone, inputs, targets.clamp(min=0), piece_len, vocab_limit)
    if per_sequence:  # a sequence is right when all its answer tokens are
        correct = int((right | ~asked).all(dim=1).sum())
        answers = inputs.shape[0]
    else:
        correct, answers = int((right & asked).sum()), int(asked.sum())
    return correct, answers, float(log_p[asked].double().sum()), int(asked.sum())


def _add(grid: ScoreGrid, cell: tuple, scores: Iterable[tuple[int, int, float, int]]) -> None:
    correct = answers = tokens = 0
    total = 0.0
    for c, a, s, t in scores:
        correct, answers, total, tokens = correct + c, answers + a, total + s, tokens + t
    grid.accuracy[cell], grid.count[cell] = correct / max(answers, 1), answers
    grid.log_prob[cell] = total / max(tokens, 1)


def _say(grid: ScoreGrid, report: Callable[[str], None] | None) -> ScoreGrid:
    if grid.note is not None:
        (report or (lambda line: print(line, file=sys.stderr)))(grid.note)
    return grid


def _batch_sizes(num_sequences: int, batch_size: int) -> list[int]:
    if num_sequences < 1 or batch_size < 1:
        raise ConfigError(f"num_sequences={num_sequences} and batch_size={batch_size} must be >= 1")
    return [min(batch_size, num_sequences - start) for start in range(0, num_sequences, batch_size)]


@torch.no_grad()
def evaluate_niah(
    backbone: nn.Module, train_length: int, *, factors: Sequence[int] = FACTORS, depths: Sequence[float] = DEPTHS,
    num_sequences: int = 32, batch_size: int = 8, tokenizer: str = "bytes", haystack: str = "sample",
    num_digits: int = 5, seed: int = 1234, split: int | str = TEST, piece_len: int | None = None,
    report: Callable[[str], None] | None = None, **text: str,
) -> ScoreGrid:
    """Needle accuracy per ``(length, depth)``, lengths ``factor * train_length``: ``num_sequences`` per cell from
    the ``split``'s haystack (``text``: ``needle``/``question`` as the training data's). ``piece_len`` None:
    ``train_length``. Call it on a backbone in eval mode."""
    split = SPLITS[split] if isinstance(split, str) else split
    task = needle_task(tokenizer, haystack, split, **text)
    lengths, note = lengths_within_context(backbone, [f * train_length for f in factors])
    for length in lengths:  # a length the haystack can not fill, a bad depth: one line before any scoring
        check_niah(task, length, num_digits)
    for depth in depths:
        needle_position(task, train_length, num_digits, depth)
    grid, sizes = ScoreGrid(note=note), _batch_sizes(num_sequences, batch_size)
    for length in lengths:
        for depth in depths:
            _add(grid, (length, depth), (
                _score_batch(backbone, *niah_batch(np.random.default_rng([seed, split, length, b]), task, size,
                                                   length, num_digits, depth),
                             True, piece_len or train_length, task.vocab_size)
                for b, size in enumerate(sizes)))
    return _say(grid, report)


@torch.no_grad()
def evaluate_mqar(
    backbone: nn.Module, train_length: int, num_kv_pairs: int, vocab_size: int, *, factors: Sequence[int] = FACTORS,
    scale_pairs: bool = False, num_sequences: int = 64, batch_size: int = 16, power_a: float = 0.01,
    random_fillers: bool = True, seed: int = 1234, split: int | str = TEST, piece_len: int | None = None,
    report: Callable[[str], None] | None = None,
) -> ScoreGrid:
    """MQAR accuracy per ``(length, pairs)``, lengths ``factor * train_length``, with ``num_kv_pairs`` pairs at
    every length, or ``factor * num_kv_pairs`` (``scale_pairs``: the same density of pairs as in training)."""
    split = SPLITS[split] if isinstance(split, str) else split
    lengths, note = lengths_within_context(backbone, [f * train_length for f in factors])
    cells = [(f * train_length, f * num_kv_pairs if scale_pairs else num_kv_pairs) for f in factors]
    cells = [cell for cell in cells if cell[0] in lengths]
    grid, sizes = ScoreGrid(note=note), _batch_sizes(num_sequences, batch_size)
    for length, pairs in cells:
        try:
            mqar_batch(np.random.default_rng(0), 1, length, pairs, vocab_size, power_a)  # lays the task out or says why
        except ConfigError as exc:
            raise ConfigError(f"MQAR at length {length} with {pairs} pairs: {exc}") from None
    for length, pairs in cells:
        _add(grid, (length, pairs), (
            _score_batch(backbone, *mqar_batch(np.random.default_rng([seed, split, length, b]), size, length, pairs,
                                               vocab_size, power_a, random_fillers),
                         False, piece_len or train_length, vocab_size)
            for b, size in enumerate(sizes)))
    return _say(grid, report)
