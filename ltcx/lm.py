"""LanguageModel: one LightningModule for every backbone that keeps the contract
``logits [B, T, V], state = backbone(idx [B, T], state=None)``."""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric

from ltcx.checkpoint import read_checkpoint
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.registry import class_path, resolve_backbone


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
    """Names of parameters with and without weight decay: matrices decay, vectors (norms, biases) do not,
    and a backbone may exempt more through ``no_weight_decay_param_names()``."""
    exempt = set(getattr(backbone, "no_weight_decay_param_names", lambda: set())())
    decay, no_decay = [], []
    for name, param in backbone.named_parameters():  # shared (tied) parameters are listed once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and name not in exempt else no_decay).append(name)
    return decay, no_decay


class LanguageModel(L.LightningModule):
    """Next-token language modelling around any backbone.

    Args:
        backbone: the sequence model (class_path + init_args in YAML); its vocab_size is set from the data.
        learning_rate: peak learning rate after warmup.
        min_lr: learning rate at the end of the cosine decay.
        warmup_steps: optimizer steps of linear warmup.
        decay_steps: optimizer step at which the cosine reaches min_lr; None = trainer.max_steps.
        weight_decay: AdamW weight decay of the matrices (not norms, biases or exempt parameters).
        betas: AdamW betas.
        eps: AdamW epsilon.
        compile: run the backbone through torch.compile (checkpoint keys stay those of the plain backbone).
    """

    def __init__(
        self,
        backbone: nn.Module,
        learning_rate: float = 6e-4,
        min_lr: float = 6e-5,
        warmup_steps: int = 1170,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        compile: bool = False,
    ) -> None:
        super().__init__()
        checks = [
            (0 < learning_rate < math.inf, "learning_rate", learning_rate, "must be a positive number"),
            (0 <= min_lr <= learning_rate, "min_lr", min_lr, f"must be in [0, model.learning_rate={learning_rate}]"),
            (warmup_steps >= 0, "warmup_steps", warmup_steps, "must be >= 0"),
            (decay_steps is None or decay_steps >= 1, "decay_steps", decay_steps, "must be >= 1 (null: max_steps)"),
        ]
        for ok, key, value, rule in checks:
            if not ok:
                raise ConfigError(f"model.{key} ({value}) {rule}: fix --model.{key}")
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone
        self.val_loss = MeanMetric()
        self.tokens_seen = 0
        self._last_step_time: float | None = None

    # -- model ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.hparams.compile and "_compiled_logits" not in self.__dict__:
            backbone = self.backbone

            def logits(idx: torch.Tensor) -> torch.Tensor:
                # Training and evaluation need the logits only. Returning the state too makes views (the KV
                # caches) outputs of the compiled graph, which torch 2.13's AOTAutograd cache rebuilds with
                # garbage shapes when a later run hits the cache.
                return backbone(idx)[0]

            # A plain __dict__ entry, outside the module tree, so state_dict keys stay "backbone.*".
            self.__dict__["_compiled_logits"] = torch.compile(logits)

    def forward(self, idx: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """idx [B, T] -> (logits [B, T, V], state); compiled (``compile: true``) for a call without a state,
        which then returns no state."""
        if state is None and "_compiled_logits" in self.__dict__:
            return self.__dict__["_compiled_logits"](idx), None
        return self.backbone(idx, state)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """batch [B, T+1] token blocks -> mean next-token cross-entropy over B*T predictions."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, _ = self(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # -- training ------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        data = getattr(self.trainer, "datamodule", None)
        context = getattr(self.backbone, "max_seq_len", None)
        block_size = getattr(data, "block_size", None)
        if context is not None and block_size is not None and block_size > context:
            raise LtcxError(
                f"data.block_size ({block_size}) exceeds the model's context ({context}): set "
                f"model.backbone.init_args.block_size to at least {block_size} or lower data.block_size"
            )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        step_tokens = (batch.shape[1] - 1) * batch.shape[0] * self.trainer.world_size
        self.tokens_seen += step_tokens
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tokens_per_sec", step_tokens / (now - self._last_step_time))
        self._last_step_time = now
        self.log("train/tokens_seen", float(self.tokens_seen))
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_validation_start(self) -> None:
        self._last_step_time = None  # time spent validating is not training throughput

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch), weight=batch.shape[0])

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss.compute()  # averaged over every rank's batches
        self.val_loss.reset()
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", torch.exp(val_loss))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test/loss", self.loss(batch), sync_dist=True, batch_size=batch.shape[0])

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Mean next-token loss of each block [B] (scores text; `ltcx predict` returns them)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, _ = self(inputs)
        losses = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # [B, T]
        return losses.mean(dim=1)

    def configure_optimizers(self):
        decay_names, no_decay_names = weight_decay_groups(self.backbone)
        params = dict(self.backbone.named_parameters())
        groups = [
            {"params": [params[n] for n in decay_names], "weight_decay": self.hparams.weight_decay},
            {"params": [params[n] for n in no_decay_names], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups,
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            eps=self.hparams.eps,
            fused=self.device.type == "cuda",
        )
        decay_steps = self.hparams.decay_steps
        if decay_steps is None:
            decay_steps = self.trainer.max_steps if self.trainer is not None else -1
            if decay_steps is None or decay_steps < 0:
                raise LtcxError("the learning-rate schedule needs an end: set trainer.max_steps or model.decay_steps")
        max_lr, min_lr, warmup = self.hparams.learning_rate, self.hparams.min_lr, self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_at_step(step, max_lr, min_lr, warmup, decay_steps) / max_lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ltcx"] = {
            "backbone_class": class_path(type(self.backbone)),
            "backbone_config": self.backbone.config_dict(),
            "tokenizer": getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None),
            "tokens_seen": self.tokens_seen,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("ltcx", {}).get("tokens_seen", 0)


def check_same_backbone(meta: dict, backbone: nn.Module, ckpt_path: str | Path) -> None:
    """Raise one line if the checkpoint's ``ltcx`` metadata describes another model than ``backbone``."""
    stored_class, stored = meta.get("backbone_class"), meta.get("backbone_config", {})
    configured_class, configured = class_path(type(backbone)), backbone.config_dict()
    if stored_class != configured_class:
        difference = f"it holds a {stored_class}, the config builds a {configured_class}"
    else:
        keys = [k for k in sorted(set(stored) | set(configured)) if stored.get(k) != configured.get(k)]
        if not keys:
            return
        difference = ", ".join(f"{k}: {stored.get(k)!r} in the file, {configured.get(k)!r} configured" for k in keys)
    raise LtcxError(
        f"checkpoint '{ckpt_path}' is of another model ({difference}): pass the config that trained it "
        "(saved next to its logs as config.yaml)"
    )


def load_language_model(ckpt_path: str | Path, map_location: str | torch.device = "cpu") -> tuple[LanguageModel, dict]:
    """Rebuild a LanguageModel and its backbone from a checkpoint written by ltcx.

    The file is read as data only (``weights_only=True``) and the backbone class is looked up in ltcx's
    registry (``ltcx.models.registry``), never imported from the string in the file. Returns the model in
    eval mode and the checkpoint's ``ltcx`` metadata (backbone class and config, tokenizer name).
    """
    checkpoint = read_checkpoint(ckpt_path, map_location=map_location)
    meta = checkpoint["ltcx"]
    backbone_class = resolve_backbone(meta.get("backbone_class"))
    config = meta.get("backbone_config")
    try:
        backbone = backbone_class(**config)
    except (TypeError, ValueError) as error:  # ConfigError is a ValueError
        raise LtcxError(f"checkpoint '{ckpt_path}' has an invalid backbone_config ({error})") from None
    accepted = set(inspect.signature(LanguageModel).parameters) - {"backbone"}
    hparams = {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if k in accepted}
    model = LanguageModel(backbone, **hparams)
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0][:200]
        raise LtcxError(
            f"checkpoint '{ckpt_path}': its weights do not match its backbone_config ({first}); the file is damaged"
        ) from None
    model.on_load_checkpoint(checkpoint)
    return model.eval(), meta
