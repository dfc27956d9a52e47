"""Pure helpers of the text pipeline: cutting a token stream into blocks (with positions to resume from), and the
document-level hold-outs: validation takes the documents whose 32-bit text hash is in the lowest ``holdout_fraction``
of the range, test those in the highest ``test_fraction``, so the two never share a document and changing one
fraction never moves the other's documents."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

__all__ = ["in_holdout", "in_test_holdout", "pack_blocks", "pack_positions"]


def pack_blocks(token_lists: Iterable[list[int]], block_len: int) -> Iterator[list[int]]:
    """Join ``token_lists`` into one stream and cut it into consecutive, non-overlapping blocks of ``block_len``.

    Nothing is padded, repeated or skipped, except the tail shorter than ``block_len`` at the end of the stream,
    which is dropped. The caller appends the end-of-text id to each document before passing it in.
    """
    return (block for block, _, _ in pack_positions(token_lists, block_len))


def pack_positions(
    token_lists: Iterable[list[int]], block_len: int, *, first_doc: int = 0, offset: int = 0
) -> Iterator[tuple[list[int], int, int]]:
    """``pack_blocks``, each block with the stream position right after it: ``(block, doc, tok)``, the next block
    starts at token ``tok`` of document ``doc`` (counting documents from ``first_doc``).

    Started at ``first_doc`` with the first list's first ``offset`` tokens dropped, it continues a stream from such
    a position exactly: what is left over after a block is always the rest of the current document, so the position
    alone (no buffer) says where the following blocks begin.
    """
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    buf: list[int] = []
    for doc, tokens in enumerate(token_lists, first_doc):
        buf.extend(tokens[offset:] if doc == first_doc else tokens)
        if len(buf) >= block_len:
            end = len(buf) - len(buf) % block_len
            for start in range(0, end, block_len):
                left = len(buf) - start - block_len  # all of them from this document
                yield buf[start : start + block_len], *((doc, len(tokens) - left) if left else (doc + 1, 0))
            buf = buf[end:]


def in_holdout(text: str, fraction: float) -> bool:
    """Whether a document belongs to the validation hold-out: a stable hash of its text falls below ``fraction``.

    Depends on the text only, so it is the same on every rank, worker, run and machine.
    """
    if fraction <= 0.0:
        return False
    return zlib.crc32(text.encode("utf-8")) < fraction * 4294967296.0


def in_test_holdout(text: str, fraction: float) -> bool:
    """Whether a document belongs to the test hold-out: the same hash as ``in_holdout`` falls in the top
    ``fraction`` of its range (disjoint from the validation hold-out while the two fractions sum to at most 1)."""
    if fraction <= 0.0:
        return False
    return zlib.crc32(text.encode("utf-8")) >= (1.0 - fraction) * 4294967296.0
