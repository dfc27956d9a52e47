"""``ltcx fit --help`` (and ``validate``, ``test``, ``predict``) without importing Lightning.

LightningCLI builds these commands' parser from the Trainer's signature, so its answer needs ``import lightning``,
most of the CPU time of ``fit --help``. The bare page (``<command> --help``, no other argument) depends only on
ltcx's classes and the installed Lightning, jsonargparse, torch and Python, so it is stored in
``help_pages/<command>.txt`` as the parser prints it at 80 columns, with the versions it was made with in
``help_pages/versions.json``, and printed from there when those versions are the installed ones and the terminal
has 80 columns or more. Anything else (``--config x.yaml --help``, which shows that file's values, or
``--model.backbone.help GPT``) goes to the parser. ``tests/test_help_pages.py`` holds the stored pages to what the
parser prints; after changing an argument, its help or a pinned version, rewrite them:

    python -m ltcx.cli.help_pages
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PAGES = Path(__file__).with_name("help_pages")
COMMANDS = ("fit", "validate", "test", "predict")
COLUMNS = 80
PROG = "ltcx"  # the program name the pages are written with; the first line is given the one that runs


def installed_versions() -> dict[str, str]:
    """The versions a page depends on: Python's (its argparse lays the page out) and the packages that make it."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for package in ("lightning", "jsonargparse", "torch"):
        try:
            versions[package] = version(package).split("+")[0]  # 2.13.0+cpu: the CPU build of 2.13.0
        except PackageNotFoundError:
            versions[package] = "missing"
    return versions


def current_page(command: str) -> str | None:
    """``command``'s stored page if it is what the parser would print with the installed versions, else ``None``."""
    if command not in COMMANDS:
        return None
    try:
        recorded = json.loads((PAGES / "versions.json").read_text())
        page = (PAGES / f"{command}.txt").read_text()
    except (OSError, ValueError):
        return None
    return page if recorded == installed_versions() else None


def stored_page(command: str, args: list[str], prog: str) -> str | None:
    """The stored ``--help`` page of ``command`` when ``args`` asks for exactly it and the page is what the parser
    would print here; ``None`` sends the command line to the parser."""
    if args not in (["--help"], ["-h"]):
        return None
    if shutil.get_terminal_size().columns < COLUMNS:  # the parser wraps to the narrower terminal
        return None
    page = current_page(command)
    if page is None:
        return None
    first, newline, rest = page.partition("\n")
    return first.replace(f"usage: {PROG} ", f"usage: {prog} ", 1) + newline + rest


def page_options(page: str) -> frozenset[str]:
    """The option strings a help page lists (``-c``, ``--config``, ``--trainer.max_steps``, ``--data.help``): the
    start of each line that begins an option, before the two spaces that begin its help."""
    options = set()
    for line in page.splitlines():
        if line.startswith("  -"):
            invocation = line[2:].split("  ")[0]
            options.update(re.findall(r"(?:^|, )(-{1,2}[\w.]+)", invocation))
    return frozenset(options)


def render_pages() -> dict[str, str]:
    """Each command's ``--help`` as LightningCLI prints it, in one fresh interpreter (the known subclasses it lists
    are those its imports define, not a test session's)."""
    script = (
        "import contextlib, io, json, sys\n"
        "from ltcx.cli.lightning import cli_main\n"
        "pages = {}\n"
        f"for command in {list(COMMANDS)!r}:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            cli_main([command, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    pages[command] = out.getvalue()\n"
        "sys.__stdout__.write(json.dumps(pages))\n"
    )
    env = {**os.environ, "COLUMNS": str(COLUMNS), "LINES": "50"}
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = [{PROG!r}]\n{script}"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def write_pages() -> None:
    """Rewrite ``help_pages/`` from the parser and the installed versions."""
    PAGES.mkdir(exist_ok=True)
    for command, page in render_pages().items():
        (PAGES / f"{command}.txt").write_text(page)
    (PAGES / "versions.json").write_text(json.dumps(installed_versions(), indent=2) + "\n")
    print(f"wrote {', '.join(f'{c}.txt' for c in COMMANDS)} and versions.json to {PAGES}")


if __name__ == "__main__":
    write_pages()
