"""The study runner behind ``ltcx study``: a spec (``ltcx/study/spec.py``) becomes runs, phase by phase.

1. **Plan**: each architecture's shape at each size (``size_by: width``: the catalogue's scaling rule at ``layers``;
   ``params``: the baseline at that many non-embedding parameters, the others matched to its ``match`` figure by
   ``ltcx/study/budget.py``; ``config``: the YAML as it is), and each run's steps.
2. **Tune**: every learning rate of the grid on the tuning seed; the best of each (architecture, size) by the final
   ``val/<metric>`` (a run stopped on a non-finite loss ranks last).
3. **Seeds**: every seed at the chosen rate (the tuning seed's run is that one), each seed reading the same batches
   in the same order for every architecture (``--seed_everything S --data.seed S``).
4. **Test**: each run of phase 3 on the data's test split, which played no part in choosing: in its own fit process
   where it trains in phase 3 (``--test_after_fit``), else ``ltcx test`` of its checkpoint (the tuning seed's run);
   its ``test_metrics.json`` is what the report shows.

Each run is an ordinary ``ltcx fit`` process (where the machine shows no GPU, a fork of a fork server that imported
torch and Lightning once: ``ltcx/study/prestart.py``) in its own folder
``<out>/<name>/runs/<arch>/<size>/lr<lr>/seed<S>/`` (TensorBoard logs, checkpoints, ``run.log``). ``result.json``
marks a finished run and ``test.json`` a finished test (written atomically); a killed study rerun continues where it
stopped: finished runs are skipped and an unfinished one resumes from its ``last.ckpt``. A signal (Ctrl-C reaches the
whole process group) is left to the child, which saves its step and exits 128 + the signal; the runner then raises
``StudyStopped`` naming the run and the step. Where a phase's runs train (one after another, a run per GPU, a SLURM
job per run) is the launcher's (``ltcx/study/launch.py``): each run trains under its claim, and a failed one is
reported while the others finish (``StudyFailed`` after the report).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltcx.cli.test_metrics import TEST_METRICS
from ltcx.errors import ConfigError, LtcxError
from ltcx.study import prestart
from ltcx.study.launch import CLAIMED, Job, StudyStopped, make_launcher, received, running, signals_noted, try_claim
from ltcx.study.report import write_json
from ltcx.study.spec import StudySpec, arch_name

__all__ = ["Run", "Shape", "StudyFailed", "StudyStopped", "plan_shapes", "read_logs", "run_study",
           "select_learning_rates"]

DEFAULT_VOCAB = 50304  # GPT-2's padded vocabulary: the shapes' figures when the data sets none


class StudyFailed(Exception):
    """Runs failed (each reported with its log's last line) while the others finished: ``failed``, the
    ``launch.Failed`` of each."""

    def __init__(self, failed: list) -> None:
        super().__init__(f"{len(failed)} runs failed")
        self.failed = failed


@dataclass(frozen=True)
class Shape:
    """One architecture at one size in one cell of the grid: its ``init_args`` (less ``vocab_size``), the budget
    match's distance, and the cell's ``--data`` values. ``entry`` is the spec's ``archs`` entry (a catalogue name or
    a model YAML), ``arch`` its name."""

    arch: str
    size: float
    init_args: dict[str, Any]
    distance: float | None = None
    cell: tuple[tuple[str, Any], ...] = ()
    entry: str = ""

    @property
    def label(self) -> str:
        size = "config" if not self.init_args and self.distance is None else f"size{self.size:g}"
        return "-".join([size, *(f"{CELL_NAMES.get(key, key)}{_cell_value(value)}" for key, value in self.cell)])

    def block_size(self, spec: StudySpec) -> int:
        """The sequence length of this cell (the grid's ``block_size``, else the spec's)."""
        return int(dict(self.cell).get("block_size", spec.block_size))


# a grid key's short name in labels and folders: T64-P8 is length 64 with 8 key-value pairs
CELL_NAMES = {"block_size": "T", "num_kv_pairs": "P"}


def _cell_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value).lower()


@dataclass(frozen=True)
class Run:
    """One ``ltcx fit``: an architecture's shape, a learning rate and a seed."""

    shape: Shape
    lr: float
    seed: int
    steps: int
    evals: int

    @property
    def arch(self) -> str:
        return self.shape.arch

    @property
    def label(self) -> str:
        return f"{self.arch} {self.shape.label} lr={self.lr:g} seed {self.seed}"

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.arch / self.shape.label / f"lr{self.lr:g}" / f"seed{self.seed}"

    def block_size(self, spec: StudySpec) -> int:
        return self.shape.block_size(spec)


# ----------------------------------------------------------------------------- the plan


def vocab_size(spec: StudySpec) -> int:
    return int(spec.data.get("vocab_size", DEFAULT_VOCAB))


def grid_cells(spec: StudySpec) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the spec's ``grid`` (one empty cell without a grid), the first key varying slowest. A cell
    the data refuses (MQAR's ``block_size >= 4 * num_kv_pairs``, ``check_mqar``) is left out."""
    from ltcx.data.mqar import check_mqar

    keys = list(spec.grid)
    cells = []
    for values in itertools.product(*(spec.grid[key] for key in keys)):
        cell = tuple(zip(keys, values))
        pairs = dict(cell).get("num_kv_pairs", spec.data.get("num_kv_pairs"))
        if pairs is not None and isinstance(pairs, int):
            try:
                check_mqar(vocab_size(spec), int(dict(cell).get("block_size", spec.block_size)), pairs, 1.0)
            except ConfigError:
                continue
        cells.append(cell)
    return cells


def plan_shapes(spec: StudySpec) -> list[Shape]:
    """Every (architecture, size, cell) of the study: cells within sizes, architectures in the spec's order within
    each."""
    cells = grid_cells(spec)
    if not cells:
        raise ConfigError(f"study spec {spec.source}: key 'grid' leaves no cell the data accepts (MQAR needs "
                          "block_size >= 4 * num_kv_pairs): fix the grid")
    if spec.size_by == "config":
        return [Shape(arch_name(entry), 0.0, {}, cell=cell, entry=entry) for cell in cells for entry in spec.archs]
    return [dataclasses.replace(shape, cell=cell) for size in spec.sizes for cell in cells
            for shape in _shapes_at(spec, size, int(dict(cell).get("block_size", spec.block_size)))]


def _shapes_at(spec: StudySpec, size: float, block_size: int) -> list[Shape]:
    """Every architecture at ``size`` for sequences of ``block_size``."""
    from ltcx.models import catalog
    from ltcx.study.budget import match_shape

    options = {} if spec.head_dim is None else {"head_dim": spec.head_dim}
    shapes = []
    if spec.size_by == "width":
        for arch in spec.archs:
            entry = catalog.get(arch)
            if entry.scaling is None:
                raise ConfigError(f"architecture '{arch}' has no scaling rule: give its catalogue entry one "
                                  "(Architecture.scaling, ltcx/models/scaling.py) or use size_by: config")
            layers = spec.layers or entry.scaling.depth
            shapes.append(Shape(arch, size, _initialised(arch, entry.scaled(int(size), layers, block_size, **options),
                                                         spec), entry=arch))
        return shapes
    reference = match_shape(spec.reference, "params", size, block_size, vocab_size(spec), n_layers=spec.layers,
                            **options)
    target = reference.figure(spec.match)
    for arch in spec.archs:
        match = reference if arch == spec.reference else match_shape(
            arch, spec.match, target, block_size, vocab_size(spec), n_layers=spec.layers, **options)
        args = {k: v for k, v in match.init_args.items() if k != "vocab_size"}
        shapes.append(Shape(arch, size, _initialised(arch, args, spec), match.distance, entry=arch))
    return shapes


def _initialised(arch: str, init_args: dict[str, Any], spec: StudySpec) -> dict[str, Any]:
    """``scaled_init``: N(0, 1/width) matrices where the backbone has ``init_std`` (GPT-2's 0.02 is made for width 768;
    at width 64 it keeps a GPT on MQAR's plateau for thousands of steps, docs/recall.md)."""
    from ltcx.models import catalog

    if not spec.scaled_init:
        return init_args
    fields = {f.name for f in dataclasses.fields(catalog.get(arch).backbone_class().config_class)}
    width = init_args.get("n_embd")
    return {**init_args, "init_std": round(width ** -0.5, 6)} if "init_std" in fields and width else init_args


def run_steps(spec: StudySpec, shape: Shape) -> tuple[int, int]:
    """(max_steps, steps between validations): ``steps``, or ``tokens_per_param`` x the shape's non-embedding
    parameters in batches, rounded up to a multiple of ``evals`` (the last validation is at the end)."""
    steps = spec.steps
    if steps is None:
        from ltcx.study.budget import figures

        if spec.size_by == "config":
            raise ConfigError(f"study spec {spec.source}: size_by: config needs 'steps' (tokens_per_param needs a "
                              "shape the study sets)")
        block_size = shape.block_size(spec)
        params = figures(shape.arch, {**shape.init_args, "vocab_size": vocab_size(spec)}, block_size, block_size)[0]
        steps = math.ceil(spec.tokens_per_param * params / (spec.batch_size * block_size))
    every = max(1, math.ceil(steps / spec.evals))
    return every * spec.evals, every


def make_run(spec: StudySpec, shape: Shape, lr: float, seed: int) -> Run:
    steps, _ = run_steps(spec, shape)
    return Run(shape, lr, seed, steps, spec.evals)


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def arch_config(shape: Shape) -> str:
    """The model YAML of ``shape``: its own (a variant's file) or the catalogue's."""
    from ltcx.models.catalog import config_path

    entry = shape.entry or shape.arch
    return str(Path(entry).resolve()) if entry.endswith((".yaml", ".yml")) else str(config_path(entry))


def composed_configs(spec: StudySpec) -> list[str]:
    """The spec's ``configs`` as paths: a shipped name (``data/mqar``) or a file."""
    from ltcx.models.catalog import shipped_config

    paths = []
    for config in spec.configs:
        path = Path(config) if Path(config).is_file() else shipped_config(config)
        if path is None:
            raise ConfigError(f"study spec {spec.source}: key 'configs': '{config}' is neither a file nor a shipped "
                              "config (e.g. data/mqar, trainer/smoke)")
        paths.append(str(Path(path).resolve()))
    return paths


def common_args(spec: StudySpec, run: Run) -> list[str]:
    """What ``fit`` and ``test`` of ``run`` share: configs, shape, data and the spec's own flags."""
    args = ["--config", arch_config(run.shape)]
    for path in composed_configs(spec):
        args += ["--config", path]
    for key, value in run.shape.init_args.items():
        args += [f"--model.backbone.init_args.{key}", _value(value)]
    args += ["--data.block_size", str(run.block_size(spec)), "--data.batch_size", str(spec.batch_size),
             "--data.seed", str(run.seed), "--seed_everything", str(run.seed)]
    for group in ("data", "model", "trainer"):
        for key, value in getattr(spec, group).items():
            args += [f"--{group}.{key}", _value(value)]
    for key, value in run.shape.cell:
        if key != "block_size":
            args += [f"--data.{key}", _value(value)]
    return [*args, *spec.args]


def fit_args(spec: StudySpec, run: Run, root: Path, test: bool = False) -> list[str]:
    """``ltcx fit`` of ``run`` into ``root``; with ``test``, its test split is scored when training ends, in the same
    process (``--test_after_fit``: one process start fewer than a separate ``ltcx test``)."""
    steps, every = run_steps(spec, run.shape)
    warmup = round(spec.warmup_fraction * steps)
    return ["fit", *common_args(spec, run), "--model.learning_rate", f"{run.lr:g}",
            "--model.min_lr", f"{run.lr * spec.min_lr_ratio:g}", "--model.warmup_steps", str(warmup),
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
            "--trainer.check_val_every_n_epoch", "null", "--trainer.default_root_dir", str(root),
            *(["--test_after_fit", "true"] if test else [])]


# ----------------------------------------------------------------------------- one run


def read_logs(root: Path, prefix: str = "val/") -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag starting with ``prefix`` by step, from every TensorBoard version under ``root`` (a resumed run
    writes a new version; a later version wins for the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves: dict[str, dict[int, float]] = {}
    versions = sorted(root.glob("lightning_logs/*/version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        for events_file in sorted(version.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
            events.Reload()
            for tag in events.Tags()["scalars"]:
                if tag.startswith(prefix):
                    curves.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return {tag: sorted(curve.items()) for tag, curve in sorted(curves.items())}


def latest_checkpoint(root: Path) -> Path | None:
    """The last.ckpt of the latest run under ``root/checkpoints/<arch>/``."""
    from ltcx.persist.runs import latest_last_checkpoint

    found = [path for folder in sorted((root / "checkpoints").glob("*/")) for path in latest_last_checkpoint(folder)]
    return Path(found[-1]) if found else None


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() \
        else []
    return lines[-1] if lines else "(the log is empty)"


def _stop_line(log: Path, signum: int) -> str:
    """The child's ``ltcx: SIGINT at step N: saved ...`` line, without its ``ltcx: ``."""
    name = signal.Signals(signum).name
    lines = [line for line in log.read_text(errors="replace").splitlines() if f"ltcx: {name} at step " in line]
    return lines[-1].split("ltcx: ", 1)[1].split("; resume with", 1)[0] if lines else f"{name} before its first step"


def ltcx_command() -> list[str]:
    """The ``ltcx`` command as a subprocess, installed or in a checkout."""
    return [sys.executable, "-c", "import sys; sys.argv[0] = 'ltcx'; from ltcx.cli import main; main()"]


def _child(args: list[str], log: Path, label: str, env: dict | None = None, keep_fds: tuple[int, ...] = ()) -> int:
    """Run ``ltcx args`` to its end, output appended to ``log``; ``env`` on top of this process's, ``keep_fds``
    inherited (the run's claim: held until the child is gone too). A signal reaching this process (Ctrl-C reaches the
    whole process group, the child too) is not passed on: the child saves its step and exits, and this process then
    stops with it (a child that got no signal and finishes stops the study after it). SIGUSR2 is blocked in the
    child: SLURM sends its time-limit warning to every process of a job, and the job answers it for the child
    (``launch.StudyJob.checkpoint``)."""
    with signals_noted():
        if prestart.available():  # a fork of the pre-imported fork server, which blocks SIGUSR2 itself
            child = prestart.start(args, log, env or {}, keep_fds)
        else:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # the child inherits this thread's mask
            try:
                with open(log, "a") as stream:
                    child = subprocess.Popen([*ltcx_command(), *args], stdout=stream, stderr=subprocess.STDOUT,
                                             env={**os.environ, **(env or {})}, pass_fds=keep_fds)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        with running(child):
            code = child.wait()
        noted = received()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) or noted:
        signum = code - 128 if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) else noted[0]
        where = _stop_line(log, signum) if code != 0 else f"{signal.Signals(signum).name} after it finished"
        raise StudyStopped(f"study stopped: {label}: {where}; run the same `ltcx study` command to resume",
                           128 + signum)
    return code


def train(spec: StudySpec, run: Run, out: Path, say: Callable[[str], None], env: dict | None = None,
          keep_fds: tuple[int, ...] = (), where: str = "", test: bool = False) -> dict:
    """Train ``run`` unless it finished before (its ``result.json``); its result. ``env``, ``keep_fds``: the child's
    (``_child``); ``where``: the launcher's slot, said in the start line; ``test``: the fit tests its final weights
    too (``evaluate_test`` then reads that). The caller holds the run's claim (``ltcx/study/launch.py``)."""
    root = run.folder(out)
    result_file = root / "result.json"
    if result_file.is_file():
        say(f"{run.label}: done before, skipped")
        return json.loads(result_file.read_text())
    args = fit_args(spec, run, root, test=test)
    checkpoint = latest_checkpoint(root)
    if checkpoint is not None:
        args += ["--ckpt_path", str(checkpoint)]  # a stopped run continues where it stopped
    root.mkdir(parents=True, exist_ok=True)
    say(f"{run.label}: training {run.steps} steps ({'resumed from ' + checkpoint.name if checkpoint else 'new'})"
        + (f" on {where}" if where else ""))
    code = _child(args, root / "run.log", run.label, env=env, keep_fds=keep_fds)
    diverged = False
    if code != 0:
        line = last_line(root / "run.log")
        from ltcx.callbacks.guard import FIX

        diverged = FIX in line  # a non-finite loss: this learning rate is too high, a result of the grid
        if not diverged:
            raise LtcxError(f"{run.label} failed (exit {code}): {line} (see {root / 'run.log'}; rerun to resume)")
    curves = read_logs(root)
    tokens_per_step = spec.batch_size * run.block_size(spec)
    result = {"arch": run.arch, "size": run.shape.size, "size_label": run.shape.label, "cell": dict(run.shape.cell),
              "lr": run.lr,
              "seed": run.seed, "steps": run.steps, "tokens": run.steps * tokens_per_step, "diverged": diverged,
              "init_args": run.shape.init_args, "distance": run.shape.distance,
              "val": {tag: curve[-1][1] for tag, curve in curves.items() if curve and not diverged},
              # the validation after optimizer step s is logged at step s
              "curves": {tag: [[step * tokens_per_step, value] for step, value in curve]
                         for tag, curve in curves.items()}}
    if not diverged:
        final = latest_checkpoint(root)
        if final is None:
            raise LtcxError(f"{run.label} left no last.ckpt (see {root / 'run.log'})")
        result.update(measure(final, run.block_size(spec)), checkpoint=str(final))
        if f"val/{spec.metric}" not in result["val"]:
            raise LtcxError(f"{run.label} logged no val/{spec.metric} (see {root / 'run.log'}): choose a metric its "
                            "data logs (recall_acc: MQAR; loss; bpb: text)")
    write_json(result_file, result)
    return result


def measure(checkpoint: Path, seq_len: int) -> dict:
    """The trained model's non-embedding parameters, training FLOPs per token and state bytes after ``seq_len``
    tokens (batch 1, its dtype): the figures the ladder and the tables use."""
    from ltcx.lm import LanguageModel
    from ltcx.persist import load_language_model
    from ltcx.study.budget import non_embedding_parameters

    backbone = load_language_model(checkpoint, model_class=LanguageModel)[0].backbone
    return {"params": non_embedding_parameters(backbone), "all_params": backbone.parameter_count(),
            "flops_per_token": float(backbone.flops_per_token(seq_len)),
            "state_bytes": int(backbone.state_bytes(seq_len))}


def evaluate_test(spec: StudySpec, run: Run, out: Path, say: Callable[[str], None], env: dict | None = None,
                  keep_fds: tuple[int, ...] = ()) -> dict:
    """A finished run's metrics on the data's test split, from the ``test_metrics.json`` its fit wrote
    (``--test_after_fit``) or else from ``ltcx test`` of its checkpoint (``test/loss``, ``test/bpb``,
    ``test/recall_acc``), kept as the run's ``test.json``."""
    root = run.folder(out)
    kept = root / "test.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    result = json.loads((root / "result.json").read_text())
    test_root = root / "test"
    # the fit's own test (--test_after_fit), of the weights it trained to the end: those of result["checkpoint"]
    written = sorted(root.glob(f"lightning_logs/*/version_*/{TEST_METRICS}"), key=lambda p: p.stat().st_mtime)
    if not written:
        say(f"{run.label}: testing")
        test_root.mkdir(exist_ok=True)
        args = ["test", *common_args(spec, run), "--ckpt_path", result["checkpoint"],
                "--trainer.default_root_dir", str(test_root)]
        code = _child(args, root / "test.log", f"{run.label} (test)", env=env, keep_fds=keep_fds)
        if code != 0:
            raise LtcxError(f"{run.label}: ltcx test failed (exit {code}): {last_line(root / 'test.log')} "
                            f"(see {root / 'test.log'})")
        written = sorted(test_root.rglob(TEST_METRICS), key=lambda p: p.stat().st_mtime)
    if not written:
        raise LtcxError(f"{run.label}: ltcx test wrote no test_metrics.json under {test_root} (this ltcx has no test "
                        "split)")
    metrics = {k: float(v) for k, v in json.loads(written[-1].read_text()).items() if isinstance(v, (int, float))}
    if f"test/{spec.metric}" not in metrics:
        raise LtcxError(f"{run.label}: {written[-1]} has no test/{spec.metric} (it has {', '.join(metrics)})")
    write_json(kept, metrics)
    return metrics


def execute_job(spec: StudySpec, job: Job, out: Path, say: Callable[[str], None], env: dict | None = None,
                where: str = "") -> dict | str:
    """One launcher job under its run's claim: train the run (a final run trained in the tuning phase goes straight
    to its test) and, for a final run, test it; its result, or ``CLAIMED`` when another process holds the claim.
    The claim's descriptor goes to each child, so it is held until they are gone too."""
    root = job.run.folder(out)
    fd = try_claim(root)
    if fd is None:
        return CLAIMED
    try:
        trained = root / "result.json"
        result = json.loads(trained.read_text()) if trained.is_file() else train(
            spec, job.run, out, say, env=env, keep_fds=(fd,), where=where, test=job.test)
        if job.test and not result.get("diverged"):
            result = {**result, "test": evaluate_test(spec, job.run, out, say, env=env, keep_fds=(fd,))}
        return result
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- selection


def rank_key(spec: StudySpec, result: dict) -> tuple:
    """Smaller is better: diverged or non-finite last, then the metric in its direction, then the validation loss,
    then the smaller rate."""
    value = result.get("val", {}).get(f"val/{spec.metric}")
    if result.get("diverged") or value is None or not math.isfinite(value):
        return (1, 0.0, 0.0, result["lr"])
    loss = result["val"].get("val/loss", math.inf)
    return (0, -value if spec.higher_is_better else value, loss if math.isfinite(loss) else math.inf, result["lr"])


def select_learning_rates(spec: StudySpec, tuning: list[dict]) -> dict[tuple[str, str], dict]:
    """(arch, size label) -> {"lr", "edge", "grid": [{lr, value, diverged}]}: the best rate of the tuning seed by the
    validation split alone; ``edge`` when it is the grid's smallest or largest (of several): widen the grid there."""
    chosen: dict[tuple[str, str], dict] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for result in tuning:
        groups.setdefault((result["arch"], result["size_label"]), []).append(result)
    grid = sorted(spec.learning_rates)
    for key, results in groups.items():
        best = min(results, key=lambda r: rank_key(spec, r))
        edge = len(grid) > 1 and best["lr"] in (grid[0], grid[-1])
        chosen[key] = {"lr": best["lr"], "edge": edge, "all_diverged": rank_key(spec, best)[0] == 1,
                       "grid": [{"lr": r["lr"], "value": r.get("val", {}).get(f"val/{spec.metric}"),
                                 "diverged": r.get("diverged", False)} for r in sorted(results, key=lambda r: r["lr"])]}
    return chosen


# ----------------------------------------------------------------------------- the study


def check_folder(spec: StudySpec, out: Path) -> None:
    """A results folder holds one study: a rerun with another spec under the same name is one line, before
    anything runs."""
    stored = out / "spec.json"
    if stored.is_file():
        before = json.loads(stored.read_text())
        now = json.loads(json.dumps(spec.defining()))
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"{out} holds a study with another '{changed[0]}' ({before.get(changed[0])!r}, now "
                              f"{now.get(changed[0])!r}): give the study another name (--name) or restore the spec")


def run_study(spec: StudySpec, out: Path, dry_run: bool = False, say: Callable[[str], None] = print,
              retime: bool = False, launcher: dict | None = None, report_only: bool = False) -> dict | None:
    """Plan, tune, train every seed and test it, then time and write the summary and the report
    (``write_summary``); with ``dry_run`` print what would run where and run nothing; with ``report_only`` write the
    report from the runs finished so far and run nothing. ``launcher``: the command line's launcher options over the
    spec's (``ltcx/study/launch.py``). Returns the summary; raises ``StudyFailed`` after it when runs failed."""
    check_folder(spec, out)
    composed_configs(spec)  # a bad path is one line now, not after the first run
    shapes = plan_shapes(spec)
    tuning_runs = [make_run(spec, shape, lr, spec.tune_seed) for shape in shapes for lr in spec.learning_rates]
    launch = make_launcher(spec, out, say, execute_job, launcher)
    if dry_run:
        _print_plan(spec, out, shapes, tuning_runs, say, launch)
        return None
    if report_only:
        return _report_from_folder(spec, out, shapes, tuning_runs, say, retime)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "spec.json", spec.defining())
    total = len(tuning_runs) + len(shapes) * (len(spec.seeds) - 1)
    say(f"study {spec.name}: {len(shapes)} shapes x {len(spec.learning_rates)} learning rates on seed "
        f"{spec.tune_seed}, then {len(spec.seeds)} seeds: {total} runs in {out} ({launch.kind} launcher)")
    tuned_results = launch.map([Job(run) for run in tuning_runs], "tune")
    tuning = [result for result in tuned_results if result is not None]
    chosen = select_learning_rates(spec, tuning)
    held = list(dict.fromkeys(f"{run.arch} {run.shape.label}" for run, result in zip(tuning_runs, tuned_results)
                              if result is None))
    if held:  # its rate is chosen from the whole grid or not at all
        say(f"tune: {', '.join(held)}: a tuning run failed, so no seeds run there until it is rerun")
    # seed by seed: a stopped study has whole seeds of every architecture first; the tuning seed's run at the chosen
    # rate is that seed's run (done, then tested)
    final_runs = [make_run(spec, shape, chosen[(shape.arch, shape.label)]["lr"], seed) for seed in spec.seeds
                  for shape in shapes if f"{shape.arch} {shape.label}" not in held]
    final = [result for result in launch.map([Job(run, test=True) for run in final_runs], "seeds")
             if result is not None]
    for result in final:
        result.setdefault("test", {})  # a diverged run has no test
    summary = write_summary(spec, out, tuning, final, chosen, say, retime) if final else None
    if launch.failed:
        raise StudyFailed(launch.failed)
    return summary


def _report_from_folder(spec: StudySpec, out: Path, shapes: list[Shape], tuning_runs: list[Run],
                        say: Callable[[str], None], retime: bool = False) -> dict:
    """The summary of the runs finished so far (``--report_only``): shapes whose tuning grid is complete, their
    seeds that were tested."""
    from ltcx.study.launch import finished

    if not (out / "spec.json").is_file():
        raise LtcxError(f"{out} holds no study yet: run `ltcx study` with this spec first")
    tuning = [r for r in (finished(spec, Job(run), out) for run in tuning_runs) if r is not None]
    chosen = select_learning_rates(spec, tuning)
    complete = {key for key in chosen
                if sum((r["arch"], r["size_label"]) == key for r in tuning) == len(spec.learning_rates)}
    final = [r for r in (finished(spec, Job(make_run(spec, shape, chosen[(shape.arch, shape.label)]["lr"], seed),
                                           test=True), out)
                         for seed in spec.seeds for shape in shapes if (shape.arch, shape.label) in complete)
             if r is not None]
    if not final:
        raise LtcxError(f"{out}: no run is finished and tested yet: nothing to report (run `ltcx study` first)")
    for result in final:
        result.setdefault("test", {})
    return write_summary(spec, out, tuning, final, {k: v for k, v in chosen.items() if k in complete}, say,
                         retime)


def write_summary(spec: StudySpec, out: Path, tuning: list[dict], final: list[dict], chosen: dict,
                  say: Callable[[str], None], retime: bool = False) -> dict:
    """The timing pass (``ltcx/study/timing.py``: one checkpoint per row, its lowest seed's, unless
    ``timing_rounds`` is 0), then ``summary.json``, ``summary.md``, the figures and ``report.html``."""
    from ltcx.study.report import summarize, write_report

    timing = None
    if spec.timing_rounds:
        from ltcx.study.timing import timing_pass

        checkpoints: dict[str, tuple[Path, int]] = {}
        for result in sorted(final, key=lambda r: r["seed"]):
            key = f"{result['arch']} {result['size_label']}"
            if not result.get("diverged") and result.get("checkpoint") and key not in checkpoints:
                block = int(result.get("cell", {}).get("block_size", spec.block_size))
                checkpoints[key] = (Path(result["checkpoint"]), block)
        if checkpoints:
            timing = timing_pass(out, checkpoints, spec.batch_size, spec.timing_rounds, retime, say)
    summary = summarize(spec, tuning, final, chosen, timing)
    written = write_report(summary, out)
    say(f"study {spec.name}: wrote {', '.join(str(p.relative_to(out)) for p in written)} in {out}")
    return summary


def _print_plan(spec: StudySpec, out: Path, shapes: list[Shape], tuning: list[Run], say, launch) -> None:
    say(f"study {spec.name} (dry run, nothing is trained): results in {out}, {launch.kind} launcher")
    say(f"tune: {len(tuning)} runs on seed {spec.tune_seed}")
    to_run = 0
    for run in tuning:
        done = (run.folder(out) / "result.json").is_file()
        where = "" if done or not launch.where(to_run) else f" on {launch.where(to_run)}"
        to_run += not done
        say(f"  {run.label}: {run.steps} steps [{'done' if done else 'to run'}]{where}: "
            f"ltcx {' '.join(fit_args(spec, run, run.folder(out)))}")
    others = [s for s in spec.seeds if s != spec.tune_seed]
    say(f"seeds: {len(shapes) * len(others)} runs more (seeds {', '.join(map(str, others)) or 'none'}) at each shape's "
        "chosen learning rate, then `ltcx test` on every seed's run")
    for shape in shapes:
        say(f"  {shape.arch} {shape.label}: {make_run(spec, shape, spec.learning_rates[0], 0).steps} steps x "
            f"{len(others)} seeds")
