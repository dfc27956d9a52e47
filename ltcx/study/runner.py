"""The study runner behind ``ltcx study``: a spec (``ltcx/study/spec.py``) becomes runs, phase by phase.

1. **Plan**: each architecture's shape at each size (``size_by: width``: the catalogue's scaling rule at ``layers``;
   ``params``: the baseline at that many non-embedding parameters, the others matched to its ``match`` figure by
   ``ltcx/study/budget.py``; ``config``: the YAML as it is), and each run's steps.
2. **Tune**: every learning rate of the grid on the tuning seed; the best of each (architecture, size) by the final
   ``val/<metric>`` (a run stopped on a non-finite loss ranks last). Where the best is at the grid's edge, the next
   rate outward (the grid's own ratio) is tried and the choice made again, up to ``lr_extend`` rates.
3. **Seeds**: every seed at the chosen rate (the tuning seed's run is that one), each seed reading the same batches
   in the same order for every architecture (``--seed_everything S --data.seed S``).
4. **Test**: each run of phase 3 on the data's test split, which played no part in choosing: in its own fit process
   where it trains in phase 3 (``--test_after_fit``), else ``ltcx test`` of its checkpoint (the tuning seed's run);
   its ``test_metrics.json`` is what the report shows.

Each run is an ordinary ``ltcx fit`` process in its own folder (``ltcx/study/processes.py``: a killed study rerun
continues where it stopped). Where a phase's runs train (one after another, a run per GPU, a SLURM job per run) is
the launcher's (``ltcx/study/launch.py``): each run trains under its claim, and a failed one is reported while the
others finish (``StudyFailed`` after the report, which lists it; so does a finished run whose files are damaged,
``ltcx/study/records.py``). The shapes and steps are ``plan``'s, the chosen rates, summary and
report ``results``'.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ltcx.study.launch import Job, StudyFailed, StudyStopped, make_launcher
from ltcx.study.plan import composed_configs, make_run, plan_shapes
from ltcx.study.processes import execute_job, print_plan
from ltcx.study.report import write_json
from ltcx.study.results import check_folder, extension_runs, report_from_folder, select_learning_rates, write_summary
from ltcx.study.spec import StudySpec

__all__ = ["StudyFailed", "StudyStopped", "run_study"]


def run_study(spec: StudySpec, out: Path, dry_run: bool = False, say: Callable[[str], None] = print,
              retime: bool = False, launcher: dict | None = None, report_only: bool = False) -> dict | None:
    """Plan, tune, train every seed and test it, then time and write the summary and the report
    (``write_summary``); with ``dry_run`` print what would run where and run nothing; with ``report_only`` write the
    report from the runs finished so far and run nothing. ``launcher``: the command line's launcher options over the
    spec's (``ltcx/study/launch.py``). Returns the summary; raises ``StudyFailed`` after it when runs failed."""
    check_folder(spec, out)
    composed_configs(spec)  # a bad path is one line now, not after the first run
    shapes = plan_shapes(spec)
    tuning_runs = [make_run(spec, shape, lr, spec.tune_seed) for shape in shapes for lr in spec.learning_rates]
    launch = make_launcher(spec, out, say, execute_job, launcher)
    if dry_run:
        print_plan(spec, out, shapes, tuning_runs, say, launch)
        return None
    if report_only:
        return report_from_folder(spec, out, shapes, tuning_runs, say, retime)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "spec.json", spec.defining())
    total = len(tuning_runs) + len(shapes) * (len(spec.seeds) - 1)
    say(f"study {spec.name}: {len(shapes)} shapes x {len(spec.learning_rates)} learning rates on seed "
        f"{spec.tune_seed} (up to {spec.lr_extend} more each at the grid's edge), then {len(spec.seeds)} seeds: "
        f"{total} runs in {out} ({launch.kind} launcher)")
    tuned_results = launch.map([Job(run) for run in tuning_runs], "tune")
    tuning = [result for result in tuned_results if result is not None]
    held = {(run.arch, run.shape.label) for run, result in zip(tuning_runs, tuned_results) if result is None}
    chosen = select_learning_rates(spec, tuning)
    while more := extension_runs(spec, shapes, chosen, held):  # a choice at the grid's edge: one rate further out
        say(f"tune: the chosen rate is at the grid's edge: trying {', '.join(run.label for run in more)}")
        extended = launch.map([Job(run) for run in more], "tune")
        tuning += [result for result in extended if result is not None]
        held |= {(run.arch, run.shape.label) for run, result in zip(more, extended) if result is None}
        chosen = select_learning_rates(spec, tuning)
    if held:  # its rate is chosen from every rate it needs or not at all
        say(f"tune: {', '.join(f'{a} {s}' for a, s in sorted(held))}: a tuning run failed, so no seeds run there "
            "until it is rerun")
    # seed by seed: a stopped study has whole seeds of every architecture first; the tuning seed's run at the chosen
    # rate is that seed's run (done, then tested)
    final_runs = [make_run(spec, shape, chosen[(shape.arch, shape.label)]["lr"], seed) for seed in spec.seeds
                  for shape in shapes if (shape.arch, shape.label) not in held]
    final = [result for result in launch.map([Job(run, test=True) for run in final_runs], "seeds")
             if result is not None]
    for result in final:
        result.setdefault("test", {})  # a diverged run has no test
    summary = write_summary(spec, out, tuning, final, {k: v for k, v in chosen.items() if k not in held}, say, retime,
                            left_out=launch.failed) if final else None
    if launch.failed:
        raise StudyFailed(launch.failed)
    return summary
