"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology", arXiv 2312.04927), generated on the fly.

A sequence of ``block_size`` tokens holds ``P = num_kv_pairs`` key-value pairs, then a query of every key::

    position   0   1   2   3  ..  2P-2 2P-1 | 2P .. block_size-1
    input      k0  v0  k1  v1 ..  kP-1 vP-1 | filler, with key k_i at position 2P + 2 g_i
    target     -100 everywhere except v_i at position 2P + 2 g_i (the model reads k_i and must answer v_i)

Keys are distinct, drawn from ``[1, V/2)``; values distinct, from ``[V/2, V)`` (``V = vocab_size``); token 0 is never
a key, so it can be the filler when ``random_fillers`` is off. The gaps ``g_i`` are distinct slots of the
``S = (block_size - 2P) // 2`` even offsets after the pairs, drawn one after another without replacement with
``P(g) ~ (g + 1) ** (power_a - 1)``: Zoology's power law (``power_a = 0.01`` puts most queries soon after the pairs;
``1.0`` is uniform). Every other position holds a random token of the whole vocabulary (``random_fillers``, Zoology's
``random_non_queries``) or 0. This is the layout of Zoology's ``multiquery_ar``; the draws are vectorised (sampling
without replacement as Gumbel top-k, which gives the same distribution as drawing one after another).

Batch ``g`` of a split is a function of ``(seed, split, g)`` alone (a NumPy generator seeded by that triple), so:
rank ``r`` of ``R`` takes global batches ``r, r + R, ...`` (ranks never share a batch, and the union over ranks is
the single-device stream), a resume at batch ``b`` computes batch ``b`` directly, dataloader workers take every
W-th batch, and the training, validation and test streams come from different seeds (``split`` 0, 1, 2 in the
triple), so ``ltcx test`` reads batches no run trained or chose on. Batches are pairs
``(inputs LongTensor[B, T], targets LongTensor[B, T])``, ``T = block_size``, targets ``IGNORE_INDEX`` where nothing
is asked; ``LanguageModel`` scores them and logs ``val/recall_acc``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ltcx.batches import IGNORE_INDEX
from ltcx.data.block_source import loader_checks, make_loader, rank_and_world
from ltcx.errors import ConfigError, refuse_bad_settings
from ltcx.tokenizers import padded_vocab_size as _pad_vocab

__all__ = ["RecallBatches", "RecallDataModule", "check_mqar", "mqar_batch", "query_gap_probabilities"]

TRAIN, VALIDATION, TEST = 0, 1, 2  # the split's entry in a batch's seed: the streams never share a seed
SPLITS = {"train": TRAIN, "val": VALIDATION, "validation": VALIDATION, "test": TEST}


def check_mqar(vocab_size: int, block_size: int, num_kv_pairs: int, power_a: float) -> None:
    """One ``ConfigError`` line for a task that cannot be laid out (pairs that do not fit, too few token ids)."""
    if num_kv_pairs < 1:
        raise ConfigError(f"data.num_kv_pairs={num_kv_pairs} must be >= 1: fix --data.num_kv_pairs")
    if block_size < 4 * num_kv_pairs:
        raise ConfigError(
            f"data.num_kv_pairs={num_kv_pairs} does not fit data.block_size={block_size}: the pairs and a query slot "
            f"for each need block_size >= 4 * num_kv_pairs = {4 * num_kv_pairs}; raise --data.block_size or lower "
            "--data.num_kv_pairs"
        )
    if vocab_size < 2 * num_kv_pairs + 2:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is too small for data.num_kv_pairs={num_kv_pairs}: distinct keys from "
            f"[1, vocab_size/2) and values from [vocab_size/2, vocab_size) need vocab_size >= 2 * num_kv_pairs + 2 "
            f"= {2 * num_kv_pairs + 2}; raise --data.vocab_size or lower --data.num_kv_pairs"
        )
    if not 0 < power_a < math.inf:
        raise ConfigError(f"data.power_a={power_a} must be a positive number (1.0: uniform gaps): fix --data.power_a")


def query_gap_probabilities(block_size: int, num_kv_pairs: int, power_a: float) -> np.ndarray:
    """``[S]`` probabilities of a query's gap ``g`` (its slot ``2P + 2g``) for the first draw: ``(g+1)^(a-1)``
    normalised, ``S = (block_size - 2P) // 2``."""
    space = (block_size - 2 * num_kv_pairs) // 2
    weights = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    return weights / weights.sum()


def _first_k_in_random_order(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` column indices of the ``k`` largest ``scores [B, N]`` of each row, largest first (argpartition,
    then a sort of those ``k`` alone)."""
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def mqar_batch(
    rng: np.random.Generator,
    batch_size: int,
    block_size: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float = 0.01,
    random_fillers: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch from ``rng``: ``(inputs LongTensor[B, T], targets LongTensor[B, T])`` laid out as the module
    docstring says (``T = block_size``, ``B = batch_size``)."""
    check_mqar(vocab_size, block_size, num_kv_pairs, power_a)
    B, T, P, half = batch_size, block_size, num_kv_pairs, vocab_size // 2
    # Distinct keys and values: the P smallest of uniform draws over each id range, in random order.
    keys = 1 + _first_k_in_random_order(rng.random((B, half - 1)), P)
    values = half + _first_k_in_random_order(rng.random((B, vocab_size - half)), P)
    # The gaps without replacement, successively by the power law: Gumbel top-k of log-probabilities.
    log_p = np.log(query_gap_probabilities(T, P, power_a))
    gaps = _first_k_in_random_order(log_p - np.log(-np.log(rng.random((B, log_p.size)))), P)
    if random_fillers:
        inputs = rng.integers(0, vocab_size, size=(B, T), dtype=np.int64)
    else:
        inputs = np.zeros((B, T), dtype=np.int64)
    inputs[:, 0 : 2 * P : 2] = keys
    inputs[:, 1 : 2 * P : 2] = values
    query_at = 2 * P + 2 * gaps  # [B, P]: where key i is asked
    np.put_along_axis(inputs, query_at, keys, axis=1)
    targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    np.put_along_axis(targets, query_at, values, axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


class RecallBatches(IterableDataset):
    """MQAR batches of one rank of one split (use ``batch_size=None`` in the DataLoader). ``num_batches`` None:
    endless training batches from this rank's batch ``start_batch`` on; else exactly that many."""

    def __init__(
        self,
        *,
        split: int | str,
        rank: int,
        world_size: int,
        batch_size: int,
        block_size: int,
        num_kv_pairs: int,
        vocab_size: int,
        power_a: float,
        random_fillers: bool,
        seed: int,
        start_batch: int = 0,
        num_batches: int | None = None,
    ) -> None:
        check_mqar(vocab_size, block_size, num_kv_pairs, power_a)
        split = SPLITS[split] if isinstance(split, str) else split  # "train", "val" or "test"; or 0, 1, 2
        self.split, self.rank, self.world_size, self.seed = split, rank, world_size, seed
        self.start_batch, self.num_batches = start_batch, num_batches
        self.task = dict(batch_size=batch_size, block_size=block_size, num_kv_pairs=num_kv_pairs,
                         vocab_size=vocab_size, power_a=power_a, random_fillers=random_fillers)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the training batches are endless")
        return self.num_batches

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``b`` of this rank: global batch ``b * world_size + rank`` of the split."""
        rng = np.random.default_rng([self.seed, self.split, b * self.world_size + self.rank])
        return mqar_batch(rng, **self.task)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.num_batches is None:
            batches: Iterator[int] = itertools.count(self.start_batch + worker, workers)
        else:
            batches = iter(range(worker, self.num_batches, workers))
        for b in batches:
            yield self.batch(b)


class RecallDataModule(L.LightningDataModule):
    """Multi-query associative recall (MQAR, Zoology's ``multiquery_ar``) made on the fly: use it as ``--data`` with
    ``configs/data/mqar.yaml`` (``class_path: ltcx.data.RecallDataModule``). No tokenizer: the model's vocabulary is
    ``vocab_size`` (padded), and ``SampleGeneration`` skips its text samples.

    Args:
        vocab_size: token ids of the task (keys from the lower half, values from the upper half; Zoology: 8192).
        block_size: tokens per sequence (the model's input length).
        num_kv_pairs: key-value pairs per sequence, each queried once; needs block_size >= 4 * num_kv_pairs.
        power_a: exponent of the power law placing the queries (0.01: most soon after the pairs; 1.0: uniform).
        random_fillers: positions that are neither a pair nor a query hold random ids (else 0; Zoology's
            ``random_non_queries``).
        batch_size: sequences per batch on each device.
        val_batches: validation batches per validation run on each device (0 disables validation).
        test_batches: test batches of ``ltcx test`` on each device, from a seed stream of their own; None:
            ``val_batches``.
        num_workers: dataloader worker processes per device.
        seed: seed of the task; the training, validation and test streams are drawn from different seeds made from it.
        pad_vocab_to_multiple_of: round the model's vocabulary up to a multiple of this (1 = no padding).
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        block_size: int = 64,
        num_kv_pairs: int = 4,
        power_a: float = 0.01,
        random_fillers: bool = True,
        batch_size: int = 64,
        val_batches: int = 16,
        num_workers: int = 0,
        seed: int = 1234,
        pad_vocab_to_multiple_of: int = 64,
        test_batches: int | None = None,
    ) -> None:
        super().__init__()
        checks = loader_checks(batch_size, val_batches, num_workers, pad_vocab_to_multiple_of, test_batches)
        refuse_bad_settings("data", [*checks, (seed >= 0, "seed", seed, "must be >= 0")])
        check_mqar(vocab_size, block_size, num_kv_pairs, power_a)
        self.save_hyperparameters()
        self.vocab_size, self.block_size, self.num_kv_pairs = vocab_size, block_size, num_kv_pairs
        self.power_a, self.random_fillers = power_a, random_fillers
        self.batch_size, self.val_batches, self.num_workers = batch_size, val_batches, num_workers
        self.test_batches = val_batches if test_batches is None else test_batches
        self.seed, self.pad_vocab_to_multiple_of = seed, pad_vocab_to_multiple_of
        self.tokenizer = None  # what a checkpoint records as its tokenizer: these ids are no text
        self._resume_batches = 0

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to ``pad_vocab_to_multiple_of``: the embedding size the model should use."""
        return _pad_vocab(self.vocab_size, self.pad_vocab_to_multiple_of)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, block_size={self.block_size}, "
                f"num_kv_pairs={self.num_kv_pairs}, power_a={self.power_a})")

    __str__ = __repr__

    def _batches(self, split: int, rank: int | None, world_size: int | None, **kw: Any) -> RecallBatches:
        rank, world_size = rank_and_world(self, rank, world_size)
        return RecallBatches(
            split=split, rank=rank, world_size=world_size, batch_size=self.batch_size, block_size=self.block_size,
            num_kv_pairs=self.num_kv_pairs, vocab_size=self.vocab_size, power_a=self.power_a,
            random_fillers=self.random_fillers, seed=self.seed, **kw,
        )

    def train_dataset(
        self, rank: int | None = None, world_size: int | None = None, *, skip_batches: int | None = None
    ) -> RecallBatches:
        """Endless training batches of ``rank`` of ``world_size`` (default: the trainer's, else 0 of 1), from batch
        ``skip_batches`` (default: the resumed position)."""
        start = self._resume_batches if skip_batches is None else skip_batches
        return self._batches(TRAIN, rank, world_size, start_batch=start)

    def val_dataset(self, rank: int | None = None, world_size: int | None = None) -> RecallBatches:
        """``val_batches`` validation batches of ``rank``, the same in every run."""
        if self.val_batches == 0:
            raise ConfigError("validation is disabled (data.val_batches=0): set --data.val_batches > 0")
        return self._batches(VALIDATION, rank, world_size, num_batches=self.val_batches)

    def test_dataset(self, rank: int | None = None, world_size: int | None = None) -> RecallBatches:
        """``test_batches`` test batches of ``rank``, from the test seed stream, the same in every run."""
        if self.test_batches == 0:
            raise ConfigError("the test split is disabled (data.test_batches=0): set --data.test_batches > 0")
        return self._batches(TEST, rank, world_size, num_batches=self.test_batches)

    def setup(self, stage: str | None = None) -> None:
        if stage == "test":
            self.test_dataset()  # a disabled test split is one line before the test run writes anything

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.train_dataset(), batch_size=None, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_batches == 0:
            return []
        return make_loader(self.val_dataset(), batch_size=None, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """``ltcx test`` reads the test batches (``test_dataset``)."""
        return make_loader(self.test_dataset(), batch_size=None, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader | list:
        """``ltcx predict`` scores the validation batches."""
        return self.val_dataloader()

    # ------------------------------------------------------------------ exact resume
    def state_dict(self) -> dict[str, Any]:
        """Training batches this rank has consumed (``global_step * accumulate_grad_batches``): batch ``b`` is a
        function of ``b``, so that is the whole resume state."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {"train_batches_consumed": 0}
        return {"train_batches_consumed": int(trainer.global_step) * int(trainer.accumulate_grad_batches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next training dataloader starts after the batches already consumed."""
        self._resume_batches = int(state_dict.get("train_batches_consumed", 0))
