"""Token shards made by ``ltcx prepare`` (a folder holding ``meta.json``; the format: ``shard_format.py``) as a
``BlockSource``: ``ShardSource`` checks the shards against ``meta.json`` and the tokenizer once, on construction;
``ShardBlocks`` reads batches of token blocks from them by memory map, with an arithmetic (O(1)) position, so the
resume state is ``train_batches_consumed`` and nothing else.

A split's shards are cut into non-overlapping blocks of ``block_len`` tokens (a shard's tail shorter than a block is
not used); block ``g`` is tokens ``[j * block_len, (j + 1) * block_len)`` of the shard it falls in.

Training, ``sampling="blocks"``: epoch ``e`` is a permutation of all ``N`` blocks seeded by ``seed + e``; rank ``r`` of
``R`` takes its entries ``r, r + R, ...`` (``N // R`` of them, so every rank's epoch has the same length and no block
is seen twice in an epoch by any rank). Sample ``p`` of a rank is entry ``p % (N // R)`` of epoch ``p // (N // R)``.
``sampling="random"``: every block starts at a uniformly random token (nanoGPT's sampling), from a generator seeded by
``(seed, rank, batch)``; ranks draw independently. Either way batch ``b`` of a rank is a function of ``b`` alone, so
dataloader worker ``w`` of ``W`` makes batches ``start + w, start + w + W, ...`` (the order the loader takes them in)
and a resume at batch ``start`` reads nothing it skips.

Validation and test: rank ``r`` takes blocks ``r, r + R, ...`` of the split in order, cycled to exactly ``num_batches``
batches. A folder prepared before ``ltcx prepare`` wrote a test split has none: ``ltcx test`` says so in one line.

Every batch's ids are checked against the tokenizer's vocabulary as it is read (a max over ``[B, block_len]``): the
start-up check (``verify="fast"``) reads only headers and the ``max_id`` meta.json records, so a shard edited in place
is caught here, in one line naming the shard and the token, before the model sees it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ltcx.data.block_source import DataError, Gather, make_loader
from ltcx.data.shard_format import (
    Shard,
    load_meta,
    more_validation,
    open_shard,
    outside_vocabulary,
    test_source,
    validation_source,
    verify_shards,
)
from ltcx.errors import ConfigError, LtcxError

__all__ = ["SAMPLING", "ShardBlocks", "ShardSource"]

SAMPLING = ("blocks", "random")


class ShardSource:
    """``BlockSource`` of the prepared folder ``folder`` (``path``: as the user typed it, for messages)."""

    def __init__(
        self,
        folder: str,
        *,
        path: str,
        tokenizer: str,
        vocab_size: int,
        block_size: int,
        batch_size: int,
        val_batches: int,
        num_workers: int,
        seed: int,
        sampling: str,
        verify: str,
        test_batches: int = 0,
    ) -> None:
        meta = load_meta(folder)
        made_with = repr(meta["tokenizer"])  # a name from a file, shown as data (a newline stays one line)
        if meta["tokenizer"] != tokenizer:
            raise ConfigError(
                f"the token shards in '{path}' were made with tokenizer {made_with}, not "
                f"'{tokenizer}': set --data.tokenizer to it"
            )
        if meta["vocab_size"] != vocab_size:  # same name, other files (a local or updated hub tokenizer)
            raise ConfigError(
                f"the token shards in '{path}' were made with tokenizer {made_with} of "
                f"{meta['vocab_size']} ids, which now has {vocab_size}: use the tokenizer they were made with, "
                "or prepare the data again into a new folder"
            )
        if val_batches > 0 and not meta["shards"]["validation"]:
            raise ConfigError(
                f"the token shards in '{path}' hold no validation documents ({validation_source(meta)}): set "
                f"--data.val_batches 0, or {more_validation(meta)}"
            )
        verify_shards(folder, meta, verify, vocab_size=vocab_size)
        self.folder, self.path, self.meta = folder, path, meta
        self.block_len, self.batch_size, self.val_batches = block_size + 1, batch_size, val_batches
        self.test_batches = test_batches
        self.num_workers, self.seed, self.sampling = num_workers, seed, sampling
        self._resume_batches = 0

    def _blocks(self, split: str, rank: int, world_size: int, **kw: Any) -> ShardBlocks:
        return ShardBlocks(
            self.folder, self.meta["shards"].get(split, []), self.meta["dtype"], vocab_size=self.meta["vocab_size"],
            tokenizer=self.meta["tokenizer"], block_len=self.block_len, rank=rank,
            world_size=world_size, batch_size=self.batch_size, seed=self.seed, sampling=self.sampling, **kw,
        )

    def train_dataset(
        self, rank: int, world_size: int, *, infinite: bool = True, skip_batches: int | None = None
    ) -> ShardBlocks:
        """Whole batches, endless whatever ``infinite`` says (an epoch is a permutation, not a pass to stop at)."""
        skip = self._resume_batches if skip_batches is None else skip_batches
        return self._blocks("train", rank, world_size, start_batch=skip)

    def val_dataset(self, rank: int, world_size: int) -> ShardBlocks:
        """``val_batches`` whole batches; one line naming the flags when a rank would have no block."""
        return self._held_out("validation", rank, world_size, self.val_batches, validation_source(self.meta),
                              f"{more_validation(self.meta)}, or lower --data.block_size")

    def test_dataset(self, rank: int, world_size: int) -> ShardBlocks:
        """``test_batches`` whole batches of the test shards; one line when the folder has none or too few."""
        if not self.meta["shards"].get("test"):
            raise ConfigError(
                f"the token shards in '{self.path}' hold no test documents ({test_source(self.meta)}): prepare the "
                "data again into a new --out with ltcx prepare, which writes a test split (the source's own, else "
                "--test_fraction of the documents by hash)"
            )
        return self._held_out("test", rank, world_size, self.test_batches, test_source(self.meta),
                              "prepare again into a new --out with a larger --test_fraction, or lower "
                              "--data.block_size")

    def _held_out(self, split: str, rank: int, world_size: int, num_batches: int, source: str,
                  remedy: str) -> ShardBlocks:
        """``num_batches`` whole batches of ``split``; one line naming the ``remedy`` when a rank would have no
        block."""
        shards = self.meta["shards"][split]
        blocks = sum(shard["tokens"] // self.block_len for shard in shards)
        if blocks <= rank:
            tokens = sum(shard["tokens"] for shard in shards)
            raise ConfigError(
                f"the {split} shards in '{self.path}' hold {tokens:,} tokens ({source}): {blocks} blocks of "
                f"{self.block_len} tokens (--data.block_size + 1), fewer than one for each of {world_size} rank(s); "
                f"{remedy}"
            )
        return self._blocks(split, rank, world_size, num_batches=num_batches)

    def dataloader(self, dataset: ShardBlocks) -> DataLoader:
        return make_loader(dataset, batch_size=None, num_workers=self.num_workers)  # ShardBlocks makes batches

    def on_before_batch_transfer(self, batch: Any) -> Any:
        return batch

    def state_dict(self, gather: Gather) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_batches = int(state.get("train_batches_consumed", 0))


class ShardBlocks(IterableDataset):
    """Batches ``LongTensor[batch_size, block_len]`` of one rank from one split's shards (use ``batch_size=None`` in
    the DataLoader). ``num_batches`` None: endless training batches from batch ``start_batch`` on; else exactly that
    many validation (or test) batches. ``vocab_size``: every id read must be below it (``tokenizer`` names it in the
    error)."""

    def __init__(
        self,
        folder: str,
        shards: list[Shard],
        dtype: str,
        *,
        vocab_size: int,
        tokenizer: str,
        block_len: int,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int = 0,
        sampling: str = "blocks",
        start_batch: int = 0,
        num_batches: int | None = None,
    ) -> None:
        self.folder, self.shards, self.dtype = folder, shards, np.dtype(dtype)
        self.vocab_size, self.tokenizer = vocab_size, tokenizer
        self.block_len, self.rank, self.world_size, self.batch_size = block_len, rank, world_size, batch_size
        self.seed, self.sampling, self.start_batch, self.num_batches = seed, sampling, start_batch, num_batches
        tokens = np.array([s["tokens"] for s in shards], dtype=np.int64)
        per_shard = tokens // block_len
        self._block_start = np.concatenate([[0], np.cumsum(per_shard)])  # first block of each shard
        self.num_blocks = int(self._block_start[-1])
        self._windows = np.maximum(tokens - block_len + 1, 0)  # start tokens of a random block, per shard
        self._maps: list[np.memmap] | None = None
        self._epoch: tuple[int, np.ndarray] | None = None  # (epoch, this rank's blocks in it)
        if sampling not in SAMPLING:
            raise LtcxError(f"data.sampling={sampling!r} must be 'blocks' or 'random': fix --data.sampling")
        if (self._windows.sum() if sampling == "random" and num_batches is None else self.blocks_per_rank) == 0:
            what = "validation or test" if num_batches is not None else "training"
            raise LtcxError(
                f"{what} shards in '{folder}' too small: {self.num_blocks} blocks of {block_len} tokens for "
                f"{world_size} rank(s); use a smaller block_size, fewer devices or more data"
            )

    @property
    def blocks_per_rank(self) -> int:
        """Blocks of one rank: per training epoch (``N // R``), or before validation cycles."""
        if self.num_batches is not None:
            return len(range(self.rank, self.num_blocks, self.world_size))
        return self.num_blocks // self.world_size

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the training batches are endless")
        return self.num_batches

    def __getstate__(self) -> dict[str, Any]:  # memory maps are opened anew in each worker process
        return {**self.__dict__, "_maps": None, "_epoch": None}

    def _tokens(self, blocks: np.ndarray) -> np.ndarray:
        """``[len(blocks), block_len]`` tokens of global block ids ``blocks``."""
        shard = np.searchsorted(self._block_start, blocks, side="right") - 1
        starts = (blocks - self._block_start[shard]) * self.block_len
        return self._read(shard, starts)

    def _read(self, shard: np.ndarray, starts: np.ndarray) -> np.ndarray:
        if self._maps is None:
            self._maps = [open_shard(self.folder, s, self.dtype) for s in self.shards]
        tokens = np.stack([self._maps[k][s : s + self.block_len] for k, s in zip(shard.tolist(), starts.tolist())])
        if tokens.max() >= self.vocab_size:  # DataError: one line also from a dataloader worker process
            row, col = (int(i) for i in np.argwhere(tokens >= self.vocab_size)[0])
            path = os.path.join(self.folder, self.shards[shard[row]]["file"])
            raise DataError(outside_vocabulary(path, int(tokens[row, col]), self.tokenizer, self.vocab_size,
                                               offset=int(starts[row]) + col))
        return tokens

    def epoch_blocks(self, epoch: int) -> np.ndarray:
        """This rank's block ids of training epoch ``epoch``, in order: ``[N // R]``."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = np.random.default_rng(self.seed + epoch).permutation(self.num_blocks)
            self._epoch = epoch, order[self.rank :: self.world_size][: self.blocks_per_rank].copy()
        return self._epoch[1]

    def batch(self, b: int) -> torch.Tensor:
        """Batch ``b`` of this rank: ``LongTensor[batch_size, block_len]``."""
        positions = np.arange(b * self.batch_size, (b + 1) * self.batch_size, dtype=np.int64)
        per_rank = self.blocks_per_rank
        if self.num_batches is not None:  # validation: this rank's blocks in order, cycled
            tokens = self._tokens(self.rank + (positions % per_rank) * self.world_size)
        elif self.sampling == "blocks":
            epochs, index = np.divmod(positions, per_rank)
            blocks = np.concatenate([self.epoch_blocks(int(e))[index[epochs == e]] for e in np.unique(epochs)])
            tokens = self._tokens(blocks)
        else:
            rng = np.random.default_rng([self.seed, self.rank, b])
            cum = np.cumsum(self._windows)
            u = rng.integers(cum[-1], size=self.batch_size)
            shard = np.searchsorted(cum, u, side="right")
            tokens = self._read(shard, u - (cum[shard] - self._windows[shard]))
        return torch.from_numpy(tokens.astype(np.int64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.start_batch if self.num_batches is None else 0
        batches = itertools.count(start + worker, workers)
        if self.num_batches is not None:
            batches = iter(range(worker, self.num_batches, workers))
        for b in batches:
            yield self.batch(b)
