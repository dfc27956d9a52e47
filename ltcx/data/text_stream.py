"""Streamed text (the Hugging Face hub or local files) as a ``BlockSource``: documents -> tokens -> fixed-size
blocks, split over ranks and dataloader workers, with an exact resume.

One code path for the hub and for local files: both become ``datasets`` streaming ``IterableDataset`` s
(``text_datasets.open_text``). ``StreamSource``, in the main process, opens and checks the text, picks each rank's and
worker's part, and keeps where every part's stream stands. The dataloader-worker side (``Documents``, ``TrainBlocks``,
``ValBlocks``, which serves the test split too), per split and pass: (shuffle) -> split by DDP rank -> split by
dataloader worker -> tokenize -> append end-of-text -> cut blocks of ``block_size + 1`` tokens. Training blocks carry
the stream position after them (``StreamSource`` keeps them for the checkpoint); a resume reads the documents before it
without tokenizing them.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ltcx.data.block_source import DataError, Gather, make_loader
from ltcx.data.packing import in_holdout, in_test_holdout, pack_blocks, pack_positions
from ltcx.data.text_datasets import file_being_read, open_text
from ltcx.errors import ConfigError
from ltcx.tokenizers import _short_reason, get_tokenizer

__all__ = ["SAMPLE_BY", "Documents", "StreamSource", "TrainBlocks", "ValBlocks"]

SAMPLE_BY = ("line", "paragraph", "document")  # the choices of txt_sample_by

# ValBlocks defines __len__ and is exact with any number of workers (each serves its own batches).
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined", category=UserWarning)
_READ_BATCH = 128  # documents read and tokenized together


class StreamSource:
    """``BlockSource`` of text streamed through ``datasets``: the hub or local files, opened (lazily) and checked
    here. Its resume state is ``stream_positions[rank][part] = (pass, doc, tok)``: where the stream of every rank's
    dataloader part (``max(num_workers, 1)`` of them) continues, ``(-1, -1, -1)`` for a part not read yet; and
    ``test_holdout``, the fraction of documents the training stream leaves out for the test split by hash (0 when
    the source has its own test split), which a resume keeps so that the stream continues exactly.

    The test split is the source's own (``test_split``: a hub split; local files named test beside validation-named
    ones), else the documents whose hash is in the top ``test_fraction`` (``in_test_holdout``), left out of training.
    """

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
        test_split: str | None = None,
        test_batches: int = 0,
        test_fraction: float = 0.0,
    ) -> None:
        self.block_len = block_size + 1
        self.batch_size = batch_size
        self.num_workers = num_workers
        train, val, test, what = open_text(
            path, name=name, train_split=train_split,
            val_split=val_split if val_batches > 0 else None, test_split=test_split,
            txt_sample_by=txt_sample_by, text_column=text_column,
        )
        holdout = val is None and val_batches > 0
        if holdout and holdout_fraction <= 0.0:
            raise ConfigError(
                f"{what} has no validation split and data.holdout_fraction is 0: set --data.holdout_fraction "
                "(e.g. 0.005) or --data.val_batches 0"
            )
        common = dict(text_column=text_column, tokenizer=tokenizer, seed=seed, shuffle_buffer=shuffle_buffer)
        val_holdout = holdout_fraction if holdout else 0.0
        test_holdout = test_fraction if test is None else 0.0  # held out of training whatever test_batches says
        self.what, self.val_batches, self.test_batches = what, val_batches, test_batches
        self._train = Documents(train, split="train", holdout_fraction=val_holdout, test_fraction=test_holdout,
                                **common)
        self._val: Documents | None = None
        if val_batches > 0:
            self._val = Documents(val if val is not None else train, split="val", holdout_fraction=val_holdout,
                                  **common)
        self._test: Documents | None = None
        if test is not None or test_holdout > 0:
            self._test = Documents(test if test is not None else train, split="test", test_fraction=test_holdout,
                                   **common)
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

    def test_dataset(self, rank: int, world_size: int) -> ValBlocks:
        """``test_batches`` batches of the test split, read as validation is (fixed, the same every run)."""
        if self._test is None:
            raise ConfigError(
                f"{self.what} has no test split and data.test_fraction is 0: set --data.test_fraction (e.g. 0.005) "
                "and train again, so that training leaves the test documents out"
            )
        return ValBlocks(
            self._test,
            block_len=self.block_len,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            num_batches=self.test_batches,
            split="test",
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
        return {"stream_positions": gather(mine).cpu().tolist(), "test_holdout": self._train.test_fraction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_batches = int(state.get("train_batches_consumed", 0))
        self._resume_positions = state.get("stream_positions")
        if "train_batches_consumed" not in state:  # a fresh run
            return
        # A checkpoint's training stream left out its own test hold-out (none before it was recorded): keep it.
        resumed, configured = float(state.get("test_holdout", 0.0)), self._train.test_fraction
        if resumed != configured:
            self._train.test_fraction = resumed
            doubt = "; the test split may hold documents it trained on" if resumed < configured else ""
            _notice(f"the checkpoint's training stream held out {resumed} of the documents for the test split by "
                    f"hash (data.test_fraction {configured} here): training continues that stream{doubt}")


def _notice(text: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        print(f"ltcx: {text}", file=sys.stderr)


# The dataloader-worker side: what each worker reads, tokenizes and packs.


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    if info is None:
        return 0, 1
    # datasets does this before streaming in a forked worker (fsspec locks copied mid-use can hang).
    try:
        import fsspec.asyn

        fsspec.asyn.reset_lock()
    except Exception:  # noqa: BLE001 - best effort
        pass
    return info.id, info.num_workers


def _where(rank: int, world_size: int, worker: int, num_workers: int) -> str:
    text = f"rank {rank} of {world_size}"
    if num_workers > 1:
        text += f" (dataloader worker {worker} of {num_workers})"
    return text


class Documents:
    """Everything a dataloader worker needs to produce token lists of one split (picklable)."""

    def __init__(
        self,
        ds: Any,
        *,
        text_column: str,
        tokenizer: str,
        split: str,
        seed: int,
        shuffle_buffer: int,
        holdout_fraction: float = 0.0,
        test_fraction: float = 0.0,
    ) -> None:
        self.ds = ds  # datasets.IterableDataset of the split
        self.text_column = text_column
        self.tokenizer = tokenizer
        # The hash hold-outs taken out of ``ds`` (0: none): "train" keeps the documents outside both, "val" those
        # in the validation one, "test" those in the test one (a split of its own: every document).
        self.split = split
        self.holdout_fraction = holdout_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer

    def _held(self, texts: list[str]) -> list[str]:
        """The documents of ``texts`` this split keeps (``split``, the hold-out fractions)."""
        val, test = self.holdout_fraction, self.test_fraction
        if self.split == "train":
            if not (val or test):
                return texts
            return [t for t in texts if not in_holdout(t, val) and not in_test_holdout(t, test)]
        if self.split == "val" and val > 0:
            return [t for t in texts if in_holdout(t, val)]
        if self.split == "test" and test > 0:
            return [t for t in texts if in_test_holdout(t, test)]
        return texts

    def token_lists(
        self, *, epoch: int | None, parts: list[tuple[int, int]], first_doc: int = 0
    ) -> Iterator[list[int]]:
        """Token ids (end-of-text appended) of each document of one pass, from document ``first_doc`` on (the
        documents before it are read but not tokenized).

        ``epoch`` None reads in file order; otherwise the stream is shuffled with ``seed + epoch``. ``parts`` are
        successive ``(index, count)`` splits (rank of world size, then worker of workers) via
        ``split_dataset_by_node``, so the parts of one level are disjoint and together cover everything.
        """
        from datasets.distributed import split_dataset_by_node

        ds = self.ds
        if epoch is not None and self.shuffle_buffer > 0:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        for index, count in parts:
            if count > 1:
                ds = split_dataset_by_node(ds, rank=index, world_size=count)
        tok = get_tokenizer(self.tokenizer)
        eot = tok.eot_id
        col = self.text_column
        # .iter() reads this process's part as set up above; plain iteration inside a torch worker would let
        # `datasets` re-split by worker on its own (by shards only, leaving workers idle on single-file sets).
        try:
            for batch in ds.iter(batch_size=_READ_BATCH):
                texts = [t for t in batch[col] if isinstance(t, str) and t.strip()]
                texts = self._held(texts)
                if first_doc:
                    texts, first_doc = texts[first_doc:], max(0, first_doc - len(texts))
                if not texts:
                    continue
                for ids in tok.encode_batch(texts):
                    ids.append(eot)
                    yield ids
        except Exception as exc:  # noqa: BLE001 - a bad file found mid-stream: one line naming it
            file = file_being_read(exc)
            what = f"data file '{file}'" if file else "the data"
            raise DataError(f"cannot read {what} ({_short_reason(exc)}): fix or remove it") from None


class TrainBlocks(IterableDataset):
    """Training blocks of one rank, endless by default: ``{"idx": LongTensor[block_size + 1], "position":
    LongTensor[4]}``, the position being ``(part, pass, doc, tok)`` right after the block (``pack_positions``).

    Each pass reshuffles with ``seed + pass``; inside a dataloader each worker reads its own part of the rank's part.
    A resume continues after ``skip_batches`` batches of the rank (as a DataLoader with ``batch_size`` assembles them,
    batch ``i`` from worker ``i % num_workers``): from ``starts[part]``, the position the saving run reached in each
    part, reading the documents before it without tokenizing them; without ``starts`` (a checkpoint from before
    positions were saved) by re-tokenizing and dropping the blocks already served.
    """

    def __init__(
        self,
        source: Documents,
        *,
        block_len: int,
        rank: int,
        world_size: int,
        batch_size: int,
        skip_batches: int = 0,
        starts: list[list[int]] | None = None,
        infinite: bool = True,
    ) -> None:
        self.source = source
        self.block_len = block_len
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.skip_batches = skip_batches
        self.starts = starts  # per part: (pass, doc, tok), or (-1, -1, -1) for a part not read yet
        self.infinite = infinite

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker, num_workers = _worker()
        # The DataLoader takes batch i from worker i % num_workers, starting again at worker 0 after a resume:
        # after `skip_batches` batches, worker w continues the stream of the worker that would have served
        # batch skip_batches + w.
        part = (worker + self.skip_batches) % num_workers
        parts = [(self.rank, self.world_size), (part, num_workers)]
        first_epoch, doc, tok = max(self.starts[part], [0, 0, 0]) if self.starts else (0, 0, 0)
        skip = 0 if self.starts else len(range(part, self.skip_batches, num_workers)) * self.batch_size
        for epoch in itertools.count(first_epoch):
            produced, whole_pass = 0, doc == tok == 0
            stream = self.source.token_lists(epoch=epoch, parts=parts, first_doc=doc)
            # doc, tok: the start position for this epoch, then the position of each block yielded
            for block, doc, tok in pack_positions(stream, self.block_len, first_doc=doc, offset=tok):  # noqa: B020
                produced += 1
                if skip:
                    skip -= 1
                    continue
                yield {"idx": torch.tensor(block, dtype=torch.long), "position": torch.tensor([part, epoch, doc, tok])}
            if not self.infinite:
                return
            if produced == 0 and whole_pass:
                raise DataError(
                    f"data set too small: {_where(self.rank, self.world_size, part, num_workers)} got no block of "
                    f"{self.block_len} tokens; use more data, a smaller block_size or fewer devices/workers"
                )
            doc = tok = 0


class ValBlocks(IterableDataset):
    """Exactly ``num_batches * batch_size`` validation (or test) blocks for one rank, the same for any number of
    workers.

    The rank's part is read in file order, cycled if it is shorter than needed; in a dataloader with W workers,
    worker w yields the blocks of batches w, w + W, ..., so the loader's round-robin restores the order.
    """

    def __init__(
        self, source: Documents, *, block_len: int, rank: int, world_size: int, batch_size: int, num_batches: int,
        split: str = "validation",
    ) -> None:
        self.source = source
        self.split = split  # "validation" or "test", for messages
        self.block_len = block_len
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.num_batches = num_batches
        self._blocks: list[torch.Tensor] | None = None  # the full sequence, once computed in this process

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def _sequence(self, worker: int, num_workers: int) -> Iterator[torch.Tensor]:
        if self._blocks is not None:
            yield from self._blocks
            return
        total = len(self)
        blocks: list[torch.Tensor] = []
        stream = self.source.token_lists(epoch=None, parts=[(self.rank, self.world_size)])
        for block in pack_blocks(stream, self.block_len):
            blocks.append(torch.tensor(block, dtype=torch.long))
            yield blocks[-1]
            if len(blocks) == total:
                break
        if not blocks:
            fraction = "holdout_fraction" if self.split == "validation" else "test_fraction"
            raise DataError(
                f"{self.split} data too small: {_where(self.rank, self.world_size, worker, num_workers)} got no block "
                f"of {self.block_len} tokens; use more {self.split} data, a larger {fraction}, a smaller "
                "block_size or fewer devices"
            )
        if len(blocks) < total:  # never repeated unsaid: a mean over repeats is a mean over fewer blocks
            fraction = "holdout_fraction" if self.split == "validation" else "test_fraction"
            batches = "val_batches" if self.split == "validation" else "test_batches"
            print(f"ltcx: the {self.split} split holds {len(blocks)} distinct blocks of {self.block_len} tokens, fewer "
                  f"than the {total} its batches read, so they repeat: give more {self.split} data, a larger "
                  f"data.{fraction} or fewer data.{batches}", file=sys.stderr)
        full = list(itertools.islice(itertools.cycle(blocks), total))
        yield from full[len(blocks) :]
        self._blocks = full

    def __iter__(self) -> Iterator[torch.Tensor]:
        worker, num_workers = _worker()
        total = len(self)
        for j, block in enumerate(self._sequence(worker, num_workers)):
            if j >= total:
                return
            if (j // self.batch_size) % num_workers == worker:
                yield block
