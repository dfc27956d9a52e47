"""Streaming language-model data: documents -> tokens -> fixed-size blocks, sharded over ranks and workers.

One code path for the Hugging Face hub and for local files: both become ``datasets`` streaming
``IterableDataset`` s. Per split and pass: (shuffle) -> split by DDP rank -> split by dataloader worker ->
tokenize -> append end-of-text -> cut blocks of ``block_size + 1`` tokens. A ``path`` prepared by ``ltcx prepare``
switches the data module to token shards (``shard_data.py``).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ltcx.data.files import local_path
from ltcx.data.packing import in_holdout, pack_blocks, pack_positions
from ltcx.data.shard_data import SAMPLING, ShardBlocks
from ltcx.data.shards import META, VERIFY_MODES, holds_shards, is_prepared, load_meta, verify_shards
from ltcx.data.sources import open_text
from ltcx.errors import ConfigError, LtcxError
from ltcx.tokenizers import Tokenizer, _short_reason, get_tokenizer
from ltcx.tokenizers import padded_vocab_size as _pad_vocab

__all__ = ["TextDataModule", "DataError"]

_SAMPLE_BY = ("line", "paragraph", "document")
# ValBlocks defines __len__ and is exact with any number of workers (each serves its own batches).
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined", category=UserWarning)
_READ_BATCH = 128  # documents read and tokenized together


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


def _file_being_read(exc: BaseException) -> str | None:
    """The file a `datasets` builder was reading when ``exc`` was raised: its json, text and parquet builders
    all loop ``for file in files``, and the error itself does not name it."""
    file, tb = None, exc.__traceback__
    while tb is not None:
        if "packaged_modules" in tb.tb_frame.f_code.co_filename and isinstance(tb.tb_frame.f_locals.get("file"), str):
            file = tb.tb_frame.f_locals["file"]
        tb = tb.tb_next
    return file


def _where(rank: int, world_size: int, worker: int, num_workers: int) -> str:
    text = f"rank {rank} of {world_size}"
    if num_workers > 1:
        text += f" (dataloader worker {worker} of {num_workers})"
    return text


class _Source:
    """Everything a dataloader worker needs to produce token lists of one split (picklable)."""

    def __init__(
        self,
        ds: Any,
        *,
        text_column: str,
        tokenizer: str,
        holdout: str | None,
        holdout_fraction: float,
        seed: int,
        shuffle_buffer: int,
    ) -> None:
        self.ds = ds  # datasets.IterableDataset of the split
        self.text_column = text_column
        self.tokenizer = tokenizer
        self.holdout = holdout  # None: all documents; "train": outside the hold-out; "val": inside it
        self.holdout_fraction = holdout_fraction
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer

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
        keep_val = self.holdout == "val"
        # .iter() reads this process's part as set up above; plain iteration inside a torch worker would let
        # `datasets` re-split by worker on its own (by shards only, leaving workers idle on single-file sets).
        try:
            for batch in ds.iter(batch_size=_READ_BATCH):
                texts = [t for t in batch[col] if isinstance(t, str) and t.strip()]
                if self.holdout is not None:
                    texts = [t for t in texts if in_holdout(t, self.holdout_fraction) == keep_val]
                if first_doc:
                    texts, first_doc = texts[first_doc:], max(0, first_doc - len(texts))
                if not texts:
                    continue
                for ids in tok.encode_batch(texts):
                    ids.append(eot)
                    yield ids
        except Exception as exc:  # noqa: BLE001 - a bad file found mid-stream: one line naming it
            file = _file_being_read(exc)
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
        source: _Source,
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
    """Exactly ``num_batches * batch_size`` validation blocks for one rank, the same for any number of workers.

    The rank's part is read in file order, cycled if it is shorter than needed; in a dataloader with W workers,
    worker w yields the blocks of batches w, w + W, ..., so the loader's round-robin restores the order.
    """

    def __init__(
        self, source: _Source, *, block_len: int, rank: int, world_size: int, batch_size: int, num_batches: int
    ) -> None:
        self.source = source
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
            raise DataError(
                f"validation data too small: {_where(self.rank, self.world_size, worker, num_workers)} got no block "
                f"of {self.block_len} tokens; use more validation data, a larger holdout_fraction, a smaller "
                "block_size or fewer devices"
            )
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


class TextDataModule(L.LightningDataModule):
    """Language-model blocks of ``block_size + 1`` tokens, from text (streamed from the Hugging Face hub or local files,
    tokenized as it is read) or from token shards made by ``ltcx prepare`` (read by memory map).

    Args:
        path: Hugging Face hub data set id; a local file, folder (recursive) or glob of .txt/.jsonl/.parquet files;
            ``sample`` (the TinyStories sample shipped with ltcx, unless ./sample exists); or a folder prepared by
            ``ltcx prepare`` (it holds meta.json): then the text options below do not apply.
        name: configuration name of the hub data set, if it has several.
        text_column: column holding the document text (.txt files have the column "text").
        train_split: hub split to train on.
        val_split: hub split to validate on; None or a missing split validates on a hold-out of the training documents.
        tokenizer: "gpt2", "bytes", or a Hugging Face tokenizer name or local folder.
        block_size: tokens of context per training sample (each sample holds block_size + 1 tokens).
        batch_size: blocks per batch on each device.
        val_batches: validation batches per validation run, the same on every device (0 disables validation).
        num_workers: dataloader worker processes per device.
        shuffle_buffer: documents in the streaming shuffle buffer (0 = read in file order).
        seed: seed of the shuffle (pass k uses seed + k).
        holdout_fraction: fraction of training documents held out for validation when there is no validation split.
        txt_sample_by: one document of a .txt file: "line", "paragraph" (blank-line separated) or "document" (file).
        pad_vocab_to_multiple_of: round the model's vocabulary size up to a multiple of this (1 = no padding).
        sampling: token shards only: "blocks" (every block once per epoch, shuffled) or "random" (random offsets).
        verify: token shards only: check them against meta.json at start, "fast" (size, header and the largest id
            meta.json records), "full" (SHA-256 and every id below the vocabulary) or "none".
    """

    def __init__(
        self,
        path: str = "roneneldan/TinyStories",
        name: str | None = None,
        text_column: str = "text",
        train_split: str = "train",
        val_split: str | None = "validation",
        tokenizer: str = "gpt2",
        block_size: int = 512,
        batch_size: int = 24,
        val_batches: int = 20,
        num_workers: int = 0,
        shuffle_buffer: int = 10_000,
        seed: int = 1234,
        holdout_fraction: float = 0.005,
        txt_sample_by: str = "paragraph",
        pad_vocab_to_multiple_of: int = 64,
        sampling: str = "blocks",
        verify: str = "fast",
    ) -> None:
        super().__init__()
        checks = [
            (block_size >= 1, "block_size", block_size, "must be >= 1"),
            (batch_size >= 1, "batch_size", batch_size, "must be >= 1"),
            (val_batches >= 0, "val_batches", val_batches, "must be >= 0"),
            (num_workers >= 0, "num_workers", num_workers, "must be >= 0"),
            (shuffle_buffer >= 0, "shuffle_buffer", shuffle_buffer, "must be >= 0 (0 = no shuffle)"),
            (0.0 <= holdout_fraction < 1.0, "holdout_fraction", holdout_fraction, "must be in [0, 1)"),
            (txt_sample_by in _SAMPLE_BY, "txt_sample_by", txt_sample_by, "must be 'line', 'paragraph' or 'document'"),
            (pad_vocab_to_multiple_of >= 1, "pad_vocab_to_multiple_of", pad_vocab_to_multiple_of, "must be >= 1"),
            (sampling in SAMPLING, "sampling", sampling, "must be 'blocks' or 'random'"),
            (verify in VERIFY_MODES, "verify", verify, "must be 'fast', 'full' or 'none'"),
            (bool(path), "path", path, "must name a hub data set or local files"),
        ]
        for ok, key, value, rule in checks:
            if not ok:
                raise ConfigError(f"data.{key}={value!r} {rule}: fix --data.{key}")
        self.save_hyperparameters()
        self.path = path
        self.name = name
        self.text_column = text_column
        self.train_split = train_split
        self.val_split = val_split
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_batches = val_batches
        self.num_workers = num_workers
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.holdout_fraction = holdout_fraction
        self.txt_sample_by = txt_sample_by
        self.pad_vocab_to_multiple_of = pad_vocab_to_multiple_of
        self.sampling = sampling
        self.verify = verify
        self._shards: tuple[str, dict] | None = None  # (folder, meta.json) in token-shard mode
        self._train_source: _Source | None = None
        self._val_source: _Source | None = None
        self._resume_batches = 0
        self._resume_positions: list | None = None  # [rank][part] = (pass, doc, tok) saved by the last run
        self._positions: dict[int, list[int]] = {}  # part -> (pass, doc, tok) after the last batch trained on

    # ------------------------------------------------------------------ tokenizer facts
    @property
    def tokenizer_obj(self) -> Tokenizer:
        """The tokenizer (loaded on first use)."""
        return get_tokenizer(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer produces."""
        return self.tokenizer_obj.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to ``pad_vocab_to_multiple_of``: the embedding size the model should use."""
        return _pad_vocab(self.vocab_size, self.pad_vocab_to_multiple_of)

    @property
    def block_len(self) -> int:
        """Tokens per sample: ``block_size + 1`` (inputs ``block[:-1]``, targets ``block[1:]``)."""
        return self.block_size + 1

    def __repr__(self) -> str:  # LightningDataModule's __str__ would build every dataloader
        return f"{type(self).__name__}(path={self.path!r}, tokenizer={self.tokenizer!r}, block_size={self.block_size})"

    __str__ = __repr__

    # ------------------------------------------------------------------ loading and checks
    def setup(self, stage: str | None = None) -> None:
        """Open the data (lazily, streaming) and check it: tokenizer, files, columns, non-empty text.

        Idempotent; every problem is a one-line ``LtcxError`` raised before training writes anything.
        """
        if self._train_source is not None or self._shards is not None:
            return
        self.tokenizer_obj  # noqa: B018 - raises "unknown tokenizer ..." early
        folder = local_path(self.path)
        if is_prepared(folder):
            self._setup_shards(folder)
            return
        if holds_shards(folder):  # a prepared folder that lost its meta.json, not one without text files
            raise LtcxError(
                f"'{self.path}' holds token shards but no {META}: it was deleted or moved, and without it the shards "
                f"cannot be checked or read; restore {META}, or prepare the data again with ltcx prepare --out "
                "<a new or empty folder> and point --data.path at that folder"
            )
        train, val, what = open_text(
            self.path, name=self.name, train_split=self.train_split,
            val_split=self.val_split if self.val_batches > 0 else None,
            txt_sample_by=self.txt_sample_by, text_column=self.text_column,
        )
        holdout = val is None and self.val_batches > 0
        if holdout and self.holdout_fraction <= 0.0:
            raise ConfigError(
                f"{what} has no validation split and data.holdout_fraction is 0: set --data.holdout_fraction "
                "(e.g. 0.005) or --data.val_batches 0"
            )
        common = dict(
            text_column=self.text_column,
            tokenizer=self.tokenizer,
            holdout_fraction=self.holdout_fraction,
            seed=self.seed,
            shuffle_buffer=self.shuffle_buffer,
        )
        self._train_source = _Source(train, holdout="train" if holdout else None, **common)
        if self.val_batches > 0:
            self._val_source = _Source(val if val is not None else train, holdout="val" if holdout else None, **common)

    def _setup_shards(self, folder: str) -> None:
        meta = load_meta(folder)
        made_with = repr(meta["tokenizer"])  # a name from a file, shown as data (a newline stays one line)
        if meta["tokenizer"] != self.tokenizer:
            raise ConfigError(
                f"the token shards in '{self.path}' were made with tokenizer {made_with}, not "
                f"'{self.tokenizer}': set --data.tokenizer to it"
            )
        if meta["vocab_size"] != self.vocab_size:  # same name, other files (a local or updated hub tokenizer)
            raise ConfigError(
                f"the token shards in '{self.path}' were made with tokenizer {made_with} of "
                f"{meta['vocab_size']} ids, which now has {self.vocab_size}: use the tokenizer they were made with, "
                "or prepare the data again into a new folder"
            )
        if self.val_batches > 0 and not meta["shards"]["validation"]:
            raise ConfigError(
                f"the token shards in '{self.path}' have no validation split (prepared with --val_fraction 0): "
                "set --data.val_batches 0 or prepare with a validation fraction"
            )
        verify_shards(folder, meta, self.verify, vocab_size=self.vocab_size)
        self._shards = folder, meta

    def _shard_blocks(self, split: str, rank: int, world_size: int, **kw: Any) -> ShardBlocks:
        assert self._shards is not None
        folder, meta = self._shards
        return ShardBlocks(
            folder, meta["shards"][split], meta["dtype"], block_len=self.block_len, rank=rank, world_size=world_size,
            batch_size=self.batch_size, seed=self.seed, sampling=self.sampling, **kw,
        )

    # ------------------------------------------------------------------ datasets and loaders
    def _rank_world(self, rank: int | None, world_size: int | None) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if rank is None:
            rank = int(trainer.global_rank) if trainer is not None else 0
        if world_size is None:
            world_size = int(trainer.world_size) if trainer is not None else 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        return rank, world_size

    def train_dataset(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        infinite: bool = True,
        skip_batches: int | None = None,
    ) -> TrainBlocks | ShardBlocks:
        """The training blocks of ``rank`` of ``world_size`` (default: the trainer's, else 0 of 1); from token shards,
        whole batches, endless.

        ``infinite=False`` gives a single pass of text (for tests); ``skip_batches`` defaults to the resumed position.
        """
        self.setup("fit")
        rank, world_size = self._rank_world(rank, world_size)
        skip = self._resume_batches if skip_batches is None else skip_batches
        if self._shards is not None:
            return self._shard_blocks("train", rank, world_size, start_batch=skip)
        assert self._train_source is not None
        starts = None
        if skip_batches is None:  # the trainer's loader: positions continue from those resumed (none: afresh)
            starts = self._resume_starts(rank, world_size)
            self._positions = {part: list(start) for part, start in enumerate(starts or []) if start[0] >= 0}
        return TrainBlocks(
            self._train_source,
            block_len=self.block_len,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            skip_batches=skip,
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

    def val_dataset(self, rank: int | None = None, world_size: int | None = None) -> ValBlocks | ShardBlocks:
        """Exactly ``val_batches * batch_size`` validation blocks of ``rank`` of ``world_size`` (from token shards, as
        ``val_batches`` batches)."""
        self.setup("validate")
        if self.val_batches == 0:
            raise ConfigError("validation is disabled (data.val_batches=0): set --data.val_batches > 0")
        rank, world_size = self._rank_world(rank, world_size)
        if self._shards is not None:
            return self._shard_blocks("validation", rank, world_size, num_batches=self.val_batches)
        assert self._val_source is not None
        return ValBlocks(
            self._val_source,
            block_len=self.block_len,
            rank=rank,
            world_size=world_size,
            batch_size=self.batch_size,
            num_batches=self.val_batches,
        )

    def _loader(self, dataset: IterableDataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=None if isinstance(dataset, ShardBlocks) else self.batch_size,  # ShardBlocks makes batches
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset())

    def val_dataloader(self) -> DataLoader | list:
        if self.val_batches == 0:
            return []
        return self._loader(self.val_dataset())

    def test_dataloader(self) -> DataLoader | list:
        """``ltcx test`` and ``ltcx predict`` read the validation stream (the data sets have no test split)."""
        return self.val_dataloader()

    predict_dataloader = test_dataloader

    # ------------------------------------------------------------------ exact resume
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training batch of text carries the stream position after it: keep it, hand on the blocks."""
        if isinstance(batch, dict):
            part, *position = batch["position"][-1].tolist()
            self._positions[part] = position
            return batch["idx"]
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Training batches this rank has consumed (``global_step * accumulate_grad_batches``) and, for text, where
        every rank's stream stands: ``stream_positions[rank][part] = (pass, doc, tok)``, gathered from all ranks
        (Lightning calls this on every rank and saves rank 0's)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {"train_batches_consumed": 0}
        state: dict[str, Any] = {
            "train_batches_consumed": int(trainer.global_step) * int(trainer.accumulate_grad_batches)
        }
        if self._shards is None and self._train_source is not None:
            mine = torch.full((max(self.num_workers, 1), 3), -1, dtype=torch.long)
            for part, position in self._positions.items():
                mine[part] = torch.tensor(position)
            if trainer.world_size > 1:
                every = trainer.strategy.all_gather(mine.to(trainer.strategy.root_device))
            else:
                every = mine[None]
            state["stream_positions"] = every.cpu().tolist()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next training dataloader continues after the batches already consumed."""
        self._resume_batches = int(state_dict.get("train_batches_consumed", 0))
        self._resume_positions = state_dict.get("stream_positions")
