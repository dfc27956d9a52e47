"""Does this file fit this model: the backbone a checkpoint describes, its weights' names and shapes (compared on the
meta device before anything is allocated, with the memory the model needs), its settings' and counts' names and
types. Each answer is one ``LtcxError`` line naming the fix; a file that fits loads without surprises."""

from __future__ import annotations

import inspect
import math
import os
import threading
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn

from ltcx.errors import ANOTHER_VERSION, LtcxError
from ltcx.models.registry import class_path, resolve_backbone

__all__ = ["current_names", "weight_differences", "check_weights_fit", "check_backbone_fits", "memory_limit",
           "model_too_large", "MAX_TENSORS",
           "unknown_settings", "check_same_backbone", "check_setting_types", "check_counts", "resumable_fields",
           "RESUMABLE_BACKBONE_FIELDS"]


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


def current_names(source: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` (a checkpoint's ``ltcx`` entry, an export's config) with its ``backbone_config`` in this version's
    field names: a field its backbone class renamed (``renamed_fields``: old name -> field) is read under its new
    name, so that files written before the rename load, resume and export. A config holding a field under both
    names is one ``LtcxError`` line; an unknown class is left to the build, which names it."""
    config = meta.get("backbone_config")
    try:
        renamed = getattr(resolve_backbone(meta.get("backbone_class")), "renamed_fields", {})
    except LtcxError:
        return dict(meta)
    if not isinstance(config, dict) or not renamed.keys() & config.keys():
        return dict(meta)
    both = [old for old in config if old in renamed and renamed[old] in config]
    if both:
        old, new = both[0], renamed[both[0]]
        raise LtcxError(f"{source} has backbone_config {old} and {new}, the old and the new name of one setting: "
                        f"keep only {new}")
    return {**meta, "backbone_config": {renamed.get(key, key): value for key, value in config.items()}}


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


class _TooLarge(Exception):
    """The meta build registered more tensors or values than the file could hold."""


def _meta_backbone(backbone_class: type, config: dict, max_tensors: int, max_values: int) -> nn.Module | None:
    """The backbone ``config`` builds, on the meta device (shapes without memory), or None when its constructor fails
    (the real build names why). Raises ``_TooLarge`` as soon as the constructor registers more than ``max_tensors``
    parameters and buffers or ``max_values`` values, so that ``n_layer: 100000`` stops after a few layers."""
    seen: set[int] = set()
    values = 0
    thread = threading.get_ident()

    def count(module: nn.Module, name: str, tensor: Any) -> None:
        nonlocal values
        if tensor is None or id(tensor) in seen or threading.get_ident() != thread:
            return
        seen.add(id(tensor))
        values += tensor.numel()
        if len(seen) > max_tensors:
            raise _TooLarge("tensors")
        if values > max_values:
            raise _TooLarge("values")

    hooks = [nn.modules.module.register_module_parameter_registration_hook(count),
             nn.modules.module.register_module_buffer_registration_hook(count)]
    try:
        with torch.device("meta"):
            return backbone_class(**config)
    except _TooLarge:
        raise
    except RuntimeError as error:  # a shape whose byte count overflows int64: no machine builds it
        if "overflow" in str(error).lower():
            raise _TooLarge("values") from None
        return None
    except Exception:  # noqa: BLE001 - a bad setting or a constructor the meta device can not run: the build says
        return None
    finally:
        for hook in hooks:
            hook.remove()


def memory_limit() -> int | None:
    """The bytes of memory this process may use at most: the machine's, less where a cgroup (a container) or
    ``RLIMIT_AS`` allows less; None when the system does not tell."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for name in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(name) as f:
                limits.append(int(f.read().strip()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, ValueError, OSError):
        pass
    limits = [n for n in limits if n > 0]
    return min(limits) if limits else None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


# More weight tensors than this (some 700 GPT layers) is no model a machine trains here: the meta build stops there.
MAX_TENSORS = 10_000


def model_too_large(backbone_class: type, config: dict, limit: int | None) -> str | None:
    """Why the model ``backbone_class(**config)`` does not fit in ``limit`` bytes (None: no limit known), as a phrase
    ("holds 1,234 parameters, 9.2 GiB, more than the 8.0 GiB of memory here"); None when it fits or its constructor
    fails on the meta device (the real build names why). Built on the meta device and stopped as soon as its weights
    pass ``limit`` or ``MAX_TENSORS``, so ``n_layer: 100000`` costs a few hundred layers."""
    values = limit // 4 if limit is not None else 2**62  # float32, the weights' dtype as built
    try:
        model = _meta_backbone(backbone_class, config, MAX_TENSORS, values)
    except _TooLarge as error:
        if error.args[0] == "tensors":
            return f"builds more than {MAX_TENSORS:,} weight tensors"
        if limit is None:
            return "builds more weights than any machine holds"
        return f"holds over {values:,} parameters, more than the {_gib(limit)} of memory here holds in float32"
    if model is None or limit is None:
        return None
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    needed = sum(t.numel() * t.element_size() for t in tensors)
    if needed <= limit:
        return None
    count = sum(p.numel() for p in model.parameters())
    return f"holds {count:,} parameters, {_gib(needed)}, more than the {_gib(limit)} of memory here"


def check_backbone_fits(source: str, meta: Mapping[str, Any], stored: Mapping[str, Any], prefix: str = "",
                        each_tensor_once: bool = False) -> None:
    """Before a backbone is built from a file: the model its ``backbone_config`` describes, built on the meta device,
    has the names and shapes of the file's weights ``stored`` (name -> tensor or shape; only the names under
    ``prefix``, ``backbone.`` in a checkpoint) and fits in this machine's memory; else one ``LtcxError`` line, before
    anything is allocated. The build stops once it holds twice the file's tensors (a config asking for 100000 layers
    or a width of 10**7 is refused at once). ``each_tensor_once``: the file stores tied weights once (safetensors).
    What this check can not build (an unknown class or setting, one of the wrong type) is left to the real build,
    which names it."""
    try:
        backbone_class = resolve_backbone(meta.get("backbone_class"))
    except LtcxError:
        return
    config = meta.get("backbone_config")
    if not isinstance(config, dict) or unknown_settings(config, backbone_class):
        return
    try:
        check_setting_types(config, backbone_class, source, "")
    except LtcxError:
        return
    mine = {name: value for name, value in stored.items() if isinstance(name, str) and name.startswith(prefix)}
    shapes = [_shape(value) or [] for value in mine.values()]
    values = sum(math.prod(shape) for shape in shapes)
    try:
        model = _meta_backbone(backbone_class, config, 2 * len(mine) + 64, 2 * values + 2**22)
    except _TooLarge:
        raise LtcxError(
            f"{source} does not fit the model: its backbone_config builds more weights than the file holds "
            f"({len(mine)} tensors, {values:,} values); it was saved by another version of ltcx or another config: "
            f"{ANOTHER_VERSION}"
        ) from None
    if model is None:
        return
    expected = model.state_dict(keep_vars=True)  # the tensors themselves: tied weights are one object
    if each_tensor_once:
        kept: dict[int, str] = {}
        for name, tensor in expected.items():
            if id(tensor) not in kept or (prefix + name in mine and prefix + kept[id(tensor)] not in mine):
                kept[id(tensor)] = name
        expected = {name: expected[name] for name in expected if kept[id(expected[name])] == name}
    check_weights_fit(source, mine, {prefix + name: tensor for name, tensor in expected.items()})
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    needed, limit = sum(t.numel() * t.element_size() for t in tensors), memory_limit()
    if limit is not None and needed > limit:
        count = sum(p.numel() for p in model.parameters())
        dtype = str(next(iter(tensors)).dtype).removeprefix("torch.")
        raise LtcxError(
            f"{source} holds a model of {count:,} parameters, {_gib(needed)} in {dtype}, more than the "
            f"{_gib(limit)} of memory here: load it on a machine with more memory"
        )


def check_counts(source: str, counts: Mapping[str, tuple[Any, int]]) -> None:
    """One ``LtcxError`` line for the first of ``counts`` (a file's step, tokens seen, training length: the name as
    the file spells it -> (value, least value)) that is neither null nor an integer of at least its least value,
    before a command uses it (``ltcx evaluate --max_len 4x`` multiplies the training length)."""
    for name, (value, least) in counts.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise LtcxError(f"{source} has {name} {value!r:.80}, which is not an integer >= {least}: fix it in the "
                            "file or use another one")


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
