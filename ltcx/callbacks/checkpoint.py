"""``ModelCheckpoint``: Lightning's, saving each run in its own ``version_N`` folder, keeping the checkpoints of the
last ``keep_runs`` runs of a resumed chain, replacing ``last.ckpt`` whole, saving the final step, and saving the
current step on request (``save_current_step``: ``Preemption`` calls it when a signal stops training)."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid

import lightning as L
import torch
from lightning.pytorch import callbacks as pl_callbacks

from ltcx.errors import ConfigError
from ltcx.persist import atomic_copy, remove_stale_temps, run_versions
from ltcx.persist.runs import callback_state


def _run_folder(trainer: L.Trainer, root: str) -> str:
    """``version_N`` with N the first logger's version (its log folder's name), else the next free N in ``root``."""
    version = trainer.loggers[0].version if trainer.loggers else None
    if version is None:
        version = max(run_versions(root), default=-1) + 1
    return version if isinstance(version, str) else f"version_{version}"


# Keys of the callback's state in each checkpoint: the run that saved it, and the runs it was resumed from.
RUN_ID, RESUMED_FROM = "run_id", "resumed_from"


class ModelCheckpoint(pl_callbacks.ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that also saves the final step, and the step a signal stopped at when
    ``Preemption`` (in every run of ltcx's CLI) calls ``save_current_step``.

    Lightning saves ``last.ckpt`` at the end of training only if nothing was saved before, so a run ending
    between periodic saves lost its last steps; here the final step is always saved (once).

    With ``run_folders`` (the default) a run saves in ``<dirpath>/version_N/``, N being its logger's version
    (``lightning_logs/<model>/version_N``), so runs sharing a ``dirpath`` never overwrite each other's files.
    Temp files of saves killed midway (``.last.ckpt.tmp-<pid>``, the process gone) are removed from every run
    folder when a run starts.

    Args:
        run_folders: save in ``<dirpath>/version_N/`` (else in ``dirpath`` itself, as Lightning does).
        keep_runs: a resumed run continues the runs it was resumed from, each in its own folder, each keeping a
            full ``last.ckpt`` (the weights and AdamW's two moments): keep the ``.ckpt`` files of the last
            ``keep_runs`` runs of that chain (this run included) and delete the older ones' once this run has saved
            its first checkpoint. Default 2: this run's and the one it resumed from. None keeps every file.

    Runs are told apart by ids, never by paths: each run (each ``fit``) draws a random id, and every checkpoint it
    saves records it and the ids of the runs it was resumed from. Retention deletes a ``.ckpt`` file of a
    ``version_N`` folder of ``dirpath`` only if the id read from that file itself is an older ancestor's: a new run
    where an old one was, a copy moved or restored, another chain sharing the folder, a file without an id (written
    by an earlier ltcx or another tool) or one that can not be read are never touched.
    """

    def __init__(self, *args, run_folders: bool = True, keep_runs: int | None = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run_folders = run_folders
        self.keep_runs = keep_runs
        self._root_dirpath = self.dirpath  # dirpath as configured; a run saves in <dirpath>/version_N
        self._run_id = ""  # drawn when a run starts (setup)
        self._resumed_from: list[str] = []  # ids of the runs this one was resumed from, oldest first
        self._pruned = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        keep = self.keep_runs  # checked here: jsonargparse turns an error of __init__ into a page of Union errors
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"ModelCheckpoint keep_runs ({keep}) must be an integer >= 1 (null: keep every run's "
                              "checkpoints): fix its init_args.keep_runs")
        if stage == "fit":  # a new run: rank 0's id on every rank; a resume fills _resumed_from after this
            self._run_id = trainer.strategy.broadcast(uuid.uuid4().hex)
            self._resumed_from, self._pruned = [], False
        if self.run_folders and self._root_dirpath is not None:
            # Each run its own folder, named as its log folder, so no run's last.ckpt overwrites (or, as last-v1.ckpt,
            # hides behind) another's. Nothing is created here: validate/test/predict and failed runs leave no folder.
            self.dirpath = os.path.join(self._root_dirpath, _run_folder(trainer, self._root_dirpath))
            if trainer.is_global_zero:  # a resumed run saves in a new folder and would never look at the old ones
                for version in run_versions(self._root_dirpath):
                    remove_stale_temps(os.path.join(self._root_dirpath, f"version_{version}"))
        super().setup(trainer, pl_module, stage)  # rank 0's folder is broadcast to every rank

    def _monitor_candidates(self, trainer: L.Trainer) -> dict:
        """Lightning's, with ``step`` always the trainer's global step: LanguageModel logs a ``step`` metric (the x
        axis of its scalars), which Lightning would otherwise read here, one batch behind, into the file names."""
        candidates = super()._monitor_candidates(trainer)
        candidates["step"] = torch.tensor(trainer.global_step)
        return candidates

    def state_dict(self) -> dict:
        return {**super().state_dict(), RUN_ID: self._run_id, RESUMED_FROM: list(self._resumed_from)}

    def load_state_dict(self, state_dict: dict) -> None:
        run, earlier = state_dict.get(RUN_ID), state_dict.get(RESUMED_FROM)
        if isinstance(run, str) and run and isinstance(earlier, list) and all(isinstance(r, str) for r in earlier):
            self._resumed_from = [*earlier, run]  # a file without ids (an earlier ltcx) starts no chain
        if self.run_folders and os.path.dirname(str(state_dict.get("dirpath"))) == str(self._root_dirpath):
            # Resuming an earlier run of this folder: its best/last paths are in its own run folder, not this one.
            self.best_model_path = state_dict.get("best_model_path", "")
            return
        super().load_state_dict(state_dict)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if not self._pruned:  # this run has a checkpoint of its own now
            self._pruned = True
            self._remove_older_runs(trainer)

    def _remove_older_runs(self, trainer: L.Trainer) -> None:
        """Delete the ``.ckpt`` files in ``dirpath``'s run folders that record as their own run the id of a run this
        one descends from, but for the last ``keep_runs`` - 1 of them."""
        cut = len(self._resumed_from) - (self.keep_runs - 1) if self.keep_runs is not None else 0
        older = set(self._resumed_from[:max(cut, 0)])
        if not older or not self.run_folders or self._root_dirpath is None or not trainer.is_global_zero:
            return
        doomed = []  # every file is read before any is removed: a save_last link is read through its target
        for version in run_versions(self._root_dirpath):
            folder = os.path.join(self._root_dirpath, f"version_{version}")
            if folder == self.dirpath:
                continue
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if name.endswith(".ckpt") and os.path.isfile(path):
                    state = callback_state(path, self.state_key)
                    run = state.get(RUN_ID) if state is not None else None
                    if isinstance(run, str) and run in older:
                        doomed.append((folder, name))
        for folder, name in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
        for folder in sorted({folder for folder, _ in doomed}):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # if nothing else is in it
        removed = [f"{os.path.basename(folder)}/{name}" for folder, name in doomed]
        if removed:
            print(f"ltcx: removed {', '.join(removed)} from {self._root_dirpath}: checkpoints of runs before the last "
                  f"{self.keep_runs} (ModelCheckpoint keep_runs; null keeps them)", file=sys.stderr)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        """``save_last: link``: Lightning removes ``last.ckpt`` before linking it, and copies it where links fail,
        so a kill or a full disk there left none or half of one; here the link or copy replaces it whole."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            temp = os.path.join(os.path.dirname(linkpath), f".{os.path.basename(linkpath)}.tmp-{os.getpid()}")
            try:
                os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), temp)
                os.replace(temp, linkpath)
            except OSError:  # no symbolic links on this file system
                with contextlib.suppress(FileNotFoundError):
                    os.remove(temp)
                atomic_copy(filepath, linkpath)
        trainer.strategy.barrier()

    def save_current_step(self, trainer: L.Trainer) -> None:
        """Save the step training stopped at (as ``last.ckpt`` when ``save_last``), unless already saved."""
        if self._should_skip_saving_checkpoint(trainer):  # also: already saved at this step
            return
        candidates = self._monitor_candidates(trainer)
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
        else:
            self._save_topk_checkpoint(trainer, candidates)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save_current_step(trainer)
