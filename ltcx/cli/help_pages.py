"""What the parsers of ``fit``, ``validate``, ``test`` and ``predict`` answer without importing Lightning.

LightningCLI builds these commands' parser from the Trainer's signature, so its answer needs ``import lightning``,
most of the CPU time of ``fit --help``. What the parser holds depends only on ltcx's classes and the installed
Lightning, jsonargparse, torch and Python, so it is stored, with those versions and a digest of the ltcx files that
define the arguments (``PARSER_SOURCES``), and used while they are the installed ones:

- ``help_pages/<command>.txt``: the bare ``<command> --help`` page as the parser prints it (laid out for 80 columns
  whatever the terminal's width, ``lightning.LtcxArgumentParser``), printed when asked for exactly it. Any other
  ``--help`` (``--config x.yaml --help``, which shows that file's values, or ``--model.backbone.help GPT``) goes to
  the parser.
- ``help_pages/parsers.json``: the versions, and each command's option strings with their types where the type is
  made of builtins (``int``, ``Optional[float]``, ``Literal[...]``, ...; ``None`` where it names a class):
  ``early_checks`` refuses an unknown flag or a value of the wrong type from them.

``tests/test_help_pages.py`` holds both to the parser; after changing an argument, its help or a pinned version (or
adding a backbone, which ``fit --help`` lists), rewrite them:

    python -m ltcx.cli.help_pages
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import os
import pathlib
import subprocess
import sys
import types
import typing

PAGES = pathlib.Path(__file__).with_name("help_pages")
INDEX = PAGES / "parsers.json"
COMMANDS = ("fit", "validate", "test", "predict")
COLUMNS = 80  # the width the Lightning commands' help is laid out for
PROG = "ltcx"  # the program name the pages are written with; the first line is given the one that runs


# ltcx's files that define what the parsers hold: LanguageModel's arguments, the CLI's own (--num_threads, the
# usage), the backbones --model.backbone lists. After an edit to one (a new argument of one's own) every command line
# goes to the parser until the pages are rewritten, rather than a new flag being refused as unknown.
PARSER_SOURCES = ("lm.py", "cli/lightning.py", "models/catalog.py", "models/registry.py")


def installed_versions() -> dict[str, str]:
    """What the stored parsers depend on: Python's version (its argparse lays the page out), the packages', and the
    content of ``PARSER_SOURCES``."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for package in ("lightning", "jsonargparse", "torch"):
        try:
            versions[package] = version(package).split("+")[0]  # 2.13.0+cpu: the CPU build of 2.13.0
        except PackageNotFoundError:
            versions[package] = "missing"
    sources = hashlib.sha256()
    package = pathlib.Path(__file__).parent.parent
    try:
        for name in PARSER_SOURCES:
            sources.update((package / name).read_bytes())
        versions["ltcx sources"] = sources.hexdigest()[:16]
    except OSError:  # installed without its sources: nothing stored is known to fit
        versions["ltcx sources"] = "unreadable"
    return versions


@functools.lru_cache(maxsize=1)
def _current_index() -> dict | None:
    """``parsers.json``'s commands if it was written with the installed versions, else ``None``."""
    try:
        index = json.loads(INDEX.read_text())
    except (OSError, ValueError):
        return None
    return index.get("commands") if index.get("versions") == installed_versions() else None


def current_page(command: str) -> str | None:
    """``command``'s stored page if it is what the parser would print with the installed versions, else ``None``."""
    if command not in COMMANDS or _current_index() is None:
        return None
    try:
        return (PAGES / f"{command}.txt").read_text()
    except OSError:
        return None


def stored_page(command: str, args: list[str], prog: str) -> str | None:
    """The stored ``--help`` page of ``command`` when ``args`` asks for exactly it and the page is what the parser
    would print here; ``None`` sends the command line to the parser."""
    if args not in (["--help"], ["-h"]):
        return None
    page = current_page(command)
    if page is None:
        return None
    first, newline, rest = page.partition("\n")
    return first.replace(f"usage: {PROG} ", f"usage: {prog} ", 1) + newline + rest


def stored_options(command: str) -> dict[str, object] | None:
    """``command``'s option strings (``-c``, ``--trainer.max_steps``; an append form ``--trainer.callbacks+`` is its
    option's), each with its type where that is made of builtins, else ``None``; ``None`` if not current."""
    commands = _current_index()
    if commands is None or command not in commands:
        return None
    return {option: _type_from_json(kind) for option, kind in commands[command].items()}


# Types as JSON: a name for a plain type, {"Union" | "UnionType" | "Literal" | "list" | "tuple" | "dict": [...]}.
_PLAIN = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None), "Path": pathlib.Path,
          "timedelta": datetime.timedelta}


def _type_to_json(hint):
    """``hint`` as JSON if it is made of ``_PLAIN`` types, unions, literals and builtin containers, else ``None``."""
    for name, plain in _PLAIN.items():
        if hint is plain:
            return name
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"Literal": list(args)} if all(isinstance(a, (int, str)) for a in args) else None
    kinds = {typing.Union: "Union", types.UnionType: "UnionType", list: "list", tuple: "tuple", dict: "dict"}
    if origin not in kinds or not args:
        return None
    members = [_type_to_json(a) for a in args]
    return None if any(m is None for m in members) else {kinds[origin]: members}


def _type_from_json(kind):
    if kind is None:
        return None
    if isinstance(kind, str):
        return _PLAIN[kind]
    [(name, members)] = kind.items()
    if name == "Literal":
        return typing.Literal[tuple(members)]
    members = [_type_from_json(m) for m in members]
    if name == "UnionType":  # int | None, as the signature wrote it
        return functools.reduce(operator.or_, members)
    return {"Union": typing.Union, "list": list, "tuple": tuple, "dict": dict}[name][tuple(members)]


def command_parsers() -> dict:
    """Each command's parser as ``cli_main`` builds it, stopped before it parses (imports Lightning)."""
    from ltcx.cli.lightning import LtcxCLI, cli_main

    class Built(Exception):
        pass

    def stop(cli, parser, args):
        raise Built(cli._subcommand_parsers)

    parse_arguments = LtcxCLI.parse_arguments
    LtcxCLI.parse_arguments = stop
    try:
        cli_main(["fit"])
    except Built as built:
        return built.args[0]
    finally:
        LtcxCLI.parse_arguments = parse_arguments
    raise AssertionError("cli_main parsed without building its parsers")


def _render_here() -> None:
    """In a fresh interpreter: print each command's ``--help`` and options as JSON (``render``)."""
    import contextlib
    import io

    from ltcx.cli.lightning import cli_main

    pages = {}
    for command in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                cli_main([command, "--help"])
            except SystemExit:
                pass
        pages[command] = out.getvalue()
    parsers = command_parsers()
    options = {command: {name.rstrip("+"): _type_to_json(getattr(action, "_typehint", None))
                         for action in parsers[command]._actions for name in action.option_strings}
               for command in COMMANDS}
    sys.__stdout__.write(json.dumps({"pages": pages, "options": options}))


def render() -> tuple[dict[str, str], dict]:
    """``(pages, options)`` as the parser has them, from one fresh interpreter (the known subclasses a page lists are
    those its imports define, not a test session's)."""
    env = {**os.environ, "COLUMNS": "132"}  # not the width of the page, which is always COLUMNS
    code = f"import sys; sys.argv = [{PROG!r}]\nfrom ltcx.cli.help_pages import _render_here\n_render_here()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    rendered = json.loads(done.stdout)
    return rendered["pages"], rendered["options"]


def write_pages() -> None:
    """Rewrite ``help_pages/`` from the parser and the installed versions."""
    pages, options = render()
    PAGES.mkdir(exist_ok=True)
    for command, page in pages.items():
        (PAGES / f"{command}.txt").write_text(page)
    commands = ",\n".join(f"  {json.dumps(command)}: {{\n" + ",\n".join(
        f"   {json.dumps(option)}: {json.dumps(kind)}" for option, kind in options[command].items()) + "\n  }"
        for command in COMMANDS)
    INDEX.write_text(f'{{\n "versions": {json.dumps(installed_versions())},\n "commands": {{\n{commands}\n }}\n}}\n')
    print(f"wrote {', '.join(f'{c}.txt' for c in COMMANDS)} and {INDEX.name} to {PAGES}")


if __name__ == "__main__":
    write_pages()
