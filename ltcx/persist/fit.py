"""Does this file fit this model: the backbone a checkpoint describes, its weights' names and shapes, its settings'
names and types. Each answer is one ``LtcxError`` line naming the fix; a file that fits loads without surprises."""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

from ltcx.errors import ANOTHER_VERSION, LtcxError
from ltcx.models.registry import class_path

__all__ = ["weight_differences", "check_weights_fit", "unknown_settings", "check_same_backbone",
           "check_setting_types", "resumable_fields", "RESUMABLE_BACKBONE_FIELDS"]


def _shape(value: Any) -> list[int] | None:
    """A tensor's shape as a list (``[96, 32]``), a shape given as a sequence as one, else None."""
    if torch.is_tensor(value):
        return list(value.shape)
    if isinstance(value, (list, tuple, torch.Size)) and all(isinstance(n, int) for n in value):
        return list(value)
    return None


def weight_differences(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Why weights ``stored`` (name -> tensor or shape, as in a file) do not load into a model whose
    ``state_dict()`` is ``expected``: one phrase per name, shapes that differ first, then names the model has and
    the file lacks, then names only the file has. Empty when every name and shape agree."""
    shapes = [
        f"{name} is {_shape(stored[name])} in the file and {_shape(value)} here"
        for name, value in expected.items()
        if name in stored and _shape(stored[name]) is not None and _shape(value) is not None
        and _shape(stored[name]) != _shape(value)
    ]
    missing = [f"{name} {_shape(value)} is not in the file" for name, value in expected.items() if name not in stored]
    extra = [f"{name} {_shape(value)} is in the file only" for name, value in stored.items() if name not in expected]
    return shapes + missing + extra


def unknown_settings(stored: Mapping[str, Any], accepted: Any) -> list[str]:
    """Names in ``stored`` (a checkpoint's hyper-parameters or backbone_config) that the callable ``accepted``
    (a class) does not take: settings of another version of ltcx. None when it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(accepted).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return sorted(name for name in stored if name not in parameters and not name.startswith("_"))


def check_weights_fit(source: str, stored: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """One ``LtcxError`` line when the weights of ``source`` (``checkpoint '...'``) have other names or shapes than
    the model's ``state_dict()`` ``expected``: a readable file from another version of ltcx or another config,
    which is not a damaged file (``read_checkpoint`` says that)."""
    problems = weight_differences(stored, expected)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise LtcxError(
            f"{source} does not fit the model: {problems[0]}{more}; it was saved by another version of ltcx or "
            f"another config: {ANOTHER_VERSION}"
        )


# Backbone fields that leave the weights' meaning alone, so a resumed run may change them (``--model.backbone.
# init_args.dropout 0.1 --ckpt_path ...``); every other field is the architecture and must match the checkpoint. A
# backbone class may name its own as ``resumable_fields``.
RESUMABLE_BACKBONE_FIELDS = frozenset({"dropout"})


def resumable_fields(backbone_class: type) -> frozenset[str]:
    """The fields of ``backbone_class`` a resumed run may change: its ``resumable_fields``, else dropout."""
    return frozenset(getattr(backbone_class, "resumable_fields", RESUMABLE_BACKBONE_FIELDS))


_MISSING = object()


def _constructor_defaults(backbone_class: type) -> dict:
    """The backbone constructor's default for each argument that has one."""
    try:
        parameters = inspect.signature(backbone_class).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def check_same_backbone(meta: dict, backbone: nn.Module, ckpt_path: str | Path) -> None:
    """Raise one line if the checkpoint's ``ltcx`` metadata describes another model than ``backbone`` (fields in
    ``resumable_fields``, dropout, may differ)."""
    stored_class, stored = meta.get("backbone_class"), meta.get("backbone_config", {})
    configured_class, configured = class_path(type(backbone)), backbone.config_dict()
    fix = "pass the config that trained it (saved next to its logs as config.yaml)"
    if stored_class != configured_class:
        difference = f"it holds a {stored_class}, the config builds a {configured_class}"
    else:
        resumable = set(resumable_fields(type(backbone)))
        # A setting added after the file was written is absent from it; at its default it builds the older model.
        defaults = _constructor_defaults(type(backbone))
        keys = [
            k for k in sorted(set(stored) | set(configured))
            if k not in resumable and stored.get(k, defaults.get(k, _MISSING)) != configured.get(k, _MISSING)
        ]
        if not keys:
            return

        def one(k: str) -> str:
            if k in stored:
                file = f"{stored[k]!r} in the file"
            else:
                file = f"{defaults[k]!r} (the default) in the file" if k in defaults else "not in the file"
            here = f"{configured[k]!r} configured" if k in configured else "not a setting of this version"
            return f"{k}: {file}, {here}"

        difference = ", ".join(one(k) for k in keys)
        if any((k not in stored and k not in defaults) or k not in configured for k in keys):  # no config builds it
            fix = f"it was saved by another version of ltcx: {ANOTHER_VERSION}"
    raise LtcxError(f"checkpoint '{ckpt_path}' is of another model ({difference}): {fix}")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (read from a file) is of the annotated type ``hint``; a type not known here counts as fitting
    (its constructor checks it)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    if hint in (int, float):  # a bool is no number here; an int is a float
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint in (bool, str, type(None)):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    """``hint`` as a reader of a config file says it: 'an integer or null', 'a list [a number, a number]'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list [{', '.join(_describe(a) for a in args)}]"
    if origin in (tuple, list):
        return f"a list of {_describe(args[0])}s" if args else "a list"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def check_setting_types(values: Any, accepted: type, source: str, prefix: str) -> None:
    """One ``LtcxError`` line for the first of ``values`` (settings read from ``source``) that is not of the type the
    class ``accepted`` annotates it with, named ``prefix`` + its name: a constructor would fail on it with a
    TypeError, or later, mid-run."""
    if not isinstance(values, dict):
        raise LtcxError(f"{source} has {prefix.rstrip('.')} {values!r:.80}, not a mapping of settings: use another one")
    try:
        hints = typing.get_type_hints(accepted.__init__)
        # A backbone's constructor derived from its config dataclass carries its types in its __signature__ only.
        hints.update({name: p.annotation for name, p in inspect.signature(accepted).parameters.items()
                      if p.annotation is not inspect.Parameter.empty and not isinstance(p.annotation, str)})
    except Exception:  # noqa: BLE001 - annotations this version can not resolve: the constructor checks
        return
    for name, value in values.items():
        if name in hints and not _fits(value, hints[name]):
            raise LtcxError(f"{source} has {prefix}{name} {value!r:.80}, which is not {_describe(hints[name])}: fix it "
                            "in the file or use another one")
