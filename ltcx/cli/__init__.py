"""Command line: LightningCLI (fit, validate, test, predict) plus ``generate``, ``export``, ``prepare``, ``evaluate``
and ``lm-eval``.

    ltcx fit --config configs/gpt.yaml
    ltcx generate --ckpt_path checkpoints/gpt/version_0/last.ckpt --prompt "Once upon a time"
    ltcx export --ckpt_path checkpoints/gpt/version_0/last.ckpt --out gpt-tinystories/
    ltcx prepare --source my_corpus/ --out data/my_corpus      # token shards, then --data.path data/my_corpus
    ltcx evaluate --ckpt_path checkpoints/gpt --data.path sample --max_len 4x    # loss by position
    ltcx lm-eval --ckpt_path checkpoints/gpt --tasks hellaswag     # lm-evaluation-harness tasks

``lightning`` is the LightningCLI subclass and its hooks, ``generate``, ``export``, ``evaluate`` and ``harness``
(``lm-eval``) the argparse front-ends,
``threads`` sizes torch's CPU threads, ``run_folders`` resolves the trainer's folders and ``--ckpt_path last``,
``predict`` writes ``predict``'s losses. LightningCLI's modules are imported with this package, as before the split:
a test (or any caller) that redirects stderr around ``main()`` must not be where the libraries' loggers bind their
stream on first import (pytest's capsys closes it after the test); the other verbs import the model code (and
``lm-eval`` the ``lm_eval`` package) after parsing their arguments.
"""

from __future__ import annotations

import signal
import sys

from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ltcx.cli.lightning import LtcxCLI, cli_main
from ltcx.errors import LtcxError, StoppedOnAllRanks

__all__ = ["main", "LtcxCLI", "cli_main"]


def main(argv: list[str] | None = None) -> None:
    """``ltcx`` / ``python run.py``: ``generate``, ``prepare``, ``export``, ``evaluate``, ``lm-eval`` or a LightningCLI
    subcommand; user errors as one line."""
    command_line = sys.argv[1:] if argv is None else argv
    try:
        if command_line and command_line[0] == "generate":
            from ltcx.cli.generate import generate_main

            generate_main(command_line[1:])
        elif command_line and command_line[0] == "prepare":
            from ltcx.data.prepare import prepare_main

            prepare_main(command_line[1:])
        elif command_line and command_line[0] == "export":
            from ltcx.cli.export import export_main

            export_main(command_line[1:])
        elif command_line and command_line[0] == "evaluate":
            from ltcx.cli.evaluate import evaluate_main

            evaluate_main(command_line[1:])
        elif command_line and command_line[0] == "lm-eval":
            from ltcx.cli.harness import harness_main

            harness_main(command_line[1:])
        else:
            cli_main(argv)  # None: LightningCLI reads sys.argv itself
    except LtcxError as error:
        if not isinstance(error, StoppedOnAllRanks) or rank_zero_only.rank == 0:  # every rank has it: say it once
            print(f"ltcx: error: {error}", file=sys.stderr)
        sys.exit(2)
    except SIGTERMException as stop:  # training stopped by a signal: never report success
        sys.exit(stop.code or 128 + signal.SIGTERM)
