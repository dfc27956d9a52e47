"""Load a model from any file ltcx writes: a checkpoint, a checkpoint folder (its latest run's) or an export
(``load_exported``). The class to build is the caller's (``model_class``: ``LanguageModel`` or a subclass, which
``LanguageModel.load_from_checkpoint`` passes as itself), so nothing here imports it; its settings are checked against
that class (types, ``setting_problem``) and the backbone class is looked up in ltcx's registry, before anything is
built."""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

import torch

from ltcx.errors import ANOTHER_VERSION, LtcxError
from ltcx.models.registry import resolve_backbone
from ltcx.persist.checkpoint import read_checkpoint
from ltcx.persist.digest import file_sha256
from ltcx.persist.file_fits import (
    check_backbone_fits,
    check_counts,
    check_setting_types,
    check_weights_fit,
    current_names,
    unknown_settings,
)
from ltcx.persist.finite import check_finite
from ltcx.persist.runs import checkpoint_in_folder
from ltcx.tokenizers import Tokenizer, get_tokenizer, stored_tokenizer_name, vocab_fits

__all__ = ["EXPORT_CONFIG", "EXPORT_WEIGHTS", "EXPORT_FORMAT", "load_language_model", "load_model_and_tokenizer",
           "load_exported", "build_language_model", "check_settings", "damaged"]

M = TypeVar("M")  # the model class a caller asks for
EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_FORMAT = "config.json", "model.safetensors", "ltcx-export-1"  # `ltcx export`'s


def load_language_model(ckpt_path: str | Path, *, model_class: type[M], map_location: str | torch.device = "cpu"
                        ) -> tuple[M, dict]:
    """Rebuild a ``model_class`` (``LanguageModel`` or a subclass) and its backbone from a checkpoint written by ltcx,
    a folder written by ``ltcx export`` (``load_exported``), or a checkpoint folder (the latest run's
    ``version_N/last.ckpt``).

    The file is read as data only (``weights_only=True``) and the backbone class is looked up in ltcx's
    registry (``ltcx.models.registry``), never imported from the string in the file. Returns the model in
    eval mode and the checkpoint's ``ltcx`` metadata (backbone class and config, tokenizer name; for a checkpoint,
    ``checkpoint_path``: the file read, a folder's ``last.ckpt``).
    """
    if os.path.isdir(ckpt_path):
        if os.path.isfile(os.path.join(ckpt_path, EXPORT_CONFIG)):
            return load_exported(ckpt_path, model_class=model_class, map_location=map_location)
        ckpt_path = checkpoint_in_folder(ckpt_path)
    checkpoint = read_checkpoint(ckpt_path, map_location=map_location)
    data_hparams = checkpoint.get("datamodule_hyper_parameters")
    meta = {**checkpoint["ltcx"], "global_step": checkpoint.get("global_step"), "checkpoint_path": str(ckpt_path),
            "train_block_size": data_hparams.get("block_size") if isinstance(data_hparams, dict) else None}
    model = build_language_model(model_class, meta, checkpoint.get("hyper_parameters", {}),
                                 f"checkpoint '{ckpt_path}'", ("model.", "model.backbone.init_args."))
    stored = checkpoint.get("state_dict")
    check_weights_fit(f"checkpoint '{ckpt_path}'", stored if isinstance(stored, dict) else {}, model.state_dict())
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, RuntimeError) as error:
        raise damaged(f"checkpoint '{ckpt_path}'", error) from None
    model.on_load_checkpoint(checkpoint)
    return model.eval(), meta


def load_model_and_tokenizer(
    ckpt_path: str | Path, tokenizer: str | None = None, map_location: str | torch.device = "cpu", *,
    model_class: type[M],
) -> tuple[M, dict, Tokenizer]:
    """``load_language_model`` plus the tokenizer to read and write its text: ``tokenizer`` (the user's
    ``--tokenizer``) else the one the file names, if it is one a file may name (``stored_tokenizer_name``); either must
    fit the model's vocabulary. Every problem is one line naming ``--tokenizer`` as the fix."""
    model, meta = load_language_model(ckpt_path, model_class=model_class, map_location=map_location)
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


def load_exported(folder: str | Path, *, model_class: type[M], map_location: str | torch.device = "cpu"
                  ) -> tuple[M, dict]:
    """Rebuild a ``model_class`` (``LanguageModel`` or a subclass) from a folder written by ``export_model`` /
    ``ltcx export``: ``config.json`` is read as data and names the backbone class, looked up in ltcx's registry;
    ``model.safetensors`` holds only tensors. Returns the model in eval mode and its metadata (backbone class and
    config, tokenizer name)."""
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
    if isinstance(config, dict) and config.get("model_type") == "ltcx" and "format" not in config:
        raise LtcxError(f"{source} is an `ltcx export --format hf` folder, which transformers loads (`import ltcx.hf; "
                        f"AutoModelForCausalLM.from_pretrained('{folder}')`): pass its checkpoint, or a folder of "
                        "`ltcx export` in its default format (--format ltcx)")
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise LtcxError(f"{source}: {EXPORT_CONFIG} was not written by `ltcx export` (format {EXPORT_FORMAT})")
    config = current_names(source, config)  # written before a backbone field was renamed: this version's names
    check_counts(source, {f"{EXPORT_CONFIG}'s {key}": (config.get(key), least)
                          for key, least in (("global_step", 0), ("tokens_seen", 0), ("train_block_size", 1))})
    prefixes = (f"{EXPORT_CONFIG}'s hyper_parameters.", f"{EXPORT_CONFIG}'s backbone_config.")
    check_settings(model_class, config, config.get("hyper_parameters", {}), source, prefixes)
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
    model = build_language_model(model_class, config, config.get("hyper_parameters", {}), source, prefixes)
    check_weights_fit(source, stored, _one_name_per_tensor(model.backbone.state_dict(), stored))
    try:
        load_model(model.backbone, str(weights), strict=True, device=str(torch.device(map_location)))
    except Exception as error:  # noqa: BLE001 - a damaged file or weights of another config: one line
        raise damaged(source, error) from None
    check_finite(source, model.backbone.state_dict().items(), "export it again from a good checkpoint")
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


def check_settings(model_class: type, meta: dict, hyper_parameters: Any, source: str, prefixes: tuple[str, str]
                   ) -> type:
    """The backbone class ``meta`` names (through the registry), once its settings are known to it and
    ``hyper_parameters`` to ``model_class``, each of its type and rule: each problem is one ``LtcxError`` line;
    ``prefixes`` name the file's hyper-parameters and backbone settings in a message."""
    backbone_class = resolve_backbone(meta.get("backbone_class"))
    config = meta.get("backbone_config")
    unknown = unknown_settings(config, backbone_class) if isinstance(config, dict) else []
    if unknown:
        raise LtcxError(
            f"{source} has backbone_config {', '.join(unknown)}, which this version's {backbone_class.__name__} does "
            f"not take: it was saved by another version of ltcx: {ANOTHER_VERSION}"
        )
    check_setting_types(config, backbone_class, source, prefixes[1])
    check_setting_types(hyper_parameters, model_class, source, prefixes[0])
    accepted = _accepted(model_class)
    problem = model_class.setting_problem(
        {k: v for k, v in hyper_parameters.items() if accepted is None or k in accepted})
    if problem:  # else LanguageModel's line, which names a flag (--model.betas) and not the file
        key, value, rule = problem
        raise LtcxError(f"{source} has {prefixes[0]}{key} {value}, which {rule}: fix it in the file or use another one")
    return backbone_class


def build_language_model(model_class: type[M], meta: dict, hyper_parameters: Any, source: str,
                         prefixes: tuple[str, str]) -> M:
    """A ``model_class`` around the backbone that ``meta`` names and configures, its settings checked first
    (``check_settings``); its size was checked against the file before (``check_backbone_fits``)."""
    backbone_class = check_settings(model_class, meta, hyper_parameters, source, prefixes)
    try:
        backbone = backbone_class(**meta["backbone_config"])
    except (TypeError, ValueError) as error:  # ConfigError is a ValueError
        raise LtcxError(f"{source} has an invalid backbone_config ({error})") from None
    accepted = _accepted(model_class)
    return model_class(backbone, **{k: v for k, v in hyper_parameters.items() if accepted is None or k in accepted})


def _accepted(model_class: type) -> set[str] | None:
    """The hyper-parameters ``model_class`` takes besides its backbone (None: any, it takes ``**kwargs``): a file's
    others (``_instantiator``, Lightning's) are left out."""
    parameters = inspect.signature(model_class).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters} - {"backbone"}


def damaged(source: str, error: Exception) -> LtcxError:
    """A file whose weights were read but could not be loaded for another reason than names and shapes
    (``check_weights_fit`` answers those first)."""
    first = str(error).strip().splitlines()[0][:200]
    return LtcxError(f"{source}: its weights could not be loaded ({first}); the file is damaged")
