"""Errors a user can cause (the CLI prints them as one line and exits non-zero), and the one-line notices ltcx
prints where it runs something other than what was asked for, the same function (``notice_once``)."""

from __future__ import annotations

import sys

from lightning_utilities.core.rank_zero import rank_zero_only

_notices_given: set[str] = set()


def notice_once(text: str) -> None:
    """One ``ltcx:`` line on stderr, once per process, from the first process only."""
    if text not in _notices_given and getattr(rank_zero_only, "rank", 0) == 0:
        _notices_given.add(text)
        print(f"ltcx: {text}", file=sys.stderr)


class LtcxError(Exception):
    """A problem with the user's input (config, files, data, prompt) whose message names the fix."""


class ConfigError(LtcxError, ValueError):
    """An impossible configuration value; the message names the field and the rule."""


class StoppedOnAllRanks(LtcxError):
    """An error every process of a distributed run raised at the same step; only global rank 0 prints it."""


# The fix named by every message about a file written by another version of ltcx.
ANOTHER_VERSION = "load it with the version that wrote it, or start a new run"


def missing_checkpoint(name: str) -> LtcxError:
    """The one line for a ``--ckpt_path`` that names nothing (checked by the commands before their slow imports)."""
    shown = name if name.isprintable() else repr(name)[1:-1]  # a newline in it would break the one line
    return LtcxError(f"checkpoint '{shown}' does not exist: pass --ckpt_path the path of a .ckpt file")


def refuse_bad_settings(section: str, checks: list[tuple[bool, str, object, str]]) -> None:
    """``checks``: ``(ok, key, value, rule)``; the first not ok is one ``ConfigError`` line naming
    ``--{section}.{key}`` (e.g. ``data.batch_size=0 must be >= 1: fix --data.batch_size``)."""
    for ok, key, value, rule in checks:
        if not ok:
            raise ConfigError(f"{section}.{key}={value!r} {rule}: fix --{section}.{key}")
