"""Needle in a haystack (RULER's single-needle S-NIAH, Hsieh et al. 2024, arXiv 2404.06654), generated on the fly.

A sequence is ``block_size + 1`` tokens of a tokenizer (``bytes`` by default), cut one apart into
``(inputs [B, T], targets [B, T])`` as MQAR's pairs are (``T = block_size``)::

    haystack[0 : p] | needle("The passkey is 40917. ") | haystack[p : n] | question(" What is the passkey? The
    passkey is ") | 4 0 9 1 7

``n = T + 1 - len(needle) - len(question) - num_digits`` haystack tokens; the needle starts at position
``p = round(depth * n)`` of the sequence (depth 0: first; 1: right before the question), at that exact token, not
a sentence boundary. The passkey is ``num_digits`` random decimal digits (the first nonzero), one token per digit:
each digit's own id, never the tokenizer's merge of them, so every tokenizer asks the same digits. Targets are
``IGNORE_INDEX`` except at the last ``num_digits`` inputs, whose targets are the digits: the model reads the
question (and the digits so far) and must answer the next digit. The haystack is a window at a random offset of the
shipped TinyStories sample (``ltcx/data/sample/``: ``train.txt`` for training, ``validation.txt`` for the validation
and test splits; ``haystack="sample"``), or a filler sentence repeated from its start (``haystack="repeat"``, the
passkey-retrieval filler of Mohtashami & Jaggi 2023). Training draws the depth uniformly (``p`` uniform over
``0..n``); ``ltcx.eval.long_context`` asks at fixed depths and longer lengths.

Batch ``g`` of a split is a function of ``(seed, split, g)`` alone, as MQAR's (``ltcx/data/mqar.py`` says what that
gives: disjoint ranks, exact resume, train/validation/test streams from different seeds).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ltcx.batches import IGNORE_INDEX
from ltcx.data.block_source import loader_checks, rank_and_world
from ltcx.data.module import check_batch_fits
from ltcx.data.mqar import SPLITS, TRAIN, VALIDATION, RecallBatches, RecallDataModule
from ltcx.errors import ConfigError, refuse_bad_settings
from ltcx.tokenizers import Tokenizer, get_tokenizer

__all__ = ["HAYSTACKS", "NeedleBatches", "NeedleDataModule", "NeedleTask", "needle_position", "needle_task",
           "niah_batch"]

HAYSTACKS = ("sample", "repeat")
SAMPLE_DIR = Path(__file__).parent / "sample"
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The passkey is {passkey}. "
QUESTION = " What is the passkey? The passkey is "


@dataclass(frozen=True)
class NeedleTask:
    """The token ids a needle sequence is made of (``needle_task`` builds them once per tokenizer and split):
    the needle's text before and after the passkey, the question, each decimal digit's id, the haystack."""

    before: np.ndarray  # [len] ids of the needle before the passkey
    after: np.ndarray  # [len] ids of the needle after the passkey
    question: np.ndarray  # [len]
    digits: np.ndarray  # [10]: the id of "0" .. "9"
    haystack: np.ndarray  # [N] ids: the sample's tokens, or the filler sentence's (repeated as needed)
    repeat: bool  # haystack="repeat": the window starts at 0 and wraps; else a random offset of the sample
    vocab_size: int  # ids of the tokenizer

    def fixed_length(self, num_digits: int) -> int:
        """Tokens of a sequence that are not haystack: needle with its passkey, question, answer."""
        return self.before.size + num_digits + self.after.size + self.question.size + num_digits

    def haystack_length(self, block_size: int, num_digits: int) -> int:
        """``n``: haystack tokens of a sequence of ``block_size`` inputs."""
        return block_size + 1 - self.fixed_length(num_digits)


def _ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


@functools.lru_cache(maxsize=16)
def _sample_ids(tokenizer_name: str, file: str) -> np.ndarray:
    """The shipped sample's tokens (read and tokenized once per tokenizer and file)."""
    text = (SAMPLE_DIR / file).read_text(encoding="utf-8")
    return _ids(get_tokenizer(tokenizer_name), text)


def needle_task(
    tokenizer: str = "bytes", haystack: str = "sample", split: int | str = TRAIN, needle: str = NEEDLE,
    question: str = QUESTION,
) -> NeedleTask:
    """The ids of the task for ``tokenizer`` (a name for ``get_tokenizer``); ``needle`` holds ``{passkey}`` once.
    One ``ConfigError`` line for an unknown haystack, a needle without its passkey, a digit of several tokens."""
    if haystack not in HAYSTACKS:
        raise ConfigError(f"data.haystack={haystack!r} is not one of {', '.join(HAYSTACKS)}: fix --data.haystack")
    if needle.count("{passkey}") != 1:
        raise ConfigError(f"data.needle={needle!r} must hold '{{passkey}}' exactly once: fix --data.needle")
    split = SPLITS[split] if isinstance(split, str) else split
    tok = get_tokenizer(tokenizer)
    digits = [tok.encode(str(d)) for d in range(10)]
    if any(len(ids) != 1 for ids in digits):
        raise ConfigError(f"data.tokenizer={tokenizer!r} does not give each decimal digit one token, so the passkey "
                          "cannot be asked digit by digit: use --data.tokenizer bytes or gpt2")
    before, after = needle.split("{passkey}")
    if haystack == "sample":
        hay = _sample_ids(tokenizer, "train.txt" if split == TRAIN else "validation.txt")
    else:
        hay = _ids(tok, REPEAT_FILLER)
    return NeedleTask(_ids(tok, before), _ids(tok, after), _ids(tok, question),
                      np.asarray([ids[0] for ids in digits], dtype=np.int64), hay, haystack == "repeat",
                      tok.vocab_size)


def check_niah(task: NeedleTask, block_size: int, num_digits: int) -> None:
    """One ``ConfigError`` line for a sequence the needle, question and answer do not fit, or a sample haystack
    shorter than the sequence's."""
    if not 1 <= num_digits <= 18:
        raise ConfigError(f"data.num_digits={num_digits} must be in 1..18: fix --data.num_digits")
    n = task.haystack_length(block_size, num_digits)
    if n < 0:
        raise ConfigError(
            f"data.block_size={block_size} is too short for the needle, the question and a {num_digits}-digit answer: "
            f"they need block_size >= {task.fixed_length(num_digits) - 1}; raise --data.block_size or shorten "
            "--data.needle / --data.question"
        )
    if not task.repeat and n > task.haystack.size:
        raise ConfigError(
            f"data.block_size={block_size} needs {n} haystack tokens and the shipped sample has {task.haystack.size}: "
            "use --data.haystack repeat or lower --data.block_size"
        )


def needle_position(task: NeedleTask, block_size: int, num_digits: int, depth: float) -> int:
    """The input position the needle starts at for ``depth`` in [0, 1]: ``round(depth * n)``."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth} must be in [0, 1] (0: the needle first, 1: right before the question)")
    return int(round(depth * task.haystack_length(block_size, num_digits)))


def niah_batch(
    rng: np.random.Generator, task: NeedleTask, batch_size: int, block_size: int, num_digits: int = 5,
    depth: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One needle batch from ``rng``: ``(inputs LongTensor[B, T], targets LongTensor[B, T])`` laid out as the module
    docstring says; ``depth`` None draws the needle's position uniformly per sequence (training)."""
    check_niah(task, block_size, num_digits)
    B, n = batch_size, task.haystack_length(block_size, num_digits)
    passkeys = rng.integers(0, 10, size=(B, num_digits))
    passkeys[:, 0] = rng.integers(1, 10, size=B)  # a leading zero would make a shorter number
    if depth is None:
        positions = rng.integers(0, n + 1, size=B)
    else:
        positions = np.full(B, needle_position(task, block_size, num_digits, depth))
    if task.repeat:
        starts = np.zeros(B, dtype=np.int64)
        hay = np.resize(task.haystack, n)  # the sentence repeated from its start, cut at n
    else:
        starts = rng.integers(0, task.haystack.size - n + 1, size=B)
    rows = np.empty((B, block_size + 1), dtype=np.int64)
    for b in range(B):  # data making, one row at a time: pieces of different lengths per row
        window = hay if task.repeat else task.haystack[starts[b] : starts[b] + n]
        key = task.digits[passkeys[b]]
        p = positions[b]
        rows[b] = np.concatenate([window[:p], task.before, key, task.after, window[p:], task.question, key])
    targets = np.full((B, block_size), IGNORE_INDEX, dtype=np.int64)
    targets[:, block_size - num_digits :] = rows[:, block_size + 1 - num_digits :]
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(targets)


class NeedleBatches(RecallBatches):
    """Needle batches of one rank of one split (use ``batch_size=None`` in the DataLoader); iteration, ``len`` and
    ``num_batches`` as ``RecallBatches``'. ``depth`` None: drawn per sequence; else every needle at it."""

    def __init__(
        self, *, split: int | str, rank: int, world_size: int, batch_size: int, block_size: int, num_digits: int,
        tokenizer: str, haystack: str, seed: int, needle: str = NEEDLE, question: str = QUESTION,
        depth: float | None = None, start_batch: int = 0, num_batches: int | None = None,
    ) -> None:
        split = SPLITS[split] if isinstance(split, str) else split
        self.needle_task = needle_task(tokenizer, haystack, split, needle, question)
        check_niah(self.needle_task, block_size, num_digits)
        if depth is not None:
            needle_position(self.needle_task, block_size, num_digits, depth)  # a bad depth is one line now
        self.split, self.rank, self.world_size, self.seed = split, rank, world_size, seed
        self.start_batch, self.num_batches = start_batch, num_batches
        self.task = dict(batch_size=batch_size, block_size=block_size, num_digits=num_digits, depth=depth)

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``b`` of this rank: global batch ``b * world_size + rank`` of the split."""
        rng = np.random.default_rng([self.seed, self.split, b * self.world_size + self.rank])
        return niah_batch(rng, self.needle_task, **self.task)


class NeedleDataModule(RecallDataModule):
    """Needle in a haystack (RULER's S-NIAH) made on the fly, for training at ``block_size``: use it as ``--data``
    with ``configs/data/niah.yaml`` (``class_path: ltcx.data.niah.NeedleDataModule``). The model's vocabulary is
    the tokenizer's (padded); dataloaders, splits and exact resume are ``RecallDataModule``'s.

    Args:
        tokenizer: ``bytes`` (257 ids: the small vocabulary) or ``gpt2``; any whose digits are one token each.
        block_size: tokens per sequence (the model's input length L).
        num_digits: digits of the passkey (one token each).
        haystack: ``sample`` (the shipped TinyStories sample) or ``repeat`` (a filler sentence repeated).
        needle: the sentence hidden in the haystack, holding ``{passkey}`` once.
        question: the text after the haystack; the answer's digits follow it.
        batch_size, val_batches, test_batches, num_workers, seed, pad_vocab_to_multiple_of: as
            ``RecallDataModule``'s.
    """

    def __init__(
        self,
        tokenizer: str = "bytes",
        block_size: int = 256,
        num_digits: int = 5,
        haystack: str = "sample",
        needle: str = NEEDLE,
        question: str = QUESTION,
        batch_size: int = 32,
        val_batches: int = 8,
        num_workers: int = 0,
        seed: int = 1234,
        pad_vocab_to_multiple_of: int = 64,
        test_batches: int | None = None,
    ) -> None:
        super(RecallDataModule, self).__init__()
        checks = loader_checks(batch_size, val_batches, num_workers, pad_vocab_to_multiple_of, test_batches)
        refuse_bad_settings("data", [*checks, (seed >= 0, "seed", seed, "must be >= 0")])
        check_batch_fits(block_size, batch_size)
        for split in (TRAIN, VALIDATION):  # every split's haystack fits, before anything is allocated
            check_niah(needle_task(tokenizer, haystack, split, needle, question), block_size, num_digits)
        self.save_hyperparameters()
        self.tokenizer, self.block_size, self.num_digits, self.haystack = tokenizer, block_size, num_digits, haystack
        self.needle, self.question = needle, question
        self.vocab_size = get_tokenizer(tokenizer).vocab_size
        self.batch_size, self.val_batches, self.num_workers = batch_size, val_batches, num_workers
        self.test_batches = val_batches if test_batches is None else test_batches
        self.seed, self.pad_vocab_to_multiple_of = seed, pad_vocab_to_multiple_of
        self._resume_batches = 0

    @property
    def tokenizer_obj(self) -> Tokenizer:
        """The tokenizer (its text samples are TensorBoard's sample generations)."""
        return get_tokenizer(self.tokenizer)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(tokenizer={self.tokenizer!r}, block_size={self.block_size}, "
                f"num_digits={self.num_digits}, haystack={self.haystack!r})")

    __str__ = __repr__

    def _batches(self, split: int, rank: int | None, world_size: int | None, **kw: Any) -> NeedleBatches:
        rank, world_size = rank_and_world(self, rank, world_size)
        return NeedleBatches(
            split=split, rank=rank, world_size=world_size, batch_size=self.batch_size, block_size=self.block_size,
            num_digits=self.num_digits, tokenizer=self.tokenizer, haystack=self.haystack, seed=self.seed,
            needle=self.needle, question=self.question, **kw,
        )

