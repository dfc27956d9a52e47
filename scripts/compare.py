"""A controlled, multi-seed comparison of architectures: same data, same tokens, same recipe, paired seeds.

    python scripts/compare.py --name quick --configs configs/gpt.yaml configs/ltc.yaml configs/xlstm.yaml \\
        --seeds 0 1 2 --baseline gpt --tokens 300000 --batch_size 8 --block_size 128 -- --data.path sample
    python scripts/plot_results.py results/quick

Each (config, seed) is an ordinary `run.py fit` in its own folder results/<name>/runs/<model>/seed<S>
(TensorBoard logs under lightning_logs/, checkpoints under checkpoints/), with `--seed_everything S` and
`--data.seed S`, so every model of one seed sees the same blocks in the same order. Arguments after `--` go
to every run. A comparison that was stopped resumes where it stopped: finished runs (a `result.json`) are
not redone, and an unfinished one continues from its `last.ckpt`.

Once every run has finished, one timing pass in this process times the models against each other: one trained
checkpoint per model (its lowest seed's), training steps at the comparison's batch and block and cached decode steps
(batch 1) round after round, the models in turn, so a load that comes and goes on a shared machine slows all alike
and the ratios measure the models. Timing each run inside its own training measured the machine's load at that
hour instead. The pass records the load average while it runs; above the usable core count the speed columns are
marked unreliable. Its result (timing.json) is reused while the checkpoints it timed are unchanged; --retime redoes
it (e.g. on a quieter machine).

Writes results/<name>/summary.json and summary.md: the final validation loss of every run, mean +- 95% confidence
interval per model, the paired difference to the baseline (per seed, then mean +- 95% interval over seeds, and the
paired t-test's p-value), parameters, the state or
KV-cache bytes per token, and from the timing pass training tokens/s and the cached decode step (ms per token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fail(message: str) -> None:
    print(f"compare: error: {message}", file=sys.stderr)
    sys.exit(2)


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (a count, a size), refused in one line before any run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1: pass an integer >= 1")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line (``compare: error: argument --evals: 0 is below 1 ...``), no usage page."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (see --help)")


# ----------------------------------------------------------------------------- statistics


def summarize(runs: list[dict], baseline: str | None, speeds: dict[str, dict] | None = None) -> dict:
    """Per-model statistics from the runs ({"model", "seed", "val_loss", ...}) and the timing pass's ``speeds``
    ({model: {"tokens_per_sec", "decode_ms_per_token"}}; a speed a run recorded itself is ignored: it measured the
    load of its hour).

    The paired difference of a model is computed seed by seed against the baseline run of the same seed
    (same data order), then averaged: its sd and 95% interval measure how consistent the gap is, free of the
    seed-to-seed variation both models share, and its p-value (paired t-test) whether the seeds tell it from
    noise (``ltcx.study.stats``).
    """
    from ltcx.study.stats import mean_interval, paired_difference

    models: dict[str, list[dict]] = {}
    for run in runs:
        models.setdefault(run["model"], []).append(run)
    base_by_seed = {run["seed"]: run["val_loss"] for run in models.get(baseline, [])}
    summary = {}
    for model, model_runs in models.items():
        loss = mean_interval([run["val_loss"] for run in model_runs])
        entry = {
            "seeds": sorted(run["seed"] for run in model_runs),
            "val_loss_mean": loss.mean,
            "val_loss_sd": loss.sd,
            "val_loss_ci95": loss.half_width,
        }
        for key in ("params", "state_bytes_per_token"):
            values = [run[key] for run in model_runs if run.get(key) is not None]
            entry[key] = statistics.fmean(values) if values else None
        for key in SPEED_KEYS:
            entry[key] = (speeds or {}).get(model, {}).get(key)
        paired = [(run["val_loss"], base_by_seed[run["seed"]]) for run in model_runs if run["seed"] in base_by_seed]
        if baseline is not None and model != baseline and paired:
            diff = paired_difference([value for value, _ in paired], [base for _, base in paired])
            entry["diff_vs_baseline_mean"], entry["diff_vs_baseline_sd"] = diff.interval.mean, diff.interval.sd
            entry["diff_vs_baseline_ci95"], entry["diff_vs_baseline_p"] = diff.interval.half_width, diff.p_value
            entry["paired_seeds"] = len(paired)
        summary[model] = entry
    return summary


def markdown_table(summary: dict, baseline: str | None, timing: dict | None = None) -> str:
    """The table of ``summary`` (from ``summarize``) and, with the timing pass's record, a note on how the speed
    columns were measured (and a warning in their headers when the load made them unreliable)."""

    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    mark = " (unreliable)" if timing and timing["speed_unreliable"] else ""
    rows = [
        f"| model | seeds | val loss (mean +- 95% CI) | vs {baseline or 'baseline'} (paired mean +- 95% CI) | p | "
        f"parameters | train tokens/s{mark} | decode ms/token{mark} | state bytes/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, s in sorted(summary.items(), key=lambda item: item[1]["val_loss_mean"]):
        loss = f"{s['val_loss_mean']:.4f} +- {number(s.get('val_loss_ci95'), '.4f')}"
        diff = p_value = "-"
        if "diff_vs_baseline_mean" in s:
            diff = f"{s['diff_vs_baseline_mean']:+.4f} +- {number(s.get('diff_vs_baseline_ci95'), '.4f')}"
            p_value = number(s.get("diff_vs_baseline_p"), ".3g")
        rows.append(
            f"| {model} | {len(s['seeds'])} | {loss} | {diff} | {p_value} | {number(s['params'], ',.0f')} | "
            f"{number(s['tokens_per_sec'], ',.0f')} | {number(s['decode_ms_per_token'], '.1f')} | "
            f"{number(s['state_bytes_per_token'], ',.0f')} |"
        )
    if timing:
        rows += ["", timing_note(timing)]
    return "\n".join(rows) + "\n"


def timing_note(timing: dict) -> str:
    """One paragraph: how the speed columns were timed and, when the load average passed the core count, that
    they are unreliable."""
    note = (f"Speed columns: one timing pass after training, in one process on {timing['device']} "
            f"({timing['precision']}), {timing['rounds']} interleaved rounds over one checkpoint per model; training "
            f"at batch {timing['batch_size']} x {timing['block_size']} tokens, decode at batch 1 after "
            f"{timing['decode_position']} tokens. Load average (1 min) up to {timing['load_average_max']:.1f} on "
            f"{timing['usable_cores']} usable cores.")
    if timing["speed_unreliable"]:
        note += (f"\n\n**The speed columns are unreliable**: the load average ({timing['load_average_max']:.1f}) "
                 f"exceeded the {timing['usable_cores']} usable cores while they were timed, so other jobs took "
                 "turns on the cores; rerun with --retime on a quieter machine.")
    return note


# ----------------------------------------------------------------------------- one run


def read_logs(run_root: Path, tag: str = "val/loss") -> list[tuple[int, float]]:
    """``tag`` (the validation loss by default) by step from every TensorBoard version of a run (a resumed run writes
    a new version; later versions win for the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curve: dict[int, float] = {}
    versions = sorted(run_root.glob("lightning_logs/*/version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        for events_file in sorted(version.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
            events.Reload()
            if tag in events.Tags()["scalars"]:
                curve.update({e.step: e.value for e in events.Scalars(tag)})
    return sorted(curve.items())


def measure_checkpoint(checkpoint: Path, block_size: int) -> dict:
    """Parameters and state bytes per token after block_size tokens (batch 1), from the trained checkpoint: the
    figures no load changes (speeds come from the timing pass)."""
    import torch

    from ltcx.lm import LanguageModel
    from ltcx.models.state import map_state_tensors
    from ltcx.persist import load_language_model

    model, _ = load_language_model(checkpoint, model_class=LanguageModel)
    backbone = model.backbone
    vocab = backbone.config.vocab_size  # every ltcx backbone has a config with its vocabulary
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, state = backbone(torch.randint(0, vocab, (1, block_size), generator=generator))
        sizes: list[int] = []
        map_state_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return {"params": backbone.parameter_count(), "state_bytes_per_token": sum(sizes) / block_size}


# ----------------------------------------------------------------------------- the timing pass

SPEED_KEYS = ("tokens_per_sec", "decode_ms_per_token")


def interleaved_timings(backbones: dict, batch_size: int, block_size: int, device, rounds: int,
                        autocast_factory=contextlib.nullcontext) -> tuple[dict[str, dict], list[float]]:
    """({model: {"tokens_per_sec", "decode_ms_per_token"}}, the 1-minute load averages seen during the pass).

    In every round each backbone takes one training step (AdamW, batch_size x block_size random tokens) and then
    four cached decode steps (batch 1, after block_size // 2 tokens), the backbones in turn with the first one
    rotating, so a load that drifts hits every model alike; each figure is the median of its samples. One untimed
    step of each kind first (allocations, lazy initialisation). The backbones' weights change (they are copies
    loaded for timing only). ``autocast_factory()`` makes the context the forward passes run in.
    """
    import torch

    from ltcx.throughput import prefilled_state, timed, training_step

    generator = torch.Generator().manual_seed(0)
    train_steps, decode_steps = {}, {}
    for name, backbone in backbones.items():
        vocab = backbone.config.vocab_size  # every ltcx backbone has a config with its vocabulary
        idx = torch.randint(0, vocab, (batch_size, block_size + 1), generator=generator).to(device)
        optimizer = torch.optim.AdamW(backbone.parameters(), lr=1e-4)
        train_steps[name] = training_step(lambda i, b=backbone: b(i)[0], idx, optimizer, autocast_factory())
        with torch.no_grad(), autocast_factory():
            token, state = prefilled_state(backbone.eval(), 1, block_size // 2, device)
        decode_steps[name] = lambda b=backbone, t=token, s=state: b(t, s)

    def train(name: str) -> float:
        backbones[name].train()
        return timed(train_steps[name], device, repeats=1, warmup=0)

    def decode(name: str) -> float:
        backbones[name].eval()
        with torch.no_grad(), autocast_factory():
            return timed(decode_steps[name], device, repeats=1, warmup=0)

    names = list(backbones)
    for name in names:  # warm-up
        train(name)
        decode(name)
    train_s = {name: [] for name in names}
    decode_s = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    for round_index in range(max(1, rounds)):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            train_s[name].append(train(name))
        for _ in range(4):  # a decode step is short: more samples
            for name in order:
                decode_s[name].append(decode(name))
        loads.append(os.getloadavg()[0])
    speeds = {name: {"tokens_per_sec": batch_size * block_size / statistics.median(train_s[name]),
                     "decode_ms_per_token": 1e3 * statistics.median(decode_s[name])} for name in names}
    return speeds, loads


def timing_pass(out: Path, checkpoints: dict[str, Path], args) -> dict:
    """Time the models of ``checkpoints`` ({model: trained checkpoint}) against each other (``interleaved_timings``)
    and record it in out/timing.json, or reuse that record when it timed the same checkpoint files at the same
    settings (and not --retime). An interrupted pass leaves no record and is redone whole: its ratios must come
    from one process."""
    import torch

    from ltcx.cli.threads import usable_cores
    from ltcx.lm import LanguageModel
    from ltcx.persist import load_language_model

    device = torch.device(args.timing_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # a GPU trains in the recipe's bf16-mixed, so it is timed in bf16 autocast; a CPU in float32
    bf16 = device.type == "cuda"
    settings = {
        "device": str(device), "precision": "bf16 autocast" if bf16 else "float32", "rounds": args.timing_rounds,
        "batch_size": args.batch_size, "block_size": args.block_size, "decode_position": args.block_size // 2,
        "checkpoints": {model: [str(path), path.stat().st_mtime_ns] for model, path in sorted(checkpoints.items())},
    }
    timing_file = out / "timing.json"
    if timing_file.is_file() and not args.retime:
        stored = json.loads(timing_file.read_text())
        if {key: stored.get(key) for key in settings} == settings:
            print("compare: timing pass: done before for these checkpoints, reused (--retime to redo it)", flush=True)
            return stored
    print(f"compare: timing pass: {len(checkpoints)} models interleaved, {args.timing_rounds} rounds on {device}",
          flush=True)
    backbones = {model: load_language_model(path, model_class=LanguageModel, map_location=device)[0].backbone.to(device)
                 for model, path in checkpoints.items()}
    speeds, loads = interleaved_timings(
        backbones, args.batch_size, args.block_size, device, args.timing_rounds,
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext,
    )
    cores = usable_cores()
    timing = {**settings, "models": speeds, "load_averages": loads, "load_average_max": max(loads),
              "usable_cores": cores, "speed_unreliable": max(loads) > cores}
    temporary = timing_file.with_suffix(".tmp")
    temporary.write_text(json.dumps(timing, indent=2))
    os.replace(temporary, timing_file)
    return timing


def latest_checkpoint(run_root: Path) -> list[str]:
    """The last.ckpt of the latest run (its own checkpoints/<model>/version_N/) under ``run_root``."""
    from ltcx.persist import latest_last_checkpoint

    folders = sorted((run_root / "checkpoints").glob("*/")) if (run_root / "checkpoints").is_dir() else []
    return [path for folder in folders for path in latest_last_checkpoint(folder)]


def train_run(command: list[str], run_root: Path, label: str, max_steps: int) -> Path:
    """Run ``command`` (``run.py fit`` arguments, its logs and checkpoints under ``run_root``) to the end, continuing
    from the run's last.ckpt if an earlier attempt left one; output, with ltcx's plain progress lines, to
    ``run_root/run.log``. Returns the final last.ckpt; a failure stops the script with one line (rerunning it
    resumes)."""
    command = [sys.executable, str(ROOT / "run.py"), "fit", *command, "--trainer.default_root_dir", str(run_root)]
    checkpoints = latest_checkpoint(run_root)
    if checkpoints:
        command += ["--ckpt_path", str(checkpoints[0])]  # a stopped run continues where it stopped
    run_root.mkdir(parents=True, exist_ok=True)
    print(f"{label}: training {max_steps} steps ({'resumed' if checkpoints else 'new'})", flush=True)
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
    ]
    if args.warmup_steps is not None:
        command += ["--model.warmup_steps", str(args.warmup_steps)]
    checkpoint = train_run(command, run_root, f"{model} seed {seed}", max_steps)
    curve = read_logs(run_root)
    if not curve:
        fail(f"{model} seed {seed} logged no validation loss; see {run_root / 'run.log'}")
    tokens_per_step = args.batch_size * args.block_size
    result = {
        "model": model, "seed": seed, "config": str(config), "steps": max_steps,
        "tokens": max_steps * tokens_per_step, "val_loss": curve[-1][1],
        # ltcx logs the validation after optimizer step s at step s (LanguageModel logs "step" with it)
        "curve": [[step * tokens_per_step, loss] for step, loss in curve],
        **measure_checkpoint(checkpoint, args.block_size),
    }
    write_result(result_file, result)
    return result


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, those after ``--``, which go to every run)."""
    if "--" not in argv:
        return list(argv), []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def main(argv: list[str] | None = None) -> None:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="results go to <out>/<name>/")
    parser.add_argument("--configs", nargs="+", required=True,
                        help="model YAMLs or catalogued architecture names (gpt, ltc, ...); a model is named by the "
                             "file stem")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--baseline", default=None, help="model (file stem) the others are compared to")
    parser.add_argument("--tokens", type=at_least_one, required=True, help="training tokens per run")
    parser.add_argument("--batch_size", type=at_least_one, required=True)
    parser.add_argument("--block_size", type=at_least_one, required=True)
    parser.add_argument("--evals", type=at_least_one, default=8,
                        help="validations per run (the last one is at the end)")
    parser.add_argument("--warmup_steps", type=int, default=None, help="override every config's warmup")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--timing_rounds", type=int, default=5,
                        help="rounds of the timing pass (each: one training step and four decode steps per model); "
                             "0 skips it (no speed columns)")
    parser.add_argument("--timing_device", default=None, help="device of the timing pass (default: cuda if any)")
    parser.add_argument("--retime", action="store_true", help="redo the timing pass even if it was done before")
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
    timing = None
    if args.timing_rounds > 0:
        checkpoints = {}  # model -> the checkpoint of its lowest seed that has one: the architecture sets the speed
        for name in names:
            found = [path for seed in sorted(args.seeds)
                     for path in latest_checkpoint(out / "runs" / name / f"seed{seed}")[-1:]]
            if not found:
                fail(f"no last.ckpt is left under {out / 'runs' / name} for the timing pass: rerun one of its seeds "
                     "(delete its result.json) or pass --timing_rounds 0 to leave the speed columns empty")
            checkpoints[name] = Path(found[0])
        timing = timing_pass(out, checkpoints, args)
    summary = {"baseline": args.baseline, "tokens": runs[0]["tokens"],
               "models": summarize(runs, args.baseline, timing and timing["models"]),
               # a result.json of an older compare.py holds the run's own timings: they measured the load, not kept
               "runs": [{key: value for key, value in run.items() if key not in SPEED_KEYS} for run in runs],
               "speed_unreliable": timing and timing["speed_unreliable"], "timing": timing,
               "command": " ".join(["scripts/compare.py", *sys.argv[1:]])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(summary["models"], args.baseline, timing)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"compare: wrote {out / 'summary.json'} and {out / 'summary.md'}")


if __name__ == "__main__":
    main()
