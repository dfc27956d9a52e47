"""``Preemption``: SIGTERM and Ctrl-C stop training after the current step, save that step through the run's
``ModelCheckpoint`` and exit with 128 + the signal number; under DDP the ranks agree at each step's end."""

from __future__ import annotations

import signal

import lightning as L
import torch
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ltcx.ddp import launcher_outlives_workers


class Preemption(L.Callback):
    """Stop after the current step on SIGTERM or Ctrl-C (SIGINT), save it and exit with 128 + the signal (143, 130),
    so a preempted job never looks finished; ltcx's CLI adds it to every run (a ``Trainer`` built in Python needs
    ``callbacks=[..., Preemption()]``).

    On SIGTERM Lightning stops after the current step and exits 0 without saving; Ctrl-C stops wherever it lands.
    Here the first Ctrl-C is routed to Lightning's SIGTERM stop; a second one interrupts at once without saving. The
    step is saved by every ``ModelCheckpoint`` of the run that has ``save_current_step`` (ltcx's: as ``last.ckpt``
    when ``save_last``). Under DDP a signal reaching any rank (the launching process, or the whole process group)
    stops every rank after the same training step, decided together at its end; every rank exits with the same
    status.

    Lightning's ``OnExceptionCheckpoint`` does not do this job: it saves on every exception, also one raised
    mid-step (the weights and optimizer of no consistent step, or non-finite ones ``FiniteLossGuard`` stopped on),
    to a fixed ``<dirpath>/on_exception.ckpt`` beside the run folders rather than the run's ``last.ckpt`` that
    ``--ckpt_path last`` resumes, deletes it again at teardown, and neither stops on SIGINT, sets the exit status
    nor makes the DDP ranks stop at the same step.
    """

    def __init__(self) -> None:
        self._stop_signal = signal.SIGTERM
        self._previous_sigint = None
        self._pending_signal = 0  # under DDP: the signal this rank received, until the ranks agree on it

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Last before the checkpoint callbacks: a signal sent from another callback's on_train_batch_end (or during
        # it) is agreed on at that same step, and the agreement comes before ModelCheckpoint's periodic save. A new
        # list: Lightning is iterating over the old one to call each callback's setup.
        others = [c for c in trainer.callbacks if c is not self]
        at = next((i for i, c in enumerate(others) if isinstance(c, pl_callbacks.Checkpoint)), len(others))
        trainer.callbacks = [*others[:at], self, *others[at:]]

    def on_train_start(self, trainer, pl_module) -> None:
        self._pending_signal = 0
        if trainer.world_size > 1:
            # Under DDP a signal only marks the rank it reached; the ranks agree on stopping at the end of each
            # training step (on_train_batch_end). Lightning's own SIGTERM handler is replaced: it runs a broadcast
            # inside the handler, at whatever point each rank is, and the ranks' collectives then no longer match
            # (a SIGTERM to the launching process hung the run).
            signal.signal(signal.SIGTERM, self._note_signal)
            self._previous_sigint = signal.signal(signal.SIGINT, self._note_signal)
        else:
            # Lightning turns SIGTERM into a stop after the current step: route the first Ctrl-C there too.
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _note_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._restore_sigint()  # a second Ctrl-C interrupts at once
        self._pending_signal = max(self._pending_signal, int(signum))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size > 1:
            # Every rank, every step: the highest signal any rank received (0: none), so all stop at this same step
            # with the same exit status, whichever ranks the signal reached (the launching process, the group).
            flag = torch.tensor(self._pending_signal, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max"))
            if signum:
                self._stop_signal = signal.Signals(signum)
                # What Lightning's handler sets: its loop raises SIGTERMException after this step on every rank.
                trainer._signal_connector.received_sigterm = True

    def _on_sigint(self, signum, frame) -> None:
        self._stop_signal = signal.SIGINT
        signal.signal(signal.SIGINT, self._previous_sigint)  # a second Ctrl-C interrupts at once
        lightning_handler = signal.getsignal(signal.SIGTERM)
        if not callable(lightning_handler):  # Lightning installs none outside the main thread
            raise KeyboardInterrupt
        lightning_handler(signal.SIGTERM, frame)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_sigint()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException):  # other errors stop mid-step: nothing consistent to save
            return
        savers = [c for c in trainer.checkpoint_callbacks if hasattr(c, "save_current_step")]
        for checkpoint in savers:
            checkpoint.save_current_step(trainer)
        # SIGTERMException is a SystemExit: its code becomes the process's exit status.
        exception.code = 128 + self._stop_signal
        if trainer.world_size > 1:
            launcher_outlives_workers(trainer)
        saved = next((c.last_model_path or c.best_model_path for c in savers), None)
        saved = f"saved {saved}; resume with --ckpt_path last" if saved else "saved nothing (no ltcx ModelCheckpoint)"
        rank_zero_info(f"ltcx: {self._stop_signal.name} at step {trainer.global_step}: {saved}")
