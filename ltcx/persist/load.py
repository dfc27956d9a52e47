"""Load a model from any file ltcx writes: a checkpoint, a checkpoint folder (its latest run's) or an export."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ltcx.lm import LanguageModel
from ltcx.persist.build import build_language_model, damaged
from ltcx.persist.checkpoint import read_checkpoint
from ltcx.persist.export import EXPORT_CONFIG, load_exported
from ltcx.persist.fit import check_weights_fit
from ltcx.persist.runs import checkpoint_in_folder

__all__ = ["load_language_model"]


def load_language_model(ckpt_path: str | Path, map_location: str | torch.device = "cpu") -> tuple[LanguageModel, dict]:
    """Rebuild a LanguageModel and its backbone from a checkpoint written by ltcx, a folder written by
    ``ltcx export`` (``load_exported``), or a checkpoint folder (the latest run's ``version_N/last.ckpt``).

    The file is read as data only (``weights_only=True``) and the backbone class is looked up in ltcx's
    registry (``ltcx.models.registry``), never imported from the string in the file. Returns the model in
    eval mode and the checkpoint's ``ltcx`` metadata (backbone class and config, tokenizer name).
    """
    if os.path.isdir(ckpt_path):
        if os.path.isfile(os.path.join(ckpt_path, EXPORT_CONFIG)):
            return load_exported(ckpt_path, map_location=map_location)
        ckpt_path = checkpoint_in_folder(ckpt_path)
    checkpoint = read_checkpoint(ckpt_path, map_location=map_location)
    meta = {**checkpoint["ltcx"], "global_step": checkpoint.get("global_step")}
    model = build_language_model(meta, checkpoint.get("hyper_parameters", {}), f"checkpoint '{ckpt_path}'",
                                 ("model.", "model.backbone.init_args."))
    stored = checkpoint.get("state_dict")
    check_weights_fit(f"checkpoint '{ckpt_path}'", stored if isinstance(stored, dict) else {}, model.state_dict())
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, RuntimeError) as error:
        raise damaged(f"checkpoint '{ckpt_path}'", error) from None
    model.on_load_checkpoint(checkpoint)
    return model.eval(), meta
