"""Weights-only exports: a folder of ``model.safetensors`` (the backbone's weights) and ``config.json`` (plain data),
to share a model without pickles. ``export_model`` writes one from a checkpoint; ``ltcx.persist.load`` reads it
(``load_exported``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ltcx.errors import LtcxError
from ltcx.persist.digest import file_sha256
from ltcx.persist.files import atomic_folder
from ltcx.persist.load import EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_WEIGHTS, load_language_model

__all__ = ["EXPORT_CONFIG", "EXPORT_WEIGHTS", "EXPORT_FORMAT", "export_model"]


def export_model(ckpt_path: str | Path, out: str | Path, tokenizer: str | None = None, *, model_class: type) -> Path:
    """Write the model of a checkpoint (read as a ``model_class``, whose settings it checks and records) to a new
    folder ``out`` without pickles: ``model.safetensors`` (the backbone's weights) and ``config.json`` (backbone class
    path and config, tokenizer name, hyper-parameters, step). ``load_exported(out)`` rebuilds it. The folder appears
    whole or not at all.

    tokenizer: the name to record instead of the checkpoint's. Either must be one a reader of the export may load on
    the file's word (``stored_tokenizer_name``: gpt2, bytes or a Hugging Face hub id), never a folder."""
    from safetensors.torch import save_model

    from ltcx.tokenizers import stored_tokenizer_name

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LtcxError(f"'{out}' already exists and is not an empty folder: pass --out a new folder")
    model, meta = load_language_model(ckpt_path, model_class=model_class)
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
    def write(temp: str) -> None:
        try:
            save_model(model.backbone, os.path.join(temp, EXPORT_WEIGHTS), metadata={"format": "pt"})
        except Exception as error:  # noqa: BLE001 - safetensors' own error type: the OS error is in its message
            raise _os_error(error) from None
        config["weights_sha256"] = file_sha256(os.path.join(temp, EXPORT_WEIGHTS))  # checked by load_exported
        with open(os.path.join(temp, EXPORT_CONFIG), "w") as f:
            f.write(json.dumps(config, indent=2) + "\n")

    atomic_folder(out, write)
    return out


def _os_error(error: Exception) -> Exception:
    """The ``OSError`` a safetensors write failed with, read from its message ('I/O error: No space left on device
    (os error 28)'); any other error as it is."""
    found = re.search(r"os error (\d+)", str(error))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else error
