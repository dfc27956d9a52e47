"""What a study costs, estimated before it runs (``ltcx study --dry_run``): CPU seconds from each run's FLOPs and
steps, this machine's measured rates and a fixed cost per process.

* ``run_flops``: a run's training FLOPs (the shape's training FLOPs per token, 3 x forward, times the tokens it
  trains on) plus its validations' and its test's forward FLOPs (a third of that per token, over their batches);
* ``measured_rate``: FLOPs per CPU-second of one thread training a small GPT (width 128, 2 layers, 128 tokens,
  batch 8, the fused loss, AdamW), about half a second: the arithmetic;
* ``measured_step_s``: the CPU seconds of one training step of an architecture at a tiny shape (width 64, 2
  layers, 16 tokens, batch 1), per layer: what a step costs besides its arithmetic (each op's dispatch), which is
  most of a tiny model's step;
* ``estimate``: FLOPs / rate + each step's and evaluation batch's cost + ``start_s`` per process (its start, data,
  checkpoints; the fork server's runs start without importing, ``ltcx/study/prestart.py``).

``estimate`` is a pure function of those counts and rates, so a test passes its own; the dry run prints it with the
rates it measured. Where the runs train on a GPU it is the CPU time this machine would need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Estimate", "START_S", "estimate", "measured_rate", "measured_step_s", "run_flops", "study_estimate"]

START_S = {"forked": 3.0, "fresh": 10.0}  # CPU seconds a run's process spends besides its steps (docs/compare.md)


@dataclass(frozen=True)
class Estimate:
    """``cpu_s`` = ``flops`` / ``rate`` + ``steps_s`` + ``processes`` x ``start_s``."""

    flops: float
    rate: float
    steps_s: float
    processes: int
    start_s: float

    @property
    def cpu_s(self) -> float:
        return self.flops / self.rate + self.steps_s + self.processes * self.start_s

    def describe(self) -> str:
        return (f"{_minutes(self.cpu_s)} ({self.flops / 1e12:.3g} TFLOP at {self.rate / 1e9:.3g} GFLOP per "
                f"CPU-second, {self.steps_s / 60:.3g} CPU-minutes of per-step cost, {self.processes} processes x "
                f"{self.start_s:g} CPU-s)")


def _minutes(seconds: float) -> str:
    if seconds < 5400:
        return f"{seconds / 60:.1f} CPU-minutes"
    hours = seconds / 3600
    return f"{hours:,.1f} CPU-hours" if hours < 100 else f"{hours:,.0f} CPU-hours"


def run_flops(flops_per_token: float, steps: int, batch_size: int, block_size: int, eval_batches: int) -> float:
    """A run's FLOPs: ``steps`` training steps of ``batch_size`` x ``block_size`` tokens at ``flops_per_token``
    (training: 3 x forward), and ``eval_batches`` batches of validation and test at a third of it."""
    tokens = batch_size * block_size
    return flops_per_token * tokens * (steps + eval_batches / 3)


def estimate(flops: list[float], rate: float, steps_s: list[float], processes: int, start_s: float) -> Estimate:
    """The CPU time of runs of ``flops`` each at ``rate`` FLOPs per CPU-second, ``steps_s`` each besides their
    arithmetic, in ``processes`` processes of ``start_s`` CPU seconds each."""
    if not rate > 0:
        raise ValueError(f"rate ({rate}) must be positive")
    return Estimate(float(sum(flops)), float(rate), float(sum(steps_s)), int(processes), float(start_s))


def _best_cpu_s(step, budget_s: float) -> float:
    """The least process CPU seconds of ``step()`` over the calls within ``budget_s`` CPU seconds, after one."""
    step()
    best, start = float("inf"), time.process_time()
    while True:
        before = time.process_time()
        step()
        after = time.process_time()
        if after > before:
            best = min(best, after - before)
        if after - start >= budget_s and best < float("inf"):
            return best


def _one_thread(function):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function()
    finally:
        torch.set_num_threads(previous)


def _step(backbone, vocab: int, batch: int, block: int):
    import torch

    from ltcx.lm import LanguageModel
    from ltcx.throughput import loss_step

    model = LanguageModel(backbone)
    idx = torch.randint(0, vocab, (batch, block + 1), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, loss_step(model, idx, optimizer, torch.autocast("cpu", enabled=False))


def measured_rate(budget_s: float = 0.5) -> float:
    """FLOPs per CPU-second of one thread training a small GPT (the module docstring)."""
    from ltcx.models.gpt import GPT

    def measure() -> float:
        model, step = _step(GPT(vocab_size=320, block_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=128),
                            320, 8, 128)
        return model.backbone.flops_per_token(128) * 8 * 128 / _best_cpu_s(step, budget_s)

    return _one_thread(measure)


def measured_step_s(arch: str, budget_s: float = 0.2) -> float:
    """CPU seconds per layer of one training step of ``arch`` (a catalogue name) at a tiny shape (the module
    docstring): its per-step cost besides the arithmetic."""
    from ltcx.models import catalog

    def measure() -> float:
        entry = catalog.get(arch)
        args = entry.scaled(64, 2, 16) if entry.scaling else {}
        backbone = entry.backbone_class()(**args, vocab_size=64)
        return _best_cpu_s(_step(backbone, 64, 1, 16)[1], budget_s) / 2

    return _one_thread(measure)


def _yaml_backbone(path) -> dict:
    """The ``model.backbone`` ({class_path, init_args}) a fit YAML gives, its ``config:`` includes first."""
    from pathlib import Path

    import yaml

    path = Path(path)
    raw = yaml.safe_load(path.read_text()) or {}
    included = raw.get("config")
    found: dict = {}
    for name in [included] if isinstance(included, str) else included or []:
        found = _yaml_backbone(path.parent / name) or found
    section = raw.get("model.backbone") or (raw.get("model") or {}).get("backbone")
    if isinstance(section, dict):
        same = section.get("class_path", found.get("class_path")) == found.get("class_path")
        found = {"class_path": section.get("class_path", found.get("class_path")),
                 "init_args": {**(found.get("init_args", {}) if same else {}), **(section.get("init_args") or {})}}
    return found


def shape_flops_per_token(spec, shape) -> float:
    """Training FLOPs per token of ``shape`` (a study's, ``ltcx/study/plan.py``) at the vocabulary its data gives
    it: its planned init_args, or its YAML's backbone (``size_by: config``)."""
    import importlib

    import torch

    from ltcx.study.budget import figures
    from ltcx.study.plan import arch_config, vocab_size

    block = shape.block_size(spec)
    vocab = vocab_size(spec, shape.entry or shape.arch, shape.cell)[1]
    if shape.init_args:
        return figures(shape.arch, {**shape.init_args, "vocab_size": vocab}, block, block)[1]
    backbone = _yaml_backbone(arch_config(shape))
    module, _, name = backbone["class_path"].rpartition(".")
    args = {k: v for k, v in backbone.get("init_args", {}).items() if k != "vocab_size"}
    if "block_size" in args and args["block_size"] is None:
        args["block_size"] = block
    with torch.device("meta"):
        model = getattr(importlib.import_module(module), name)(**args, vocab_size=vocab)
    return float(model.flops_per_token(block))


def study_estimate(spec, shapes, tuning_runs, rate: float, step_s: dict[str, float],
                   start_s: float) -> tuple[Estimate, Estimate]:
    """(the study's estimate with its grid as given, the most the grid's extensions add: ``lr_extend`` runs of each
    shape) at ``rate``, ``step_s`` (architecture -> CPU seconds per layer of a step besides its arithmetic; an
    evaluation batch costs a third) and ``start_s``. Processes: every tuning run, every other seed's run (tested in
    its own fit) and one ``ltcx test`` per shape (the tuning seed's run)."""
    from ltcx.study.plan import data_args, make_run

    per_token = {(shape.arch, shape.label): shape_flops_per_token(spec, shape) for shape in shapes}

    def batches(shape, test: bool) -> int:
        _, args = data_args(spec, shape.entry or shape.arch, shape.cell)
        val = int(args.get("val_batches", 0) or 0)
        return spec.evals * val + (int(args.get("test_batches") or val) if test else 0)

    def layers(shape) -> int:
        return int(shape.init_args.get("n_layer") or _yaml_backbone_layers(spec, shape))

    def cost(run, test: bool, train: bool = True) -> tuple[float, float]:
        steps = run.steps if train else 0
        evals = batches(run.shape, test) if train else batches(run.shape, True) - batches(run.shape, False)
        flops = run_flops(per_token[(run.arch, run.shape.label)], steps, spec.batch_size, run.block_size(spec), evals)
        return flops, step_s.get(run.arch, step_s.get("gpt", 0.0)) * layers(run.shape) * (steps + evals / 3)

    others = [make_run(spec, shape, spec.learning_rates[0], seed) for shape in shapes for seed in spec.seeds
              if seed != spec.tune_seed]
    tests = [make_run(spec, shape, spec.learning_rates[0], spec.tune_seed) for shape in shapes]
    base = ([cost(run, False) for run in tuning_runs] + [cost(run, True) for run in others]
            + [cost(run, True, train=False) for run in tests])
    grown = [cost(run, False) for run in tests] * (spec.lr_extend if len(spec.learning_rates) > 1 else 0)
    return (estimate([f for f, _ in base], rate, [s for _, s in base], len(tuning_runs) + len(others) + len(tests),
                     start_s),
            estimate([f for f, _ in grown], rate, [s for _, s in grown], len(grown), start_s))


def _yaml_backbone_layers(spec, shape) -> int:
    from ltcx.study.plan import arch_config

    return int(_yaml_backbone(arch_config(shape)).get("init_args", {}).get("n_layer") or 1)
