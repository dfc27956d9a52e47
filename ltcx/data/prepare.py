"""``ltcx prepare``: a text corpus, read once in streaming, into deduplicated, tokenized token shards.

    ltcx prepare --out data/fineweb-edu-10BT                          # FineWeb-Edu sample-10BT from the hub
    ltcx prepare --source sample --out data/sample                    # its validation.txt is the validation split
    ltcx prepare --source my_corpus/ --out data/my_corpus --val_fraction 0.01

Validation is the source's own validation split when it has one (a hub data set's ``val_split``; local files named
val/valid/validation, else test, as ``--data.path`` reads them), read first and in full; otherwise a stable hash of
the normalised text sends ``val_fraction`` of the documents to validation. The test split likewise: the source's
``test_split`` (local files named test beside validation-named ones), read next and in full, else the documents
whose hash is in the top ``test_fraction`` of its range (``in_test_holdout``). Documents are read in order; exact
duplicates (after whitespace normalisation) are dropped, across the splits too (so they share no document);
worker processes tokenize batches of documents; the main process appends them, each followed by end-of-text, to
the current shard of its split. A shard is committed when it holds ``shard_tokens``: shard files first, then the
hashes seen, then ``meta.json`` with the stream position (which split, and ``datasets``' ``state_dict`` in it). A
killed run resumes from the last commit: the stream is restored with ``load_state_dict``, the hash file is cut back
to its committed length, later files are overwritten.

One module because it is one resumable pipeline: a commit ties the stream position, the hashes and the shards
together. The command-line front-end is ``ltcx/cli/prepare.py``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import multiprocessing
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from ltcx.data.files import looks_local
from ltcx.data.packing import in_holdout, in_test_holdout
from ltcx.data.shard_format import (
    FORMAT,
    META,
    VERSION,
    holds_shards,
    more_validation,
    test_source,
    token_dtype,
    validation_source,
    write_json,
    write_shard,
)
from ltcx.data.text_datasets import check_text, file_being_read, open_hub, open_local
from ltcx.errors import LtcxError
from ltcx.tokenizers import _short_reason, get_tokenizer

__all__ = ["prepare"]

SEEN = "seen.u64"  # 8-byte hashes of the normalised documents kept so far (append-only, cut back on resume)
COUNTS = ("documents_read", "empty", "duplicates", "train_documents", "validation_documents", "train_tokens",
          "validation_tokens", "test_documents", "test_tokens")
SPLITS = ("train", "validation", "test")  # the order of a batch's kept documents and of its token arrays


def _key(normalised: str) -> int:
    # 64 bits: for 10^7 documents the chance of one false duplicate is about 3e-6
    return int.from_bytes(hashlib.blake2b(normalised.encode("utf-8"), digest_size=8).digest(), "little")


_TOKENIZER = None

# A BPE tokenizer's cost grows faster than the length of one pre-tokenized piece (tiktoken, gpt2: a long line of
# letters is one piece), so a document above LONG_CHARS is tokenized in pieces of at most PIECE_CHARS (``_pieces``).
LONG_CHARS = 1 << 20
PIECE_CHARS = 1 << 16
_SPACE_AFTER_WORD = re.compile(r" \S")  # searched in the reversed text: a space after a non-whitespace character


def _pieces(text: str) -> list[str]:
    """``text``, or above ``LONG_CHARS`` characters ``text`` cut into pieces of at most ``PIECE_CHARS``, to be
    tokenized one by one and joined.

    Each cut goes just before the piece's last space that follows a non-whitespace character, where GPT-2's and
    tiktoken's pre-tokenizers always cut, so the tokens are the whole text's; a piece without one (a line without
    spaces) is cut at the limit, where the tokens can differ but still decode to the text.
    """
    if len(text) <= LONG_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        match = _SPACE_AFTER_WORD.search(text[start : end + 1][::-1])  # the last one: the first in the reversed text
        cut = end - match.start() if match is not None else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _init_worker(tokenizer: str) -> None:
    global _TOKENIZER
    _TOKENIZER = get_tokenizer(tokenizer)


def _tokenize(job: tuple[list[list[str]], str]) -> list[np.ndarray]:
    """Token arrays of the training, validation and test documents of one batch (``SPLITS``), each document
    followed by end-of-text."""
    splits, dtype = job
    tok = _TOKENIZER
    assert tok is not None

    def flat(texts: list[str]) -> np.ndarray:
        pieces, ends = [], []  # every document's pieces (one for all but very long ones); ends: its last one
        for text in texts:
            cut = _pieces(text)
            pieces.extend(cut)
            ends.extend([False] * (len(cut) - 1) + [True])
        ids: list[int] = []
        for piece, last in zip(tok.encode_batch(pieces) if pieces else [], ends):
            ids.extend(piece)
            if last:
                ids.append(tok.eot_id)
        return np.asarray(ids, dtype=dtype)

    return [flat(texts) for texts in splits]


class _Shards:
    """The documents of one split waiting to be written, and that split's committed shards."""

    def __init__(self, out: str, prefix: str, shards: list[dict]) -> None:
        self.out, self.prefix, self.shards = out, prefix, shards
        self.parts: list[np.ndarray] = []
        self.tokens = self.documents = 0

    def add(self, tokens: np.ndarray, documents: int) -> None:
        self.parts.append(tokens)
        self.tokens += tokens.size
        self.documents += documents

    def flush(self) -> None:
        if self.documents:
            path = os.path.join(self.out, f"{self.prefix}_{len(self.shards):06d}.bin")
            self.shards.append(write_shard(path, np.concatenate(self.parts), self.documents))
        self.parts, self.tokens, self.documents = [], 0, 0


def prepare(
    source: str = "HuggingFaceFW/fineweb-edu",
    out: str = "",
    *,
    name: str | None = "sample-10BT",
    split: str = "train",
    val_split: str | None = "validation",
    test_split: str | None = "test",
    text_column: str = "text",
    txt_sample_by: str = "paragraph",
    tokenizer: str = "gpt2",
    val_fraction: float = 0.001,
    test_fraction: float = 0.001,
    shard_tokens: int = 100_000_000,
    max_tokens: int | None = None,
    num_proc: int | None = None,
    batch_docs: int = 1024,
) -> dict[str, Any]:
    """Prepare ``source`` (hub data set id, or local files) into token shards in ``out``; returns ``meta.json``.

    ``val_split``: the source's validation split (hub: that split; local files: those named val/valid/validation,
    else test), used when the source has it; None, or a source without one: ``val_fraction`` of the documents held
    out by a hash of their text (local validation-named files are then read as training text). ``test_split`` and
    ``test_fraction`` the same for the test split (local files: those named test beside validation-named ones),
    whose documents lie at the other end of the hash's range.
    ``max_tokens`` stops after about that many training tokens (at a batch boundary). Rerunning the same call
    resumes an interrupted preparation and does nothing for a finished one.
    """
    if not out:
        raise LtcxError("no output folder: pass --out (a new or empty folder, or one to resume)")
    if not 0.0 <= val_fraction < 1.0:
        raise LtcxError(f"--val_fraction ({val_fraction}) must be in [0, 1)")
    if not 0.0 <= test_fraction < 1.0 - val_fraction:
        raise LtcxError(f"--test_fraction ({test_fraction}) must be in [0, 1 - --val_fraction) = "
                        f"[0, {1.0 - val_fraction:g})")
    for flag, value in (("--shard_tokens", shard_tokens), ("--max_tokens", max_tokens), ("--num_proc", num_proc),
                        ("batch_docs", batch_docs)):  # None: the default (no limit, one process per CPU)
        if value is not None and value < 1:
            raise LtcxError(f"{flag} must be >= 1, not {value}")
    local = looks_local(source)
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    settings = {
        "source": source, "name": None if local else name, "split": None if local else split,
        "text_column": text_column, "txt_sample_by": txt_sample_by if local else None, "tokenizer": tokenizer,
        "val_fraction": val_fraction, "shard_tokens": shard_tokens, "max_tokens": max_tokens, "val_split": val_split,
        "test_split": test_split, "test_fraction": test_fraction,
    }
    meta = _existing(out, settings)
    if meta is not None and meta["complete"]:
        print(f"ltcx: '{out}' is already prepared ({_summary(meta)})", file=sys.stderr)
        return meta
    if local:
        ds, val, test, what = open_local(source, txt_sample_by=txt_sample_by, validation=val_split is not None,
                                         test=test_split is not None, flag="--source")
    else:
        if test_split is not None and test_split in (split, val_split):
            raise LtcxError(f"--test_split '{test_split}' is the {'--split' if test_split == split else '--val_split'}"
                            " being prepared: pass another split, or --test_split none to hold out --test_fraction "
                            "of its documents")
        ds, val, test, what = open_hub(source, name, split, val_split, test_split, flags=("--source", "--split"))
        if val is not None and val_split == split:
            raise LtcxError(f"--val_split '{val_split}' is the --split being prepared: pass another split, or "
                            "--val_split none to hold out --val_fraction of its documents")
    check_text(ds, source, what, text_column, split=split if not local else "train",
               flags=("--source", "--text_column"))
    for held, name_there, name_local in ((val, val_split, "validation"), (test, test_split, "test")):
        if held is not None:
            check_text(held, source, what, text_column, split=name_there if not local else name_local,
                       flags=("--source", "--text_column"))
    streams = [(kind, held) for kind, held in (("validation", val), ("test", test)) if held is not None]
    streams.append(("train", ds))
    if meta is None:  # everything checked: only now is anything written
        meta = _create(out, settings, tok, dtype)
    validation = {"split": val_split if val is not None else None, "holdout": 0.0 if val is not None else val_fraction}
    if meta.setdefault("validation", validation) != validation:  # the source gained or lost its validation split
        raise LtcxError(f"the source's validation split changed since '{out}' was started "
                        f"({validation_source(meta)} then): prepare it into a new --out")
    tested = {"split": test_split if test is not None else None, "holdout": 0.0 if test is not None else test_fraction}
    if meta.setdefault("test", tested) != tested:
        raise LtcxError(f"the source's test split changed since '{out}' was started ({test_source(meta)} then): "
                        "prepare it into a new --out")
    meta["shards"].setdefault("test", [])  # a folder started before the test split: resumed with none
    for key in COUNTS:
        meta["counts"].setdefault(key, 0)

    num_proc = num_proc or os.cpu_count() or 1
    # The workers only tokenize (no `datasets` or fsspec state is used after the fork).
    pool = multiprocessing.Pool(num_proc, _init_worker, (tokenizer,)) if num_proc > 1 else None
    try:
        if pool is None:
            _init_worker(tokenizer)
        _run(streams, meta, out, text_column, dtype, batch_docs, pool, num_proc)
    finally:
        if pool is not None:
            pool.terminate()
    print(f"ltcx: prepared '{out}': {_summary(meta)}", file=sys.stderr)
    asked = meta["validation"]["split"] is not None or meta["validation"]["holdout"] > 0  # --val_fraction 0: none
    if asked and meta["counts"]["validation_tokens"] < _FEW_VALIDATION_TOKENS:
        print(f"ltcx: only {meta['counts']['validation_tokens']:,} validation tokens ({validation_source(meta)}), too "
              f"few for validation batches of longer blocks; {more_validation(meta)}", file=sys.stderr)
    return meta


# Fewer validation tokens than this get a notice: 4 blocks of the configs' block_size 512 (+1).
_FEW_VALIDATION_TOKENS = 4 * 513


def _existing(out: str, settings: dict) -> dict[str, Any] | None:
    """The ``meta.json`` in ``out`` when its settings are the same; None for a new or empty folder."""
    path = os.path.join(out, META)
    if os.path.exists(out) and not os.path.isdir(out):
        raise LtcxError(f"--out '{out}' is a file, not a folder: pass --out a new or empty folder")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise LtcxError(
                f"cannot read '{path}' ({_short_reason(exc)}): it is damaged; pass --out a new or empty folder"
            ) from None
        if not isinstance(meta, dict):
            raise LtcxError(f"'{path}' is not an ltcx token-shard {META}: pass --out a new or empty folder")
        theirs = meta.get("settings", {})
        if isinstance(theirs, dict) and "val_split" not in theirs:  # prepared before validation splits were read:
            theirs = {**theirs, "val_split": None}  # one stream, documents held out by hash, as val_split None does
        if isinstance(theirs, dict) and "test_split" not in theirs:  # prepared before the test split: it has none
            theirs = {**theirs, "test_split": None, "test_fraction": 0.0}
        if meta.get("format") != FORMAT or theirs != settings:
            diff = ", ".join(f"{k}: {theirs.get(k)!r} there, {v!r} now"
                             for k, v in settings.items() if theirs.get(k) != v)
            raise LtcxError(f"'{out}' holds a preparation with other settings ({diff}): use another --out")
        return meta
    if holds_shards(out):
        raise LtcxError(
            f"'{out}' holds token shards but no {META}: it was deleted or moved, and without it nothing can be "
            f"resumed; restore {META} to resume, or pass --out a new or empty folder"
        )
    if os.path.isdir(out) and os.listdir(out):
        raise LtcxError(f"'{out}' is not empty and holds no {META}: pass --out a new or empty folder")
    return None


def _write_error(out: str, error: OSError, *, started: bool = True) -> LtcxError:
    """The one line for a write into ``out`` that failed (a full disk most likely); ``started``: after a commit."""
    reason = "disk full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else (error.strerror or type(error).__name__)
    again = "again, which resumes from its last commit" if started else "again (nothing was written)"
    return LtcxError(f"cannot write to '{out}' ({reason}): free space there and run the same ltcx prepare command "
                     f"{again}")


def _create(out: str, settings: dict, tok: Any, dtype: np.dtype) -> dict[str, Any]:
    """A new preparation's ``meta.json`` and empty hash file in ``out``, or (a failed write) neither."""
    made = not os.path.isdir(out)
    try:
        return _write_start(out, settings, tok, dtype)
    except OSError as exc:
        with contextlib.suppress(OSError):  # what this call made
            os.remove(os.path.join(out, SEEN))
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise _write_error(out, exc, started=False) from None


def _write_start(out: str, settings: dict, tok: Any, dtype: np.dtype) -> dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    meta = {
        "format": FORMAT, "version": VERSION, "complete": False, "settings": settings,
        "tokenizer": settings["tokenizer"], "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": dtype.name,
        "counts": dict.fromkeys(COUNTS, 0), "shards": {"train": [], "validation": [], "test": []},
        "resume": {"stream": None, "seen": 0},
    }
    open(os.path.join(out, SEEN), "wb").close()
    write_json(os.path.join(out, META), meta)
    return meta


def _batches(
    streams: list[tuple[str, Any]], column: str, batch_docs: int, position: dict | None
) -> Iterator[tuple[str, list[Any], dict]]:
    """``(split, documents, position after them)`` in batches of one split each: the streams one after another
    (validation first, so that ``max_tokens`` never cuts it short), from ``position`` (a committed one, or None)."""
    start = 0
    if position is not None:
        if "split" not in position:  # committed before validation splits were read: the one training stream's
            position = {"split": "train", "stream": position}
        start = [split for split, _ in streams].index(position["split"])
        streams[start][1].load_state_dict(position["stream"])
    for split, ds in streams[start:]:
        batch: list[Any] = []
        examples = iter(ds)
        while True:
            try:
                example = next(examples, None)
            except Exception as exc:  # noqa: BLE001 - a bad file after the first: one line naming it
                file = file_being_read(exc)  # here, in the reading thread: the pool pickles the traceback away
                what = f"data file '{file}'" if file else "the source"
                raise LtcxError(
                    f"cannot read {what} ({_short_reason(exc)}): fix it "
                    "and run the same ltcx prepare again (it resumes), or remove it and prepare into a new --out"
                ) from None
            if example is None:
                break
            batch.append(example[column])
            if len(batch) == batch_docs:
                yield split, batch, {"split": split, "stream": ds.state_dict()}
                batch = []
        if batch:
            yield split, batch, {"split": split, "stream": ds.state_dict()}


def _run(
    streams: list[tuple[str, Any]], meta: dict, out: str, column: str, dtype: np.dtype, batch_docs: int, pool: Any,
    num_proc: int,
) -> None:
    from tqdm import tqdm

    settings, counts, holdout = meta["settings"], meta["counts"], meta["validation"]["holdout"]
    test_holdout = meta["test"]["holdout"]
    seen_path = os.path.join(out, SEEN)
    with open(seen_path, "r+b") as f:  # cut back to the last commit: later hashes belong to uncommitted documents
        f.truncate(meta["resume"]["seen"] * 8)
    seen = set(np.fromfile(seen_path, dtype="<u8").tolist())
    train = _Shards(out, "train", meta["shards"]["train"])
    val = _Shards(out, "val", meta["shards"]["validation"])
    test = _Shards(out, "test", meta["shards"]["test"])
    shards = (train, val, test)  # SPLITS' order
    # The pool reads jobs() in a thread of its own, ahead of the tokenizers (a semaphore caps how far): each
    # batch's stream position, new hashes and counts wait here until its tokens arrive, and only then join what
    # the next commit writes.
    in_flight: deque[tuple[dict, list[int], dict[str, int]]] = deque()
    room, stop = threading.Semaphore(4 * num_proc), threading.Event()
    new_keys: list[int] = []
    pending = dict.fromkeys(COUNTS, 0)

    def jobs() -> Iterator[tuple[list[list[str]], str]]:
        for split, texts, state in _batches(streams, column, batch_docs, meta["resume"]["stream"]):
            while not room.acquire(timeout=0.1):
                if stop.is_set():
                    return
            keys: list[int] = []
            tally = dict(documents_read=len(texts), empty=0, duplicates=0)
            kept: tuple[list[str], list[str], list[str]] = ([], [], [])
            for text in texts:
                normalised = " ".join(text.split()) if isinstance(text, str) else ""
                key = _key(normalised) if normalised else None
                if key is None or key in seen:
                    tally["empty" if key is None else "duplicates"] += 1
                    continue
                seen.add(key)
                keys.append(key)
                if split != "train":
                    kept[SPLITS.index(split)].append(text)
                else:
                    kept[1 if in_holdout(normalised, holdout) else 2 if in_test_holdout(normalised, test_holdout)
                         else 0].append(text)
            tally.update({f"{name}_documents": len(docs) for name, docs in zip(SPLITS, kept)})
            in_flight.append((state, keys, tally))
            yield list(kept), dtype.name

    def commit(state: dict, *, complete: bool) -> None:
        try:
            write_commit(state, complete=complete)
        except OSError as exc:  # the last commit stays whole: its meta.json is replaced last
            raise _write_error(out, exc) from None

    def write_commit(state: dict, *, complete: bool) -> None:
        pending.update({f"{name}_tokens": split.tokens for name, split in zip(SPLITS, shards)})
        for split in shards:
            split.flush()
        with open(seen_path, "ab") as f:
            f.write(np.asarray(new_keys, dtype="<u8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        for k in COUNTS:
            counts[k] += pending[k]
            pending[k] = 0
        meta["resume"] = {"stream": state, "seen": meta["resume"]["seen"] + len(new_keys)}
        meta["complete"] = complete
        new_keys.clear()
        write_json(os.path.join(out, META), meta)

    results = pool.imap(_tokenize, jobs()) if pool is not None else map(_tokenize, jobs())
    state = meta["resume"]["stream"]
    limit = settings["max_tokens"]
    bar = tqdm(desc="prepare", unit="tok", unit_scale=True, total=limit, initial=counts["train_tokens"],
               dynamic_ncols=True)
    try:
        for ids in results:
            state, keys, tally = in_flight.popleft()
            room.release()
            new_keys.extend(keys)
            for k, v in tally.items():
                pending[k] += v
            for name, split, split_ids in zip(SPLITS, shards, ids):
                split.add(split_ids, tally[f"{name}_documents"])
            bar.update(ids[0].size)
            bar.set_postfix(docs=counts["documents_read"] + pending["documents_read"],
                            dups=counts["duplicates"] + pending["duplicates"], refresh=False)
            done = limit is not None and counts["train_tokens"] + train.tokens >= limit
            if max(split.tokens for split in shards) >= settings["shard_tokens"] or done:
                commit(state, complete=done)
            if done:
                break
        else:
            commit(state, complete=True)
    finally:
        stop.set()  # the pool's reader thread returns, so that the pool can be shut down
        bar.close()


def _summary(meta: dict) -> str:
    c = meta["counts"]
    shards = meta["shards"]
    return (f"{c['train_tokens']:,} training, {c['validation_tokens']:,} validation and {c.get('test_tokens', 0):,} "
            f"test tokens in {len(shards['train'])} + {len(shards['validation'])} + {len(shards.get('test', []))} "
            f"shards; {c['documents_read']:,} documents read, {c['duplicates']:,} duplicates and {c['empty']:,} empty "
            f"dropped; validation: {validation_source(meta)}; test: {test_source(meta)}")

