"""What the command line (``ltcx/cli/``) and the study (``ltcx/study/``) share, so that neither imports the other:
the test metrics' file (``ltcx test`` writes it, ``ltcx study`` reads it), the cores this process may use and torch's
CPU threads, and how a process runs ``ltcx`` (the fork server's entry). It imports neither package: the command line
is named here (``COMMAND_LINE``) and imported by name when a process runs it, so the only import edge between the two
is cli -> study.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from ltcx.errors import ConfigError

__all__ = ["COMMAND_LINE", "LIGHTNING_MODULES", "TEST_METRICS", "ltcx_command", "program_name", "run_ltcx",
           "set_cpu_threads", "usable_cores", "write_test_metrics"]

COMMAND_LINE = "ltcx.cli"  # the module whose main() is `ltcx`
LIGHTNING_MODULES = ("ltcx.cli.lightning",)  # what a Lightning command (fit, test) imports before its first step
TEST_METRICS = "test_metrics.json"


# ----------------------------------------------------------------------------- running ltcx


def program_name() -> str:
    """The program's name as the parsers print it: ``python -m ltcx`` (ltcx's own ``__main__.py``), ``run.py``, else
    ``ltcx`` (the console script, and any other program that calls ``main``, a test runner's included)."""
    started = Path(sys.argv[0] if sys.argv and sys.argv[0] else "ltcx")
    if started.name == "__main__.py" and started.parent.name == "ltcx":
        return "python -m ltcx"
    return "run.py" if started.name == "run.py" else "ltcx"


def ltcx_command() -> list[str]:
    """The ``ltcx`` command as a subprocess, installed or in a checkout."""
    return [sys.executable, "-c", f"import sys; sys.argv[0] = 'ltcx'; from {COMMAND_LINE} import main; main()"]


def run_ltcx(args: list[str]) -> None:
    """``ltcx args`` in this process, as ``ltcx_command`` runs it in a new one (the command line is ``sys.argv``):
    the entry of a run forked from the study's fork server (``ltcx/study/prestart.py``)."""
    sys.argv = ["ltcx", *args]
    importlib.import_module(COMMAND_LINE).main()


# ----------------------------------------------------------------------------- test metrics


def write_test_metrics(trainer, model) -> str | None:
    """``trainer``'s finished test run as one flat JSON object, written atomically by global rank 0 into
    ``trainer.log_dir``: ``test/loss``, ``test/ppl``, ``test/bpb`` (text with a tokenizer of fixed bytes per token),
    ``test/recall_acc`` (MQAR), and the ``tokens`` (and ``bytes``) of the targets scored, over every rank. Returns
    its path (None on other ranks)."""
    from ltcx.data.shard_format import write_json

    if not trainer.is_global_zero:
        return None
    metrics: dict[str, float | int] = {
        key: float(value) for key, value in sorted(trainer.callback_metrics.items(), key=lambda kv: _order(kv[0]))
        if key.startswith("test/")
    }
    metrics.update(getattr(model, "test_counts", {}))
    folder = trainer.log_dir or trainer.default_root_dir
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, TEST_METRICS)
    write_json(path, metrics)  # a non-finite loss is written as Python's json writes it (NaN, Infinity)
    shown = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items() if key.startswith("test/"))
    print(f"ltcx: test: {shown}; metrics in {path}", flush=True)
    return path


def _order(key: str) -> tuple[int, str]:
    known = ("test/loss", "test/ppl", "test/bpb", "test/recall_acc")
    return (known.index(key), key) if key in known else (len(known), key)


# ----------------------------------------------------------------------------- cores and threads


def set_cpu_threads(num_threads: int | None, trainer_config, on_cpu: bool) -> None:
    """Threads of torch's CPU ops: ``--num_threads N``, else ``OMP_NUM_THREADS`` (torch reads it), else torch's one
    per core, divided among the processes of DDP on a CPU (Lightning's launcher does that), and capped at the
    cores this process may use: a container's CPU quota, which torch does not see, counts. The number chosen is
    exported as ``OMP_NUM_THREADS``, so DDP's launcher and its processes keep it."""
    import torch

    if num_threads is not None:
        if num_threads < 1:
            raise ConfigError(f"num_threads ({num_threads}) must be >= 1 (null: one per core): fix --num_threads")
    elif os.environ.get("OMP_NUM_THREADS") or not on_cpu:
        return
    else:
        devices = trainer_config.devices
        processes = int(devices) if isinstance(devices, int) or str(devices).isdigit() else 1
        budget = max(1, usable_cores() // max(1, processes))
        if torch.get_num_threads() <= budget:
            return  # torch's default already fits (Lightning divides it for DDP)
        print(f"ltcx: {usable_cores()} usable CPU cores for {processes} process(es): {budget} torch thread(s) each, "
              f"not {torch.get_num_threads()} (--num_threads or OMP_NUM_THREADS to change)", file=sys.stderr)
        num_threads = budget
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)


def usable_cores() -> int:
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
