"""The CPU default of ``ltcx evaluate --task long_context --train cpu``: every catalogue architecture's tiny shape,
and the GPT with rotary positions (``gpt-rope``), trained by ``ltcx fit`` at length ``LENGTH`` on the needle and,
separately, on MQAR: one run per (architecture, task), one seed, one learning rate, no tuning. The runs go to
``<out>/runs/<label>-<task>/`` (logs, checkpoints, ``run.log``); a finished run (its ``done.json``) is not trained
again, a stopped one continues from its last checkpoint. ``ltcx evaluate`` then scores the checkpoints at
``LENGTH`` x 1, 2, 4, 8 (``ltcx/eval/long_context.py``).

The shapes' context (``block_size``) is the training length, so a model with learned positions (GPT, LTC, GTA)
stops there and says so: the chart shows where each one ends. docs/long_context.md has this run's results and the
GPU grid.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ltcx.errors import LtcxError
from ltcx.study.report import write_json

__all__ = ["LENGTH", "STEPS", "DefaultRun", "archs", "plan", "train_cpu_default"]

LENGTH = 32  # the training length L (evaluated at L, 2L, 4L, 8L)
STEPS = 1000  # quick-recall's: a 2-layer GPT leaves MQAR's plateau after several hundred (docs/recall.md)
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
# (label, catalogue name, variant) of the runs beside an entry's tiny shape: the GPT with rotary positions
ALSO = {"gpt": [("gpt-rope", "gpt", "rope")]}
# a needle and question short enough for L = 32 (RULER's wording needs L >= 63): 2 digits, 18 tokens of haystack
TASK_DATA = {
    "needle": ("data/niah", {"num_digits": 2, "haystack": "sample", "needle": "key {passkey}. ", "question": " key?"}),
    "mqar": ("data/mqar", {"vocab_size": 64, "num_kv_pairs": 2, "random_fillers": False}),  # quick-recall's task
}


@dataclass(frozen=True)
class DefaultRun:
    label: str  # gpt, gpt-rope, ...
    arch: str  # its catalogue name
    variant: str  # its catalogue shape
    task: str  # needle | mqar

    @property
    def name(self) -> str:
        return f"{self.label}-{self.task}"

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.name

    def fit_args(self, root: Path) -> list[str]:
        """``ltcx fit`` of this run, logs and checkpoints under ``root``."""
        from ltcx.models.catalog import CATALOG, config_path, shipped_config

        entry = CATALOG[self.arch]
        init_args = dict(entry.shapes()[self.variant])
        fields = {f.name for f in dataclasses.fields(entry.backbone_class().config_class)}
        if "block_size" in init_args:
            init_args["block_size"] = LENGTH  # the context is the training length
        if "init_std" in fields:  # N(0, 1/width): GPT-2's 0.02 keeps a narrow model on MQAR's plateau (docs/recall.md)
            init_args["init_std"] = round(init_args["n_embd"] ** -0.5, 6)
        config, data = TASK_DATA[self.task]
        args = ["fit", "--config", str(config_path(self.arch)), "--config", str(shipped_config(config))]
        for key, value in init_args.items():
            args += [f"--model.backbone.init_args.{key}", value if isinstance(value, str) else json.dumps(value)]
        for key, value in {**data, "block_size": LENGTH, "batch_size": BATCH_SIZE, "val_batches": 2,
                           "seed": 0}.items():
            args += [f"--data.{key}", value if isinstance(value, str) else json.dumps(value)]
        return [*args, "--seed_everything", "0", "--model.learning_rate", f"{LEARNING_RATE:g}",
                "--model.min_lr", f"{LEARNING_RATE / 10:g}", "--model.warmup_steps", str(STEPS // 10),
                "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS),
                "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(root)]


def archs() -> list[tuple[str, str, str]]:
    """(label, catalogue name, variant) of each model of the CPU default: every catalogue entry's tiny shape, in the
    catalogue's order, each followed by its ``ALSO``."""
    from ltcx.models.catalog import CATALOG

    return [model for name in CATALOG for model in [(name, name, "tiny"), *ALSO.get(name, [])]]


def plan() -> list[DefaultRun]:
    """Every run of the CPU default, architecture by architecture."""
    return [DefaultRun(label, arch, variant, task) for label, arch, variant in archs() for task in TASK_DATA]


def train_cpu_default(out: Path, say: Callable[[str], None] = print) -> list[tuple[str, Path]]:
    """Train every run of ``plan()`` under ``out/runs/`` (a finished one is kept, a stopped one resumed): the
    ``(label, last checkpoint)`` of each (the label is the architecture's: its task is in its checkpoint). A failed
    run is one line naming its log."""
    from ltcx.study.processes import ended_by, run_child
    from ltcx.study.records import read_done
    from ltcx.study.results import last_line, latest_checkpoint

    trained = []
    for run in plan():
        root = run.folder(out)
        done = root / "done.json"
        if done.is_file():
            say(f"{run.name}: trained before, kept")
            trained.append((run.label, read_done(root)))
            continue
        args, checkpoint = run.fit_args(root), latest_checkpoint(root)
        if checkpoint is not None:
            args += ["--ckpt_path", str(checkpoint)]
        root.mkdir(parents=True, exist_ok=True)
        say(f"{run.name}: training {STEPS} steps at length {LENGTH} ({'resumed' if checkpoint else 'new'})")
        code = run_child(args, root / "run.log", run.name)
        final = latest_checkpoint(root)
        if code != 0 or final is None:
            why = ended_by(code, root / "run.log") if code else last_line(root / "run.log")
            raise LtcxError(f"{run.name} failed (exit {code}): {why} (see {root / 'run.log'}; rerun to resume)")
        write_json(done, {"checkpoint": str(final.relative_to(root))})  # relative: the folder may move
        trained.append((run.label, final))
    return trained
