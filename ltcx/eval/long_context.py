"""Recall past the training length: needle in a haystack over lengths x depths, and MQAR over lengths (pairs kept,
and pairs scaled with the length), scored by a trained backbone fed through its state in pieces
(``scoring.target_log_probs``: memory bounded by the piece, plus whatever state the architecture carries).

A cell's accuracy is exact match: a needle sequence counts when every digit of its passkey is the argmax (greedy
decoding would write it), an MQAR query when its value is (as ``val/recall_acc``). Each cell also reports the mean
log-probability of its answer tokens (nats), which moves before accuracy does. The sequences of one length are the
same at every depth (the batch's seed is ``(seed, split, length, batch)``), so depths are compared on paired data.
A backbone with a context limit (``max_seq_len``) is scored up to it; the longer lengths are left out, named in one
line (``ScoreGrid.note``, printed to stderr).

``ltcx evaluate --task long_context`` (``ltcx/cli/evaluate_long_context.py``) reads a checkpoint's task from its data
settings (``trained_task``), checks it at every length and depth (``check_task``), scores it (``evaluate_task``: a
JSON-ready dict) and draws accuracy against length (``plot_accuracy_by_length``) and the needle's heatmaps
(``plot_needle_heatmaps``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ltcx.batches import IGNORE_INDEX
from ltcx.data.mqar import SPLITS, TEST, mqar_batch
from ltcx.data.niah import check_niah, needle_position, needle_task, niah_batch
from ltcx.errors import ConfigError
from ltcx.eval.scoring import target_log_probs

__all__ = ["DEPTHS", "FACTORS", "TASKS", "ScoreGrid", "check_lengths_fit", "check_task", "evaluate_mqar",
           "evaluate_niah", "evaluate_task", "lengths_within_context", "plot_accuracy_by_length",
           "largest_fitting", "plot_needle_heatmaps", "scoring_bytes", "trained_task"]

FACTORS = (1, 2, 4, 8)  # lengths L, 2L, 4L, 8L
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Bytes per token of one sequence as it is made and scored, besides the model's state: its ids and targets (int64,
# made in numpy and copied to torch), the float64 draws that lay MQAR out, its log-probabilities and argmax hits.
DATA_BYTES_PER_TOKEN = 64


@dataclass
class ScoreGrid:
    """Scores per cell: ``(length, depth)`` for the needle, ``(length, num_kv_pairs)`` for MQAR."""

    accuracy: dict[tuple, float] = field(default_factory=dict)  # exact-match accuracy in [0, 1]
    log_prob: dict[tuple, float] = field(default_factory=dict)  # mean log p of the answer tokens (nats)
    count: dict[tuple, int] = field(default_factory=dict)  # answers scored (sequences, or MQAR queries)
    note: str | None = None  # the context-limit line, when lengths were left out


def lengths_within_context(backbone: nn.Module, lengths: Sequence[int]) -> tuple[list[int], str | None]:
    """The lengths a backbone can read whole, and the one line naming where it stops (None: all of them)."""
    limit = backbone.max_seq_len
    kept = [n for n in lengths if limit is None or n <= limit]
    if len(kept) == len(lengths):
        return kept, None
    left = ", ".join(str(n) for n in lengths if n not in kept)
    return kept, (f"ltcx: {type(backbone).__name__} stops at its context limit of {limit} tokens (max_seq_len, "
                  f"learned positions): lengths {left} not evaluated")


def scoring_bytes(backbone: nn.Module, length: int, batch_size: int, piece_len: int | None) -> int:
    """The least memory scoring a batch of ``batch_size`` sequences of ``length`` tokens takes: each sequence's data
    (``DATA_BYTES_PER_TOKEN`` a token), its state after ``length`` tokens (the backbone's ``state_bytes``: a KV cache
    grows with the length) and one piece's logits [B, piece_len, V] in float32 with their log-softmax."""
    state = backbone.state_bytes(length) if hasattr(backbone, "state_bytes") else 0
    head = backbone.output_head() if hasattr(backbone, "output_head") else None
    vocab = head.out_features if isinstance(head, nn.Linear) else 0
    piece = min(piece_len or length, length)
    return batch_size * (DATA_BYTES_PER_TOKEN * length + int(state) + 2 * 4 * piece * vocab)


def largest_fitting(need: Callable[[int], int], limit: int, high: int) -> int:
    """The largest ``n`` in ``0..high`` whose ``need(n)`` (growing with ``n``) is at most ``limit``: a bisection."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if need(middle) <= limit else (low, middle - 1)
    return low


def check_lengths_fit(backbone: nn.Module, train_length: int, factors: Sequence[int], batch_size: int,
                      piece_len: int | None, limit: int | None, source: str) -> None:
    """One ``ConfigError`` line naming ``--factors`` and the largest factor that fits, before any sequence is made,
    when scoring ``source``'s model at the longest length it reads (``factor x train_length``, up to its context
    limit) takes more than ``limit`` bytes (None: the system does not tell; nothing is refused)."""
    lengths, _ = lengths_within_context(backbone, [f * train_length for f in factors])
    if limit is None or not lengths:
        return
    longest = max(lengths)
    need = scoring_bytes(backbone, longest, batch_size, piece_len)
    if need <= limit:
        return
    most = largest_fitting(lambda f: scoring_bytes(backbone, f * train_length, batch_size, piece_len), limit,
                           longest // train_length - 1)
    fix = f"use --factors up to {most}" if most else "lower --batch_size (and --piece_len)"
    raise ConfigError(
        f"--factors {longest // train_length}: scoring {source} on {batch_size} sequences of {longest:,} tokens "
        f"({longest // train_length} x its training length {train_length}) takes about {need / 2**30:,.1f} GiB, more "
        f"than the {limit / 2**30:,.1f} GiB of memory here: {fix}"
    )


def _device(backbone: nn.Module) -> torch.device:
    parameter = next(backbone.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _score_batch(
    backbone: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, per_sequence: bool, piece_len: int | None,
    vocab_limit: int | None,
) -> tuple[int, int, float, int]:
    """-> (answers exactly right, answers, summed log p of the answer tokens, answer tokens)."""
    device = _device(backbone)
    inputs, targets = inputs.to(device), targets.to(device)
    asked = targets != IGNORE_INDEX
    log_p, right = target_log_probs(backbone, inputs, targets.clamp(min=0), piece_len, vocab_limit)
    if per_sequence:  # a sequence is right when all its answer tokens are
        correct = int((right | ~asked).all(dim=1).sum())
        answers = inputs.shape[0]
    else:
        correct, answers = int((right & asked).sum()), int(asked.sum())
    return correct, answers, float(log_p[asked].double().sum()), int(asked.sum())


def _add(grid: ScoreGrid, cell: tuple, scores: Iterable[tuple[int, int, float, int]]) -> None:
    correct = answers = tokens = 0
    total = 0.0
    for c, a, s, t in scores:
        correct, answers, total, tokens = correct + c, answers + a, total + s, tokens + t
    grid.accuracy[cell], grid.count[cell] = correct / max(answers, 1), answers
    grid.log_prob[cell] = total / max(tokens, 1)


def _say(grid: ScoreGrid, report: Callable[[str], None] | None) -> ScoreGrid:
    if grid.note is not None:
        (report or (lambda line: print(line, file=sys.stderr)))(grid.note)
    return grid


def _batch_sizes(num_sequences: int, batch_size: int) -> list[int]:
    if num_sequences < 1 or batch_size < 1:
        raise ConfigError(f"num_sequences={num_sequences} and batch_size={batch_size} must be >= 1")
    return [min(batch_size, num_sequences - start) for start in range(0, num_sequences, batch_size)]


@torch.no_grad()
def evaluate_niah(
    backbone: nn.Module, train_length: int, *, factors: Sequence[int] = FACTORS, depths: Sequence[float] = DEPTHS,
    num_sequences: int = 32, batch_size: int = 8, tokenizer: str = "bytes", haystack: str = "sample",
    num_digits: int = 5, seed: int = 1234, split: int | str = TEST, piece_len: int | None = None,
    report: Callable[[str], None] | None = None, **text: str,
) -> ScoreGrid:
    """Needle accuracy per ``(length, depth)``, lengths ``factor * train_length``: ``num_sequences`` per cell from
    the ``split``'s haystack (``text``: ``needle``/``question`` as the training data's). ``piece_len`` None:
    ``train_length``. Call it on a backbone in eval mode."""
    split = SPLITS[split] if isinstance(split, str) else split
    task = needle_task(tokenizer, haystack, split, **text)
    lengths, note = lengths_within_context(backbone, [f * train_length for f in factors])
    for length in lengths:  # a length the haystack can not fill, a bad depth: one line before any scoring
        check_niah(task, length, num_digits)
    for depth in depths:
        needle_position(task, train_length, num_digits, depth)
    grid, sizes = ScoreGrid(note=note), _batch_sizes(num_sequences, batch_size)
    for length in lengths:
        for depth in depths:
            _add(grid, (length, depth), (
                _score_batch(backbone, *niah_batch(np.random.default_rng([seed, split, length, b]), task, size,
                                                   length, num_digits, depth),
                             True, piece_len or train_length, task.vocab_size)
                for b, size in enumerate(sizes)))
    return _say(grid, report)


@torch.no_grad()
def evaluate_mqar(
    backbone: nn.Module, train_length: int, num_kv_pairs: int, vocab_size: int, *, factors: Sequence[int] = FACTORS,
    scale_pairs: bool = False, num_sequences: int = 64, batch_size: int = 16, power_a: float = 0.01,
    random_fillers: bool = True, seed: int = 1234, split: int | str = TEST, piece_len: int | None = None,
    report: Callable[[str], None] | None = None,
) -> ScoreGrid:
    """MQAR accuracy per ``(length, pairs)``, lengths ``factor * train_length``, with ``num_kv_pairs`` pairs at
    every length, or ``factor * num_kv_pairs`` (``scale_pairs``: the same density of pairs as in training)."""
    split = SPLITS[split] if isinstance(split, str) else split
    lengths, note = lengths_within_context(backbone, [f * train_length for f in factors])
    cells = [(f * train_length, f * num_kv_pairs if scale_pairs else num_kv_pairs) for f in factors]
    cells = [cell for cell in cells if cell[0] in lengths]
    grid, sizes = ScoreGrid(note=note), _batch_sizes(num_sequences, batch_size)
    for length, pairs in cells:
        try:
            mqar_batch(np.random.default_rng(0), 1, length, pairs, vocab_size, power_a)  # lays the task out or says why
        except ConfigError as exc:
            raise ConfigError(f"MQAR at length {length} with {pairs} pairs: {exc}") from None
    for length, pairs in cells:
        _add(grid, (length, pairs), (
            _score_batch(backbone, *mqar_batch(np.random.default_rng([seed, split, length, b]), size, length, pairs,
                                               vocab_size, power_a, random_fillers),
                         False, piece_len or train_length, vocab_size)
            for b, size in enumerate(sizes)))
    return _say(grid, report)


# -- a checkpoint's task, its results as JSON, the figures (``ltcx evaluate --task long_context``) ----------------

TASKS = ("needle", "mqar")


def trained_task(data: dict | None, source: str) -> tuple[str, dict]:
    """The long-context task a checkpoint learned, from its data module's settings (Lightning's
    ``datamodule_hyper_parameters``): ``("needle", settings)`` for ``NeedleDataModule``, ``("mqar", settings)`` for
    ``RecallDataModule``; one line for any other data (a model is scored on the task it was trained on)."""
    if isinstance(data, dict) and {"num_digits", "haystack", "block_size"} <= data.keys():
        keys = ("tokenizer", "num_digits", "haystack", "needle", "question")
        return "needle", {k: data[k] for k in keys if k in data} | {"block_size": int(data["block_size"])}
    if isinstance(data, dict) and {"num_kv_pairs", "vocab_size", "block_size"} <= data.keys():
        keys = ("vocab_size", "num_kv_pairs", "power_a", "random_fillers")
        return "mqar", {k: data[k] for k in keys if k in data} | {"block_size": int(data["block_size"])}
    raise ConfigError(f"{source} was not trained on the needle or on MQAR (configs/data/niah.yaml, "
                      "configs/data/mqar.yaml): --task long_context scores a model on the one it learned")


def check_task(task: str, data: dict, factors: Sequence[int], depths: Sequence[float]) -> None:
    """One line, before any model runs, for a length or depth the task can not be laid out at."""
    length = data["block_size"]
    if task == "needle":
        needle = needle_task(data.get("tokenizer", "bytes"), data.get("haystack", "sample"), TEST,
                             **{k: data[k] for k in ("needle", "question") if k in data})
        digits = data.get("num_digits", 5)
        for factor in factors:
            n = needle.haystack_length(factor * length, digits)
            if not needle.repeat and n > needle.haystack.size:  # evaluate's own flag, not the training data's
                most = (needle.haystack.size + needle.fixed_length(digits) - 1) // length
                raise ConfigError(
                    f"--factors {factor}: a needle sequence of {factor * length:,} tokens needs {n:,} haystack tokens "
                    f"and the shipped sample the model was trained on has {needle.haystack.size:,}: use --factors up "
                    f"to {most}"
                )
            check_niah(needle, factor * length, digits)
        for depth in depths:
            needle_position(needle, length, data.get("num_digits", 5), depth)
        return
    for factor in factors:
        for pairs in (data["num_kv_pairs"], factor * data["num_kv_pairs"]):
            try:
                mqar_batch(np.random.default_rng(0), 1, factor * length, pairs, data["vocab_size"],
                           data.get("power_a", 0.01))
            except ConfigError as exc:
                raise ConfigError(f"MQAR at length {factor * length} with {pairs} pairs: {exc}") from None


def _table(grid: ScoreGrid, cells: Sequence[tuple]) -> dict[str, list]:
    kept = [cell for cell in cells if cell in grid.accuracy]
    return {"accuracy": [grid.accuracy[c] for c in kept], "log_prob": [grid.log_prob[c] for c in kept],
            "count": [grid.count[c] for c in kept]}


def evaluate_task(
    backbone: nn.Module, task: str, data: dict, *, factors: Sequence[int] = FACTORS,
    depths: Sequence[float] = DEPTHS, num_sequences: int = 32, batch_size: int = 8, piece_len: int | None = None,
    seed: int = 1234, report: Callable[[str], None] | None = None,
) -> dict:
    """Score ``backbone`` on its ``task`` (``trained_task``) at ``factor x`` its training length: the needle over
    lengths x depths, MQAR with the pairs kept and scaled. A JSON-ready dict: ``lengths`` scored, ``accuracy`` by
    length (the needle's averaged over depths), the cells, and ``note`` (the context-limit line or None)."""
    length = data["block_size"]
    common = dict(factors=factors, num_sequences=num_sequences, batch_size=batch_size, piece_len=piece_len, seed=seed,
                  report=report)
    if task == "needle":
        text = {k: data[k] for k in ("needle", "question") if k in data}
        grid = evaluate_niah(backbone, length, depths=depths, tokenizer=data.get("tokenizer", "bytes"),
                             haystack=data.get("haystack", "sample"), num_digits=data.get("num_digits", 5),
                             **common, **text)
        lengths = sorted({n for n, _ in grid.accuracy})
        heatmap = [[grid.accuracy[(n, d)] for n in lengths] for d in depths]  # [depth][length]
        return {"task": task, "train_length": length, "factors": list(factors), "lengths": lengths, "note": grid.note,
                "accuracy": [float(np.mean([grid.accuracy[(n, d)] for d in depths])) for n in lengths],
                "depths": list(depths), "heatmap": heatmap,
                "log_prob": [[grid.log_prob[(n, d)] for n in lengths] for d in depths],
                "count": grid.count[(lengths[0], depths[0])] if lengths else 0}
    result: dict[str, Any] = {"task": task, "train_length": length, "factors": list(factors)}
    for name, scale in (("kept", False), ("scaled", True)):
        grid = evaluate_mqar(backbone, length, data["num_kv_pairs"], data["vocab_size"], scale_pairs=scale,
                             power_a=data.get("power_a", 0.01), random_fillers=data.get("random_fillers", True),
                             **{**common, "report": report if name == "kept" else (lambda _: None)})
        cells = sorted(grid.accuracy)
        result[name] = {"lengths": [n for n, _ in cells], "pairs": [p for _, p in cells], **_table(grid, cells)}
        result["note"] = grid.note
    result["lengths"], result["accuracy"] = result["kept"]["lengths"], result["kept"]["accuracy"]
    return result


def _colours(results: Sequence[dict]) -> dict[str, Any]:
    """One colour per label, the same in every panel (a model's needle and MQAR runs share its label)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r["label"] for r in results))
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: palette(i % palette.N) for i, label in enumerate(labels)}


def plot_accuracy_by_length(results: Sequence[dict], path: str) -> None:
    """A PNG of exact-match accuracy against length (log2 axis): the needle (mean over depths) and MQAR (solid:
    pairs kept; dashed: pairs scaled with the length), one colour per result label (one legend for both panels);
    dotted: the training length; a line that ends early ends at its model's context limit."""
    plt = _pyplot()
    colours = _colours(results)
    figure, panels = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True, layout="constrained")
    titles = {"needle": "needle in a haystack (mean over depths)", "mqar": "MQAR (solid: pairs kept; dashed: scaled)"}
    for axes, task in zip(panels, TASKS):
        shown = [r for r in results if r["task"] == task]
        for result in shown:
            colour = colours[result["label"]]
            axes.plot(result["lengths"], result["accuracy"], marker="o", color=colour, label=result["label"])
            if task == "mqar":
                axes.plot(result["scaled"]["lengths"], result["scaled"]["accuracy"], marker="x", linestyle="--",
                          color=colour)
        for length in sorted({r["train_length"] for r in shown}):
            axes.axvline(length, color="grey", linestyle=":", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("sequence length (tokens; dotted: training length)")
        axes.set_title(titles[task] if shown else f"{titles[task]}: no model")
        axes.set_ylim(-0.03, 1.03)
        axes.grid(alpha=0.3)
    panels[0].set_ylabel("exact-match accuracy")
    handles = {h.get_label(): h for axes in panels for h in axes.get_lines() if not h.get_label().startswith("_")}
    if handles:
        figure.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small")
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)


def plot_needle_heatmaps(results: Sequence[dict], path: str) -> None:
    """A PNG of one heatmap per needle result: accuracy per (depth, length); a length past the model's context limit
    is left grey and marked."""
    plt = _pyplot()
    shown = [r for r in results if r["task"] == "needle"]
    columns = min(3, max(1, len(shown)))
    rows = max(1, -(-len(shown) // columns))
    figure, panels = plt.subplots(rows, columns, figsize=(4.4 * columns + 1, 3.3 * rows), squeeze=False,
                                  layout="constrained")
    lengths = sorted({n for r in shown for n in r["lengths"]} | {r["train_length"] * f for r in shown
                                                                  for f in r.get("factors", ())})
    image = None
    for axes, result in zip(panels.flat, shown):
        grid = np.full((len(result["depths"]), len(lengths)), np.nan)
        for j, n in enumerate(lengths):
            if n in result["lengths"]:
                grid[:, j] = [row[result["lengths"].index(n)] for row in result["heatmap"]]
        axes.set_facecolor("0.85")
        image = axes.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                text = "limit" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}"
                axes.text(j, i, text, ha="center", va="center", fontsize=7,
                          color="black" if np.isnan(grid[i, j]) or grid[i, j] > 0.5 else "white")
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        axes.set_yticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]])
        axes.set_xlabel(f"length (trained at {result['train_length']})")
        axes.set_ylabel("needle depth")
        axes.set_title(result["label"], fontsize="small")
    for axes in list(panels.flat)[len(shown):]:
        axes.axis("off")
        if not shown:
            axes.text(0.5, 0.5, "no needle model", ha="center", va="center")
    if image is not None:
        figure.colorbar(image, ax=panels, shrink=0.8, label="exact-match accuracy")
    figure.savefig(path, dpi=110, format="png")
    plt.close(figure)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    return plt
