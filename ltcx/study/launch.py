"""Launchers: where a study phase's runs train (``ltcx/study/runner.py`` hands each phase's jobs over).

- ``local``: in this process, one after another.
- ``devices``: ``workers`` slots in this process, one run per slot at a time, each run's ``ltcx fit`` child seeing its
  slot's GPUs (``CUDA_VISIBLE_DEVICES``) and its share of the cores (``OMP_NUM_THREADS`` = ``cpus_per_run``, else
  cores // workers). CPU runs with ``cpus_per_run`` fill the cores: cores // cpus_per_run slots.
- ``slurm``: one SLURM job per run (or per ``runs_per_job``) through ``submitit``, requeued on preemption or at the
  time limit; on the node the job does the same work as the other two.

Whatever launches it, a run trains only under its **claim**: an exclusive ``fcntl.flock`` on ``<run folder>/claim``,
held by the process that trains it and inherited by its ``ltcx fit`` child, so the kernel releases it when both are
gone (killed too). A launcher finding a run claimed moves on and, at the phase's end, waits for its ``result.json``,
retrying the claim: a claim won without a result means its owner died, and the run resumes from its ``last.ckpt``.
A run that fails is reported with its log's last line, and a finished run whose files are damaged with the file
and the fix (``ltcx/study/records.py``); the phase finishes the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltcx.errors import ConfigError, LtcxError
from ltcx.study.records import DamagedRecord, read_result, read_test

__all__ = ["CLAIMED", "KINDS", "Failed", "Job", "Launcher", "StudyFailed", "StudyStopped", "check_options", "claimed",
           "finished", "make_launcher", "received", "running", "signals_noted", "stop_children", "try_claim"]

KINDS = ("local", "devices", "slurm")
# launcher key -> (what it takes, check); the spec's `launcher:` and the command line's flags both pass here
OPTIONS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "kind": ("local, devices or slurm", lambda v: v in KINDS),
    "workers": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "gpus_per_run": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "cpus_per_run": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "partition": ("a SLURM partition's name", lambda v: isinstance(v, str) and bool(v)),
    "time_min": ("an integer >= 1 (minutes)", lambda v: _is_int(v) and v >= 1),
    "runs_per_job": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "folder": ("a folder for submitit's files", lambda v: isinstance(v, str) and bool(v)),
    "cluster": ("slurm, or local (submitit's local executor: tests, a machine without SLURM)",
                lambda v: v in ("slurm", "local")),
}
POLL_S = 5.0  # how often a launcher looks again at runs claimed elsewhere
MAX_RESUBMITS = 2  # a SLURM job that died without a result (killed, node lost) is submitted again this often


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(where: str, options: Any) -> dict[str, Any]:
    """``options`` checked: one line naming the bad key."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: key 'launcher' ({options!r}) must be a mapping (kind: local|devices|slurm, "
                          "workers: N, ...)")
    for key, value in options.items():
        if key not in OPTIONS:
            raise ConfigError(f"{where}: unknown key 'launcher.{key}': the keys are {', '.join(OPTIONS)}")
        what, ok = OPTIONS[key]
        if not ok(value):
            raise ConfigError(f"{where}: key 'launcher.{key}' ({value!r}) must be {what}")
    return dict(options)


@dataclass(frozen=True)
class Job:
    """One run to train; with ``test``, its ``ltcx test`` after (a final run)."""

    run: Any  # plan.Run
    test: bool = False


@dataclass(frozen=True)
class Failed:
    """A job that failed: ``line`` is its log's last line (in the runner's message); ``damaged``: it had finished,
    but a file it left is damaged (the line names the file and the fix)."""

    job: Job
    line: str
    damaged: bool = False


def failure(job: Job, error: LtcxError) -> Failed:
    return Failed(job, str(error), damaged=isinstance(error, DamagedRecord))


CLAIMED = "claimed"  # a job's answer when another process holds the run's claim


class StudyStopped(Exception):
    """A signal stopped the study: ``line`` says where, ``code`` is the exit status (128 + the signal)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line, self.code = line, code


class StudyFailed(Exception):
    """Runs failed (each reported with its log's last line) or were found damaged while the others finished:
    ``failed``, the ``Failed`` of each."""

    def __init__(self, failed: list[Failed]) -> None:
        super().__init__(f"{len(failed)} runs failed")
        self.failed = failed


# ----------------------------------------------------------------------------- signals and children

_received: list[int] = []  # SIGINT / SIGTERM this process got while children ran: noted, not acted on
_noting = [0]  # depth of signals_noted in the main thread
_running: set = set()  # the children (subprocess.Popen, prestart.ForkedRun) running now (stop_children)
_running_lock = threading.Lock()


@contextlib.contextmanager
def signals_noted():
    """While children run, SIGINT and SIGTERM are noted and not acted on: Ctrl-C reaches the whole process group, so
    each child saves its step and exits, and the study stops after them. Only the main thread sets handlers; in
    another thread, or inside an outer one, it does nothing."""
    if threading.current_thread() is not threading.main_thread() or _noting[0]:
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, lambda signum, frame: _received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    _noting[0] += 1
    try:
        yield
    finally:
        _noting[0] -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


def received() -> list[int]:
    """The signals noted since the outermost ``signals_noted`` began (start no more runs when there are any)."""
    return list(_received)


@contextlib.contextmanager
def running(child):
    """``child`` (a ``subprocess.Popen`` or ``prestart.ForkedRun``) listed as running, for ``stop_children``."""
    with _running_lock:
        _running.add(child)
    try:
        yield child
    finally:
        with _running_lock:
            _running.discard(child)


def stop_children(signum: int = signal.SIGTERM) -> None:
    """Ask every running child to save its step and exit (a SLURM job's time limit or preemption); returns once each
    has exited (left for the thread waiting on it to reap)."""
    with _running_lock:
        children = list(_running)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)
    for child in children:
        if hasattr(child, "wait_exited"):  # a run forked from the fork server (ltcx/study/prestart.py)
            child.wait_exited()
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)


# ----------------------------------------------------------------------------- the claim and one job


def try_claim(root: Path) -> int | None:
    """An exclusive lock on ``root/claim`` (a descriptor to keep open while the run trains), or None when another
    process holds it. The file says who holds it (host, pid); the lock, not the file, is the claim."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "claim", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    return fd


def claimed(root: Path) -> bool:
    """Whether another process holds ``root``'s claim now (looked at, not taken)."""
    try:
        fd = os.open(root / "claim", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def finished(spec, job: Job, out: Path) -> dict | None:
    """The job's result when it is done (``result.json``, and ``test.json`` for a final run that did not diverge),
    each checked as data: ``DamagedRecord`` when one is not what ltcx wrote."""
    try:
        result = read_result(job.run, out)
        if job.test and not result.get("diverged"):
            result["test"] = read_test(job.run, out, spec.metric)
    except FileNotFoundError:
        return None
    return result


def settled(spec, job: Job, out: Path) -> bool:
    """Whether the job is done, or its files are damaged (nothing to wait for either way)."""
    try:
        return finished(spec, job, out) is not None
    except DamagedRecord:
        return True


# ----------------------------------------------------------------------------- progress


class Progress:
    """One line per finished run (its label and val metric), then the phase's counts and the time left."""

    def __init__(self, spec, phase: str, total: int, slots: int, say: Callable[[str], None]) -> None:
        self.spec, self.phase, self.total, self.slots, self.say = spec, phase, total, slots, say
        self.done = self.failed = self.running = 0
        self.seconds: list[float] = []
        self.lock = threading.Lock()

    def started(self) -> None:
        with self.lock:
            self.running += 1

    def ended(self, job: Job, result: dict | None, seconds: float | None, failed: bool = False) -> None:
        with self.lock:
            self.running -= 1 if seconds is not None else 0
            if failed:
                self.failed += 1
                self._counts()
                return
            self.done += 1
            if seconds is not None:
                self.seconds.append(seconds)
            value = (result or {}).get("val", {}).get(f"val/{self.spec.metric}")
            figure = "diverged" if (result or {}).get("diverged") else (
                f"val/{self.spec.metric} {value:.4f}" if isinstance(value, float) else "no figure")
            self.say(f"{job.run.label}: {figure}")
            self._counts()

    def _counts(self) -> None:
        left = self.total - self.done - self.failed - self.running
        eta = ""
        if self.seconds and left + self.running:
            slots = self.slots or max(1, self.running)  # 0: a cluster's, as many as run now
            eta = f", about {_duration(sum(self.seconds) / len(self.seconds) * (left + self.running) / slots)} left"
        self.say(f"{self.phase}: done {self.done} / running {self.running} / failed {self.failed} / left {left}{eta}")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# ----------------------------------------------------------------------------- launchers


class Launcher:
    """Maps a phase's jobs to workers; ``map`` returns their results in order (None for a failed job, listed in
    ``failed``). ``work(spec, job, out, say, env=, where=)`` does one job under its claim (``processes.execute_job``:
    its result, or ``CLAIMED``). This base class runs the jobs here one after another; subclasses say where."""

    kind = "local"

    def __init__(self, spec, out: Path, say: Callable[[str], None], work: Callable[..., Any]) -> None:
        self.spec, self.out, self.work = spec, out, work
        lock = threading.Lock()

        def said(line: str) -> None:
            with lock:
                say(line)

        self.say = said
        self.failed: list[Failed] = []

    @property
    def slots(self) -> int:
        return 1

    def where(self, index: int) -> str:
        """Where the ``index``-th job of a phase would run (the dry run's words; local: nothing to say)."""
        return ""

    def map(self, jobs: Sequence[Job], phase: str) -> list[dict | None]:
        """Every job's result in order: the first pass launches them all; runs claimed elsewhere are waited for at
        the end (their result.json, or their claim won again when its owner died)."""
        results: list[dict | None] = [None] * len(jobs)
        progress = Progress(self.spec, phase, len(jobs), self.slots, self.say)
        todo, waiting, announced = list(range(len(jobs))), [], False
        while todo or waiting:
            for index, outcome in self.launch(jobs, todo, progress).items():
                if outcome == CLAIMED:
                    waiting.append(index)
                elif isinstance(outcome, Failed):
                    self.failed.append(outcome)
                else:
                    results[index] = outcome
            todo = []
            if waiting:
                if not announced:
                    self.say(f"{phase}: {len(waiting)} runs claimed by another launcher: waiting for them")
                    announced = True
                time.sleep(POLL_S)
                # finished there, or its claim free again (its owner died): launched again (a claim still held is
                # left alone, so no job is submitted to find it claimed)
                todo = [i for i in waiting if settled(self.spec, jobs[i], self.out)
                        or not claimed(jobs[i].run.folder(self.out))]
                waiting = [i for i in waiting if i not in todo]
        return results

    def launch(self, jobs: Sequence[Job], indices: list[int], progress: Progress) -> dict[int, Any]:
        """Run ``jobs[i]`` for each index: index -> result, ``CLAIMED`` or ``Failed``."""
        outcomes: dict[int, Any] = {}
        for index in indices:
            outcomes[index] = self._one(jobs[index], progress, None, "")
        return outcomes

    def _one(self, job: Job, progress: Progress, env: dict | None, where: str) -> Any:
        """One job in this process (any thread): its outcome, progress said."""
        try:
            done = finished(self.spec, job, self.out)
        except DamagedRecord as error:
            return self._failed(failure(job, error), progress, ran=False)
        if done is not None:
            self.say(f"{job.run.label}: done before, skipped")
            progress.ended(job, done, None)
            return done
        started = time.monotonic()
        progress.started()
        try:
            outcome = self.work(self.spec, job, self.out, self.say, env=env, where=where)
        except LtcxError as error:
            return self._failed(failure(job, error), progress)
        except BaseException:
            with progress.lock:
                progress.running -= 1
            raise
        if outcome == CLAIMED:
            with progress.lock:
                progress.running -= 1
            return outcome
        progress.ended(job, outcome, time.monotonic() - started)
        return outcome

    def _failed(self, failed: Failed, progress: Progress, ran: bool = True) -> Failed:
        """``failed`` said and counted (``ran``: it was counted as running)."""
        self.say(f"{failed.job.run.label}: {'DAMAGED' if failed.damaged else 'FAILED'}: {failed.line}")
        progress.ended(failed.job, None, 0.0 if ran else None, failed=True)
        return failed


class Devices(Launcher):
    """``workers`` slots in this process; a slot's runs see its GPUs (``gpus_per_run`` of them) and its cores
    (``cpus_per_run`` threads, else an equal share). Without GPUs, ``cpus_per_run`` alone sets the slots: a small
    model gains little from a second thread (torch's threads wait on each other at tiny ops), so one-thread runs
    side by side do a CPU study in less CPU and wall time (docs/recall.md measures it)."""

    kind = "devices"

    def __init__(self, spec, out: Path, say: Callable[[str], None], work: Callable[..., Any],
                 workers: int | None = None, gpus_per_run: int = 1, cpus_per_run: int | None = None) -> None:
        super().__init__(spec, out, say, work)
        from ltcx.runtime import usable_cores

        cores, gpus = usable_cores(), visible_gpus()
        per_run = max(1, gpus_per_run)
        if gpus and gpus_per_run:
            most = len(gpus) // per_run
            if most == 0:
                raise ConfigError(f"launcher devices: gpus_per_run {gpus_per_run} but this machine shows {len(gpus)} "
                                  "GPUs: lower gpus_per_run")
            workers = workers or most
            if workers > most:
                raise ConfigError(f"launcher devices: {workers} workers x {per_run} GPUs per run but this machine "
                                  f"shows {len(gpus)} GPUs: give --workers {most} or fewer")
            groups = [gpus[i * per_run:(i + 1) * per_run] for i in range(workers)]
        else:
            workers = workers or (max(1, cores // cpus_per_run) if cpus_per_run else 1)
            groups = [[] for _ in range(workers)]
        threads = cpus_per_run or max(1, cores // workers)
        # gpus_per_run 0 on a machine with GPUs: CPU runs that do not see them
        self.envs = [{"OMP_NUM_THREADS": str(threads),
                      **({"CUDA_VISIBLE_DEVICES": ",".join(g)} if g or gpus else {})} for g in groups]

    @property
    def slots(self) -> int:
        return len(self.envs)

    def _slot_words(self, slot: int) -> str:
        env = self.envs[slot]
        return f"slot {slot} (" + ", ".join(f"{k}={v}" for k, v in sorted(env.items())) + ")"

    def where(self, index: int) -> str:
        return self._slot_words(index % self.slots)

    def launch(self, jobs: Sequence[Job], indices: list[int], progress: Progress) -> dict[int, Any]:
        free = list(range(self.slots))
        lock = threading.Lock()
        outcomes: dict[int, Any] = {}
        stops: list[BaseException] = []

        def work(index: int) -> Any:
            with lock:
                slot = free.pop(0)
            try:
                if stops or received():
                    return None  # a signal or a stopped run: start nothing more
                return self._one(jobs[index], progress, self.envs[slot], self._slot_words(slot))
            finally:
                with lock:
                    free.append(slot)

        with signals_noted(), ThreadPoolExecutor(self.slots, thread_name_prefix="ltcx-slot") as pool:
            futures = {pool.submit(work, index): index for index in indices}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    try:
                        outcome = future.result()
                    except (StudyStopped, KeyboardInterrupt) as stop:
                        stops.append(stop)
                        continue
                    if outcome is not None:
                        outcomes[futures[future]] = outcome
        if stops:
            raise stops[0]
        if received():
            raise StudyStopped("study stopped by a signal between runs; run the same `ltcx study` command to resume",
                               130)
        return outcomes


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (its own list when set)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


class Slurm(Launcher):
    """One submitit job per ``runs_per_job`` runs (SLURM, or submitit's local executor with ``cluster: local``);
    a job preempted or at its time limit asks its run to save, is requeued and resumes it (``StudyJob.checkpoint``);
    one that died without a result is submitted again (``MAX_RESUBMITS``)."""

    kind = "slurm"

    def __init__(self, spec, out: Path, say: Callable[[str], None], work: Callable[..., Any],
                 partition: str | None = None,
                 time_min: int = 60 * 24, gpus_per_run: int = 1, cpus_per_run: int | None = None,
                 runs_per_job: int = 1, folder: str | None = None, cluster: str = "slurm") -> None:
        super().__init__(spec, out, say, work)
        self.partition, self.time_min, self.gpus_per_run = partition, time_min, gpus_per_run
        self.cpus_per_run, self.runs_per_job, self.cluster = cpus_per_run, runs_per_job, cluster
        self.folder = Path(folder) if folder else out / "submitit"

    @property
    def slots(self) -> int:
        return 0  # the cluster's: as many as run at once (Progress)

    def where(self, index: int) -> str:
        words = [f"job {index // self.runs_per_job}", f"{self.time_min} min", f"{self.gpus_per_run} GPUs"]
        if self.partition:
            words.insert(1, f"partition {self.partition}")
        return "SLURM " + ", ".join(words) if self.cluster == "slurm" else "submitit local " + ", ".join(words)

    def executor(self):
        try:
            import submitit
        except ImportError:
            raise LtcxError("the slurm launcher needs submitit: pip install submitit==1.5.4") from None
        executor = submitit.AutoExecutor(folder=str(self.folder), cluster=self.cluster)
        options: dict[str, Any] = {"timeout_min": self.time_min * self.runs_per_job, "nodes": 1,
                                   "tasks_per_node": 1, "gpus_per_node": self.gpus_per_run,
                                   "name": f"ltcx-{self.spec.name}"}
        if self.cpus_per_run:
            options["cpus_per_task"] = self.cpus_per_run
        if self.partition:
            options["slurm_partition"] = self.partition
        if self.cluster == "slurm":
            options["slurm_additional_parameters"] = {"requeue": True}  # SLURM's own requeue on preemption
        executor.update_parameters(**options)
        return executor

    def launch(self, jobs: Sequence[Job], indices: list[int], progress: Progress) -> dict[int, Any]:
        outcomes: dict[int, Any] = {}
        todo = []
        for index in indices:
            try:
                done = finished(self.spec, jobs[index], self.out)
            except DamagedRecord as error:
                outcomes[index] = self._failed(failure(jobs[index], error), progress, ran=False)
                continue
            if done is not None:
                self.say(f"{jobs[index].run.label}: done before, skipped")
                progress.ended(jobs[index], done, None)
                outcomes[index] = done
            else:
                todo.append(index)
        groups = [todo[i:i + self.runs_per_job] for i in range(0, len(todo), self.runs_per_job)]
        if not groups:
            return outcomes
        executor = self.executor()
        submitted = {}
        for group in groups:
            submitted[id(group)] = (group, self._submit(executor, jobs, group), 0, time.monotonic())
            for _ in group:
                progress.started()
        self.say(f"submitted {len(groups)} jobs ({len(todo)} runs) to "
                 f"{'SLURM' if self.cluster == 'slurm' else 'submitit local'}; their files in {self.folder}")
        while submitted:
            for key, (group, job, tries, started) in list(submitted.items()):
                if not job.done():
                    continue
                del submitted[key]
                try:
                    answers = job.result()
                except Exception as error:  # submitit's: the job died (killed, node lost) or raised
                    if tries < MAX_RESUBMITS and _died(error):
                        self.say(f"job {job.job_id} ended without a result (state {job.state}): submitted again")
                        submitted[key] = (group, self._submit(executor, jobs, group), tries + 1, started)
                        continue
                    answers = [Failed(jobs[i], f"{jobs[i].run.label}: job {job.job_id} failed: "
                                               f"{_last_line(error)}") for i in group]
                seconds = (time.monotonic() - started) / len(group)
                for index, answer in zip(group, answers):
                    outcomes[index] = answer
                    if answer == CLAIMED:
                        with progress.lock:
                            progress.running -= 1
                    elif isinstance(answer, Failed):
                        self._failed(answer, progress)
                    else:
                        progress.ended(jobs[index], answer, seconds)
            if submitted:
                time.sleep(1.0)
        return outcomes

    def _submit(self, executor, jobs: Sequence[Job], group: list[int]):
        return executor.submit(StudyJob(self.spec, self.out, [jobs[i] for i in group], self.work))


def _died(error: Exception) -> bool:
    """submitit's error for a job whose process ended without writing a result (killed), not one our code raised."""
    return type(error).__name__ == "UncompletedJobError"


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class StudyJob:
    """What a SLURM job runs on its node: ``work`` for each of its jobs (picklable: a spec, a folder, runs).
    submitit calls ``checkpoint`` on the time limit's or a preemption's signal: the running ``ltcx fit`` is asked to
    save its step (SIGTERM), and the same job is requeued; its runs resume from their last.ckpt."""

    def __init__(self, spec, out: Path, jobs: list[Job], work: Callable[..., Any]) -> None:
        self.spec, self.out, self.jobs, self.work = spec, out, jobs, work  # work: a module's function, pickled by name

    def __call__(self) -> list[Any]:
        answers: list[Any] = []
        for job in self.jobs:
            try:
                answers.append(self.work(self.spec, job, self.out, lambda line: print(line, flush=True)))
            except LtcxError as error:
                answers.append(failure(job, error))
            except StudyStopped as stop:
                print(f"ltcx: {stop.line}", flush=True)
                if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and stop.code == 128 + signal.SIGTERM:
                    # a preemption's SIGTERM reached every process of the job: the run saved its step, and SLURM
                    # kills and requeues this job within its grace time (a result now would end it for the launcher)
                    while True:
                        time.sleep(60)
                raise
        return answers

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit

        stop_children()  # each saves its step and exits 143; this job's claim is released once they have
        return submitit.helpers.DelayedSubmission(StudyJob(self.spec, self.out, self.jobs, self.work))


_ALLOWED = {"local": (), "devices": ("workers", "gpus_per_run", "cpus_per_run"),
            "slurm": ("partition", "time_min", "gpus_per_run", "cpus_per_run", "runs_per_job", "folder", "cluster")}


def make_launcher(spec, out: Path, say: Callable[[str], None], work: Callable[..., Any],
                  overrides: dict[str, Any] | None = None) -> Launcher:
    """The spec's ``launcher`` with the command line's ``overrides`` (typed wins; a typed kind other than the spec's
    replaces the spec's launcher, whose keys were for its own kind); ``work`` does one job."""
    typed = {k: v for k, v in (overrides or {}).items() if v is not None}
    spec_kind = spec.launcher.get("kind", "local")
    options = {**(spec.launcher if typed.get("kind", spec_kind) == spec_kind else {}), **typed}
    check_options("launcher", options)
    kind = options.pop("kind", "local")
    allowed = _ALLOWED[kind]
    extra = [k for k in options if k not in allowed]
    if extra:
        kinds = " or ".join(k for k in ("devices", "slurm") if extra[0] in _ALLOWED[k])
        raise ConfigError(f"launcher {kind}: '{extra[0]}' applies to launcher {kinds} only: leave it out or choose "
                          "that kind")
    if kind == "devices":
        return Devices(spec, out, say, work, **options)
    if kind == "slurm":
        return Slurm(spec, out, say, work, **options)
    return Launcher(spec, out, say, work)
