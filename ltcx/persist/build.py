"""A LanguageModel built from the settings a file holds (a checkpoint's or an export's): the backbone class looked
up in ltcx's registry (never imported from the string in the file), each setting checked before a constructor sees
it."""

from __future__ import annotations

import inspect
from typing import Any

from ltcx.errors import ANOTHER_VERSION, LtcxError
from ltcx.lm import LanguageModel, setting_problem
from ltcx.models.registry import resolve_backbone
from ltcx.persist.fit import check_setting_types, unknown_settings

__all__ = ["build_language_model", "check_settings", "damaged"]


def check_settings(meta: dict, hyper_parameters: Any, source: str, prefixes: tuple[str, str]) -> type:
    """The backbone class ``meta`` names (through the registry), once its settings and ``hyper_parameters`` are
    known to it and of its types: each problem is one ``LtcxError`` line; ``prefixes`` name the file's
    hyper-parameters and backbone settings in a message."""
    backbone_class = resolve_backbone(meta.get("backbone_class"))
    config = meta.get("backbone_config")
    unknown = unknown_settings(config, backbone_class) if isinstance(config, dict) else []
    if unknown:
        raise LtcxError(
            f"{source} has backbone_config {', '.join(unknown)}, which this version's {backbone_class.__name__} does "
            f"not take: it was saved by another version of ltcx: {ANOTHER_VERSION}"
        )
    check_setting_types(config, backbone_class, source, prefixes[1])
    check_setting_types(hyper_parameters, LanguageModel, source, prefixes[0])
    defaults = {n: p.default for n, p in inspect.signature(LanguageModel).parameters.items() if n != "backbone"}
    problem = setting_problem({**defaults, **{k: v for k, v in hyper_parameters.items() if k in defaults}})
    if problem:  # else LanguageModel's line, which names a flag (--model.betas) and not the file
        key, value, rule = problem
        raise LtcxError(f"{source} has {prefixes[0]}{key} {value}, which {rule}: fix it in the file or use another one")
    return backbone_class


def build_language_model(meta: dict, hyper_parameters: Any, source: str, prefixes: tuple[str, str]) -> LanguageModel:
    """A LanguageModel around the backbone that ``meta`` names and configures, its settings checked first
    (``check_settings``); its size was checked against the file before (``check_backbone_fits``)."""
    backbone_class = check_settings(meta, hyper_parameters, source, prefixes)
    try:
        backbone = backbone_class(**meta["backbone_config"])
    except (TypeError, ValueError) as error:  # ConfigError is a ValueError
        raise LtcxError(f"{source} has an invalid backbone_config ({error})") from None
    accepted = set(inspect.signature(LanguageModel).parameters) - {"backbone"}
    return LanguageModel(backbone, **{k: v for k, v in hyper_parameters.items() if k in accepted})


def damaged(source: str, error: Exception) -> LtcxError:
    """A file whose weights were read but could not be loaded for another reason than names and shapes
    (``check_weights_fit`` answers those first)."""
    first = str(error).strip().splitlines()[0][:200]
    return LtcxError(f"{source}: its weights could not be loaded ({first}); the file is damaged")
