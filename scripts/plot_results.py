"""Draw a comparison written by scripts/compare.py: who wins at a glance.

    python scripts/plot_results.py results/quick

Writes into that folder: val_loss_curves.png (validation loss against training tokens, mean over seeds
with a band of +- one sd), final_val_loss.png (final loss per model as a point, error bars = sd over seeds,
none for one seed, the paired difference to the baseline in the labels) and throughput.png (training tokens/s and
the cached decode step per model from the comparison's timing pass, marked when the machine was loaded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def curves_by_model(runs: list[dict]) -> dict[str, tuple[list[float], list[float], list[float] | None]]:
    """model -> (tokens, mean loss, sd of loss, None for one seed) over the seeds at the tokens every seed
    reached."""
    grouped: dict[str, list[dict[float, float]]] = {}
    for run in runs:
        grouped.setdefault(run["model"], []).append({tokens: loss for tokens, loss in run["curve"]})
    curves = {}
    for model, seeds in grouped.items():
        shared = sorted(set.intersection(*(set(curve) for curve in seeds)))
        means = [statistics.fmean(curve[t] for curve in seeds) for t in shared]
        sds = [statistics.stdev(curve[t] for curve in seeds) for t in shared] if len(seeds) > 1 else None
        curves[model] = (shared, means, sds)
    return curves


def seeds_label(n: int) -> str:
    return "1 seed" if n == 1 else f"{n} seeds"


def curves_figure(summary: dict, colours: dict) -> plt.Figure:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for model, (tokens, means, sds) in sorted(curves_by_model(summary["runs"]).items()):
        n = len(summary["models"][model]["seeds"])
        axes.plot(tokens, means, label=f"{model} ({seeds_label(n)})", color=colours[model])
        if sds is not None:  # one seed has no spread to draw, not a spread of zero
            axes.fill_between(tokens, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                              color=colours[model], alpha=0.2)
    axes.set(xlabel="training tokens", ylabel="validation loss", title="Validation loss (mean +- sd over seeds)")
    axes.legend()
    axes.grid(alpha=0.3)
    return figure


def final_loss_figure(summary: dict, order: list[str], colours: dict) -> plt.Figure:
    """The final loss of each model as a point with an error bar of +- one sd over its seeds (none for one seed).

    Points, not bars: a bar's length must be read from zero, and bars from zero would make gaps of a few hundredths
    of a nat on losses of 7-9 invisible; a cropped bar chart (the old y axis started at 8.59) makes a 0.08 gap look
    huge. A point is read by its position on the labelled axis, so the axis may fit the data, and the error bars
    and the dashed baseline line give the scale that matters: how big a gap is next to the seed-to-seed spread.
    """
    models = summary["models"]
    figure, axes = plt.subplots(figsize=(max(7.0, 1.2 * len(order)), 4.5))  # room for every label
    for x, model in enumerate(order):
        entry = models[model]
        sd = entry["val_loss_sd"] if len(entry["seeds"]) > 1 else None
        axes.errorbar([x], [entry["val_loss_mean"]], yerr=None if sd is None else [sd], fmt="o", capsize=4,
                      color=colours[model], label=model)
    labels = []
    for model in order:
        diff = models[model].get("diff_vs_baseline_mean")
        labels.append("\n".join([model, *([f"{diff:+.3f}"] if diff is not None else []),
                                 seeds_label(len(models[model]["seeds"]))]))
    axes.set_xticks(range(len(order)), labels)
    axes.set_xlim(-0.5, len(order) - 0.5)
    baseline = summary.get("baseline")
    if baseline in models:
        axes.axhline(models[baseline]["val_loss_mean"], color="grey", linestyle="--", linewidth=1)
    axes.set(ylabel="final validation loss",
             title=f"Final validation loss, {summary['tokens']:,} tokens\nmean +- sd over seeds"
             + (f"; dashed: {baseline}, paired gap to it under each name" if baseline in models else ""))
    axes.grid(axis="y", alpha=0.3)
    return figure


def throughput_figure(summary: dict, order: list[str], colours: dict) -> plt.Figure:
    """Training tokens/s and the cached decode step per model, from the comparison's timing pass, with a note in
    red when that pass found the machine loaded, when it was skipped, or when the summary predates it."""
    models = summary["models"]
    timing = summary.get("timing")
    figure, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 1.6 * len(order)), 4))
    for axes, key, title in ((left, "tokens_per_sec", "training tokens/s"), (right, "decode_ms_per_token",
                                                                            "cached decode step, ms/token (batch 1)")):
        values = [models[m][key] or 0.0 for m in order]
        axes.bar(order, values, color=[colours[m] for m in order])
        axes.set(title=title)
        axes.tick_params(axis="x", rotation=30)
        axes.grid(axis="y", alpha=0.3)
    if "timing" not in summary:
        note = "UNRELIABLE: each run timed itself at a different hour (a summary from before the timing pass)"
    elif timing is None:
        note = "not timed (compare.py --timing_rounds 0)"
    elif timing["speed_unreliable"]:
        note = (f"UNRELIABLE: load average {timing['load_average_max']:.1f} exceeded the "
                f"{timing['usable_cores']} usable cores while timing")
    else:
        note = None
    bottom = 0.0
    if note is not None:
        figure.text(0.5, 0.01, note, ha="center", va="bottom", color="red", fontweight="bold")
        bottom = 0.07
    figure.tight_layout(rect=(0, bottom, 1, 1))
    return figure


def plot(folder: Path) -> list[Path]:
    summary_file = folder / "summary.json"
    if not summary_file.is_file():
        print(f"plot_results: error: no {summary_file}: run scripts/compare.py --name {folder.name} first",
              file=sys.stderr)
        sys.exit(2)
    summary = json.loads(summary_file.read_text())
    models = summary["models"]
    order = sorted(models, key=lambda m: models[m]["val_loss_mean"])
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(sorted(models))}
    written = []
    for name, figure in (("val_loss_curves.png", curves_figure(summary, colours)),
                         ("final_val_loss.png", final_loss_figure(summary, order, colours)),
                         ("throughput.png", throughput_figure(summary, order, colours))):
        written.append(folder / name)
        if name != "throughput.png":  # that one leaves room for its note itself
            figure.tight_layout()
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="results/<name> written by scripts/compare.py")
    for path in plot(parser.parse_args().folder):
        print(f"plot_results: wrote {path}")


if __name__ == "__main__":
    main()
