"""Mistakes in a Lightning command's line that are found before Lightning is imported (whose import alone is most
of the CPU time of ``fit``'s answer): a ``--config`` or ``--ckpt_path`` naming no file, LightningCLI's
``--optimizer`` / ``--lr_scheduler``, which ltcx does not offer, and, from the command's stored options
(``help_pages``), a flag it does not have or a value of the wrong type.

A line is refused here only if the full parser refuses it too. The command line is read as argparse reads it (which
words are options, which are values, abbreviations, ``--``), and in its order: a value of the wrong type or a
missing config file is judged where it stands, as the parser does, and gets the parser's own line; unknown flags
come after, as the parser reports them at the end, with the closest option; ``--ckpt_path`` last (the parser does
not look at the file). A help flag (``-h``, ``--he``, ``--data.help``) ends the reading there: the parser prints
the help at that point. The parser may still name another mistake first that is not judged here (a class's
argument, a value inside a config file); it refuses the line all the same.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from dataclasses import dataclass

from ltcx.cli.help_pages import stored_options
from ltcx.cli.one_line_errors import NO_OPTIMIZER_FLAGS, OneLineErrors
from ltcx.errors import LtcxError, missing_checkpoint

# YAML's nulls (and nothing), which the parser reads as no value: no file to look for.
YAML_NULLS = ("null", "Null", "NULL", "~", "")
# The names Lightning itself gives a meaning to as --ckpt_path (``last`` is also ltcx's: the latest run's).
CKPT_KEYWORDS = ("last", "best", "hpc", "registry", "None", *YAML_NULLS)
CONFIG_FLAGS = ("-c", "--config")
# The options a command line is read against when no stored options fit the installed versions.
BASIC_OPTIONS = {"-h": None, "--help": None, "-c": None, "--config": None, "--print_config": None, "--ckpt_path": None}
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's: a value, not an option


@dataclass
class Word:
    """One option of a command line as argparse reads it: ``flag`` as typed, the ``option`` it names (``None``:
    unknown; an option that takes a class for a name under it), and its ``value`` (``None``: none follows)."""

    flag: str
    option: str | None
    value: str | None
    explicit: bool  # the value was part of the flag (--flag=value, -cFILE)


def read_command_line(args: list[str], options: dict[str, object], abbreviations: bool = True) -> list[Word]:
    """The options of ``args`` with their values, as argparse's ``_parse_optional`` tells options from values: a
    known option (or ``option=value``), a unique start of one (``--trainer.max_step``), a name under an option that
    takes a class (``--model.backbone.n_layer``: jsonargparse's), else a negative number or a word with a space is a
    value and any other word starting with ``-`` an unknown option. An option takes the next word as its value unless
    that word is an option. Reading stops at ``--`` (after it, every word is a value the parser does not take)."""
    words: list[Word] = []
    at = 0
    while at < len(args):
        arg = args[at]
        at += 1
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            continue  # a value no option took
        flag, explicit, value = arg, False, None
        option = _option_named(arg, options, abbreviations)
        if option is None and "=" in arg:
            name, _, rest = arg.partition("=")
            option = _option_named(name, options, abbreviations)
            if option is not None:
                flag, explicit, value = name, True, rest
        if option is None and not arg.startswith("--") and arg[:2] in options:  # -cFILE
            flag, option, explicit, value = arg[:2], arg[:2], True, arg[2:].removeprefix("=")
        if option is None and (NEGATIVE_NUMBER.match(arg) or " " in arg):
            continue  # a value no option took
        if option is None:
            flag = arg.partition("=")[0]
        if not explicit and option not in ("-h", "--help") and at < len(args) and _is_value(args[at], options):
            value = args[at]
            at += 1
        words.append(Word(flag, option, value, explicit))
    return words


def _option_named(flag: str, options: dict[str, object], abbreviations: bool) -> str | None:
    """The option ``flag`` names: itself, the one option it is the start of, or the class-taking option it lies
    under."""
    if flag in options:
        return flag
    if not flag.startswith("--") or not re.fullmatch(r"--[A-Za-z_][\w.]*\+?", flag):
        return None
    name = flag.rstrip("+")
    if name in options:
        return name
    if abbreviations:
        starts = [option for option in options if option.startswith(name)]
        if len(starts) == 1:
            return starts[0]
        if len(starts) > 1:
            return None  # ambiguous: the parser says so
    parts = name.split(".")
    for n in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:n])
        if parent in options:
            # under --model.backbone or --data (a class's own arguments), or deeper than an option: the parser's
            return parent if n > 1 or f"{parent}.help" in options else None
    return None


def _is_value(arg: str, options: dict[str, object]) -> bool:
    return (not arg.startswith("-") or arg == "-" or NEGATIVE_NUMBER.match(arg) is not None
            or (" " in arg and _option_named(arg.partition("=")[0], options, True) is None))


def _is_help(word: Word) -> bool:
    """``-h``, ``--help`` or a start of it (argparse's abbreviation), or a class's ``--data.help``."""
    return (word.option in ("-h", "--help") or (len(word.flag) >= 3 and "--help".startswith(word.flag))
            or word.flag.endswith(".help"))


def check_lightning_command_line(command: str, args: list[str], prog: str) -> None:
    """``args`` (after ``command``) of ``prog`` (``ltcx fit``): raise the ``LtcxError`` the parser would, for the
    mistakes that need no parser."""
    stored = stored_options(command)
    options = stored if stored is not None else BASIC_OPTIONS
    words = read_command_line(args, options, abbreviations=stored is not None)
    helped = next((at for at, word in enumerate(words) if _is_help(word)), None)
    for word in words[:helped]:  # where the parser meets them: a config file, a typed value
        if word.option in CONFIG_FLAGS and word.value is not None:
            _check_config_file(word.value, prog)
        elif word.option is not None and options.get(word.option) is not None and word.option.startswith(
                word.flag.rstrip("+")):  # the option or a start of it, not a name under it (the parser's)
            _check_typed_value(word, options[word.option], prog)
    if helped is not None:
        return
    for word in words:  # the unknown ones, as the parser reports them after reading the whole line
        if word.flag.split(".", 1)[0] in ("--optimizer", "--lr_scheduler"):
            raise LtcxError(NO_OPTIMIZER_FLAGS)
        if word.option is None and stored is not None:
            close = _closest_option(word.flag, [o for o in options if not o.endswith(".help")])
            like = f" (did you mean {close}?)" if close else ""
            raise LtcxError(f"unrecognized arguments: {word.flag}{like}; see `{prog} --help`")
    for word in words:
        if word.option == "--ckpt_path" and word.value is not None:
            path = word.value
            if path not in CKPT_KEYWORDS and "://" not in path and not os.path.exists(os.path.expanduser(path)):
                raise missing_checkpoint(path)


def _closest_option(flag: str, options: list[str]) -> str | None:
    """The option ``flag`` was probably meant as: the one of the same group whose words' initials it spells
    (``--model.lr``: ``--model.learning_rate``), else the closest by characters."""
    group, _, last = flag.rpartition(".")
    for option in options:
        option_group, _, name = option.rpartition(".")
        if option_group == group and len(last) > 1 and "".join(w[:1] for w in name.split("_")) == last:
            return option
    close = difflib.get_close_matches(flag, options, n=1)
    return close[0] if close else None


def _check_config_file(path: str, prog: str) -> None:
    """``--config`` names a file that is not there (the parser also takes a config's text, and YAML's null)."""
    inline = "\n" in path or ": " in path or path.lstrip().startswith(("{", "["))
    if inline or path in YAML_NULLS or os.path.exists(os.path.expanduser(path)):
        return
    raise LtcxError(f"--config: File does not exist: '{os.path.abspath(os.path.expanduser(path))}'; "
                    f"see `{prog} --help`")


def _check_typed_value(word: Word, hint: object, prog: str) -> None:
    """A value of the wrong type for an option whose type is made of builtins (``--trainer.max_steps x``), judged
    by jsonargparse itself: a parser of just that option and its stored type (the full parser's) reads the flag and
    its value, and its error is the full parser's line."""
    parser = _typed_flag_parser()(prog=prog, default_env=False)
    parser.add_argument(word.option, type=hint)
    if word.explicit:
        parser.parse_args([f"{word.flag}={word.value}"])
    else:
        parser.parse_args([word.flag] + ([word.value] if word.value is not None else []))


@functools.cache
def _typed_flag_parser() -> type:
    """jsonargparse's parser with ``OneLineErrors`` (jsonargparse imported only when a typed value is judged)."""
    from jsonargparse import ArgumentParser

    class TypedFlag(OneLineErrors, ArgumentParser):
        pass

    return TypedFlag
