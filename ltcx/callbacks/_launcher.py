"""The process that launched the DDP workers outlives them in a stop every rank agreed on (``FiniteLossGuard``,
``Preemption``, ltcx's CLI), so its exit status is its own and its last lines are not lost."""

from __future__ import annotations

import atexit
import subprocess
import threading
import time

import lightning as L


def launcher_outlives_workers(trainer: L.Trainer) -> None:
    """In a stop every rank agreed on, the process that started the others (rank 0 under Lightning's ``ddp``
    launcher) exits after them, with its own exit status.

    Lightning's child-process observer in that process SIGKILLs it (exit -9, its last line maybe lost) as soon as a
    worker exits non-zero, which here each one does on purpose (2, 143); it is told there is nothing left to watch,
    and the workers are waited for when this process exits (killed after 60 s, so nothing hangs)."""
    procs = list(getattr(trainer.strategy.launcher, "procs", None) or [])
    if not procs:  # a worker, or processes started by torchrun / SLURM: each exits on its own
        return
    try:  # Lightning's private observer (lightning is pinned in requirements.txt); without it, nothing to quiet
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:
        _ChildProcessObserver = None
    for thread in threading.enumerate():
        if _ChildProcessObserver is not None and isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next poll finds all (none) fine and stops
    atexit.register(_wait_for, procs, 60.0)


def _wait_for(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
