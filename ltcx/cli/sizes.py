"""Sizes a command line asks for, checked against the memory here before Lightning builds anything: one batch of
``--data`` (``batch_size`` x ``block_size`` tokens, their ids and one hidden state of the model's width each:
``check_batch_fits``, which the data modules also run on their own) and the model the ``--model.backbone`` settings
describe (built on the meta device, stopped as soon as it outgrows the memory). Each refusal is one ``ConfigError``
line naming the option, instead of an allocator's traceback once the run is half set up."""

from __future__ import annotations

from typing import Any

from ltcx.data.module import check_batch_fits
from ltcx.errors import ConfigError

__all__ = ["check_run_sizes"]


def _get(namespace: Any, key: str, default: Any = None) -> Any:
    getter = getattr(namespace, "get", None)
    return getter(key, default) if callable(getter) else getattr(namespace, key, default)


def check_run_sizes(config: Any) -> None:
    """``config``: a Lightning command's parsed settings (``fit``'s namespace), after the backbone's context was
    taken from ``data.block_size``. In order: one batch's token ids (``--data.block_size`` alone can be absurd), the
    model (whose learned positions may be that block size), one batch's hidden states at the model's width."""
    from ltcx.persist import file_fits

    limit = file_fits.memory_limit()
    if limit is None:
        return
    backbone = _get(_get(config, "model"), "backbone")
    settings = {k: v for k, v in dict(_get(backbone, "init_args") or {}).items() if not k.startswith("_")}
    data = _get(config, "data")
    data_args = _get(data, "init_args", data)
    block_size, batch_size = _get(data_args, "block_size"), _get(data_args, "batch_size")
    batch_known = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (block_size, batch_size))
    if batch_known:
        check_batch_fits(block_size, batch_size)
    _check_model(_get(backbone, "class_path"), settings, block_size, limit)  # once the ids fit
    width = settings.get("n_embd")
    if batch_known and isinstance(width, int) and width > 0:
        check_batch_fits(block_size, batch_size, width)


def _check_model(class_path: Any, settings: dict, data_block_size: Any, limit: int) -> None:
    """The model ``class_path(**settings)`` in memory, built on the meta device first."""
    from ltcx.errors import LtcxError
    from ltcx.models.registry import resolve_backbone
    from ltcx.persist import file_fits

    if not isinstance(class_path, str):
        return
    try:
        backbone_class = resolve_backbone(class_path)
    except LtcxError:
        return  # the build names an unknown class
    why = file_fits.model_too_large(backbone_class, settings, limit)
    if why is None:
        return
    shown = ", ".join(f"{k} {settings[k]:,}" for k in ("n_layer", "n_embd", "vocab_size", "block_size")
                      if isinstance(settings.get(k), int) and not isinstance(settings.get(k), bool))
    options = ["--model.backbone.init_args.n_layer", "--model.backbone.init_args.n_embd"]
    if why.endswith("weight tensors"):  # the count of layers, whatever their width
        options = options[:1]
    elif settings.get("block_size") is not None and settings.get("block_size") == data_block_size:
        options.append("--data.block_size (its context)")
    fix = f"{', '.join(options[:-1])} or {options[-1]}" if len(options) > 1 else options[0]
    raise ConfigError(f"the model --model.backbone.init_args describe ({shown}) {why}: lower {fix}")
