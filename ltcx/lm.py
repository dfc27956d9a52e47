"""LanguageModel: one LightningModule for every backbone that keeps the contract
``logits [B, T, V], state = backbone(idx [B, T], state=None)``."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric

from ltcx.checkpoint import (
    ANOTHER_VERSION,
    check_weights_fit,
    checkpoint_in_folder,
    read_checkpoint,
    unknown_settings,
)
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.registry import Backbone, class_path, resolve_backbone


def lr_at_step(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``max_lr`` over
    ``warmup_steps`` steps, cosine decay to ``min_lr`` at ``decay_steps``, then constant ``min_lr``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


# Backbone fields that leave the weights' meaning alone, so a resumed run may change them (``--model.backbone.
# init_args.dropout 0.1 --ckpt_path ...``); every other field is the architecture and must match the checkpoint. A
# backbone class may name its own as ``resumable_fields``.
RESUMABLE_BACKBONE_FIELDS = frozenset({"dropout"})


def resumable_fields(backbone_class: type) -> frozenset[str]:
    """The fields of ``backbone_class`` a resumed run may change: its ``resumable_fields``, else dropout."""
    return frozenset(getattr(backbone_class, "resumable_fields", RESUMABLE_BACKBONE_FIELDS))


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
        decay_steps: optimizer step at which the cosine reaches min_lr; None = trainer.max_steps (on resume: the
            checkpoint's end, so a longer max_steps continues at min_lr).
        weight_decay: AdamW weight decay of the matrices (not norms, biases or exempt parameters).
        betas: AdamW betas.
        eps: AdamW epsilon.
        compile: run the backbone through torch.compile (checkpoint keys stay those of the plain backbone).
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
        self.start_step: int | None = None  # set when training starts
        self.decay_steps: int | None = None  # the schedule's end, resolved in configure_optimizers
        self._checkpoint_decay_steps: int | None = None  # ... and as a resumed checkpoint had it

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

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step  # the step this run started (or resumed) at
        self._follow_hparams_after_restore()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        step_tokens = (batch.shape[1] - 1) * batch.shape[0] * self.trainer.world_size
        self.tokens_seen += step_tokens
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tokens_per_sec", step_tokens / (now - self._last_step_time), prog_bar=True)
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
            {"params": [params[n] for n in names], "weight_decay": decay}
            for names, decay in zip((decay_names, no_decay_names), self._group_weight_decays())
        ]
        optimizer = torch.optim.AdamW(
            groups,
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            eps=self.hparams.eps,
            fused=self.device.type == "cuda",
        )
        self.decay_steps = self._schedule_end()
        max_lr, min_lr, warmup = self.hparams.learning_rate, self.hparams.min_lr, self.hparams.warmup_steps
        # Reads self.decay_steps at each step: a checkpoint restored after this (FSDP) still sets the schedule's end.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_at_step(step, max_lr, min_lr, warmup, self.decay_steps) / max_lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _group_weight_decays(self) -> tuple[float, float]:
        """Weight decay of the optimizer's two parameter groups: the matrices', then the rest's."""
        return self.hparams.weight_decay, 0.0

    def _follow_hparams_after_restore(self) -> None:
        """Lightning restores a resumed optimizer and scheduler from their state dicts, hyper-parameters included
        (each group's lr, initial_lr, weight_decay, betas, eps; the scheduler's base_lrs), after
        ``configure_optimizers``: set those back to this model's, which a ``--model.*`` flag typed on resume may have
        changed, keeping the restored moments and step counts. The next step's rate is the schedule's at the
        scheduler's step, as ``LambdaLR`` computes it (so a run resumed unchanged continues exactly)."""
        if type(self).configure_optimizers is not LanguageModel.configure_optimizers or not self.trainer.optimizers:
            return  # a subclass's own optimizer: its own business
        optimizer, configs = self.trainer.optimizers[0], self.trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or len(optimizer.param_groups) != 2:
            return
        max_lr = self.hparams.learning_rate
        scheduler.base_lrs = [max_lr] * len(optimizer.param_groups)
        rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, decay, lr in zip(optimizer.param_groups, self._group_weight_decays(), rates):
            group.update(initial_lr=max_lr, weight_decay=decay, betas=tuple(self.hparams.betas), eps=self.hparams.eps)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        scheduler._last_lr = rates

    def _schedule_end(self) -> int:
        """The step where the cosine ends: ``model.decay_steps``, else the resumed checkpoint's own end (so making
        ``trainer.max_steps`` longer extends the run at min_lr instead of re-deriving the schedule and jumping the
        learning rate back up), else ``trainer.max_steps``."""
        explicit, stored = self.hparams.decay_steps, self._checkpoint_decay_steps
        max_steps = self.trainer.max_steps if self._trainer is not None else -1
        if explicit is not None:
            if stored is not None and stored != explicit:
                self._notice(f"model.decay_steps {explicit} replaces the checkpoint's learning-rate schedule end "
                             f"({stored})")
            return explicit
        if stored is not None:
            if max_steps != stored:
                self._notice(
                    f"resuming with the checkpoint's learning-rate schedule (cosine to min_lr ends at step {stored}, "
                    f"not at trainer.max_steps {max_steps}); pass --model.decay_steps N to change it"
                )
            return stored
        if max_steps is None or max_steps < 0:
            raise LtcxError("the learning-rate schedule needs an end: set trainer.max_steps or model.decay_steps")
        return max_steps

    def _notice(self, text: str) -> None:
        if self._trainer is None or self.trainer.is_global_zero:
            print(f"ltcx: {text}", file=sys.stderr)

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's usual call: the model of a checkpoint written by ``ltcx fit`` (or a folder written by
        ``ltcx export``), read as data and rebuilt through ltcx's backbone registry (``load_language_model``);
        ``kwargs`` override saved hyper-parameters. In train mode, as Lightning returns it."""
        if hparams_file is not None:
            raise LtcxError("hparams_file is not used: an ltcx checkpoint carries its own configuration")
        model, _ = load_language_model(checkpoint_path, map_location="cpu" if map_location is None else map_location)
        if kwargs:
            rebuilt = cls(model.backbone, **{**dict(model.hparams), **kwargs})
            rebuilt.tokens_seen = model.tokens_seen
            model = rebuilt
        return model.train()

    @classmethod
    def from_pretrained(cls, folder: str | Path, map_location: str | torch.device = "cpu") -> LanguageModel:
        """The model of a folder written by ``ltcx export`` (weights-only safetensors + config.json), in eval mode."""
        return load_exported(folder, map_location=map_location)[0]

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ltcx"] = {
            "backbone_class": class_path(type(self.backbone)),
            "backbone_config": self.backbone.config_dict(),
            "tokenizer": getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None),
            "tokens_seen": self.tokens_seen,
            "decay_steps": self.decay_steps,  # the schedule's end as resolved, kept when the run is extended
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get("ltcx", {})
        self.tokens_seen = meta.get("tokens_seen", 0)
        self._checkpoint_decay_steps = meta.get("decay_steps")
        if self.decay_steps is not None and self._trainer is not None:  # optimizers already configured
            self.decay_steps = self._schedule_end()


_MISSING = object()


def _constructor_defaults(backbone_class: type) -> dict:
    """The backbone constructor's default for each argument that has one."""
    try:
        parameters = inspect.signature(backbone_class).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def check_same_backbone(meta: dict, backbone: nn.Module, ckpt_path: str | Path) -> None:
    """Raise one line if the checkpoint's ``ltcx`` metadata describes another model than ``backbone`` (fields in
    ``resumable_fields``, dropout, may differ)."""
    stored_class, stored = meta.get("backbone_class"), meta.get("backbone_config", {})
    configured_class, configured = class_path(type(backbone)), backbone.config_dict()
    fix = "pass the config that trained it (saved next to its logs as config.yaml)"
    if stored_class != configured_class:
        difference = f"it holds a {stored_class}, the config builds a {configured_class}"
    else:
        resumable = set(resumable_fields(type(backbone)))
        # A setting added after the file was written is absent from it; at its default it builds the older model.
        defaults = _constructor_defaults(type(backbone))
        keys = [
            k for k in sorted(set(stored) | set(configured))
            if k not in resumable and stored.get(k, defaults.get(k, _MISSING)) != configured.get(k, _MISSING)
        ]
        if not keys:
            return

        def one(k: str) -> str:
            if k in stored:
                file = f"{stored[k]!r} in the file"
            else:
                file = f"{defaults[k]!r} (the default) in the file" if k in defaults else "not in the file"
            here = f"{configured[k]!r} configured" if k in configured else "not a setting of this version"
            return f"{k}: {file}, {here}"

        difference = ", ".join(one(k) for k in keys)
        if any((k not in stored and k not in defaults) or k not in configured for k in keys):  # no config builds it
            fix = f"it was saved by another version of ltcx: {ANOTHER_VERSION}"
    raise LtcxError(f"checkpoint '{ckpt_path}' is of another model ({difference}): {fix}")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (read from a file) is of the annotated type ``hint``; a type not known here counts as fitting
    (its constructor checks it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    if hint in (int, float):  # a bool is no number here; an int is a float
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint in (bool, str, type(None)):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    """``hint`` as a reader of a config file says it: 'an integer or null', 'a list [a number, a number]'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list [{', '.join(_describe(a) for a in args)}]"
    if origin in (tuple, list):
        return f"a list of {_describe(args[0])}s" if args else "a list"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def check_setting_types(values: Any, accepted: type, source: str, prefix: str) -> None:
    """One ``LtcxError`` line for the first of ``values`` (settings read from ``source``) that is not of the type the
    class ``accepted`` annotates it with, named ``prefix`` + its name: a constructor would fail on it with a
    TypeError, or later, mid-run."""
    if not isinstance(values, dict):
        raise LtcxError(f"{source} has {prefix.rstrip('.')} {values!r:.80}, not a mapping of settings: use another one")
    try:
        hints = typing.get_type_hints(accepted.__init__)
    except Exception:  # noqa: BLE001 - annotations this version can not resolve: the constructor checks
        return
    for name, value in values.items():
        if name in hints and not _fits(value, hints[name]):
            raise LtcxError(f"{source} has {prefix}{name} {value!r:.80}, which is not {_describe(hints[name])}: fix it "
                            "in the file or use another one")


def _build(meta: dict, hyper_parameters: Any, source: str, prefixes: tuple[str, str]) -> LanguageModel:
    """A LanguageModel around the backbone that ``meta`` names (through the registry) and configures; ``prefixes``
    name the file's hyper-parameters and backbone settings in a message."""
    backbone_class = resolve_backbone(meta.get("backbone_class"))
    config = meta.get("backbone_config")
    unknown = unknown_settings(config, backbone_class) if isinstance(config, dict) else []
    if unknown:
        raise LtcxError(
            f"{source} has backbone_config {', '.join(unknown)}, which this version's {backbone_class.__name__} does "
            f"not take: it was saved by another version of ltcx: {ANOTHER_VERSION}"
        )
    check_setting_types(config, backbone_class, source, prefixes[1])
    try:
        backbone = backbone_class(**config)
    except (TypeError, ValueError) as error:  # ConfigError is a ValueError
        raise LtcxError(f"{source} has an invalid backbone_config ({error})") from None
    check_setting_types(hyper_parameters, LanguageModel, source, prefixes[0])
    accepted = set(inspect.signature(LanguageModel).parameters) - {"backbone"}
    return LanguageModel(backbone, **{k: v for k, v in hyper_parameters.items() if k in accepted})


def _damaged(source: str, error: Exception) -> LtcxError:
    """A file whose weights were read but could not be loaded for another reason than names and shapes
    (``check_weights_fit`` answers those first)."""
    first = str(error).strip().splitlines()[0][:200]
    return LtcxError(f"{source}: its weights could not be loaded ({first}); the file is damaged")


def _one_name_per_tensor(state_dict: dict[str, torch.Tensor], present) -> dict[str, torch.Tensor]:
    """``state_dict`` with tied weights (one tensor under several names) under one name: one ``present`` in the
    file if any (safetensors stores a shared tensor once, under any of its names), else the first."""
    groups: dict[tuple, list[str]] = {}
    for name, value in state_dict.items():
        key = (value.data_ptr(), tuple(value.shape), value.stride()) if value.numel() else ("empty", name)
        groups.setdefault(key, []).append(name)
    kept = {}
    for names in groups.values():
        name = next((n for n in names if n in present), names[0])
        kept[name] = state_dict[name]
    return kept


def load_language_model(ckpt_path: str | Path, map_location: str | torch.device = "cpu") -> tuple[LanguageModel, dict]:
    """Rebuild a LanguageModel and its backbone from a checkpoint written by ltcx, a folder written by
    ``ltcx export`` (``load_exported``), or a checkpoint folder (the latest run's ``version_N/last.ckpt``).

    The file is read as data only (``weights_only=True``) and the backbone class is looked up in ltcx's
    registry (``ltcx.models.registry``), never imported from the string in the file. Returns the model in
    eval mode and the checkpoint's ``ltcx`` metadata (backbone class and config, tokenizer name).
    """
    if os.path.isdir(ckpt_path):
        if os.path.isfile(os.path.join(ckpt_path, EXPORT_CONFIG)):
            return load_exported(ckpt_path, map_location=map_location)
        ckpt_path = checkpoint_in_folder(ckpt_path)
    checkpoint = read_checkpoint(ckpt_path, map_location=map_location)
    meta = {**checkpoint["ltcx"], "global_step": checkpoint.get("global_step")}
    model = _build(meta, checkpoint.get("hyper_parameters", {}), f"checkpoint '{ckpt_path}'",
                   ("model.", "model.backbone.init_args."))
    stored = checkpoint.get("state_dict")
    check_weights_fit(f"checkpoint '{ckpt_path}'", stored if isinstance(stored, dict) else {}, model.state_dict())
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, RuntimeError) as error:
        raise _damaged(f"checkpoint '{ckpt_path}'", error) from None
    model.on_load_checkpoint(checkpoint)
    return model.eval(), meta


# -- weights-only export ----------------------------------------------------------------------------------------

EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_FORMAT = "config.json", "model.safetensors", "ltcx-export-1"


def export_model(ckpt_path: str | Path, out: str | Path, tokenizer: str | None = None) -> Path:
    """Write the model of a checkpoint to a new folder ``out`` without pickles: ``model.safetensors`` (the
    backbone's weights) and ``config.json`` (backbone class path and config, tokenizer name, hyper-parameters,
    step). ``load_exported(out)`` rebuilds it. The folder appears whole or not at all.

    tokenizer: the name to record instead of the checkpoint's. Either must be one a reader of the export may load on
    the file's word (``stored_tokenizer_name``: gpt2, bytes or a Hugging Face hub id), never a folder."""
    from safetensors.torch import save_model

    from ltcx.tokenizers import stored_tokenizer_name

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LtcxError(f"'{out}' already exists and is not an empty folder: pass --out a new folder")
    model, meta = load_language_model(ckpt_path)
    # Whoever reads the export loads the name on the file's word (``ltcx generate``).
    only = "an export names only gpt2, bytes or a Hugging Face hub id"
    if tokenizer is not None:
        tokenizer = stored_tokenizer_name(tokenizer, "--tokenizer", only)
    else:
        tokenizer = stored_tokenizer_name(
            meta.get("tokenizer"), f"checkpoint '{ckpt_path}' names tokenizer",
            f"{only}: pass --tokenizer with the tokenizer's hub id",
        )
    config = {
        "format": EXPORT_FORMAT,
        "backbone_class": meta["backbone_class"],
        "backbone_config": meta["backbone_config"],
        "tokenizer": tokenizer,
        "tokens_seen": meta.get("tokens_seen", 0),
        "hyper_parameters": {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.hparams.items()},
    }
    if meta.get("global_step") is not None:
        config["global_step"] = meta["global_step"]
    try:
        json.dumps(config)
    except TypeError as error:
        raise LtcxError(f"checkpoint '{ckpt_path}' holds a config that is not plain data ({error})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        temp.mkdir()
        save_model(model.backbone, str(temp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        config["weights_sha256"] = _file_sha256(temp / EXPORT_WEIGHTS)  # checked by load_exported
        (temp / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(temp, out)
    except OSError as error:
        raise LtcxError(f"cannot write '{out}' ({error.strerror or error}); nothing was written") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()


def load_exported(folder: str | Path, map_location: str | torch.device = "cpu") -> tuple[LanguageModel, dict]:
    """Rebuild a LanguageModel from a folder written by ``export_model`` / ``ltcx export``: ``config.json`` is read
    as data and names the backbone class, looked up in ltcx's registry; ``model.safetensors`` holds only tensors.
    Returns the model in eval mode and its metadata (backbone class and config, tokenizer name)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    folder = Path(folder)
    source = f"exported model '{folder}'"
    try:
        config = json.loads((folder / EXPORT_CONFIG).read_text())
    except FileNotFoundError:
        raise LtcxError(f"'{folder}' has no {EXPORT_CONFIG}: pass a folder written by `ltcx export`") from None
    except (OSError, ValueError) as error:
        raise LtcxError(f"{source}: {EXPORT_CONFIG} could not be read ({error})") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise LtcxError(f"{source}: {EXPORT_CONFIG} was not written by `ltcx export` (format {EXPORT_FORMAT})")
    model = _build(config, config.get("hyper_parameters", {}), source,
                   (f"{EXPORT_CONFIG}'s hyper_parameters.", f"{EXPORT_CONFIG}'s backbone_config."))
    weights = folder / EXPORT_WEIGHTS
    if not weights.is_file():
        raise LtcxError(f"{source} has no {EXPORT_WEIGHTS}: export it again")
    expected = config.get("weights_sha256")
    if expected is None:
        print(f"ltcx: {source} has no weights_sha256 in {EXPORT_CONFIG} (exported by an earlier ltcx), so its "
              f"{EXPORT_WEIGHTS} could not be checked for damage", file=sys.stderr)
    elif _file_sha256(weights) != expected:
        raise LtcxError(f"{source} is damaged: its {EXPORT_WEIGHTS} does not match the SHA-256 in its {EXPORT_CONFIG} "
                        "(bytes changed on disk or in transfer); export it again from its checkpoint")
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {name: f.get_slice(name).get_shape() for name in f.keys()}
    except Exception as error:  # noqa: BLE001 - not a safetensors file (truncated, overwritten): one line
        raise _damaged(source, error) from None
    check_weights_fit(source, stored, _one_name_per_tensor(model.backbone.state_dict(), stored))
    try:
        load_model(model.backbone, str(weights), strict=True, device=str(torch.device(map_location)))
    except Exception as error:  # noqa: BLE001 - a damaged file or weights of another config: one line
        raise _damaged(source, error) from None
    model.tokens_seen = config.get("tokens_seen", 0)
    meta = {k: config.get(k) for k in ("backbone_class", "backbone_config", "tokenizer", "tokens_seen", "global_step")}
    return model.eval(), meta
