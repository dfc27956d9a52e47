"""Callbacks for the failure tests: at a given step, poison the weights, signal or pause the process itself."""

import os
import signal
import time

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
    process's whole process group (every rank, as Ctrl-C in a terminal or a job scheduler does). With
    ``count_file``, only the run that is the ``skip_runs + 1``-th to reach ``at_step`` sends it (the file counts the
    runs, e.g. of a study, that reached it)."""

    def __init__(self, at_step: int, signal_name: str, rank: int | None = None, group: bool = False,
                 count_file: str | None = None, skip_runs: int = 0) -> None:
        self.at_step = at_step
        self.signal_name = signal_name
        self.rank = rank
        self.group = group
        self.count_file = count_file
        self.skip_runs = skip_runs

    def _counted_out(self) -> bool:
        if self.count_file is None:
            return False
        seen = int(open(self.count_file).read()) if os.path.exists(self.count_file) else 0
        with open(self.count_file, "w") as counter:
            counter.write(str(seen + 1))
        return seen != self.skip_runs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and self.rank in (None, trainer.global_rank) and not self._counted_out():
            if self.group:
                os.killpg(os.getpgid(0), getattr(signal, self.signal_name))
            else:
                os.kill(os.getpid(), getattr(signal, self.signal_name))


class Pause(L.Callback):
    """After optimizer step ``at_step``, the process of global rank ``rank`` spends ``seconds`` outside any collective
    (a long step, a save, samples on rank 0); ``peer_grace`` sets how long the launching process waits for its own
    collective to find a stopped peer (``ltcx.ddp``) before it stops with the line itself."""

    def __init__(self, at_step: int, rank: int, seconds: float, peer_grace: float | None = None) -> None:
        self.at_step = at_step
        self.rank = rank
        self.seconds = seconds
        self.peer_grace = peer_grace

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.peer_grace is not None:
            from ltcx import ddp

            ddp.PEER_GRACE_S = self.peer_grace

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class KillSelfWhileSaving(L.Callback):
    """In the save of step ``at_step``, SIGKILL the process of global rank ``rank``: rank 0, which writes the file,
    once the new file is written beside the old one and before it replaces it; another rank between the gathers of
    the weights and of the optimizer state (FSDP2's full state dict; a callback's state is collected in between)."""

    def __init__(self, at_step: int, rank: int) -> None:
        self.at_step = at_step
        self.rank = rank
        self._trainer = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer
        if trainer.global_rank == self.rank == 0:
            replace = os.replace

            def kill_before_replacing(source, target, *args, **kwargs):
                if trainer.global_step == self.at_step and os.fspath(target).endswith(".ckpt"):
                    os.kill(os.getpid(), signal.SIGKILL)
                return replace(source, target, *args, **kwargs)

            os.replace = kill_before_replacing  # what ltcx.persist.files renames the written temp file with

    def state_dict(self) -> dict:
        trainer = self._trainer
        if trainer is not None and trainer.global_step == self.at_step and trainer.global_rank == self.rank != 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}
