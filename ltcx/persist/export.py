"""Weights-only exports: a folder of ``model.safetensors`` (the backbone's weights) and ``config.json`` (plain data),
to share a model without pickles. ``export_model`` writes one from a checkpoint, ``load_exported`` reads it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.persist.build import build_language_model, check_settings, damaged
from ltcx.persist.digest import file_sha256
from ltcx.persist.files import give_new_file_mode
from ltcx.persist.fit import check_backbone_fits, check_counts, check_weights_fit

__all__ = ["EXPORT_CONFIG", "EXPORT_WEIGHTS", "EXPORT_FORMAT", "export_model", "load_exported"]

EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_FORMAT = "config.json", "model.safetensors", "ltcx-export-1"


def export_model(ckpt_path: str | Path, out: str | Path, tokenizer: str | None = None) -> Path:
    """Write the model of a checkpoint to a new folder ``out`` without pickles: ``model.safetensors`` (the
    backbone's weights) and ``config.json`` (backbone class path and config, tokenizer name, hyper-parameters,
    step). ``load_exported(out)`` rebuilds it. The folder appears whole or not at all.

    tokenizer: the name to record instead of the checkpoint's. Either must be one a reader of the export may load on
    the file's word (``stored_tokenizer_name``: gpt2, bytes or a Hugging Face hub id), never a folder."""
    from safetensors.torch import save_model

    from ltcx.persist.load import load_language_model  # load reads exports too: imported here, not above
    from ltcx.tokenizers import stored_tokenizer_name

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LtcxError(f"'{out}' already exists and is not an empty folder: pass --out a new folder")
    model, meta = load_language_model(ckpt_path)
    # Whoever reads the export loads the name on the file's word (``ltcx generate``).
    only = "an export names only gpt2, bytes or a Hugging Face hub id"
    if tokenizer is not None:
        tokenizer = stored_tokenizer_name(tokenizer, "--tokenizer", only)
    else:
        tokenizer = stored_tokenizer_name(
            meta.get("tokenizer"), f"checkpoint '{ckpt_path}' names tokenizer",
            f"{only}: pass --tokenizer with the tokenizer's hub id",
        )
    config = {
        "format": EXPORT_FORMAT,
        "backbone_class": meta["backbone_class"],
        "backbone_config": meta["backbone_config"],
        "tokenizer": tokenizer,
        "tokens_seen": meta.get("tokens_seen", 0),
        "hyper_parameters": {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.hparams.items()},
    }
    for key in ("global_step", "train_block_size"):  # the training length: `ltcx evaluate --max_len 4x`
        if meta.get(key) is not None:
            config[key] = meta[key]
    try:
        json.dumps(config)
    except TypeError as error:
        raise LtcxError(f"checkpoint '{ckpt_path}' holds a config that is not plain data ({error})") from None
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    made = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]  # deepest first
    replaced = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
        try:
            save_model(model.backbone, str(temp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        except Exception as error:  # noqa: BLE001 - safetensors' own error type: the OS error is in its message
            raise _os_error(error) from None
        config["weights_sha256"] = file_sha256(temp / EXPORT_WEIGHTS)  # checked by load_exported
        with open(temp / EXPORT_CONFIG, "w") as f:
            f.write(json.dumps(config, indent=2) + "\n")
        for written in (EXPORT_WEIGHTS, EXPORT_CONFIG):  # safetensors writes through a 0o600 temp file
            give_new_file_mode(temp / written)
            _fsync(temp / written)
        if out.exists() and os.name == "nt":  # POSIX renames over the empty folder (checked above) in one step
            out.rmdir()
        os.replace(temp, out)
        replaced = True
        _fsync(out.parent)  # the rename itself
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)
        for folder in made if not replaced else ():  # the folders made for it, if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or str(error))
        kept = "the export there may not survive a power loss" if replaced else "nothing was written"
        raise LtcxError(f"cannot write '{out}' ({reason}); {kept}: free space or pass --out a folder on another "
                        "disk") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out


def _os_error(error: Exception) -> Exception:
    """The ``OSError`` a safetensors write failed with, read from its message ('I/O error: No space left on device
    (os error 28)'); any other error as it is."""
    found = re.search(r"os error (\d+)", str(error))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else error


def _fsync(path: Path) -> None:
    """Flush a written file, or a folder's entries (a rename), to the disk, where the system can."""
    if path.is_dir() and not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_exported(folder: str | Path, map_location: str | torch.device = "cpu") -> tuple[LanguageModel, dict]:
    """Rebuild a LanguageModel from a folder written by ``export_model`` / ``ltcx export``: ``config.json`` is read
    as data and names the backbone class, looked up in ltcx's registry; ``model.safetensors`` holds only tensors.
    Returns the model in eval mode and its metadata (backbone class and config, tokenizer name)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    folder = Path(folder)
    source = f"exported model '{folder}'"
    try:
        config = json.loads((folder / EXPORT_CONFIG).read_text())
    except FileNotFoundError:
        raise LtcxError(f"'{folder}' has no {EXPORT_CONFIG}: pass a folder written by `ltcx export`") from None
    except (OSError, ValueError) as error:
        raise LtcxError(f"{source}: {EXPORT_CONFIG} could not be read ({error})") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise LtcxError(f"{source}: {EXPORT_CONFIG} was not written by `ltcx export` (format {EXPORT_FORMAT})")
    check_counts(source, {f"{EXPORT_CONFIG}'s {key}": (config.get(key), least)
                          for key, least in (("global_step", 0), ("tokens_seen", 0), ("train_block_size", 1))})
    check_settings(config, config.get("hyper_parameters", {}), source,
                   (f"{EXPORT_CONFIG}'s hyper_parameters.", f"{EXPORT_CONFIG}'s backbone_config."))
    weights = folder / EXPORT_WEIGHTS
    if not weights.is_file():
        raise LtcxError(f"{source} has no {EXPORT_WEIGHTS}: export it again")
    expected = config.get("weights_sha256")
    if expected is None:
        print(f"ltcx: {source} has no weights_sha256 in {EXPORT_CONFIG} (exported by an earlier ltcx), so its "
              f"{EXPORT_WEIGHTS} could not be checked for damage", file=sys.stderr)
    elif not isinstance(expected, str) or not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise LtcxError(f"{source} has {EXPORT_CONFIG}'s weights_sha256 {expected!r:.80}, which is not a SHA-256 (64 "
                        "hex digits): export it again from its checkpoint")
    elif file_sha256(weights) != expected:
        raise LtcxError(f"{source} is damaged: its {EXPORT_WEIGHTS} does not match the SHA-256 in its {EXPORT_CONFIG} "
                        "(bytes changed on disk or in transfer); export it again from its checkpoint")
    try:  # the header only: names and shapes, no tensor read
        with safe_open(str(weights), framework="pt") as f:
            stored = {name: f.get_slice(name).get_shape() for name in f.keys()}
    except Exception as error:  # noqa: BLE001 - not a safetensors file (truncated, overwritten): one line
        raise damaged(source, error) from None
    check_backbone_fits(source, config, stored, each_tensor_once=True)  # before the model is built
    model = build_language_model(config, config.get("hyper_parameters", {}), source,
                                 (f"{EXPORT_CONFIG}'s hyper_parameters.", f"{EXPORT_CONFIG}'s backbone_config."))
    check_weights_fit(source, stored, _one_name_per_tensor(model.backbone.state_dict(), stored))
    try:
        load_model(model.backbone, str(weights), strict=True, device=str(torch.device(map_location)))
    except Exception as error:  # noqa: BLE001 - a damaged file or weights of another config: one line
        raise damaged(source, error) from None
    model.tokens_seen, model.saved_tokenizer = config.get("tokens_seen", 0), config.get("tokenizer")
    keys = ("backbone_class", "backbone_config", "tokenizer", "tokens_seen", "global_step", "train_block_size")
    meta = {k: config.get(k) for k in keys}
    return model.eval(), meta


def _one_name_per_tensor(state_dict: dict[str, torch.Tensor], present) -> dict[str, torch.Tensor]:
    """``state_dict`` with tied weights (one tensor under several names) under one name: one ``present`` in the
    file if any (safetensors stores a shared tensor once, under any of its names), else the first."""
    groups: dict[tuple, list[str]] = {}
    for name, value in state_dict.items():
        key = (value.data_ptr(), tuple(value.shape), value.stride()) if value.numel() else ("empty", name)
        groups.setdefault(key, []).append(name)
    kept = {}
    for names in groups.values():
        name = next((n for n in names if n in present), names[0])
        kept[name] = state_dict[name]
    return kept
