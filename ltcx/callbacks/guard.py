"""``FiniteLossGuard``: stop as soon as the training loss, the weights or the validation loss is NaN or infinite,
every DDP rank at the same step."""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from ltcx.ddp import launcher_outlives_workers
from ltcx.errors import StoppedOnAllRanks

FIX = "lower model.learning_rate, raise model.warmup_steps or set trainer.gradient_clip_val"


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``parameter``: its shard under FSDP2 (a DTensor), else the tensor itself."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


class FiniteLossGuard(L.Callback):
    """Stop training with a clear message as soon as the training loss, the weights or the validation loss is NaN
    or infinite.

    The training loss is checked before the backward pass, so the optimizer never steps on it and the weights stay
    those of the last good step. A finite loss can still give a non-finite update (a learning rate far too high): the
    weights are checked after each optimizer step (each tensor's min and max), before anything saves or validates
    them; and the validation loss at the end of each validation, before ``SampleGeneration`` samples from the model
    or ``ModelCheckpoint`` saves it. ``SafeCheckpointIO`` refuses to write non-finite weights in any case. Under DDP
    the ranks' losses and weight checks are gathered first (one scalar per rank and step), so every rank stops at the
    same step; the validation loss is already averaged over the ranks.
    """

    def __init__(self) -> None:
        self._checked_step = -1  # the optimizer step whose weights were checked last
        self._named: list[tuple[str, torch.Tensor]] | None = None  # the non-empty parameters, listed at train start

    def setup(self, trainer, pl_module, stage: str) -> None:
        # First among the callbacks: its validation check runs before SampleGeneration's and every other
        # on_validation_end, whatever the order of the config's callbacks (ModelCheckpoint is last in any case).
        if trainer.callbacks and trainer.callbacks[0] is not self:
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)

    def on_train_start(self, trainer, pl_module) -> None:
        # Listed once rather than walking the modules at every step. The strategy
        # has set the parameters up by now (FSDP2's DTensors) and the optimizer updates them in place.
        self._named = [(name, p) for name, p in pl_module.named_parameters() if _local(p).numel()]

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        losses = self._gather(trainer, loss.detach().float().reshape(1))
        bad = [(rank, value) for rank, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            self._stop(trainer, f"training loss became {bad[0][1]}", bad, trainer.global_step + 1,
                       "before updating the weights")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._checked_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._checked_step = trainer.global_step
        # Under FSDP2 each rank checks its own shards (the gather below joins them); a rank's shard can be empty.
        named = [(name, _local(p).detach()) for name, p in self._named]
        # Each tensor's min and max are NaN or inf exactly when it holds one (a sum or a norm can overflow first);
        # on a CPU one aminmax per tensor is cheaper than torch._foreach_norm(..., inf), and one stack of all of
        # them (promoted to one dtype) cheaper than a stack per tensor.
        extremes = torch.stack([x for _, p in named for x in torch.aminmax(p)] or list(torch.zeros(2))).view(-1, 2)
        broken = ~torch.isfinite(extremes).all(dim=1)
        counts = self._gather(trainer, broken.sum().float().reshape(1))
        bad = [(rank, count) for rank, count in enumerate(counts) if count]
        if not bad:
            return
        names = [name for (name, _), b in zip(named, broken.tolist()) if b]
        which = f" ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''})" if names else ""
        self._stop(trainer, f"weights became non-finite{which}", bad, trainer.global_step,
                   "before saving or validating them")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":  # nothing samples or saves after a sanity check
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not math.isfinite(float(loss)):
            # Averaged over the ranks: every rank has the same value and stops here with the same message.
            where = f" (averaged over the {trainer.world_size} ranks)" if trainer.world_size > 1 else ""
            self._stop(trainer, f"validation loss{where} became {float(loss)}", [], trainer.global_step,
                       "before sampling from or saving the model")

    @staticmethod
    def _gather(trainer, value: torch.Tensor) -> list[float]:
        """``value`` (one scalar) of every rank, in rank order: all-gathered under DDP."""
        if trainer.world_size > 1:
            value = trainer.strategy.all_gather(value).reshape(-1)
        return value.tolist()

    @staticmethod
    def _stop(trainer, what: str, bad: list[tuple[int, float]], step: int, before: str) -> None:
        if trainer.world_size == 1:
            where, stopped = "", "training stopped"
        else:
            ranks = f" on rank {', '.join(str(rank) for rank, _ in bad)} of {trainer.world_size}" if bad else ""
            where, stopped = ranks, "every rank stopped"
            launcher_outlives_workers(trainer)
        raise StoppedOnAllRanks(
            f"{what}{where} at step {step}, so {stopped} {before} (the last checkpoint is the last good one); {FIX}"
        )
