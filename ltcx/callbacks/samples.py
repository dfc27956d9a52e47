"""``SampleGeneration``: completions of a few prompts after each validation, in every logger that holds text (else
``samples.txt`` in the run's log folder)."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

from ltcx.generation import generate_texts
from ltcx.sharding import is_sharded, unsharded_copy


class SampleGeneration(L.Callback):
    """After each validation (not the sanity check), complete the prompts and log the text with the step to every
    logger that holds text (TensorBoard, Weights & Biases, MLflow, Comet); with none such (CSVLogger, no logger)
    append it to ``samples.txt`` in the run's log folder.

    Runs on global rank 0 only (from a gathered copy of a model sharded by FSDP2); the model is put back in train
    mode afterwards. Data without a tokenizer (a recall task, ``RecallDataModule``) has no text to sample: the
    callback then says so once and does nothing.

    Args:
        prompts: texts to complete.
        max_new_tokens: tokens generated per prompt (capped so the longest prompt fits the model's context).
        temperature: sampling temperature (0 = greedy).
        top_k: sample among the k most likely tokens.
        seed: seed of the sampler, so samples at different steps are comparable.
    """

    def __init__(
        self,
        prompts: list[str] = ["Once upon a time"],  # noqa: B006 (a list for jsonargparse; copied, never mutated)
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 50,
        seed: int = 0,
    ) -> None:
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self._told_no_text = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.prompts:
            return
        backbone = pl_module.backbone
        if is_sharded(backbone):  # FSDP2: rank 0 samples from a gathered copy (every rank takes part in gathering it)
            backbone = unsharded_copy(backbone, pl_module.device)
        if not trainer.is_global_zero:
            return
        if not hasattr(trainer.datamodule, "tokenizer_obj"):
            if not self._told_no_text:
                print(f"ltcx: no sample generations: {type(trainer.datamodule).__name__} has no tokenizer (its tokens "
                      "are not text); remove SampleGeneration from the callbacks to silence this", file=sys.stderr)
                self._told_no_text = True
            return
        tokenizer = trainer.datamodule.tokenizer_obj
        budget = self.max_new_tokens
        context = backbone.max_seq_len
        if context is not None:  # every prompt must fit with its completion
            budget = min(budget, context - max(len(tokenizer.encode(p)) for p in self.prompts))
        was_training = backbone.training
        backbone.eval()
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        try:
            lines = generate_texts(
                backbone, tokenizer, self.prompts, max(budget, 0),
                temperature=self.temperature, top_k=self.top_k, generator=generator,
            )
        finally:
            backbone.train(was_training)
        step = trainer.global_step
        text = "\n\n---\n\n".join(lines)
        held = False
        for logger in trainer.loggers:
            held |= _log_text(logger, step, self.prompts, lines, text)
        if not held:  # no logger that holds text (CSVLogger, none): a plain file in the run's folder
            path = os.path.join(trainer.log_dir or trainer.default_root_dir, "samples.txt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"=== step {step}\n{text}\n\n")


def _log_text(logger, step: int, prompts: list[str], lines: list[str], text: str) -> bool:
    """Log the samples to ``logger`` if it can hold text (TensorBoard, Weights & Biases, MLflow, Comet); whether
    it did."""
    if hasattr(logger, "log_text"):  # Weights & Biases: a table of (step, prompt, sample)
        logger.log_text(key="samples", columns=["step", "prompt", "sample"],
                        data=[[step, p, t] for p, t in zip(prompts, lines)], step=step)
        return True
    experiment = getattr(logger, "experiment", None)
    if hasattr(experiment, "add_text"):  # TensorBoard
        # Two trailing spaces per line keep line breaks in TensorBoard's markdown view.
        experiment.add_text("samples", text.replace("\n", "  \n"), step)
        return True
    if hasattr(experiment, "log_text"):
        if getattr(logger, "run_id", None) is not None:  # MLflow: a text artifact per step
            experiment.log_text(logger.run_id, text, f"samples/step_{step:08d}.txt")
        else:  # Comet
            experiment.log_text(text, step=step)
        return True
    return False
