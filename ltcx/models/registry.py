"""Backbone classes a checkpoint may name. A checkpoint stores its backbone's class path as a string; that
string is looked up here and never imported or called freely, so a crafted file can not run other code.

ltcx's own backbones are known by class path and imported on first use (only these module paths are ever
imported); any other class must be registered explicitly:

    @register_backbone
    class MyModel(nn.Module): ...
"""

from __future__ import annotations

import abc
import importlib

import torch.nn as nn

from ltcx.errors import LtcxError
from ltcx.models.catalog import builtin_class_paths

__all__ = ["Backbone", "register_backbone", "resolve_backbone"]

# ltcx's own backbones: class path -> (module, class name), imported lazily. Derived from the catalogue's own
# entries (not those a test adds with add_to_catalog), so only ltcx's model modules are ever imported.
_BUILTIN = builtin_class_paths()
_REGISTERED: dict[str, type] = {}


def class_path(cls: type) -> str:
    """The key of ``cls``: ``f"{module}.{qualname}"``, as checkpoints store it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_backbone(cls: type) -> type:
    """Allow checkpoints to name ``cls`` (usable as a class decorator); returns ``cls``."""
    if not isinstance(cls, type):
        raise TypeError(f"register_backbone expects a class, got {cls!r}")
    _REGISTERED[class_path(cls)] = cls
    return cls


def resolve_backbone(path: str) -> type:
    """The backbone class registered under ``path``; ``LtcxError`` for anything else."""
    if not isinstance(path, str):
        raise LtcxError(f"backbone class {path!r} is not a class path: the checkpoint is not one of ltcx's")
    if path in _REGISTERED:
        return _REGISTERED[path]
    if path not in _BUILTIN:
        raise LtcxError(
            f"backbone class '{path}' is not a registered ltcx backbone (known: {', '.join(known_backbones())}); "
            "register your own class with ltcx.models.registry.register_backbone"
        )
    module, name = _BUILTIN[path]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise LtcxError(f"backbone class '{path}' is not available in this ltcx version ({error})") from None
    _REGISTERED[path] = cls
    return cls


def known_backbones() -> list[str]:
    """Class paths a checkpoint may name: ltcx's own and those registered."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))


class _BackboneMeta(abc.ABCMeta):
    def __subclasses__(cls) -> list[type]:
        # What `ltcx fit --help` lists as the choices of model.backbone: ltcx's backbones and those registered
        # (jsonargparse walks __subclasses__; without this it would list every torch.nn class imported).
        found = []
        for path in known_backbones():
            try:
                found.append(resolve_backbone(path))
            except LtcxError:  # allow-listed but not in this version
                continue
        return found


class Backbone(nn.Module, metaclass=_BackboneMeta):
    """The type of ``LanguageModel.backbone``: any ``nn.Module`` keeping the contract
    ``logits [B, T, V], state = backbone(idx [B, T], state=None)`` is one (no need to inherit from this class);
    ltcx's own backbones and those passed to ``register_backbone`` are the ones the CLI's help lists."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        return issubclass(other, nn.Module) or NotImplemented

    @abc.abstractmethod
    def forward(self, idx, state=None): ...
