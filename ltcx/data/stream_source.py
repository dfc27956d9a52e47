"""``StreamSource``: text streamed through ``datasets`` (the hub or local files) as a ``BlockSource``.

The blocks themselves are made in the dataloader workers (``stream_blocks.py``); this side opens and checks the text,
picks each rank's and worker's part, and keeps where every part's stream stands for an exact resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ltcx.data.block_source import Gather, make_loader
from ltcx.data.sources import open_text
from ltcx.data.stream_blocks import Documents, TrainBlocks, ValBlocks
from ltcx.errors import ConfigError

__all__ = ["SAMPLE_BY", "StreamSource"]

SAMPLE_BY = ("line", "paragraph", "document")  # the choices of txt_sample_by


class StreamSource:
    """``BlockSource`` of text streamed through ``datasets``: the hub or local files, opened (lazily) and checked
    here. Its resume state is ``stream_positions[rank][part] = (pass, doc, tok)``: where the stream of every rank's
    dataloader part (``max(num_workers, 1)`` of them) continues, ``(-1, -1, -1)`` for a part not read yet."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None,
        text_column: str,
        train_split: str,
        val_split: str | None,
        tokenizer: str,
        block_size: int,
        batch_size: int,
        val_batches: int,
        num_workers: int,
        shuffle_buffer: int,
        seed: int,
        holdout_fraction: float,
        txt_sample_by: str,
    ) -> None:
        self.block_len = block_size + 1
        self.batch_size = batch_size
        self.num_workers = num_workers
        train, val, what = open_text(
            path, name=name, train_split=train_split,
            val_split=val_split if val_batches > 0 else None,
            txt_sample_by=txt_sample_by, text_column=text_column,
        )
        holdout = val is None and val_batches > 0
        if holdout and holdout_fraction <= 0.0:
            raise ConfigError(
                f"{what} has no validation split and data.holdout_fraction is 0: set --data.holdout_fraction "
                "(e.g. 0.005) or --data.val_batches 0"
            )
        common = dict(
            text_column=text_column,
            tokenizer=tokenizer,
            holdout_fraction=holdout_fraction,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
        )
        self.val_batches = val_batches
        self._train = Documents(train, holdout="train" if holdout else None, **common)
        self._val: Documents | None = None
        if val_batches > 0:
            self._val = Documents(val if val is not None else train, holdout="val" if holdout else None, **common)
        self._resume_batches = 0
        self._resume_positions: list | None = None  # [rank][part] = (pass, doc, tok) saved by the last run
        self._positions: dict[int, list[int]] = {}  # part -> (pass, doc, tok) after the last batch trained on

    def train_dataset(
        self, rank: int, world_size: int, *, infinite: bool = True, skip_batches: int | None = None
    ) -> TrainBlocks:
        starts = None
        if skip_batches is None:  # the trainer's loader: positions continue from those resumed (none: afresh)
            starts = self._resume_starts(rank, world_size)
            self._positions = {part: list(start) for part, start in enumerate(starts or []) if start[0] >= 0}
        return TrainBlocks(
            self._train,
            block_len=self.block_len,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            skip_batches=self._resume_batches if skip_batches is None else skip_batches,
            starts=starts,
            infinite=infinite,
        )

    def _resume_starts(self, rank: int, world_size: int) -> list[list[int]] | None:
        """This rank's saved stream position per dataloader part, checked against the present layout."""
        saved = self._resume_positions
        if not saved:
            return None
        parts = max(self.num_workers, 1)
        if len(saved) != world_size or len(saved[rank]) != parts:
            raise ConfigError(
                f"the checkpoint's text stream was read by {len(saved)} rank(s) x {len(saved[0])} dataloader part(s), "
                f"this run has {world_size} x {parts}: resume with the same devices x num_nodes and data.num_workers "
                "(max(num_workers, 1) parts), or train on token shards (ltcx prepare), whose position needs neither"
            )
        return saved[rank]

    def val_dataset(self, rank: int, world_size: int) -> ValBlocks:
        assert self._val is not None
        return ValBlocks(
            self._val,
            block_len=self.block_len,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            num_batches=self.val_batches,
        )

    def dataloader(self, dataset: IterableDataset) -> DataLoader:
        return make_loader(dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def on_before_batch_transfer(self, batch: Any) -> Any:
        """A training batch carries the stream position after it: keep it, hand on the blocks (a validation
        batch is the blocks alone)."""
        if isinstance(batch, dict):
            part, *position = batch["position"][-1].tolist()
            self._positions[part] = position
            return batch["idx"]
        return batch

    def state_dict(self, gather: Gather) -> dict[str, Any]:
        mine = torch.full((max(self.num_workers, 1), 3), -1, dtype=torch.long)
        for part, position in self._positions.items():
            mine[part] = torch.tensor(position)
        return {"stream_positions": gather(mine).cpu().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_batches = int(state.get("train_batches_consumed", 0))
        self._resume_positions = state.get("stream_positions")
