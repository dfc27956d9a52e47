"""The optimizer and its schedule: AdamW over two parameter groups (matrices decay; vectors and a backbone's exempt
matrices do not) and a linear warmup into a cosine decay, as the LTC paper trains. ``LanguageModel`` composes
these; resuming goes through the optimizer's and scheduler's public state only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["adamw", "cosine_schedule", "follow_settings", "lr_at_step", "schedule_end", "setting_problem",
           "weight_decay_groups"]


def lr_at_step(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``max_lr`` over
    ``warmup_steps`` steps, cosine decay to ``min_lr`` at ``decay_steps``, then constant ``min_lr``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def weight_decay_groups(backbone: nn.Module) -> tuple[list[str], list[str]]:
    """Names of parameters with and without weight decay: matrices decay, vectors (norms, biases) do not, and
    neither do the backbone's ``no_weight_decay_param_names()``."""
    exempt = set(backbone.no_weight_decay_param_names())
    decay, no_decay = [], []
    for name, param in backbone.named_parameters():  # shared (tied) parameters are listed once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and name not in exempt else no_decay).append(name)
    return decay, no_decay


def adamw(backbone: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
          device: torch.device) -> torch.optim.AdamW:
    """AdamW over the two groups of ``weight_decay_groups`` (decayed by ``weight_decay``, then by 0), as torch's
    fused kernel on a CPU or a CUDA device (one pass over the parameters, not the foreach path's several)."""
    params = dict(backbone.named_parameters())
    groups = [{"params": [params[n] for n in names], "weight_decay": decay}
              for names, decay in zip(weight_decay_groups(backbone), (weight_decay, 0.0))]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=device.type in ("cpu", "cuda"))


def cosine_schedule(optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, warmup_steps: int,
                    end: Callable[[], int]) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_at_step`` as a scheduler stepped once per optimizer step; ``end()`` gives the cosine's end when a step's
    rate is computed, so a checkpoint restored after this (FSDP) can still set it."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at_step(step, max_lr, min_lr, warmup_steps, end()) / max_lr)


def follow_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, max_lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """After a resumed optimizer and scheduler were restored from their state dicts (which hold the old run's
    hyper-parameters), set the settings back to the ones given, which a ``--model.*`` flag may have changed, keeping
    the moments and step counts: each group's lr (the schedule's at the scheduler's step), initial_lr, weight decay
    (the matrices', then 0), betas and eps, and the scheduler's base rates."""
    state = scheduler.state_dict()
    state["base_lrs"] = [max_lr] * len(optimizer.param_groups)
    scheduler.load_state_dict(state)
    rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, decay, lr in zip(optimizer.param_groups, (weight_decay, 0.0), rates):
        group.update(initial_lr=max_lr, weight_decay=decay, betas=tuple(betas), eps=eps)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def schedule_end(explicit: int | None, stored: int | None, max_steps: int | None,
                 notice: Callable[[str], None]) -> int:
    """The step where the cosine ends: ``explicit`` (``model.decay_steps``), else ``stored`` (a resumed checkpoint's
    own end, so a longer ``trainer.max_steps`` extends the run at min_lr instead of re-deriving the schedule and
    jumping the rate back up), else ``max_steps``. ``notice`` tells the user when a choice overrides another."""
    if explicit is not None:
        if stored is not None and stored != explicit:
            notice(f"model.decay_steps {explicit} replaces the checkpoint's learning-rate schedule end ({stored})")
        return explicit
    if stored is not None:
        if max_steps != stored:
            notice(f"resuming with the checkpoint's learning-rate schedule (cosine to min_lr ends at step {stored}, "
                   f"not at trainer.max_steps {max_steps}); pass --model.decay_steps N to change it")
        return stored
    if max_steps is None or max_steps < 0:
        from ltcx.errors import LtcxError

        raise LtcxError("the learning-rate schedule needs an end: set trainer.max_steps or model.decay_steps")
    return max_steps


def setting_problem(settings: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first of the optimizer's settings (learning_rate, min_lr, warmup_steps, decay_steps, weight_decay, betas,
    eps; all present) that breaks its rule, as (name, value as a user types it, rule); None when all hold. AdamW
    would refuse some mid-start with a traceback and accept others (a negative weight decay)."""
    lr, betas = settings["learning_rate"], settings["betas"]
    betas_ok = isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    checks = [
        (0 < lr < math.inf, "learning_rate", lr, "must be a positive number"),
        (0 <= settings["min_lr"] <= lr, "min_lr", settings["min_lr"], f"must be in [0, model.learning_rate={lr}]"),
        (settings["warmup_steps"] >= 0, "warmup_steps", settings["warmup_steps"], "must be >= 0"),
        (settings["decay_steps"] is None or settings["decay_steps"] >= 1, "decay_steps", settings["decay_steps"],
         "must be >= 1 (null: max_steps)"),
        (0 <= settings["weight_decay"] < math.inf, "weight_decay", settings["weight_decay"], "must be >= 0"),
        (betas_ok, "betas", betas, "must be two numbers in [0, 1), such as [0.9, 0.95]"),
        (0 < settings["eps"] < math.inf, "eps", settings["eps"], "must be a positive number, such as 1e-8"),
    ]
    for ok, key, value, rule in checks:
        if not ok:
            shown = "[" + ", ".join(str(v) for v in value) + "]" if isinstance(value, (list, tuple)) else str(value)
            return key, shown, rule
    return None
