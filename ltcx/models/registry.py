"""Backbone classes a checkpoint may name. A checkpoint stores its backbone's class path as a string; that
string is looked up here and never imported or called freely, so a crafted file can not run other code.

ltcx's own backbones are known by class path and imported on first use (only these module paths are ever
imported); any other class must be registered explicitly:

    @register_backbone
    class MyModel(Backbone): ...      # ltcx.models.base.Backbone
"""

from __future__ import annotations

import importlib

from ltcx.errors import LtcxError
from ltcx.models.catalog import builtin_class_paths

__all__ = ["BackboneType", "class_path", "known_backbones", "register_backbone", "resolve_backbone"]

# ltcx's own backbones: class path -> (module, class name), imported lazily. Derived from the catalogue's own
# entries (not those a test adds with add_to_catalog), so only ltcx's model modules are ever imported.
_BUILTIN = builtin_class_paths()
_REGISTERED: dict[str, type] = {}


def class_path(cls: type) -> str:
    """The key of ``cls``: ``f"{module}.{qualname}"``, as checkpoints store it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_backbone(cls: type) -> type:
    """Allow checkpoints to name ``cls`` (usable as a class decorator); returns ``cls``."""
    if not isinstance(cls, BackboneType):
        raise TypeError(f"register_backbone expects a subclass of ltcx.models.base.Backbone, got {cls!r}")
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


class BackboneType(type):
    """The metaclass of ``ltcx.models.base.Backbone``: its root class's ``__subclasses__`` are the backbones a
    checkpoint may name, ltcx's own (imported on demand) and those registered. That is what ``ltcx fit --help``
    lists as model.backbone's choices (jsonargparse walks ``__subclasses__``)."""

    def __subclasses__(cls) -> list[type]:
        if any(isinstance(base, BackboneType) for base in cls.__bases__):
            return type.__subclasses__(cls)  # below the root: the class's own subclasses
        found = []
        for path in known_backbones():
            try:
                found.append(resolve_backbone(path))
            except LtcxError:  # allow-listed but not in this version
                continue
        return found
