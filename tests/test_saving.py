"""Writing checkpoints and exports: the final step, atomic saves (full disk, kill -9 mid-save, `save_last: link`,
file:// paths, an export onto a full disk), stale temp files, `keep_runs` retention and `default_root_dir`."""

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    ROOT,
    assert_mentions,
    lean_fit_args,
    one_error_line,
    step_and_weights,
    write_checkpoint,
)
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.persist import SafeCheckpointIO, atomic_save, read_checkpoint


def test_final_step_saved_after_periodic_saves(tmp_path, fit_env):
    data = fit_env
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", "5", every=2))
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_0/last.ckpt")[0] == 5



def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, fit_env, monkeypatch, capsys):
    """The disk fills after the saves of step 1: step 2's first save (its top-k file) fails with one line, which
    is true: nothing of step 2 is on disk, and step 1's files are intact."""
    data = fit_env
    folder = tmp_path / "checkpoints/gpt/version_0"
    last = folder / "last.ckpt"
    real_fsync, saved = os.fsync, {}

    def full_disk(fd):
        if last.is_file() and stat.S_ISREG(os.fstat(fd).st_mode):  # a file's data, not its folder's rename
            saved.setdefault("before", last.read_bytes())
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr("ltcx.persist.files.os.fsync", full_disk)
    line = one_error_line(lean_fit_args(tmp_path, data, "--trainer.max_steps", "3", every=1), capsys)
    assert_mentions(line, f"cannot write checkpoint '{folder / 'epoch=0-step=2.ckpt'}'", "disk full",
                    "nothing was written", "free space", "dirpath")
    assert last.read_bytes() == saved["before"] and step_and_weights(last)[0] == 1
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # no temp file left
    with pytest.raises(LtcxError, match="previous checkpoint .*intact"):  # an existing name: its old file
        atomic_save({"new": torch.ones(3)}, last)
    assert last.read_bytes() == saved["before"]



KILLED_MID_SAVE = """
import os, signal, sys, torch
import ltcx.persist.files as c
def die(*args):  # the new file is written and synced, the rename not done
    os.kill(os.getpid(), signal.SIGKILL)
c.os.replace = die
c.atomic_save({"new": torch.ones(3)}, sys.argv[1])
"""



def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_save({"old": torch.zeros(3)}, target)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(target)], cwd=ROOT, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    [temp] = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")]  # same folder, hidden
    assert torch.load(target, weights_only=True)["old"].eq(0).all()
    atomic_save({"newer": torch.ones(3)}, target)  # the next save clears the dead process's temp file
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(target, weights_only=True)["newer"].eq(1).all()



def test_temp_files_of_killed_saves_are_removed_when_a_run_starts(tmp_path, fit_env):
    """A resumed run saves in a new folder: the temp file a kill left in the old one goes when the run starts."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1"))
    folder = tmp_path / "checkpoints/gpt/version_0"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, alive = folder / f".last.ckpt.tmp-{int(dead.stdout)}", folder / f".last.ckpt.tmp-{os.getpid()}"
    stale.write_bytes(b"half a checkpoint"), alive.write_bytes(b"being written")
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "2", "--ckpt_path", "last"))
    assert not stale.exists() and alive.exists()  # a running process's file is its own



def test_keep_runs_deletes_the_checkpoints_of_older_runs_of_a_resumed_chain(tmp_path, fit_env, capsys):
    """Default keep_runs 2: a resume keeps its own and its parent's files and deletes its older ancestors' once it
    has saved; a run it does not descend from is never touched; the file resumed from stays until this run saved."""
    folder = tmp_path / "checkpoints/gpt"

    def fit(steps: int, ckpt_path: str, *extra: str, keep_runs: str = "") -> None:
        main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", str(steps), "--ckpt_path", ckpt_path, *extra,
                           keep_runs=keep_runs))

    def files() -> list[str]:
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.ckpt"))

    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1"))  # version_0
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1"))  # version_1: another run, fresh
    fit(2, str(folder / "version_0/last.ckpt"))  # version_2, resumed from version_0
    fit(3, "last")  # version_3, from version_2: version_0 goes
    assert files() == ["version_1/last.ckpt", "version_2/last.ckpt", "version_3/last.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == ["version_1", "version_2", "version_3"]
    notices = [line for line in capsys.readouterr().err.splitlines() if "removed" in line]
    assert notices == [f"ltcx: removed version_0/last.ckpt from {folder}: checkpoints of runs before the last 2 "
                       "(ModelCheckpoint keep_runs; null keeps them)"]
    one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "6", "--ckpt_path", "last",
                                 "--trainer.callbacks+=fault_injection.PoisonWeights", "--trainer.callbacks.at_step=4",
                                 keep_runs="1"), capsys)  # stops (NaN) before its first save: nothing deleted
    assert files() == ["version_1/last.ckpt", "version_2/last.ckpt", "version_3/last.ckpt"]
    fit(4, "last", keep_runs="1")  # version_5 (the failed run logged as version_4)
    assert [f for f in files() if f != "version_1/last.ckpt"] == ["version_5/last.ckpt"]
    assert step_and_weights(folder / "version_5/last.ckpt")[0] == 4



def test_keep_runs_must_be_positive(tmp_path, fit_env, capsys):
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1", keep_runs="0"), capsys)
    assert_mentions(line, "ModelCheckpoint keep_runs (0)", ">= 1", "null: keep every run's checkpoints",
                    "init_args.keep_runs")



def test_save_last_link_replaces_last_whole_even_when_copying(tmp_path, monkeypatch):
    """``save_last: link`` where links fail copies the top-k file: a full disk midway keeps the old last.ckpt
    (Lightning removed it first and left half a copy)."""
    from types import SimpleNamespace

    from ltcx.callbacks import ModelCheckpoint

    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda *a: None))
    top, last = tmp_path / "epoch=0-step=2.ckpt", tmp_path / "last.ckpt"
    top.write_bytes(b"new" * 1000), last.write_bytes(b"old")
    ModelCheckpoint._link_checkpoint(trainer, str(top), str(last))
    assert last.is_symlink() and last.read_bytes() == top.read_bytes()
    last.unlink(), last.write_bytes(b"old")

    def no_links(*args):
        raise OSError(errno.EPERM, "links not supported")

    def half_copy(source, target):
        Path(target).write_bytes(Path(source).read_bytes()[:1000])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "symlink", no_links)
    monkeypatch.setattr(shutil, "copyfile", half_copy)
    with pytest.raises(LtcxError) as raised:
        ModelCheckpoint._link_checkpoint(trainer, str(top), str(last))
    assert_mentions(str(raised.value), "last.ckpt'", "disk full", "previous checkpoint there is intact")
    assert last.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [top.name, "last.ckpt"]
    monkeypatch.undo()
    monkeypatch.setattr(os, "symlink", no_links)
    ModelCheckpoint._link_checkpoint(trainer, str(top), str(last))
    assert not last.is_symlink() and last.read_bytes() == top.read_bytes()



def test_file_url_saves_atomically(tmp_path, monkeypatch):
    """A ``file://`` path is a local file: written through the same temp file and rename (fsspec would stage it in
    /tmp and copy it over, leaving half a file when the disk fills)."""
    target = tmp_path / "epoch=0-step=2.ckpt"
    SafeCheckpointIO().save_checkpoint({"ltcx": {}, "w": torch.ones(3)}, f"file://{target}")
    assert read_checkpoint(target)["w"].eq(1).all()
    target.unlink()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("ltcx.persist.files.os.fsync", full_disk)
    with pytest.raises(LtcxError, match=r"\(disk full\); nothing was written"):
        SafeCheckpointIO().save_checkpoint({"ltcx": {}, "w": torch.ones(3)}, f"file://{target}")
    assert not list(tmp_path.iterdir())



def test_default_root_dir_holds_logs_and_checkpoints(tmp_path, fit_env):
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1", "--trainer.default_root_dir", "runs"))
    assert (tmp_path / "runs/checkpoints/gpt/version_0/last.ckpt").is_file()
    assert (tmp_path / "runs/lightning_logs/gpt/version_0/config.yaml").is_file()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "lightning_logs").exists()


@pytest.fixture
def umask(request):
    """The process umask set to the test's parameter, restored after."""
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], indirect=True, ids=["022", "077", "002"])
def test_saved_files_have_the_permissions_the_umask_gives(tmp_path, umask):
    """Checkpoints, copies, exports and prepared shards are readable as any file the user writes (0o666 less the
    umask): safetensors writes through a 0o600 temp file, which would make an exported model private."""
    from ltcx.data.shard_format import write_json, write_shard
    from ltcx.lm import LanguageModel
    from ltcx.persist import atomic_copy, export_model
    from ltcx.persist.files import current_umask

    assert current_umask() == umask
    expected = 0o666 & ~umask
    atomic_save({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    atomic_copy(str(tmp_path / "a.ckpt"), str(tmp_path / "last.ckpt"))
    SafeCheckpointIO().save_checkpoint({"ltcx": {}, "w": torch.ones(3)}, str(tmp_path / "b.ckpt"))
    export = export_model(write_checkpoint(tmp_path / "good.ckpt"), tmp_path / "export", model_class=LanguageModel)
    write_shard(str(tmp_path / "shard.bin"), torch.arange(5).numpy().astype("uint16"), 1)
    write_json(str(tmp_path / "meta.json"), {})
    written = [tmp_path / name for name in ("a.ckpt", "last.ckpt", "b.ckpt", "shard.bin", "meta.json")]
    for path in [*written, export / "model.safetensors", export / "config.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path.name, oct(path.stat().st_mode))
    assert stat.S_IMODE(export.stat().st_mode) == 0o777 & ~umask
    assert current_umask() == umask  # reading it changed nothing


@pytest.mark.parametrize("fails", ["weights", "config"])
def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, fails):
    """`ltcx export` onto a full disk: safetensors' own write error (weights), or config.json's data not reaching
    the disk (its fsync), is one line naming the folder; no temp folder, no lone config.json, no empty folder made
    for it is left."""
    import safetensors.torch
    from safetensors import SafetensorError

    checkpoint = write_checkpoint(tmp_path / "good.ckpt")
    out = tmp_path / "exports" / "model"
    real_fsync = os.fsync

    def half_written(tensors, filename, metadata=None):  # safetensors' Rust writer on ENOSPC
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("config.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    if fails == "weights":
        monkeypatch.setattr(safetensors.torch, "serialize_file", half_written)
    else:
        monkeypatch.setattr(os, "fsync", full_disk)
    capsys.readouterr()
    line = one_error_line(["export", "--ckpt_path", str(checkpoint), "--out", str(out)], capsys)
    assert_mentions(line, f"cannot write '{out}'", "disk full", "nothing was written", "free space",
                    "--out a folder on another disk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]


@pytest.mark.parametrize("writer", ["atomic_write_text", "study json", "study figure"])
def test_two_processes_writing_one_file_at_once_both_finish_and_leave_a_whole_file(tmp_path, monkeypatch, writer):
    """Two launchers finishing one study write its report at the same moment: each through a temp file of its own
    process, so neither's rename finds its temp file taken by the other (a shared ``state.tmp.png`` did: CI)."""
    import matplotlib.pyplot as plt

    import ltcx.persist.files as files
    from ltcx.study import report

    target = tmp_path / ("state.png" if writer == "study figure" else "summary.json")

    def write(content: str) -> None:
        if writer == "atomic_write_text":
            files.atomic_write_text(target, content)
        elif writer == "study json":
            report.write_json(target, content)
        else:
            figure = plt.figure()
            figure.suptitle(content)
            report._save(figure, target)

    real_replace, real_getpid, done = os.replace, os.getpid, []

    def replace(source, destination):  # just before this process's rename, another process writes the same file
        if not done:
            done.append(True)
            monkeypatch.setattr(os, "getpid", lambda: real_getpid() + 1)
            try:
                write("other")
            finally:
                monkeypatch.setattr(os, "getpid", real_getpid)
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    write("mine")
    assert done and sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temp file of either left
    if writer == "study figure":
        assert target.read_bytes().startswith(b"\x89PNG")
    else:
        assert "mine" in target.read_text()


def test_a_file_write_onto_a_full_disk_is_one_line_and_keeps_the_previous_file(tmp_path, monkeypatch):
    from ltcx.persist.files import atomic_write_text

    target = tmp_path / "summary.md"
    target.write_text("before")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(LtcxError) as raised:
        atomic_write_text(target, "after", "free space or pass --out another folder")
    assert_mentions(str(raised.value), f"cannot write file '{target}'", "disk full", "previous file there is intact",
                    "free space or pass --out another folder")  # the fix the caller gave
    assert target.read_text() == "before" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.md"]


def test_an_export_removes_the_temp_folders_of_exports_to_it_that_were_killed(tmp_path, capsys):
    """A killed `ltcx export` leaves its temp folder (``.<name>.tmp-<pid>``) beside the target; the next export to
    that target removes it, and only it: not a running export's, not another target's."""
    checkpoint = write_checkpoint(tmp_path / "good.ckpt")
    out = tmp_path / "exports" / "model"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(finished.stdout)  # a process that has exited
    killed, running, other = (out.parent / f".model.tmp-{gone}", out.parent / f".model.tmp-{os.getppid()}",
                              out.parent / f".other.tmp-{gone}")  # getppid: a process that runs
    for folder in (killed, running, other):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 10)
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(out)])
    capsys.readouterr()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([running.name, other.name, "model"])
