"""One declaration per architecture: the backbone's config dataclass, and the constructor derived from it.

Each backbone's settings are the fields of its ``config_class``, a dataclass declared once: a type, a default and
a docstring under each field (a string literal after it, as in PEP 257), checked in ``__post_init__``
(``ConfigError`` naming the field and the rule). A backbone deriving from ``ConfiguredModule`` takes those fields
as keyword arguments, ``Backbone(**fields)`` builds ``config_class(**fields)``, and the constructor's signature
and docstring are generated from the dataclass, so the defaults can not drift from it:

* ``inspect.signature(Backbone)`` (and of ``Backbone.__init__``) is ``(*, field: type = default, ...)``, one
  keyword-only parameter per ``init`` field, its annotation evaluated; jsonargparse (LightningCLI) reads this
  signature for ``--model.backbone.help`` and the YAML's ``init_args``, and the ``Args:`` section of the generated
  ``__init__.__doc__`` for each field's description;
* ``backbone.config_dict()`` (what checkpoints keep as ``backbone_config``) holds the same names, so
  ``type(m)(**m.config_dict())`` rebuilds the model.

A subclass that only extends the config (``LTCGPT``: ``config_class = LTCConfig`` plus its attention) gets a
constructor of its own with the extended signature that calls the parent's; a class that writes its own
``__init__`` without declaring a ``config_class`` keeps its own signature.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, ClassVar

import torch.nn as nn

__all__ = ["ConfiguredModule", "field_docs", "init_fields"]

_MARK = "_ltcx_config_constructor"


def init_fields(config: Any) -> dict[str, Any]:
    """The constructor arguments held by a config instance: every ``init`` field (tuples as lists, as in YAML)."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def field_docs(config_class: type) -> dict[str, str]:
    """The docstring written under each field of ``config_class`` and of the dataclasses it extends (a subclass's
    own docstring of a field wins). Empty where the source can not be read."""
    docs: dict[str, str] = {}
    for klass in reversed(config_class.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _signature(config_class: type) -> inspect.Signature:
    hints = typing.get_type_hints(config_class)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(config_class):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        parameters.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[f.name])
        )
    return inspect.Signature(parameters, return_annotation=None)


def _docstring(owner: type, config_class: type, signature: inspect.Signature) -> str:
    docs = field_docs(config_class)
    lines = [f"Build a {owner.__name__} from the fields of {config_class.__name__}, as keyword arguments.", "",
             "Args:"]
    for name in list(signature.parameters)[1:]:
        text = docs.get(name, "see " + config_class.__name__ + ".").splitlines()
        lines.append(f"    {name}: {text[0]}")
        lines += [f"        {line}" if line else "" for line in text[1:]]
    return "\n".join(lines)


class ConfiguredModule(nn.Module):
    """An ``nn.Module`` whose constructor takes the fields of its ``config_class`` as keyword arguments (the
    signature and docstring generated from the dataclass, see ``ltcx.models.config``)."""

    config_class: ClassVar[type]
    config: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            if "config_class" not in cls.__dict__:
                return  # its own constructor, its own signature
            init = cls.__dict__["__init__"]
        elif getattr(cls.__init__, _MARK, False):
            def init(self, **fields: Any) -> None:
                super(cls, self).__init__(**fields)

            init.__qualname__, init.__module__ = f"{cls.__qualname__}.__init__", cls.__module__
            cls.__init__ = init
        else:
            return  # inherits a hand-written constructor
        if not dataclasses.is_dataclass(getattr(cls, "config_class", None)):
            raise TypeError(f"{cls.__qualname__}.config_class must be a dataclass")
        init.__signature__ = _signature(cls.config_class)
        init.__doc__ = _docstring(cls, cls.config_class, init.__signature__)
        setattr(init, _MARK, True)

    @classmethod
    def from_config(cls, config: Any) -> ConfiguredModule:
        """The model of a config instance: ``cls(**init_fields(config))``."""
        return cls(**init_fields(config))

    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this model: ``type(model)(**model.config_dict())``."""
        return init_fields(self.config)
