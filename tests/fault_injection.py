"""Callbacks for the failure tests: at a given step, poison the weights or signal the process itself."""

import os
import signal

import lightning as L
import torch


class PoisonWeights(L.Callback):
    """After optimizer step ``at_step``, set one weight to NaN (as a blown-up update would)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


class SignalSelf(L.Callback):
    """After optimizer step ``at_step``, send ``signal_name`` (e.g. SIGTERM) to this process."""

    def __init__(self, at_step: int, signal_name: str) -> None:
        self.at_step = at_step
        self.signal_name = signal_name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), getattr(signal, self.signal_name))
