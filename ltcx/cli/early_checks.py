"""Mistakes in a Lightning command's line that are found before Lightning is imported (whose import alone is most
of the CPU time of ``fit``'s answer): a ``--config`` or ``--ckpt_path`` naming no file, LightningCLI's
``--optimizer`` / ``--lr_scheduler``, which ltcx does not offer, and, from the command's stored options
(``help_pages``), a flag it does not have or a value of the wrong type. Each is the one line the full parser would
give; an unknown flag's also names the option it most resembles."""

from __future__ import annotations

import difflib
import os
import re

from ltcx.cli.help_pages import stored_options
from ltcx.cli.one_line_errors import NO_OPTIMIZER_FLAGS, OneLineErrors
from ltcx.errors import LtcxError, missing_checkpoint

# The names Lightning itself gives a meaning to as --ckpt_path (``last`` is also ltcx's: the latest run's).
CKPT_KEYWORDS = ("last", "best", "hpc", "registry", "null", "None")


def flag_values(args: list[str], *flags: str) -> list[tuple[str, str]]:
    """``(flag, value)`` for each ``--flag value`` or ``--flag=value`` of ``flags`` in ``args``."""
    found = []
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in flags:
            if equals:
                found.append((name, value))
            elif i + 1 < len(args):
                found.append((name, args[i + 1]))
    return found


def _is_inline_yaml(value: str) -> bool:
    """jsonargparse also takes a config's text as ``--config``."""
    return "\n" in value or ": " in value or value.lstrip().startswith(("{", "["))


def unknown_flag(args: list[str], options: dict[str, object]) -> str | None:
    """The first flag in ``args`` that the parser whose option strings are ``options`` would not recognise, judged
    no deeper than the option it starts with: below an option that takes a class (``--model.backbone``,
    ``--data``, ``--trainer.logger``) the names depend on the class and are the parser's to check. argparse takes a
    unique start of an option (``--trainer.max_step``) as that option."""
    for arg in args:
        flag = re.match(r"--[A-Za-z_][\w.]*", arg)  # not a value such as -1 or a YAML text
        if flag is None or flag.group() != arg.split("=", 1)[0].rstrip("+"):
            continue
        name = flag.group()
        if any(option.startswith(name) for option in options):
            continue
        parts = name.split(".")
        known = next((".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)
                      if ".".join(parts[:n]) in options), None)
        if known is not None and (known.count(".") > 0 or f"{known}.help" in options):
            continue  # under --model.backbone or --data: the class's own arguments
        return name
    return None


def check_lightning_command_line(command: str, args: list[str], prog: str) -> None:
    """``args`` (after ``command``) of ``prog`` (``ltcx fit``): raise the ``LtcxError`` the parser would, for the
    mistakes that need no parser."""
    for arg in args:
        if arg.split("=", 1)[0].split(".", 1)[0] in ("--optimizer", "--lr_scheduler"):
            raise LtcxError(NO_OPTIMIZER_FLAGS)
    for _, path in flag_values(args, "--config", "-c"):
        if not _is_inline_yaml(path) and not os.path.isfile(path):
            raise LtcxError(f"--config: File does not exist: '{os.path.abspath(path)}'; see `{prog} --help`")
    for _, path in flag_values(args, "--ckpt_path"):
        if path not in CKPT_KEYWORDS and not os.path.exists(path) and "://" not in path:
            raise missing_checkpoint(path)
    options = stored_options(command)
    if options is None:  # other versions than the stored parsers': the parser answers
        return
    flag = unknown_flag(args, options)
    if flag is not None:
        close = difflib.get_close_matches(flag, [o for o in options if not o.endswith(".help")], n=1, cutoff=0.6)
        like = f" (did you mean {close[0]}?)" if close else ""
        raise LtcxError(f"unrecognized arguments: {flag}{like}; see `{prog} --help`")
    if "--help" not in args and "-h" not in args:  # argparse would print the help where it comes in the line
        check_typed_values(args, options, prog)


def check_typed_values(args: list[str], options: dict[str, object], prog: str) -> None:
    """A value of the wrong type for an option whose type is made of builtins (``--trainer.max_steps x``), judged by
    jsonargparse itself: the flags of those options, with their values, go through a parser of just them, whose
    types are the stored ones (the full parser's)."""
    typed, at = [], 0
    while at < len(args):
        name, equals, _ = args[at].partition("=")
        step = 1 if equals else 2
        if name.startswith("--") and options.get(name.rstrip("+")) is not None:
            typed += args[at:at + step]
            at += step
        else:
            at += 1
    if not typed:
        return
    from jsonargparse import ArgumentParser

    class TypedFlags(OneLineErrors, ArgumentParser):
        pass

    parser = TypedFlags(prog=prog)
    for name in dict.fromkeys(arg.partition("=")[0].rstrip("+") for arg in typed if arg.startswith("--")):
        parser.add_argument(name, type=options[name])
    parser.parse_args(typed)
