"""Command-line errors as one ``LtcxError`` line naming the flag, the reason and ``--help``, instead of a usage
(~75 lines for ``fit``) and a message: ``OneLineErrors``, the ``error`` of LightningCLI's parser
(``lightning.LtcxArgumentParser``), and ``command_parser``, the argparse parser of ltcx's own commands (generate,
export, ...); an unknown flag with the option it was probably meant as. Imports neither torch nor Lightning."""

from __future__ import annotations

import argparse
import difflib
import re

from ltcx.errors import LtcxError
from ltcx.runtime import program_name

# LightningCLI's --optimizer / --lr_scheduler would silently replace ltcx's AdamW and its warmup + cosine schedule
# (and the schedule's end kept in checkpoints): ltcx does not offer them.
NO_OPTIMIZER_FLAGS = (
    "--optimizer and --lr_scheduler are not ltcx options: every run trains with AdamW and a warmup + cosine "
    "schedule by step; set --model.learning_rate, --model.min_lr, --model.warmup_steps, --model.decay_steps, "
    "--model.weight_decay, --model.betas or --model.eps instead"
)


class OneLineErrors:
    """A jsonargparse parser whose errors are one ``LtcxError`` line.

    jsonargparse calls ``error`` on the parser that failed, the subcommand's own (``fit``) included: that parser
    inherits ``exit_on_error`` from the main one. The parsers jsonargparse makes inside for a class's arguments have
    ``exit_on_error=False``: their errors are caught and reported by the parser above, so they stay as they are."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            super().error(message, ex)
        if re.search(r"""(--|['"])(optimizer|lr_scheduler)\b""", message):  # a flag, or `optimizer:` in a YAML
            raise LtcxError(NO_OPTIMIZER_FLAGS) from ex
        parser = getattr(ex, "subcommand_parser", None) or self
        raise _one_error_line(parser, one_line(message)) from ex


class _CommandParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _one_error_line(self, message)


def command_parser(command: str, description: str | None, **kwargs) -> argparse.ArgumentParser:
    """The argparse parser of ltcx's own ``command``: named as the program was started (``program_name``), its errors
    one ``LtcxError`` line as LightningCLI's commands' are."""
    return _CommandParser(prog=f"{program_name()} {command}", description=description, **kwargs)


def _one_error_line(parser: argparse.ArgumentParser, text: str) -> LtcxError:
    """text; see `<prog> --help`, an unrecognized flag with the option it was probably meant as."""
    unknown = re.match(r"unrecognized arguments: (-[^\s=]+)", text, re.IGNORECASE)
    if unknown:
        close = closest_option(unknown.group(1), list(getattr(parser, "_option_string_actions", {})))
        text += f" (did you mean {close}?)" if close else ""
    return LtcxError(f"{text}; see `{parser.prog.replace(' [options]', '')} --help`")


def closest_option(flag: str, options: list[str]) -> str | None:
    """The option ``flag`` was probably meant as: one of the same group whose words' initials it spells
    (``--model.lr``: ``--model.learning_rate``), else the closest by characters."""
    options = [option for option in options if option.startswith("--") and not option.endswith(".help")]
    group, _, last = flag.rpartition(".")
    for option in options:
        option_group, _, name = option.rpartition(".")
        if option_group == group and len(last) > 1 and "".join(w[:1] for w in name.split("_")) == last:
            return option
    close = difflib.get_close_matches(flag, options, n=1)
    return close[0] if close else None


def one_line(message: str) -> str:
    """jsonargparse's message on one line: ``Parser key "k":`` becomes ``--k:``, followed by the first reason, the
    types a union accepts and the value given; the rest (each union member's own error) is left out."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid arguments"
    key = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[0])
    if key is None:
        return lines[0]
    for at, line in enumerate(lines[:-1]):  # a class's own argument (--data.block_size): its reason, not the union's
        unknown = re.match(r"(?:- )?Problem with given class_path '([\w.]+)':", line)
        option = re.match(r"Option '(\w+)' is not accepted", lines[at + 1])
        if unknown and option:  # --model.backbone.init_args.dropou: a name the class does not take
            name = unknown.group(1)
            return (f"--{key.group(1)}: {name} has no option '{option.group(1)}' (its options: --{key.group(1)}.help "
                    f"{name.rpartition('.')[2]})")
        if line.startswith("- Problem with given class_path "):
            inner = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[at + 1])
            reason = (inner.group(2) or (lines[at + 2] if at + 2 < len(lines) else "")) if inner else lines[at + 1]
            name = f"{key.group(1)}.{inner.group(1)}" if inner else key.group(1)
            return re.sub(r"<class '([\w.]+)'>", r"\1", f"--{name}: {reason or 'invalid value'}")
    rest = ([key.group(2)] if key.group(2) else []) + lines[1:]
    text = f"--{key.group(1)}: {rest[0] if rest else 'invalid value'}"
    for line in rest[1:]:
        if line.startswith("Subtypes: "):
            text += f" (accepted: {line[len('Subtypes: '):]})"
        elif line.startswith("Given value: ") and "Got value" not in text:
            text += f" (given: {line[len('Given value: '):]})"
    return re.sub(r"<class '([\w.]+)'>", r"\1", text).replace("typing.", "")
