"""Files written whole or not at all: a temp file beside the target, fsync, ``os.replace``, fsync of the folder (a
folder of files, an export, likewise: ``atomic_folder``).

A file on disk is either the previous complete one or the new complete one, whatever kills the process; temp files
of processes killed mid-save are removed by the next save in that folder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
from typing import Any

import torch

from ltcx.errors import LtcxError
from ltcx.persist.digest import with_digest

__all__ = ["atomic_save", "atomic_copy", "atomic_write", "atomic_write_text", "atomic_folder", "fsync_path",
           "remove_stale_temps", "current_umask", "give_new_file_mode"]


def current_umask() -> int:
    """The process's umask, read without changing it where the system tells (Linux: ``/proc/self/status``); else
    set to 0o077 and back at once, so a file another thread creates meanwhile is at worst private, never public."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def give_new_file_mode(path: str | os.PathLike) -> None:
    """Set ``path``'s permissions to those of a file ``open()`` creates (0o666 less the umask): writers that go
    through ``tempfile`` (safetensors) leave 0o600, so a model meant to be shared would be readable by its owner
    alone."""
    os.chmod(path, 0o666 & ~current_umask())


def _temp_name(path: str) -> str:
    """``<dir>/.<name>.tmp-<pid>``: in the target's own folder (so ``os.replace`` is atomic), hidden, so no
    ``*.ckpt`` glob ever matches it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


_TEMP = re.compile(r"\..+\.tmp-(\d+)")


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def remove_stale_temps(folder: str | os.PathLike) -> None:
    """Remove the temp files in ``folder`` of processes that no longer run (killed mid-save)."""
    folder = os.fspath(folder)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    for name in names:
        found, temp = _TEMP.fullmatch(name), os.path.join(folder, name)
        if not found or (os.path.isdir(temp) and not os.path.islink(temp)):  # an export's temp folder: its own business
            continue
        if _process_gone(int(found.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)


def _remove_stale_temp_folders(parent: str, name: str) -> None:
    """Remove the temp folders ``<parent>/.<name>.tmp-<pid>`` that writes of ``name`` killed midway left behind
    (their process no longer runs): only these names, only folders."""
    pattern = re.compile(re.escape(f".{name}.tmp-") + r"(\d+)")
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        found, temp = pattern.fullmatch(entry), os.path.join(parent, entry)
        if found and os.path.isdir(temp) and not os.path.islink(temp) and _process_gone(int(found.group(1))):
            shutil.rmtree(temp, ignore_errors=True)


_CHECKPOINT_FIX = "free space or point the checkpoint dirpath at another disk"


def _write_error(path: str, error: OSError, written: bool = False, what: str = "checkpoint",
                 fix: str = _CHECKPOINT_FIX) -> LtcxError:
    """The one line for a write of ``what`` that failed with ``error``; ``fix`` tells the user what to do."""
    reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or type(error).__name__)
    kept = f"the previous {what} there is intact" if os.path.exists(path) else "nothing was written"
    if written:  # only making the rename durable failed
        kept = f"the new {what} there may not survive a power loss"
    return LtcxError(f"cannot write {what} '{path}' ({reason}); {kept}: {fix}")


def _replace_durably(write, path: str, what: str = "checkpoint", fix: str = _CHECKPOINT_FIX) -> None:
    """``write(temp)`` a temp file beside ``path``, fsync it and ``os.replace`` it over ``path``, then fsync the folder.
    On any failure the temp file is removed and ``path`` keeps its previous content (``_write_error`` for an
    OSError). The temp name holds the process id, so processes writing the same file at once never share one."""
    folder = os.path.dirname(path) or "."
    temp = _temp_name(path)
    replaced = False
    try:
        os.makedirs(folder, exist_ok=True)
        remove_stale_temps(folder)
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)  # this process's own leftover (a link would redirect the write)
        write(temp)
        fsync_path(temp)
        give_new_file_mode(temp)  # whatever ``write`` used to create it: the permissions of any file the user writes
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
            raise _write_error(path, error, replaced, what, fix) from None
        raise


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` through ``<dir>/.<name>.tmp-<pid>``, fsync and ``os.replace``; a dict gets
    its digest (``content_digest``) under ``DIGEST_KEY``, so file and digest are written in one step.

    On any failure the temp file is removed and ``path`` keeps its previous content; an ``OSError`` (disk
    full, no permission) becomes one ``LtcxError`` line.
    """
    path = os.fspath(path)
    buffer = io.BytesIO()  # serialise first: a failing write is then a plain OSError, not torch's zip error
    torch.save(with_digest(obj) if isinstance(obj, dict) else obj, buffer)

    def write(temp: str) -> None:
        with open(temp, "wb") as f:
            f.write(buffer.getbuffer())

    _replace_durably(write, path)


def atomic_copy(source: str, path: str) -> None:
    """Copy the file ``source`` to ``path`` as ``atomic_save`` writes: whole or not at all."""
    _replace_durably(lambda temp: shutil.copyfile(source, temp), path)


_OUT_FIX = "free space or pass --out a writable folder"


def atomic_write(path: str | os.PathLike, write, fix: str = _OUT_FIX) -> None:
    """``write(temp)`` fills a temp file (``<dir>/.<name>.tmp-<pid>``: give writers that infer a format from the
    name, such as matplotlib, the format), which then replaces ``path`` as ``atomic_save`` does: whole or not at
    all, also when several processes write the same file at once. An ``OSError`` is one line ending in ``fix``."""
    _replace_durably(write, os.fspath(path), "file", fix)


def atomic_write_text(path: str | os.PathLike, text: str, fix: str = _OUT_FIX) -> None:
    """``text`` (UTF-8) to ``path`` as ``atomic_write`` writes."""

    def write(temp: str) -> None:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write, fix)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a written file, or a folder's entries (a rename), to the disk, where the system can."""
    path = os.fspath(path)
    if os.path.isdir(path) and not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_folder(out: str | os.PathLike, write) -> str:
    """``write(temp)`` fills a temp folder beside ``out`` (a new or empty folder); its files get the permissions of
    any file the user writes and are fsynced, then the folder is renamed to ``out``: it appears whole or not at all.
    A full disk (any ``OSError``) is one line, and nothing is left, nor the parent folders made for it; the temp
    folders of earlier writes of ``out`` that were killed midway are removed first."""
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    temp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    made, folder = [], parent  # deepest first: the parent folders made for it
    while not os.path.exists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    replaced = False
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_temp_folders(parent, os.path.basename(out))
        shutil.rmtree(temp, ignore_errors=True)
        os.mkdir(temp)
        write(temp)
        for name in os.listdir(temp):  # safetensors, for one, writes through a 0o600 temp file
            give_new_file_mode(os.path.join(temp, name))
            fsync_path(os.path.join(temp, name))
        if os.path.exists(out) and os.name == "nt":  # POSIX renames over the empty folder in one step
            os.rmdir(out)
        os.replace(temp, out)
        replaced = True
        fsync_path(parent)  # the rename itself
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)  # before the folders made for it, which must be empty to go
        for folder in made if not replaced else ():
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or str(error))
        kept = "it may not survive a power loss" if replaced else "nothing was written"
        raise LtcxError(f"cannot write '{out}' ({reason}); {kept}: free space or pass --out a folder on another "
                        "disk") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out
