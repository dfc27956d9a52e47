"""Checkpoint files: read as data only, written atomically, never with non-finite weights.

Every checkpoint a user hands us (``ltcx generate``, ``load_language_model``, ``fit/validate/test/predict
--ckpt_path``) goes through ``read_checkpoint``: ``torch.load(weights_only=True)``, which only rebuilds
tensors and plain containers, so a crafted file can not run code. ``SafeCheckpointIO`` is the Lightning
``CheckpointIO`` the CLI installs: it reads through ``read_checkpoint`` and writes a temp file in the target's
own directory, fsyncs it and ``os.replace`` s it over the target, so a file on disk is either the previous
complete checkpoint or the new complete one, whatever kills the process. Each file carries a SHA-256 digest of its
contents (``content_digest``), written with it and checked by ``read_checkpoint``: torch's zip reader does not check
its records' CRCs, so a flipped byte in a tensor would otherwise load silently.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
import re
import shutil
import sys
from typing import Any, Mapping

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ltcx.errors import LtcxError

__all__ = ["read_checkpoint", "atomic_save", "atomic_copy", "content_digest", "remove_stale_temps",
           "non_finite_weights", "SafeCheckpointIO", "latest_last_checkpoint", "checkpoint_in_folder",
           "weight_differences", "check_weights_fit", "unknown_settings"]


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
    _check_digest(name, checkpoint)
    return checkpoint


# The digest of a checkpoint's contents, saved in the file under this key: {"sha256": hex, "version": 1}.
DIGEST_KEY, DIGEST_VERSION = "ltcx_digest", 1


def content_digest(obj: Any) -> str:
    """SHA-256 of ``obj`` walked canonically: each container's type and length, then its items in order (dict keys
    in insertion order, which pickle keeps; sets sorted); each tensor's dtype, shape and raw bytes (contiguous, as
    uint8, so bf16 works); other values by type and ``repr`` (exact for floats, nan and -0.0 included)."""
    sha = hashlib.sha256()

    def put(tag: str, data: bytes | memoryview = b"") -> None:
        data = memoryview(data)
        sha.update(f"{tag}:{data.nbytes}:".encode())
        sha.update(data)

    def walk(value: Any) -> None:
        if torch.is_tensor(value):
            tensor = value.detach().cpu().contiguous().reshape(-1)
            put("tensor", f"{tensor.dtype}{list(value.shape)}".encode())
            put("data", tensor.view(torch.uint8).numpy())
        elif isinstance(value, Mapping):
            put(type(value).__name__, str(len(value)).encode())
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            put(type(value).__name__, str(len(value)).encode())
            for item in items:
                walk(item)
        elif isinstance(value, str):
            put("str", value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, (bytes, bytearray)):
            put(type(value).__name__, value)
        else:
            put(type(value).__name__, repr(value).encode())

    walk(obj)
    return sha.hexdigest()


def _with_digest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (not changed) plus its digest, under the last key."""
    contents = {k: v for k, v in checkpoint.items() if k != DIGEST_KEY}
    return {**contents, DIGEST_KEY: {"sha256": content_digest(contents), "version": DIGEST_VERSION}}


def _check_digest(name: str, checkpoint: dict[str, Any]) -> None:
    """Take the digest out of ``checkpoint`` and check it; a file without one (torch.save, an earlier ltcx) is one
    notice line."""
    saved = checkpoint.pop(DIGEST_KEY, None)
    if saved is None:
        if getattr(rank_zero_only, "rank", 0) == 0:
            print(f"ltcx: checkpoint '{name}' has no SHA-256 digest (written by torch.save or an earlier ltcx), so "
                  "it could not be checked for damage", file=sys.stderr)
        return
    if not isinstance(saved, dict) or saved.get("version") != DIGEST_VERSION:
        raise LtcxError(f"checkpoint '{name}' has a digest of another version of ltcx ({saved!r:.80}): "
                        f"{ANOTHER_VERSION}")
    if saved.get("sha256") != content_digest(checkpoint):
        raise LtcxError(f"checkpoint '{name}' is damaged: its contents do not match the SHA-256 digest saved with it "
                        "(bytes changed on disk or in transfer); use another checkpoint")


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


def _temp_name(path: str) -> str:
    """``<dir>/.<name>.tmp-<pid>``: in the target's own folder (so ``os.replace`` is atomic), hidden, so no
    ``*.ckpt`` glob ever matches it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


_TEMP = re.compile(r"\..+\.tmp-(\d+)")


def remove_stale_temps(folder: str | os.PathLike) -> None:
    """Remove the temp files in ``folder`` of processes that no longer run (killed mid-save)."""
    folder = os.fspath(folder)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    for name in names:
        found, temp = _TEMP.fullmatch(name), os.path.join(folder, name)
        if not found or (os.path.isdir(temp) and not os.path.islink(temp)):  # an export's temp folder: its own business
            continue
        try:
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        except PermissionError:  # alive, another user's
            pass


def _write_error(path: str, error: OSError, written: bool = False) -> LtcxError:
    """The one line for a checkpoint write that failed with ``error``."""
    reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or type(error).__name__)
    kept = "the previous checkpoint there is intact" if os.path.exists(path) else "nothing was written"
    if written:  # only making the rename durable failed
        kept = "the new checkpoint there may not survive a power loss"
    return LtcxError(f"cannot write checkpoint '{path}' ({reason}); {kept}: free space or point the checkpoint dirpath "
                     "at another disk")


def _replace_durably(write, path: str) -> None:
    """``write(temp)`` a temp file beside ``path``, fsync it and ``os.replace`` it over ``path``, then fsync the folder.
    On any failure the temp file is removed and ``path`` keeps its previous content (``_write_error`` for an
    OSError)."""
    folder = os.path.dirname(path) or "."
    temp = _temp_name(path)
    replaced = False
    try:
        os.makedirs(folder, exist_ok=True)
        remove_stale_temps(folder)
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)  # this process's own leftover (a link would redirect the write)
        write(temp)
        os.replace(temp, path)
        replaced = True
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
            raise _write_error(path, error, written=replaced) from None
        raise


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` through ``<dir>/.<name>.tmp-<pid>``, fsync and ``os.replace``; a dict gets
    its digest (``content_digest``) under ``DIGEST_KEY``, so file and digest are written in one step.

    On any failure the temp file is removed and ``path`` keeps its previous content; an ``OSError`` (disk
    full, no permission) becomes one ``LtcxError`` line.
    """
    path = os.fspath(path)
    buffer = io.BytesIO()  # serialise first: a failing write is then a plain OSError, not torch's zip error
    torch.save(_with_digest(obj) if isinstance(obj, dict) else obj, buffer)

    def write(temp: str) -> None:
        with open(temp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())

    _replace_durably(write, path)


def atomic_copy(source: str, path: str) -> None:
    """Copy the file ``source`` to ``path`` as ``atomic_save`` writes: whole or not at all."""

    def write(temp: str) -> None:
        shutil.copyfile(source, temp)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())

    _replace_durably(write, path)


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` reading with ``read_checkpoint`` and writing with ``atomic_save``,
    refusing to write non-finite weights. Remote paths (``s3://``...) keep Lightning's own writer (with the digest)."""

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
        local = _local_path(path)
        if storage_options is not None or local is None:
            super().save_checkpoint(_with_digest(checkpoint), path, storage_options)
        else:
            atomic_save(checkpoint, local)


def _local_path(path: str | os.PathLike) -> str | None:
    """``path`` as a local file name (``file://`` URLs too: fsspec would write them through a temp file in /tmp and a
    copy, which a full disk leaves half-written), None for a remote URL (``s3://``...)."""
    text = os.fspath(path)
    if "://" not in text:
        return text
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, local = fsspec.core.url_to_fs(text)
    return local if isinstance(fs, LocalFileSystem) else None
