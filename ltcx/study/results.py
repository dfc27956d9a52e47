"""What a study's runs leave behind, read back: TensorBoard's validation curves, the last checkpoint and its figures,
a log's last line, the learning rate each shape tunes to, and the summary and the report written from all of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from ltcx.errors import ConfigError, LtcxError
from ltcx.study.launch import Failed, Job, StudyFailed, failure, finished
from ltcx.study.plan import Run, Shape, make_run
from ltcx.study.records import DamagedRecord, read_spec_record
from ltcx.study.spec import StudySpec

__all__ = ["check_folder", "extension_runs", "grid_ratio", "last_line", "latest_checkpoint", "measure", "rank_key",
           "read_logs", "report_from_folder", "select_learning_rates", "write_summary"]


# ----------------------------------------------------------------------------- one run


def read_logs(root: Path, prefix: str = "val/") -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag starting with ``prefix`` by step, from every TensorBoard version under ``root`` (a resumed run
    writes a new version; a later version wins for the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves: dict[str, dict[int, float]] = {}
    versions = sorted(root.glob("lightning_logs/*/version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        for events_file in sorted(version.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})
            events.Reload()
            for tag in events.Tags()["scalars"]:
                if tag.startswith(prefix):
                    curves.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return {tag: sorted(curve.items()) for tag, curve in sorted(curves.items())}


def latest_checkpoint(root: Path) -> Path | None:
    """The last.ckpt of the latest run under ``root/checkpoints/<arch>/``."""
    from ltcx.persist.runs import latest_last_checkpoint

    found = [path for folder in sorted((root / "checkpoints").glob("*/")) for path in latest_last_checkpoint(folder)]
    return Path(found[-1]) if found else None


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() \
        else []
    return lines[-1] if lines else "(the log is empty)"


def measure(checkpoint: Path, seq_len: int) -> dict:
    """The trained model's non-embedding parameters, training FLOPs per token and state bytes after ``seq_len``
    tokens (batch 1, its dtype): the figures the ladder and the tables use."""
    from ltcx.lm import LanguageModel
    from ltcx.persist import load_language_model
    from ltcx.study.budget import non_embedding_parameters

    backbone = load_language_model(checkpoint, model_class=LanguageModel)[0].backbone
    return {"params": non_embedding_parameters(backbone), "all_params": backbone.parameter_count(),
            "flops_per_token": float(backbone.flops_per_token(seq_len)),
            "state_bytes": int(backbone.state_bytes(seq_len))}


# ----------------------------------------------------------------------------- selection


def rank_key(spec: StudySpec, result: dict) -> tuple:
    """Smaller is better: diverged or non-finite last, then the metric in its direction, then the validation loss,
    then the smaller rate."""
    value = result.get("val", {}).get(f"val/{spec.metric}")
    if result.get("diverged") or value is None or not math.isfinite(value):
        return (1, 0.0, 0.0, result["lr"])
    loss = result["val"].get("val/loss", math.inf)
    return (0, -value if spec.higher_is_better else value, loss if math.isfinite(loss) else math.inf, result["lr"])


def grid_ratio(spec: StudySpec) -> float | None:
    """The grid's own step: the ratio of its neighbours (their geometric mean where uneven); None for one rate."""
    grid = sorted(spec.learning_rates)
    return (grid[-1] / grid[0]) ** (1 / (len(grid) - 1)) if len(grid) > 1 else None


def select_learning_rates(spec: StudySpec, tuning: list[dict]) -> dict[tuple[str, str], dict]:
    """(arch, size label) -> {"lr", "edge", "tried", "added", "next", "grid": [{lr, value, diverged}]}: the best rate
    of the tuning seed by the validation split alone, among the rates tried for it; ``edge`` when it is the smallest
    or largest of several; ``added``: the rates tried beyond the spec's grid; ``next``: the rate to try next (the
    grid's ratio outward from the edge), None when the choice is interior or ``lr_extend`` rates were added."""
    chosen: dict[tuple[str, str], dict] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for result in tuning:
        groups.setdefault((result["arch"], result["size_label"]), []).append(result)
    ratio = grid_ratio(spec)
    for key, results in groups.items():
        best = min(results, key=lambda r: rank_key(spec, r))
        tried = sorted({r["lr"] for r in results})
        edge = len(tried) > 1 and best["lr"] in (tried[0], tried[-1])
        added = [lr for lr in tried if lr not in spec.learning_rates]
        step = None
        if edge and ratio and len(added) < spec.lr_extend:  # k steps of the ratio past the grid's end, rounded
            up = best["lr"] == tried[-1]
            beyond = 1 + sum(lr > max(spec.learning_rates) if up else lr < min(spec.learning_rates) for lr in added)
            end = max(spec.learning_rates) if up else min(spec.learning_rates)
            step = float(f"{end * ratio ** (beyond if up else -beyond):.3g}")
        chosen[key] = {"lr": best["lr"], "edge": edge, "all_diverged": rank_key(spec, best)[0] == 1,
                       "tried": tried, "added": added, "next": step,
                       "grid": [{"lr": r["lr"], "value": r.get("val", {}).get(f"val/{spec.metric}"),
                                 "diverged": r.get("diverged", False)} for r in sorted(results, key=lambda r: r["lr"])]}
    return chosen


def extension_runs(spec: StudySpec, shapes: list[Shape], chosen: dict, held: set) -> list[Run]:
    """The next rate of each shape whose choice is at the grid's edge (``chosen[...]["next"]``), on the tuning seed;
    none for the shapes in ``held`` (a tuning run failed or is missing there)."""
    keys = [(shape, (shape.arch, shape.label)) for shape in shapes]
    return [make_run(spec, shape, chosen[key]["next"], spec.tune_seed) for shape, key in keys
            if key in chosen and key not in held and chosen[key]["next"] is not None]


# ----------------------------------------------------------------------------- the study


def check_folder(spec: StudySpec, out: Path) -> None:
    """A results folder holds one study: a rerun with another spec under the same name is one line, before
    anything runs."""
    stored = out / "spec.json"
    if stored.is_file():
        before = {"lr_extend": 0, **read_spec_record(stored)}  # a study from before lr_extend: its grid as given
        now = json.loads(json.dumps(spec.defining()))
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"{out} holds a study with another '{changed[0]}' ({before.get(changed[0])!r}, now "
                              f"{now.get(changed[0])!r}): give the study another name (--name) or restore the spec")


def report_from_folder(spec: StudySpec, out: Path, shapes: list[Shape], tuning_runs: list[Run],
                       say: Callable[[str], None], retime: bool = False) -> dict:
    """The summary of the runs finished so far (``--report_only``): every shape, its rate chosen from the rates
    tried (the grid and its extensions), its seeds that were tested. A run not finished is named (said, and listed in
    the summary: its row, fit and multiplier marked incomplete); a run whose files are damaged too, and after the
    summary ``StudyFailed``."""
    if not (out / "spec.json").is_file():
        raise LtcxError(f"{out} holds no study yet: run `ltcx study` with this spec first")
    damaged: list[Failed] = []
    missing: list[Run] = []
    held: set[tuple[str, str]] = set()

    def done(job: Job) -> dict | None:
        try:
            result = finished(spec, job, out)
        except DamagedRecord as error:
            damaged.append(failure(job, error))
            say(f"{job.run.label}: DAMAGED: {error}")
            result = None
        else:
            if result is None:
                missing.append(job.run)
                say(f"{job.run.label}: missing (not finished{' and tested' if job.test else ''})")
        if result is None:
            held.add((job.run.arch, job.run.shape.label))
        return result

    tuning = [r for r in (done(Job(run)) for run in tuning_runs) if r is not None]
    chosen = select_learning_rates(spec, tuning)
    while more := extension_runs(spec, shapes, chosen, held):  # the rates the study added, as it added them
        tuning += [r for r in (done(Job(run)) for run in more) if r is not None]
        chosen = select_learning_rates(spec, tuning)
    complete = {key: pick for key, pick in chosen.items() if key not in held}
    final_runs = [make_run(spec, shape, complete[(shape.arch, shape.label)]["lr"], seed) for seed in spec.seeds
                  for shape in shapes if (shape.arch, shape.label) in complete]
    final = [r for r in (done(Job(run, test=True)) for run in final_runs) if r is not None]
    if not final:
        if damaged:
            more = f" (and {len(damaged) - 1} more runs damaged)" if len(damaged) > 1 else ""
            raise LtcxError(f"{damaged[0].line}{more}; no other run is finished and tested: nothing to report")
        raise LtcxError(f"{out}: no run is finished and tested yet: nothing to report (run `ltcx study` first)")
    for result in final:
        result.setdefault("test", {})
    summary = write_summary(spec, out, tuning, final, complete, say, retime, left_out=damaged, missing=missing)
    if damaged:
        raise StudyFailed(damaged)
    return summary


def write_summary(spec: StudySpec, out: Path, tuning: list[dict], final: list[dict], chosen: dict,
                  say: Callable[[str], None], retime: bool = False, left_out: list[Failed] = (),
                  missing: list[Run] = ()) -> dict:
    """The timing pass (``ltcx/study/timing.py``: one checkpoint per row, its lowest seed's, unless
    ``timing_rounds`` is 0), then ``summary.json``, ``summary.md``, the figures and ``report.html``; ``left_out``:
    the runs that failed or whose files are damaged, ``missing`` those not finished, each listed in it and marking
    what needs it incomplete."""
    from ltcx.study.report import summarize, write_report

    timing = None
    if spec.timing_rounds:
        from ltcx.study.timing import timing_pass

        checkpoints: dict[str, tuple[Path, int]] = {}
        for result in sorted(final, key=lambda r: r["seed"]):
            key = f"{result['arch']} {result['size_label']}"
            if not result.get("diverged") and result.get("checkpoint") and key not in checkpoints:
                block = int(result.get("cell", {}).get("block_size", spec.block_size))
                checkpoints[key] = (Path(result["checkpoint"]), block)
        if checkpoints:
            timing = timing_pass(out, checkpoints, spec.batch_size, spec.timing_rounds, retime, say)
    absent = [_absent(f.job.run, out, "damaged" if f.damaged else "failed", f.line) for f in left_out]
    absent += [_absent(run, out, "missing", "not finished: rerun the same `ltcx study` command") for run in missing]
    if absent:
        say(f"study {spec.name}: {len(absent)} runs missing or failed, their rows marked incomplete: "
            + "; ".join(f"{e['run']} ({e['why']})" for e in absent))
    summary = summarize(spec, tuning, final, chosen, timing, absent)
    written = write_report(summary, out)
    say(f"study {spec.name}: wrote {', '.join(str(p.relative_to(out)) for p in written)} in {out}")
    return summary


def _absent(run: Run, out: Path, why: str, line: str) -> dict:
    """A run the summary lacks, as it lists it: its label, folder, why (failed, damaged, missing), its log's line,
    and the row it belongs to."""
    return {"run": run.label, "folder": str(run.folder(out)), "why": why, "damaged": why == "damaged", "line": line,
            "arch": run.arch, "size_label": run.shape.label, "size": run.shape.size, "cell": dict(run.shape.cell),
            "lr": run.lr, "seed": run.seed}
