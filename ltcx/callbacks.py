"""Callbacks: sample generations in TensorBoard and a guard against non-finite losses."""

from __future__ import annotations

import math

import lightning as L
import torch

from ltcx.errors import LtcxError
from ltcx.generation import generate_texts


class SampleGeneration(L.Callback):
    """After each validation (not the sanity check), complete the prompts and log the text with the step.

    Runs on global rank 0 only; the model is put back in train mode afterwards.

    Args:
        prompts: texts to complete.
        max_new_tokens: tokens generated per prompt (capped so the longest prompt fits the model's context).
        temperature: sampling temperature (0 = greedy).
        top_k: sample among the k most likely tokens.
        seed: seed of the sampler, so samples at different steps are comparable.
    """

    def __init__(
        self,
        prompts: list[str] = ["Once upon a time"],
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

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or not self.prompts:
            return
        tokenizer = trainer.datamodule.tokenizer_obj
        backbone = pl_module.backbone
        budget = self.max_new_tokens
        context = getattr(backbone, "max_seq_len", None)
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
        text = "\n\n---\n\n".join(lines)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                # Two trailing spaces per line keep line breaks in TensorBoard's markdown view.
                experiment.add_text("samples", text.replace("\n", "  \n"), trainer.global_step)


class FiniteLossGuard(L.Callback):
    """Stop training with a clear message as soon as the training loss is NaN or infinite."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not math.isfinite(float(loss)):
            raise LtcxError(
                f"training loss became {float(loss)} at step {trainer.global_step}; lower "
                "model.learning_rate, raise model.warmup_steps or set trainer.gradient_clip_val"
            )
