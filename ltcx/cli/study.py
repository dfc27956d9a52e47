"""``ltcx study``: run a study spec (a YAML, or a preset shipped in ``configs/study/``) through
``ltcx/study/runner.py``; docs/compare.md.

    ltcx study --spec quick-recall                 # a preset: MQAR on the CPU
    ltcx study --spec my_study.yaml --dry_run      # what would run
    ltcx study --spec my_study.yaml                # rerun after a stop: it continues where it stopped
    ltcx study --spec my_study.yaml --launcher devices --workers 8   # a run per GPU of this node (docs/launchers.md)
    ltcx study --spec my_study.yaml --launcher slurm --partition gpu # a SLURM job per run, through submitit
    ltcx study --spec my_study.yaml --report_only  # the report of the runs finished so far
    ltcx study --spec my_study.yaml --report_only --retime   # ... with the timing pass redone (a quieter machine)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ltcx.cli.one_line_errors import command_parser

__all__ = ["study_main"]


def _at_least(low: int):
    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, not {text!r}")
        return value

    return number


def study_main(argv: list[str]) -> None:
    parser = command_parser("study", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ltcx.study.spec import preset_names

    parser.add_argument("--spec", required=True, help=f"a study YAML, or a preset: {', '.join(preset_names())}")
    parser.add_argument("--name", default=None, help="results go to <out>/<name>/ (default: the spec's name)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="the folder of every study's results")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the plan, each run's command and where it would run; run nothing")
    parser.add_argument("--report_only", action="store_true",
                        help="write the summary and the report from the runs finished so far; run nothing")
    parser.add_argument("--retime", action="store_true",
                        help="redo the timing pass even where timing.json holds these checkpoints (docs/compare.md)")
    where = parser.add_argument_group("launcher (over the spec's `launcher:`; docs/launchers.md)")
    where.add_argument("--launcher", choices=["local", "devices", "slurm"], default=None,
                       help="local: one run after another; devices: one run per GPU (or per worker on a CPU); slurm: "
                            "a SLURM job per run through submitit")
    where.add_argument("--workers", type=_at_least(1), default=None,
                       help="devices: runs at a time (default: one per GPU; on a CPU-only machine cores / "
                            "cpus_per_run, or 1, each worker with cores / workers threads)")
    where.add_argument("--gpus_per_run", type=_at_least(0), default=None, help="devices, slurm: GPUs of each run")
    where.add_argument("--cpus_per_run", type=_at_least(1), default=None,
                       help="devices, slurm: CPU threads (cores) of each run; devices without GPUs: as many runs at "
                            "once as the cores hold")
    where.add_argument("--partition", default=None, help="slurm: the partition")
    where.add_argument("--time_min", type=_at_least(1), default=None, help="slurm: each job's time limit in minutes")
    args = parser.parse_args(argv)
    if args.dry_run and args.report_only:
        parser.error("--dry_run and --report_only exclude each other: give one")

    from ltcx.study.runner import StudyFailed, StudyStopped, run_study
    from ltcx.study.spec import find_spec, load_spec

    spec = load_spec(find_spec(args.spec), args.name)
    out = (args.out / spec.name).resolve()
    launcher = {"kind": args.launcher, "workers": args.workers, "gpus_per_run": args.gpus_per_run,
                "cpus_per_run": args.cpus_per_run, "partition": args.partition, "time_min": args.time_min}
    try:
        run_study(spec, out, dry_run=args.dry_run, say=lambda line: print(line, flush=True),
                  launcher={k: v for k, v in launcher.items() if v is not None}, report_only=args.report_only,
                  retime=args.retime)
    except StudyStopped as stop:
        print(f"ltcx: {stop.line}", file=sys.stderr, flush=True)
        sys.exit(stop.code)
    except StudyFailed as failed:  # the others finished; the report holds them and lists these
        for run in failed.failed:
            print(f"ltcx: {'damaged' if run.damaged else 'failed'}: {run.line}", file=sys.stderr, flush=True)
        damaged = sum(run.damaged for run in failed.failed)
        said = []  # (what, its fix)
        if damaged < len(failed.failed):
            said.append((f"{len(failed.failed) - damaged} runs failed", "rerun the same command to retry them"))
        if damaged:
            said.append((f"{damaged} runs are damaged", "delete each damaged run's folder named above and rerun the "
                                                          "same command to retrain it"))
        print(f"ltcx: study {spec.name}: {' and '.join(w for w, _ in said)} (above); {'; '.join(f for _, f in said)}",
              file=sys.stderr, flush=True)
        sys.exit(1)
