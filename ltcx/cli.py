"""Command line: LightningCLI (fit, validate, test, predict) plus ``generate``.

    ltcx fit --config configs/gpt.yaml
    ltcx generate --ckpt_path checkpoints/gpt/version_0/last.ckpt --prompt "Once upon a time"
    ltcx export --ckpt_path checkpoints/gpt/version_0/last.ckpt --out gpt-tinystories/
    ltcx prepare --source my_corpus/ --out data/my_corpus      # token shards, then --data.path data/my_corpus
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import sys
from typing import Optional

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ltcx.callbacks import LineProgress, StepRichProgressBar, StepTQDMProgressBar, _launcher_outlives_workers
from ltcx.callbacks.preemption import Preemption
from ltcx.checkpoint import (
    ANOTHER_VERSION,
    SafeCheckpointIO,
    check_weights_fit,
    checkpoint_in_folder,
    latest_last_checkpoint,
    read_checkpoint,
    unknown_settings,
)
from ltcx.data import TextDataModule
from ltcx.errors import ConfigError, LtcxError, StoppedOnAllRanks
from ltcx.lm import LanguageModel, check_same_backbone, check_setting_types, resumable_fields
from ltcx.models.catalog import architecture_name
from ltcx.models.registry import resolve_backbone

DESCRIPTION = (
    "ltcx: train and evaluate language models (`ltcx generate --help` samples from a checkpoint, `ltcx export --help` "
    "writes a weights-only copy, `ltcx prepare --help` makes token shards)"
)


# How gloo and NCCL report a collective whose peer process is gone (its sockets closed: it exited, crashed or was
# killed).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError",
             "remote process exited")


class LtcxArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one ``LtcxError`` line instead of its usage (~75 lines) and message.

    jsonargparse calls ``error`` on the parser that failed, the subcommand's own (``fit``) included: that parser
    inherits ``exit_on_error`` from the main one. The parsers jsonargparse makes inside for a class's arguments have
    ``exit_on_error=False``: their errors are caught and reported by the parser above, so they stay as they are."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        raise LtcxError(f"{_one_line(message)}; see `{prog} --help`") from ex

    def parse_path(self, path, *args, **kwargs):
        try:
            return super().parse_path(path, *args, **kwargs)
        except UnicodeDecodeError:  # jsonargparse reads it as text: a traceback
            raise LtcxError(f"--config '{path}' is not a YAML text file (its bytes are not UTF-8 text): pass the "
                            "path of a YAML config") from None
        except LtcxError as error:  # from error(): jsonargparse's YAML message does not name the file
            problem = getattr(error.__cause__, "__cause__", None)
            if not isinstance(problem, yaml.YAMLError):
                raise
            mark = getattr(problem, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            reason = getattr(problem, "problem", None) or str(problem).splitlines()[0]
            raise LtcxError(f"--config '{path}' is not valid YAML ({reason}{where}): fix the file") from None


def _one_line(message: str) -> str:
    """jsonargparse's message on one line: ``Parser key "k":`` becomes ``--k:``, followed by the first reason, the
    types a union accepts and the value given; the rest (each union member's own error) is left out."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid arguments"
    key = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[0])
    if key is None:
        return lines[0]
    rest = ([key.group(2)] if key.group(2) else []) + lines[1:]
    text = f"--{key.group(1)}: {rest[0] if rest else 'invalid value'}"
    for line in rest[1:]:
        if line.startswith("Subtypes: "):
            text += f" (accepted: {line[len('Subtypes: '):]})"
        elif line.startswith("Given value: ") and "Got value" not in text:
            text += f" (given: {line[len('Given value: '):]})"
    return re.sub(r"<class '([\w.]+)'>", r"\1", text).replace("typing.", "")


class LtcxCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's vocabulary always matches the data's tokenizer: nobody keeps vocab_size by hand.
        parser.link_arguments("data.padded_vocab_size", "model.backbone.init_args.vocab_size", apply_on="instantiate")
        parser.add_argument(
            "--num_threads", type=Optional[int], default=None,
            help="torch threads per process (null: OMP_NUM_THREADS if set, else one per usable core, divided among "
            "the processes of DDP on a CPU)",
        )

    def parse_arguments(self, parser, args) -> None:
        # The command line as given, to tell a flag the user typed from a value a YAML file set.
        self._command_line = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        super().parse_arguments(parser, args)
        self._name_after_architecture()

    def _name_after_architecture(self) -> None:
        """A null logger ``name`` becomes the architecture's catalogue name (else its class name, lower case) and a
        null ``ModelCheckpoint`` ``dirpath`` ``checkpoints/<that name>``: configs/recipe.yaml leaves both null."""
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        backbone = config.get("model", {}).get("backbone")
        if not isinstance(backbone, Namespace) or not isinstance(backbone.get("class_path"), str):
            return
        init_args = backbone.get("init_args")
        init_args = init_args.as_dict() if isinstance(init_args, Namespace) else {}
        arch = architecture_name(backbone.class_path, init_args) or backbone.class_path.rsplit(".", 1)[-1].lower()
        for item, key, value in (("logger", "name", arch), ("callbacks", "dirpath", f"checkpoints/{arch}")):
            specs = config.trainer.get(item)
            for spec in specs if isinstance(specs, list) else [specs]:
                init_args = spec.get("init_args") if isinstance(spec, Namespace) else None
                if isinstance(init_args, Namespace) and key in init_args and init_args[key] is None:
                    init_args[key] = value

    def _on_command_line(self, key: str) -> bool:
        """Whether ``--key`` (``--key value`` or ``--key=value``) was typed on the command line."""
        flag = f"--{key}"
        return any(arg == flag or arg.startswith(flag + "=") for arg in getattr(self, "_command_line", []))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        precision = str(config.trainer.precision)
        accelerator = str(config.trainer.accelerator)
        on_cpu = accelerator == "cpu" or (accelerator in ("auto", "cuda", "gpu") and not torch.cuda.is_available())
        if "bf16" in precision and on_cpu and not self._on_command_line("trainer.precision"):
            # The same YAML trains in bf16 on a GPU and in float32 on a CPU, where bf16 is emulated and many
            # times slower on most processors; a bf16 typed on the command line is kept.
            reason = "training on the CPU" if accelerator == "cpu" else "no CUDA device"
            print(
                f"ltcx: {reason}, so trainer.precision {precision} -> 32-true "
                f"(pass --trainer.precision {precision} to keep it)",
                file=sys.stderr,
            )
            config.trainer.precision = "32-true"
        _set_cpu_threads(config.get("num_threads"), config.trainer, on_cpu)
        max_steps = config.trainer.max_steps
        if max_steps is not None and max_steps < -1:
            raise ConfigError(f"trainer.max_steps ({max_steps}) must be >= -1 (-1: no limit): fix --trainer.max_steps")

    def _typed_model_keys(self) -> set[str]:
        """The ``model.*`` keys typed on the command line (``--model.KEY value`` or ``--model.KEY=value``), without
        ``model.`` and ``init_args.``: ``learning_rate``, ``backbone.dropout``, ``backbone`` (the whole backbone)."""
        keys = set()
        for arg in getattr(self, "_command_line", []):
            if isinstance(arg, str) and arg.startswith("--model."):
                parts = [p for p in arg[len("--model."):].split("=", 1)[0].split(".") if p != "init_args"]
                if parts and parts[-1] != "help":
                    keys.add(".".join(parts))
        return keys

    def _parse_ckpt_path(self) -> None:
        """Where Lightning reads the ``--ckpt_path`` hyperparameters into the config, ltcx first resolves folders and
        ``last`` and reads the file once through ``read_checkpoint``: a bad file is one line before anything is built
        or written, and the trainer is later handed this same copy. Then the checkpoint's model configuration
        (``hyper_parameters`` and its backbone's config) replaces the YAML's, except the ``--model.*`` flags typed on
        the command line, which win (``_checkpoint_model_config``)."""
        self._checkpoint = None
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        _resolve_under_root(config.trainer)
        if config.get("ckpt_path") == "last":
            config.ckpt_path = _find_last_checkpoint(config.trainer)
        elif isinstance(config.get("ckpt_path"), str) and os.path.isdir(config.ckpt_path):
            config.ckpt_path = checkpoint_in_folder(config.ckpt_path)  # a checkpoint folder: its latest run's
        if config.get("ckpt_path") in (None, "last"):
            return
        self._checkpoint = read_checkpoint(config.ckpt_path)
        model = self._checkpoint_model_config(config, notices=subcommand == "fit")
        if model:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def _checkpoint_model_config(self, config, notices: bool) -> dict:
        """The part of the checkpoint's model configuration that replaces ``config.model``.

        A ``--model.*`` flag typed on the command line wins over the checkpoint (on ``fit``, a notice line when its
        value differs); every other value (a YAML's or a default) is the checkpoint's, so resuming continues the
        run that was saved (on ``fit``, a notice line names each YAML value left out, but for a null: not set). A
        typed backbone field that would change the architecture (the class, or any field but
        ``resumable_fields``: dropout) is one error line before anything is built; an untyped backbone of another
        class is left to ``check_same_backbone``. (A YAML does not win: it is usually the architecture's own
        config, whose values a first run's typed flags changed.)
        """
        typed, path = self._typed_model_keys(), config.ckpt_path
        stored = {
            k: v for k, v in self._checkpoint.get("hyper_parameters", {}).items()
            if k not in ("_instantiator", "_class_path", "backbone")
        }
        unknown = unknown_settings(stored, self.model_class)
        if unknown:  # jsonargparse would print its usage and "does not accept option"
            raise LtcxError(
                f"checkpoint '{path}' has hyper-parameter(s) {', '.join(f'model.{k}' for k in unknown)}, which this "
                f"version of ltcx does not have: it was saved by another version of ltcx: {ANOTHER_VERSION}"
            )
        check_setting_types(stored, self.model_class, f"checkpoint '{path}'", "model.")  # else jsonargparse's usage
        model = {}
        for key, value in stored.items():
            current = config.model.get(key) if key in config.model else value
            if key not in typed:
                model[key] = value
                if notices and current is not None and not _same(current, value):  # null: not set, no choice
                    _notice(f"resuming with the checkpoint's model.{key} {_show(value)}, not {_show(current)} from the "
                            f"config (type --model.{key} {_show(current)} to change it)")
            elif notices and key != "decay_steps" and not _same(current, value):  # decay_steps: LanguageModel's notice
                _notice(f"resuming with model.{key} {_show(current)} (the checkpoint has {_show(value)})")
        backbone = self._checkpoint_backbone(config.model.get("backbone"), typed, path, notices)
        if backbone:
            model["backbone"] = backbone
        return model

    def _checkpoint_backbone(self, backbone, typed: set[str], path: str, notices: bool) -> dict | None:
        """The checkpoint's backbone fields that replace the configured ones (``class_path`` + ``init_args``)."""
        meta = self._checkpoint["ltcx"]
        stored_class, stored = meta.get("backbone_class"), meta.get("backbone_config")
        if backbone is None or not isinstance(stored, dict) or not isinstance(stored_class, str):
            return None
        whole = "backbone" in typed  # the whole backbone typed (--model.backbone ...): every field counts as typed
        if backbone.class_path != stored_class:
            if whole or "backbone.class_path" in typed:
                raise LtcxError(
                    f"--model.backbone {backbone.class_path} is another architecture than checkpoint '{path}' (a "
                    f"{stored_class}), whose weights can not be resumed into it: drop the flag to resume the "
                    "checkpoint, or start a new run without --ckpt_path"
                )
            return None  # an architecture YAML of another class: check_same_backbone names both once it is built
        check_setting_types(stored, resolve_backbone(stored_class), f"checkpoint '{path}'", "model.backbone.init_args.")
        resumable = resumable_fields(resolve_backbone(stored_class))
        init_args = backbone.get("init_args") or {}
        taken = {}
        for key, value in stored.items():
            if key not in init_args:  # vocab_size: linked from the data's tokenizer
                continue
            current = init_args[key]
            if not (whole or f"backbone.{key}" in typed):
                taken[key] = value
                if notices and current is not None and not _same(current, value):
                    _notice(f"resuming with the checkpoint's model.backbone.init_args.{key} {_show(value)}, not "
                            f"{_show(current)} from the config")
            elif _same(current, value):
                continue
            elif key not in resumable:
                raise LtcxError(
                    f"--model.backbone.init_args.{key} {_show(current)} would change the architecture of "
                    f"checkpoint '{path}' (it has {key} {_show(value)}), whose weights can not be resumed into it: "
                    "drop the flag to resume the checkpoint, or start a new run without --ckpt_path"
                )
            elif notices:
                _notice(f"resuming with model.backbone.init_args.{key} {_show(current)} (the checkpoint has "
                        f"{_show(value)})")
        return {"class_path": stored_class, "init_args": taken} if taken else None

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        if not any(isinstance(c, Preemption) for c in callbacks):  # SIGTERM / Ctrl-C save the step in every run
            kwargs["callbacks"] = callbacks = [*callbacks, Preemption()]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            # Lightning would add its own bar, whose total is wrong after a resume; output to a file or a pipe gets
            # plain lines every log_every_n_steps instead of a bar that shows nothing there until the end.
            if not sys.stdout.isatty():
                bar = LineProgress()
            else:
                bar = StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
            kwargs["callbacks"] = [*callbacks, bar]
        trainer = super().instantiate_trainer(**kwargs)
        # Log folders this run creates (a folder named by an explicit logger version may hold an earlier run's logs).
        folders = (getattr(logger, "log_dir", None) for logger in trainer.loggers)
        self._new_log_folders = [f for f in folders if isinstance(f, str) and not os.path.exists(f)]
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; keep a user's own
            trainer.strategy.checkpoint_io = SafeCheckpointIO()
        return trainer

    def _check_ckpt_path(self) -> None:
        """``--ckpt_path`` must hold the configured model, its weights of the names and shapes this version of
        ltcx builds from that config; checked before anything is written."""
        if self._checkpoint is None:
            return
        ckpt_path = self.config_init[self.subcommand].ckpt_path
        check_same_backbone(self._checkpoint["ltcx"], self.model.backbone, ckpt_path)
        if getattr(self.model, "strict_loading", True):  # the same config, yet weights of other names or shapes
            stored = self._checkpoint.get("state_dict")
            check_weights_fit(f"checkpoint '{ckpt_path}'", stored if isinstance(stored, dict) else {},
                              self.model.state_dict())
        checkpoint_io = self.trainer.strategy.checkpoint_io
        if isinstance(checkpoint_io, SafeCheckpointIO):
            checkpoint_io.hand_over(ckpt_path, self._checkpoint)
        self._checkpoint = None  # the trainer holds it now (or reads it again through its own CheckpointIO)

    before_fit = before_validate = before_test = before_predict = _check_ckpt_path

    def after_predict(self) -> None:
        """``predict`` from the command line: each block's mean loss to ``predictions.csv`` in the run's log folder
        (``predictions.rank<R>.csv`` per rank under DDP) and a one-line summary on stdout."""
        trainer = self.trainer
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

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            if subcommand == "fit" and self._nothing_to_train():
                return
            super()._run_subcommand(subcommand)
        except LtcxError:
            self._remove_empty_log_folders()
            raise
        except RuntimeError as error:  # torch.distributed.DistBackendError is one
            trainer = getattr(self, "trainer", None)
            if trainer is None or trainer.world_size < 2 or not any(s in str(error) for s in PEER_LOST):
                raise
            raise self._peer_stopped(trainer, subcommand) from None

    @staticmethod
    def _peer_stopped(trainer, subcommand: str) -> LtcxError:
        """This rank's collective found a peer process gone (gloo / NCCL name its address, not its rank: with two
        ranks it is the other one). The launching process waits for the others rather than being killed by
        Lightning's observer mid-message."""
        _launcher_outlives_workers(trainer)
        rank, size, step = trainer.global_rank, trainer.world_size, trainer.global_step
        then = ", then resume with --ckpt_path last" if subcommand == "fit" else ""
        if size == 2:
            return LtcxError(f"rank {1 - rank} of 2 stopped (it exited, crashed or was killed) at step {step}; this "
                             f"rank ({rank}) stops too: see rank {1 - rank}'s own output{then}")
        return LtcxError(f"another rank of this {size}-rank run stopped (it exited, crashed or was killed) at step "
                         f"{step}; this rank ({rank}) stops too: see the other ranks' output{then}")

    def _nothing_to_train(self) -> bool:
        """``fit --ckpt_path`` of a checkpoint at or past ``trainer.max_steps``: Lightning would start and stop at once,
        exit 0 and leave an empty log folder. A finished run asked to resume is not an error (scripts/compare.py
        resumes a finished run whose results it has not written yet): one notice, exit 0, nothing written."""
        step = (self._checkpoint or {}).get("global_step")
        max_steps = self.trainer.max_steps
        if not isinstance(step, int) or max_steps is None or max_steps < 0 or step < max_steps:
            return False
        self._check_ckpt_path()  # before_fit's check, which this skips: a checkpoint of another model is an error
        _notice(f"checkpoint '{self.config_init.fit.ckpt_path}' is at step {step}, at or past trainer.max_steps "
                f"{max_steps}: nothing to train; raise --trainer.max_steps to continue")
        return True

    def _remove_empty_log_folders(self) -> None:
        """A run that stopped on a user error before training a step leaves no ``version_N`` log folder holding
        only its config and an empty event file (its checkpoint folder is only made by a save)."""
        trainer = getattr(self, "trainer", None)
        start = getattr(getattr(self, "model", None), "start_step", None)
        if trainer is None or not trainer.is_global_zero or (start is not None and trainer.global_step > start):
            return
        for folder in getattr(self, "_new_log_folders", []):
            if not os.path.isdir(folder):
                continue
            names = os.listdir(folder)
            if all(n in ("config.yaml", "hparams.yaml") or n.startswith("events.out.tfevents.") for n in names):
                shutil.rmtree(folder, ignore_errors=True)
                for parent in (os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))):
                    try:  # <save_dir>/<name>, then <save_dir>, if this run made them and left them empty
                        os.rmdir(parent)
                    except OSError:
                        break


def _same(a, b) -> bool:
    """Equal as configuration values: tuples and lists alike (betas), 1 == 1.0."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(value) -> str:
    """A configuration value as a user would type it: 0.0001, [0.9, 0.95], null, true."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _notice(text: str) -> None:
    """One ``ltcx:`` line on stderr, from the first process only (DDP's launcher runs the CLI in each)."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        print(f"ltcx: {text}", file=sys.stderr)


def _set_cpu_threads(num_threads: int | None, trainer_config, on_cpu: bool) -> None:
    """Threads of torch's CPU ops: ``--num_threads N``, else ``OMP_NUM_THREADS`` (torch reads it), else torch's one
    per core, divided among the processes of DDP on a CPU (Lightning's launcher does that), and capped at the
    cores this process may use: a container's CPU quota, which torch does not see, counts. The number chosen is
    exported as ``OMP_NUM_THREADS``, so DDP's launcher and its processes keep it."""
    if num_threads is not None:
        if num_threads < 1:
            raise ConfigError(f"num_threads ({num_threads}) must be >= 1 (null: one per core): fix --num_threads")
    elif os.environ.get("OMP_NUM_THREADS") or not on_cpu:
        return
    else:
        devices = trainer_config.devices
        processes = int(devices) if isinstance(devices, int) or str(devices).isdigit() else 1
        budget = max(1, _usable_cores() // max(1, processes))
        if torch.get_num_threads() <= budget:
            return  # torch's default already fits (Lightning divides it for DDP)
        print(f"ltcx: {_usable_cores()} usable CPU cores for {processes} process(es): {budget} torch thread(s) each, "
              f"not {torch.get_num_threads()} (--num_threads or OMP_NUM_THREADS to change)", file=sys.stderr)
        num_threads = budget
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)


def _usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (v2 ``cpu.max``, v1 CFS)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
            if quota not in ("max", "-1") and int(period) > 0:
                return max(1, min(cores, -(-int(quota) // int(period))))
        except (OSError, ValueError, IndexError):
            continue
    return cores


def _init_args_with_paths(trainer_config):
    """The init_args of the trainer's logger(s) and callbacks given as class_path + init_args."""
    loggers = trainer_config.logger if isinstance(trainer_config.logger, list) else [trainer_config.logger]
    for item in [*loggers, *(trainer_config.callbacks or [])]:
        init_args = getattr(item, "init_args", None)
        if init_args is not None:
            yield init_args


def _resolve_under_root(trainer_config) -> None:
    """Relative log and checkpoint folders (``save_dir``, ``dirpath``) go under ``trainer.default_root_dir``."""
    root = trainer_config.default_root_dir
    if not root:
        return
    for init_args in _init_args_with_paths(trainer_config):
        for key in ("save_dir", "dirpath"):
            value = init_args.get(key)
            if isinstance(value, str) and not os.path.isabs(value) and "://" not in value:
                init_args[key] = os.path.join(root, value)


def _find_last_checkpoint(trainer_config) -> str | None:
    """``--ckpt_path last``: the ``last.ckpt`` of the latest run (the highest ``version_N/`` of the checkpoint
    folder holding one), None (a fresh start) when there is none, and an error listing them when runs that
    shared one folder left several."""
    folders = [a.dirpath for a in _init_args_with_paths(trainer_config) if isinstance(a.get("dirpath"), str)]
    if not folders:
        return "last"  # no folder configured: Lightning's own search
    candidates = sorted(path for folder in folders for path in latest_last_checkpoint(folder))
    if len(candidates) > 1:
        raise LtcxError(
            f"--ckpt_path last is ambiguous: {', '.join(candidates)} (runs sharing the folder wrote several); "
            "pass --ckpt_path the one to resume"
        )
    if not candidates:
        print(f"ltcx: --ckpt_path last: no last checkpoint in {', '.join(folders)}; starting afresh", file=sys.stderr)
        return None
    return candidates[0]


def cli_main(args: list[str] | None = None) -> LtcxCLI:
    return LtcxCLI(
        LanguageModel,
        TextDataModule,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION},
        parser_class=LtcxArgumentParser,
        args=args,
    )


def generate_main(argv: list[str]) -> None:
    """``ltcx generate``: stream a completion of each prompt from a checkpoint to stdout."""
    from ltcx.generation import check_generation_args, stream_tokens
    from ltcx.lm import EXPORT_CONFIG, load_language_model
    from ltcx.tokenizers import get_tokenizer, stored_tokenizer_name, vocab_fits

    parser = argparse.ArgumentParser(prog="ltcx generate", description=generate_main.__doc__)
    parser.add_argument(
        "--ckpt_path", required=True,
        help="checkpoint written by `ltcx fit` (e.g. .../version_0/last.ckpt), a checkpoint folder (its latest run's "
        "last.ckpt) or a folder written by `ltcx export`",
    )
    parser.add_argument(
        "--prompt", action="append", help="prompt text; repeat for several prompts (none: start a new document)"
    )
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--num_samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no_stop_at_eot", action="store_true", help="keep going after the end-of-text token")
    parser.add_argument(
        "--tokenizer", default=None,
        help="override the tokenizer stored in the checkpoint (gpt2, bytes, a Hugging Face id or local folder; a "
        "folder the checkpoint names is only loaded when given here)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        raise LtcxError(f"--num_samples ({args.num_samples}) must be >= 1")
    device = _device(args.device)

    model, meta = load_language_model(args.ckpt_path, map_location=device)
    backbone = model.backbone.to(device)
    stored = meta.get("tokenizer")
    exported = os.path.isfile(os.path.join(args.ckpt_path, EXPORT_CONFIG))
    source = f"exported model '{args.ckpt_path}'" if exported else f"checkpoint '{args.ckpt_path}'"
    tokenizer_name = args.tokenizer or stored_tokenizer_name(
        stored, f"{source} names tokenizer",
        "ltcx loads no tokenizer folder a file names; if you trust it, pass --tokenizer FOLDER yourself",
    )
    if tokenizer_name is None:
        raise LtcxError("the checkpoint names no tokenizer: pass --tokenizer (e.g. gpt2)")
    tokenizer = get_tokenizer(tokenizer_name)
    model_vocab = meta.get("backbone_config", {}).get("vocab_size")
    if model_vocab is not None and not vocab_fits(tokenizer.vocab_size, model_vocab):
        if args.tokenizer in (None, stored):
            fix = f"{source} names another tokenizer than its model's: pass the --tokenizer it was trained with"
        elif stored is not None:
            fix = f"it was trained with tokenizer {stored!r}: pass that --tokenizer"
        else:
            fix = "pass the --tokenizer it was trained with"
        raise LtcxError(
            f"tokenizer {tokenizer_name!r} ({tokenizer.vocab_size} ids) does not fit the model's vocabulary of "
            f"{model_vocab}: {fix}"
        )
    generator = torch.Generator(device=device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()
    stop = None if args.no_stop_at_eot else tokenizer.eot_id
    # Without a prompt, generation starts from the end-of-text token, as at a document boundary in training.
    prompts = [(text, tokenizer.encode(text)) for text in args.prompt] if args.prompt else [("", [tokenizer.eot_id])]
    for _, ids in prompts:  # every prompt is checked before anything is printed
        check_generation_args(backbone, len(ids), args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    for prompt, ids in prompts:
        # Samples run one after another, so each streams as it is produced (a batch could only be shown at its end).
        for i in range(args.num_samples):
            if args.num_samples > 1:
                sys.stdout.write(f"--- sample {i + 1}\n")
            sys.stdout.write(prompt)
            row: list[int] = []
            printed = 0  # characters of the completion already written
            for token in stream_tokens(
                backbone, torch.tensor([ids], dtype=torch.long, device=device), args.max_new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop_token=stop,
                vocab_limit=tokenizer.vocab_size, generator=generator,
            ):
                if int(token) == stop:
                    break
                row.append(int(token))
                # Decode the whole completion and write what is new, holding back a character that is still
                # incomplete (a multi-byte character split over tokens decodes as U+FFFD until its last byte).
                text = tokenizer.decode(row)
                if not text.endswith("\ufffd"):
                    sys.stdout.write(text[printed:])
                    sys.stdout.flush()
                    printed = len(text)
            sys.stdout.write(tokenizer.decode(row)[printed:] + "\n")
            sys.stdout.flush()


def export_main(argv: list[str]) -> None:
    """``ltcx export``: a checkpoint's model as a weights-only folder (model.safetensors + config.json) to share
    without pickles; ``LanguageModel.from_pretrained(folder)`` and ``ltcx generate --ckpt_path folder`` read it."""
    from ltcx.lm import export_model

    parser = argparse.ArgumentParser(prog="ltcx export", description=export_main.__doc__)
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by `ltcx fit`, or its checkpoint folder")
    parser.add_argument("--out", required=True, help="a new folder to write")
    parser.add_argument(
        "--tokenizer", default=None,
        help="the tokenizer name to record instead of the checkpoint's: gpt2, bytes or a Hugging Face hub id (the "
        "folder holds no tokenizer, and a folder name is never recorded)",
    )
    args = parser.parse_args(argv)
    out = export_model(args.ckpt_path, args.out, tokenizer=args.tokenizer)
    print(f"ltcx: exported to {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")


def _device(name: str) -> torch.device:
    """``--device`` as a torch device that exists on this machine, else one line naming what does."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LtcxError(f"--device '{name}' is not a device name: use cpu or cuda (cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LtcxError(f"--device {name}: this machine has no usable CUDA device (torch sees none); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise LtcxError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA devices")
    return device


def main(argv: list[str] | None = None) -> None:
    """``ltcx`` / ``python run.py``: ``generate``, ``prepare`` or a LightningCLI subcommand; user errors as one line."""
    command_line = sys.argv[1:] if argv is None else argv
    try:
        if command_line and command_line[0] == "generate":
            generate_main(command_line[1:])
        elif command_line and command_line[0] == "prepare":
            from ltcx.data.prepare import prepare_main

            prepare_main(command_line[1:])
        elif command_line and command_line[0] == "export":
            export_main(command_line[1:])
        else:
            cli_main(argv)  # None: LightningCLI reads sys.argv itself
    except LtcxError as error:
        if not isinstance(error, StoppedOnAllRanks) or rank_zero_only.rank == 0:  # every rank has it: say it once
            print(f"ltcx: error: {error}", file=sys.stderr)
        sys.exit(2)
    except SIGTERMException as stop:  # training stopped by a signal: never report success
        sys.exit(stop.code or 128 + signal.SIGTERM)
