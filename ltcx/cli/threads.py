"""Threads of torch's CPU ops, sized to the cores this process may use (its affinity and a cgroup CPU quota)."""

from __future__ import annotations

import os
import sys

import torch

from ltcx.errors import ConfigError

__all__ = ["set_cpu_threads", "usable_cores"]


def set_cpu_threads(num_threads: int | None, trainer_config, on_cpu: bool) -> None:
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
