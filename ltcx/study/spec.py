"""A study spec: what a study trains, read from a YAML a user writes (presets ship in ``configs/study/``).

    name: quick-recall            # results/<name>/ (default: the file's stem)
    archs: [gpt, ltc, xlstm]      # catalogue names; the first is the baseline unless ``baseline`` names another
    configs: [data/mqar]          # composed after each architecture's YAML (shipped names or paths)
    data: {num_kv_pairs: 4}       # --data.<key> for every run; also model: {...}, trainer: {...}, args: [...]
    size_by: width                # width (the scaling rule at ``layers``) | params (non-embedding, matched) |
                                  # config (each YAML as it is; no sizes)
    sizes: [32, 64]               # the ladder: widths, or the baseline's non-embedding parameters
    match: params                 # size_by params: what the others match the baseline on (params | flops | state)
    block_size: 32
    batch_size: 32
    steps: 400                    # or tokens_per_param: 20 (tokens = that x the non-embedding parameters)
    learning_rates: [1e-3, 3e-3, 1e-2]
    lr_extend: 3                  # rates the grid may add per (architecture, size, cell), one at a time outward by
                                  # its own ratio, while the chosen rate is at its edge (0: the grid as given)
    seeds: [0, 1, 2]
    metric: recall_acc            # chosen on val/<metric>, reported on test/<metric>: loss | bpb | recall_acc
    grid: {block_size: [64, 128], num_kv_pairs: [4, 8]}   # optional: cells (every combination of --data values);
                                  # each (architecture, size, cell) has its own learning rate
    anchor: 0.99                  # optional: the baseline must reach this test/<metric> on the first cell
    timing_rounds: 5              # the interleaved timing pass after training (0: none)
    launcher: {kind: devices, workers: 8}   # where runs train: local (default) | devices | slurm (partition,
                                  # time_min, gpus_per_run, cpus_per_run, runs_per_job); docs/launchers.md

An ``archs`` entry is a catalogue name or, with ``size_by: config``, a model YAML of your own (a variant: its file
stem names it in the tables).

``load_spec`` checks every key before anything runs: an unknown key, a wrong type or a value out of range is one
``ConfigError`` line naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ltcx.errors import ConfigError

__all__ = ["METRICS", "StudySpec", "arch_name", "find_spec", "load_spec", "name_problem", "preset_names"]

# metric -> True when higher is better (the selection's direction)
METRICS = {"loss": False, "bpb": False, "recall_acc": True}


@dataclass(frozen=True)
class StudySpec:
    """One study; ``load_spec`` fills it from YAML and checks it. The run-defining fields are all of them except
    ``name``, ``description`` and ``source``."""

    archs: list[str]
    block_size: int
    batch_size: int
    learning_rates: list[float]
    name: str = "study"
    description: str = ""
    baseline: str | None = None
    configs: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    sizes: list[float] = field(default_factory=list)
    size_by: str = "params"
    match: str = "params"
    layers: int | None = None
    head_dim: int | None = None
    scaled_init: bool = False
    steps: int | None = None
    tokens_per_param: float | None = None
    evals: int = 4
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    lr_extend: int = 3
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    tuning_seed: int | None = None
    metric: str = "loss"
    grid: dict[str, list] = field(default_factory=dict)
    anchor: float | None = None
    timing_rounds: int = 5
    launcher: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def reference(self) -> str:
        """The baseline: the paired differences and the compute multiplier are against it."""
        return self.baseline or arch_name(self.archs[0])

    @property
    def tune_seed(self) -> int:
        return self.seeds[0] if self.tuning_seed is None else self.tuning_seed

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric]

    def defining(self) -> dict[str, Any]:
        """What decides the runs' results: a results folder holds one study (``results.check_folder`` compares this
        on resume). The timing pass and the anchor are read from the finished runs, so changing them redoes no run;
        the launcher says where runs train, not what they are."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("name", "description", "source", "timing_rounds", "anchor", "launcher")}


_TYPES = {f.name: f.type for f in dataclasses.fields(StudySpec)}
_REQUIRED = [f.name for f in dataclasses.fields(StudySpec)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: take it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def load_spec(path: str | Path, name: str | None = None) -> StudySpec:
    """The spec in ``path``, checked; ``name`` (default: the YAML's ``name``, else the file's stem)."""
    import yaml

    path = Path(path)
    where = f"study spec {path}"
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"{where}: cannot read it ({error.strerror}): pass --spec a YAML file or a preset "
                          f"({', '.join(preset_names())})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}: not valid YAML{at}: fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping of keys (archs:, sizes:, ...), not {type(raw).__name__}")
    keys = [k for k in _TYPES if k != "source"]
    unknown = sorted(set(raw) - set(keys), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}': the keys are {', '.join(keys)}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"{where}: missing key '{missing[0]}' (required: {', '.join(_REQUIRED)})")
    values = {key: _check(where, key, value) for key, value in raw.items()}
    if name is not None:  # --name: held inside --out as the spec's name is
        problem = name_problem(name)
        if problem:
            raise ConfigError(f"--name {name!r} {problem}: results go to <out>/<name>/: give a folder's name")
        values["name"] = name
    values.setdefault("name", path.stem)
    spec = StudySpec(**values, source=str(path))
    _check_whole(where, spec)
    return spec


def _check(where: str, key: str, value: Any) -> Any:
    """``value`` of ``key`` in its type, or one line naming the key and what it takes."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: key '{key}' ({value!r}) must be {what}")

    if key in ("archs", "configs", "args"):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise bad("a list of strings")
        if key == "archs" and not value:
            raise bad("a list of at least one architecture")
        return list(value)
    if key in ("data", "model", "trainer"):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad(f"a mapping of --{key}.<key> values")
        return dict(value)
    if key in ("sizes", "learning_rates"):
        value = [_number(v) for v in value] if isinstance(value, list) else value
        if not isinstance(value, list) or not value or not all(_is_number(v) and v > 0 for v in value):
            raise bad("a list of positive numbers")
        if len(set(value)) != len(value):
            raise bad("a list without repeats")
        if key == "learning_rates" and len(value) > 5:
            raise bad("at most 5 values (a log-spaced grid of 3-5)")
        return sorted(value)
    if key == "seeds":
        if not isinstance(value, list) or not value or not all(_is_int(v) and v >= 0 for v in value):
            raise bad("a list of seeds (integers >= 0)")
        if len(set(value)) != len(value):
            raise bad("a list without repeats")
        return list(value)
    if key == "grid":
        if not isinstance(value, dict) or not value or not all(isinstance(k, str) for k in value):
            raise bad("a mapping of --data keys to lists of values (e.g. {num_kv_pairs: [4, 8]})")
        for name, values in value.items():
            if not isinstance(values, list) or not values or len(set(map(repr, values))) != len(values):
                raise ConfigError(f"{where}: key 'grid.{name}' ({values!r}) must be a non-empty list without repeats")
        return {name: list(values) for name, values in value.items()}
    if key == "anchor":
        value = _number(value)
        if not _is_number(value):
            raise bad("a number (the baseline's least test/<metric> on the first cell)")
        return float(value)
    if key == "timing_rounds":
        if not (_is_int(value) and value >= 0):
            raise bad("an integer >= 0 (0: no timing pass)")
        return value
    if key == "lr_extend":
        if not (_is_int(value) and value >= 0):
            raise bad("an integer >= 0 (rates the grid may add outward; 0: none)")
        return value
    if key in ("block_size", "batch_size", "evals", "steps", "layers", "head_dim"):
        if not (_is_int(value) and value >= 1):
            raise bad("an integer >= 1")
        return value
    if key == "tuning_seed":
        if not (_is_int(value) and value >= 0):
            raise bad("an integer >= 0")
        return value
    if key in ("tokens_per_param", "warmup_fraction", "min_lr_ratio"):
        value = _number(value)
        if not _is_number(value) or value < 0 or (key == "tokens_per_param" and value == 0) or (
                key != "tokens_per_param" and value > 1):
            raise bad("a positive number" if key == "tokens_per_param" else "a number in [0, 1]")
        return float(value)
    if key == "scaled_init":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if key == "size_by":
        if value not in ("width", "params", "config"):
            raise bad("width, params or config")
        return value
    if key == "match":
        if value not in ("params", "flops", "state"):
            raise bad("params, flops or state")
        return value
    if key == "metric":
        if value not in METRICS:
            raise bad(f"one of {', '.join(METRICS)}")
        return value
    if key == "name":
        problem = name_problem(value)
        if problem:
            raise ConfigError(f"{where}: key 'name' ({value!r}) {problem} (results go to <out>/<name>/)")
        return value
    if key in ("description", "baseline"):
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if key == "launcher":
        from ltcx.study.launch import check_options

        return check_options(where, value)
    raise AssertionError(key)  # every key of StudySpec is checked above


def _check_whole(where: str, spec: StudySpec) -> None:
    """The rules between keys."""
    from ltcx.models.catalog import CATALOG

    files = [a for a in spec.archs if a not in CATALOG and a.endswith((".yaml", ".yml"))]
    for file in files:
        if not Path(file).is_file():
            raise ConfigError(f"{where}: key 'archs': no such model YAML '{file}': fix the path")
        if spec.size_by != "config":
            raise ConfigError(f"{where}: key 'archs': a model YAML ('{file}') is trained as it is: use size_by: "
                              "config, or a catalogue name for a study that sets the shapes")
    if len({arch_name(a) for a in spec.archs}) != len(spec.archs):
        raise ConfigError(f"{where}: key 'archs' names an architecture twice (a YAML is named by its file stem)")
    unknown = [a for a in spec.archs if a not in CATALOG and a not in files]
    if unknown:
        raise ConfigError(f"{where}: key 'archs': unknown architecture '{unknown[0]}' "
                          f"(the catalogue's: {', '.join(sorted(CATALOG))}; or a model YAML's path)")
    if spec.baseline is not None and spec.baseline not in [arch_name(a) for a in spec.archs]:
        raise ConfigError(f"{where}: key 'baseline' ({spec.baseline}) is not one of archs ({', '.join(spec.archs)})")
    if (spec.steps is None) == (spec.tokens_per_param is None):
        raise ConfigError(f"{where}: give exactly one of keys 'steps' and 'tokens_per_param' (the training length)")
    if (spec.size_by == "config") == bool(spec.sizes):
        raise ConfigError(f"{where}: key 'sizes' " + ("is left out with size_by: config (the YAMLs' own shapes)"
                                                      if spec.sizes else "is missing: the ladder's widths or "
                                                      "parameter counts (or size_by: config)"))
    if spec.size_by == "config" and spec.steps is None:
        raise ConfigError(f"{where}: size_by: config needs key 'steps' (tokens_per_param needs a shape the study sets)")
    if spec.size_by == "width" and not all(float(s).is_integer() for s in spec.sizes):
        raise ConfigError(f"{where}: key 'sizes' must be integer widths when size_by is width")
    if spec.size_by != "params" and spec.match != "params":
        raise ConfigError(f"{where}: key 'match' applies to size_by: params only")
    if spec.tuning_seed is not None and spec.tuning_seed not in spec.seeds:
        raise ConfigError(f"{where}: key 'tuning_seed' ({spec.tuning_seed}) must be one of seeds {spec.seeds}")
    for key, reserved in (("data", ("seed", "batch_size", "block_size")),
                          ("model", ("learning_rate", "min_lr", "warmup_steps"))):
        taken = [k for k in getattr(spec, key) if k in reserved or k.startswith("backbone")]
        if taken:
            raise ConfigError(f"{where}: key '{key}.{taken[0]}' is set by the study itself (seeds, batch_size, "
                              "block_size, learning_rates, sizes): leave it out")
    taken = [k for k in spec.grid if k in ("seed", "batch_size") or k in spec.data]
    if taken:
        raise ConfigError(f"{where}: key 'grid.{taken[0]}' is " + ("also in key 'data': keep it in one of them"
                                                                  if taken[0] in spec.data else "set by the study"))
    if spec.anchor is not None and not spec.higher_is_better:
        raise ConfigError(f"{where}: key 'anchor' applies to a metric where higher is better (recall_acc)")
    taken = [k for k in spec.trainer if k in ("max_steps", "val_check_interval", "default_root_dir")]
    if taken:
        raise ConfigError(f"{where}: key 'trainer.{taken[0]}' is set by the study itself (steps, evals): leave it out")


def name_problem(name: object) -> str | None:
    """What keeps ``name`` from being one folder inside ``--out`` (the spec's ``name`` or ``--name``), or None."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if any(c in name for c in "/\\\0") or name in (".", "..") or not name.isprintable():
        return "must be one folder's name: printable, without '/' or '\\', not '.' or '..'"
    return None


def arch_name(arch: str) -> str:
    """An ``archs`` entry's name in folders and tables: a catalogue name, or a model YAML's file stem."""
    return Path(arch).stem if arch.endswith((".yaml", ".yml")) else arch


def preset_dir() -> Path:
    from ltcx.models.catalog import CONFIG_DIR

    return CONFIG_DIR / "study"


def preset_names() -> list[str]:
    """The presets shipped with ltcx (``configs/study/<name>.yaml``)."""
    folder = preset_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def find_spec(value: str) -> Path:
    """``--spec``: a YAML file, else a shipped preset's name (``quick-recall``); one line naming the presets."""
    path = Path(value)
    if path.is_file():
        return path
    preset = preset_dir() / f"{value.removesuffix('.yaml')}.yaml"
    if "/" not in value and preset.is_file():
        return preset
    raise ConfigError(f"--spec {value}: no such file or preset: pass a study YAML or one of "
                      f"{', '.join(preset_names())}")
