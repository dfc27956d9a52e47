"""The layout of a checkpoint folder: each run saves in its own ``version_N/``, its latest state as ``last.ckpt``;
``callback_state`` reads what a callback saved in a checkpoint without reading its tensors."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ltcx.errors import LtcxError

__all__ = ["run_versions", "latest_last_checkpoint", "checkpoint_in_folder", "callback_state"]

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


def callback_state(path: str | os.PathLike, key: str) -> dict[str, Any] | None:
    """The state the callback of state key ``key`` saved in the checkpoint at ``path``; None where there is none or
    the file can not be read (damaged, not a checkpoint, asking for code).

    Read as data (``weights_only=True``) and lazily (``mmap=True``: the tensors are mapped, never read), so a large
    checkpoint costs only its small pickle; its digest is not checked, that would read every tensor.
    """
    try:
        checkpoint = torch.load(os.fspath(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - truncated, corrupt, an old non-zip file, a folder: nothing to tell
        return None
    callbacks = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    state = callbacks.get(key) if isinstance(callbacks, dict) else None
    return state if isinstance(state, dict) else None
