"""The interface ``TextDataModule`` serves its data through: a block source, picked once from ``--data.path``.

Two sources keep it, each with a training, a validation and a test split: ``StreamSource`` (text streamed through
``datasets``, ``text_stream.py``) and ``ShardSource`` (token shards made by ``ltcx prepare``, ``token_shards.py``).
The data module holds the arguments, the tokenizer and the trainer; a source holds its own data and resume state and
never asks which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from ltcx.errors import LtcxError

__all__ = ["BlockSource", "DataError", "Gather", "make_loader", "rank_and_world"]

# Gathers a tensor from every rank: ``Tensor[*shape]`` -> ``Tensor[world_size, *shape]`` (rank order).
Gather = Callable[[torch.Tensor], torch.Tensor]


class DataError(LtcxError):
    """A data problem found while iterating (possibly inside a dataloader worker).

    torch re-raises a worker's exception in the main process as ``type(exc)(traceback_text)``; this class turns
    that text back into the original one-line message so the CLI can still print one clear line.
    """

    def __init__(self, message: str) -> None:
        if message.startswith("Caught ") and "Original Traceback" in message:
            tag = f"{type(self).__name__}: "
            for line in reversed(message.strip().splitlines()):
                if tag in line:
                    message = line.split(tag, 1)[1].strip()
                    break
        super().__init__(message)


class BlockSource(Protocol):
    """Blocks of ``block_len = block_size + 1`` tokens for one data module, opened and checked on construction
    (every problem a one-line ``LtcxError``). Every loader's batches reach the model as ``LongTensor[B, block_len]``
    (``B = batch_size``), after ``on_before_batch_transfer``.
    """

    def train_dataset(
        self, rank: int, world_size: int, *, infinite: bool = True, skip_batches: int | None = None
    ) -> IterableDataset:
        """Training blocks of ``rank`` of ``world_size``, endless unless ``infinite=False`` (a single pass, where the
        source has passes). ``skip_batches`` None: the trainer's loader, continuing where the loaded state says;
        else start after that many batches of this rank."""
        ...

    def val_dataset(self, rank: int, world_size: int) -> IterableDataset:
        """Exactly ``val_batches * batch_size`` validation blocks of ``rank``, the same in every run."""
        ...

    def test_dataset(self, rank: int, world_size: int) -> IterableDataset:
        """Exactly ``test_batches * batch_size`` blocks of ``rank`` from the test split (documents training never
        reads), the same in every run; one line when the source has none."""
        ...

    def dataloader(self, dataset: IterableDataset) -> DataLoader:
        """The loader of one of this source's data sets (it knows whether they yield blocks or whole batches)."""
        ...

    def on_before_batch_transfer(self, batch: Any) -> Any:
        """A training or validation batch as the loader made it -> ``LongTensor[B, block_len]`` (a source may
        take what it needs to resume from the batch first)."""
        ...

    def state_dict(self, gather: Gather) -> dict[str, Any]:
        """What a resume needs beyond ``train_batches_consumed`` (which the data module adds): ``{}`` or the
        source's own keys, gathered from every rank with ``gather`` (called on every rank, rank 0's is saved)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The data module's whole saved entry (``train_batches_consumed`` and the source's keys, if any): the next
        ``train_dataset(skip_batches=None)`` continues after it."""
        ...


def loader_checks(batch_size: int, val_batches: int, num_workers: int, pad_vocab_to_multiple_of: int,
                  test_batches: int | None = None) -> list[tuple[bool, str, object, str]]:
    """The settings every data module has, as ``refuse_bad_settings`` checks (``ltcx.errors``)."""
    return [
        (batch_size >= 1, "batch_size", batch_size, "must be >= 1"),
        (val_batches >= 0, "val_batches", val_batches, "must be >= 0"),
        (test_batches is None or test_batches >= 0, "test_batches", test_batches, "must be >= 0 (null: val_batches)"),
        (num_workers >= 0, "num_workers", num_workers, "must be >= 0"),
        (pad_vocab_to_multiple_of >= 1, "pad_vocab_to_multiple_of", pad_vocab_to_multiple_of, "must be >= 1"),
    ]


def make_loader(dataset: IterableDataset, *, batch_size: int | None, num_workers: int) -> DataLoader:
    """A DataLoader of ``dataset``; ``batch_size`` None when the data set yields whole batches."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )


def rank_and_world(module: Any, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` of a data module's loader: those given, else its trainer's (0 of 1 without one)."""
    trainer = getattr(module, "trainer", None)
    if rank is None:
        rank = int(trainer.global_rank) if trainer is not None else 0
    if world_size is None:
        world_size = int(trainer.world_size) if trainer is not None else 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    return rank, world_size
