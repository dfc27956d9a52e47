"""``TextDataModule``: the arguments, the tokenizer, and the block source ``--data.path`` picks.

Text (the hub, local files, ``sample``) is streamed through ``datasets`` by ``StreamSource``; a folder prepared by
``ltcx prepare`` is read by memory map by ``ShardSource``. The data module checks its arguments, chooses the source
in ``setup`` and hands it the rank, the loaders, the batches and the resume state (``block_source.py``: the interface).
Its checkpoint entry, under the key ``TextDataModule``: ``train_batches_consumed`` and the source's own keys
(``stream_positions[rank][part]`` and ``test_holdout`` for text, none for shards). It also hands the model the bytes
each token id decodes to (``token_bytes``), for bits per byte.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from ltcx.data.block_source import BlockSource, loader_checks, rank_and_world
from ltcx.data.files import local_path
from ltcx.data.shard_format import META, VERIFY_MODES, holds_shards, is_prepared
from ltcx.data.text_stream import SAMPLE_BY, StreamSource
from ltcx.data.token_shards import SAMPLING, ShardSource
from ltcx.errors import ConfigError, LtcxError, refuse_bad_settings
from ltcx.tokenizers import Tokenizer, get_tokenizer
from ltcx.tokenizers import padded_vocab_size as _pad_vocab

__all__ = ["TextDataModule"]


BYTES_PER_TOKEN_ID = 16  # a token's input and target ids (int64)


def check_batch_fits(block_size: int, batch_size: int, width: int = 0) -> None:
    """One ``ConfigError`` line naming ``--data.block_size`` (and the largest that fits) when one batch of
    ``batch_size`` x ``block_size`` tokens takes more than the memory here: their ids, and with the model's
    ``width`` one float32 hidden state each (the least a forward holds), before anything is allocated."""
    from ltcx.persist import file_fits

    limit = file_fits.memory_limit()
    per_token = BYTES_PER_TOKEN_ID + 4 * width
    need = batch_size * block_size * per_token
    if limit is None or need <= limit:
        return
    held = f"their ids and one hidden state of width {width:,} in float32" if width else "their ids alone"
    raise ConfigError(
        f"data.block_size={block_size:,} with data.batch_size={batch_size}: one batch of {batch_size} x "
        f"{block_size:,} tokens takes at least {need / 2**30:,.1f} GiB ({held}), more than the "
        f"{limit / 2**30:,.1f} GiB of memory here: fix --data.block_size (at most "
        f"{limit // (batch_size * per_token):,} at this batch size)"
    )


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
        test_split: hub split to test on (local files: those named test beside validation-named ones); None or a
            missing split tests on a hold-out of the training documents (``test_fraction``).
        tokenizer: "gpt2", "bytes", or a Hugging Face tokenizer name or local folder.
        block_size: tokens of context per training sample (each sample holds block_size + 1 tokens).
        batch_size: blocks per batch on each device.
        val_batches: validation batches per validation run, the same on every device (0 disables validation).
        test_batches: test batches of ``ltcx test``, the same on every device; None: ``val_batches``.
        num_workers: dataloader worker processes per device.
        shuffle_buffer: documents in the streaming shuffle buffer (0 = read in file order).
        seed: seed of the shuffle (pass k uses seed + k).
        holdout_fraction: fraction of training documents held out for validation when there is no validation split.
        test_fraction: fraction of training documents held out for the test split, and never trained on, when there
            is no test split (by a hash of the text, disjoint from the validation hold-out; 0: none).
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
        test_split: str | None = "test",
        tokenizer: str = "gpt2",
        block_size: int = 512,
        batch_size: int = 24,
        val_batches: int = 20,
        test_batches: int | None = None,
        num_workers: int = 0,
        shuffle_buffer: int = 10_000,
        seed: int = 1234,
        holdout_fraction: float = 0.005,
        test_fraction: float = 0.005,
        txt_sample_by: str = "paragraph",
        pad_vocab_to_multiple_of: int = 64,
        sampling: str = "blocks",
        verify: str = "fast",
    ) -> None:
        super().__init__()
        checks = [
            (block_size >= 1, "block_size", block_size, "must be >= 1"),
            *loader_checks(batch_size, val_batches, num_workers, pad_vocab_to_multiple_of, test_batches),
            (shuffle_buffer >= 0, "shuffle_buffer", shuffle_buffer, "must be >= 0 (0 = no shuffle)"),
            (0.0 <= holdout_fraction < 1.0, "holdout_fraction", holdout_fraction, "must be in [0, 1)"),
            (0.0 <= test_fraction < 1.0 - holdout_fraction, "test_fraction", test_fraction,
             f"must be in [0, 1 - data.holdout_fraction) = [0, {1.0 - holdout_fraction:g})"),
            (txt_sample_by in SAMPLE_BY, "txt_sample_by", txt_sample_by, "must be 'line', 'paragraph' or 'document'"),
            (sampling in SAMPLING, "sampling", sampling, "must be 'blocks' or 'random'"),
            (verify in VERIFY_MODES, "verify", verify, "must be 'fast', 'full' or 'none'"),
            (bool(path), "path", path, "must name a hub data set or local files"),
        ]
        refuse_bad_settings("data", checks)
        check_batch_fits(block_size, batch_size)
        self.save_hyperparameters()
        self.path = path
        self.name = name
        self.text_column = text_column
        self.train_split = train_split
        self.val_split = val_split
        self.test_split = test_split
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_batches = val_batches
        self.test_batches = val_batches if test_batches is None else test_batches
        self.num_workers = num_workers
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.holdout_fraction = holdout_fraction
        self.test_fraction = test_fraction
        self.txt_sample_by = txt_sample_by
        self.pad_vocab_to_multiple_of = pad_vocab_to_multiple_of
        self.sampling = sampling
        self.verify = verify
        self._source: BlockSource | None = None  # StreamSource or ShardSource, once set up
        self._resumed: dict[str, Any] = {}  # the checkpoint's entry, handed to the source once there is one
        self._token_bytes: torch.Tensor | None | bool = False  # False: not built yet

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
    def token_bytes(self) -> torch.Tensor | None:
        """``LongTensor[vocab_size]``: the UTF-8 bytes each token id decodes to (0 for end-of-text), which
        ``LanguageModel`` sums over the targets for bits per byte; None for a tokenizer without fixed bytes per
        token (a Hugging Face one), said once in a notice line."""
        if self._token_bytes is False:
            lengths = self.tokenizer_obj.token_bytes()
            self._token_bytes = None if lengths is None else torch.tensor(lengths, dtype=torch.long)
            trainer = getattr(self, "trainer", None)
            if lengths is None and (trainer is None or trainer.is_global_zero):
                print(f"ltcx: tokenizer {self.tokenizer!r} has no fixed bytes per token (a Hugging Face tokenizer): "
                      "val/bpb and test/bpb are not logged", file=sys.stderr)
        return self._token_bytes  # type: ignore[return-value]

    @property
    def block_len(self) -> int:
        """Tokens per sample: ``block_size + 1`` (inputs ``block[:-1]``, targets ``block[1:]``)."""
        return self.block_size + 1

    def __repr__(self) -> str:  # LightningDataModule's __str__ would build every dataloader
        return f"{type(self).__name__}(path={self.path!r}, tokenizer={self.tokenizer!r}, block_size={self.block_size})"

    __str__ = __repr__

    # ------------------------------------------------------------------ choosing the source
    def setup(self, stage: str | None = None) -> None:
        """Open the data (lazily, streaming) and check it: tokenizer, files, columns, non-empty text, or the token
        shards against ``meta.json``.

        Idempotent; every problem is a one-line ``LtcxError`` raised before training writes anything (for
        ``stage="test"``: a disabled or missing test split too, before the test run writes anything).
        """
        if self._source is None:
            self._open()
        if stage == "test":
            self.test_dataset()  # one line now for a test split that is disabled or missing

    def _open(self) -> None:
        self.tokenizer_obj  # noqa: B018 - raises "unknown tokenizer ..." early
        folder = local_path(self.path)
        if is_prepared(folder):
            source: BlockSource = ShardSource(
                folder, path=self.path, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                block_size=self.block_size, batch_size=self.batch_size, val_batches=self.val_batches,
                num_workers=self.num_workers, seed=self.seed, sampling=self.sampling, verify=self.verify,
                test_batches=self.test_batches,
            )
        elif holds_shards(folder):  # a prepared folder that lost its meta.json, not one without text files
            raise LtcxError(
                f"'{self.path}' holds token shards but no {META}: it was deleted or moved, and without it the shards "
                f"cannot be checked or read; restore {META}, or prepare the data again with ltcx prepare --out "
                "<a new or empty folder> and point --data.path at that folder"
            )
        else:
            source = StreamSource(
                self.path, name=self.name, text_column=self.text_column, train_split=self.train_split,
                val_split=self.val_split, tokenizer=self.tokenizer, block_size=self.block_size,
                batch_size=self.batch_size, val_batches=self.val_batches, num_workers=self.num_workers,
                shuffle_buffer=self.shuffle_buffer, seed=self.seed, holdout_fraction=self.holdout_fraction,
                txt_sample_by=self.txt_sample_by, test_split=self.test_split, test_batches=self.test_batches,
                test_fraction=self.test_fraction,
            )
        source.load_state_dict(self._resumed)
        self._source = source

    @property
    def source(self) -> BlockSource:
        """The block source (set up on first use)."""
        self.setup()
        assert self._source is not None
        return self._source

    # ------------------------------------------------------------------ datasets and loaders
    def train_dataset(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        infinite: bool = True,
        skip_batches: int | None = None,
    ) -> IterableDataset:
        """The training blocks of ``rank`` of ``world_size`` (default: the trainer's, else 0 of 1); from token shards,
        whole batches, endless.

        ``infinite=False`` gives a single pass of text (for tests); ``skip_batches`` defaults to the resumed position.
        """
        self.setup("fit")
        rank, world_size = rank_and_world(self, rank, world_size)
        return self.source.train_dataset(rank, world_size, infinite=infinite, skip_batches=skip_batches)

    def val_dataset(self, rank: int | None = None, world_size: int | None = None) -> IterableDataset:
        """Exactly ``val_batches * batch_size`` validation blocks of ``rank`` of ``world_size`` (from token shards, as
        ``val_batches`` batches)."""
        self.setup("validate")
        if self.val_batches == 0:
            raise ConfigError("validation is disabled (data.val_batches=0): set --data.val_batches > 0")
        rank, world_size = rank_and_world(self, rank, world_size)
        return self.source.val_dataset(rank, world_size)

    def test_dataset(self, rank: int | None = None, world_size: int | None = None) -> IterableDataset:
        """Exactly ``test_batches * batch_size`` blocks of ``rank`` of ``world_size`` from the test split (documents
        training never reads: the source's test split, else the ``test_fraction`` hold-out); from token shards, as
        ``test_batches`` batches."""
        if self.test_batches == 0:
            raise ConfigError("the test split is disabled (data.test_batches=0): set --data.test_batches > 0")
        rank, world_size = rank_and_world(self, rank, world_size)
        return self.source.test_dataset(rank, world_size)

    def train_dataloader(self) -> DataLoader:
        return self.source.dataloader(self.train_dataset())

    def val_dataloader(self) -> DataLoader | list:
        if self.val_batches == 0:
            return []
        return self.source.dataloader(self.val_dataset())

    def test_dataloader(self) -> DataLoader:
        """``ltcx test`` reads the test split (``test_dataset``)."""
        return self.source.dataloader(self.test_dataset())

    def predict_dataloader(self) -> DataLoader | list:
        """``ltcx predict`` scores the validation blocks."""
        return self.val_dataloader()

    # ------------------------------------------------------------------ exact resume
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The source's batch -> ``LongTensor[B, block_size + 1]`` (text training batches leave their position)."""
        return batch if self._source is None else self._source.on_before_batch_transfer(batch)

    def state_dict(self) -> dict[str, Any]:
        """Training batches this rank has consumed (``global_step * accumulate_grad_batches``) and the source's
        state: for text, where every rank's stream stands, ``stream_positions[rank][part] = (pass, doc, tok)``,
        gathered from all ranks (Lightning calls this on every rank and saves rank 0's)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {"train_batches_consumed": 0}
        state: dict[str, Any] = {
            "train_batches_consumed": int(trainer.global_step) * int(trainer.accumulate_grad_batches)
        }
        if self._source is not None:

            def gather(mine: torch.Tensor) -> torch.Tensor:
                if trainer.world_size > 1:
                    return trainer.strategy.all_gather(mine.to(trainer.strategy.root_device))
                return mine[None]

            state.update(self._source.state_dict(gather))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next training dataloader continues after the batches already consumed."""
        self._resumed = dict(state_dict)
        if self._source is not None:
            self._source.load_state_dict(self._resumed)
