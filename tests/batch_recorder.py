"""A callback for the end-to-end tests: each rank writes the training blocks it saw to a JSON file."""

import json
import os

import lightning as L


class RecordBatches(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.blocks: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch  # a recall task's (inputs, targets)
        self.blocks.extend(inputs.tolist())

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.blocks, f)
