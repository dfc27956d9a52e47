"""Data: streaming text, or token shards prepared once (``ltcx.data.prepare``), served as fixed-size token blocks;
synthetic recall tasks (MQAR, ``ltcx.data.mqar``) made on the fly."""

from ltcx.data.block_source import DataError
from ltcx.data.module import TextDataModule
from ltcx.data.mqar import RecallDataModule
from ltcx.data.packing import in_holdout, in_test_holdout, pack_blocks

__all__ = ["DataError", "RecallDataModule", "TextDataModule", "in_holdout", "in_test_holdout", "pack_blocks"]
