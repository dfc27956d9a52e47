"""``MFUMonitor``: the model FLOPs utilisation (``work/mfu``) and FLOP/s (``work/flops_per_sec``) of each training
step, against a GPU's data-sheet peak or a CPU's measured one."""

from __future__ import annotations

import math
import sys
import time

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ltcx.batches import split_batch
from ltcx.errors import LtcxError
from ltcx.throughput import default_peak_flops, loggers_write_now, model_flops_per_token


class MFUMonitor(L.Callback):
    """Log ``work/mfu``, the model FLOPs utilisation of a training step, and ``work/flops_per_sec``, on the steps the
    loggers write (``ltcx.throughput.loggers_write_now``).

    mfu = (B x T tokens of this device's batch) x backbone.flops_per_token(T) / (step time x peak_flops),
    the step time being the wall time between two training batch ends (data loading and the optimizer step
    included, validation excluded). A backbone without ``flops_per_token`` counts 6 N.

    A CPU's peak is measured (the best of a few short matmuls), and on a shared machine it can read low; a step
    that runs faster than it raises the peak to that step's rate, with one notice line, so ``work/mfu`` never
    goes above 1. A peak set in the config or a GPU's data-sheet peak is kept: a step above it logs its MFU
    above 1 with one warning line, since that points at a wrong ``peak_flops`` or ``flops_per_token``.

    Lightning's ``ThroughputMonitor`` (with ``lightning.fabric.utilities.throughput.Throughput``) does not suffice:
    it logs ``train/device/mfu`` and ``train/device/flops_per_sec`` straight to the loggers, not through
    ``self.log``, so neither the progress bar nor ``LineProgress`` shows them; it averages over a window of
    ``window_size`` (100) batches and logs nothing before the window is full (a short run has no MFU at all), where
    this logs each logged step's own; its ``available_flops`` is fixed at setup from a table of GPUs, None on a CPU
    (no MFU there), with no measured CPU peak and no raising of a peak a step beat; it reads a fixed
    ``flops_per_batch`` off the LightningModule rather than the backbone's ``flops_per_token`` for the batch's
    length; and it runs on rank 0 only. The peak itself comes from ``ltcx.throughput.default_peak_flops``, which
    uses Lightning's ``get_available_flops`` table for GPUs.

    Args:
        peak_flops: FLOP/s of one device. None: the dense bf16 peak of a known GPU (H100/H200 989e12, A100
            312e12, ...), or on a CPU a float32 matmul rate measured when training starts.
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and not 0 < peak_flops < math.inf:
            raise LtcxError(f"MFUMonitor peak_flops ({peak_flops}) must be a positive number of FLOP/s")
        self.peak_flops = peak_flops
        self._peak: float | None = None
        self._measured = False  # whether _peak is this run's own measurement (raised when a step beats it)
        self._told = False  # the one line about a step above the peak is printed
        self._last_end: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops is not None:
            self._peak, source = float(self.peak_flops), "set in the config"
        else:
            self._peak, source = default_peak_flops(pl_module.device)
        self._measured = self.peak_flops is None and pl_module.device.type == "cpu"
        self._told = False
        if self._peak is None:
            rank_zero_warn(f"ltcx: no work/mfu: {source}; set MFUMonitor's peak_flops (FLOP/s of one device)")
        else:
            rank_zero_info(f"ltcx: work/mfu against {self._peak:.3g} FLOP/s per device ({source})")
        self._last_end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        if self._peak is not None and last is not None and now > last and loggers_write_now(trainer):
            size, length = split_batch(batch)[0].shape  # the inputs [B, T] (a block holds T + 1 tokens)
            flops = size * length * model_flops_per_token(pl_module.backbone, length) / (now - last)
            if flops > self._peak:
                self._above_peak(trainer, flops)
            pl_module.log("work/flops_per_sec", flops)
            pl_module.log("work/mfu", flops / self._peak)

    def _above_peak(self, trainer, flops: float) -> None:
        """A step ran at ``flops`` FLOP/s, above the peak: a measured peak read low and is raised to it; a given
        one is kept. Either way one line, the first time."""
        if self._measured:
            text = (f"step {trainer.global_step} ran at {flops:.3g} FLOP/s, above the measured CPU peak of "
                    f"{self._peak:.3g} (the machine was busier while measuring): work/mfu is against the fastest rate "
                    "seen from now on; set MFUMonitor's peak_flops for a fixed figure")
            self._peak = flops
        else:
            text = (f"work/mfu {flops / self._peak:.3g} > 1 at step {trainer.global_step}: {flops:.3g} FLOP/s is "
                    f"above the peak of {self._peak:.3g}; check MFUMonitor's peak_flops and the backbone's "
                    "flops_per_token")
        if not self._told and getattr(trainer, "is_global_zero", True):
            print(f"ltcx: {text}", file=sys.stderr)
        self._told = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last_end = None  # time spent validating is not a training step
