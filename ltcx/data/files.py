"""Local data files: resolve a file / folder / glob, pick the `datasets` builder, assign files to splits."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

from ltcx.errors import LtcxError

__all__ = ["LocalFiles", "SAMPLE", "file_kind", "local_path", "looks_local", "resolve_local_files"]

# `--data.path sample`: the TinyStories sample shipped in the package (ltcx/data/sample/README.md), unless a
# file or folder named "sample" exists in the working directory: the user's own data always wins.
SAMPLE = "sample"
SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample")

# extension -> `datasets` packaged builder
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# A path component naming a split: word-bounded so that e.g. "interval.txt" or "latest.txt" stay training files.
_VAL_RE = re.compile(r"(?<![a-z])(?:val|valid|validation)(?![a-z])")
_TEST_RE = re.compile(r"(?<![a-z])test(?![a-z])")

_NO_MATCH = "no data files match '{path}': pass {flag} a file, folder or glob of .txt/.jsonl/.parquet files"


def file_kind(path: str) -> str | None:
    """The data-file extension of ``path`` (``.txt``, ``.jsonl``, ``.json``, ``.parquet``), ignoring a compression
    suffix such as ``.gz``; ``None`` if it is not a data file."""
    name = os.path.basename(path).lower()
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    ext = os.path.splitext(name)[1]
    return ext if ext in _BUILDERS else None


def local_path(path: str) -> str:
    """``path`` as a local file system path: ``sample`` is the built-in sample unless ``./sample`` exists."""
    if path == SAMPLE and not os.path.exists(SAMPLE):
        return SAMPLE_DIR
    return os.path.expanduser(path)


def looks_local(path: str) -> bool:
    """Whether ``path`` means local files (or the built-in sample) rather than a Hugging Face hub data set id."""
    if path == SAMPLE:
        return True
    p = os.path.expanduser(path)
    if os.path.exists(p) or glob.has_magic(p):
        return True
    if os.path.isabs(p) or p.startswith(("./", "../", "~")):
        return True
    return _path_like(p)


def _path_like(p: str) -> bool:
    """A name no hub id (``name`` or ``namespace/name``) has, so a mistyped or missing local path gets the
    local-files error and is never sent to the hub: a trailing or repeated slash, a backslash, more than one
    slash, an extension with a letter (``corpus.txt``; hub names may end in a version like ``-3.1``), or a parent
    folder that exists here (``data/local`` with ``./data``)."""
    parts = p.split("/")
    if "\\" in p or len(parts) > 2 or "" in parts or file_kind(p) is not None:
        return True
    if re.fullmatch(r"\.[0-9]*[A-Za-z][A-Za-z0-9]*", os.path.splitext(parts[-1])[1] or ".0"):
        return True
    return len(parts) == 2 and os.path.isdir(parts[0])


@dataclass
class LocalFiles:
    """Resolved local data: the `datasets` builder, its extra arguments and the files of each split."""

    builder: str
    train: list[str]
    validation: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)  # test-named files beside validation-named ones
    kind: str = ""  # the extension, for messages


def _is_hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split(os.sep) if part not in (".", ".."))


def _split_of(rel: str) -> str:
    low = rel.lower()
    if _VAL_RE.search(low):
        return "validation"
    if _TEST_RE.search(low):
        return "test"
    return "train"


def resolve_local_files(path: str, flag: str = "--data.path") -> LocalFiles:
    """Resolve ``path`` (a file, a folder searched recursively, or a glob) to data files and assign them to splits.

    Files whose path below the folder (or whose name) contains ``val``/``valid``/``validation`` as a word go to
    validation; if there are none, files named ``test`` do, else those are the test split; files named ``test``
    never go to training. A single
    file, or a set without a validation-named file, is training data only. Hidden files and files of other types
    in a folder or glob are ignored; mixing types, and an empty file, are errors, which name ``flag`` (the
    caller's option that set ``path``) as the fix.
    """
    p = local_path(path)
    if os.path.isfile(p):
        if file_kind(p) is None:
            raise LtcxError(
                f"unsupported data file type '{path}': pass {flag} .txt, .jsonl, .json or .parquet files"
            )
        base, files = os.path.dirname(p), [p]
    elif os.path.isdir(p):
        base, files = p, []
        for root, dirs, names in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
    elif glob.has_magic(p):
        files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
        base = os.path.commonpath([os.path.dirname(f) for f in files]) if files else ""
    else:
        raise LtcxError(_NO_MATCH.format(path=path, flag=flag))

    files = [f for f in files if file_kind(f) is not None and not _is_hidden(os.path.relpath(f, base or "."))]
    if not files:
        raise LtcxError(_NO_MATCH.format(path=path, flag=flag))
    kinds = sorted({_BUILDERS[file_kind(f)] for f in files})  # type: ignore[index]
    if len(kinds) > 1:
        exts = ", ".join(sorted({file_kind(f) for f in files}))  # type: ignore[misc]
        raise LtcxError(
            f"data files of different types under '{path}' ({exts}): point {flag} at one type, "
            "e.g. a glob like 'folder/**/*.txt'"
        )
    for f in files:
        if os.path.getsize(f) == 0:
            raise LtcxError(f"data file '{f}' is empty: put text in it, delete it, or point {flag} elsewhere")

    kind = file_kind(files[0]) or ""
    if len(files) == 1:
        return LocalFiles(builder=kinds[0], train=files, kind=kind)
    by_split: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for f in files:
        by_split[_split_of(os.path.relpath(f, base or "."))].append(f)
    validation = by_split["validation"] or by_split["test"]
    test = by_split["test"] if by_split["validation"] else []
    if not by_split["train"]:  # only validation/test-named files: use them all for training (and hold out)
        return LocalFiles(builder=kinds[0], train=files, kind=kind)
    return LocalFiles(builder=kinds[0], train=by_split["train"], validation=validation, test=test, kind=kind)
