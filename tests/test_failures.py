"""The failure catalogue: crafted, damaged and wrong-typed files, non-finite losses and weights, interrupted and
failing saves, retention, signals, shared folders, bad flags and config files, offline, default_root_dir. Each case
asserts the exact outcome: the message, the exit code, and which files exist and are intact."""

import errno
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    ROOT,
    fit_args,
    lean_fit_args,
    one_error_line,
    run_cli,
    step_and_weights,
    write_checkpoint,
    write_corpus,
)
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models import registry
from ltcx.models.gpt import GPT
from ltcx.models.ltc import LTCGPT
from ltcx.persist import SafeCheckpointIO, atomic_save, load_language_model, read_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "good.ckpt")


# -- 1, 2: files a user hands us are data, never code ----------------------------------------------------------


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["torch.save", "plain pickle"])
def test_pickle_payload_runs_no_code(tmp_path, capsys, kind):
    marker, path = tmp_path / "pwned", tmp_path / "evil.ckpt"
    payload = {"state_dict": {}, "ltcx": {"backbone_class": "ltcx.models.gpt.GPT"}, "x": RunsCode(marker)}
    if kind == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a"], capsys)
    assert f"checkpoint '{path}'" in line
    assert ("will not run code from a file" in line) if kind == "torch.save" else ("could not be read" in line)
    assert not marker.exists()


def test_backbone_class_from_the_file_is_never_imported(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = write_checkpoint(tmp_path / "evil.ckpt", backbone_class="os.system",
                            backbone_config={"command": f"touch {marker}"})
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a"], capsys)
    assert "backbone class 'os.system' is not a registered ltcx backbone" in line
    assert not marker.exists()


def test_registry_knows_ltcx_backbones_and_registered_ones(monkeypatch):
    assert registry.resolve_backbone("ltcx.models.gpt.GPT") is GPT
    assert registry.resolve_backbone("ltcx.models.ltc.LTCGPT") is LTCGPT
    with pytest.raises(LtcxError, match="not a registered ltcx backbone"):
        registry.resolve_backbone("test_failures.MyBackbone")
    # An allow-listed class whose module is not there (yet) is a clear error, not an ImportError.
    monkeypatch.setitem(registry._BUILTIN, "ltcx.models.nowhere.Model", ("ltcx.models.nowhere", "Model"))
    with pytest.raises(LtcxError, match="not available in this ltcx version"):
        registry.resolve_backbone("ltcx.models.nowhere.Model")

    @registry.register_backbone
    class MyBackbone(GPT):
        pass

    assert registry.resolve_backbone(registry.class_path(MyBackbone)) is MyBackbone


# -- 3: a non-finite loss or weight never reaches a checkpoint -------------------------------------------------


@pytest.mark.parametrize("poison_at,message", [
    (4, "training loss became nan at step 5, so training stopped before updating the weights"),
    (6, "weights backbone.wte.weight and 1 more are not finite at step 6, so '{last}' was not written and the previous "
        "checkpoint is kept"),
])
def test_nan_stops_before_any_non_finite_weights_are_saved(tmp_path, fit_env, capsys, poison_at, message):
    """Weights poisoned after step 4: the loss of step 5 is NaN and the guard stops before the update. Poisoned
    after the last step (6): the final save refuses. Either way last.ckpt stays the good one of step 3."""
    data = fit_env
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", "3"))
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    before = last.read_bytes()
    line = one_error_line(lean_fit_args(
        tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last",
        "--trainer.callbacks+=fault_injection.PoisonWeights", f"--trainer.callbacks.at_step={poison_at}",
    ), capsys)
    assert message.format(last=tmp_path / "checkpoints/gpt/version_1/last.ckpt") in line  # the resumed run's folder
    assert last.read_bytes() == before
    step, weights = step_and_weights(last)
    assert step == 3 and all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    assert sorted(p.relative_to(last.parent.parent).as_posix() for p in last.parent.parent.rglob("*")) == [
        "version_0", "version_0/last.ckpt"]  # --ckpt_path last still finds the good one


@pytest.mark.parametrize("max_steps", ["2", "3"])
def test_resuming_at_or_past_max_steps_says_so_and_writes_nothing(tmp_path, fit_env, capsys, max_steps):
    """A finished run asked to resume (scripts/compare.py does so) exits 0 with a notice, leaving no new folder."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "3"))
    capsys.readouterr()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", max_steps, "--ckpt_path", "last"))
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    assert (f"ltcx: checkpoint '{last.relative_to(tmp_path)}' is at step 3, at or past trainer.max_steps {max_steps}: "
            "nothing to train; raise --trainer.max_steps to continue") in capsys.readouterr().err.splitlines()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_non_finite_update_stops_before_anything_saves_it(tmp_path, fit_env, capsys):
    """A finite loss whose update writes NaN into the weights at step 4 (the huge learning rate case): stopped right
    after that optimizer step (gradient clipping spread the NaN to every weight), before the periodic save of step 4;
    the good step 2 stays last."""
    line = one_error_line(lean_fit_args(
        tmp_path, fit_env, "--trainer.max_steps", "6", "--trainer.callbacks+=fault_injection.PoisonGradient",
        "--trainer.callbacks.at_step=4", every=2), capsys)
    assert line == ("ltcx: error: weights became non-finite (backbone.wte.weight and 9 more) at step 4, so training "
                    "stopped before saving or validating them (the last checkpoint is the last good one); lower "
                    "model.learning_rate, raise model.warmup_steps or set trainer.gradient_clip_val")
    folder = tmp_path / "checkpoints/gpt/version_0"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    for path in folder.iterdir():
        step, weights = step_and_weights(path)
        assert step == 2 and all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_non_finite_validation_loss_stops_before_samples_and_saves(tmp_path, fit_env, capsys):
    """The validation loss of step 2 is NaN: training stops at the end of that validation, before SampleGeneration
    (listed before the guard in configs/gpt.yaml) samples from the model; no checkpoint is written."""
    line = one_error_line(fit_args(
        fit_env, "--trainer.max_steps", "4", "--trainer.callbacks+=fault_injection.PoisonBeforeValidation",
        "--trainer.callbacks.at_step=2"), capsys)
    assert line == ("ltcx: error: validation loss became nan at step 2, so training stopped before sampling from or "
                    "saving the model (the last checkpoint is the last good one); lower model.learning_rate, raise "
                    "model.warmup_steps or set trainer.gradient_clip_val")
    assert not (tmp_path / "checkpoints").exists()
    assert not list((tmp_path / "lightning_logs").rglob("samples.txt"))


def test_huge_learning_rate_ends_in_one_line(tmp_path, fit_env, capsys):
    """What a user saw as a torch.multinomial traceback: model.learning_rate 1e3 on a tiny GPT."""
    line = one_error_line(fit_args(fit_env, "--trainer.max_steps", "8", "--model.learning_rate", "1e3",
                                   "--model.warmup_steps", "0"), capsys)
    assert " became " in line and "lower model.learning_rate" in line
    for path in (tmp_path / "checkpoints").rglob("*.ckpt"):
        weights = step_and_weights(path)[1]
        assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


# -- 4: the final step is always saved -------------------------------------------------------------------------


def test_final_step_saved_after_periodic_saves(tmp_path, fit_env):
    data = fit_env
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", "5", every=2))
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_0/last.ckpt")[0] == 5


# -- 5: atomic saves, full disk --------------------------------------------------------------------------------


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
    assert line == (f"ltcx: error: cannot write checkpoint '{folder / 'epoch=0-step=2.ckpt'}' (disk full); nothing was "
                    "written: free space or point the checkpoint dirpath at another disk")
    assert last.read_bytes() == saved["before"] and step_and_weights(last)[0] == 1
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # no temp file left
    with pytest.raises(LtcxError, match="the previous checkpoint there is intact"):  # an existing name: its old file
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
    assert line == ("ltcx: error: ModelCheckpoint keep_runs (0) must be an integer >= 1 (null: keep every run's "
                    "checkpoints): fix its init_args.keep_runs")


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
    with pytest.raises(LtcxError, match=r"last.ckpt' \(disk full\); the previous checkpoint there is intact"):
        ModelCheckpoint._link_checkpoint(trainer, str(top), str(last))
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
    from ltcx.data.shards import write_json, write_shard
    from ltcx.persist import atomic_copy, export_model
    from ltcx.persist.files import current_umask

    assert current_umask() == umask
    expected = 0o666 & ~umask
    atomic_save({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    atomic_copy(str(tmp_path / "a.ckpt"), str(tmp_path / "last.ckpt"))
    SafeCheckpointIO().save_checkpoint({"ltcx": {}, "w": torch.ones(3)}, str(tmp_path / "b.ckpt"))
    export = export_model(write_checkpoint(tmp_path / "good.ckpt"), tmp_path / "export")
    write_shard(str(tmp_path / "shard.bin"), torch.arange(5).numpy().astype("uint16"), 1)
    write_json(str(tmp_path / "meta.json"), {})
    written = [tmp_path / name for name in ("a.ckpt", "last.ckpt", "b.ckpt", "shard.bin", "meta.json")]
    for path in [*written, export / "model.safetensors", export / "config.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path.name, oct(path.stat().st_mode))
    assert stat.S_IMODE(export.stat().st_mode) == 0o777 & ~umask
    assert current_umask() == umask  # reading it changed nothing


def test_checkpoint_io_refuses_non_finite_weights(tmp_path):
    target = tmp_path / "last.ckpt"
    with pytest.raises(LtcxError, match=r"weights w are not finite at step 7, so '.*last.ckpt' was not written"):
        SafeCheckpointIO().save_checkpoint({"global_step": 7, "state_dict": {"w": torch.tensor([1.0, float("inf")])}},
                                           target)
    assert not list(tmp_path.iterdir())


# -- 6: SIGTERM / Ctrl-C save the current step and exit non-zero; resuming continues exactly --------------------


def test_sigterm_saves_the_step_exits_143_and_resumes_exactly(tmp_path):
    data = write_corpus(tmp_path / "corpus", 60, 10)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    done = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6"), whole)
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf",
                                    "--trainer.callbacks.at_step=3", "--trainer.callbacks.signal_name=SIGTERM"), parts)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "ltcx: SIGTERM at step 3: saved" in stopped.stderr and "Traceback" not in stopped.stderr
    assert step_and_weights(parts / "checkpoints/gpt/version_0/last.ckpt")[0] == 3

    resumed = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last"), parts)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step, weights = step_and_weights(parts / "checkpoints/gpt/version_1/last.ckpt")  # the resumed run's folder
    step_whole, weights_whole = step_and_weights(whole / "checkpoints/gpt/version_0/last.ckpt")
    assert step == step_whole == 6
    assert all(torch.equal(weights[k], weights_whole[k]) for k in weights_whole)  # bit for bit


def test_ctrl_c_saves_the_step_and_exits_130(tmp_path):
    data = write_corpus(tmp_path / "corpus", 60, 10)
    stopped = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf",
                                    "--trainer.callbacks.at_step=2", "--trainer.callbacks.signal_name=SIGINT"),
                      tmp_path)
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr[-3000:]
    assert "ltcx: SIGINT at step 2: saved" in stopped.stderr
    assert step_and_weights(tmp_path / "checkpoints/gpt/version_0/last.ckpt")[0] == 2


# -- 7: --ckpt_path last never takes another run's checkpoint ---------------------------------------------------


def test_ckpt_path_last_takes_the_latest_run(tmp_path, fit_env, capsys):
    """Each run saves in its own version_N beside its logs; `last` is the latest run's last.ckpt; runs that stopped
    before saving (and validate) leave no checkpoint folder."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "2"))
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "3"))  # a second fresh run: its own folder
    main(["validate", *lean_fit_args(tmp_path, fit_env)[1:], "--ckpt_path", "last"])
    one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", "last",
                                 "--data.block_size", "128"), capsys)  # fails before its first step
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", "last"))
    folder = tmp_path / "checkpoints/gpt"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.ckpt")) == [
        "version_0/last.ckpt", "version_1/last.ckpt", "version_3/last.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == ["version_0", "version_1", "version_3"]
    assert sorted(p.name for p in (tmp_path / "lightning_logs/gpt").iterdir()) == [
        "version_0", "version_1", "version_2", "version_3"]  # version_2: validate; the failed run left nothing
    assert [step_and_weights(folder / f"version_{v}/last.ckpt")[0] for v in (0, 1, 3)] == [2, 3, 4]
    assert read_checkpoint(folder / "version_3/last.ckpt")["ltcx"]["tokens_seen"] == 4 * 4 * 32  # resumed at 3


def test_ckpt_path_last_refuses_when_runs_share_the_folder(tmp_path, fit_env, capsys, checkpoint):
    folder = tmp_path / "checkpoints/gpt"
    folder.mkdir(parents=True)
    shutil.copy(checkpoint, folder / "last.ckpt")
    shutil.copy(checkpoint, folder / "last-v1.ckpt")
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1", "--ckpt_path", "last"), capsys)
    assert line == ("ltcx: error: --ckpt_path last is ambiguous: checkpoints/gpt/last-v1.ckpt, "
                    "checkpoints/gpt/last.ckpt (runs sharing the folder wrote several); pass --ckpt_path the one to "
                    "resume")
    assert not (tmp_path / "lightning_logs").exists()


# -- 8, 9: bad files and flags: one line, exit 2, nothing written ----------------------------------------------


def damaged(tmp_path: Path, checkpoint: Path, how: str) -> Path:
    path = tmp_path / f"{how}.ckpt"
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    elif how == "random":
        path.write_bytes(os.urandom(4096))
    return path


@pytest.mark.parametrize("how,message", [
    ("missing", "does not exist: pass --ckpt_path the path of a .ckpt file"),
    ("empty", "is empty (0 bytes): use another checkpoint"),
    ("truncated", "it is truncated or not a checkpoint"),
    ("random", "could not be read"),
    ("another architecture", "--model.backbone.init_args.n_embd 16 would change the architecture of checkpoint "
                             "'{path}' (it has n_embd 32), whose weights can not be resumed into it: drop the flag "
                             "to resume"),
    ("another vocabulary", "is of another model (vocab_size: 320 in the file, 50304 configured): pass the config that"),
])
def test_fit_ckpt_path_failures(tmp_path, fit_env, capsys, checkpoint, how, message):
    path = checkpoint if how.startswith("another") else damaged(tmp_path, checkpoint, how)
    typed = [] if how == "another vocabulary" else ["--model.backbone.init_args.n_embd", "16"]  # gpt2 here, bytes there
    line = one_error_line(fit_args(fit_env, "--trainer.max_steps", "1", "--ckpt_path", str(path), *typed), capsys)
    assert f"checkpoint '{path}'" in line and message.format(path=path) in line
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("override,message", [
    (["--model.learning_rate", "0"], "model.learning_rate (0.0) must be a positive number"),
    (["--model.learning_rate=-1e-3"], "model.learning_rate (-0.001) must be a positive number"),
    (["--model.min_lr", "1e-2"], "model.min_lr (0.01) must be in [0, model.learning_rate=0.0006]"),
    (["--model.warmup_steps", "-1"], "model.warmup_steps (-1) must be >= 0"),
    (["--trainer.max_steps", "-2"], "trainer.max_steps (-2) must be >= -1 (-1: no limit)"),
])
def test_bad_training_flags(tmp_path, fit_env, capsys, override, message):
    line = one_error_line(fit_args(fit_env, "--trainer.max_steps", "1", *override), capsys)
    assert message in line
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("flags,message", [
    (["--trainer.max_steps", "abc"], "--trainer.max_steps: Expected a int. Got value: abc"),
    (["--model.learning_rate", "nan"], "--model.learning_rate: Expected a float. Got value: nan"),
    (["--trainer.precision", "7"], "--trainer.precision: Does not validate against any of the Union subtypes "
                                   "(accepted: [Literal[64, 32, 16], "),
    (["--bogus_flag", "1"], "unrecognized arguments: --bogus_flag 1"),
], ids=["int", "float", "union", "unknown"])
def test_flags_jsonargparse_refuses_are_one_line_not_its_usage(tmp_path, fit_env, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(fit_env, *flags))
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()  # no usage, no traceback, no notice
    assert line.startswith(f"ltcx: error: {message}") and line.endswith("; see `ltcx fit --help`"), line
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


def test_nan_learning_rate_from_yaml_is_refused(tmp_path, fit_env, capsys):
    """YAML's .nan is a float that reaches LanguageModel, whose check refuses it (NaN fails 0 < lr < inf)."""
    line = one_error_line(fit_args(fit_env, "--model.learning_rate", ".nan"), capsys)
    assert line == "ltcx: error: model.learning_rate (nan) must be a positive number: fix --model.learning_rate"


@pytest.mark.parametrize("content,message", [
    (None, "--config: File does not exist: '{path}'; see `ltcx fit --help`"),
    (bytes(range(128, 256)), "--config '{path}' is not a YAML text file (its bytes are not UTF-8 text): pass the path "
                             "of a YAML config"),
    (b"model:\n  learning_rate: [1,\n", "--config '{path}' is not valid YAML (did not find expected node content at "
                                       "line 3, column 1): fix the file"),
], ids=["missing", "binary", "not YAML"])
def test_bad_config_file_is_one_line_naming_it(tmp_path, fit_env, capsys, content, message):
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(fit_env, "--config", str(path)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"ltcx: error: {message.format(path=path)}"]


def test_help_and_print_config_still_work(fit_env, capsys):
    for flag in ("--help", "--print_config"):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), flag])
        assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "learning_rate: " in out


def test_unreadable_file_mid_training_is_named(tmp_path, fit_env, capsys):
    corpus = tmp_path / "jsonl"
    corpus.mkdir()
    for i in range(4):
        lines = [f'{{"text": "the cat sat on the mat number {i} {j} and ran off"}}' for j in range(12)]
        if i == 2:
            lines.insert(3, "{not json")
        (corpus / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    line = one_error_line(lean_fit_args(tmp_path, corpus, "--trainer.max_steps", "200"), capsys)
    assert line.startswith(f"ltcx: error: cannot read data file '{corpus / 'part-2.jsonl'}' (ArrowInvalid: JSON parse")
    assert line.endswith("): fix or remove it")


@pytest.mark.parametrize("flags,message", [
    (["--num_samples", "0"], "--num_samples (0) must be >= 1"),
    (["--temperature", "nan"], "temperature (nan) must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature (inf) must be a finite number >= 0"),
    (["--tokenizer", "gpt2"], "tokenizer 'gpt2' (50257 ids) does not fit the model's vocabulary of 320: it was trained "
                              "with tokenizer 'bytes': pass that --tokenizer"),
    (["--prompt", "x" * 80], "prompt (80 tokens) plus max_new_tokens (5) is 85 tokens, more than the model's context"),
])
def test_generate_flag_errors_print_nothing_else(capsys, checkpoint, flags, message):
    line = one_error_line(["generate", "--ckpt_path", str(checkpoint), "--max_new_tokens", "5", *flags], capsys)
    assert message in line
    assert capsys.readouterr().out == ""  # the prompt is not echoed before it is checked


def test_generate_metadata_not_matching_weights(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "bad.ckpt")
    state = torch.load(path, weights_only=True)
    state["ltcx"]["backbone_config"]["n_layer"] = 2
    torch.save(state, path)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert line == (f"ltcx: error: checkpoint '{path}' does not fit the model: backbone.blocks.1.ln_1.weight [32] is "
                    f"not in the file (and 13 more); {OTHER_VERSION}")


def test_weights_that_are_no_tensors_are_still_a_damaged_file(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "bad.ckpt")
    state = torch.load(path, weights_only=True)
    state["state_dict"]["backbone.wpe.weight"] = "not a tensor"
    torch.save(state, path)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert line.startswith(f"ltcx: error: checkpoint '{path}': its weights could not be loaded (")
    assert line.endswith("); the file is damaged")


# -- 9a: a checkpoint or export whose bytes changed is named damaged, never loaded -------------------------------


def test_digest_covers_every_value_type_lightning_saves(tmp_path):
    """The digest of what was saved is that of what loads back, for each kind of value in a Lightning checkpoint;
    any changed value or byte changes it."""
    from collections import OrderedDict

    from ltcx.persist import DIGEST_KEY, content_digest

    values = {
        "state_dict": OrderedDict(w=torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(), s=torch.tensor(2.5)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}, 1: {}}, "param_groups": [
            {"betas": (0.9, 0.95), "lr": 1e-3, "params": [0, 1], "foreach": None, "fused": False}]}],
        "floats": [float("nan"), -0.0, float("inf"), 1 / 3], "size": torch.Size([2, 3]), "nested": [[1, [2, "x"]], ()],
        "tags": {"b", "a"}, "dtype": torch.float16, "text": "ünï", "ltcx": {"backbone_class": "ltcx.models.gpt.GPT"},
    }
    atomic_save(values, tmp_path / "all.ckpt")
    stored = torch.load(tmp_path / "all.ckpt", weights_only=True)
    assert list(stored)[-1] == DIGEST_KEY and stored[DIGEST_KEY]["sha256"] == content_digest(values)
    loaded = read_checkpoint(tmp_path / "all.ckpt")
    assert DIGEST_KEY not in loaded and content_digest(loaded) == content_digest(values)
    for change in (lambda v: v["state_dict"]["w"][1, 0].add_(1),
                   lambda v: v["optimizer_states"][0]["state"].update({2: {}}),
                   lambda v: v["floats"].__setitem__(1, 0.0), lambda v: v.update(size=(2, 3))):
        change(loaded)
        assert content_digest(loaded) != content_digest(values)


def flip_tensor_bytes(path: Path, tensor: torch.Tensor, count: int = 20) -> None:
    """Flip ``count`` bytes in the middle of ``tensor``'s data inside the file ``path`` (torch stores records
    uncompressed, so the tensor's bytes are there as they are in memory)."""
    data, raw = bytearray(path.read_bytes()), tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    middle = at + len(raw) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("entry", ["read_checkpoint", "load_from_checkpoint", "generate", "export", "fit"])
def test_checkpoint_with_flipped_bytes_is_named_damaged(tmp_path, fit_env, capsys, trained, entry):
    saved, data = trained
    path = tmp_path / "flipped.ckpt"
    shutil.copy(saved, path)
    flip_tensor_bytes(path, read_checkpoint(saved)["optimizer_states"][0]["state"][0]["exp_avg"])
    assert torch.load(path, weights_only=True)["global_step"] == 1  # torch reads it without a word
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    message = (f"checkpoint '{path}' is damaged: its contents do not match the SHA-256 digest saved with it (bytes "
               "changed on disk or in transfer); use another checkpoint")
    if entry in ("read_checkpoint", "load_from_checkpoint"):
        with pytest.raises(LtcxError) as error:
            (read_checkpoint if entry == "read_checkpoint" else LanguageModel.load_from_checkpoint)(path)
        assert str(error.value) == message
    else:
        args = {
            "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
            "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
            "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
        }[entry]
        assert one_error_line(args, capsys) == f"ltcx: error: {message}"
    assert_nothing_written(tmp_path, before)


def test_export_with_flipped_bytes_is_named_damaged(tmp_path, trained, capsys):
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    capsys.readouterr()
    assert len(json.loads((out / "config.json").read_text())["weights_sha256"]) == 64
    flip_tensor_bytes(out / "model.safetensors", read_checkpoint(trained[0])["state_dict"]["backbone.wpe.weight"])
    message = (f"exported model '{out}' is damaged: its model.safetensors does not match the SHA-256 in its "
               "config.json (bytes changed on disk or in transfer); export it again from its checkpoint")
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert str(error.value) == message
    assert one_error_line(["generate", "--ckpt_path", str(out), "--max_new_tokens", "2"], capsys) == \
        f"ltcx: error: {message}"
    assert capsys.readouterr().out == ""


def test_files_without_a_digest_load_with_one_notice(tmp_path, trained, capsys, checkpoint):
    load_language_model(checkpoint)  # written by torch.save, as an earlier ltcx did
    assert capsys.readouterr().err.splitlines() == [
        f"ltcx: checkpoint '{checkpoint}' has no SHA-256 digest (written by torch.save or an earlier ltcx), so it "
        "could not be checked for damage"]
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    LanguageModel.from_pretrained(out)
    assert capsys.readouterr().err.splitlines() == [
        f"ltcx: exported model '{out}' has no weights_sha256 in config.json (exported by an earlier ltcx), so its "
        "model.safetensors could not be checked for damage"]


# -- 9b: a readable checkpoint of another version of ltcx is named as such, not as a damaged file ----------------

OTHER_VERSION = ("it was saved by another version of ltcx or another config: load it with the version that wrote it, "
                 "or start a new run")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint saved by `ltcx fit` (one step of the tiny GPT) and its corpus, shared by the tests below."""
    root = tmp_path_factory.mktemp("trained")
    data = write_corpus(root / "corpus", 60, 10)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ltcx"])
        for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            patch.setenv(flag, "1")
        main(lean_fit_args(root, data, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(root)))
    return root / "checkpoints/gpt/version_0/last.ckpt", data


def as_an_older_version(trained: Path, path: Path, change) -> Path:
    """The trained checkpoint with ``change(checkpoint)`` applied, as an older ltcx would have written it."""
    checkpoint = torch.load(trained, weights_only=True)
    del checkpoint["ltcx_digest"]  # which no earlier ltcx wrote
    change(checkpoint)
    torch.save(checkpoint, path)
    return path


def other_shapes(checkpoint: dict) -> None:
    """A wider q_proj (the way xLSTM's 408 -> 404 changed its projections), a key gone and one not known here."""
    weights = checkpoint["state_dict"]
    weights["backbone.blocks.0.attn.q_proj.weight"] = torch.zeros(48, 32)
    del weights["backbone.blocks.0.mlp.c_fc.weight"]
    weights["backbone.blocks.0.attn.rotary.inv_freq"] = torch.zeros(8)


def assert_nothing_written(folder: Path, before: set) -> None:
    assert {p for p in folder.rglob("*") if p.name != "lean.yaml"} == before


@pytest.mark.parametrize("entry", ["fit", "validate", "generate", "export"])
def test_checkpoint_of_other_shapes_is_not_called_damaged(tmp_path, fit_env, capsys, trained, entry):
    saved, data = trained
    path = as_an_older_version(saved, tmp_path / "old.ckpt", other_shapes)
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    args = {
        "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
        "validate": ["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)],
        "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
        "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
    }[entry]
    line = one_error_line(args, capsys)
    assert line == (f"ltcx: error: checkpoint '{path}' does not fit the model: backbone.blocks.0.attn.q_proj.weight is "
                    f"[48, 32] in the file and [32, 32] here (and 2 more); {OTHER_VERSION}")
    assert capsys.readouterr().out == ""
    assert_nothing_written(tmp_path, before)


def test_python_loaders_name_a_checkpoint_of_other_shapes(tmp_path, trained):
    path = as_an_older_version(trained[0], tmp_path / "old.ckpt", other_shapes)
    for load in (LanguageModel.load_from_checkpoint, load_language_model):
        with pytest.raises(LtcxError, match=r"does not fit the model: .* \(and 2 more\); it was saved by another"):
            load(path)


def test_exported_model_of_other_shapes_is_not_called_damaged(tmp_path, trained, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    assert LanguageModel.from_pretrained(out).backbone.lm_head.weight is not None  # its tied weights, stored once, load
    weights = load_file(out / "model.safetensors")
    weights["blocks.0.mlp.c_fc.weight"] = torch.zeros(96, 32)
    save_file(weights, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]  # as an earlier ltcx exported it
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert str(error.value) == (f"exported model '{out}' does not fit the model: blocks.0.mlp.c_fc.weight is [96, 32] "
                                f"in the file and [128, 32] here; {OTHER_VERSION}")
    (out / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file: damaged
    line = one_error_line(["generate", "--ckpt_path", str(out)], capsys)
    assert line.startswith(f"ltcx: error: exported model '{out}': its weights could not be loaded (")
    assert line.endswith("the file is damaged")


def test_settings_of_another_version_are_named(tmp_path, fit_env, capsys, trained):
    saved, data = trained
    again = "it was saved by another version of ltcx: load it with the version that wrote it, or start a new run"

    def old_hyper_parameter(checkpoint):
        checkpoint["hyper_parameters"]["label_smoothing"] = 0.1

    def old_backbone_setting(checkpoint):
        checkpoint["ltcx"]["backbone_config"]["round_to"] = 64

    path = as_an_older_version(saved, tmp_path / "old-hparams.ckpt", old_hyper_parameter)
    line = one_error_line(lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)), capsys)
    assert line == (f"ltcx: error: checkpoint '{path}' has hyper-parameter(s) model.label_smoothing, which this "
                    f"version of ltcx does not have: {again}")
    path = as_an_older_version(saved, tmp_path / "old-config.ckpt", old_backbone_setting)
    line = one_error_line(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)], capsys)
    assert line == (f"ltcx: error: checkpoint '{path}' is of another model (round_to: 64 in the file, not a setting of "
                    f"this version): {again}")
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert line == (f"ltcx: error: checkpoint '{path}' has backbone_config round_to, which this version's GPT does not "
                    f"take: {again}")
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


WRONG_TYPES = [
    ("decay_steps", {"steps": 5}, "an integer or null"),
    ("learning_rate", "abc", "a number"),
    ("betas", "x", "a list [a number, a number]"),
    ("backbone.bias", "yes", "true or false"),
]


@pytest.mark.parametrize("setting,value,expected", WRONG_TYPES)
@pytest.mark.parametrize("entry", ["fit", "generate", "export", "load_from_checkpoint"])
def test_hyper_parameter_of_the_wrong_type_in_a_checkpoint(tmp_path, fit_env, capsys, trained, entry, setting, value,
                                                           expected):
    saved, data = trained
    where, _, name = setting.rpartition(".")

    def change(checkpoint):
        (checkpoint["ltcx"]["backbone_config"] if where else checkpoint["hyper_parameters"])[name] = value

    path = as_an_older_version(saved, tmp_path / "typed.ckpt", change)
    capsys.readouterr()
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    shown = f"model.backbone.init_args.{name}" if where else f"model.{name}"
    message = (f"checkpoint '{path}' has {shown} {value!r}, which is not {expected}: fix it in the file or use "
               "another one")
    if entry == "load_from_checkpoint":
        with pytest.raises(LtcxError) as error:
            LanguageModel.load_from_checkpoint(path)
        assert str(error.value) == message
    else:
        args = {
            "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
            "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
            "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
        }[entry]
        assert one_error_line(args, capsys) == f"ltcx: error: {message}"
    assert_nothing_written(tmp_path, before)


@pytest.mark.parametrize("setting,value,expected", WRONG_TYPES)
def test_hyper_parameter_of_the_wrong_type_in_an_export(tmp_path, trained, capsys, setting, value, expected):
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    where, _, name = setting.rpartition(".")
    (config["backbone_config"] if where else config["hyper_parameters"])[name] = value
    (out / "config.json").write_text(json.dumps(config))
    shown = f"config.json's backbone_config.{name}" if where else f"config.json's hyper_parameters.{name}"
    message = (f"exported model '{out}' has {shown} {value!r}, which is not {expected}: fix it in the file or use "
               "another one")
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert str(error.value) == message
    assert one_error_line(["generate", "--ckpt_path", str(out), "--max_new_tokens", "2"], capsys) == \
        f"ltcx: error: {message}"


def test_checkpoint_from_before_a_new_setting_loads_at_its_default(tmp_path, fit_env, capsys, trained):
    """A setting added later (the GPT's mlp_hidden) is absent from older files: at its default it builds the model
    they hold, so they resume, validate and generate; typing another value is named as another model."""
    saved, data = trained

    def before_mlp_hidden(checkpoint):
        del checkpoint["ltcx"]["backbone_config"]["mlp_hidden"]

    path = as_an_older_version(saved, tmp_path / "older.ckpt", before_mlp_hidden)
    main(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2", "--seed", "0"])
    main(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)])
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)))
    assert torch.load(tmp_path / "checkpoints/gpt/version_1/last.ckpt", weights_only=True)["global_step"] == 2
    capsys.readouterr()
    line = one_error_line(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path),
                           "--model.backbone.init_args.mlp_hidden", "64"], capsys)
    assert line.startswith(f"ltcx: error: checkpoint '{path}' is of another model (mlp_hidden: None (the default) in "
                           "the file, 64 configured): pass the config that trained it")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_generate_device_cuda_without_cuda(capsys, checkpoint):
    line = one_error_line(["generate", "--ckpt_path", str(checkpoint), "--device", "cuda"], capsys)
    assert line == ("ltcx: error: --device cuda: this machine has no usable CUDA device (torch sees none); "
                    "use --device cpu")


def test_generate_reads_a_good_checkpoint(capsys, checkpoint):
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "ab", "--max_new_tokens", "4", "--seed", "0"])
    assert capsys.readouterr().out.startswith("ab")
    model, meta = load_language_model(checkpoint)
    assert type(model.backbone) is GPT and meta["tokenizer"] == "bytes"


# -- 10: offline fails at once ----------------------------------------------------------------------------------


def test_offline_hub_data_and_tokenizer_fail_at_once(tmp_path, fit_env, capsys):
    start = time.monotonic()
    line = one_error_line(fit_args(Path("roneneldan/TinyStories"), "--trainer.max_steps", "1"), capsys)
    assert line == ("ltcx: error: cannot load data set 'roneneldan/TinyStories' from the Hugging Face hub (offline "
                    "mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)); offline? use --data.path sample (a "
                    "TinyStories sample shipped with ltcx) or point --data.path at local .txt/.jsonl/.parquet files")
    line = one_error_line(fit_args(fit_env, "--data.tokenizer", "some-org/no-such-tokenizer"), capsys)
    assert "unknown tokenizer 'some-org/no-such-tokenizer'" in line
    assert "not in the local cache and offline mode" in line
    assert time.monotonic() - start < 10


def test_unreachable_hub_is_found_by_one_short_probe(tmp_path, fit_env, monkeypatch, capsys):
    """Offline mode not set, but no hub: one connection attempt (here to a closed local port) and the line."""
    import huggingface_hub.constants

    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "*")
    start = time.monotonic()
    line = one_error_line(fit_args(Path("roneneldan/TinyStories"), "--trainer.max_steps", "1"), capsys)
    assert "from the Hugging Face hub (no connection to 127.0.0.1:9 within 3 s" in line
    assert time.monotonic() - start < 10


# -- 11: bf16 generation for every backbone: tests/test_contract.py -----------------------------------------


# -- 12: default_root_dir ---------------------------------------------------------------------------------------


def test_default_root_dir_holds_logs_and_checkpoints(tmp_path, fit_env):
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1", "--trainer.default_root_dir", "runs"))
    assert (tmp_path / "runs/checkpoints/gpt/version_0/last.ckpt").is_file()
    assert (tmp_path / "runs/lightning_logs/gpt/version_0/config.yaml").is_file()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "lightning_logs").exists()


def test_progress_bar_total_after_resume():
    from ltcx.callbacks import StepTQDMProgressBar

    class Trainer:
        max_epochs, max_steps, accumulate_grad_batches, global_step, num_training_batches = -1, 6, 1, 4, float("inf")

    bar = StepTQDMProgressBar()
    bar._trainer = Trainer()
    assert bar.total_train_batches == 6  # Lightning's own bar says 2 (the steps left) against a count of 6
