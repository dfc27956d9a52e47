"""Command line: LightningCLI (fit, validate, test, predict) plus ``generate``, ``export``, ``prepare``, ``evaluate``
and ``lm-eval``.

    ltcx fit --config configs/gpt.yaml
    ltcx generate --ckpt_path checkpoints/gpt/version_0/last.ckpt --prompt "Once upon a time"
    ltcx export --ckpt_path checkpoints/gpt/version_0/last.ckpt --out gpt-tinystories/
    ltcx prepare --source my_corpus/ --out data/my_corpus      # token shards, then --data.path data/my_corpus
    ltcx evaluate --ckpt_path checkpoints/gpt --data.path sample --max_len 4x    # loss by position
    ltcx lm-eval --ckpt_path checkpoints/gpt --tasks hellaswag     # lm-evaluation-harness tasks

``lightning`` is the LightningCLI subclass and its hooks, ``generate``, ``export``, ``prepare``, ``evaluate`` and
``harness`` (``lm-eval``) the argparse front-ends (``ltcx/runtime.py`` sizes torch's CPU threads), ``allocator``
keeps the memory a step frees for the next step, ``run_folders`` resolves the trainer's folders and ``--ckpt_path
last``,
``predict`` writes ``predict``'s losses, ``console`` prints a run's first and last lines and quiets Lightning's
start-up lines. Each command imports what it needs when it runs: ``ltcx --help``, an unknown command, the argparse
commands' ``--help`` and argument errors, and a Lightning command's missing ``--config`` or ``--ckpt_path`` file
(``early_checks``) answer without importing torch or Lightning.
"""

from __future__ import annotations

import signal
import sys

from ltcx.errors import LtcxError, StoppedOnAllRanks
from ltcx.runtime import program_name

__all__ = ["main", "program_name", "USAGE"]

LIGHTNING_COMMANDS = {
    "fit": "train a model (ltcx fit --config configs/gpt.yaml)",
    "validate": "the validation loss of a model or checkpoint",
    "test": "loss, ppl, bpb or recall on the test split, to test_metrics.json",
    "predict": "each block's loss, to predictions.csv",
}
OWN_COMMANDS = {
    "generate": "sample text from a checkpoint or an exported folder",
    "export": "write a weights-only folder (model.safetensors + config.json)",
    "prepare": "tokenize a corpus once into deduplicated token shards",
    "evaluate": "loss by position or long-context recall, up to several times the training length",
    "lm-eval": "lm-evaluation-harness tasks (--tasks hellaswag,...)",
    "study": "a study spec: tuned learning rates, paired seeds, a ladder, a report",
}
USAGE = "usage: ltcx <command> [options]   (python -m ltcx and python run.py are the same)\n\ncommands:\n" + "".join(
    f"  {name:<10} {what}\n" for name, what in {**LIGHTNING_COMMANDS, **OWN_COMMANDS}.items()
) + "\n`ltcx <command> --help` lists a command's options."


def __getattr__(name: str):
    if name in ("LtcxCLI", "cli_main"):  # the LightningCLI pieces, imported when first asked for
        import importlib

        return getattr(importlib.import_module("ltcx.cli.lightning"), name)
    raise AttributeError(f"module 'ltcx.cli' has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    """``ltcx`` / ``python run.py``: a command; user errors as one line (exit 2), a stop by signal exits 128 + it."""
    command_line = sys.argv[1:] if argv is None else list(argv)
    command = command_line[0] if command_line else None
    if command in (None, "-h", "--help"):
        print(USAGE, file=sys.stdout if command else sys.stderr)
        sys.exit(0 if command else 2)
    if command == "--version":
        from ltcx import __version__

        print(f"ltcx {__version__}")
        return
    from ltcx.cli.allocator import keep_freed_memory

    keep_freed_memory()  # before any tensor: a step's freed memory is kept for the next (ltcx/cli/allocator.py)
    try:
        if command == "generate":
            from ltcx.cli.generate import generate_main

            generate_main(command_line[1:])
        elif command == "prepare":
            from ltcx.cli.prepare import prepare_main

            prepare_main(command_line[1:])
        elif command == "export":
            from ltcx.cli.export import export_main

            export_main(command_line[1:])
        elif command == "evaluate":
            from ltcx.cli.evaluate import evaluate_main

            evaluate_main(command_line[1:])
        elif command == "lm-eval":
            from ltcx.cli.lm_eval import lm_eval_main

            lm_eval_main(command_line[1:])
        elif command == "study":
            from ltcx.cli.study import study_main

            study_main(command_line[1:])
        elif command in LIGHTNING_COMMANDS:
            from ltcx.cli.early_checks import check_lightning_command_line

            args = check_lightning_command_line(command_line[1:], f"{program_name()} {command}")
            from ltcx.cli.lightning import cli_main

            if argv is None:  # LightningCLI reads sys.argv (given args too, it warns that both were given)
                sys.argv[1:] = [command, *args]
                cli_main(None)
            else:
                cli_main([command, *args])
        else:
            known = ", ".join([*LIGHTNING_COMMANDS, *OWN_COMMANDS])
            raise LtcxError(f"unknown command '{command}': choose one of {known}; see `{program_name()} --help`")
    except LtcxError as error:
        if not isinstance(error, StoppedOnAllRanks) or _rank() == 0:  # every rank has it: say it once
            print(f"ltcx: error: {error}", file=sys.stderr)
        sys.exit(2)
    except SystemExit as stop:  # training stopped by a signal (Lightning's SIGTERMException): never report success
        if type(stop).__name__ == "SIGTERMException":
            sys.exit(stop.code or 128 + signal.SIGTERM)
        raise


def _rank() -> int:
    """This process's global rank, as Lightning knows it (0 when Lightning was never imported)."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    return getattr(getattr(rank_zero, "rank_zero_only", None), "rank", 0) or 0
