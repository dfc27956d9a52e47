"""What a run prints around its steps: one line saying what trains and where its logs and checkpoints go (in place of
Lightning's model summary table, whose FLOPs column reads 0 for these models), and one at the end saying where the
results are. Lightning's lines that tell nothing on the machine at hand are left out.

Dropped: ``GPU available: False ...`` and ``TPU available: False ...`` (a line is kept when the device exists, and
Lightning's warning about a GPU left unused is a warning, not one of these), Lightning's advertisement for its
logging service, and the deprecation warning Lightning 2.6's ``_pytree`` helper triggers in torch 2.13 on every fit
(Lightning's code, not the user's: nothing they can change). Everything else Lightning says is kept.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["quiet_lightning", "print_run_start", "print_run_end", "shown"]

NOTHING_TO_SAY = ("GPU available: False", "TPU available: False", "HPU available: False", "💡 Tip:")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOTHING_TO_SAY)


def quiet_lightning() -> None:
    """Install the filters (idempotent)."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # rank_zero_info's logger
    if not any(isinstance(f, _DropLines) for f in logger.filters):
        logger.addFilter(_DropLines())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def shown(path: str) -> str:
    """``path`` relative to the working directory when it lies under it (Lightning makes checkpoint folders
    absolute)."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@rank_zero_only
def print_run_start(trainer, pl_module) -> None:
    """``ltcx: GPT, 28,758,912 parameters; logs lightning_logs/gpt/version_1, checkpoints checkpoints/gpt/version_1;
    resumed at step 20 of 40`` on stderr, as training starts."""
    backbone = getattr(pl_module, "backbone", pl_module)
    count = getattr(backbone, "parameter_count", None)
    parameters = count() if callable(count) else sum(p.numel() for p in backbone.parameters())
    parts = [f"{type(backbone).__name__}, {parameters:,} parameters"]
    where = []
    log_dir = _log_dir(trainer)
    if log_dir:
        where.append(f"logs {shown(log_dir)}")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "dirpath", None):
        where.append(f"checkpoints {shown(checkpoint.dirpath)}")
    if where:
        parts.append(", ".join(where))
    if trainer.global_step > 0:
        parts.append(f"resumed at step {trainer.global_step} of {trainer.max_steps}")
    print("ltcx: " + "; ".join(parts), file=sys.stderr, flush=True)


def _log_dir(trainer) -> str | None:
    """The first logger's folder, read from the logger: ``trainer.log_dir`` broadcasts from rank 0, a collective
    that would hang when called on one rank only."""
    log_dir = getattr(trainer.loggers[0], "log_dir", None) if trainer.loggers else None
    return log_dir if isinstance(log_dir, str) else None


def print_run_end(trainer) -> None:
    """Where the run's results are, as its last line (nanoGPT's "saving checkpoint to out")."""
    checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
        trainer.checkpoint_callback, "best_model_path", "")
    saved = f"checkpoint {shown(checkpoint)}" if checkpoint else "no checkpoint saved"
    log_dir, save_dir = _log_dir(trainer), getattr(trainer.loggers[0], "save_dir", None) if trainer.loggers else None
    logs = f"; logs {shown(log_dir)} (tensorboard --logdir {shown(save_dir)})" if log_dir and save_dir else ""
    if trainer.is_global_zero:
        print(f"ltcx: step {trainer.global_step}: {saved}{logs}", file=sys.stderr, flush=True)
