"""Opening text: a Hugging Face hub data set or local files, both as ``datasets`` streaming ``IterableDataset`` s.

Shared by the streaming data module and ``ltcx prepare``; every problem is one ``LtcxError`` line.
"""

from __future__ import annotations

from typing import Any

from ltcx.data.files import LocalFiles, looks_local, resolve_local_files
from ltcx.errors import ConfigError, LtcxError
from ltcx.hub import hub_unreachable
from ltcx.tokenizers import _short_reason

__all__ = ["check_text", "file_being_read", "hub_error", "open_hub", "open_local", "open_text"]


def file_being_read(exc: BaseException) -> str | None:
    """The file a `datasets` builder was reading when ``exc`` was raised: its json, text and parquet builders
    all loop ``for file in files``, and the error itself does not name it."""
    file, tb = None, exc.__traceback__
    while tb is not None:
        if "packaged_modules" in tb.tb_frame.f_code.co_filename and isinstance(tb.tb_frame.f_locals.get("file"), str):
            file = tb.tb_frame.f_locals["file"]
        tb = tb.tb_next
    return file


def hub_error(path: str, reason: str, flag: str = "--data.path") -> LtcxError:
    return LtcxError(
        f"cannot load data set '{path}' from the Hugging Face hub ({reason}); offline? use {flag} sample "
        f"(a TinyStories sample shipped with ltcx) or point {flag} at local .txt/.jsonl/.parquet files"
    )


def open_local(
    path: str, *, txt_sample_by: str, validation: bool = True, test: bool = True, flag: str = "--data.path"
) -> tuple[Any, Any, Any, str]:
    """``(train, validation or None, test or None, description)`` of local files; ``validation=False`` reads every
    file, validation-named ones included, as one training stream; ``test=False`` leaves the test-named files beside
    validation-named ones out (they never train). ``flag``: the option that set ``path``, for messages."""
    import datasets

    files: LocalFiles = resolve_local_files(path, flag)
    data_files = {"train": files.train if validation else files.train + files.validation}
    if validation and files.validation:
        data_files["validation"] = files.validation
    if test and files.test:
        data_files["test"] = files.test
    kwargs: dict[str, Any] = {"sample_by": txt_sample_by} if files.builder == "text" else {}
    what = f"data files '{path}'"
    try:
        dd = datasets.load_dataset(files.builder, data_files=data_files, streaming=True, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise LtcxError(
            f"cannot read {what} ({_short_reason(exc)}): check that they are valid {files.kind} files"
        ) from exc
    return dd["train"], dd.get("validation"), dd.get("test"), what


def open_hub(
    path: str, name: str | None, train_split: str, val_split: str | None, test_split: str | None = None,
    *, flags: tuple[str, str] = ("--data.path", "--data.train_split"),
) -> tuple[Any, Any, Any, str]:
    """``(train, validation or None, test or None, description)`` of a hub data set, streamed; a missing
    ``val_split`` or ``test_split`` is None. ``flags``: the options that set the data set and the split, as messages
    name them."""
    import datasets

    source, split_flag = flags
    unreachable = hub_unreachable()
    if unreachable:  # say so now, not after `datasets` has retried for a minute
        raise hub_error(path, unreachable, source)
    try:
        dd = datasets.load_dataset(path, name, streaming=True)
    except Exception as exc:  # noqa: BLE001
        raise hub_error(path, _short_reason(exc), source) from exc
    what = f"data set '{path}'" + (f" ({name})" if name else "")
    if train_split not in dd:
        raise ConfigError(f"{what} has no split '{train_split}' (splits: {', '.join(dd)}): set {split_flag}")

    def split(wanted: str | None) -> Any:
        return dd[wanted] if wanted and wanted in dd else None

    return dd[train_split], split(val_split), split(test_split), what


def open_text(
    path: str, *, name: str | None, train_split: str, val_split: str | None, test_split: str | None,
    txt_sample_by: str, text_column: str,
) -> tuple[Any, Any, Any, str]:
    """Local files or a hub data set (``val_split`` / ``test_split`` None: no such stream), each split checked."""
    if looks_local(path):
        train, val, test, what = open_local(path, txt_sample_by=txt_sample_by, validation=val_split is not None,
                                            test=test_split is not None)
    else:
        if test_split is not None and test_split in (train_split, val_split):
            which = "training split" if test_split == train_split else "validation split (--data.val_split)"
            raise ConfigError(f"--data.test_split '{test_split}' is the {which}: pass another split, or null to "
                              "hold out --data.test_fraction of the training documents by hash")
        train, val, test, what = open_hub(path, name, train_split, val_split, test_split)
    check_text(train, path, what, text_column, split="train")
    for ds, split in ((val, "validation"), (test, "test")):
        if ds is not None:
            check_text(ds, path, what, text_column, split=split)
    return train, val, test, what


def check_text(
    ds: Any, path: str, what: str, text_column: str, *, split: str,
    flags: tuple[str, str] = ("--data.path", "--data.text_column"),
) -> None:
    """Peek at the first examples: the text column exists and some document is non-empty. ``flags``: the options
    that set the data and the column, as messages name them."""
    path_flag, column_flag = flags
    try:
        found_column = False
        for example in ds:
            if text_column not in example:
                cols = ", ".join(repr(c) for c in example)
                raise LtcxError(
                    f"column '{text_column}' not found in the {split} split of {what} (columns: {cols}): "
                    f"set {column_flag}"
                )
            found_column = True
            text = example[text_column]
            if isinstance(text, str) and text.strip():
                return
    except LtcxError:
        raise
    except Exception as exc:  # noqa: BLE001
        if not looks_local(path):
            raise hub_error(path, _short_reason(exc), path_flag) from exc
        file = file_being_read(exc)
        if file is not None:
            raise LtcxError(f"cannot read data file '{file}' ({_short_reason(exc)}): fix or remove it") from exc
        raise LtcxError(f"cannot read {what} ({_short_reason(exc)}): check that the files are valid") from exc
    detail = f"every document in column '{text_column}' is empty" if found_column else "it has no documents"
    raise LtcxError(f"no text in the {split} split of {what}: {detail}; point {path_flag} at files with text")
