"""Checkpoint files: read as data only, written atomically, never with non-finite weights.

Every checkpoint a user hands us (``ltcx generate``, ``load_language_model``, ``fit/validate/test/predict
--ckpt_path``) goes through ``read_checkpoint``: ``torch.load(weights_only=True)``, which only rebuilds
tensors and plain containers, so a crafted file can not run code. ``SafeCheckpointIO`` is the Lightning
``CheckpointIO`` the CLI installs: it reads through ``read_checkpoint`` and writes through ``atomic_save``
(``ltcx.persist.files``), so a file on disk is either the previous complete checkpoint or the new complete one. Each
file carries a SHA-256 digest of its contents (``ltcx.persist.digest``), written with it and checked on reading, after
the model its config describes has been compared with its weights on the meta device (``check_checkpoint_sizes``);
then every weight is checked finite (``ltcx.persist.finite``).
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ltcx.errors import LtcxError, missing_checkpoint
from ltcx.persist.digest import check_digest, with_digest
from ltcx.persist.file_fits import check_backbone_fits, check_counts, current_names
from ltcx.persist.files import atomic_save
from ltcx.persist.finite import check_finite, non_finite_names

__all__ = ["read_checkpoint", "check_checkpoint_sizes", "non_finite_weights", "SafeCheckpointIO"]


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint dict at ``path``, loaded with ``weights_only=True``; one-line ``LtcxError`` otherwise.

    Also checks that ltcx wrote it (its ``"ltcx"`` entry names the backbone).
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise missing_checkpoint(name)
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
    # A file written before a backbone field was renamed is read in this version's names; the digest covers the file
    # as written.
    meta = current_names(f"checkpoint '{name}'", checkpoint["ltcx"])
    # Before the digest, which reads every tensor's bytes: sizes are checked before anything is allocated.
    check_checkpoint_sizes(name, {**checkpoint, "ltcx": meta})
    check_digest(name, checkpoint)
    weights = checkpoint.get("state_dict")
    if isinstance(weights, dict):  # none is saved non-finite: this file was damaged or edited
        check_finite(f"checkpoint '{name}'", weights.items(), "use an earlier checkpoint")
    checkpoint["ltcx"] = meta
    return checkpoint


def check_checkpoint_sizes(name: str, checkpoint: dict[str, Any]) -> None:
    """The checkpoint's backbone, as its config describes it, has its weights' names and shapes and fits in memory
    (``check_backbone_fits``: every command and loader reads checkpoints here, so none builds an impossible model),
    and its step, tokens seen and training length are counts."""
    source = f"checkpoint '{name}'"
    data = checkpoint.get("datamodule_hyper_parameters")
    check_counts(source, {
        "global_step": (checkpoint.get("global_step"), 0),
        "ltcx.tokens_seen": (checkpoint["ltcx"].get("tokens_seen"), 0),
        "datamodule_hyper_parameters.block_size": (data.get("block_size") if isinstance(data, dict) else None, 1),
    })
    weights = checkpoint.get("state_dict")
    if isinstance(weights, dict):
        check_backbone_fits(source, checkpoint["ltcx"], weights, prefix="backbone.")


def non_finite_weights(checkpoint: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``checkpoint["state_dict"]`` holding NaN or inf."""
    return non_finite_names(checkpoint.get("state_dict", {}).items())


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
            super().save_checkpoint(with_digest(checkpoint), path, storage_options)
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
