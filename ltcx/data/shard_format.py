"""The token-shard format on disk: written by ``ltcx prepare``, memory-mapped by ``ShardSource`` (``token_shards.py``).

A prepared folder holds ``train_NNNNNN.bin``, ``val_NNNNNN.bin``, ``test_NNNNNN.bin`` and ``meta.json`` (tokenizer,
settings, counts, and for every shard its token and document counts, largest id and SHA-256). A shard is a 64-byte
header and the token ids:

    magic b"LTCXTOK\\0" | version u32 | bytes per token u32 (2: uint16, 4: uint32) | tokens u64 | documents u64 | 0...
    tokens x little-endian uint16/uint32, every document followed by the tokenizer's end-of-text id

so the fast check (file size and header against meta.json) needs no reading beyond 64 bytes a shard. A shard's
``max_id`` was added to meta.json later (same format version): folders prepared before it load as before, and for
them only the full check sees ids outside the vocabulary. So was the test split (``shards["test"]``, ``meta["test"]``):
folders prepared before it have neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Any

import numpy as np

from ltcx.errors import LtcxError

__all__ = [
    "HEADER_BYTES", "META", "Shard", "holds_shards", "is_prepared", "load_meta", "open_shard", "token_dtype",
    "more_validation", "outside_vocabulary", "test_source", "validation_source", "verify_shards", "write_json",
    "write_shard",
]

MAGIC = b"LTCXTOK\0"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, tokens, documents (then zeros to 64 bytes)
META = "meta.json"
FORMAT = "ltcx-token-shards"
VERIFY_MODES = ("fast", "full", "none")

Shard = dict[str, Any]  # meta.json's record of one shard: file, tokens, documents, max_id (newer folders), sha256
_SHARD_NAME = re.compile(r"(train|val|test)_\d{6}\.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (GPT-2's 50,257 do), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_shard(path: str, tokens: np.ndarray, documents: int) -> Shard:
    """Write ``tokens`` (1-D uint16/uint32) as a shard: temp file, fsync, ``os.replace``. Returns its record."""
    header = _HEADER.pack(MAGIC, VERSION, tokens.dtype.itemsize, tokens.size, documents).ljust(HEADER_BYTES, b"\0")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written temp file left
        _remove(tmp)
        raise
    return {"file": os.path.basename(path), "tokens": int(tokens.size), "documents": documents,
            "max_id": int(tokens.max(initial=0)), "sha256": _sha256(path)}


def write_json(path: str, data: dict) -> None:
    """Atomically: the old complete file or the new complete one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def is_prepared(folder: str) -> bool:
    """Whether ``folder`` is (or was being made into) a prepared token-shard folder."""
    return os.path.isfile(os.path.join(folder, META))


def holds_shards(folder: str) -> bool:
    """Whether ``folder`` holds an ltcx token shard (by its name and magic), with or without a meta.json."""
    if not os.path.isdir(folder):
        return False
    for name in os.listdir(folder):
        if _SHARD_NAME.fullmatch(name):
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    if f.read(len(MAGIC)) == MAGIC:
                        return True
            except OSError:
                continue
    return False


def load_meta(folder: str) -> dict[str, Any]:
    """``meta.json`` of a prepared folder; one line if it is unreadable or the preparation did not finish."""
    path = os.path.join(folder, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise LtcxError(f"cannot read '{path}' ({exc}): prepare the data again with ltcx prepare") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LtcxError(f"'{path}' is not an ltcx token-shard meta.json (version {VERSION}): prepare the data again")
    if not meta.get("complete"):
        raise LtcxError(
            f"the preparation of '{folder}' did not finish: run the same ltcx prepare command again to complete it"
        )
    return meta


def validation_source(meta: dict[str, Any]) -> str:
    """Where a prepared folder's validation documents came from, in words (for messages)."""
    validation = meta.get("validation")  # absent in folders prepared before a source's validation split was read
    if validation is not None and validation["split"] is not None:
        local = meta["settings"].get("split") is None  # local files: split by their names
        return "the source's validation-named files" if local else f"the source's {validation['split']!r} split"
    return f"--val_fraction {meta['settings']['val_fraction']} of the documents held out by hash"


def test_source(meta: dict[str, Any]) -> str:
    """Where a prepared folder's test documents came from, in words (for messages)."""
    test = meta.get("test")  # absent in folders prepared before ltcx prepare wrote a test split
    if test is None:
        return "prepared before ltcx prepare wrote a test split"
    if test["split"] is not None:
        local = meta["settings"].get("split") is None
        return "the source's test-named files" if local else f"the source's {test['split']!r} split"
    return f"--test_fraction {meta['settings']['test_fraction']} of the documents held out by hash"


def more_validation(meta: dict[str, Any]) -> str:
    """How to prepare more validation documents than the folder of ``meta`` holds (for messages)."""
    validation = meta.get("validation")
    if validation is not None and validation["split"] is not None:
        return "for more, prepare again into a new --out with --val_split none and a --val_fraction"
    return "prepare again into a new --out with a larger --val_fraction"


def open_shard(folder: str, shard: Shard, dtype: np.dtype) -> np.memmap:
    """The tokens of one shard, memory-mapped read-only: ``[shard['tokens']]``."""
    return np.memmap(os.path.join(folder, shard["file"]), dtype=dtype, mode="r", offset=HEADER_BYTES,
                     shape=(shard["tokens"],))


def verify_shards(folder: str, meta: dict[str, Any], mode: str = "fast", vocab_size: int | None = None) -> None:
    """Check every shard against ``meta.json``: ``fast`` its size and header, ``full`` also its SHA-256.

    With ``vocab_size``, also that every id is below it: ``fast`` by the ``max_id`` meta.json records (absent in
    folders prepared before it was recorded: not checked), ``full`` by reading every id (in the SHA-256 pass).
    Raises one ``LtcxError`` line naming the first shard that does not match.
    """
    if mode not in VERIFY_MODES:
        raise LtcxError(f"data.verify={mode!r} must be 'fast', 'full' or 'none': fix --data.verify")
    if mode == "none":
        return
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    for shard in meta["shards"]["train"] + meta["shards"]["validation"] + meta["shards"].get("test", []):
        path = os.path.join(folder, shard["file"])
        problem, max_id = _shard_problem(path, shard, dtype, full=mode == "full")
        if problem:
            raise LtcxError(
                f"token shard '{path}' does not match {META} ({problem}): it was changed or damaged after "
                "ltcx prepare; prepare the data again into a new folder"
            )
        if vocab_size is not None and max_id is not None and max_id >= vocab_size:
            raise LtcxError(outside_vocabulary(path, max_id, meta["tokenizer"], vocab_size))


def outside_vocabulary(path: str, token_id: int, tokenizer: str, vocab_size: int, offset: int | None = None) -> str:
    """The line naming an id at or above the tokenizer's ``vocab_size`` in shard ``path`` (at token ``offset``: found
    in a batch, after the start-up check passed)."""
    where = "" if offset is None else f" at token {offset:,}"
    fix = "prepare the data again into a new folder"
    if offset is not None:
        fix += " (ltcx prepare), or check every id before training with --data.verify full"
    return (f"token shard '{path}' holds id {token_id}{where}, outside the vocabulary of tokenizer {tokenizer!r} "
            f"({vocab_size} ids, 0-{vocab_size - 1}): it was changed after ltcx prepare or made with another "
            f"tokenizer; {fix}")


def _shard_problem(path: str, shard: Shard, dtype: np.dtype, *, full: bool) -> tuple[str | None, int | None]:
    """What is wrong with the shard's file (None: nothing), and its largest id (full: read; fast: as recorded)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as exc:
        return exc.strerror or str(exc), None
    expected = HEADER_BYTES + shard["tokens"] * dtype.itemsize
    if size != expected:
        return f"{size} bytes, expected {expected}", None
    if len(head) < _HEADER.size or _HEADER.unpack(head) != (MAGIC, VERSION, dtype.itemsize, shard["tokens"],
                                                             shard["documents"]):
        return "its header differs", None
    if not full:
        return None, shard.get("max_id")
    sha256, max_id = _scan(path, dtype)
    return ("SHA-256 differs" if sha256 != shard["sha256"] else None), max_id


def _scan(path: str, dtype: np.dtype) -> tuple[str, int]:
    """The SHA-256 of a shard file and its largest id, in one read (chunks hold whole ids: the size was checked)."""
    digest, max_id = hashlib.sha256(), 0
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_BYTES))
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            max_id = max(max_id, int(np.frombuffer(chunk, dtype=dtype).max()))
    return digest.hexdigest(), max_id
