"""``ltcx evaluate --task long_context``: recall past the training length, for one or several models, each on the task
its checkpoint trained on (the needle or MQAR, read from the checkpoint's data settings).

    ltcx evaluate --task long_context --ckpt_path runs/gpt-needle --ckpt_path runs/xlstm-mqar --out evaluation
    ltcx evaluate --task long_context --train cpu --out results/long-context     # the CPU default, trained first

The scores are ``ltcx/eval/long_context.py``'s (at ``--factors`` x each model's training length, fed through its state
in pieces); the CPU default's runs are ``ltcx/study/long_context.py``'s. Writes ``long_context.json`` (every cell),
``long_context.png`` (accuracy against length per model: the needle and MQAR) and ``needle_heatmaps.png`` (length x
depth per needle model) to ``--out``, each whole or not at all.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ltcx.errors import ConfigError, LtcxError

__all__ = ["long_context_main", "RESULTS"]

RESULTS = ("long_context.json", "long_context.png", "needle_heatmaps.png")


def _numbers(flag: str, text: str, kind: type, check, rule: str) -> list:
    try:
        values = [kind(part) for part in re.split(r"[,\s]+", text.strip()) if part]
    except ValueError:
        values = []
    if not values or not all(check(v) for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"{flag} '{text}' must be a comma-separated list of distinct {rule}")
    return sorted(values)


def long_context_main(args) -> None:
    """Every model is loaded and its task checked before any is scored; the CPU default (``--train cpu``) is trained
    after the arguments are checked and before the models are loaded."""
    factors = _numbers("--factors", args.factors, int, lambda f: f >= 1, "whole multiples >= 1 (1,2,4,8)")
    depths = _numbers("--depths", args.depths, float, lambda d: 0.0 <= d <= 1.0, "depths in [0, 1] (0,0.5,1)")
    num_sequences, batch_size = args.num_sequences or 32, args.batch_size or 8
    for flag, typed in (("--data.path", args.data_path is not None), ("--max_len", args.max_len != "4x"),
                        ("--tokenizer", args.tokenizer is not None), ("--bucket_size", args.bucket_size is not None)):
        if typed:
            raise ConfigError(f"{flag} is position_loss's: --task long_context reads each model's own task and "
                              "lengths (--factors)")
    if not args.ckpt_path and args.train is None:
        raise ConfigError("--task long_context needs --ckpt_path (a model trained on configs/data/niah.yaml or "
                          "configs/data/mqar.yaml) or --train cpu (train the CPU default first)")

    import torch

    from ltcx.cli.generate import _device

    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if args.device is None else args.device)
    scoring = dict(factors=factors, depths=depths, batch_size=batch_size, piece_len=args.piece_len,
                   limit=_memory_here(device))
    runs = [_load(path, path, **scoring) for path in args.ckpt_path]  # a bad one is one line before training
    out = Path(args.out)
    if args.train == "cpu":
        from ltcx.study.long_context import train_cpu_default

        _writable(out)
        runs += [_load(label, str(path), **scoring) for label, path in train_cpu_default(out)]

    from ltcx.eval.long_context import evaluate_task
    from ltcx.models.catalog import architecture_name

    results = []
    for run in runs:
        backbone = run["backbone"].to(device)
        scores = evaluate_task(backbone, run["task"], run["data"], factors=factors, depths=depths,
                               num_sequences=num_sequences, batch_size=batch_size, piece_len=args.piece_len,
                               seed=args.seed)
        run["backbone"] = backbone.cpu()  # one model on the device at a time
        meta = run["meta"]
        results.append(dict(
            label=run["label"], ckpt_path=os.path.abspath(run["path"]), backbone=type(backbone).__name__,
            architecture=architecture_name(meta["backbone_class"], meta.get("backbone_config")),
            position=meta.get("backbone_config", {}).get("position"),
            parameters=backbone.parameter_count() if hasattr(backbone, "parameter_count") else None,
            context_limit=backbone.max_seq_len, global_step=meta.get("global_step"),
            data=run["data"], **scores))
        accuracy = "  ".join(f"{n}: {a:.3f}" for n, a in zip(scores["lengths"], scores["accuracy"]))
        print(f"{run['label']} ({type(backbone).__name__}, {run['task']}, trained at {run['data']['block_size']}): "
              f"{accuracy}")

    from ltcx.eval.long_context import plot_accuracy_by_length, plot_needle_heatmaps
    from ltcx.persist.files import atomic_write, atomic_write_text

    _writable(out)
    settings = dict(factors=factors, depths=depths, num_sequences=num_sequences, batch_size=batch_size,
                    piece_len=args.piece_len, seed=args.seed, device=str(device), train=args.train)
    json_path, length_png, heatmap_png = (out / name for name in RESULTS)
    atomic_write_text(json_path, json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    atomic_write(length_png, lambda temp: plot_accuracy_by_length(results, temp))
    atomic_write(heatmap_png, lambda temp: plot_needle_heatmaps(results, temp))
    print(f"ltcx: wrote {json_path}, {length_png} and {heatmap_png}")


def _memory_here(device) -> int | None:
    """The bytes scoring may use: the GPU's for a CUDA device (the state and logits live there), else the process's
    (``memory_limit``)."""
    import torch

    from ltcx.persist import file_fits

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return file_fits.memory_limit()


def _load(label: str, path: str, factors: list[int], depths: list[float], batch_size: int, piece_len: int | None,
          limit: int | None) -> dict:
    """A model and the task its checkpoint trained on, checked at every length and depth asked, and scoring at the
    longest length checked against ``limit`` bytes of memory, before any sequence is made."""
    from ltcx.eval.long_context import check_lengths_fit, check_task, trained_task
    from ltcx.lm import LanguageModel
    from ltcx.persist import read_checkpoint
    from ltcx.persist.load import load_language_model
    from ltcx.persist.runs import checkpoint_in_folder

    if os.path.isfile(os.path.join(path, "config.json")):
        raise LtcxError(f"'{path}' is an export, which keeps no data settings: pass the checkpoint it was exported "
                        "from (--task long_context scores a model on the task it trained on)")
    file = checkpoint_in_folder(path) if os.path.isdir(path) else path
    model, meta = load_language_model(file, model_class=LanguageModel)  # digests and fit checked here
    task, data = trained_task(read_checkpoint(file).get("datamodule_hyper_parameters"), f"checkpoint '{path}'")
    if task == "needle":  # laid out by arithmetic alone: its own limits (the haystack's length) first
        check_task(task, data, factors, depths)
    check_lengths_fit(model.backbone, data["block_size"], factors, batch_size, piece_len, limit, f"checkpoint '{path}'")
    if task != "needle":  # laying MQAR out makes a sequence of each length: after the memory check
        check_task(task, data, factors, depths)
    return dict(label=label, path=path, backbone=model.backbone, task=task, data=data, meta=meta)


def _writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise LtcxError(f"cannot make --out '{out}' ({error.strerror or error}): pass a writable folder") from None

