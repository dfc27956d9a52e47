"""Draw a comparison written by scripts/compare.py: who wins at a glance.

    python scripts/plot_results.py results/quick

Writes into that folder: val_loss_curves.png (validation loss against training tokens, mean over seeds
with a band of +- one sd), final_val_loss.png (final loss per model, error bars = sd over seeds, the
paired difference to the baseline in the labels) and throughput.png (training tokens/s and the cached
decode step per model).
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


def curves_by_model(runs: list[dict]) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """model -> (tokens, mean loss, sd of loss) over the seeds at the tokens every seed reached."""
    grouped: dict[str, list[dict[float, float]]] = {}
    for run in runs:
        grouped.setdefault(run["model"], []).append({tokens: loss for tokens, loss in run["curve"]})
    curves = {}
    for model, seeds in grouped.items():
        shared = sorted(set.intersection(*(set(curve) for curve in seeds)))
        means = [statistics.fmean(curve[t] for curve in seeds) for t in shared]
        sds = [statistics.stdev(curve[t] for curve in seeds) if len(seeds) > 1 else 0.0 for t in shared]
        curves[model] = (shared, means, sds)
    return curves


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

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for model, (tokens, means, sds) in sorted(curves_by_model(summary["runs"]).items()):
        axes.plot(tokens, means, label=model, color=colours[model])
        axes.fill_between(tokens, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                          color=colours[model], alpha=0.2)
    axes.set(xlabel="training tokens", ylabel="validation loss", title="Validation loss (mean +- sd over seeds)")
    axes.legend()
    axes.grid(alpha=0.3)
    written.append(folder / "val_loss_curves.png")
    figure.tight_layout()
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(max(7.0, 1.2 * len(order)), 4.5))  # room for every label
    means = [models[m]["val_loss_mean"] for m in order]
    errors = [models[m]["val_loss_sd"] or 0.0 for m in order]
    labels = [m if "diff_vs_baseline_mean" not in models[m] else f"{m}\n{models[m]['diff_vs_baseline_mean']:+.3f}"
              for m in order]
    axes.bar(labels, means, yerr=errors, capsize=4, color=[colours[m] for m in order])
    low = min(m - e for m, e in zip(means, errors))
    high = max(m + e for m, e in zip(means, errors))
    axes.set_ylim(low - 0.5 * (high - low + 1e-3), high + 0.2 * (high - low + 1e-3))
    baseline = summary.get("baseline")
    axes.set(ylabel="final validation loss",
             title=f"Final validation loss, {summary['tokens']:,} tokens"
             + (f" (paired gap to {baseline})" if baseline else ""))
    axes.grid(axis="y", alpha=0.3)
    written.append(folder / "final_val_loss.png")
    figure.tight_layout()
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    figure, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 1.6 * len(order)), 4))
    for axes, key, title in ((left, "tokens_per_sec", "training tokens/s"), (right, "decode_ms_per_token",
                                                                            "cached decode step, ms/token (batch 1)")):
        values = [models[m][key] or 0.0 for m in order]
        axes.bar(order, values, color=[colours[m] for m in order])
        axes.set(title=title)
        axes.tick_params(axis="x", rotation=30)
        axes.grid(axis="y", alpha=0.3)
    written.append(folder / "throughput.png")
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
