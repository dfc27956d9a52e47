"""``ltcx fit / validate / test / predict``: LightningCLI with ltcx's hooks.

The parser's errors are one line; bf16 falls back to float32 on a CPU; torch's threads fit the usable cores
(``threads``); ``--ckpt_path`` (a file, a checkpoint folder or ``last``: ``run_folders``) is read and checked once
before anything is written, its model configuration replacing the YAML's as ``ltcx.cli.resume`` says;
checkpoints are written through ``SafeCheckpointIO``; ``predict`` writes its losses (``predict``).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
from typing import Optional

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ltcx.callbacks import LineProgress, StepRichProgressBar, StepTQDMProgressBar
from ltcx.callbacks.preemption import Preemption
from ltcx.cli.console import print_run_end, print_run_start, quiet_lightning
from ltcx.cli.one_line_errors import OneLineErrors
from ltcx.cli.predict import write_predictions
from ltcx.cli.resume import checkpoint_model_config, model_keys
from ltcx.cli.run_folders import find_last_checkpoint, name_after_architecture, resolve_under_root
from ltcx.cli.sizes import check_run_sizes
from ltcx.data import RecallDataModule, TextDataModule  # noqa: F401 - the --data classes fit --help lists
from ltcx.ddp import launcher_outlives_workers, peer_stopped_line, watch_workers
from ltcx.errors import ConfigError, LtcxError
from ltcx.lm import LanguageModel
from ltcx.persist.checkpoint import SafeCheckpointIO, read_checkpoint
from ltcx.persist.file_fits import check_same_backbone, check_weights_fit
from ltcx.persist.runs import checkpoint_in_folder
from ltcx.runtime import program_name, set_cpu_threads, write_test_metrics

DESCRIPTION = (
    "ltcx: train and evaluate language models (`ltcx generate --help` samples from a checkpoint, `ltcx export --help` "
    "writes a weights-only copy, `ltcx prepare --help` makes token shards, `ltcx evaluate --help` scores loss by "
    "position, `ltcx lm-eval --help` runs lm-evaluation-harness tasks)"
)
# A command's usage in one line: argparse's own lists every flag (about 45 lines for fit) before the list of options.
COMMAND_USAGE = "%(prog)s [-c CONFIG] [--print_config] [--KEY VALUE ...]"


# How gloo and NCCL report a collective whose peer process is gone (its sockets closed: it exited, crashed or was
# killed).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError",
             "remote process exited")


class LtcxArgumentParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser, whose errors are one ``LtcxError`` line (``OneLineErrors``) instead of its usage (~75
    lines) and message, a file that is not YAML included. It records the keys typed on the command line
    (``typed_keys``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.typed_keys: set[str] = set()

    def _parse_optional(self, arg_string):
        """argparse's reading of one word of the command line: the option it names, by its whole name or by a prefix
        of one (``--trainer.precisio``), is recorded in ``typed_keys`` as its key (``trainer.precision``); a key
        inside a class argument as typed (``--model.backbone.init_args.dropout``). A YAML, an environment variable
        or a default is never read here."""
        found = super()._parse_optional(arg_string)
        for option in found if isinstance(found, list) else [found]:  # a list from Python 3.12.7 on
            if isinstance(option, tuple) and option[0] is not None and isinstance(option[1], str):
                action, typed = option[0], option[1]
                inside = typed.startswith("--") and typed not in self._option_string_actions  # jsonargparse's subkey
                self.typed_keys.add(typed[2:] if inside else action.dest)
        return found

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


def subcommands_built(subcommand: str | None) -> dict[str, set[str]]:
    """LightningCLI's subcommands whose parsers are built: its four, or only ``subcommand`` where the command line is
    known to start with it (``cli_main``): a run uses one, and each costs start-up time."""
    every = LightningCLI.subcommands()
    return every if subcommand is None else {subcommand: every[subcommand]}


class LtcxCLI(LightningCLI):
    def __init__(self, *args, subclass_mode_data: bool = True, subcommand: str | None = None, **kwargs) -> None:
        # --data takes TextDataModule's arguments as before (no class_path needed), or another data module by
        # class_path: ltcx.data.RecallDataModule (configs/data/mqar.yaml). The parser records what was typed.
        kwargs.setdefault("parser_class", LtcxArgumentParser)
        self._subcommand = subcommand
        super().__init__(*args, subclass_mode_data=subclass_mode_data, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        return subcommands_built(self._subcommand)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            # A data module is built inside jsonargparse's check of the --data union (subclass mode), which wraps
            # its one-line LtcxError in a many-line "Does not validate against any of the Union subtypes".
            cause = _ltcx_error_in(error)
            if cause is None:
                raise
            raise cause from None

    def add_arguments_to_parser(self, parser) -> None:
        # The model's vocabulary always matches the data's tokenizer: nobody keeps vocab_size by hand.
        parser.set_defaults({"data": {"class_path": "ltcx.data.TextDataModule"}})
        parser.link_arguments("data.padded_vocab_size", "model.backbone.init_args.vocab_size", apply_on="instantiate")
        parser.add_argument(
            "--test_after_fit", type=bool, default=False,
            help="fit only: when training ends, test the final weights on the data's test split in the same process, "
            "as `ltcx test --ckpt_path <its last.ckpt>` would (test_metrics.json in the run's log folder), without a "
            "second process's start",
        )
        parser.add_argument(
            "--num_threads", type=Optional[int], default=None,
            help="torch threads per process (null: OMP_NUM_THREADS if set, else one per usable core, divided among "
            "the processes of DDP on a CPU)",
        )

    def parse_arguments(self, parser, args) -> None:
        for each in [parser, *getattr(self, "_subcommand_parsers", {}).values()]:
            getattr(each, "typed_keys", set()).clear()
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        self._typed = frozenset(getattr(self._subcommand_parsers[subcommand] if subcommand else parser, "typed_keys",
                                        ()))
        name_after_architecture(self.config[subcommand] if subcommand else self.config)

    def _set_seed(self) -> None:
        seed = self._get(self.config, "seed_everything")
        if not isinstance(seed, bool) and isinstance(seed, int) and not 0 <= seed < 2**32:  # numpy's seeds
            raise ConfigError(f"seed_everything ({seed}) must be in [0, {2**32 - 1}], or true for a random seed: fix "
                              "--seed_everything")
        super()._set_seed()

    def typed_keys(self) -> frozenset[str]:
        """The keys the user typed on the command line (``trainer.precision``, ``model.learning_rate``,
        ``model.backbone.init_args.dropout``), as the parser read them: by whole name or by a prefix it accepts, as
        ``--key value`` or ``--key=value``; never a YAML's value, an environment variable's or a default. Every
        policy that lets a typed value win asks this (bf16 on a CPU, a resumed checkpoint's settings)."""
        return getattr(self, "_typed", frozenset())

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        precision = str(config.trainer.precision)
        accelerator = str(config.trainer.accelerator)
        check_accelerator(accelerator)
        on_cpu = accelerator == "cpu" or (accelerator in ("auto", "cuda", "gpu") and not torch.cuda.is_available())
        check_devices(config.trainer.devices, on_cpu)
        if "bf16" in precision and on_cpu and "trainer.precision" not in self.typed_keys():
            # The same YAML trains in bf16 on a GPU and in float32 on a CPU, where bf16 is emulated and many
            # times slower on most processors; a bf16 typed on the command line is kept.
            reason = "training on the CPU" if accelerator == "cpu" else "no CUDA device"
            print(
                f"ltcx: {reason}, so trainer.precision {precision} -> 32-true "
                f"(pass --trainer.precision {precision} to keep it)",
                file=sys.stderr,
            )
            config.trainer.precision = "32-true"
        if config.get("test_after_fit") and self.subcommand != "fit":
            raise ConfigError(f"--test_after_fit is for fit, not {self.subcommand}: drop it (`ltcx test --ckpt_path` "
                              "tests a checkpoint)")
        set_cpu_threads(config.get("num_threads"), config.trainer, on_cpu)
        context_from_data(config)
        check_run_sizes(config)  # the model and one batch against this machine's memory, before anything is built
        max_steps = config.trainer.max_steps
        if max_steps is not None and max_steps < -1:
            raise ConfigError(f"trainer.max_steps ({max_steps}) must be >= -1 (-1: no limit): fix --trainer.max_steps")

    def _parse_ckpt_path(self) -> None:
        """Where Lightning reads the ``--ckpt_path`` hyperparameters into the config, ltcx first resolves folders and
        ``last`` and reads the file once through ``read_checkpoint``: a bad file is one line before anything is built
        or written, and the trainer is later handed this same copy. Then the checkpoint's model configuration
        (``hyper_parameters`` and its backbone's config) replaces the YAML's, except the ``--model.*`` flags typed on
        the command line, which win (``ltcx.cli.resume``)."""
        self._checkpoint = None
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        resolve_under_root(config.trainer)
        if config.get("ckpt_path") == "last":
            config.ckpt_path = find_last_checkpoint(config.trainer)
        elif isinstance(config.get("ckpt_path"), str) and os.path.isdir(config.ckpt_path):
            config.ckpt_path = checkpoint_in_folder(config.ckpt_path)  # a checkpoint folder: its latest run's
        if config.get("ckpt_path") in (None, "last"):
            return
        self._checkpoint = read_checkpoint(config.ckpt_path)
        model = checkpoint_model_config(
            self._checkpoint, config.model, model_keys(self.typed_keys()), config.ckpt_path, self.model_class,
            notice=_notice if subcommand == "fit" else None,
        )
        check_checkpoint_settings(self.model_class, config.model, model, config.ckpt_path)
        if model:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def instantiate_trainer(self, **kwargs):
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        if not any(isinstance(c, Preemption) for c in callbacks):  # SIGTERM / Ctrl-C save the step in every run
            kwargs["callbacks"] = callbacks = [*callbacks, Preemption()]
        # The run's first line (what trains, where it writes) before the other callbacks' notices at the start; the
        # launching process of DDP / FSDP2 watches its workers in place of Lightning's observer (watch_workers).
        start = LambdaCallback(setup=lambda trainer, pl_module, stage: watch_workers(trainer),
                               on_train_start=print_run_start)
        kwargs["callbacks"] = callbacks = [start, *callbacks]
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

    before_validate = before_test = before_predict = _check_ckpt_path

    def before_fit(self) -> None:
        self._check_ckpt_path()
        if self._get(self.config, "test_after_fit"):
            self.datamodule.setup("test")  # a disabled or missing test split: one line before training

    def after_fit(self) -> None:
        if self._get(self.config, "test_after_fit"):  # the weights trained to the end, which last.ckpt holds
            self.trainer.test(self.model, datamodule=self.datamodule)
            write_test_metrics(self.trainer, self.model)
        print_run_end(self.trainer)

    def after_test(self) -> None:
        """``test`` from the command line: the test split's metrics to ``test_metrics.json`` in the run's log
        folder, and a line saying where."""
        write_test_metrics(self.trainer, self.model)

    def after_predict(self) -> None:
        """``predict`` from the command line: each block's mean loss to ``predictions.csv`` in the run's log folder
        and a one-line summary on stdout."""
        write_predictions(self.trainer)

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
        """This rank's collective found a peer process gone. The launching process waits for the others rather than
        being stopped by its watch of them mid-message."""
        launcher_outlives_workers(trainer)
        return LtcxError(peer_stopped_line(trainer.global_rank, trainer.world_size, trainer.global_step,
                                           subcommand == "fit"))

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


def context_from_data(config) -> None:
    """A backbone ``block_size: null`` (the GPT family's context) becomes ``data.block_size``: the context is the
    length the model trains on, written once in the recipe (a learned position embedding past it would never be
    trained). A number, typed or from a resumed checkpoint, is kept."""
    init_args = getattr(getattr(config.get("model"), "backbone", None), "init_args", None)
    data = config.get("data")
    block_size = getattr(getattr(data, "init_args", data), "block_size", None)  # a data class_path's, or flat
    if init_args is not None and "block_size" in init_args and init_args.block_size is None and block_size:
        init_args.block_size = block_size


def check_accelerator(accelerator: str) -> None:
    """A GPU asked for on a machine without one: one line, not Lightning's ``No supported gpu backend found!``
    traceback (``configs/trainer/fsdp.yaml`` asks for one)."""
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if (accelerator == "cuda" and not cuda) or (accelerator == "gpu" and not (cuda or mps)) or (
            accelerator == "mps" and not mps):
        raise ConfigError(f"trainer.accelerator {accelerator}: no GPU found on this machine: use "
                          "--trainer.accelerator cpu or auto")


def check_devices(devices, on_cpu: bool) -> None:
    """``trainer.devices`` as Lightning reads it, else one line (not its ``TypeError`` traceback): on a CPU a
    number of processes or ``auto``; on GPUs also -1 (every one) and indices (``0,1`` or ``[0, 1]``)."""
    text = None if isinstance(devices, (list, tuple)) else str(devices).strip()
    count = int(text) if text is not None and re.fullmatch(r"-?\d+", text) else None
    if on_cpu:
        ok = text == "auto" or (count is not None and count >= 1)
        accepted = "a number of processes (such as 2) or auto on the CPU"
    else:
        indices = devices if text is None else text.split(",") if "," in text else None
        ok = text == "auto" or (count is not None and (count >= 1 or count == -1)) or (
            indices is not None and all(re.fullmatch(r"\d+", str(i).strip()) for i in indices if str(i).strip()))
        accepted = "a number of GPUs (such as 2), -1 (every GPU), auto, or GPU indices (0,1 or [0, 1])"
    if not ok:
        shown = "[" + ", ".join(str(d) for d in devices) + "]" if text is None else text
        raise ConfigError(f"trainer.devices ({shown}) must be {accepted}: fix --trainer.devices")


def check_checkpoint_settings(model_class: type, configured, taken: dict, path: str) -> None:
    """The settings a resumed checkpoint gives the model (``taken``: every one not typed) keep ``model_class``'s rules
    (``setting_problem``); else its line would name a flag nobody typed instead of the file."""
    names = {*inspect.signature(model_class).parameters, *taken} - {"backbone"}
    problem = model_class.setting_problem({name: taken[name] if name in taken else configured.get(name)
                                           for name in names if name in taken or name in configured})
    if problem and problem[0] in taken:
        key, value, rule = problem
        raise LtcxError(f"checkpoint '{path}' has model.{key} {value}, which {rule}: type --model.{key} to resume "
                        "with another value, or use another checkpoint")


def _ltcx_error_in(error: BaseException) -> LtcxError | None:
    """The first ``LtcxError`` in the chain of causes and contexts of ``error``, if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, LtcxError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _notice(text: str) -> None:
    """One ``ltcx:`` line on stderr, from the first process only (DDP's launcher runs the CLI in each)."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        print(f"ltcx: {text}", file=sys.stderr)


def cli_main(args: list[str] | None = None) -> LtcxCLI:
    """LightningCLI on ``args`` (None: ``sys.argv[1:]``), whose first is one of its subcommands (``ltcx.cli.main``
    dispatches only those here): only that subcommand's parser is built."""
    quiet_lightning()
    first = (sys.argv[1:] if args is None else args)[:1]
    subcommand = first[0] if first and first[0] in LightningCLI.subcommands() else None
    return LtcxCLI(
        LanguageModel,
        L.LightningDataModule,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # ltcx's AdamW and schedule (LanguageModel.configure_optimizers), always
        parser_kwargs={"description": DESCRIPTION, "prog": program_name(),
                       **{c: {"usage": COMMAND_USAGE} for c in subcommands_built(subcommand)}},
        parser_class=LtcxArgumentParser,
        args=args,
        subcommand=subcommand,
    )


