"""DDP and FSDP2 processes: the one that launched the workers (rank 0 under Lightning's launcher) watches them in
place of Lightning's observer: it outlives them in a stop every rank agreed on (``FiniteLossGuard``, ``Preemption``,
ltcx's CLI), so its exit status is its own and its last lines are not lost, and a worker that stopped on its own (a
crash, ``kill -9``, the out-of-memory killer) ends it with one line and exit 2; ``peer_stopped_line``, what a rank
whose peer is gone says."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

import lightning as L

PEER_GRACE_S = 30.0  # s the launching process waits for its own collective to find a stopped worker
POLL_S = 1.0


def peer_stopped_line(rank: int, size: int, step: int, fit: bool, stopped: int | None = None) -> str:
    """The line of rank ``rank`` whose peer process ``stopped`` (None: not known, as gloo and NCCL name an address,
    not a rank; with two ranks it is the other one) is gone."""
    if stopped is None and size == 2:
        stopped = 1 - rank
    then = ", then resume with --ckpt_path last" if fit else ""
    if stopped is not None:
        return (f"rank {stopped} of {size} stopped (it exited, crashed or was killed) at step {step}; this rank "
                f"({rank}) stops too: see rank {stopped}'s own output{then}")
    return (f"another rank of this {size}-rank run stopped (it exited, crashed or was killed) at step {step}; this "
            f"rank ({rank}) stops too: see the other ranks' output{then}")


def watch_workers(trainer: L.Trainer) -> None:
    """In the launching process, from the start of a run: Lightning's child-process observer SIGKILLs this process
    (exit -9, no word of why) within 5 s of a worker exiting non-zero, unless this process's own collective found
    the worker gone first: a race lost whenever this rank is a few seconds away from its next collective (a long
    step, a save, samples). ltcx's watch gives this rank ``PEER_GRACE_S`` to stop on its own (the CLI's one line,
    logs closed), then prints that line itself, kills the other workers (they may hang in a collective) and exits
    2."""
    procs = _workers(trainer)
    if not procs or any(isinstance(t, _WorkerWatch) and t.is_alive() for t in threading.enumerate()):
        return
    _quiet_lightning_observer()
    _WorkerWatch(trainer, procs).start()


def launcher_outlives_workers(trainer: L.Trainer) -> None:
    """In a stop every rank agreed on, the process that started the others (rank 0 under Lightning's ``ddp``
    launcher) exits after them, with its own exit status.

    Lightning's observer would SIGKILL it as soon as a worker exits non-zero, which here each one does on purpose
    (2, 143), and ltcx's watch would stop it with a line of its own: both are told there is nothing left to watch,
    and the workers are waited for when this process exits (killed after 60 s, so nothing hangs)."""
    procs = _workers(trainer)
    if not procs:  # a worker, or processes started by torchrun / SLURM: each exits on its own
        return
    _quiet_lightning_observer()
    for thread in threading.enumerate():
        if isinstance(thread, _WorkerWatch):
            thread.stand_down()
    atexit.register(_wait_for, procs, 60.0)


def _workers(trainer: L.Trainer) -> list:
    return list(getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or [])


def _quiet_lightning_observer() -> None:
    try:  # Lightning's private observer (lightning is pinned in requirements.txt); without it, nothing to quiet
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:
        return
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next poll finds all (none) fine and stops


class _WorkerWatch(threading.Thread):
    """Polls the workers every ``POLL_S``; the first that exited non-zero (local rank i + 1 is global rank
    ``node_rank * processes + i + 1``) starts the grace period, at whose end this process stops with one line."""

    def __init__(self, trainer: L.Trainer, procs: list) -> None:
        super().__init__(daemon=True, name="ltcx-worker-watch")  # ends with the process
        self._trainer = trainer
        self._procs = procs
        self._done = threading.Event()

    def stand_down(self) -> None:
        self._done.set()

    def run(self) -> None:
        while not self._done.wait(POLL_S):
            codes = [proc.poll() for proc in self._procs]
            if all(code == 0 for code in codes):
                return
            stopped = next((i for i, code in enumerate(codes) if code), None)
            if stopped is not None:
                if not self._done.wait(PEER_GRACE_S):
                    self._stop(stopped)
                return

    def _stop(self, index: int) -> None:
        trainer = self._trainer
        first = trainer.node_rank * trainer.num_devices
        line = peer_stopped_line(trainer.global_rank, trainer.world_size, trainer.global_step,
                                 trainer.state.fn == "fit", stopped=first + index + 1)
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # one stuck in a collective ignores SIGTERM
        # What the main thread printed, unless it holds a stream's lock itself (blocked on a full pipe): 2 s at most.
        flush = threading.Thread(target=_flush, daemon=True)
        flush.start()
        flush.join(2.0)
        os.write(2, f"ltcx: error: {line}\n".encode())
        os._exit(2)  # the main thread may be inside a collective that never returns


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed pipe: the line after it is what matters
            pass


def _wait_for(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
