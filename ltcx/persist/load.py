"""Load a model from any file ltcx writes: a checkpoint, a checkpoint folder (its latest run's) or an export."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.persist.build import build_language_model, damaged
from ltcx.persist.checkpoint import read_checkpoint
from ltcx.persist.export import EXPORT_CONFIG, load_exported
from ltcx.persist.fit import check_weights_fit
from ltcx.persist.runs import checkpoint_in_folder
from ltcx.tokenizers import Tokenizer, get_tokenizer, stored_tokenizer_name, vocab_fits

__all__ = ["load_language_model", "load_model_and_tokenizer"]


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
    data_hparams = checkpoint.get("datamodule_hyper_parameters")
    meta = {**checkpoint["ltcx"], "global_step": checkpoint.get("global_step"),
            "train_block_size": data_hparams.get("block_size") if isinstance(data_hparams, dict) else None}
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


def load_model_and_tokenizer(
    ckpt_path: str | Path, tokenizer: str | None = None, map_location: str | torch.device = "cpu"
) -> tuple[LanguageModel, dict, Tokenizer]:
    """``load_language_model`` plus the tokenizer to read and write its text: ``tokenizer`` (the user's
    ``--tokenizer``) else the one the file names, if it is one a file may name (``stored_tokenizer_name``); either must
    fit the model's vocabulary. Every problem is one line naming ``--tokenizer`` as the fix."""
    model, meta = load_language_model(ckpt_path, map_location=map_location)
    stored = meta.get("tokenizer")
    exported = os.path.isfile(os.path.join(ckpt_path, EXPORT_CONFIG))
    source = f"exported model '{ckpt_path}'" if exported else f"checkpoint '{ckpt_path}'"
    tokenizer_name = tokenizer or stored_tokenizer_name(
        stored, f"{source} names tokenizer",
        "ltcx loads no tokenizer folder a file names; if you trust it, pass --tokenizer FOLDER yourself",
    )
    if tokenizer_name is None:
        raise LtcxError("the checkpoint names no tokenizer: pass --tokenizer (e.g. gpt2)")
    loaded = get_tokenizer(tokenizer_name)
    model_vocab = meta.get("backbone_config", {}).get("vocab_size")
    if model_vocab is not None and not vocab_fits(loaded.vocab_size, model_vocab):
        if tokenizer in (None, stored):
            fix = f"{source} names another tokenizer than its model's: pass the --tokenizer it was trained with"
        elif stored is not None:
            fix = f"it was trained with tokenizer {stored!r}: pass that --tokenizer"
        else:
            fix = "pass the --tokenizer it was trained with"
        raise LtcxError(
            f"tokenizer {tokenizer_name!r} ({loaded.vocab_size} ids) does not fit the model's vocabulary of "
            f"{model_vocab}: {fix}"
        )
    return model, meta, loaded
