"""The study's timing pass: after every run has finished, one trained checkpoint per (architecture, size, cell) is
timed against the others in this one process, round after round, the models in turn.

A run timed inside its own training measures the machine's load at that hour, not the model: on a shared machine a
ratio is only meaningful between models timed in the same minutes. In every round each model takes one
training step through ``LanguageModel.loss`` (the fused head, AdamW, the study's batch and block) and four cached
decode steps (batch 1, after block // 2 tokens), the first model of the round rotating; each figure is the median of
its samples. The 1-minute load average is recorded; above the usable core count the figures are marked unreliable.
The record (``timing.json``) is reused while the checkpoints it timed are unchanged (a damaged one is said and
redone); ``ltcx study --retime`` redoes it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["interleaved_timings", "timing_pass"]


def interleaved_timings(models: dict, batch_size: int, block_size: int, device: torch.device, rounds: int,
                        autocast: Callable = contextlib.nullcontext) -> tuple[dict[str, dict], list[float]]:
    """({name: {"tokens_per_sec", "decode_ms_per_token"}}, the 1-minute load averages seen during the pass) for
    ``models`` ({name: LanguageModel}); their weights change (copies loaded for timing only)."""
    from ltcx.throughput import loss_step, prefilled_state, timed

    generator = torch.Generator().manual_seed(0)
    train_steps, decode_steps = {}, {}
    for name, model in models.items():
        vocab = model.backbone.config.vocab_size
        idx = torch.randint(0, vocab, (batch_size, block_size + 1), generator=generator).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_steps[name] = loss_step(model, idx, optimizer, autocast())
        with torch.no_grad(), autocast():
            token, state = prefilled_state(model.backbone.eval(), 1, block_size // 2, device)
        decode_steps[name] = lambda b=model.backbone, t=token, s=state: b(t, s)

    def train(name: str) -> float:
        models[name].train()
        return timed(train_steps[name], device, repeats=1, warmup=0)

    def decode(name: str) -> float:
        models[name].eval()
        with torch.no_grad(), autocast():
            return timed(decode_steps[name], device, repeats=1, warmup=0)

    names = list(models)
    for name in names:  # warm-up: allocations, lazy initialisation
        train(name)
        decode(name)
    train_s: dict[str, list[float]] = {name: [] for name in names}
    decode_s: dict[str, list[float]] = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    for round_index in range(max(1, rounds)):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            train_s[name].append(train(name))
        for _ in range(4):  # a decode step is short: more samples
            for name in order:
                decode_s[name].append(decode(name))
        loads.append(os.getloadavg()[0])
    speeds = {name: {"tokens_per_sec": batch_size * block_size / statistics.median(train_s[name]),
                     "decode_ms_per_token": 1e3 * statistics.median(decode_s[name])} for name in names}
    return speeds, loads


def timing_pass(out: Path, checkpoints: dict[str, tuple[Path, int]], batch_size: int, rounds: int, retime: bool,
                say: Callable[[str], None]) -> dict:
    """Time ``checkpoints`` ({key: (trained checkpoint, its block size)}) against each other and record it in
    ``out/timing.json``, or reuse that record when it timed the same files at the same settings (and not ``retime``).
    Models of different block sizes are timed in separate interleaved groups (a ratio is read within a group). An
    interrupted pass leaves no record and is redone whole: its ratios must come from one process."""
    from ltcx.lm import LanguageModel
    from ltcx.persist import load_language_model
    from ltcx.runtime import usable_cores
    from ltcx.study.report import write_json

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"  # a GPU trains in the recipe's bf16-mixed, so it is timed in bf16 autocast
    settings = {"device": str(device), "precision": "bf16 autocast" if bf16 else "float32", "rounds": rounds,
                "batch_size": batch_size,
                "checkpoints": {key: [str(path), path.stat().st_mtime_ns, block]
                                for key, (path, block) in sorted(checkpoints.items())}}
    timing_file = out / "timing.json"
    if timing_file.is_file() and not retime:
        from ltcx.study.records import TIMING_FIELDS, DamagedRecord, read_json_record

        try:
            stored = read_json_record(timing_file, TIMING_FIELDS, "the timing pass is redone")
        except DamagedRecord as error:
            say(f"timing pass: {error}")
            stored = {}
        if stored and {key: stored.get(key) for key in settings} == settings:
            say("timing pass: done before for these checkpoints, reused (--retime redoes it)")
            return stored
    say(f"timing pass: {len(checkpoints)} models interleaved, {rounds} rounds on {device}")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    speeds: dict[str, dict] = {}
    loads: list[float] = []
    for block in sorted({block for _, block in checkpoints.values()}):
        group = {key: load_language_model(path, model_class=LanguageModel, map_location=device)[0].to(device)
                 for key, (path, b) in checkpoints.items() if b == block}
        found, seen = interleaved_timings(group, batch_size, block, device, rounds, autocast)
        speeds.update({key: {**value, "block_size": block} for key, value in found.items()})
        loads += seen
    cores = usable_cores()
    timing = {**settings, "models": speeds, "load_averages": loads, "load_average_max": max(loads),
              "usable_cores": cores, "speed_unreliable": max(loads) > cores}
    write_json(timing_file, timing)
    return timing
