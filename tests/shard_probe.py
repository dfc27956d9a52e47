"""A callback for the sharded end-to-end tests: each rank writes how many parameter elements it holds to a JSON file."""

import json
import os

import lightning as L
from torch.distributed.tensor import DTensor


class RecordShards(L.Callback):
    """At the end of training, ``<out_dir>/rank<R>.json``: this rank's parameter elements (its shards under FSDP2)
    and the model's."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        params = list(pl_module.parameters())
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"held": held, "total": sum(p.numel() for p in params)}, f)
