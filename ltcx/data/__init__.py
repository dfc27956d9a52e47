"""Data: streaming text, or token shards prepared once (``ltcx.data.prepare``), served as fixed-size token blocks."""

from ltcx.data.block_source import DataError
from ltcx.data.module import TextDataModule
from ltcx.data.packing import in_holdout, pack_blocks

__all__ = ["DataError", "TextDataModule", "in_holdout", "pack_blocks"]
