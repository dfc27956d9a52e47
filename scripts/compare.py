"""A controlled, multi-seed comparison of architectures: same data, same tokens, same recipe, paired seeds.

    python scripts/compare.py --name quick --configs configs/gpt.yaml configs/ltc.yaml configs/xlstm.yaml \\
        --seeds 0 1 2 --baseline gpt --tokens 300000 --batch_size 8 --block_size 128 -- --data.path sample
    python scripts/plot_results.py results/quick

Each (config, seed) is an ordinary `run.py fit` in its own folder results/<name>/runs/<model>/seed<S>
(TensorBoard logs under lightning_logs/, checkpoints under checkpoints/), with `--seed_everything S` and
`--data.seed S`, so every model of one seed sees the same blocks in the same order. Arguments after `--` go
to every run. A comparison that was stopped resumes where it stopped: finished runs (a `result.json`) are
not redone, and an unfinished one continues from its `last.ckpt`.

Writes results/<name>/summary.json and summary.md: the final validation loss of every run, mean +- sd per
model, the paired difference to the baseline (per seed, then mean +- sd over seeds), parameters, training
tokens/s, the cached decode step (ms per token, batch 1) and the state or KV-cache bytes per token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fail(message: str) -> None:
    print(f"compare: error: {message}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- statistics


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def summarize(runs: list[dict], baseline: str | None) -> dict:
    """Per-model statistics from the runs ({"model", "seed", "val_loss", ...}).

    The paired difference of a model is computed seed by seed against the baseline run of the same seed
    (same data order), then averaged: its sd measures how consistent the gap is, free of the seed-to-seed
    variation both models share.
    """
    models: dict[str, list[dict]] = {}
    for run in runs:
        models.setdefault(run["model"], []).append(run)
    base_by_seed = {run["seed"]: run["val_loss"] for run in models.get(baseline, [])}
    summary = {}
    for model, model_runs in models.items():
        losses = [run["val_loss"] for run in model_runs]
        loss_mean, loss_sd = mean_sd(losses)
        entry = {
            "seeds": sorted(run["seed"] for run in model_runs),
            "val_loss_mean": loss_mean,
            "val_loss_sd": loss_sd,
        }
        for key in ("params", "tokens_per_sec", "decode_ms_per_token", "state_bytes_per_token"):
            values = [run[key] for run in model_runs if run.get(key) is not None]
            entry[key] = statistics.fmean(values) if values else None
        paired = [run["val_loss"] - base_by_seed[run["seed"]] for run in model_runs if run["seed"] in base_by_seed]
        if baseline is not None and model != baseline and paired:
            entry["diff_vs_baseline_mean"], entry["diff_vs_baseline_sd"] = mean_sd(paired)
            entry["paired_seeds"] = len(paired)
        summary[model] = entry
    return summary


def markdown_table(summary: dict, baseline: str | None) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    rows = [
        f"| model | seeds | val loss (mean +- sd) | vs {baseline or 'baseline'} (paired mean +- sd) | parameters | "
        "train tokens/s | decode ms/token | state bytes/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, s in sorted(summary.items(), key=lambda item: item[1]["val_loss_mean"]):
        loss = f"{s['val_loss_mean']:.4f} +- {number(s['val_loss_sd'], '.4f')}"
        diff = "-"
        if "diff_vs_baseline_mean" in s:
            diff = f"{s['diff_vs_baseline_mean']:+.4f} +- {number(s['diff_vs_baseline_sd'], '.4f')}"
        rows.append(
            f"| {model} | {len(s['seeds'])} | {loss} | {diff} | {number(s['params'], ',.0f')} | "
            f"{number(s['tokens_per_sec'], ',.0f')} | {number(s['decode_ms_per_token'], '.1f')} | "
            f"{number(s['state_bytes_per_token'], ',.0f')} |"
        )
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------- one run


def read_logs(run_root: Path, tag: str = "val/loss") -> tuple[list[tuple[int, float]], float | None]:
    """(``tag``, the validation loss by default, by step; median training tokens/s) from every TensorBoard version
    of a run (a resumed run writes a new version; later versions win for the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curve: dict[int, float] = {}
    speeds: list[float] = []
    versions = sorted(run_root.glob("lightning_logs/*/version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        for events_file in sorted(version.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
            events.Reload()
            tags = events.Tags()["scalars"]
            if tag in tags:
                curve.update({e.step: e.value for e in events.Scalars(tag)})
            if "train/tokens_per_sec" in tags:
                speeds += [e.value for e in events.Scalars("train/tokens_per_sec")]
    return sorted(curve.items()), (statistics.median(speeds) if speeds else None)


def measure_checkpoint(checkpoint: Path, block_size: int, decode_steps: int = 16) -> dict:
    """Parameters, the cached decode step (batch 1, after a 32-token prompt) and state bytes per token after
    block_size tokens, from the trained checkpoint."""
    import torch

    from ltcx.models.state import map_state_tensors
    from ltcx.persist import load_language_model

    model, _ = load_language_model(checkpoint)
    backbone = model.backbone
    vocab = backbone.config.vocab_size  # every ltcx backbone has a config with its vocabulary
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        prompt = torch.randint(0, vocab, (1, min(32, block_size - decode_steps)), generator=generator)
        logits, state = backbone(prompt)
        times = []
        for _ in range(decode_steps):
            token = logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            logits, state = backbone(token, state)
            times.append(time.perf_counter() - start)
        _, state = backbone(torch.randint(0, vocab, (1, block_size), generator=generator))
        sizes: list[int] = []
        map_state_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return {
        "params": backbone.parameter_count(),
        "decode_ms_per_token": 1e3 * statistics.median(times),
        "state_bytes_per_token": sum(sizes) / block_size,
    }


def latest_checkpoint(run_root: Path) -> list[str]:
    """The last.ckpt of the latest run (its own checkpoints/<model>/version_N/) under ``run_root``."""
    from ltcx.persist import latest_last_checkpoint

    folders = sorted((run_root / "checkpoints").glob("*/")) if (run_root / "checkpoints").is_dir() else []
    return [path for folder in folders for path in latest_last_checkpoint(folder)]


def train_run(command: list[str], run_root: Path, label: str, max_steps: int) -> Path:
    """Run ``command`` (``run.py fit`` arguments, its logs and checkpoints under ``run_root``) to the end, continuing
    from the run's last.ckpt if an earlier attempt left one; output to ``run_root/run.log``. Returns the final
    last.ckpt; a failure stops the script with one line (rerunning it resumes)."""
    command = [sys.executable, str(ROOT / "run.py"), "fit", *command, "--trainer.default_root_dir", str(run_root)]
    checkpoints = latest_checkpoint(run_root)
    if checkpoints:
        command += ["--ckpt_path", str(checkpoints[0])]  # a stopped run continues where it stopped
    run_root.mkdir(parents=True, exist_ok=True)
    print(f"compare: {label}: training {max_steps} steps ({'resumed' if checkpoints else 'new'})", flush=True)
    with open(run_root / "run.log", "a") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        fail(f"{label} stopped with exit code {code}; see {run_root / 'run.log'} (rerun to resume)")
    checkpoints = latest_checkpoint(run_root)
    if not checkpoints:
        fail(f"{label} left no last.ckpt; see {run_root / 'run.log'}")
    return Path(checkpoints[-1])


def write_result(result_file: Path, result: dict) -> None:
    """``result`` as JSON, atomically: a run counts as done only once its result is whole."""
    temporary = result_file.with_suffix(".tmp")
    temporary.write_text(json.dumps(result, indent=2))
    os.replace(temporary, result_file)


def run_one(config: Path, model: str, seed: int, run_root: Path, args, extra: list[str]) -> dict:
    """Train one (config, seed) through the CLI unless it finished before; return its result."""
    result_file = run_root / "result.json"
    if result_file.is_file():
        print(f"compare: {model} seed {seed}: done before, skipped", flush=True)
        return json.loads(result_file.read_text())
    steps_per_eval = max(1, math.ceil(args.tokens / (args.batch_size * args.block_size) / args.evals))
    max_steps = steps_per_eval * args.evals
    command = [
        "--config", str(config), *extra,
        "--seed_everything", str(seed), "--data.seed", str(seed),
        "--data.batch_size", str(args.batch_size), "--data.block_size", str(args.block_size),
        "--trainer.max_steps", str(max_steps), "--trainer.val_check_interval", str(steps_per_eval),
        "--trainer.enable_progress_bar", "false",
    ]
    if args.warmup_steps is not None:
        command += ["--model.warmup_steps", str(args.warmup_steps)]
    checkpoint = train_run(command, run_root, f"{model} seed {seed}", max_steps)
    curve, tokens_per_sec = read_logs(run_root)
    if not curve:
        fail(f"{model} seed {seed} logged no validation loss; see {run_root / 'run.log'}")
    tokens_per_step = args.batch_size * args.block_size
    result = {
        "model": model, "seed": seed, "config": str(config), "steps": max_steps,
        "tokens": max_steps * tokens_per_step, "val_loss": curve[-1][1],
        # Lightning logs a validation inside fit one step early (before its step counter moves past the
        # optimizer step just taken): the loss logged at step s was measured after s + 1 steps.
        "curve": [[(step + 1) * tokens_per_step, loss] for step, loss in curve],
        "tokens_per_sec": tokens_per_sec, **measure_checkpoint(checkpoint, args.block_size),
    }
    write_result(result_file, result)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="results go to <out>/<name>/")
    parser.add_argument("--configs", nargs="+", required=True,
                        help="model YAMLs or catalogued architecture names (gpt, ltc, ...); a model is named by the "
                             "file stem")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--baseline", default=None, help="model (file stem) the others are compared to")
    parser.add_argument("--tokens", type=int, required=True, help="training tokens per run")
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--block_size", type=int, required=True)
    parser.add_argument("--evals", type=int, default=8, help="validations per run (the last one is at the end)")
    parser.add_argument("--warmup_steps", type=int, default=None, help="override every config's warmup")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    from ltcx.models.catalog import CATALOG, config_path

    # a catalogued architecture's name stands for its YAML (configs/<name>.yaml)
    configs = [config_path(c) if c in CATALOG and not Path(c).is_file() else Path(c).resolve() for c in args.configs]
    for config in configs:
        if not config.is_file():
            fail(f"config '{config}' does not exist: pass --configs model YAML files, e.g. configs/gpt.yaml, or "
                 f"architecture names ({', '.join(sorted(CATALOG))})")
    names = [c.stem for c in configs]
    if len(set(names)) != len(names):
        fail(f"two configs share a file name ({', '.join(names)}): models are named by it")
    if args.baseline is not None and args.baseline not in names:
        fail(f"--baseline {args.baseline} is not one of the models ({', '.join(names)})")
    out = (args.out / args.name).resolve()
    runs = [
        run_one(config, name, seed, out / "runs" / name / f"seed{seed}", args, extra)
        for seed in args.seeds
        for config, name in zip(configs, names)
    ]
    summary = {"baseline": args.baseline, "tokens": runs[0]["tokens"], "models": summarize(runs, args.baseline),
               "runs": runs, "command": " ".join(["scripts/compare.py", *sys.argv[1:]])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(summary["models"], args.baseline)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"compare: wrote {out / 'summary.json'} and {out / 'summary.md'}")


if __name__ == "__main__":
    main()
