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

__all__ = ["check_folder", "last_line", "latest_checkpoint", "measure", "rank_key", "read_logs", "report_from_folder",
           "select_learning_rates", "write_summary"]


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


def select_learning_rates(spec: StudySpec, tuning: list[dict]) -> dict[tuple[str, str], dict]:
    """(arch, size label) -> {"lr", "edge", "grid": [{lr, value, diverged}]}: the best rate of the tuning seed by the
    validation split alone; ``edge`` when it is the grid's smallest or largest (of several): widen the grid there."""
    chosen: dict[tuple[str, str], dict] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for result in tuning:
        groups.setdefault((result["arch"], result["size_label"]), []).append(result)
    grid = sorted(spec.learning_rates)
    for key, results in groups.items():
        best = min(results, key=lambda r: rank_key(spec, r))
        edge = len(grid) > 1 and best["lr"] in (grid[0], grid[-1])
        chosen[key] = {"lr": best["lr"], "edge": edge, "all_diverged": rank_key(spec, best)[0] == 1,
                       "grid": [{"lr": r["lr"], "value": r.get("val", {}).get(f"val/{spec.metric}"),
                                 "diverged": r.get("diverged", False)} for r in sorted(results, key=lambda r: r["lr"])]}
    return chosen


# ----------------------------------------------------------------------------- the study


def check_folder(spec: StudySpec, out: Path) -> None:
    """A results folder holds one study: a rerun with another spec under the same name is one line, before
    anything runs."""
    stored = out / "spec.json"
    if stored.is_file():
        before = read_spec_record(stored)
        now = json.loads(json.dumps(spec.defining()))
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"{out} holds a study with another '{changed[0]}' ({before.get(changed[0])!r}, now "
                              f"{now.get(changed[0])!r}): give the study another name (--name) or restore the spec")


def report_from_folder(spec: StudySpec, out: Path, shapes: list[Shape], tuning_runs: list[Run],
                        say: Callable[[str], None], retime: bool = False) -> dict:
    """The summary of the runs finished so far (``--report_only``): shapes whose tuning grid is complete, their
    seeds that were tested. A run whose files are damaged is said, listed in the summary and, after it,
    ``StudyFailed``."""
    if not (out / "spec.json").is_file():
        raise LtcxError(f"{out} holds no study yet: run `ltcx study` with this spec first")
    damaged: list[Failed] = []

    def done(job: Job) -> dict | None:
        try:
            return finished(spec, job, out)
        except DamagedRecord as error:
            damaged.append(failure(job, error))
            say(f"{job.run.label}: DAMAGED: {error}")
            return None

    tuning = [r for r in (done(Job(run)) for run in tuning_runs) if r is not None]
    chosen = select_learning_rates(spec, tuning)
    complete = {key for key in chosen
                if sum((r["arch"], r["size_label"]) == key for r in tuning) == len(spec.learning_rates)}
    final = [r for r in (done(Job(make_run(spec, shape, chosen[(shape.arch, shape.label)]["lr"], seed), test=True))
                         for seed in spec.seeds for shape in shapes if (shape.arch, shape.label) in complete)
             if r is not None]
    if not final:
        if damaged:
            more = f" (and {len(damaged) - 1} more runs damaged)" if len(damaged) > 1 else ""
            raise LtcxError(f"{damaged[0].line}{more}; no other run is finished and tested: nothing to report")
        raise LtcxError(f"{out}: no run is finished and tested yet: nothing to report (run `ltcx study` first)")
    for result in final:
        result.setdefault("test", {})
    summary = write_summary(spec, out, tuning, final, {k: v for k, v in chosen.items() if k in complete}, say,
                            retime, left_out=damaged)
    if damaged:
        raise StudyFailed(damaged)
    return summary


def write_summary(spec: StudySpec, out: Path, tuning: list[dict], final: list[dict], chosen: dict,
                  say: Callable[[str], None], retime: bool = False, left_out: list[Failed] = ()) -> dict:
    """The timing pass (``ltcx/study/timing.py``: one checkpoint per row, its lowest seed's, unless
    ``timing_rounds`` is 0), then ``summary.json``, ``summary.md``, the figures and ``report.html``; ``left_out``:
    the runs that failed or whose files are damaged, listed in it."""
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
    missing = [{"run": f.job.run.label, "folder": str(f.job.run.folder(out)), "damaged": f.damaged, "line": f.line}
               for f in left_out]
    summary = summarize(spec, tuning, final, chosen, timing, missing)
    written = write_report(summary, out)
    say(f"study {spec.name}: wrote {', '.join(str(p.relative_to(out)) for p in written)} in {out}")
    return summary
