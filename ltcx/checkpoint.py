"""Checkpoint files: read as data only, written atomically, never with non-finite weights.

Every checkpoint a user hands us (``ltcx generate``, ``load_language_model``, ``fit/validate/test/predict
--ckpt_path``) goes through ``read_checkpoint``: ``torch.load(weights_only=True)``, which only rebuilds
tensors and plain containers, so a crafted file can not run code. ``SafeCheckpointIO`` is the Lightning
``CheckpointIO`` the CLI installs: it reads through ``read_checkpoint`` and writes a temp file in the target's
own directory, fsyncs it and ``os.replace`` s it over the target, so a file on disk is either the previous
complete checkpoint or the new complete one, whatever kills the process.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import os
import pickle
import re
from typing import Any, Mapping

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ltcx.errors import LtcxError

__all__ = ["read_checkpoint", "atomic_save", "non_finite_weights", "SafeCheckpointIO", "latest_last_checkpoint",
           "checkpoint_in_folder", "weight_differences", "check_weights_fit", "unknown_settings"]


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint dict at ``path``, loaded with ``weights_only=True``; one-line ``LtcxError`` otherwise.

    Also checks that ltcx wrote it (its ``"ltcx"`` entry names the backbone).
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise LtcxError(f"checkpoint '{name}' does not exist: pass --ckpt_path the path of a .ckpt file")
    if os.path.getsize(name) == 0:
        raise LtcxError(f"checkpoint '{name}' is empty (0 bytes): use another checkpoint")
    try:
        checkpoint = torch.load(name, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        if found:  # a well-formed file that asks for code: refuse, naming what it asks for
            raise LtcxError(
                f"checkpoint '{name}' holds more than tensors and plain data (it names {found.group(1)}); ltcx "
                "loads checkpoints as data only and will not run code from a file"
            ) from None
        raise LtcxError(f"checkpoint '{name}' could not be read (not a checkpoint file): use another one") from None
    except Exception as error:  # noqa: BLE001 - truncated, corrupt, random bytes: the same one-line answer
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        raise LtcxError(
            f"checkpoint '{name}' could not be read ({reason}); it is truncated or not a checkpoint"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("ltcx"), dict):
        raise LtcxError(f"checkpoint '{name}' was not written by ltcx (no 'ltcx' entry); train with `ltcx fit`")
    return checkpoint


def _shape(value: Any) -> list[int] | None:
    """A tensor's shape as a list (``[96, 32]``), a shape given as a sequence as one, else None."""
    if torch.is_tensor(value):
        return list(value.shape)
    if isinstance(value, (list, tuple, torch.Size)) and all(isinstance(n, int) for n in value):
        return list(value)
    return None


def weight_differences(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Why weights ``stored`` (name -> tensor or shape, as in a file) do not load into a model whose
    ``state_dict()`` is ``expected``: one phrase per name, shapes that differ first, then names the model has and
    the file lacks, then names only the file has. Empty when every name and shape agree."""
    shapes = [
        f"{name} is {_shape(stored[name])} in the file and {_shape(value)} here"
        for name, value in expected.items()
        if name in stored and _shape(stored[name]) is not None and _shape(value) is not None
        and _shape(stored[name]) != _shape(value)
    ]
    missing = [f"{name} {_shape(value)} is not in the file" for name, value in expected.items() if name not in stored]
    extra = [f"{name} {_shape(value)} is in the file only" for name, value in stored.items() if name not in expected]
    return shapes + missing + extra


ANOTHER_VERSION = "load it with the version that wrote it, or start a new run"


def unknown_settings(stored: Mapping[str, Any], accepted: Any) -> list[str]:
    """Names in ``stored`` (a checkpoint's hyper-parameters or backbone_config) that the callable ``accepted``
    (a class) does not take: settings of another version of ltcx. None when it takes ``**kwargs``."""
    import inspect

    try:
        parameters = inspect.signature(accepted).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return sorted(name for name in stored if name not in parameters and not name.startswith("_"))


def check_weights_fit(source: str, stored: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """One ``LtcxError`` line when the weights of ``source`` (``checkpoint '...'``) have other names or shapes than
    the model's ``state_dict()`` ``expected``: a readable file from another version of ltcx or another config,
    which is not a damaged file (``read_checkpoint`` says that)."""
    problems = weight_differences(stored, expected)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise LtcxError(
            f"{source} does not fit the model: {problems[0]}{more}; it was saved by another version of ltcx or "
            f"another config: {ANOTHER_VERSION}"
        )


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


def non_finite_weights(checkpoint: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``checkpoint["state_dict"]`` holding NaN or inf."""
    return [
        name for name, value in checkpoint.get("state_dict", {}).items()
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]


def _temp_prefix(path: str) -> str:
    """``<dir>/.<name>.tmp-``: a process adds its pid; hidden, so no ``*.ckpt`` glob ever matches it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-")


def _remove_stale_temps(path: str) -> None:
    """Remove temp files of ``path`` left by processes that no longer run (killed mid-save)."""
    for temp in glob.glob(glob.escape(_temp_prefix(path)) + "*"):
        pid = temp.rsplit("-", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        except PermissionError:  # alive, another user's
            pass


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` through ``<dir>/.<name>.tmp-<pid>``, fsync and ``os.replace``.

    On any failure the temp file is removed and ``path`` keeps its previous content; an ``OSError`` (disk
    full, no permission) becomes one ``LtcxError`` line.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    temp = f"{_temp_prefix(path)}{os.getpid()}"
    buffer = io.BytesIO()  # serialise first: a failing write is then a plain OSError, not torch's zip error
    torch.save(obj, buffer)
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_temps(path)
        with open(temp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        if isinstance(error, OSError):
            reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or type(error).__name__)
            kept = "the previous checkpoint there is intact" if os.path.exists(path) else "nothing was written"
            raise LtcxError(
                f"cannot write checkpoint '{path}' ({reason}); {kept}: free space or point the checkpoint dirpath at "
                "another disk"
            ) from None
        raise


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` reading with ``read_checkpoint`` and writing with ``atomic_save``,
    refusing to write non-finite weights. Remote paths (``s3://``...) keep Lightning's own writer."""

    def __init__(self) -> None:
        self._handed_over: tuple[str, dict] | None = None

    def hand_over(self, path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
        """``checkpoint``, already read from ``path`` by ``read_checkpoint`` (the CLI checks it before anything is
        written), is what the next ``load_checkpoint(path)`` returns instead of reading the file again."""
        self._handed_over = (os.fspath(path), checkpoint)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        if self._handed_over is not None and self._handed_over[0] == os.fspath(path):
            checkpoint, self._handed_over = self._handed_over[1], None
            return checkpoint
        return read_checkpoint(path, map_location="cpu" if map_location is None else map_location)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        bad = non_finite_weights(checkpoint)
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise LtcxError(
                f"weights {bad[0]}{more} are not finite at step {checkpoint.get('global_step')}, so '{path}' was not "
                "written and the previous checkpoint is kept: lower model.learning_rate, raise model.warmup_steps "
                "or set trainer.gradient_clip_val"
            )
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            atomic_save(checkpoint, path)
