"""The files a study reads back, read as data: ``spec.json``, each run's ``result.json`` and ``test.json``, the
``test_metrics.json`` a fit or a test wrote, ``timing.json`` and a long-context run's ``done.json``. A crash, a full
disk or a hand may have damaged any of them, so each is checked on read (JSON, an object, every key it needs, each
value's type, range and finiteness) by ``read_json_record``; a damaged one is one ``DamagedRecord`` line naming the
file, what is wrong and the fix, never a traceback or a number in a table.

A run's claim file (``launch.try_claim``) is not read: its lock, not its text, is the claim.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ltcx.errors import LtcxError

__all__ = ["DamagedRecord", "Field", "RESULT_FIELDS", "TIMING_FIELDS", "read_json_record", "read_done", "read_metrics",
           "read_result", "read_spec_record", "read_test", "run_fix"]


class DamagedRecord(LtcxError):
    """A study's own file that is not what ltcx wrote: ``path``, ``problem`` and ``fix`` (all in the one line)."""

    def __init__(self, path: Path, problem: str, fix: str) -> None:
        super().__init__(f"{path} is damaged ({problem}): {fix}")
        self.path, self.problem, self.fix = path, problem, fix


@dataclass(frozen=True)
class Field:
    """One key of a record: ``what`` it must be (said when it is not) and the test ``ok``; ``required`` or not."""

    what: str
    ok: Callable[[Any], bool]
    required: bool = True


# ----------------------------------------------------------------------------- value tests


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any, low: float = -math.inf, above: float | None = None) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= low and (above is None or value > above)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_mapping(value: Any, ok: Callable[[Any], bool] = lambda v: True) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and ok(v) for k, v in value.items())


def _or_none(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or ok(value)


def _is_curve(value: Any) -> bool:
    """[[tokens, value], ...]: tokens finite and >= 0; a value may be non-finite (a diverged run's last ones)."""
    return isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and _is_finite(p[0], 0)
                                           and _is_number(p[1]) for p in value)


# ----------------------------------------------------------------------------- the reader


def read_json_record(path: Path, fields: dict[str, Field], fix: str,
                     rule: Callable[[dict], str | None] | None = None) -> dict:
    """The JSON object in ``path`` with every one of ``fields`` as it says (keys not listed are left as they are),
    and ``rule`` (the relations between keys: a problem's words, or None) kept; else ``DamagedRecord`` naming the
    problem and ``fix``. A missing file is ``FileNotFoundError``, left to the caller (not done yet is not damage)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError:
        raise DamagedRecord(path, "not UTF-8 text", fix) from None
    except OSError as error:
        raise DamagedRecord(path, f"cannot be read: {error.strerror or error}", fix) from None
    try:
        record = json.loads(text)
    except ValueError:  # JSONDecodeError, or a number too long to convert
        raise DamagedRecord(path, "not JSON: cut short or edited", fix) from None
    if not isinstance(record, dict):
        raise DamagedRecord(path, f"a JSON {type(record).__name__}, not an object", fix)
    for key, field in fields.items():
        if key not in record:
            if field.required:
                raise DamagedRecord(path, f"no '{key}'", fix)
            continue
        if not field.ok(record[key]):
            raise DamagedRecord(path, f"'{key}' is {_shown(record[key])}, not {field.what}", fix)
    problem = rule(record) if rule else None
    if problem:
        raise DamagedRecord(path, problem, fix)
    return record


def _shown(value: Any) -> str:
    """A value in the one line: short (a record's values came from JSON, so JSON shows each)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------- a study's records


def run_fix(folder: Path) -> str:
    return f"delete that run's folder {folder} to retrain it"


RESULT_FIELDS = {
    "arch": Field("a name", _is_text),
    "size": Field("a number >= 0", lambda v: _is_finite(v, 0)),
    "size_label": Field("a label", _is_text),
    "lr": Field("a learning rate > 0", lambda v: _is_finite(v, above=0)),
    "seed": Field("an integer >= 0", _is_int),
    "steps": Field("an integer >= 1", lambda v: _is_int(v, 1)),
    "tokens": Field("an integer >= 1", lambda v: _is_int(v, 1)),
    "diverged": Field("true or false", lambda v: isinstance(v, bool), required=False),
    "val": Field("a mapping of metric names to finite numbers", lambda v: _is_mapping(v, _is_finite)),
    "curves": Field("a mapping of metric names to [[tokens, value], ...]", lambda v: _is_mapping(v, _is_curve)),
    "cell": Field("a mapping", _or_none(_is_mapping), required=False),
    "init_args": Field("a mapping", _or_none(_is_mapping), required=False),
    "distance": Field("a finite number", _or_none(_is_finite), required=False),
    "params": Field("an integer >= 0", _or_none(_is_int), required=False),
    "flops_per_token": Field("a finite number >= 0", _or_none(lambda v: _is_finite(v, 0)), required=False),
    "state_bytes": Field("an integer >= 0", _or_none(_is_int), required=False),
    "checkpoint": Field("a path", _or_none(_is_text), required=False),
}


def read_result(run, out: Path) -> dict:
    """``run``'s ``result.json`` (``processes.train`` writes it), checked, and its own: the architecture, size, rate
    and seed its folder names."""
    folder = run.folder(out)
    own = {"arch": run.arch, "size_label": run.shape.label, "lr": run.lr, "seed": run.seed}

    def rule(record: dict) -> str | None:
        other = [key for key, value in own.items() if record[key] != value]
        return f"it holds {other[0]} {record[other[0]]!r} but its folder is {own[other[0]]!r}'s" if other else None

    return read_json_record(folder / "result.json", RESULT_FIELDS, run_fix(folder), rule)


def _metrics_rule(metric: str) -> Callable[[dict], str | None]:
    def rule(record: dict) -> str | None:
        return None if f"test/{metric}" in record else f"no 'test/{metric}'"

    return rule


def read_test(run, out: Path, metric: str) -> dict:
    """``run``'s ``test.json``: test metric names to finite numbers, ``test/<metric>`` among them."""
    folder = run.folder(out)
    path = folder / "test.json"
    record = read_json_record(path, {}, run_fix(folder), _metrics_rule(metric))
    bad = [key for key, value in record.items() if not _is_finite(value)]
    if bad:
        raise DamagedRecord(path, f"'{bad[0]}' is {_shown(record[bad[0]])}, not a finite number", run_fix(folder))
    return record


def read_metrics(path: Path, folder: Path) -> dict[str, float]:
    """The numbers of a ``test_metrics.json`` a fit or a test of the run in ``folder`` wrote (each finite)."""
    record = read_json_record(path, {}, run_fix(folder))
    bad = [key for key, value in record.items() if _is_number(value) and not math.isfinite(value)]
    if bad:
        raise DamagedRecord(path, f"'{bad[0]}' is {_shown(record[bad[0]])}, not a finite number", run_fix(folder))
    return {key: float(value) for key, value in record.items() if _is_number(value)}


def read_spec_record(path: Path) -> dict:
    """A study folder's ``spec.json`` (``runner.run_study`` writes ``StudySpec.defining()``): an object."""
    return read_json_record(path, {}, "delete it and run `ltcx study` again with the very spec this study was made "
                                      "with (spec.json is written again from it; the finished runs are kept)")


TIMING_FIELDS = {
    "device": Field("a device's name", _is_text),
    "precision": Field("a precision's name", _is_text),
    "rounds": Field("an integer >= 0", _is_int),
    "batch_size": Field("an integer >= 1", lambda v: _is_int(v, 1)),
    "checkpoints": Field("a mapping", _is_mapping),
    "models": Field("a mapping of rows to positive finite speeds", lambda v: _is_mapping(v, lambda m: _is_mapping(m)
                    and all(_is_finite(m.get(k), above=0) for k in ("tokens_per_sec", "decode_ms_per_token")))),
    "load_averages": Field("a list of finite numbers >= 0", lambda v: isinstance(v, list)
                           and all(_is_finite(x, 0) for x in v)),
    "load_average_max": Field("a finite number >= 0", lambda v: _is_finite(v, 0)),
    "usable_cores": Field("an integer >= 1", lambda v: _is_int(v, 1)),
    "speed_unreliable": Field("true or false", lambda v: isinstance(v, bool)),
}


def read_done(folder: Path) -> Path:
    """The checkpoint a long-context run's ``done.json`` names (relative to ``folder``, inside it)."""
    def inside(value: Any) -> bool:
        return _is_text(value) and not Path(value).is_absolute() and ".." not in Path(value).parts

    record = read_json_record(folder / "done.json", {"checkpoint": Field("a path inside the run's folder", inside)},
                              run_fix(folder))
    return folder / record["checkpoint"]
