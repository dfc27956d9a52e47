"""A Lightning command's line before Lightning is imported (whose import alone is most of the CPU time of ``fit``'s
answer): a ``--config`` naming a shipped config (``--config gpt``) is given its path, and the mistakes that need no
parser are refused: a ``--config`` or ``--ckpt_path`` naming no file, and LightningCLI's ``--optimizer`` /
``--lr_scheduler``, which ltcx does not offer. Everything else (unknown flags, values of the wrong type, ``--help``)
is the parser's.

A line is refused here only if the parser refuses it too, so the line is read as argparse reads it: which words are
options and which are their values, ``--`` ending the options, a help flag ending the reading (the parser prints the
help there, after reading any ``--config`` before it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ltcx.cli.one_line_errors import NO_OPTIMIZER_FLAGS
from ltcx.errors import LtcxError, missing_checkpoint
from ltcx.models.catalog import shipped_config, shipped_config_names

# YAML's nulls (and nothing), which the parser reads as no value: no file to look for.
YAML_NULLS = ("null", "Null", "NULL", "~", "")
# The names Lightning itself gives a meaning to as --ckpt_path (``last`` is also ltcx's: the latest run's).
CKPT_KEYWORDS = ("last", "best", "hpc", "registry", "None", *YAML_NULLS)
CONFIG_FLAGS = ("-c", "--config")
HELP_FLAGS = ("-h", "--help")
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's: a value, not an option


@dataclass
class Word:
    """One option of a command line as argparse reads it: ``flag`` as typed (``-c`` of ``-cFILE``), its ``value``
    (``None``: none follows) and where that value stands (``args[at]``, alone or after ``flag=`` / ``-c``)."""

    flag: str
    value: str | None
    at: int = -1


def read_command_line(args: list[str]) -> list[Word]:
    """The options of ``args`` with their values, as argparse's ``_parse_optional`` tells options from values: a
    word starting with ``-`` is an option unless it is a negative number or holds a space; ``--flag=value`` and
    ``-cFILE`` carry their value; an option takes the next word as its value unless that word is an option. Reading
    stops at ``--`` (after it, every word is a value)."""
    words: list[Word] = []
    at = 0
    while at < len(args):
        arg = args[at]
        at += 1
        if arg == "--":
            break
        if not _is_option(arg):
            continue  # a value no option took
        if "=" in arg and arg.startswith("--"):
            flag, _, value = arg.partition("=")
            words.append(Word(flag, value, at - 1))
        elif arg[:2] in CONFIG_FLAGS and len(arg) > 2:  # -cFILE
            words.append(Word("-c", arg[2:].removeprefix("="), at - 1))
        elif arg not in HELP_FLAGS and at < len(args) and not _is_option(args[at]):
            words.append(Word(arg, args[at], at))
            at += 1
        else:
            words.append(Word(arg, None))
    return words


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and NEGATIVE_NUMBER.match(arg) is None and " " not in arg


def _is_help(word: Word) -> bool:
    """``-h``, ``--help`` or a start of it (argparse's abbreviation), or a class's ``--data.help``."""
    return word.flag in HELP_FLAGS or (len(word.flag) >= 3 and "--help".startswith(word.flag)) or word.flag.endswith(
        ".help")


def check_lightning_command_line(args: list[str], prog: str) -> list[str]:
    """``args`` (after the command) of ``prog`` (``ltcx fit``) with each ``--config`` that names a shipped config
    given its path; raises the ``LtcxError`` the parser would for the mistakes that need no parser."""
    words = read_command_line(args)
    args = list(args)
    helped = next((at for at, word in enumerate(words) if _is_help(word)), None)
    for word in words[:helped]:  # the parser reads a config file where it stands, before a later --help
        if word.flag in CONFIG_FLAGS and word.value is not None:
            path = _config_file(word.value, prog)
            if path != word.value:
                args[word.at] = args[word.at][: len(args[word.at]) - len(word.value)] + path
    if helped is not None:
        return args
    for word in words:
        if word.flag.split(".", 1)[0].rstrip("+") in ("--optimizer", "--lr_scheduler"):
            raise LtcxError(NO_OPTIMIZER_FLAGS)
    for word in words:  # the parser does not look at the file: Lightning would fail after the run's set-up
        if word.flag == "--ckpt_path" and word.value is not None:
            path = word.value
            if path not in CKPT_KEYWORDS and "://" not in path and not os.path.exists(os.path.expanduser(path)):
                raise missing_checkpoint(path)
    return args


def _config_file(path: str, prog: str) -> str:
    """What the parser is to read for ``--config path``: the file, a config's text or YAML's null as given, a shipped
    config's path for its name; a name of nothing is refused as the parser would, with the shipped names."""
    inline = "\n" in path or ": " in path or path.lstrip().startswith(("{", "["))
    if inline or path in YAML_NULLS or os.path.exists(os.path.expanduser(path)):
        return path
    shipped = shipped_config(path)
    if shipped is not None:
        return str(shipped)
    raise LtcxError(f"--config: File does not exist: '{os.path.abspath(os.path.expanduser(path))}' (nor is it a "
                    f"config shipped with ltcx: {', '.join(shipped_config_names())}); see `{prog} --help`")
