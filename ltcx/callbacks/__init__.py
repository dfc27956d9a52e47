"""Callbacks, one concern per module; the class paths configs use (``ltcx.callbacks.ModelCheckpoint``, ...) are
these re-exports.

- ``samples``: ``SampleGeneration``, completions of a few prompts after each validation, in the loggers.
- ``guard``: ``FiniteLossGuard``, a stop on a non-finite training loss, weights or validation loss.
- ``throughput``: ``MFUMonitor``, ``work/mfu`` and ``work/flops_per_sec`` of each step.
- ``progress``: progress bars whose total is ``max_steps``, and ``LineProgress`` for output that is no terminal.
- ``checkpoint``: ``ModelCheckpoint``, Lightning's with run folders, ``keep_runs`` and the final step saved.
- ``preemption``: ``Preemption``, SIGTERM / Ctrl-C save the current step and exit 143 / 130 (every CLI run).
"""

from ltcx.callbacks.checkpoint import ModelCheckpoint
from ltcx.callbacks.guard import FiniteLossGuard
from ltcx.callbacks.preemption import Preemption
from ltcx.callbacks.progress import LineProgress, StepRichProgressBar, StepTQDMProgressBar
from ltcx.callbacks.samples import SampleGeneration
from ltcx.callbacks.throughput import MFUMonitor

__all__ = [
    "FiniteLossGuard",
    "LineProgress",
    "MFUMonitor",
    "ModelCheckpoint",
    "Preemption",
    "SampleGeneration",
    "StepRichProgressBar",
    "StepTQDMProgressBar",
]
