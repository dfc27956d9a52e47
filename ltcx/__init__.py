"""ltcx: train, sample from and compare small language models of new sequence architectures."""

__version__ = "0.1.0"
