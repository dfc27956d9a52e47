"""Progress: Lightning's bars with the run's ``max_steps`` as their total and short metric names, and
``LineProgress``, plain lines for output that is not a terminal."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import callbacks as pl_callbacks

# What the bars show, by the name it is logged under: the short label and the format.
BAR_METRICS = {
    "train/loss": ("loss", "{:.3f}"), "val/loss": ("val", "{:.3f}"), "work/tokens_per_sec": ("tok/s", "{:.0f}"),
}


def _step_total(bar_class: type) -> type:
    """``bar_class`` whose training total is the run's batches up to ``max_steps`` (Lightning shows the steps left,
    2 after resuming at step 4 of 6, against a count that continues from the resumed step: "6/2"), titled "train"
    rather than "Epoch 0/-2" in a run counted in steps, with short metric names ("loss 3.214  val 3.305  tok/s 702",
    no ``v_num``) that fit an 80-column line beside the bar."""

    class StepProgressBar(bar_class):
        @property
        def total_train_batches(self) -> int | float:
            trainer = self.trainer
            if trainer.max_epochs == -1 and trainer.max_steps > 0:
                return trainer.max_steps * trainer.accumulate_grad_batches
            return super().total_train_batches

        def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's title
            if self.trainer.max_epochs == -1:
                return f"{'train':{len(self.validation_description)}}"
            return super()._get_train_description(current_epoch)

        def get_metrics(self, trainer, pl_module) -> dict:
            metrics = super().get_metrics(trainer, pl_module)
            metrics.pop("v_num", None)
            for name, (label, form) in BAR_METRICS.items():
                if name in metrics:
                    value = metrics.pop(name)
                    metrics[label] = form.format(float(value)) if isinstance(value, (int, float)) else value
            return metrics


    StepProgressBar.__qualname__ = StepProgressBar.__name__ = f"Step{bar_class.__name__}"
    return StepProgressBar




class StepRichProgressBar(_step_total(pl_callbacks.RichProgressBar)):
    def configure_columns(self, trainer) -> list:
        """Lightning's columns with a 10-character bar and without batches/s (tokens/s is among the metrics), so that
        the metrics fit beside them on an 80-column line."""
        from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn

        columns = [c for c in super().configure_columns(trainer) if not isinstance(c, ProcessingSpeedColumn)]
        for column in columns:
            if hasattr(column, "bar_width"):
                column.bar_width = 10
        return columns

StepTQDMProgressBar = _step_total(pl_callbacks.TQDMProgressBar)


class LineProgress(pl_callbacks.ProgressBar):
    """Progress as plain lines for output that is not a terminal (a file, a pipe, a job log), where a live bar
    prints nothing until the end or fills the file with redraws: one line every ``trainer.log_every_n_steps``
    optimizer steps and one after each validation, flushed at once.

        step 20/40 (50%)  train/loss 5.1234  work/tokens_per_sec 702.1  12.3 s
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._printed_step = -1
        self._start = time.perf_counter()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        self._printed_step = trainer.global_step

    def _line(self, trainer, pl_module, keys=None) -> str:
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        if keys is not None:
            metrics = {k: trainer.callback_metrics[k] for k in keys if k in trainer.callback_metrics}
        step, total = trainer.global_step, trainer.max_steps
        where = f"step {step}/{total} ({100 * step / total:.0f}%)" if total and total > 0 else f"step {step}"
        values = "  ".join(f"{k} {float(v):.4g}" for k, v in metrics.items() if isinstance(v, (int, float)) or (
            torch.is_tensor(v) and v.numel() == 1))
        return f"{where}  {values}  {time.perf_counter() - self._start:.1f} s".replace("   ", "  ")

    def _print_step(self, trainer, pl_module) -> None:
        # Called once the step's own hooks have logged everything (tokens/s is logged at its batch end).
        step, every = trainer.global_step, max(1, trainer.log_every_n_steps)
        if self._enabled and step != self._printed_step and step % every == 0:
            self._printed_step = step
            self.print(self._line(trainer, pl_module), flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._print_step(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._print_step(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._print_step(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._enabled and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.print(self._line(trainer, pl_module, keys=["val/loss", "val/ppl"]), flush=True)
