"""The catalogue of ltcx's architectures: one entry per architecture name (``gpt``, ``ltc``, ...), naming its
backbone class, its YAML and the parameter count of that YAML's model, a tiny shape for tests and the tiny forms of
its variants (GTA's RoPE, the xLSTM's parallel mLSTM, Titans' memory chunks, ...).

Everything that holds a list of architectures reads it from here: the registry's allow-list of backbone
classes (``ltcx/models/registry.py``), the benchmark and comparison scripts, and the tests (``tests/test_contract.py``
runs every contract check on every entry and every variant, ``tests/test_configs.py`` every YAML and its size).

Importing this module is cheap: a backbone's module is imported only when its class is asked for.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ltcx.models import scaling
from ltcx.models.scaling import Knob, ScalingRule

__all__ = ["CATALOG", "CONFIG_DIR", "Architecture", "add_to_catalog", "build_configured", "build_tiny", "config_path",
           "get", "names", "shipped_config", "shipped_config_names"]

ROOT = Path(__file__).resolve().parents[2]
# The configs: inside the installed package as ltcx/configs/ (setup.py ships configs/ there), else the checkout's.
_PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG_DIR = _PACKAGED_CONFIGS if _PACKAGED_CONFIGS.is_dir() else ROOT / "configs"


@dataclass(frozen=True)
class Architecture:
    """One architecture: ``module.class_name`` is its backbone, ``yaml`` its config (relative to the repository
    root; ``""`` for none) and ``yaml_parameters`` the ``parameter_count()`` of that YAML's model at GPT-2's padded
    vocabulary (50,304), ``tiny`` the constructor arguments (less ``vocab_size``) of a shape whose forward takes
    milliseconds, ``variants`` named changes of ``tiny`` that take other code paths (each one a tiny shape too),
    ``scaling`` how it grows with the YAML's proportions (``ltcx/models/scaling.py``; the budget search's rule)."""

    name: str
    module: str
    class_name: str
    yaml: str
    tiny: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    yaml_parameters: int | None = None
    scaling: ScalingRule | None = None

    def scaled(self, width: int, n_layer: int, seq_len: int, **options) -> dict[str, Any]:
        """The init_args (less ``vocab_size``) of this architecture at ``width`` x ``n_layer`` for sequences of
        ``seq_len`` tokens, with its YAML's proportions (``options``: the rule's, e.g. ``head_dim``)."""
        if self.scaling is None:
            raise ValueError(f"architecture '{self.name}' has no scaling rule (Architecture.scaling in "
                             "ltcx/models/catalog.py)")
        return self.scaling.shape(width, n_layer, seq_len, **options)

    def shapes(self) -> dict[str, dict[str, Any]]:
        """``{"tiny": tiny, variant: tiny changed by it, ...}``: every tiny shape of this architecture."""
        return {"tiny": dict(self.tiny), **{name: {**self.tiny, **change} for name, change in self.variants.items()}}

    @property
    def class_path(self) -> str:
        return f"{self.module}.{self.class_name}"

    def backbone_class(self) -> type:
        """The backbone class (its module imported on first use)."""
        return getattr(importlib.import_module(self.module), self.class_name)

    def build_tiny(self, vocab_size: int, variant: str = "tiny", **overrides) -> Any:
        """The backbone at its tiny shape or one of its variants' (float32, training mode)."""
        return self.backbone_class()(**{**self.shapes()[variant], "vocab_size": vocab_size, **overrides})

    def tiny_cli(self) -> list[str]:
        """CLI overrides for a tiny fit of ``yaml``: the tiny init_args (the vocabulary is linked from the data,
        so it is not among them) and a warmup of 2 steps."""
        args = []
        for key, value in self.tiny.items():
            args += [f"--model.backbone.init_args.{key}", value if isinstance(value, str) else json.dumps(value)]
        return [*args, "--model.warmup_steps", "2"]


_GPT_TINY = dict(block_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, bias=False)
_TITANS_TINY = dict(n_embd=16, n_layer=2, n_head=2, n_kv_head=1, mlp_hidden=32, window=4, segment=4, n_persistent=2,
                    mem_heads=2, mem_head_dim=8, mem_hidden=16, memory_chunk_size=4)

_MLP = Knob("mlp_hidden")  # the fine knob of parameters and FLOPs
_GQA = dict(widths=scaling.gqa_widths, depth=6)


def _titans_rule(variant: str) -> ScalingRule:
    return ScalingRule(scaling.titans(variant), **_GQA, knobs={"params": _MLP, "flops": _MLP,
                                                                "state": Knob("mem_hidden")})


_ENTRIES = [
    Architecture("gpt", "ltcx.models.gpt", "GPT", "configs/gpt.yaml", _GPT_TINY,
                 variants={"mha_bias": dict(n_kv_head=2, bias=True), "rope": dict(position="rope")},
                 yaml_parameters=28_758_912,
                 scaling=ScalingRule(scaling.gpt, **_GQA, knobs={"params": _MLP, "flops": _MLP})),
    Architecture("ltc", "ltcx.models.ltc", "LTCGPT", "configs/ltc.yaml", {**_GPT_TINY, "num_decay_modes": 4},
                 variants={"all_modes": dict(num_decay_modes=8),  # as many modes as the head's 8 coordinates
                           "low_rank_controller": dict(num_decay_modes=1, controller_rank=2),
                           "mlp_controller": dict(controller_hidden_size=16)},
                 yaml_parameters=29_104_512,
                 scaling=ScalingRule(scaling.ltc, **_GQA, knobs={"params": _MLP, "flops": _MLP})),
    Architecture("xlstm", "ltcx.models.xlstm", "XLSTM", "configs/xlstm.yaml",
                 dict(n_embd=16, n_layer=2, signature=[1, 1], n_head=2, slstm_n_head=2, chunk_size=4, proj_round_to=8),
                 variants={"parallel": dict(mlstm_backend="parallel"),
                           "slstm_first_untied": dict(n_layer=3, slstm_at=[0, 2], tie_embeddings=False, bias=True),
                           "exp_forget": dict(forget_gate="exp")},
                 yaml_parameters=28_664_616,
                 scaling=ScalingRule(scaling.xlstm, scaling.xlstm_widths, depth=8)),
    Architecture("gta", "ltcx.models.gta", "GTAGPT", "configs/gta.yaml",
                 dict(block_size=64, n_layer=2, n_head=2, n_embd=16, bias=False, key_dim=8, latent_dim=8),
                 variants={"more_groups": dict(n_head=4, n_query_group=4, n_key_head=2, n_latent_head=1, latent_dim=4),
                           "rope": dict(rope=True),
                           "no_gate_bias": dict(gate=False, bias=True, n_latent_head=2, latent_dim=8)},
                 yaml_parameters=29_053_824,
                 scaling=ScalingRule(scaling.gta, scaling.gta_widths, depth=6, knobs={"params": _MLP, "flops": _MLP})),
    *(Architecture(f"titans_{variant}", "ltcx.models.titans", "Titans", f"configs/titans_{variant}.yaml",
                   {"variant": variant, **_TITANS_TINY},
                   # memory chunks of one token (the paper's online recurrence) and of a length that does not
                   # divide the segment or the tests' lengths (MAC's segments hold whole chunks: 2 there)
                   variants={"chunk_1": dict(memory_chunk_size=1),
                             "chunk_odd": dict(memory_chunk_size=2 if variant == "mac" else 5)},
                   yaml_parameters=parameters, scaling=_titans_rule(variant))
      for variant, parameters in (("mag", 28_753_644), ("mac", 28_755_948), ("mal", 28_773_558),
                                  ("lmm", 28_763_628))),
    Architecture("gated_deltanet", "ltcx.models.gated_deltanet", "GatedDeltaNet", "configs/gated_deltanet.yaml",
                 dict(n_embd=16, n_layer=2, n_head=2, head_dim=4, mlp_hidden=32, chunk_size=4),
                 # chunks that do not divide the tests' lengths; values as wide as the keys, a shorter convolution
                 variants={"chunk_odd": dict(chunk_size=5), "square_heads": dict(head_v_dim=4, conv_kernel_size=2)},
                 yaml_parameters=28_777_992,
                 scaling=ScalingRule(scaling.gated_deltanet, scaling.head_widths, depth=6,
                                     knobs={"params": _MLP, "flops": _MLP, "state": Knob("head_v_dim", step=2)})),
    Architecture("mamba2", "ltcx.models.mamba2", "Mamba2", "configs/mamba2.yaml",
                 dict(n_embd=16, n_layer=2, n_head=4, head_dim=8, d_state=4, chunk_size=4),
                 variants={"chunk_odd": dict(chunk_size=5)},
                 yaml_parameters=28_758_760,
                 scaling=ScalingRule(scaling.mamba2, scaling.head_widths, depth=10,
                                     knobs={kind: Knob("d_state", step=2) for kind in ("params", "flops", "state")})),
]

_CATALOG: dict[str, Architecture] = {entry.name: entry for entry in _ENTRIES}
CATALOG = MappingProxyType(_CATALOG)  # read-only: add entries with add_to_catalog


def add_to_catalog(entry: Architecture) -> Architecture:
    """Add an architecture (e.g. a test's toy backbone); its class is not thereby one a checkpoint may name:
    register it with ``ltcx.models.registry.register_backbone`` for that. Returns ``entry``."""
    if entry.name in _CATALOG:
        raise ValueError(f"architecture '{entry.name}' is already in the catalogue")
    _CATALOG[entry.name] = entry
    return entry


def remove_from_catalog(name: str) -> None:
    """Undo ``add_to_catalog`` (ltcx's own entries stay)."""
    if name in {entry.name for entry in _ENTRIES}:
        raise ValueError(f"'{name}' is one of ltcx's own architectures")
    _CATALOG.pop(name, None)


def names() -> list[str]:
    return sorted(_CATALOG)


def get(name: str) -> Architecture:
    """The entry of ``name``; ``KeyError`` naming the known architectures."""
    try:
        return _CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown architecture '{name}' (known: {', '.join(names())})") from None


def build_tiny(name: str, vocab_size: int, **overrides) -> Any:
    return get(name).build_tiny(vocab_size, **overrides)


def build_configured(spec: str, vocab_size: int, min_context: int = 0) -> Any:
    """The backbone of an architecture's YAML (its ``model.backbone`` block), float32, training mode.

    ``spec`` is a catalogue name, optionally with init_args overrides after a colon
    (``titans_mag:memory_chunk_size=64,window=256``, values read as YAML); a context (``block_size``) smaller than
    ``min_context`` is raised to it, and a null one (the data's length in a fit) is ``min_context``. ``KeyError``
    naming the known architectures for an unknown name.
    """
    import yaml

    name, _, overrides = spec.partition(":")
    config = yaml.safe_load(config_path(name).read_text())["model.backbone"]
    module_name, class_name = config["class_path"].rsplit(".", 1)
    init_args = {**config.get("init_args", {}), "vocab_size": vocab_size}
    for assignment in filter(None, overrides.split(",")):
        key, _, value = assignment.partition("=")
        init_args[key] = yaml.safe_load(value)
    if "block_size" in init_args:
        init_args["block_size"] = max(init_args["block_size"] or 0, min_context)
    return getattr(importlib.import_module(module_name), class_name)(**init_args)


def config_path(name: str) -> Path:
    """The absolute path of the YAML of ``name`` (a shipped one's in ``CONFIG_DIR``)."""
    yaml_path = Path(get(name).yaml)
    if yaml_path.parts[:1] == ("configs",):
        return CONFIG_DIR.joinpath(*yaml_path.parts[1:])
    return ROOT / yaml_path


def shipped_config(name: str) -> Path | None:
    """The shipped YAML a ``--config`` value names, if it is one: ``gpt``, ``gpt.yaml``, ``trainer/smoke`` or
    ``configs/trainer/smoke.yaml`` (the checkout's path, from any directory). None for any other value."""
    relative = Path(name.removeprefix("configs/"))
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return None
    if relative.suffix not in (".yaml", ".yml"):
        relative = relative.with_name(relative.name + ".yaml")
    path = CONFIG_DIR / relative
    return path if path.is_file() else None


def shipped_config_names() -> list[str]:
    """What ``shipped_config`` takes, in its short form (``gpt``, ``trainer/smoke``, ...); the study presets
    (``configs/study/``, ``ltcx study --spec``) are not fit configs."""
    return sorted(path.relative_to(CONFIG_DIR).with_suffix("").as_posix() for path in CONFIG_DIR.rglob("*.yaml")
                  if path.parent.name != "study")


def builtin_class_paths() -> dict[str, tuple[str, str]]:
    """ltcx's own backbone classes: class path -> (module, class name), distinct (Titans serves four entries)."""
    return {entry.class_path: (entry.module, entry.class_name) for entry in _ENTRIES}


def architecture_name(class_path: str, init_args: dict | None = None) -> str | None:
    """The catalogue name of a backbone given as ``class_path`` + ``init_args`` (``ltcx.models.titans.Titans`` with
    ``variant: mal`` is ``titans_mal``): among the entries of that class, the one whose tiny values of the keys that
    tell them apart (Titans' ``variant``) match ``init_args``; None when none or several match."""
    entries = [entry for entry in _CATALOG.values() if entry.class_path == class_path]
    keys = {key for entry in entries for key in entry.tiny if len({repr(e.tiny.get(key)) for e in entries}) > 1}
    init_args = init_args or {}
    found = [entry for entry in entries if all(entry.tiny.get(key) == init_args.get(key) for key in keys)]
    return found[0].name if len(found) == 1 else None
