"""``ltcx study``: run a study spec (a YAML, or a preset shipped in ``configs/study/``) through
``ltcx/study/runner.py``; docs/compare.md.

    ltcx study --spec quick-recall                 # a preset: MQAR on the CPU
    ltcx study --spec my_study.yaml --dry_run      # what would run
    ltcx study --spec my_study.yaml                # rerun after a stop: it continues where it stopped
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ltcx.errors import LtcxError

__all__ = ["study_main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise LtcxError(f"{message} (see `ltcx study --help`)")


def study_main(argv: list[str]) -> None:
    parser = _Parser(prog="ltcx study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="a study YAML, or a preset: quick-recall, tinystories-ladder, "
                                                      "fineweb-edu-ladder, reference")
    parser.add_argument("--name", default=None, help="results go to <out>/<name>/ (default: the spec's name)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="the folder of every study's results")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and each run's command; run nothing")
    args = parser.parse_args(argv)

    from ltcx.study.runner import StudyStopped, run_study
    from ltcx.study.spec import find_spec, load_spec

    spec = load_spec(find_spec(args.spec), args.name)
    out = (args.out / spec.name).resolve()
    try:
        run_study(spec, out, dry_run=args.dry_run, say=lambda line: print(line, flush=True))
    except StudyStopped as stop:
        print(f"ltcx: {stop.line}", file=sys.stderr, flush=True)
        sys.exit(stop.code)
