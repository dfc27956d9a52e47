"""`keep_runs` retention identifies runs by the run id each checkpoint carries, never by paths: a new run in a
recreated folder, a copied checkpoint, a symlinked run folder and a second chain in the same folder are never touched;
a resumed chain still drops its oldest runs' files."""

import os
import shutil

from helpers import ROOT, lean_fit_args
from ltcx.cli import main

REMOVED = "ltcx: removed "


def fit(tmp_path, data, steps: int, *extra: str, keep_runs: str = "") -> None:
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", str(steps), *extra, keep_runs=keep_runs))


def ckpt_files(folder) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.ckpt"))


def removed_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(REMOVED)]


def test_resuming_a_copy_of_an_old_run_never_deletes_a_new_run_in_a_recreated_folder(tmp_path, fit_env, monkeypatch,
                                                                                       capsys):
    """Fit, resume once, keep a copy of the resumed run's last.ckpt elsewhere; delete and recreate the folder, start
    an unrelated run (saved as version_0, as the old chain's first run was), then resume from the copy: the new run's
    checkpoint stays, though its path is the one the copy's ancestor had."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    fit(tmp_path, fit_env, 1)
    fit(tmp_path, fit_env, 2, "--ckpt_path", "last")
    backup = tmp_path / "elsewhere/backup.ckpt"
    backup.parent.mkdir()
    shutil.copy(work / "checkpoints/gpt/version_1/last.ckpt", backup)
    shutil.rmtree(work)
    work.mkdir()
    monkeypatch.chdir(work)
    fit(tmp_path, fit_env, 1, "--seed_everything", "5")
    new_run = (work / "checkpoints/gpt/version_0/last.ckpt").read_bytes()
    capsys.readouterr()
    fit(tmp_path, fit_env, 3, "--ckpt_path", str(backup))
    assert removed_lines(capsys) == []
    assert ckpt_files(work / "checkpoints/gpt") == ["version_0/last.ckpt", "version_1/last.ckpt"]
    assert (work / "checkpoints/gpt/version_0/last.ckpt").read_bytes() == new_run
    assert backup.is_file()


def test_a_copy_of_a_checkpoint_and_a_sibling_resumed_from_it_are_never_touched(tmp_path, fit_env, capsys):
    """keep_runs 1: resuming version_0 deletes its file (notice line), never its copy elsewhere; a second resume
    from that copy descends from version_0 only, so version_1 (its sibling) stays."""
    folder = tmp_path / "checkpoints/gpt"
    fit(tmp_path, fit_env, 1)
    copy = tmp_path / "elsewhere/copy.ckpt"
    copy.parent.mkdir()
    shutil.copy(folder / "version_0/last.ckpt", copy)
    capsys.readouterr()
    fit(tmp_path, fit_env, 2, "--ckpt_path", str(folder / "version_0/last.ckpt"), keep_runs="1")
    assert removed_lines(capsys) == [f"{REMOVED}version_0/last.ckpt from {folder}: checkpoints of runs before the "
                                     "last 1 (ModelCheckpoint keep_runs; null keeps them)"]
    fit(tmp_path, fit_env, 2, "--ckpt_path", str(copy), keep_runs="1")
    assert removed_lines(capsys) == []
    assert ckpt_files(folder) == ["version_1/last.ckpt", "version_2/last.ckpt"] and copy.is_file()


def test_a_symlinked_run_folder_of_another_run_is_never_touched(tmp_path, fit_env, monkeypatch, capsys):
    """version_0 moved to an archive and replaced by a link to another run's folder: resuming the archived file
    (keep_runs 1) deletes neither the other run's checkpoint behind the link nor the archived one."""
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    fit(tmp_path, fit_env, 1, "--seed_everything", "5")
    monkeypatch.chdir(tmp_path)
    fit(tmp_path, fit_env, 1)
    folder, archive = tmp_path / "checkpoints/gpt", tmp_path / "archive"
    shutil.move(folder / "version_0", archive)
    (folder / "version_0").symlink_to(other / "checkpoints/gpt/version_0", target_is_directory=True)
    capsys.readouterr()
    fit(tmp_path, fit_env, 2, "--ckpt_path", str(archive / "last.ckpt"), keep_runs="1")
    assert removed_lines(capsys) == []
    assert ckpt_files(other) == ["checkpoints/gpt/version_0/last.ckpt"] and (archive / "last.ckpt").is_file()
    assert (folder / "version_1/last.ckpt").is_file()


def test_two_chains_in_one_folder_each_prune_only_their_own(tmp_path, fit_env, capsys):
    """Two fresh runs sharing checkpoints/gpt, each resumed with keep_runs 1: each resume deletes its own parent's
    file only."""
    folder = tmp_path / "checkpoints/gpt"
    fit(tmp_path, fit_env, 1)  # chain A: version_0
    fit(tmp_path, fit_env, 1, "--seed_everything", "5")  # chain B: version_1
    capsys.readouterr()
    for parent, kept in (("version_0", "version_1"), ("version_1", "version_2")):
        fit(tmp_path, fit_env, 2, "--ckpt_path", str(folder / parent / "last.ckpt"), keep_runs="1")
        assert removed_lines(capsys) == [f"{REMOVED}{parent}/last.ckpt from {folder}: checkpoints of runs before the "
                                         "last 1 (ModelCheckpoint keep_runs; null keeps them)"]
        assert (folder / kept / "last.ckpt").is_file()
    assert ckpt_files(folder) == ["version_2/last.ckpt", "version_3/last.ckpt"]


def test_a_resumed_chain_drops_its_oldest_run_and_leaves_files_it_cannot_identify(tmp_path, fit_env, capsys):
    """Fit, resume, resume (keep_runs 2): the first run's last.ckpt goes, with the notice line; beside it a
    checkpoint without a run id (an earlier ltcx's), a truncated copy of the removed file and random bytes stay,
    and so does their folder."""
    folder = tmp_path / "checkpoints/gpt"
    fit(tmp_path, fit_env, 1)
    fit(tmp_path, fit_env, 2, "--ckpt_path", "last")
    first = folder / "version_0"
    shutil.copy(ROOT / "tests/data/made_before_issue_18/gpt-bytes.ckpt", first / "old.ckpt")
    (first / "truncated.ckpt").write_bytes((first / "last.ckpt").read_bytes()[:4096])
    (first / "noise.ckpt").write_bytes(os.urandom(4096))
    capsys.readouterr()
    fit(tmp_path, fit_env, 3, "--ckpt_path", "last")
    assert removed_lines(capsys) == [f"{REMOVED}version_0/last.ckpt from {folder}: checkpoints of runs before the "
                                     "last 2 (ModelCheckpoint keep_runs; null keeps them)"]
    assert ckpt_files(folder) == ["version_0/noise.ckpt", "version_0/old.ckpt", "version_0/truncated.ckpt",
                                  "version_1/last.ckpt", "version_2/last.ckpt"]
