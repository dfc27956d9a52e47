"""Pure helpers of the text pipeline: cutting a token stream into blocks, and the document-level hold-out."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

__all__ = ["pack_blocks", "in_holdout"]


def pack_blocks(token_lists: Iterable[list[int]], block_len: int) -> Iterator[list[int]]:
    """Join ``token_lists`` into one stream and cut it into consecutive, non-overlapping blocks of ``block_len``.

    Nothing is padded, repeated or skipped, except the tail shorter than ``block_len`` at the end of the stream,
    which is dropped. The caller appends the end-of-text id to each document before passing it in.
    """
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    buf: list[int] = []
    for tokens in token_lists:
        buf.extend(tokens)
        if len(buf) >= block_len:
            end = len(buf) - len(buf) % block_len
            for start in range(0, end, block_len):
                yield buf[start : start + block_len]
            buf = buf[end:]


def in_holdout(text: str, fraction: float) -> bool:
    """Whether a document belongs to the validation hold-out: a stable hash of its text falls below ``fraction``.

    Depends on the text only, so it is the same on every rank, worker, run and machine.
    """
    if fraction <= 0.0:
        return False
    return zlib.crc32(text.encode("utf-8")) < fraction * 4294967296.0
