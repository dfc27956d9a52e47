"""The trainer config's folders: log and checkpoint folders named after the architecture, relative ones under
``trainer.default_root_dir``, and ``--ckpt_path last`` as the latest run's ``last.ckpt`` in the configured
checkpoint folder (``ltcx.persist.runs`` knows the folder's layout)."""

from __future__ import annotations

import os
import sys

from jsonargparse import Namespace

from ltcx.errors import LtcxError
from ltcx.models.catalog import architecture_name
from ltcx.persist.runs import latest_last_checkpoint

__all__ = ["find_last_checkpoint", "name_after_architecture", "resolve_under_root"]


def _init_args_with_paths(trainer_config):
    """The init_args of the trainer's logger(s) and callbacks given as class_path + init_args."""
    loggers = trainer_config.logger if isinstance(trainer_config.logger, list) else [trainer_config.logger]
    for item in [*loggers, *(trainer_config.callbacks or [])]:
        init_args = getattr(item, "init_args", None)
        if init_args is not None:
            yield init_args


def resolve_under_root(trainer_config) -> None:
    """Relative log and checkpoint folders (``save_dir``, ``dirpath``) go under ``trainer.default_root_dir``."""
    root = trainer_config.default_root_dir
    if not root:
        return
    for init_args in _init_args_with_paths(trainer_config):
        for key in ("save_dir", "dirpath"):
            value = init_args.get(key)
            if isinstance(value, str) and not os.path.isabs(value) and "://" not in value:
                init_args[key] = os.path.join(root, value)


def find_last_checkpoint(trainer_config) -> str | None:
    """``--ckpt_path last``: the ``last.ckpt`` of the latest run (the highest ``version_N/`` of the checkpoint
    folder holding one), None (a fresh start) when there is none, and an error listing them when runs that
    shared one folder left several."""
    folders = [a.dirpath for a in _init_args_with_paths(trainer_config) if isinstance(a.get("dirpath"), str)]
    if not folders:
        return "last"  # no folder configured: Lightning's own search
    candidates = sorted(path for folder in folders for path in latest_last_checkpoint(folder))
    if len(candidates) > 1:
        raise LtcxError(
            f"--ckpt_path last is ambiguous: {', '.join(candidates)} (runs sharing the folder wrote several); "
            "pass --ckpt_path the one to resume"
        )
    if not candidates:
        print(f"ltcx: --ckpt_path last: no last checkpoint in {', '.join(folders)}; starting afresh", file=sys.stderr)
        return None
    return candidates[0]


def name_after_architecture(config) -> None:
    """A null logger ``name`` becomes the architecture's catalogue name (else its class name, lower case) and a
    null ``ModelCheckpoint`` ``dirpath`` ``checkpoints/<that name>``: configs/recipe.yaml leaves both null, so each
    architecture logs to ``lightning_logs/<arch>`` and saves to ``checkpoints/<arch>``."""
    backbone = config.get("model", {}).get("backbone")
    if not isinstance(backbone, Namespace) or not isinstance(backbone.get("class_path"), str):
        return
    init_args = backbone.get("init_args")
    init_args = init_args.as_dict() if isinstance(init_args, Namespace) else {}
    arch = architecture_name(backbone.class_path, init_args) or backbone.class_path.rsplit(".", 1)[-1].lower()
    for item, key, value in (("logger", "name", arch), ("callbacks", "dirpath", f"checkpoints/{arch}")):
        specs = config.trainer.get(item)
        for spec in specs if isinstance(specs, list) else [specs]:
            init_args = spec.get("init_args") if isinstance(spec, Namespace) else None
            if isinstance(init_args, Namespace) and key in init_args and init_args[key] is None:
                init_args[key] = value
