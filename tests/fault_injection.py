"""Callbacks for the failure tests: at a given step, poison the weights or signal the process itself."""

import os
import signal

import lightning as L
import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard under FSDP2 (a DTensor), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class PoisonWeights(L.Callback):
    """After optimizer step ``at_step``, set one weight to NaN (as a blown-up update would); with ``rank``, on that
    global rank only (under DDP the next loss is then NaN there alone, as with a bad batch on one rank; under FSDP2 the
    weight is in that rank's shard, gathered by every rank)."""

    def __init__(self, at_step: int, rank: int | None = None) -> None:
        self.at_step = at_step
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                local(next(pl_module.parameters())).view(-1)[0] = float("nan")


class PoisonGradient(L.Callback):
    """Before optimizer step ``at_step``, set one gradient to NaN: the loss was finite, and the update writes
    non-finite weights (as a learning rate far too high does); with ``rank``, on that global rank only."""

    def __init__(self, at_step: int, rank: int | None = None) -> None:
        self.at_step = at_step
        self.rank = rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.at_step and self.rank in (None, trainer.global_rank):
            local(next(p for p in pl_module.parameters() if p.grad is not None).grad).view(-1)[0] = float("nan")


class PoisonBeforeValidation(L.Callback):
    """When the validation after optimizer step ``at_step`` starts, set one weight to NaN: the validation loss is NaN
    while no training step has seen it."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.at_step:
            with torch.no_grad():
                local(next(pl_module.parameters())).view(-1)[0] = float("nan")


class KillSelf(L.Callback):
    """After optimizer step ``at_step``, SIGKILL the process of global rank ``rank`` (a crash, the OOM killer)."""

    def __init__(self, at_step: int, rank: int) -> None:
        self.at_step = at_step
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalSelf(L.Callback):
    """After optimizer step ``at_step``, send ``signal_name`` (e.g. SIGTERM) to this process; with ``rank``, only the
    process of that global rank sends it (under DDP, rank 0 is the launching process); with ``group``, to this
    process's whole process group (every rank, as Ctrl-C in a terminal or a job scheduler does)."""

    def __init__(self, at_step: int, signal_name: str, rank: int | None = None, group: bool = False) -> None:
        self.at_step = at_step
        self.signal_name = signal_name
        self.rank = rank
        self.group = group

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and self.rank in (None, trainer.global_rank):
            if self.group:
                os.killpg(os.getpgid(0), getattr(signal, self.signal_name))
            else:
                os.kill(os.getpid(), getattr(signal, self.signal_name))
