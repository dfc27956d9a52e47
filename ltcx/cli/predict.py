"""``ltcx predict``'s output: each block's mean loss to a CSV file in the run's log folder, and a summary line."""

from __future__ import annotations

import math
import os

import torch

__all__ = ["write_predictions"]


def write_predictions(trainer) -> None:
    """Each block's mean loss of ``trainer``'s finished predict loop to ``predictions.csv`` in the run's log folder
    (``predictions.rank<R>.csv`` per rank under DDP) and a one-line summary on stdout."""
    batches = trainer.predict_loop.predictions or []
    if batches and isinstance(batches[0], list):  # several dataloaders
        batches = [b for per_loader in batches for b in per_loader]
    losses = torch.cat([b.reshape(-1).float().cpu() for b in batches]) if batches else torch.zeros(0)
    folder = trainer.log_dir or trainer.default_root_dir
    name = "predictions.csv" if trainer.world_size == 1 else f"predictions.rank{trainer.global_rank}.csv"
    path = os.path.join(folder, name)
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write("block,loss\n" + "".join(f"{i},{v:.6f}\n" for i, v in enumerate(losses.tolist())))
    if not trainer.is_global_zero:
        return
    if len(losses) == 0:
        print(f"ltcx: predict: no blocks (empty validation stream); wrote {path}")
        return
    mean = float(losses.mean())
    tokens = getattr(trainer.datamodule, "block_size", None)
    per = f" of {tokens} tokens" if tokens else ""
    ranks = f" on rank 0 of {trainer.world_size}" if trainer.world_size > 1 else ""
    print(
        f"ltcx: predict: {len(losses)} blocks{per}{ranks}, mean loss {mean:.4f} "
        f"(ppl {math.exp(min(mean, 700)):.2f}), min {float(losses.min()):.4f}, max {float(losses.max()):.4f}; "
        f"each block's loss in {path}",
        flush=True,
    )
