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

__all__ = ["CELL_NAMES", "Run", "Shape", "arch_config", "composed_configs", "data_args", "grid_cells", "make_run",
           "plan_shapes", "run_steps", "vocab_size"]

TEXT_DATA = "ltcx.data.TextDataModule"  # the CLI's data class when a config names none


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


def _config_data(path: Path) -> list[dict]:
    """The ``data`` sections of a fit YAML in the order the CLI applies them: its ``config:`` includes first."""
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    parts: list[dict] = []
    included = raw.get("config")
    for name in [included] if isinstance(included, str) else included or []:
        parts += _config_data(path.parent / name)
    if isinstance(raw.get("data"), dict):
        parts.append(raw["data"])
    return parts


def data_args(spec: StudySpec, entry: str, cell: tuple = ()) -> tuple[str, dict[str, Any]]:
    """(class path, init args) of the data module a run of ``entry`` (a catalogue name or a model YAML) in ``cell``
    gets: its YAML's ``data``, then the spec's ``configs``, ``data`` and the cell, the study's block and batch sizes,
    merged as the CLI merges them (a new ``class_path`` starts its own arguments)."""

    parts = _config_data(Path(arch_config(Shape("", 0.0, {}, entry=entry))))
    for path in composed_configs(spec):
        parts += _config_data(Path(path))
    parts += [spec.data, dict(cell)]
    class_path, args = TEXT_DATA, {}
    for part in parts:
        if part.get("class_path", class_path) != class_path:
            class_path, args = part["class_path"], {}
        args.update({k: v for k, v in part.items() if k not in ("class_path", "init_args")})
        args.update(part.get("init_args") or {})
    args.update(block_size=int(dict(cell).get("block_size", spec.block_size)), batch_size=spec.batch_size)
    return class_path, args


_vocabs: dict[str, tuple[int, int]] = {}


def vocab_size(spec: StudySpec, entry: str | None = None, cell: tuple = ()) -> tuple[int, int]:
    """(the data's ids, the model's vocabulary: the ids padded as the data pads them) for a run of ``entry``
    (default: the first architecture) in ``cell``: the figures of the data module the run builds (its tokenizer's,
    or MQAR's ``vocab_size``), so that planned parameters, FLOPs and state are the trained model's."""
    import json

    class_path, args = data_args(spec, entry or spec.archs[0], cell)
    key = json.dumps([class_path, args], sort_keys=True, default=str)
    if key not in _vocabs:
        try:
            data = _data_class(spec, class_path)(**args)
            _vocabs[key] = (int(data.vocab_size), int(data.padded_vocab_size))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"study spec {spec.source}: its data ({class_path}) cannot be built to read its "
                              f"vocabulary: {str(error).splitlines()[0]}: fix 'data' or 'configs'") from None
    return _vocabs[key]


def _data_class(spec: StudySpec, class_path: str) -> type:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"study spec {spec.source}: no data class '{class_path}': fix its class_path") from None


def _default(spec: StudySpec, class_path: str, name: str) -> Any:
    import inspect

    parameter = inspect.signature(_data_class(spec, class_path)).parameters.get(name)
    return None if parameter is None else parameter.default


def grid_cells(spec: StudySpec) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the spec's ``grid`` (one empty cell without a grid), the first key varying slowest. A cell
    the data refuses (MQAR's ``block_size >= 4 * num_kv_pairs``, ``check_mqar``) is left out."""
    from ltcx.data.mqar import check_mqar

    keys = list(spec.grid)
    cells = []
    for values in itertools.product(*(spec.grid[key] for key in keys)):
        cell = tuple(zip(keys, values))
        class_path, args = data_args(spec, spec.archs[0], cell)
        pairs = args.get("num_kv_pairs")
        if isinstance(pairs, int):
            vocab = args.get("vocab_size", _default(spec, class_path, "vocab_size"))
            try:
                check_mqar(vocab, args["block_size"], pairs, 1.0)
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
    return [shape for size in spec.sizes for cell in cells for shape in _shapes_at(spec, size, cell)]


def _shapes_at(spec: StudySpec, size: float, cell: tuple) -> list[Shape]:
    """Every architecture at ``size`` in ``cell``, each matched at the vocabulary its data gives it."""
    from ltcx.study.budget import match_shape

    block_size = int(dict(cell).get("block_size", spec.block_size))
    options = {} if spec.head_dim is None else {"head_dim": spec.head_dim}
    for arch in spec.archs:
        check_shape_fields(spec, arch)
    if spec.size_by == "width":
        shapes = []
        for arch in spec.archs:
            args = _width_shape(spec, arch, int(size), block_size, vocab_size(spec, arch, cell)[1])
            shapes.append(Shape(arch, size, _initialised(arch, args, spec), cell=cell, entry=arch))
        return shapes
    where = f"study spec {spec.source}"
    reference = match_shape(spec.reference, "params", size, block_size, vocab_size(spec, spec.reference, cell)[1],
                            n_layers=spec.layers, where=where, **options)
    target = reference.figure(spec.match)
    shapes = []
    for arch in spec.archs:
        match = reference if arch == spec.reference else match_shape(
            arch, spec.match, target, block_size, vocab_size(spec, arch, cell)[1], n_layers=spec.layers, where=where,
            **options)
        args = {k: v for k, v in match.init_args.items() if k != "vocab_size"}
        shapes.append(Shape(arch, size, _initialised(arch, args, spec), match.distance, cell=cell, entry=arch))
    return shapes


def check_shape_fields(spec: StudySpec, arch: str) -> None:
    """The spec's shape fields (``head_dim``) are ones ``arch``'s scaling rule takes: else one line."""
    import inspect

    from ltcx.models import catalog

    rule = catalog.get(arch).scaling
    if rule is None:
        raise ConfigError(f"study spec {spec.source}: architecture '{arch}' has no scaling rule (Architecture.scaling, "
                          "ltcx/models/scaling.py): use size_by: config, or give its catalogue entry one")
    taken = inspect.signature(rule.shape).parameters
    if spec.head_dim is not None and "head_dim" not in taken:
        raise ConfigError(f"study spec {spec.source}: key 'head_dim': architecture '{arch}' sets its own heads (its "
                          "scaling rule takes no head_dim): leave head_dim out or leave the architecture out")


def _width_shape(spec: StudySpec, arch: str, width: int, block_size: int, vocab: int) -> dict[str, Any]:
    """``arch`` at ``width`` (``size_by: width``), or one line naming the widths or head dims it builds at."""
    from ltcx.models import catalog
    from ltcx.study.budget import shape_problem

    rule = catalog.get(arch).scaling
    layers = spec.layers or rule.depth

    def problem(w: int, head_dim: int | None) -> str | None:
        options = {} if head_dim is None else {"head_dim": head_dim}
        if head_dim is not None and w % head_dim:
            return f"head_dim {head_dim} does not divide the width {w}"
        return shape_problem(arch, {**catalog.get(arch).scaled(w, layers, block_size, **options), "vocab_size": vocab})

    found = problem(width, spec.head_dim)
    if found is None:
        return catalog.get(arch).scaled(width, layers, block_size,
                                        **({} if spec.head_dim is None else {"head_dim": spec.head_dim}))
    widths = [w for w in rule.widths(4 * max(width, 64)) if problem(w, spec.head_dim) is None][:6]
    valid = f"widths it builds at: {', '.join(map(str, widths))}" if widths else "no width near it builds"
    if spec.head_dim is not None:
        dims = [d for d in range(1, width + 1) if width % d == 0 and problem(width, d) is None]
        valid += f"; head_dim values it builds at width {width}: {', '.join(map(str, dims)) or 'none'}"
    raise ConfigError(f"study spec {spec.source}: {arch} at width {width} x {layers} layers"
                      + (f" with head_dim {spec.head_dim}" if spec.head_dim is not None else "")
                      + f" is no valid shape ({found}): {valid}")


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
        vocab = vocab_size(spec, shape.entry or shape.arch, shape.cell)[1]
        params = figures(shape.arch, {**shape.init_args, "vocab_size": vocab}, block_size, block_size)[0]
        steps = math.ceil(spec.tokens_per_param * params / (spec.batch_size * block_size))
    every = max(1, math.ceil(steps / spec.evals))
    return every * spec.evals, every


def make_run(spec: StudySpec, shape: Shape, lr: float, seed: int) -> Run:
    steps, _ = run_steps(spec, shape)
    return Run(shape, lr, seed, steps, spec.evals)


def arch_config(shape: Shape) -> str:
    """The model YAML of ``shape``: its own (a variant's file) or the catalogue's."""
    from ltcx.models.catalog import config_path

    entry = shape.entry or shape.arch
    return str(Path(entry).resolve()) if entry.endswith((".yaml", ".yml")) else str(config_path(entry))


def composed_configs(spec: StudySpec) -> list[str]:
    """The spec's ``configs`` as paths: a shipped name (``data/mqar``) or a file."""
    from ltcx.models.catalog import shipped_config

    paths = []
    for config in spec.configs:
        path = Path(config) if Path(config).is_file() else shipped_config(config)
        if path is None:
            raise ConfigError(f"study spec {spec.source}: key 'configs': '{config}' is neither a file nor a shipped "
                              "config (e.g. data/mqar, trainer/smoke)")
        paths.append(str(Path(path).resolve()))
    return paths
