"""A study's numbers and its report: ``summarize`` turns the runs into every statistic the study reports
(``summary.json``), ``write_report`` writes ``summary.json``, ``summary.md``, the PNG figures and ``report.html``
(one file: the tables and the figures embedded as base64, nothing fetched).

What is chosen and what is reported are kept apart: the learning rate comes from the validation split of the
tuning seed (``results.select_learning_rates``); every number of the results table, the paired differences and the
ladder come from the test split (``test/<metric>``) of the runs at that rate.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from ltcx.persist.files import atomic_write, atomic_write_text
from ltcx.study.budget import TOLERANCE
from ltcx.study.ladder import compute_multiplier, fit_power_law, frontier
from ltcx.study.spec import StudySpec
from ltcx.study.stats import mean_interval, paired_difference

__all__ = ["summarize", "tables", "write_json", "write_report"]

FIGURES = ("curves.png", "final.png", "ladder.png", "state.png", "grid.png")


def write_json(path: Path, value: Any) -> None:
    """``value`` as JSON, atomically: a file that marks something done is whole or absent (through a temp file of
    this process: several launchers may finish one study at once)."""
    atomic_write_text(path, json.dumps(value, indent=2))


def _interval(values: list[float]) -> dict | None:
    if not values:
        return None
    found = mean_interval(values)
    return {"mean": found.mean, "ci95": found.half_width, "sd": found.sd, "n": found.n, "low": found.low,
            "high": found.high}


def summarize(spec: StudySpec, tuning: list[dict], final: list[dict], chosen: dict, timing: dict | None = None,
              left_out: list[dict] = ()) -> dict:
    """Every number of the study from its results (``processes.train``'s dicts; ``final`` with their ``test``) and the
    timing pass's record (``ltcx/study/timing.py``; its rows are keyed ``"<arch> <size label>"``). ``left_out``: the
    runs that failed or whose files are damaged (``{"run", "folder", "damaged", "line"}``), listed so that none is
    dropped unsaid: each entry's row (``arch``, ``size_label``) is kept, marked ``incomplete``, and so are the ladder
    fit and the compute multiplier that need it."""
    metric = spec.metric
    test_key, val_key = f"test/{metric}", f"val/{metric}"
    sizes = list(dict.fromkeys(r["size_label"] for r in final))
    groups: dict[tuple[str, str], list[dict]] = {}
    for result in final:
        groups.setdefault((result["arch"], result["size_label"]), []).append(result)
    results = []
    for (arch, label), runs in groups.items():
        good = [r for r in runs if not r.get("diverged") and test_key in r.get("test", {})]
        first = good[0] if good else runs[0]
        entry = {"arch": arch, "size_label": label, "size": first["size"], "lr": chosen[(arch, label)]["lr"],
                 "edge": chosen[(arch, label)]["edge"], "seeds": sorted(r["seed"] for r in good),
                 "diverged_seeds": sorted(r["seed"] for r in runs if r.get("diverged")),
                 "test": _interval([r["test"][test_key] for r in good]),
                 "val": _interval([r["val"][val_key] for r in good if val_key in r["val"]]),
                 "test_by_seed": {str(r["seed"]): r["test"][test_key] for r in good}}
        for key in ("params", "flops_per_token", "state_bytes", "tokens", "steps", "init_args", "distance"):
            entry[key] = first.get(key)
        entry["cell"] = first.get("cell", {})
        speed = (timing or {}).get("models", {}).get(f"{arch} {label}", {})
        entry["tokens_per_sec"], entry["decode_ms_per_token"] = speed.get("tokens_per_sec"), speed.get(
            "decode_ms_per_token")
        entry["train_flops"] = (entry["flops_per_token"] or 0) * entry["tokens"] if entry["flops_per_token"] else None
        results.append(entry)
    for gone in left_out:  # a row none of whose runs finished: kept, empty, marked
        if (gone["arch"], gone["size_label"]) not in groups and gone.get("size_label") is not None:
            groups[(gone["arch"], gone["size_label"])] = []
            results.append({"arch": gone["arch"], "size_label": gone["size_label"], "size": gone["size"],
                            "cell": gone["cell"], "lr": None, "edge": False, "seeds": [], "diverged_seeds": [],
                            "test": None, "val": None, "test_by_seed": {}, "params": None, "flops_per_token": None,
                            "state_bytes": None, "tokens": None, "steps": None, "init_args": None, "distance": None,
                            "tokens_per_sec": None, "decode_ms_per_token": None, "train_flops": None})
    for entry in results:
        entry["incomplete"] = [g["run"] for g in left_out
                               if (g["arch"], g["size_label"]) == (entry["arch"], entry["size_label"])]
    index = {(e["arch"], e["size_label"]): e for e in results}
    for entry in results:
        base = index.get((spec.reference, entry["size_label"]))
        if entry["arch"] == spec.reference or base is None:
            continue
        shared = sorted(set(entry["test_by_seed"]) & set(base["test_by_seed"]), key=int)
        if shared:
            diff = paired_difference([entry["test_by_seed"][s] for s in shared],
                                     [base["test_by_seed"][s] for s in shared])
            entry["vs_baseline"] = {"mean": diff.interval.mean, "ci95": diff.interval.half_width,
                                    "sd": diff.interval.sd, "p": diff.p_value, "paired_seeds": len(shared)}
        if entry["tokens_per_sec"] and base["tokens_per_sec"]:
            entry["throughput_vs_baseline"] = entry["tokens_per_sec"] / base["tokens_per_sec"] - 1
    # every run once: the tuning seed's run at the chosen rate is a run of both phases, kept with its test
    runs: dict[tuple, dict] = {}
    for phase, items in (("tune", tuning), ("seeds", final)):
        for r in items:
            key = (r["arch"], r["size_label"], r["lr"], r["seed"])
            runs[key] = {**runs.get(key, {}), **r, "phase": phase}
    runs = list(runs.values())
    summary = {"name": spec.name, "spec": {"name": spec.name, **spec.defining()}, "metric": metric,
               "higher_is_better": spec.higher_is_better, "baseline": spec.reference, "sizes": sizes,
               "learning_rates": [{"arch": a, "size_label": s, **pick} for (a, s), pick in chosen.items()],
               "results": results, "runs": runs}
    summary["ladder"] = {} if spec.grid else ladder(spec, results)  # a grid's cells are tasks, not compute sizes
    summary["grid"] = {key: list(values) for key, values in spec.grid.items()}
    summary["anchor"] = anchor(spec, results)
    summary["timing"] = timing and {k: v for k, v in timing.items() if k != "checkpoints"}
    summary["left_out"] = [dict(entry) for entry in left_out]
    summary["tolerance"] = TOLERANCE
    return summary


def anchor(spec: StudySpec, results: list[dict]) -> dict:
    """The sanity anchor: the baseline must reach ``spec.anchor`` (test/<metric>, mean over seeds) on the first cell
    at its largest size, or the task, the steps or the pipeline is wrong; and per architecture the rows below it."""
    if spec.anchor is None:
        return {}
    threshold = spec.anchor
    firsts = [e for e in results if e["arch"] == spec.reference and e["test"]
              and list(e["cell"].values()) == [values[0] for values in spec.grid.values()]]
    lines = []
    passed = None
    if firsts:
        entry = max(firsts, key=lambda e: e["size"])
        passed = entry["test"]["mean"] >= threshold
        verdict = "passes" if passed else ("FAILS: too few steps, or the task or the pipeline is wrong "
                                           "(docs/recall.md, Initialisation)")
        lines.append(f"Sanity anchor: {spec.reference} at {entry['size_label']} reaches {entry['test']['mean']:.4f} "
                     f"(>= {threshold:g}: {verdict}).")
    for arch in dict.fromkeys(e["arch"] for e in results):
        below = [e for e in results if e["arch"] == arch and e["test"] and e["test"]["mean"] < threshold]
        where = ", ".join(f"{e['size_label']} ({e['test']['mean']:.3f})" for e in below)
        lines.append(f"{arch}: " + (f"below {threshold:g} at {where}" if below else f">= {threshold:g} in every row"))
    return {"threshold": threshold, "passed": passed, "lines": lines}


def ladder(spec: StudySpec, results: list[dict]) -> dict:
    """Per architecture: its (compute, loss, seed) points, the power-law fit over them and the compute multiplier at
    its largest size against the baseline (seed by seed). Only for a loss (lower is better) at 2 sizes or more."""
    if spec.higher_is_better or len({r["size_label"] for r in results}) < 2:
        return {}
    by_arch: dict[str, list[dict]] = {}
    incomplete: dict[str, list[str]] = {}  # arch -> its rows that lack a run
    for entry in results:
        if entry.get("incomplete"):
            incomplete.setdefault(entry["arch"], []).append(entry["size_label"])
        if entry["train_flops"] and entry["test"]:
            by_arch.setdefault(entry["arch"], []).append(entry)
    out: dict[str, Any] = {}
    for arch in dict.fromkeys(e["arch"] for e in results):
        entries = by_arch.get(arch, [])
        points = [[e["train_flops"], value, int(seed)] for e in entries for seed, value in e["test_by_seed"].items()]
        out[arch] = {"points": points, "fit": None, "fit_text": None, "incomplete": incomplete.get(arch, [])}
        if len({p[0] for p in points}) >= 2:
            fit = fit_power_law([p[0] for p in points], [p[1] for p in points])
            out[arch].update(fit=fit.__dict__, fit_text=fit.describe())

    def seed_fit(arch: str, seed: str):
        points = [(e["train_flops"], e["test_by_seed"][seed]) for e in by_arch.get(arch, [])
                  if seed in e["test_by_seed"]]
        if len({c for c, _ in points}) < 2:
            return None
        return fit_power_law([c for c, _ in points], [v for _, v in points])

    base = spec.reference
    for arch, entry in out.items():
        if arch == base or not by_arch.get(arch):
            continue
        largest = max(by_arch[arch], key=lambda e: e["train_flops"])
        fits, losses = [], []
        for seed, value in largest["test_by_seed"].items():
            fit = seed_fit(base, seed)
            if fit is not None and fit.b < 0:  # a baseline that does not improve with compute has no inverse
                fits.append(fit)
                losses.append(value)
        if fits:
            found = compute_multiplier(fits, largest["train_flops"], losses)
            entry["multiplier"] = {"at_size": largest["size_label"], "compute": largest["train_flops"],
                                   **found.__dict__}
    for arch, entry in out.items():  # a multiplier needs every run of the architecture's ladder and the baseline's
        if arch != base and (entry["incomplete"] or out.get(base, {}).get("incomplete")):
            entry["multiplier_incomplete"] = True
    points = [(e["train_flops"], e["test"]["mean"], e["arch"]) for es in by_arch.values() for e in es]
    return {"archs": out, "frontier": [list(p) for p in frontier(points)]}


# ----------------------------------------------------------------------------- tables


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def _si(value) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g}"


def _pm(interval: dict | None, key: str = "ci95", spec: str = ".4f") -> str:
    if not interval:
        return "-"
    return f"{interval['mean']:{spec}}" + ("" if interval.get(key) is None else f" +- {interval[key]:{spec}}")


def _shape_text(init_args: dict | None) -> str:
    if not init_args:
        return "its YAML's"
    width = init_args.get("n_embd")
    depth = init_args.get("n_layer")
    return f"{width} x {depth}"


def tables(summary: dict) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, header, rows, note) of every table the report shows."""
    metric, base = summary["metric"], summary["baseline"]
    results = summary["results"]
    spec = summary["spec"]
    tolerance = summary.get("tolerance", TOLERANCE)
    matched = spec.get("size_by") == "params"
    budget = f"{spec.get('match', 'params')} vs {base}" if matched else None

    def distance(e: dict) -> str:
        if e["distance"] is None:
            return "-"
        return f"{e['distance']:+.2%}" + (f" (outside {tolerance:.0%})" if abs(e["distance"]) > tolerance else "")

    shapes = [[e["arch"], e["size_label"], _shape_text(e["init_args"]), _fmt(e["params"], ",.0f"),
               _si(e["flops_per_token"]), _si(e["state_bytes"]) + "B", _fmt(e["steps"], "d"), _si(e["tokens"]),
               _si(e["train_flops"]), distance(e)] for e in results]
    out = [("Shapes", ["architecture", "size", "width x depth", "non-embedding parameters", "FLOPs / token",
                       "state", "steps", "tokens", "training FLOPs",
                       f"budget distance ({budget})" if budget else "budget distance"], shapes,
            "FLOPs per token: training (3 x forward). State: inference state after one context, batch 1."
            + (f" Budget distance: the {spec.get('match')} figure over {base}'s at the same size, less 1 ({base}'s "
               "own row: its parameters over the size asked), of the planned shape built at the data's vocabulary; "
               f"beyond {tolerance:.0%} it is marked." if budget else ""))]
    grid = sorted({g["lr"] for pick in summary["learning_rates"] for g in pick["grid"]})
    rows = []
    for pick in summary["learning_rates"]:
        values = {g["lr"]: ("diverged" if g["diverged"] else _fmt(g["value"])) for g in pick["grid"]}
        mark = " (edge of the rates tried)" if pick["edge"] else ""
        rows.append([pick["arch"], pick["size_label"], *[values.get(lr, "-") for lr in grid],
                     f"{pick['lr']:g}{mark}"])
    seed = spec["tuning_seed"] if spec["tuning_seed"] is not None else spec["seeds"][0]
    base_grid = ", ".join(f"{lr:g}" for lr in spec["learning_rates"])
    added = [f"{p['arch']} {p['size_label']}: {', '.join(f'{lr:g}' for lr in p.get('added', []))}"
             for p in summary["learning_rates"] if p.get("added")]
    out.append((f"Learning rate (val/{metric}, seed {seed})", ["architecture", "size", *[f"lr {lr:g}" for lr in grid],
                                                               "chosen"], rows,
                f"Chosen on the validation split of the tuning seed only. Rates tried: the grid ({base_grid}), and "
                "where the choice was at its edge the next rate outward by the grid's ratio, until the choice was "
                f"interior or {spec.get('lr_extend', 0)} rates were added" + (f" ({'; '.join(added)})." if added else
                                                                               " (none was needed).")))
    rows = []
    timing = summary.get("timing")
    unreliable = " (unreliable)" if timing and timing["speed_unreliable"] else ""
    for e in results:
        diff = e.get("vs_baseline")
        seeds = str(len(e["seeds"])) + (f" ({len(e['diverged_seeds'])} diverged)" if e["diverged_seeds"] else "")
        if e.get("incomplete"):
            seeds += f" (incomplete: {len(e['incomplete'])} runs missing or failed)"
        row = [e["arch"], e["size_label"], _fmt(e["lr"], "g"), seeds,
               _pm(e["test"]), _pm(e["val"]), _pm(diff) if diff else "-", _fmt(diff.get("p") if diff else None, ".3g")]
        if timing:
            change = e.get("throughput_vs_baseline")
            row += [_fmt(e["tokens_per_sec"], ",.0f"), "-" if change is None else f"{change:+.2%}",
                    _fmt(e["decode_ms_per_token"], ".2f")]
        rows.append(row)
    # every column built from the timing pass carries its verdict
    speed_header = [f"train tokens/s{unreliable}", f"throughput vs {base}{unreliable}",
                    f"decode ms/token{unreliable}"] if timing else []
    note = (f"Paired by seed against {base} at the same size (the same batches in the same order); p: the paired "
            "t-test's. An interval that holds 0 does not tell the two apart.")
    if timing:
        note += " " + timing_note(timing)
    if summary.get("anchor"):
        note += " " + " ".join(summary["anchor"]["lines"])
    out.append((f"Results (test/{metric}, mean +- 95% CI over seeds)",
                ["architecture", "size", "lr", "seeds", f"test {metric}", f"val {metric}",
                 f"vs {base} (paired)", "p", *speed_header], rows, note))
    if summary.get("grid"):
        out.append(_grid_table(summary))
    if summary["ladder"]:
        rows = []
        for arch, entry in summary["ladder"]["archs"].items():
            fit, mult = entry.get("fit"), entry.get("multiplier")
            interval = "-" if not mult else (f"{mult['value']:.3g}" + (
                "" if mult["low"] is None else f" [{mult['low']:.3g}, {mult['high']:.3g}]"))
            if entry.get("multiplier_incomplete"):
                interval += " (incomplete)"
            missing = entry.get("incomplete")
            points = str(len(entry["points"])) + (f" (incomplete: {', '.join(missing)})" if missing else "")
            if fit is None:
                rows.append([arch, "-", "-", points + " (no fit: fewer than 2 sizes)",
                             "1 (baseline)" if arch == base else interval])
                continue
            rows.append([arch, _fmt(fit["b"], ".4f") + ("" if fit["b_se"] is None else f" +- {fit['b_se']:.4f}"),
                         _fmt(fit["log_a"], ".4f") + ("" if fit["log_a_se"] is None else
                                                      f" +- {fit['log_a_se']:.4f}"),
                         points, "1 (baseline)" if arch == base else interval])
        out.append((f"Compute ladder: log test/{metric} = log a + b log C", ["architecture", "b", "log a", "points",
                                                                            f"compute multiplier vs {base}"], rows,
                    "Least squares over every seed's point, +- one standard error (none below 3 points). The compute "
                    f"multiplier: the training compute {base}'s fit needs to reach the architecture's loss at its "
                    "largest size, over the architecture's compute (above 1: less compute for the same loss); seed "
                    "by seed, geometric mean and 95% interval."))
    if summary.get("left_out"):
        out.append(("Runs left out", ["run", "why", "what happened"],
                    [[e["run"], e.get("why") or ("damaged" if e["damaged"] else "failed"), e["line"]]
                     for e in summary["left_out"]],
                    "Not in the tables above: their rows, fits and multipliers are marked incomplete. A damaged run: "
                    "delete its folder and rerun the same `ltcx study` command to retrain it; a failed or missing "
                    "one: rerun to train it."))
    return out


def timing_note(timing: dict) -> str:
    """How the speed columns were timed and, when the load average passed the core count, that they are
    unreliable."""
    note = (f"Speed columns: one timing pass after training, in one process on {timing['device']} "
            f"({timing['precision']}), {timing['rounds']} interleaved rounds over one checkpoint per row (its lowest "
            f"seed's); training steps through the loss path at batch {timing['batch_size']}, decode at batch 1 after "
            f"half a block. Load average (1 min) up to {timing['load_average_max']:.1f} on {timing['usable_cores']} "
            "usable cores.")
    if timing["speed_unreliable"]:
        note += (f" **The speed columns are unreliable**: the load average ({timing['load_average_max']:.1f}) exceeded "
                 f"the {timing['usable_cores']} usable cores while they were timed; rerun with --retime on a quieter "
                 "machine.")
    return note


def _grid_table(summary: dict) -> tuple[str, list[str], list[list[str]], str]:
    """One row per (architecture, size, every grid key but the last), one column per value of the last key."""
    metric, keys = summary["metric"], list(summary["grid"])
    last = keys[-1]
    rows: dict[tuple, dict] = {}
    for e in summary["results"]:
        row_key = (e["arch"], f"size{e['size']:g}" if e["init_args"] else "config",
                   *(str(e["cell"].get(k)) for k in keys[:-1]))
        rows.setdefault(row_key, {})[repr(e["cell"].get(last))] = e
    body = [[*key, *(_pm(cells[repr(v)]["test"], spec=".3f") if repr(v) in cells else "-"
                     for v in summary["grid"][last])] for key, cells in rows.items()]
    return (f"Grid (test/{metric}, mean +- 95% CI; learning rate chosen per cell)",
            ["architecture", "size", *keys[:-1], *(f"{last}={v}" for v in summary["grid"][last])], body,
            "A dash: a cell the data cannot hold (MQAR: block_size < 4 x num_kv_pairs).")


def incomplete_line(summary: dict) -> str | None:
    """The report's first words when runs are missing or failed: how many, and each by name."""
    gone = summary.get("left_out") or []
    if not gone:
        return None
    return (f"**Incomplete**: {len(gone)} runs missing or failed ("
            + "; ".join(f"{e['run']}: {e.get('why') or ('damaged' if e['damaged'] else 'failed')}" for e in gone)
            + "); the rows, fits and multipliers that need them are marked incomplete.")


def markdown(summary: dict) -> str:
    lines = [f"# Study {summary['name']}", ""]
    if incomplete_line(summary):
        lines += [incomplete_line(summary), ""]
    for title, header, rows, note in tables(summary):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", note, ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figures


def _colours(archs: list[str]) -> dict[str, Any]:
    import matplotlib

    cycle = matplotlib.colormaps["tab10"]
    return {arch: cycle(i % 10) for i, arch in enumerate(archs)}


def curve_band(summary: dict, arch: str, size: str) -> tuple[list[int], list[float], list] | None:
    """(the seeds, the training tokens, the ``Interval`` of val/<metric> at each) of ``arch`` at ``size``: every
    seed's run at the chosen rate, the tuning seed's included; None when none logged a curve."""
    metric = summary["metric"]
    runs = [r for r in summary["runs"] if r["phase"] == "seeds" and r["arch"] == arch and r["size_label"] == size
            and not r.get("diverged") and r["curves"].get(f"val/{metric}")]
    if not runs:
        return None
    curves = [dict(map(tuple, r["curves"][f"val/{metric}"])) for r in runs]
    tokens = sorted(set.intersection(*(set(c) for c in curves)))
    return sorted(r["seed"] for r in runs), tokens, [mean_interval([c[t] for c in curves]) for t in tokens]


def _plain_ticks(ax, x_si: bool = False) -> None:
    """Tick labels as plain numbers (0.45, 2, 10 M), not matplotlib's 4.5x10^-1 on a log axis."""
    from matplotlib.ticker import FuncFormatter

    def label(si: bool):
        return lambda value, _: _si(value) if si else f"{value:.3g}"

    for axis, si, limits in ((ax.yaxis, False, ax.get_ylim()), (ax.xaxis, x_si, ax.get_xlim())):
        axis.set_major_formatter(FuncFormatter(label(si)))
        if axis.get_scale() == "log":
            low, high = sorted(abs(v) for v in limits)
            if low > 0 and high / low < 10:  # under a decade: every minor tick labelled, else 2 and 5 of each
                axis.set_minor_formatter(FuncFormatter(label(si)))
            else:
                axis.set_minor_formatter(FuncFormatter(
                    lambda value, _, si=si: label(si)(value, _) if f"{value:.1e}"[:3] in ("2.0", "5.0") else ""))


def figures(summary: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = summary["metric"]
    archs = list(dict.fromkeys(e["arch"] for e in summary["results"]))
    colours = _colours(archs)
    written = []

    sizes = summary["sizes"]
    columns = min(4, len(sizes))
    lines = math.ceil(len(sizes) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.6 * lines), squeeze=False)
    for ax in axes.flat[len(sizes):]:
        ax.set_visible(False)
    for ax, size in zip(axes.flat, sizes):
        for arch in archs:
            band = curve_band(summary, arch, size)
            if band is None:
                continue
            seeds, tokens, found = band
            ax.plot(tokens, [f.mean for f in found], color=colours[arch], label=f"{arch} ({len(seeds)} seeds)")
            if all(f.half_width is not None for f in found):
                ax.fill_between(tokens, [f.low for f in found], [f.high for f in found], color=colours[arch],
                                alpha=0.2)
        ax.set(title=size, xlabel="training tokens", ylabel=f"val/{metric}")
        _plain_ticks(ax, x_si=True)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a size whose runs logged no curve has nothing to name
            ax.legend(fontsize=7)
    figure.suptitle("Validation curves at the chosen rate (mean, 95% band over seeds)", fontsize=9)
    written.append(_save(figure, folder / "curves.png"))

    titles = {"final.png": f"test/{metric} against non-embedding parameters",
              "ladder.png": f"Compute ladder: test/{metric} against training FLOPs, power-law fits",
              "state.png": f"test/{metric} against inference state"}
    for name, x_key, x_label in (("final.png", "params", "non-embedding parameters"),
                                 ("ladder.png", "train_flops", "training FLOPs"),
                                 ("state.png", "state_bytes", "inference state (bytes)")):
        figure, ax = plt.subplots(figsize=(6.4, 4.4))
        for arch in archs:
            entries = sorted((e for e in summary["results"] if e["arch"] == arch and e["test"] and e[x_key]),
                             key=lambda e: e[x_key])
            if not entries:
                continue
            xs = [e[x_key] for e in entries]
            ys = [e["test"]["mean"] for e in entries]
            errors = [e["test"]["ci95"] or 0.0 for e in entries]
            ax.errorbar(xs, ys, yerr=errors, fmt="o-" if name != "ladder.png" else "o", capsize=3,
                        color=colours[arch], label=arch)
            fit = summary["ladder"].get("archs", {}).get(arch, {}).get("fit") if summary["ladder"] else None
            if name == "ladder.png" and fit:
                line = [min(xs) / 1.2, max(xs) * 1.2]
                ax.plot(line, [math.exp(fit["log_a"] + fit["b"] * math.log(c)) for c in line], color=colours[arch],
                        alpha=0.7, label=f"{arch}: b = {fit['b']:.3f}")
        if name == "ladder.png" and summary["ladder"]:
            edge = summary["ladder"]["frontier"]
            ax.step([p[0] for p in edge], [p[1] for p in edge], where="post", color="black", linestyle="--",
                    alpha=0.6, label="frontier")
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set(title=titles[name], xlabel=x_label, ylabel=f"test/{metric} (mean, 95% CI)")
        ax.title.set_fontsize(9)
        _plain_ticks(ax, x_si=True)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        written.append(_save(figure, folder / name))
    if summary.get("grid"):
        written.append(_grid_figure(summary, folder / "grid.png", colours))
    return written


def _grid_figure(summary: dict, path: Path, colours: dict) -> Path:
    """test/<metric> against the grid's last key, one panel per (size, other keys' values), one line per
    architecture with its 95% interval."""
    import matplotlib.pyplot as plt

    keys = list(summary["grid"])
    last = keys[-1]
    panel_of = {}
    for e in summary["results"]:
        panel = (e["size"], *(e["cell"].get(k) for k in keys[:-1]))
        panel_of.setdefault(panel, []).append(e)
    panels = sorted(panel_of, key=repr)
    columns = min(4, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(3.8 * columns, 3.2 * lines), squeeze=False, sharey=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in summary["grid"][last])
    for ax, panel in zip(axes.flat, panels):
        for arch, colour in colours.items():
            entries = sorted((e for e in panel_of[panel] if e["arch"] == arch and e["test"]),
                             key=lambda e: summary["grid"][last].index(e["cell"].get(last)))
            if entries:
                xs = [e["cell"].get(last) if numeric else str(e["cell"].get(last)) for e in entries]
                ax.errorbar(xs, [e["test"]["mean"] for e in entries], yerr=[e["test"]["ci95"] or 0.0 for e in entries],
                            fmt="o-", capsize=3, color=colour, label=arch, alpha=0.85)
        if numeric:
            ax.set_xscale("log", base=2)
            ax.set_xticks(summary["grid"][last], [str(v) for v in summary["grid"][last]])
            ax.minorticks_off()
        title = ", ".join([f"size {panel[0]:g}" if panel[0] else "config",
                           *(f"{k} {v}" for k, v in zip(keys[:-1], panel[1:]))])
        ax.set(title=title, xlabel=last, ylabel=f"test/{summary['metric']}")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    figure.suptitle(f"test/{summary['metric']} across the grid's cells (mean, 95% CI over seeds)", fontsize=9)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    try:
        atomic_write(path, lambda temp: figure.savefig(temp, dpi=110, format="png"))
    finally:
        plt.close(figure)
    return path


# ----------------------------------------------------------------------------- html


def _inline(text: str) -> str:
    """``text`` escaped for HTML, its Markdown ``**bold**`` and ```code``` rendered (the notes are written once, for
    summary.md, where Markdown renders them)."""
    import re

    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def html_report(summary: dict, images: list[Path]) -> str:
    """One self-contained page: every table, every figure as a base64 PNG, no script and no network."""
    parts = ["<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
             f"<title>Study {html.escape(summary['name'])}</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}"
             "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #bbb;padding:2px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
             ".note{color:#555;font-size:90%}</style></head><body>",
             f"<h1>Study {html.escape(summary['name'])}</h1>",
             f"<p>metric: {html.escape(summary['metric'])} (chosen on validation, reported on test); baseline: "
             f"{html.escape(summary['baseline'])}</p>"]
    if incomplete_line(summary):
        parts.append(f"<p>{_inline(incomplete_line(summary))}</p>")
    for title, header, rows, note in tables(summary):
        parts += [f"<h2>{html.escape(title)}</h2>", "<table>",
                  "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts += ["</table>", f"<p class=\"note\">{_inline(note)}</p>"]
    parts.append("<h2>Figures</h2>")
    for image in images:
        data = base64.b64encode(image.read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt=\"{image.stem}\" src=\"data:image/png;base64,{data}\">"
                     f"<figcaption>{image.name}</figcaption></figure>")
    parts += ["<h2>Spec</h2>", f"<pre>{html.escape(json.dumps(summary['spec'], indent=2))}</pre>", "</body></html>"]
    return "\n".join(parts) + "\n"


def write_report(summary: dict, folder: Path) -> list[Path]:
    """summary.json, summary.md, the figures and report.html in ``folder``; the paths written."""
    write_json(folder / "summary.json", summary)
    atomic_write_text(folder / "summary.md", markdown(summary))
    images = figures(summary, folder)
    atomic_write_text(folder / "report.html", html_report(summary, images))
    return [folder / "summary.json", folder / "summary.md", *images, folder / "report.html"]


# ----------------------------------------------------------------------------- a docs table from a kept summary


def recall_table(summary: dict) -> str:
    """docs/recall.md's table from a study's ``summary.json``: per architecture, each size's chosen rate (marked at
    the edge of the rates tried) and its test metric, mean +- 95% interval (the seeds' values in brackets); a row
    with runs missing is marked."""
    sizes = summary["sizes"]
    metric = summary["metric"]
    header = ["architecture"] + [f"{size}: {what}" for size in sizes for what in ("lr", f"test {metric} (seeds)")]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|---|" * len(sizes)]
    rows: dict[str, dict] = {}
    for e in summary["results"]:
        rows.setdefault(e["arch"], {})[e["size_label"]] = e
    for arch, by_size in rows.items():
        cells = [arch]
        for size in sizes:
            e = by_size.get(size)
            if e is None or e["test"] is None:
                cells += ["-", "incomplete" if e is not None else "-"]
                continue
            seeds = ", ".join(f"{e['test_by_seed'][s]:.3g}" for s in sorted(e["test_by_seed"], key=int))
            cells += [f"{e['lr']:g}" + (" (edge)" if e["edge"] else ""),
                      _pm(e["test"], spec=".3f") + f" ({seeds})" + (" incomplete" if e.get("incomplete") else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m ltcx.study.report docs/results/quick-recall.json: the docs' table
    import sys

    print(recall_table(json.loads(Path(sys.argv[1]).read_text())))
