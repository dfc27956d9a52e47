"""Associative recall (MQAR) across architectures: which of them can recall, at which length, load and width.

    python scripts/recall_study.py --name recall_quick                 # the quick grid (docs/recall.md: its time)
    python scripts/recall_study.py --name zoology --grid zoology       # Zoology's figure-2 grid: a GPU's job

Every architecture of the catalogue (or --archs) at 2 layers is trained on MQAR (``configs/data/mqar.yaml``,
``ltcx/data/mqar.py``) for each cell (sequence length, key-value pairs, width) and each learning rate of a small
sweep; the best learning rate of a cell is kept (recurrent models are sensitive to it: arXiv 2508.19029). Each run
is an ordinary ``run.py fit`` in results/<name>/runs/<arch>/T<len>_P<pairs>_d<width>/lr<lr>, trained and resumed by
scripts/compare.py's machinery: a stopped study resumes where it stopped (finished runs, those with a
``result.json``, are not redone; an unfinished one continues from its last.ckpt). Arguments after ``--`` go to every
run (e.g. ``-- --trainer.accelerator gpu``).

Writes results/<name>/summary.json (every run, and the best learning rate of every cell), summary.md (the best
accuracy of each cell, and where each architecture falls below the GPT's sanity anchor) and recall.png (accuracy vs
pairs, one line per architecture, one panel per sequence length, one row of panels per width).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("compare", ROOT / "scripts" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)  # the run machinery (train, resume, read the logs, write results) lives there
fail = compare.fail

# The grids: sequence lengths, key-value pairs, widths, learning rates, training steps, batch size, vocabulary.
# A cell whose pairs do not fit its length (length < 4 * pairs) is left out.
GRIDS = {
    # 81 CPU-minutes, 48 minutes on the 2-core CPU, for the 8 catalogue architectures (docs/recall.md).
    # Length 32 and zero fillers: at length 64, or with random fillers, a 2-layer GPT needs thousands of steps to
    # leave the 1/P plateau; here it recalls both cells by step 600 at the better learning rate.
    "quick": dict(seq_lens=[32], pairs=[2, 4], widths=[64], lrs=[1e-3, 3e-3], steps=1000, batch_size=32,
                  vocab_size=64, evals=5, random_fillers=False),
    # Zoology (arXiv 2312.04927) figure 2: lengths 64-512, pairs 4-64, widths 64-512, learning rates 1e-4 to 1e-2,
    # vocabulary 8192. Zoology trains 64 epochs of 100k sequences at batch 512/256/128 (length 64-128/256/512):
    # 12,500 steps at batch 512 is the same number of sequences, drawn fresh here.
    "zoology": dict(seq_lens=[64, 128, 256, 512], pairs=[4, 8, 16, 32, 64], widths=[64, 128, 256, 512],
                    lrs=[1e-4, 4.6e-4, 2.2e-3, 1e-2], steps=12_500, batch_size=512, vocab_size=8192, evals=4,
                    random_fillers=True),
}
MARKERS = "osD^v<>ph*"
ANCHOR = ("gpt", 0.99)  # the GPT must recall the easiest cell this well, or the task or the pipeline is wrong
LAYERS = 2


HEAD_DIM = 32  # heads of 32 dimensions: at these widths the YAMLs' 64 would leave one or two heads


def backbone_shape(arch: str, width: int, seq_len: int, paper_init: bool = False) -> dict:
    """Init args of ``arch`` at ``LAYERS`` layers of ``width`` for sequences of ``seq_len``: the catalogue's scaling
    rule (``Architecture.scaled``, ltcx/models/scaling.py: the YAML's proportions) with heads of ``HEAD_DIM``. The
    GPT family and Titans draw their matrices N(0, 1/width) (``init_std``) unless ``paper_init``: their papers'
    N(0, 0.02) is GPT-2's for width 768, and at width 64 it keeps a GPT on MQAR's 1/P plateau for thousands of steps
    (docs/recall.md, Initialisation); the xLSTM's own init already scales with the width."""
    import dataclasses

    from ltcx.models.catalog import get

    try:
        entry = get(arch)
    except KeyError as error:
        fail(str(error.args[0]))
    if entry.scaling is None:
        fail(f"no study shape for architecture '{arch}': give its catalogue entry a scaling rule "
             "(Architecture.scaling in ltcx/models/catalog.py)")
    shape = entry.scaled(width, LAYERS, seq_len, head_dim=HEAD_DIM)
    fields = {f.name for f in dataclasses.fields(entry.backbone_class().config_class)}
    if not paper_init and "init_std" in fields:
        shape["init_std"] = round(width ** -0.5, 6)
    return shape


def cells(grid: dict) -> list[tuple[int, int, int]]:
    """(sequence length, pairs, width) of every cell whose pairs fit its length."""
    return [(t, p, d) for t, p, d in itertools.product(grid["seq_lens"], grid["pairs"], grid["widths"]) if t >= 4 * p]


def run_one(arch: str, cell: tuple[int, int, int], lr: float, grid: dict, out: Path, args, extra: list[str]) -> dict:
    """Train one (architecture, cell, learning rate) unless it finished before; return its result."""
    from ltcx.models.catalog import config_path

    seq_len, pairs, width = cell
    run_root = out / "runs" / arch / f"T{seq_len}_P{pairs}_d{width}" / f"lr{lr:g}"
    result_file = run_root / "result.json"
    label = f"{arch} T={seq_len} P={pairs} d={width} lr={lr:g}"
    if result_file.is_file():
        print(f"recall_study: {label}: done before, skipped", flush=True)
        return json.loads(result_file.read_text())
    steps, evals = grid["steps"], grid["evals"]
    shape = [arg for key, value in backbone_shape(arch, width, seq_len, args.paper_init).items()
             for arg in (f"--model.backbone.init_args.{key}", json.dumps(value))]
    command = [
        "--config", str(config_path(arch)), "--config", str(ROOT / "configs/data/mqar.yaml"), *shape,
        "--data.block_size", str(seq_len), "--data.num_kv_pairs", str(pairs),
        "--data.vocab_size", str(grid["vocab_size"]), "--data.batch_size", str(grid["batch_size"]),
        "--data.random_fillers", json.dumps(grid["random_fillers"]),
        "--data.val_batches", str(args.val_batches), "--data.seed", str(args.seed),
        "--seed_everything", str(args.seed), "--model.learning_rate", str(lr), "--model.min_lr", str(lr / 10),
        "--model.warmup_steps", str(max(1, steps // 10)), "--model.weight_decay", "0.1",
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(max(1, steps // evals)),
        "--trainer.enable_progress_bar", "false", *extra,
    ]
    checkpoint = compare.train_run(command, run_root, label, steps)
    curve = compare.read_logs(run_root, "val/recall_acc")
    losses = compare.read_logs(run_root, "val/loss")
    if not curve:
        fail(f"{label} logged no val/recall_acc; see {run_root / 'run.log'}")
    from ltcx.lm import LanguageModel
    from ltcx.persist import load_language_model

    params = load_language_model(checkpoint, model_class=LanguageModel)[0].backbone.parameter_count()
    result = {
        "arch": arch, "seq_len": seq_len, "pairs": pairs, "width": width, "lr": lr, "steps": steps,
        "recall_acc": curve[-1][1], "val_loss": losses[-1][1] if losses else None,
        # ltcx logs the validation after optimizer step s at step s.
        "curve": [[step, acc] for step, acc in curve], "params": params,
    }
    compare.write_result(result_file, result)
    return result


def best_per_cell(runs: list[dict]) -> list[dict]:
    """The run of each (architecture, cell) with the best final accuracy (ties: the lower validation loss)."""
    best: dict[tuple, dict] = {}
    for run in runs:
        key = (run["arch"], run["seq_len"], run["pairs"], run["width"])
        rank = (run["recall_acc"], -(run["val_loss"] if run["val_loss"] is not None else math.inf))
        held = best.get(key)
        if held is None or rank > (held["recall_acc"], -(held["val_loss"] if held["val_loss"] is not None
                                                          else math.inf)):
            best[key] = run
    return [best[key] for key in sorted(best)]


def anchor_lines(best: list[dict], archs: list[str]) -> list[str]:
    """The sanity anchor (the GPT on the easiest cell: shortest, fewest pairs, widest) and, for each architecture,
    the cells where it falls below the anchor's accuracy."""
    arch, threshold = ANCHOR
    easiest = min({(r["seq_len"], r["pairs"], -r["width"]) for r in best})
    cell = (easiest[0], easiest[1], -easiest[2])
    lines = []
    anchor = [r for r in best if r["arch"] == arch and (r["seq_len"], r["pairs"], r["width"]) == cell]
    if anchor:
        acc = anchor[0]["recall_acc"]
        verdict = "passes" if acc >= threshold else ("FAILS: too few steps, or the task or the pipeline is wrong; "
                                                     "docs/recall.md, Initialisation")
        lines.append(f"Sanity anchor: {arch} on the easiest cell (T={cell[0]}, P={cell[1]}, d={cell[2]}) reaches "
                     f"{acc:.4f} (>= {threshold}: {verdict}).")
    for name in archs:
        below = [r for r in best if r["arch"] == name and r["recall_acc"] < threshold]
        where = ", ".join(f"T={r['seq_len']} P={r['pairs']} d={r['width']} ({r['recall_acc']:.3f})" for r in below)
        lines.append(f"- {name}: " + (f"below {threshold} at {where}" if below else f">= {threshold} in every cell"))
    return lines


def markdown_table(best: list[dict], archs: list[str], pairs: list[int]) -> str:
    """One row per (architecture, sequence length, width), one column per number of pairs: the best accuracy and
    its learning rate."""
    rows = ["| architecture | length | width | " + " | ".join(f"P={p}" for p in pairs) + " |",
            "|---|---:|---:|" + "---:|" * len(pairs)]
    index = {(r["arch"], r["seq_len"], r["width"], r["pairs"]): r for r in best}
    for arch in archs:
        for seq_len, width in sorted({(r["seq_len"], r["width"]) for r in best if r["arch"] == arch}):
            values = []
            for p in pairs:
                r = index.get((arch, seq_len, width, p))
                values.append("-" if r is None else f"{r['recall_acc']:.3f} (lr {r['lr']:g})")
            rows.append(f"| {arch} | {seq_len} | {width} | " + " | ".join(values) + " |")
    return "\n".join(rows) + "\n"


def plot(best: list[dict], archs: list[str], path: Path) -> None:
    """Accuracy vs pairs: one panel per sequence length (columns) and width (rows), one line per architecture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted({r["seq_len"] for r in best})
    widths = sorted({r["width"] for r in best})
    figure, axes = plt.subplots(len(widths), len(seq_lens), figsize=(3.6 * len(seq_lens), 3.0 * len(widths)),
                                squeeze=False, sharey=True)
    for (i, width), (j, seq_len) in itertools.product(enumerate(widths), enumerate(seq_lens)):
        ax = axes[i][j]
        for k, arch in enumerate(archs):
            points = sorted((r["pairs"], r["recall_acc"]) for r in best
                            if r["arch"] == arch and r["seq_len"] == seq_len and r["width"] == width)
            if points:
                # Dodged sideways a little, each its own marker: architectures at the same accuracy stay visible.
                dodge = 2 ** ((k - (len(archs) - 1) / 2) * 0.025)
                ax.plot([p * dodge for p, _ in points], [a for _, a in points], marker=MARKERS[k % len(MARKERS)],
                        label=arch, alpha=0.85)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["pairs"] for r in best}), [str(p) for p in sorted({r["pairs"] for r in best})])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"length {seq_len}, width {width}", fontsize=9)
        ax.set_xlabel("key-value pairs")
        if j == 0:
            ax.set_ylabel("MQAR accuracy (best lr)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    argv, extra = compare.split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = compare.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="results go to <out>/<name>/")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    parser.add_argument("--archs", nargs="+", default=None, help="catalogued architectures (default: all)")
    positive = compare.at_least_one
    for key, kind in (("seq_lens", positive), ("pairs", positive), ("widths", positive), ("lrs", float)):
        parser.add_argument(f"--{key}", nargs="+", type=kind, default=None, help=f"replace the grid's {key}")
    for key in ("steps", "batch_size", "vocab_size", "evals"):
        parser.add_argument(f"--{key}", type=positive, default=None, help=f"replace the grid's {key}")
    parser.add_argument("--val_batches", type=positive, default=8, help="validation batches per evaluation")
    parser.add_argument("--paper_init", action="store_true",
                        help="keep each architecture's own init (N(0, 0.02) for the GPT family and Titans) instead "
                             "of N(0, 1/width)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    from ltcx.models.catalog import CATALOG

    grid = dict(GRIDS[args.grid])
    for key in ("seq_lens", "pairs", "widths", "lrs", "steps", "batch_size", "vocab_size", "evals"):
        if getattr(args, key) is not None:
            grid[key] = getattr(args, key)
    archs = args.archs or sorted(CATALOG, key=lambda name: (name != ANCHOR[0], name))
    unknown = [a for a in archs if a not in CATALOG]
    if unknown:
        fail(f"unknown architecture(s) {', '.join(unknown)}: pass --archs among {', '.join(sorted(CATALOG))}")
    grid_cells = cells(grid)
    if not grid_cells:
        fail("no cell of the grid fits: every length must be >= 4 x the pairs (raise --seq_lens or lower --pairs)")
    out = (args.out / args.name).resolve()
    runs = [run_one(arch, cell, lr, grid, out, args, extra)
            for cell in grid_cells for arch in archs for lr in grid["lrs"]]
    best = best_per_cell(runs)
    lines = anchor_lines(best, archs)
    summary = {"grid": grid, "archs": archs, "layers": LAYERS, "best": best, "runs": runs,
               "anchor": lines, "command": " ".join(["scripts/recall_study.py", *argv])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(best, archs, sorted(set(grid["pairs"])))
    (out / "summary.md").write_text(table + "\n" + "\n".join(lines) + "\n")
    plot(best, archs, out / "recall.png")
    print(table + "\n" + "\n".join(lines))
    print(f"recall_study: wrote {out / 'summary.json'}, {out / 'summary.md'} and {out / 'recall.png'}")


if __name__ == "__main__":
    main()
