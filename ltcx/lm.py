"""LanguageModel: one LightningModule for every backbone that keeps the contract
``logits [B, T, V], state = backbone(idx [B, T], state=None)``.

A batch is a block or an ``(inputs, targets)`` pair (``ltcx.batches``): the loss covers the targets asked, and a
pair's validation also logs ``val/recall_acc``, the fraction of them predicted exactly (argmax). Text validation and
test also log bits per byte (``val/bpb``, ``test/bpb``) from the bytes each token id decodes to, which the data
module hands over (``token_bytes``). Loading a file is
``ltcx.persist``'s, handed the class to build (``load_from_checkpoint``, ``from_pretrained``)."""

from __future__ import annotations

import functools
import inspect
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import register_fsdp_forward_method
from torchmetrics import MeanMetric, SumMetric

from ltcx.batches import IGNORE_INDEX, split_batch
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.registry import Backbone, class_path
from ltcx.ops.fused_loss import chunked_linear_cross_entropy
from ltcx.sharding import shard_backbone, unsharded_class
from ltcx.throughput import loggers_write_now

__all__ = ["LanguageModel", "lr_at_step", "weight_decay_groups", "IGNORE_INDEX", "split_batch"]


def lr_at_step(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to ``max_lr`` over
    ``warmup_steps`` steps, cosine decay to ``min_lr`` at ``decay_steps``, then constant ``min_lr``."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


class EvalScores(nn.Module):
    """One evaluation split's scores, over every rank's batches: the mean loss; the recall accuracy of pair batches
    that leave targets out; the target tokens; and, given the bytes per token id, the nats and the bytes for bits per
    byte (summed nats / ln 2 / the UTF-8 bytes the targets decode to). Metric states only: nothing in a state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.loss, self.recall_acc = MeanMetric(), MeanMetric()
        self.nats, self.tokens, self.bytes = (SumMetric().set_dtype(torch.float64) for _ in range(3))
        self.recall_scored = False

    def update(self, loss: torch.Tensor, correct: torch.Tensor | None, targets: torch.Tensor,
               token_bytes: torch.Tensor | None) -> None:
        """``loss``: the batch's mean over its asked targets ``[B, T]``; ``token_bytes``: ``[V]`` or None."""
        asked = targets != IGNORE_INDEX
        count = asked.sum()
        self.loss.update(loss, weight=targets.shape[0])
        self.tokens.update(count)
        if correct is not None:
            self.recall_acc.update(correct.float().mean(), weight=correct.numel())
            self.recall_scored = True
        if token_bytes is not None:
            self.nats.update(loss.double() * count)
            self.bytes.update(token_bytes[targets.clamp(min=0)].masked_fill(~asked, 0).sum())

    def log_to(self, module: L.LightningModule, prefix: str, bpb: bool) -> dict[str, int]:
        """Log ``{prefix}/loss``, ``/ppl``, ``/bpb`` (``bpb``), ``/recall_acc`` (pair batches) and reset; returns the
        tokens (and bytes) counted."""
        loss = self.loss.compute()
        module.log(f"{prefix}/loss", loss, prog_bar=prefix == "val")
        module.log(f"{prefix}/ppl", torch.exp(loss))
        counts = {"tokens": int(self.tokens.compute())}
        if bpb:
            total = self.bytes.compute()
            counts["bytes"] = int(total)
            if counts["bytes"] > 0:
                module.log(f"{prefix}/bpb", self.nats.compute() / math.log(2) / total)
        if self.recall_scored:  # every rank reads the same kind of batches: all of them take this branch
            module.log(f"{prefix}/recall_acc", self.recall_acc.compute(), prog_bar=prefix == "val")
        for metric in (self.loss, self.recall_acc, self.nats, self.tokens, self.bytes):
            metric.reset()
        self.recall_scored = False
        return counts


def hidden_states(backbone: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """idx [B, T] -> the backbone's final hidden states [B, T, C], for a loss: its state is discarded, so it is not
    computed (``forward_hidden(..., with_state=False)``)."""
    return backbone.forward_hidden(idx, with_state=False)[0]


def head_loss_sum(backbone: nn.Module, hidden: torch.Tensor,
                  targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., C] (``backbone.forward_hidden``'s), targets [...] -> (summed cross-entropy over the targets not
    ``IGNORE_INDEX``, their count), the backbone's ``output_head`` fused with the loss (``ltcx/ops/fused_loss.py``)."""
    head = backbone.output_head()
    return chunked_linear_cross_entropy(hidden.flatten(0, -2), head.weight, targets.flatten(), head.bias)


def fused_adamw(device: torch.device) -> bool:
    """Whether AdamW runs as torch's fused kernel on ``device``: one pass over every parameter instead of the
    foreach path's several (on a CPU at 16M parameters, a sixth of its time; the same update to rounding)."""
    return device.type in ("cpu", "cuda")


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
        compile: true: run the backbone through torch.compile (checkpoint keys stay those of the plain backbone);
            "ops": compile only the ops the backbone names for it, its ``compile_ops()`` (Titans: the neural memory's
            training calls), seconds of compiling where the whole backbone takes minutes on a CPU.
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
        compile: bool | Literal["ops"] = False,
    ) -> None:
        super().__init__()
        if compile == "ops" and not callable(getattr(backbone, "compile_ops", None)):
            raise ConfigError(f"model.compile ('ops'): {type(backbone).__name__} names no ops to compile (only "
                              "Titans does: its neural memory); use --model.compile true for the whole backbone")
        problem = self.setting_problem(dict(learning_rate=learning_rate, min_lr=min_lr, warmup_steps=warmup_steps,
                                       decay_steps=decay_steps, weight_decay=weight_decay, betas=betas, eps=eps))
        if problem:
            key, value, rule = problem
            raise ConfigError(f"model.{key} ({value}) {rule}: fix --model.{key}")
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone
        self.val_scores, self.test_scores = EvalScores(), EvalScores()
        self._token_bytes: torch.Tensor | None = None  # [V] bytes per token id, from the data module (bpb)
        self.test_counts: dict[str, int] = {}  # the last test run's target tokens and bytes
        self.tokens_seen = 0
        self._last_step_time: float | None = None
        self.start_step: int | None = None  # set when training starts
        self.decay_steps: int | None = None  # the schedule's end, resolved in configure_optimizers
        self._checkpoint_decay_steps: int | None = None  # ... and as a resumed checkpoint had it
        # The tokenizer name the checkpoint or export this model was loaded from holds: used by ``generate`` only
        # through ``stored_tokenizer_name`` (a file never chooses a folder of this machine).
        self.saved_tokenizer: Any = None
        self.last_validation: dict[str, float] | None = None  # the latest fit validation, kept in checkpoints

    @staticmethod
    def setting_problem(settings: dict[str, Any]) -> tuple[str, str, str] | None:
        """The first of the settings (learning_rate, min_lr, warmup_steps, decay_steps, weight_decay, betas, eps; one
        missing from ``settings`` is its default) that breaks its rule, as (name, value as a user types it, rule); None
        when all hold. AdamW would refuse some mid-start with a traceback and accept others (a negative weight decay);
        a file's settings are asked too (``ltcx.persist``, a resumed checkpoint's), to name the file."""
        defaults = {n: p.default for n, p in inspect.signature(LanguageModel.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        settings = {**defaults, **settings}
        lr, betas = settings["learning_rate"], settings["betas"]
        betas_ok = isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        checks = [
            (0 < lr < math.inf, "learning_rate", lr, "must be a positive number"),
            (0 <= settings["min_lr"] <= lr, "min_lr", settings["min_lr"], f"must be in [0, model.learning_rate={lr}]"),
            (settings["warmup_steps"] >= 0, "warmup_steps", settings["warmup_steps"], "must be >= 0"),
            (settings["decay_steps"] is None or settings["decay_steps"] >= 1, "decay_steps", settings["decay_steps"],
             "must be >= 1 (null: max_steps)"),
            (0 <= settings["weight_decay"] < math.inf, "weight_decay", settings["weight_decay"], "must be >= 0"),
            (betas_ok, "betas", betas, "must be two numbers in [0, 1), such as [0.9, 0.95]"),
            (0 < settings["eps"] < math.inf, "eps", settings["eps"], "must be a positive number, such as 1e-8"),
        ]
        for ok, key, value, rule in checks:
            if not ok:
                shown = "[" + ", ".join(str(v) for v in value) + "]" if isinstance(value, (list, tuple)) else str(value)
                return key, shown, rule
        return None

    # -- model ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (ltcx's ``FSDP2Strategy``, ``configs/trainer/fsdp.yaml``) the
        backbone is sharded block by block over the data-parallel ranks; then compiled if asked (``compile``)."""
        mesh = self._device_mesh
        if mesh is not None:
            if mesh.ndim > 1 and mesh["tensor_parallel"].size() > 1:
                raise ConfigError(
                    f"tensor_parallel_size {mesh['tensor_parallel'].size()}: ltcx's backbones are sharded only over "
                    "data-parallel ranks; use ltcx.sharding.FSDP2Strategy (configs/trainer/fsdp.yaml)"
                )
            strategy = self.trainer.strategy
            shard_backbone(
                self.backbone, mesh["data_parallel"] if mesh.ndim > 1 else mesh,
                activation_checkpointing=getattr(strategy, "activation_checkpointing", False),
            )
            if self._fuses_head() and "_sharded_loss_sum" not in self.__dict__:
                # FSDP gathers the root's parameters (the embedding, the tied head) only inside a method it wraps.
                backbone = self.backbone

                def ltcx_loss_sum(inputs: torch.Tensor, targets: torch.Tensor):
                    return head_loss_sum(backbone, hidden_states(backbone, inputs), targets)

                backbone.ltcx_loss_sum = ltcx_loss_sum
                register_fsdp_forward_method(backbone, "ltcx_loss_sum")
                self.__dict__["_sharded_loss_sum"] = backbone.ltcx_loss_sum
        if self.hparams.compile == "ops":
            self.backbone.compile_ops()
        elif self.hparams.compile and "_compiled_logits" not in self.__dict__:
            backbone = self.backbone

            def logits(idx: torch.Tensor) -> torch.Tensor:
                # Training and evaluation need the logits only. Returning the state too makes views (the KV
                # caches) outputs of the compiled graph, which torch 2.13's AOTAutograd cache rebuilds with
                # garbage shapes when a later run hits the cache.
                return backbone(idx)[0]

            # Plain __dict__ entries, outside the module tree, so state_dict keys stay "backbone.*".
            self.__dict__["_compiled_logits"] = torch.compile(logits)
            if self._fuses_head() and mesh is None:
                self.__dict__["_compiled_hidden"] = torch.compile(functools.partial(hidden_states, backbone))

    def forward(self, idx: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """idx [B, T] -> (logits [B, T, V], state); compiled (``compile: true``) for a call without a state,
        which then returns no state."""
        if state is None and "_compiled_logits" in self.__dict__:
            return self.__dict__["_compiled_logits"](idx), None
        return self.backbone(idx, state)

    def _fuses_head(self) -> bool:
        """Whether the loss runs the head and the cross-entropy together (``ltcx/ops/fused_loss.py``), never holding
        the ``[B, T, V]`` logits: a backbone with ``forward_hidden(idx, state=None, with_state=True)`` and
        ``output_head`` (every catalogue entry's; one added from outside may keep the bare contract)."""
        return callable(getattr(self.backbone, "forward_hidden", None)) and callable(
            getattr(self.backbone, "output_head", None))

    def _hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [B, T] -> the backbone's final hidden states [B, T, C] (compiled with ``compile: true``)."""
        compiled = self.__dict__.get("_compiled_hidden")
        return compiled(inputs) if compiled is not None else hidden_states(self.backbone, inputs)

    def _fused_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs, targets [B, T] -> (summed cross-entropy over the targets not ``IGNORE_INDEX``, their count)."""
        sharded = self.__dict__.get("_sharded_loss_sum")
        if sharded is not None:
            return sharded(inputs, targets)
        return head_loss_sum(self.backbone, self._hidden(inputs), targets)

    def loss(self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A batch (``split_batch``) -> mean cross-entropy over its targets (B*T for a block; the asked ones for a
        pair), through the fused head where the backbone allows (``_fuses_head``)."""
        inputs, targets = split_batch(batch)
        if self._fuses_head():
            total, count = self._fused_loss_sum(inputs, targets)
            return (total / count).float()
        return self._cross_entropy(self(inputs)[0], targets)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits [B, T, V], targets [B, T] -> mean cross-entropy (float32) over the targets not ``IGNORE_INDEX``."""
        logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)

    def loss_and_recall(
        self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(loss, correct [N] bool or None)`` for evaluation: ``correct`` says for each of the N asked targets of a
        pair batch whose targets leave positions out (a recall task) whether the argmax hit it; None for a block
        (training calls ``loss``, which waits for nothing on a GPU)."""
        inputs, targets = split_batch(batch)
        asked = targets != IGNORE_INDEX
        if isinstance(batch, torch.Tensor) or bool(asked.all()):
            return self.loss(batch), None
        logits, _ = self(inputs)
        return self._cross_entropy(logits, targets), logits.argmax(-1)[asked] == targets[asked]

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

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Counted here: callbacks' on_train_batch_end (a ModelCheckpoint's every_n_train_steps, Preemption's) run
        # before this module's and save this step, whose tokens their checkpoint must hold.
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
        # The rates go under work/: TensorBoard lays its groups out alphabetically, and train/ and val/ first make
        # its first view the loss curves (docs/training.md).
        if last is not None:
            self.log("work/tokens_per_sec", step_tokens / (now - last), prog_bar=True)
        self.log("work/tokens_seen", float(self.tokens_seen))
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("step", float(self.global_step))  # the x axis: optimizer steps done, as checkpoints and samples

    def _data_token_bytes(self) -> torch.Tensor | None:
        """The data module's ``[V]`` bytes per token id on this device (None: no bits per byte, e.g. MQAR)."""
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
        """Mean loss over each block's targets [B] (scores text; `ltcx predict` returns them)."""
        inputs, targets = split_batch(batch)
        if self._fuses_head() and "_sharded_loss_sum" not in self.__dict__:
            hidden = self._hidden(inputs)
            losses = torch.stack([head_loss_sum(self.backbone, h, t)[0] for h, t in zip(hidden, targets)]).float()
        else:
            logits, _ = self(inputs)
            losses = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none",
                                     ignore_index=IGNORE_INDEX).sum(dim=1)  # 0 where nothing is asked
        return losses / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)

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
            fused=fused_adamw(self.device),
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
        """Continue ``prompt`` with up to ``max_new_tokens`` tokens, as ``ltcx generate`` does (the same defaults
        and sampling loop, ``ltcx.generation``: the prompt fed once, then one token a step with the backbone's state).

        prompt: text (a str -> a str; a list of str -> a list of str, each the prompt followed by its completion,
            cut before the end-of-text token), or token ids [B, T0] (a LongTensor -> ids [B, T0 + n], n <=
            max_new_tokens; rows that stopped earlier are padded with the end-of-text id).
        temperature: 0 is greedy. top_k, top_p: None keeps every token.
        stop_at_eot: stop a row at the tokenizer's end-of-text token (for ids: only when a tokenizer is known).
        tokenizer: a ``Tokenizer`` or a name for ``get_tokenizer`` (gpt2, bytes, a Hugging Face id or folder);
            None: the one this model's checkpoint or export names (only gpt2, bytes or a hub id), else the one of
            the data module it trains with. Text needs one; ids use it to stop at end-of-text and to keep to the
            tokenizer's ids in a padded vocabulary.
        generator: the random source of sampling (None: torch's global one).

        Runs in eval mode (dropout off) and restores the model's mode after.
        """
        from ltcx.generation import generate, generate_texts

        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        was_training = self.training
        self.eval()
        try:
            if isinstance(prompt, torch.Tensor):
                if prompt.dim() != 2 or prompt.dtype != torch.long:
                    raise LtcxError(f"prompt ids must be a LongTensor [B, T], not {prompt.dtype} of shape "
                                    f"{list(prompt.shape)}: use ids[None] for one sequence")
                found = self._generation_tokenizer(tokenizer, required=False)
                device = next(self.backbone.parameters()).device
                return generate(
                    self.backbone, prompt.to(device), max_new_tokens,
                    stop_token=found.eot_id if found is not None and stop_at_eot else None,
                    vocab_limit=found.vocab_size if found is not None else None, **sampling,
                )
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or not all(isinstance(text, str) for text in texts):
                raise LtcxError("prompt must be a str, a non-empty list of str or a LongTensor of ids [B, T]")
            found = self._generation_tokenizer(tokenizer, required=True)
            completed = generate_texts(self.backbone, found, texts, max_new_tokens, stop_at_eot, **sampling)
            return completed[0] if isinstance(prompt, str) else completed
        finally:
            self.train(was_training)

    def _generation_tokenizer(self, tokenizer: Any, required: bool):
        """The tokenizer ``generate`` uses (see there), checked against the model's vocabulary; None when none is
        known and ``required`` is false."""
        from ltcx.tokenizers import get_tokenizer, stored_tokenizer_name, vocab_fits

        if tokenizer is None and self.saved_tokenizer is not None:
            tokenizer = stored_tokenizer_name(
                self.saved_tokenizer, "the file this model was loaded from names tokenizer",
                "ltcx loads no tokenizer folder a file names; if you trust it, pass generate(..., tokenizer=FOLDER)",
            )
        if tokenizer is None and self._trainer is not None:
            tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is None:
            if required:
                raise LtcxError("generate() from text needs a tokenizer and this model knows none (it was not loaded "
                                "from an ltcx checkpoint or export): pass tokenizer='gpt2' (the one it was trained "
                                "with)")
            return None
        if isinstance(tokenizer, str):
            tokenizer = get_tokenizer(tokenizer)
        model_vocab = getattr(getattr(self.backbone, "config", None), "vocab_size", None)
        if model_vocab is not None and not vocab_fits(tokenizer.vocab_size, model_vocab):
            raise LtcxError(f"tokenizer {tokenizer.name!r} ({tokenizer.vocab_size} ids) does not fit the model's "
                            f"vocabulary of {model_vocab}: pass the tokenizer it was trained with")
        return tokenizer

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's usual call: the model of a checkpoint written by ``ltcx fit`` (or a folder written by
        ``ltcx export``), read as data and rebuilt through ltcx's backbone registry (``load_language_model``) as an
        instance of this class (a subclass's call returns the subclass); ``kwargs`` override saved hyper-parameters.
        In train mode, as Lightning returns it."""
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
        """The model of a folder written by ``ltcx export`` (weights-only safetensors + config.json), an instance of
        this class, in eval mode."""
        from ltcx.persist.load import load_exported

        return load_exported(folder, model_class=cls, map_location=map_location)[0]

    # -- checkpoints ---------------------------------------------------------------------------
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
