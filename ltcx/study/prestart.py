"""A study's runs started from a pre-imported process: Python's ``multiprocessing`` fork server with ltcx's Lightning
command line preloaded.

A fresh ``ltcx fit`` spends seconds of CPU importing torch, Lightning (which imports torchmetrics, and through it
scipy.signal and transformers) and torch._dynamo before its first step; the quick-recall preset starts 96 of them.
The fork server imports all that once (and measures the CPU's matmul rate for MFU once: ``ltcx/study/preload.py``),
and each run is a fork of it: a new process with nothing of any other run in it, which starts training in under a
second. Each run is still its own process, with its own log, exit code, claim
and signals, as a subprocess (``processes.run_child``); a test holds a forked run to a fresh one bit for bit. The
command line is imported by name in the fork server (``ltcx/runtime.py``), never by the study.

Used only where the machine shows no GPU: a fork must not inherit an initialised CUDA driver, and a GPU run is long
enough that its start does not matter. ``LTCX_STUDY_FORKSERVER=0`` starts every run as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
from multiprocessing import reduction

from ltcx import runtime

__all__ = ["ForkedRun", "available", "start", "stop"]

# what a run imports before its first step, and the CPU's matmul rate
PRELOAD = [*runtime.LIGHTNING_MODULES, "ltcx.study.preload"]
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def available() -> bool:
    """Whether this process starts its runs from the fork server: no GPU visible and not switched off."""
    from ltcx.study.launch import visible_gpus

    return os.environ.get("LTCX_STUDY_FORKSERVER", "1") != "0" and not visible_gpus()


class _Inherited:
    """A descriptor the forked run keeps open (its claim, as ``pass_fds`` keeps it for a subprocess): sent to the
    fork server with the run's request (``reduction.DupFd`` while the request is pickled)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _Inherited._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _run(args: list[str], log: str, env: dict[str, str], kept: list[int]) -> None:
    """In the forked child: the run's environment (all of it) and log, then ``ltcx args``; exits with its code
    (``kept``: the inherited descriptors, open until the process ends)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # as processes.run_child blocks it for a subprocess
    os.environ.clear()
    os.environ.update(env)  # the launcher's environment now, as a subprocess gets it, not the server's at its start
    if env.get("OMP_NUM_THREADS"):
        import torch

        # a fresh process's OpenMP reads OMP_NUM_THREADS when torch loads; the fork server loaded it without
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    stream = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(stream, 1)
    os.dup2(stream, 2)
    os.close(stream)
    try:
        runtime.run_ltcx(args)
    finally:  # what an interpreter runs at its exit (a DDP launcher rank waits for its workers there), which a
        atexit._run_exitfuncs()  # multiprocessing child, ending in os._exit, would skip


class ForkedRun:
    """A run forked from the fork server, what ``processes.run_child`` and ``launch.stop_children`` ask of a
    ``subprocess.Popen``: its ``pid``, ``wait()`` for its exit code (-N: killed by signal N), and ``wait_exited()``
    (it is the fork server's child, not this process's, so ``os.waitid`` cannot wait for it)."""

    def __init__(self, process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode

    def wait_exited(self) -> None:
        multiprocessing.connection.wait([self.process.sentinel])


def start(args: list[str], log, env: dict[str, str], keep_fds: tuple[int, ...] = ()) -> ForkedRun:
    """``ltcx args`` as a fork of the fork server (started on first use), output appended to ``log``, ``env`` on top
    of this process's environment, ``keep_fds`` inherited."""
    kept = [_Inherited(fd) for fd in keep_fds]
    process = _context.Process(target=_run, args=(list(args), str(log), {**os.environ, **env}, kept))
    process.start()
    return ForkedRun(process)


def stop() -> None:
    """Stop the fork server and reap it, so its CPU time and its runs' are counted with this process's children
    (``time ltcx study``, ``ltcx evaluate``'s long-context runs); the next ``start`` starts a new one. Runs at this
    process's exit (unreaped, the server would exit by itself, its CPU time uncounted); a no-op without a server."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
        server._stop()


atexit.register(stop)
