"""The model configuration of a run resumed from a checkpoint (``--ckpt_path``): the ``fit`` command's policy.

A ``--model.*`` flag typed on the command line (``LtcxCLI.typed_keys``: by its whole name or a prefix argparse takes)
wins over the checkpoint (on ``fit``, a notice line when its value differs); every other value (a YAML's or a default)
is the checkpoint's, so resuming continues the run that was saved (on ``fit``, a notice line names each YAML value left
out, but for a null: not set). A typed backbone field that would change the architecture (the class, or any field but
``resumable_fields``: dropout) is one error line before anything is built; an untyped backbone of another class is left
to ``check_same_backbone``. (A YAML does not win: it is usually the architecture's own config, whose values a first
run's typed flags changed.)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ltcx.errors import ANOTHER_VERSION, LtcxError
from ltcx.models.registry import resolve_backbone
from ltcx.persist.file_fits import check_setting_types, resumable_fields, unknown_settings

__all__ = ["model_keys", "checkpoint_model_config", "checkpoint_backbone"]

Notice = Callable[[str], None] | None  # prints one notice line; None: no notices (not ``fit``)


def model_keys(typed: Iterable[str]) -> set[str]:
    """The ``model.*`` keys of ``typed`` (``LtcxCLI.typed_keys``), without ``model.`` and ``init_args.``:
    ``learning_rate``, ``backbone.dropout``, ``backbone`` (the whole backbone)."""
    keys = set()
    for key in typed:
        if key.startswith("model."):
            parts = [p for p in key[len("model."):].split(".") if p != "init_args"]
            if parts and parts[-1] != "help":
                keys.add(".".join(parts))
    return keys


def checkpoint_model_config(checkpoint: dict, model: Any, typed: set[str], path: str, model_class: type,
                            notice: Notice) -> dict:
    """The part of ``checkpoint``'s model configuration that replaces the configured ``model`` namespace, given the
    ``typed`` model keys (``model_keys``); ``notice`` is called with each notice line, in order, as the checks go (so
    the lines before an error are printed too)."""
    stored = {
        k: v for k, v in checkpoint.get("hyper_parameters", {}).items()
        if k not in ("_instantiator", "_class_path", "backbone")
    }
    unknown = unknown_settings(stored, model_class)
    if unknown:  # jsonargparse would print its usage and "does not accept option"
        raise LtcxError(
            f"checkpoint '{path}' has hyper-parameter(s) {', '.join(f'model.{k}' for k in unknown)}, which this "
            f"version of ltcx does not have: it was saved by another version of ltcx: {ANOTHER_VERSION}"
        )
    check_setting_types(stored, model_class, f"checkpoint '{path}'", "model.")  # else jsonargparse's usage
    replacement = {}
    for key, value in stored.items():
        current = model.get(key) if key in model else value
        if key not in typed:
            replacement[key] = value
            if notice and current is not None and not _same(current, value):  # null: not set, no choice
                notice(f"resuming with the checkpoint's model.{key} {_show(value)}, not {_show(current)} from the "
                       f"config (type --model.{key} {_show(current)} to change it)")
        elif notice and key != "decay_steps" and not _same(current, value):  # decay_steps: LanguageModel's notice
            notice(f"resuming with model.{key} {_show(current)} (the checkpoint has {_show(value)})")
    backbone = checkpoint_backbone(checkpoint, model.get("backbone"), typed, path, notice)
    if backbone:
        replacement["backbone"] = backbone
    return replacement


def checkpoint_backbone(checkpoint: dict, backbone: Any, typed: set[str], path: str, notice: Notice) -> dict | None:
    """The checkpoint's backbone fields that replace the configured ones (``class_path`` + ``init_args``)."""
    meta = checkpoint["ltcx"]
    stored_class, stored = meta.get("backbone_class"), meta.get("backbone_config")
    if backbone is None or not isinstance(stored, dict) or not isinstance(stored_class, str):
        return None
    whole = "backbone" in typed  # the whole backbone typed (--model.backbone ...): every field counts as typed
    if backbone.class_path != stored_class:
        if whole or "backbone.class_path" in typed:
            raise LtcxError(
                f"--model.backbone {backbone.class_path} is another architecture than checkpoint '{path}' (a "
                f"{stored_class}), whose weights can not be resumed into it: drop the flag to resume the "
                "checkpoint, or start a new run without --ckpt_path"
            )
        return None  # an architecture YAML of another class: check_same_backbone names both once it is built
    check_setting_types(stored, resolve_backbone(stored_class), f"checkpoint '{path}'", "model.backbone.init_args.")
    resumable = resumable_fields(resolve_backbone(stored_class))
    init_args = backbone.get("init_args") or {}
    taken = {}
    for key, value in stored.items():
        if key not in init_args:  # vocab_size: linked from the data's tokenizer
            continue
        current = init_args[key]
        if not (whole or f"backbone.{key}" in typed):
            taken[key] = value
            if notice and current is not None and not _same(current, value):
                notice(f"resuming with the checkpoint's model.backbone.init_args.{key} {_show(value)}, not "
                       f"{_show(current)} from the config")
        elif _same(current, value) or (current is None and _derives(stored_class, stored, key, value)):
            continue
        elif key not in resumable:
            raise LtcxError(
                f"--model.backbone.init_args.{key} {_show(current)} would change the architecture of "
                f"checkpoint '{path}' (it has {key} {_show(value)}), whose weights can not be resumed into it: "
                "drop the flag to resume the checkpoint, or start a new run without --ckpt_path"
            )
        elif notice:
            notice(f"resuming with model.backbone.init_args.{key} {_show(current)} (the checkpoint has "
                   f"{_show(value)})")
    return {"class_path": stored_class, "init_args": taken} if taken else None


def _derives(backbone_class: str, stored: dict, key: str, value: Any) -> bool:
    """A typed null of a derived field (``tau_min: null`` = block_size / 12) that derives the checkpoint's ``value``
    from the checkpoint's other fields: the same architecture, so no change (the study runner types every field of
    its shapes, nulls included, on ``fit`` and ``test`` of a resumed run)."""
    config_class = getattr(resolve_backbone(backbone_class), "config_class", None)
    if config_class is None:
        return False
    try:
        derived = getattr(config_class(**{**stored, key: None}), key)
    except Exception:  # noqa: BLE001 - a null the config does not accept is not the checkpoint's value
        return False
    return _same(derived, value)


def _same(a, b) -> bool:
    """Equal as configuration values: tuples and lists alike (betas), 1 == 1.0."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(value) -> str:
    """A configuration value as a user would type it: 0.0001, [0.9, 0.95], null, true."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)
