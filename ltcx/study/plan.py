"""A study's plan: each architecture's shape at each size in each cell of the grid (``size_by: width``: the
catalogue's scaling rule at ``layers``; ``params``: the baseline at that many non-embedding parameters, the others
matched to its ``match`` figure by ``ltcx/study/budget.py``; ``config``: the YAML as it is), and each run's steps.
What runs where is ``processes``'; what the runs leave behind is ``results``'.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltcx.errors import ConfigError
from ltcx.study.spec import StudySpec, arch_name

__all__ = ["CELL_NAMES", "DEFAULT_VOCAB", "Run", "Shape", "grid_cells", "make_run", "plan_shapes", "run_steps",
           "vocab_size"]

DEFAULT_VOCAB = 50304  # GPT-2's padded vocabulary: the shapes' figures when the data sets none


@dataclass(frozen=True)
class Shape:
    """One architecture at one size in one cell of the grid: its ``init_args`` (less ``vocab_size``), the budget
    match's distance, and the cell's ``--data`` values. ``entry`` is the spec's ``archs`` entry (a catalogue name or
    a model YAML), ``arch`` its name."""

    arch: str
    size: float
    init_args: dict[str, Any]
    distance: float | None = None
    cell: tuple[tuple[str, Any], ...] = ()
    entry: str = ""

    @property
    def label(self) -> str:
        size = "config" if not self.init_args and self.distance is None else f"size{self.size:g}"
        return "-".join([size, *(f"{CELL_NAMES.get(key, key)}{_cell_value(value)}" for key, value in self.cell)])

    def block_size(self, spec: StudySpec) -> int:
        """The sequence length of this cell (the grid's ``block_size``, else the spec's)."""
        return int(dict(self.cell).get("block_size", spec.block_size))


# a grid key's short name in labels and folders: T64-P8 is length 64 with 8 key-value pairs
CELL_NAMES = {"block_size": "T", "num_kv_pairs": "P"}


def _cell_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value).lower()


@dataclass(frozen=True)
class Run:
    """One ``ltcx fit``: an architecture's shape, a learning rate and a seed."""

    shape: Shape
    lr: float
    seed: int
    steps: int
    evals: int

    @property
    def arch(self) -> str:
        return self.shape.arch

    @property
    def label(self) -> str:
        return f"{self.arch} {self.shape.label} lr={self.lr:g} seed {self.seed}"

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.arch / self.shape.label / f"lr{self.lr:g}" / f"seed{self.seed}"

    def block_size(self, spec: StudySpec) -> int:
        return self.shape.block_size(spec)


def vocab_size(spec: StudySpec) -> int:
    return int(spec.data.get("vocab_size", DEFAULT_VOCAB))


def grid_cells(spec: StudySpec) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the spec's ``grid`` (one empty cell without a grid), the first key varying slowest. A cell
    the data refuses (MQAR's ``block_size >= 4 * num_kv_pairs``, ``check_mqar``) is left out."""
    from ltcx.data.mqar import check_mqar

    keys = list(spec.grid)
    cells = []
    for values in itertools.product(*(spec.grid[key] for key in keys)):
        cell = tuple(zip(keys, values))
        pairs = dict(cell).get("num_kv_pairs", spec.data.get("num_kv_pairs"))
        if pairs is not None and isinstance(pairs, int):
            try:
                check_mqar(vocab_size(spec), int(dict(cell).get("block_size", spec.block_size)), pairs, 1.0)
            except ConfigError:
                continue
        cells.append(cell)
    return cells


def plan_shapes(spec: StudySpec) -> list[Shape]:
    """Every (architecture, size, cell) of the study: cells within sizes, architectures in the spec's order within
    each."""
    cells = grid_cells(spec)
    if not cells:
        raise ConfigError(f"study spec {spec.source}: key 'grid' leaves no cell the data accepts (MQAR needs "
                          "block_size >= 4 * num_kv_pairs): fix the grid")
    if spec.size_by == "config":
        return [Shape(arch_name(entry), 0.0, {}, cell=cell, entry=entry) for cell in cells for entry in spec.archs]
    return [dataclasses.replace(shape, cell=cell) for size in spec.sizes for cell in cells
            for shape in _shapes_at(spec, size, int(dict(cell).get("block_size", spec.block_size)))]


def _shapes_at(spec: StudySpec, size: float, block_size: int) -> list[Shape]:
    """Every architecture at ``size`` for sequences of ``block_size``."""
    from ltcx.models import catalog
    from ltcx.study.budget import match_shape

    options = {} if spec.head_dim is None else {"head_dim": spec.head_dim}
    shapes = []
    if spec.size_by == "width":
        for arch in spec.archs:
            entry = catalog.get(arch)
            if entry.scaling is None:
                raise ConfigError(f"architecture '{arch}' has no scaling rule: give its catalogue entry one "
                                  "(Architecture.scaling, ltcx/models/scaling.py) or use size_by: config")
            layers = spec.layers or entry.scaling.depth
            shapes.append(Shape(arch, size, _initialised(arch, entry.scaled(int(size), layers, block_size, **options),
                                                         spec), entry=arch))
        return shapes
    reference = match_shape(spec.reference, "params", size, block_size, vocab_size(spec), n_layers=spec.layers,
                            **options)
    target = reference.figure(spec.match)
    for arch in spec.archs:
        match = reference if arch == spec.reference else match_shape(
            arch, spec.match, target, block_size, vocab_size(spec), n_layers=spec.layers, **options)
        args = {k: v for k, v in match.init_args.items() if k != "vocab_size"}
        shapes.append(Shape(arch, size, _initialised(arch, args, spec), match.distance, entry=arch))
    return shapes


def _initialised(arch: str, init_args: dict[str, Any], spec: StudySpec) -> dict[str, Any]:
    """``scaled_init``: N(0, 1/width) matrices where the backbone has ``init_std`` (GPT-2's 0.02 is made for width 768;
    at width 64 it keeps a GPT on MQAR's plateau for thousands of steps, docs/recall.md)."""
    from ltcx.models import catalog

    if not spec.scaled_init:
        return init_args
    fields = {f.name for f in dataclasses.fields(catalog.get(arch).backbone_class().config_class)}
    width = init_args.get("n_embd")
    return {**init_args, "init_std": round(width ** -0.5, 6)} if "init_std" in fields and width else init_args


def run_steps(spec: StudySpec, shape: Shape) -> tuple[int, int]:
    """(max_steps, steps between validations): ``steps``, or ``tokens_per_param`` x the shape's non-embedding
    parameters in batches, rounded up to a multiple of ``evals`` (the last validation is at the end)."""
    steps = spec.steps
    if steps is None:
        from ltcx.study.budget import figures

        if spec.size_by == "config":
            raise ConfigError(f"study spec {spec.source}: size_by: config needs 'steps' (tokens_per_param needs a "
                              "shape the study sets)")
        block_size = shape.block_size(spec)
        params = figures(shape.arch, {**shape.init_args, "vocab_size": vocab_size(spec)}, block_size, block_size)[0]
        steps = math.ceil(spec.tokens_per_param * params / (spec.batch_size * block_size))
    every = max(1, math.ceil(steps / spec.evals))
    return every * spec.evals, every


def make_run(spec: StudySpec, shape: Shape, lr: float, seed: int) -> Run:
    steps, _ = run_steps(spec, shape)
    return Run(shape, lr, seed, steps, spec.evals)
