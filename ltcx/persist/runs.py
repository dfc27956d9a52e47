"""The layout of a checkpoint folder: each run saves in its own ``version_N/``, its latest state as ``last.ckpt``."""

from __future__ import annotations

import os
import re

from ltcx.errors import LtcxError

__all__ = ["run_versions", "latest_last_checkpoint", "checkpoint_in_folder"]

_LAST = re.compile(r"last(-v\d+)?\.ckpt")
_VERSION = re.compile(r"version_(\d+)")


def run_versions(folder: str | os.PathLike) -> list[int]:
    """The N of the ``version_N`` folders in ``folder``, ascending (none if it does not exist)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    found = (_VERSION.fullmatch(name) for name in os.listdir(folder))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(folder, m.group(0))))


def latest_last_checkpoint(folder: str | os.PathLike) -> list[str]:
    """The ``last.ckpt`` of the latest run under a checkpoint folder: that of the highest-numbered ``version_N/``
    holding one (each run saves in its own), else one in ``folder`` itself (the layout before run folders).

    Returns every ``last*.ckpt`` of that folder (one normally, several when runs shared it; none: no run saved).
    """
    folder = os.fspath(folder)
    for version in reversed(run_versions(folder)):
        found = _last_files(os.path.join(folder, f"version_{version}"))
        if found:
            return found
    return _last_files(folder)


def checkpoint_in_folder(folder: str | os.PathLike) -> str:
    """The one ``last.ckpt`` of the latest run under the checkpoint folder ``folder``; one line otherwise."""
    found = latest_last_checkpoint(folder)
    if len(found) != 1:
        what = f"several runs' last checkpoints ({', '.join(found)})" if found else "no run's last.ckpt"
        raise LtcxError(f"'{os.fspath(folder)}' is a folder with {what}: pass --ckpt_path the .ckpt file")
    return found[0]


def _last_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if _LAST.fullmatch(name))
