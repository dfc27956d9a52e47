"""LanguageModel: one LightningModule for every ``Backbone`` (``ltcx/models/base.py``): the training, validation,
test and predict steps over the backbone's own fused loss, composed of the optimizer and schedule
(``ltcx/optim.py``), the evaluation scores (``ltcx/metrics.py``) and sampling (``ltcx/generation.py``).

A batch is a block or an ``(inputs, targets)`` pair (``ltcx.batches``): the loss covers the targets asked; a pair's
validation also logs ``val/recall_acc`` (argmax hits), and text's ``val/bpb`` from the data module's bytes per
token id. Loading a file is ``ltcx.persist``'s, handed the class to build."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from ltcx import optim
from ltcx.batches import IGNORE_INDEX, split_batch
from ltcx.errors import ConfigError, LtcxError
from ltcx.metrics import EvalScores, cross_entropy
from ltcx.models.base import Backbone
from ltcx.models.registry import class_path
from ltcx.sharding import shard_backbone, unsharded_class
from ltcx.throughput import loggers_write_now

__all__ = ["LanguageModel"]


class LanguageModel(L.LightningModule):
    """Next-token language modelling around any ``Backbone``.

    Args:
        backbone: the sequence model (class_path + init_args in YAML); its vocab_size is set from the data.
        learning_rate: peak learning rate after warmup.
        min_lr: learning rate at the end of the cosine decay.
        warmup_steps: optimizer steps of linear warmup.
        decay_steps: the step where the cosine reaches min_lr; None: trainer.max_steps (on resume: the checkpoint's).
        weight_decay: AdamW weight decay of the matrices (not norms, biases or exempt parameters).
        betas: AdamW betas.
        eps: AdamW epsilon.
        compile: true: compile the backbone in place (prefill and decoding stay eager); "reduce-overhead": the same
            with CUDA graphs on a CUDA device (Inductor's mode; static shapes); "ops": only the ops its
            ``compile_ops()`` names (Titans' memory), seconds of compiling where the whole backbone takes minutes.
    """

    def __init__(
        self,
        backbone: Backbone,
        learning_rate: float = 6e-4,
        min_lr: float = 6e-5,
        warmup_steps: int = 1170,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        compile: bool | Literal["ops", "reduce-overhead"] = False,
    ) -> None:
        super().__init__()
        if not isinstance(backbone, Backbone):
            raise ConfigError(f"model.backbone ({type(backbone).__name__}) must subclass ltcx.models.base.Backbone, "
                              "which holds the contract LanguageModel relies on (docs/architecture.md)")
        if compile == "ops" and not callable(getattr(backbone, "compile_ops", None)):
            raise ConfigError(f"model.compile ('ops'): {type(backbone).__name__} names no ops to compile (only "
                              "Titans does: its neural memory); use --model.compile true for the whole backbone")
        self.save_hyperparameters(ignore=["backbone"])
        if problem := self.setting_problem(dict(self.hparams)):
            raise ConfigError("model.{0} ({1}) {2}: fix --model.{0}".format(*problem))
        self.backbone = backbone
        self.val_scores, self.test_scores = EvalScores(), EvalScores()
        self._token_bytes: torch.Tensor | None = None  # [V] bytes per token id, from the data module (bpb)
        self.test_counts: dict[str, int] = {}  # the last test run's target tokens and bytes
        self.tokens_seen, self._last_step_time, self.start_step = 0, None, None  # start_step: set by on_train_start
        self.decay_steps: int | None = None  # the schedule's end, resolved in configure_optimizers
        self._checkpoint_decay_steps: int | None = None  # ... and as a resumed checkpoint had it
        self.saved_tokenizer: Any = None  # the tokenizer name of the file this model was loaded from
        self.last_validation: dict[str, float] | None = None  # the latest fit validation, kept in checkpoints

    @staticmethod
    def setting_problem(settings: dict[str, Any]) -> tuple[str, str, str] | None:
        """``optim.setting_problem`` over ``settings``, a missing one at its default here; a file's settings are
        asked too (``ltcx.persist``, a resumed checkpoint's), to name the file."""
        defaults = {n: p.default for n, p in inspect.signature(LanguageModel.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return optim.setting_problem({**defaults, **settings})

    def configure_model(self) -> None:
        """Under ``FSDP2Strategy`` (``configs/trainer/fsdp.yaml``) shard the backbone block by block over the
        data-parallel ranks; then compile it if asked."""
        mesh = self._device_mesh
        if mesh is not None:
            if mesh.ndim > 1 and mesh["tensor_parallel"].size() > 1:
                raise ConfigError(
                    f"tensor_parallel_size {mesh['tensor_parallel'].size()}: ltcx's backbones are sharded only over "
                    "data-parallel ranks; use ltcx.sharding.FSDP2Strategy (configs/trainer/fsdp.yaml)"
                )
            shard_backbone(
                self.backbone, mesh["data_parallel"] if mesh.ndim > 1 else mesh,
                activation_checkpointing=getattr(self.trainer.strategy, "activation_checkpointing", False),
            )
        if self.hparams.compile == "ops":
            self.backbone.compile_ops()
        elif self.hparams.compile:  # in place: the state_dict keys stay "backbone.*"
            self.backbone.compile(mode="reduce-overhead" if self.hparams.compile == "reduce-overhead" else None)

    def forward(self, idx: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """idx [B, T] -> (logits [B, T, V], state): the backbone's contract."""
        return self.backbone(idx, state)

    def loss(self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A batch (``split_batch``) -> mean cross-entropy (float32) over its asked targets, the head fused with the
        loss (``Backbone.forward`` with targets)."""
        inputs, targets = split_batch(batch)
        total, count = self.backbone(inputs, targets=targets)
        return (total / count).float()

    def loss_and_recall(
        self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(loss, correct [N] bool or None)``: for a pair batch that leaves positions out (a recall task), whether
        the argmax hit each of its N asked targets; None for a block."""
        inputs, targets = split_batch(batch)
        asked = targets != IGNORE_INDEX
        if isinstance(batch, torch.Tensor) or bool(asked.all()):
            return self.loss(batch), None
        logits, _ = self.backbone(inputs, with_state=False)
        return cross_entropy(logits, targets), logits.argmax(-1)[asked] == targets[asked]

    # -- training ------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        context = self.backbone.max_seq_len
        block_size = getattr(getattr(self.trainer, "datamodule", None), "block_size", None)
        if context is not None and block_size is not None and block_size > context:
            raise LtcxError(
                f"data.block_size ({block_size}) exceeds the model's context ({context}): set "
                f"model.backbone.init_args.block_size to at least {block_size} or lower data.block_size"
            )

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step  # the step this run started (or resumed) at
        configs = self.trainer.lr_scheduler_configs
        if type(self).configure_optimizers is LanguageModel.configure_optimizers and configs:
            # A resumed optimizer and scheduler hold the old run's settings: take this model's (a --model.* flag).
            hp = self.hparams
            optim.follow_settings(self.trainer.optimizers[0], configs[0].scheduler, hp.learning_rate,
                                  hp.weight_decay, hp.betas, hp.eps)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Counted here: callbacks' on_train_batch_end (checkpoints) run before this module's and must hold them.
        self.tokens_seen += split_batch(batch)[0].numel() * self.trainer.world_size

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if loggers_write_now(self.trainer):
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        last, self._last_step_time = self._last_step_time, now
        if not loggers_write_now(self.trainer):
            return
        step_tokens = split_batch(batch)[0].numel() * self.trainer.world_size
        # Rates under work/: TensorBoard sorts its groups, so train/ and val/ come first (the loss curves).
        if last is not None:
            self.log("work/tokens_per_sec", step_tokens / (now - last), prog_bar=True)
        self.log("work/tokens_seen", float(self.tokens_seen))
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("step", float(self.global_step))  # the x axis: optimizer steps done, as checkpoints and samples

    # -- evaluation ----------------------------------------------------------------------------
    def _data_token_bytes(self) -> torch.Tensor | None:
        """The data module's ``[V]`` bytes per token id (None: no bits per byte, e.g. MQAR)."""
        table = getattr(getattr(self.trainer, "datamodule", None), "token_bytes", None)
        return None if table is None else table.to(self.device)

    def on_validation_start(self) -> None:
        self._last_step_time = None  # time spent validating is not training throughput
        self._token_bytes = self._data_token_bytes()

    def _score(self, scores: EvalScores, batch: Any) -> None:
        loss, correct = self.loss_and_recall(batch)
        scores.update(loss, correct, split_batch(batch)[1], self._token_bytes)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._score(self.val_scores, batch)

    def on_validation_epoch_end(self) -> None:
        self.val_scores.log_to(self, "val", bpb=self._token_bytes is not None)
        if self.trainer.state.fn == "fit":  # validation after step N is drawn at N (Lightning's default: N - 1)
            self.log("step", float(self.global_step))
            if not self.trainer.sanity_checking:  # what an export's model card reports
                metrics = self.trainer.callback_metrics
                self.last_validation = {"step": self.global_step, **{
                    key: float(metrics[key]) for key in ("val/loss", "val/bpb", "val/recall_acc") if key in metrics}}

    def on_test_start(self) -> None:
        self._token_bytes = self._data_token_bytes()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._score(self.test_scores, batch)

    def on_test_epoch_end(self) -> None:
        self.test_counts = self.test_scores.log_to(self, "test", bpb=self._token_bytes is not None)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Mean loss over each block's targets [B] (`ltcx predict`): a row at a time, no [B, T, V] logits held."""
        inputs, targets = split_batch(batch)
        totals = torch.stack([self.backbone(inputs[i:i + 1], targets=targets[i:i + 1])[0]
                              for i in range(inputs.shape[0])]).float()
        return totals / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)  # 0 where nothing is asked

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = optim.adamw(self.backbone, hp.learning_rate, hp.weight_decay, hp.betas, hp.eps, self.device)
        self.decay_steps = self._schedule_end()
        # Reads self.decay_steps at each step: a checkpoint restored after this (FSDP) still sets the schedule's end.
        scheduler = optim.cosine_schedule(optimizer, hp.learning_rate, hp.min_lr, hp.warmup_steps,
                                          lambda: self.decay_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _schedule_end(self) -> int:
        max_steps = self.trainer.max_steps if self._trainer is not None else -1
        return optim.schedule_end(self.hparams.decay_steps, self._checkpoint_decay_steps, max_steps, self._notice)

    def _notice(self, text: str) -> None:
        if self._trainer is None or self.trainer.is_global_zero:
            print(f"ltcx: {text}", file=sys.stderr)

    # -- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt: str | list[str] | torch.Tensor,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 50,
        top_p: float | None = None,
        stop_at_eot: bool = True,
        tokenizer: Any = None,
        generator: torch.Generator | None = None,
    ) -> str | list[str] | torch.Tensor:
        """Continue ``prompt`` (text, a list of texts, or ids [B, T0]) by up to ``max_new_tokens`` tokens in eval
        mode, as ``ltcx generate`` does: ``ltcx.generation.continue_prompt`` (temperature 0 is greedy; top_k, top_p
        None keep every token), with ``tokenizer`` (a ``Tokenizer`` or a name; None: the one this model's file
        names, else the data module's) and ``generator`` (the random source; None: torch's global one)."""
        from ltcx.generation import continue_prompt

        known = (self.saved_tokenizer, getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None))
        was_training = self.training
        self.eval()
        try:
            return continue_prompt(self.backbone, prompt, max_new_tokens, tokenizer, *known, stop_at_eot,
                                   temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        finally:
            self.train(was_training)

    # -- files ---------------------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's usual call, in train mode: the model of an ``ltcx fit`` checkpoint or ``ltcx export`` folder,
        read as data and rebuilt through ltcx's registry (``ltcx.persist``); ``kwargs`` override its settings."""
        from ltcx.persist.load import load_language_model

        if hparams_file is not None:
            raise LtcxError("hparams_file is not used: an ltcx checkpoint carries its own configuration")
        model, _ = load_language_model(checkpoint_path, model_class=cls,
                                       map_location="cpu" if map_location is None else map_location)
        if kwargs:
            rebuilt = cls(model.backbone, **{**dict(model.hparams), **kwargs})
            rebuilt.tokens_seen, rebuilt.saved_tokenizer = model.tokens_seen, model.saved_tokenizer
            model = rebuilt
        return model.train()

    @classmethod
    def from_pretrained(cls, folder: str | Path, map_location: str | torch.device = "cpu") -> LanguageModel:
        """The model of an ``ltcx export`` folder (safetensors + config.json), in eval mode."""
        from ltcx.persist.load import load_exported

        return load_exported(folder, model_class=cls, map_location=map_location)[0]
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ltcx"] = {
            "backbone_class": class_path(unsharded_class(self.backbone)),
            "backbone_config": self.backbone.config_dict(),
            "tokenizer": getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None),
            "tokens_seen": self.tokens_seen,
            "decay_steps": self.decay_steps,  # the schedule's end as resolved, kept when the run is extended
            "validation": self.last_validation,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("ltcx", {})
        self.tokens_seen = meta.get("tokens_seen", 0)
        self.saved_tokenizer = meta.get("tokenizer")
        self.last_validation = meta.get("validation")
        self._checkpoint_decay_steps = meta.get("decay_steps")
        if self.decay_steps is not None and self._trainer is not None:  # optimizers already configured
            self.decay_steps = self._schedule_end()
