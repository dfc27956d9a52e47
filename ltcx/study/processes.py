"""A study's runs as processes: each run's ``ltcx fit`` / ``ltcx test`` command line, the child process that runs it
(a fork of the fork server where the machine shows no GPU, ``ltcx/study/prestart.py``, else a fresh interpreter) and
the job a launcher hands a slot (``execute_job``: train, then test, under the run's claim).

Each run goes to its own folder ``<out>/<name>/runs/<arch>/<size>/lr<lr>/seed<S>/`` (TensorBoard logs, checkpoints,
``run.log``). ``result.json`` marks a finished run and ``test.json`` a finished test (written atomically): a finished
run is skipped and an unfinished one resumes from its ``last.ckpt``. A signal (Ctrl-C reaches the whole process
group) is left to the child, which saves its step and exits 128 + the signal; ``run_child`` then raises
``StudyStopped`` naming the run and the step.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ltcx.errors import LtcxError
from ltcx.runtime import TEST_METRICS, ltcx_command
from ltcx.study import prestart
from ltcx.study.launch import CLAIMED, Job, StudyStopped, received, running, signals_noted, try_claim
from ltcx.study.plan import Run, Shape, arch_config, composed_configs, make_run, run_steps
from ltcx.study.records import read_metrics, read_result, read_test
from ltcx.study.report import write_json
from ltcx.study.results import last_line, latest_checkpoint, measure, read_logs
from ltcx.study.spec import StudySpec

__all__ = ["common_args", "ended_by", "evaluate_test", "execute_job", "fit_args",
           "print_plan", "run_child", "train"]


# ----------------------------------------------------------------------------- command lines


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


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


def _stop_line(log: Path, signum: int) -> str:
    """The child's ``ltcx: SIGINT at step N: saved ...`` line, without its ``ltcx: ``."""
    name = signal.Signals(signum).name
    lines = [line for line in log.read_text(errors="replace").splitlines() if f"ltcx: {name} at step " in line]
    return lines[-1].split("ltcx: ", 1)[1].split("; resume with", 1)[0] if lines else f"{name} before its first step"


def run_child(args: list[str], log: Path, label: str, env: dict | None = None, keep_fds: tuple[int, ...] = ()) -> int:
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


def ended_by(code: int, log: Path) -> str:
    """Why a child exited ``code`` (not 0): the signal that killed it (-N from a wait, 128 + N from a shell), not its
    log's last line, which is then whatever it printed before (a notice at its start, not the cause); else that
    line."""
    signum = -code if code < 0 else code - 128 if 128 < code <= 128 + 64 else None
    if signum is None:
        return last_line(log)
    try:
        name = f"{signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        name = f"signal {signum}"
    return f"killed by {name}, not by an error of its own: out of memory, a time limit or a kill"


def train(spec: StudySpec, run: Run, out: Path, say: Callable[[str], None], env: dict | None = None,
          keep_fds: tuple[int, ...] = (), where: str = "", test: bool = False) -> dict:
    """Train ``run`` unless it finished before (its ``result.json``); its result. ``env``, ``keep_fds``: the child's
    (``run_child``); ``where``: the launcher's slot, said in the start line; ``test``: the fit tests its final weights
    too (``evaluate_test`` then reads that). The caller holds the run's claim (``ltcx/study/launch.py``)."""
    root = run.folder(out)
    result_file = root / "result.json"
    if result_file.is_file():
        say(f"{run.label}: done before, skipped")
        return read_result(run, out)
    args = fit_args(spec, run, root, test=test)
    checkpoint = latest_checkpoint(root)
    if checkpoint is not None:
        args += ["--ckpt_path", str(checkpoint)]  # a stopped run continues where it stopped
    root.mkdir(parents=True, exist_ok=True)
    say(f"{run.label}: training {run.steps} steps ({'resumed from ' + checkpoint.name if checkpoint else 'new'})"
        + (f" on {where}" if where else ""))
    code = run_child(args, root / "run.log", run.label, env=env, keep_fds=keep_fds)
    diverged = False
    if code != 0:
        from ltcx.callbacks.guard import FIX

        why = ended_by(code, root / "run.log")
        diverged = FIX in why  # a non-finite loss: this learning rate is too high, a result of the grid
        if not diverged:
            raise LtcxError(f"{run.label} failed (exit {code}): {why} (see {root / 'run.log'}; rerun to resume)")
    curves = read_logs(root)
    last = {tag: curve[-1][1] for tag, curve in curves.items() if curve}
    # a non-finite validation figure at the end ranks the rate last, as a non-finite loss does (records refuse it)
    diverged = diverged or not all(math.isfinite(value) for value in last.values())
    tokens_per_step = spec.batch_size * run.block_size(spec)
    result = {"arch": run.arch, "size": run.shape.size, "size_label": run.shape.label, "cell": dict(run.shape.cell),
              "lr": run.lr,
              "seed": run.seed, "steps": run.steps, "tokens": run.steps * tokens_per_step, "diverged": diverged,
              "init_args": run.shape.init_args, "distance": run.shape.distance,
              "val": {} if diverged else last,
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


def evaluate_test(spec: StudySpec, run: Run, out: Path, say: Callable[[str], None], env: dict | None = None,
                  keep_fds: tuple[int, ...] = ()) -> dict:
    """A finished run's metrics on the data's test split, from the ``test_metrics.json`` its fit wrote
    (``--test_after_fit``) or else from ``ltcx test`` of its checkpoint (``test/loss``, ``test/bpb``,
    ``test/recall_acc``), kept as the run's ``test.json``."""
    root = run.folder(out)
    kept = root / "test.json"
    if kept.is_file():
        return read_test(run, out, spec.metric)
    result = read_result(run, out)
    test_root = root / "test"
    # the fit's own test (--test_after_fit), of the weights it trained to the end: those of result["checkpoint"]
    written = sorted(root.glob(f"lightning_logs/*/version_*/{TEST_METRICS}"), key=lambda p: p.stat().st_mtime)
    if not written:
        say(f"{run.label}: testing")
        test_root.mkdir(exist_ok=True)
        args = ["test", *common_args(spec, run), "--ckpt_path", result["checkpoint"],
                "--trainer.default_root_dir", str(test_root)]
        code = run_child(args, root / "test.log", f"{run.label} (test)", env=env, keep_fds=keep_fds)
        if code != 0:
            raise LtcxError(f"{run.label}: ltcx test failed (exit {code}): {ended_by(code, root / 'test.log')} "
                            f"(see {root / 'test.log'})")
        written = sorted(test_root.rglob(TEST_METRICS), key=lambda p: p.stat().st_mtime)
    if not written:
        raise LtcxError(f"{run.label}: ltcx test wrote no test_metrics.json under {test_root} (this ltcx has no test "
                        "split)")
    metrics = read_metrics(written[-1], root)
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
        result = read_result(job.run, out) if trained.is_file() else train(
            spec, job.run, out, say, env=env, keep_fds=(fd,), where=where, test=job.test)
        if job.test and not result.get("diverged"):
            result = {**result, "test": evaluate_test(spec, job.run, out, say, env=env, keep_fds=(fd,))}
        return result
    finally:
        os.close(fd)

# ----------------------------------------------------------------------------- the plan, printed


def print_plan(spec: StudySpec, out: Path, shapes: list[Shape], tuning: list[Run], say, launch,
               rate: float | None = None) -> None:
    """What would run where, each run's command, and the study's estimated CPU time (``ltcx/study/cost.py``) at
    ``rate`` FLOPs per CPU-second (default: measured here)."""
    say(f"study {spec.name} (dry run, nothing is trained): results in {out}, {launch.kind} launcher")
    say(f"tune: {len(tuning)} runs on seed {spec.tune_seed}")
    to_run = 0
    for run in tuning:
        done = (run.folder(out) / "result.json").is_file()
        where = "" if done or not launch.where(to_run) else f" on {launch.where(to_run)}"
        to_run += not done
        say(f"  {run.label}: {run.steps} steps [{'done' if done else 'to run'}]{where}: "
            f"ltcx {' '.join(fit_args(spec, run, run.folder(out)))}")
    if spec.lr_extend and len(spec.learning_rates) > 1:
        say(f"extend: up to {spec.lr_extend} rates more per shape, one at a time outward by the grid's ratio, "
            "while its chosen rate is at the edge of the rates tried")
    others = [s for s in spec.seeds if s != spec.tune_seed]
    say(f"seeds: {len(shapes) * len(others)} runs more (seeds {', '.join(map(str, others)) or 'none'}) at each shape's "
        "chosen learning rate, then `ltcx test` on every seed's run")
    for shape in shapes:
        say(f"  {shape.arch} {shape.label}: {make_run(spec, shape, spec.learning_rates[0], 0).steps} steps x "
            f"{len(others)} seeds")
    from ltcx.study.cost import START_S, measured_rate, measured_step_s, study_estimate

    start_s = START_S["forked" if prestart.available() else "fresh"]
    from ltcx.models.catalog import CATALOG

    steps = {arch: measured_step_s(arch) for arch in dict.fromkeys(s.arch if s.arch in CATALOG else "gpt"
                                                                      for s in shapes)}
    base, grown = study_estimate(spec, shapes, tuning, rate or measured_rate(), steps, start_s)
    say(f"estimated CPU time: {base.describe()}" + (f"; the grid's extensions add at most {grown.describe()}"
                                                     if grown.processes else ""))
