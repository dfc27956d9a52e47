"""``ShardSource``: token shards made by ``ltcx prepare`` (a folder holding ``meta.json``) as a ``BlockSource``.

The shards are checked against ``meta.json`` and the tokenizer once, on construction; batches are read by memory
map (``ShardBlocks`` in ``shard_data.py``). Batch ``b`` of a rank is a function of ``b`` alone, so the resume state
is ``train_batches_consumed`` and nothing else.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from ltcx.data.block_source import Gather, make_loader
from ltcx.data.shard_data import ShardBlocks
from ltcx.data.shards import load_meta, more_validation, validation_source, verify_shards
from ltcx.errors import ConfigError

__all__ = ["ShardSource"]


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
        self.num_workers, self.seed, self.sampling = num_workers, seed, sampling
        self._resume_batches = 0

    def _blocks(self, split: str, rank: int, world_size: int, **kw: Any) -> ShardBlocks:
        return ShardBlocks(
            self.folder, self.meta["shards"][split], self.meta["dtype"], vocab_size=self.meta["vocab_size"],
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
        shards = self.meta["shards"]["validation"]
        blocks = sum(shard["tokens"] // self.block_len for shard in shards)
        if blocks <= rank:
            tokens = sum(shard["tokens"] for shard in shards)
            raise ConfigError(
                f"the validation shards in '{self.path}' hold {tokens:,} tokens ({validation_source(self.meta)}): "
                f"{blocks} blocks of {self.block_len} tokens (--data.block_size + 1), fewer than one for each of "
                f"{world_size} rank(s); {more_validation(self.meta)}, or lower --data.block_size"
            )
        return self._blocks("validation", rank, world_size, num_batches=self.val_batches)

    def dataloader(self, dataset: ShardBlocks) -> DataLoader:
        return make_loader(dataset, batch_size=None, num_workers=self.num_workers)  # ShardBlocks makes batches

    def on_before_batch_transfer(self, batch: Any) -> Any:
        return batch

    def state_dict(self, gather: Gather) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_batches = int(state.get("train_batches_consumed", 0))
