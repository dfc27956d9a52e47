"""Matched budgets: each architecture's shape at a given budget of parameters, training FLOPs per token or inference
state, so that a study compares models of equal size (docs/compare.md, "Matched budgets").

The three figures, each the model's own:

* ``non_embedding_parameters(model)``: every parameter once (tied ones once), less the embedding tables
  (``nn.Embedding`` weights: tokens and learned positions) and so a head tied to one; an untied head counts;
* ``flops_per_token(seq_len)``: the backbone's training FLOPs per token at the sequence length (its own formula:
  tests/test_flops.py checks it against torch's FLOP counter on every catalogue shape);
* ``state_bytes(tokens)``: the backbone's inference state after ``tokens`` tokens at batch 1 in the model's dtype
  (tests/test_budget.py checks it against the state a forward returns).

``match_shape`` walks the catalogue's scaling rule (``Architecture.scaling``, ``ltcx/models/scaling.py``). For each
depth (the caller's, or the YAML's and up to 2 either side; nearest the YAML's first, the farther ones only when the
nearer reach no candidate within the tolerance): the width on the rule's grid where the figure first reaches the
target (a bisection: the figure grows with the width) and two neighbours on each side; for each, the fine knob (the
MLP's width, or Titans' memory MLP for the state) solved to land on the target (the figures are affine in it), in
its steps and range. Of these candidates it keeps, among those within the tolerance, the one whose depth is nearest
the YAML's, then whose knob is nearest its home value (ratio), then the nearest, then the narrowest (a state that
several widths share: the narrowest of them); when none is within it, the nearest, its distance stated and
``within`` False. Models are built on the ``meta`` device (shapes, no memory) and each build is remembered; the
state needs only the config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ltcx.errors import ConfigError
from ltcx.models import catalog

__all__ = ["KINDS", "Match", "figures", "match_shape", "matched_table", "non_embedding_parameters", "shape_problem"]

KINDS = ("params", "flops", "state")
TOLERANCE = 0.02


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` less its embedding tables: each distinct parameter once (a head tied to the token
    embedding is that embedding, so it is left out with it; an untied head counts), less the weight of every
    ``nn.Embedding`` (tokens, learned positions). Works on the meta device."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


@dataclass(frozen=True)
class Match:
    """One architecture's shape at a budget: ``init_args`` (with ``vocab_size``) and its three figures;
    ``distance`` = figure / target - 1 for the matched kind; ``within``: |distance| <= ``tolerance``."""

    name: str
    kind: str
    target: float
    init_args: dict[str, Any]
    parameters: int
    flops_per_token: float
    state_bytes: int
    distance: float
    tolerance: float
    seq_len: int
    tokens: int
    dtype: str

    @property
    def within(self) -> bool:
        return abs(self.distance) <= self.tolerance

    @property
    def depth(self) -> int:
        return self.init_args.get("n_layer")

    @property
    def width(self) -> int:
        return self.init_args.get("n_embd")

    def figure(self, kind: str | None = None) -> float:
        kind = kind or self.kind
        return {"params": self.parameters, "flops": self.flops_per_token, "state": self.state_bytes}[kind]


_built: dict[str, tuple[int, float]] = {}


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def _config_only(name: str, init_args: dict[str, Any]) -> nn.Module:
    """The backbone object without its modules: ``state_bytes`` reads the config alone (its docstrings say so),
    so the state of a shape costs no build."""
    cls = catalog.get(name).backbone_class()
    model = cls.__new__(cls)
    object.__setattr__(model, "config", cls.config_class(**init_args))
    return model


def shape_problem(name: str, init_args: dict[str, Any]) -> str | None:
    """Why ``name``'s config refuses ``init_args`` (its first line), or None when it builds."""
    try:
        _config_only(name, init_args)
    except (ValueError, TypeError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


def figures(name: str, init_args: dict[str, Any], seq_len: int, tokens: int,
            dtype: torch.dtype = torch.float32) -> tuple[int, float, int]:
    """(non-embedding parameters, training FLOPs per token at ``seq_len``, state bytes after ``tokens``) of
    ``name`` built with ``init_args`` on the meta device; remembered per shape."""
    key = _key(name, init_args, seq_len)
    if key not in _built:
        with torch.device("meta"):
            model = catalog.get(name).backbone_class()(**init_args)
        _built[key] = (non_embedding_parameters(model), float(model.flops_per_token(seq_len)))
    return (*_built[key], _state_bytes(name, init_args, tokens, dtype))


def _state_bytes(name: str, init_args: dict[str, Any], tokens: int, dtype: torch.dtype) -> int:
    return int(_config_only(name, init_args).state_bytes(tokens, dtype))


def _figure(kind: str, name: str, init_args: dict[str, Any], seq_len: int, tokens: int, dtype: torch.dtype) -> float:
    if kind == "state":
        return _state_bytes(name, init_args, tokens, dtype)
    parameters, flops, _ = figures(name, init_args, seq_len, tokens, dtype)
    return parameters if kind == "params" else flops


def _depths(n_layers: int | Sequence[int] | Callable[[int], int] | None, home: int) -> list[list]:
    """The depths to search, in rings of equal distance (ratio) from the YAML's ``home`` depth, nearest first;
    None: ``home`` and up to 2 either side."""
    if callable(n_layers):
        return [[n_layers]]
    if n_layers is None:
        depths = list(range(max(1, home - 2), home + 3))
    else:
        depths = [n_layers] if isinstance(n_layers, int) else list(n_layers)
    if not depths or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in depths):
        raise ConfigError(f"n_layers ({n_layers!r}) must be positive integers, e.g. [4, 6, 8]")
    rings: dict[float, list[int]] = {}
    for depth in sorted(set(depths)):
        rings.setdefault(round(abs(math.log(depth / home)), 12), []).append(depth)
    return [rings[distance] for distance in sorted(rings)]


def match_shape(name: str, kind: str, target: float, seq_len: int, vocab_size: int,
                n_layers: int | Sequence[int] | Callable[[int], int] | None = None, tokens: int | None = None,
                tolerance: float = TOLERANCE, dtype: torch.dtype = torch.float32, max_width: int = 8192,
                where: str = "", **options: Any) -> Match:
    """The shape of ``name`` whose ``kind`` figure (``params``: non-embedding parameters, ``flops``: training FLOPs
    per token at ``seq_len``, ``state``: inference-state bytes after ``tokens`` tokens, default ``seq_len``, at
    batch 1 in ``dtype``) is nearest ``target`` by the rule of the module docstring, at the depths ``n_layers``
    (an int, a list, a function of the width, or None: the YAML's and up to 2 either side); ``options`` go to the
    scaling rule (e.g. ``head_dim``: the widths searched are then its multiples). Only widths whose config builds
    are searched; none is one line (``where`` starts it). Never silently off: ``distance`` and ``within`` say how
    near it came."""
    entry = catalog.get(name)
    rule = entry.scaling
    if rule is None:
        raise ConfigError(f"architecture '{name}' has no scaling rule: give its catalogue entry one "
                          "(Architecture.scaling, ltcx/models/scaling.py)")
    if kind not in KINDS:
        raise ConfigError(f"budget kind '{kind}' is not one of {', '.join(KINDS)}")
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise ConfigError(f"budget target ({target!r}) must be a positive number")
    tokens = seq_len if tokens is None else tokens
    widths = rule.widths(max_width)
    knob = rule.knobs.get(kind)

    def shape(width: int, depth) -> tuple[int, dict[str, Any]]:
        layers = depth(width) if callable(depth) else depth
        return layers, {**entry.scaled(width, layers, seq_len, **options), "vocab_size": vocab_size}

    def figure(args: dict[str, Any]) -> float:
        return _figure(kind, name, args, seq_len, tokens, dtype)

    def rank(candidate):
        layers, departure, width, args = candidate
        distance = abs(figure(args) / target - 1)
        if distance <= tolerance:
            return (0, abs(math.log(layers / rule.depth)), departure, distance, width)
        return (1, distance, 0.0, 0.0, width)

    head_dim = options.get("head_dim")

    def builds(width: int, depth) -> bool:
        return (head_dim is None or width % head_dim == 0) and shape_problem(name, shape(width, depth)[1]) is None

    candidates = []  # (depth, knob departure, width, init_args)
    for ring in _depths(n_layers, rule.depth):  # nearest the YAML's depth first: stop at the first that reaches
        for depth in ring:
            valid = [w for w in widths if builds(w, depth)]
            if valid:
                candidates += _candidates(depth, valid, shape, figure, knob, target)
        if not candidates:
            continue
        if min(rank(c)[0] for c in candidates) == 0:
            break

    if not candidates:
        lead = f"{where}: " if where else ""
        given = ", ".join(f"{k} {v}" for k, v in options.items())
        raise ConfigError(f"{lead}{name} builds at no width up to {max_width}" + (f" with {given}" if given else "")
                          + f" ({shape_problem(name, shape(widths[-1], rule.depth)[1]) or 'no width divides'}): "
                          + ("give a head_dim that divides its widths, e.g. 32 or 64" if head_dim else "fix its rule"))
    *_, best = min(candidates, key=rank)
    parameters, flops, state = figures(name, best, seq_len, tokens, dtype)
    chosen = {"params": parameters, "flops": flops, "state": state}[kind]
    return Match(name, kind, float(target), best, parameters, flops, state, chosen / target - 1, tolerance,
                 seq_len, tokens, str(dtype).removeprefix("torch."))


def _candidates(depth, widths: list[int], shape, figure, knob,
                target: float) -> list[tuple[int, float, int, dict]]:
    """At one depth: the first width of the grid whose figure reaches ``target`` (a bisection; the last when none
    does) and two neighbours on each side, each with the knob solved for ``target`` (depth, knob departure, width,
    init_args)."""
    low, high = 0, len(widths) - 1
    while low < high:
        middle = (low + high) // 2
        if figure(shape(widths[middle], depth)[1]) >= target:
            high = middle
        else:
            low = middle + 1
    found = []
    for width in widths[max(0, low - 2):low + 3]:
        layers, args = shape(width, depth)
        if knob is not None:
            home, step = args[knob.field], knob.step
            other = {**args, knob.field: home + max(step, home // 4 // step * step)}
            slope = (figure(other) - figure(args)) / (other[knob.field] - home)
            if slope > 0:  # the figure is affine in the knob: solve, round to its steps, keep it in its range
                smallest, largest = max(step, _round(knob.low * home, step)), _round(knob.high * home, step)
                value = min(largest, max(smallest, _round(home + (target - figure(args)) / slope, step)))
                args = {**args, knob.field: value}
                found.append((layers, abs(math.log(value / home)), width, args))
                continue
        found.append((layers, 0.0, width, args))
    return found


def _round(value: float, step: int) -> int:
    return int(step * round(value / step))


def _si(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}".rstrip()
    return f"{value:.0f} {unit}".rstrip()


def matched_table(matches: Iterable[Match]) -> str:
    """The matched shapes side by side as Markdown: architecture, width x depth, the three figures, the distance to
    the target (marked when outside the tolerance)."""
    rows = ["| architecture | width x depth | parameters | FLOPs / token | state | distance |",
            "|---|---:|---:|---:|---:|---:|"]
    for m in matches:
        mark = "" if m.within else f" (outside {m.tolerance:.0%})"
        rows.append(f"| {m.name} | {m.width} x {m.depth} | {m.parameters:,} | {_si(m.flops_per_token)} | "
                    f"{_si(m.state_bytes, 'B')} | {m.distance:+.2%}{mark} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m ltcx.study.budget 30e6``: every architecture matched to the reference architecture's parameters,
    FLOPs per token and state at that many non-embedding parameters, one table per budget."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ltcx.study.budget", description=main.__doc__)
    parser.add_argument("parameters", type=float, help="the reference's non-embedding parameters, e.g. 30e6")
    parser.add_argument("--reference", default="gpt", help="the architecture whose figures are the targets")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--vocab_size", type=int, default=50304)
    args = parser.parse_args(argv)
    reference = match_shape(args.reference, "params", args.parameters, args.seq_len, args.vocab_size)
    for kind in KINDS:
        target = reference.figure(kind)
        print(f"\n{kind}: {target:,.0f} ({args.reference} at {reference.parameters:,} parameters, "
              f"{args.seq_len} tokens)\n")
        print(matched_table(match_shape(name, kind, target, args.seq_len, args.vocab_size) for name in catalog.names()))


if __name__ == "__main__":
    main()
