"""``ModelCheckpoint``: Lightning's, saving each run in its own ``version_N`` folder, keeping the checkpoints of the
last ``keep_runs`` runs of a resumed chain, replacing ``last.ckpt`` whole, saving the final step, and saving the
current step on request (``save_current_step``: ``Preemption`` calls it when a signal stops training)."""

from __future__ import annotations

import contextlib
import os
import re
import sys

import lightning as L
import torch
from lightning.pytorch import callbacks as pl_callbacks

from ltcx.errors import ConfigError
from ltcx.persist import atomic_copy, remove_stale_temps, run_versions


def _run_folder(trainer: L.Trainer, root: str) -> str:
    """``version_N`` with N the first logger's version (its log folder's name), else the next free N in ``root``."""
    version = trainer.loggers[0].version if trainer.loggers else None
    if version is None:
        version = max(run_versions(root), default=-1) + 1
    return version if isinstance(version, str) else f"version_{version}"


_VERSION_FOLDER = re.compile(r"version_\d+")


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
            full ``last.ckpt`` (347 MB for a 29M-parameter model): keep the ``.ckpt`` files of the last
            ``keep_runs`` runs of that chain (this run included) and delete the older ones' once this run has saved
            its first checkpoint. Default 2: this run's and the one it resumed from. Only runs this one descends
            from are touched, never another run sharing the folder; None keeps every file.
    """

    def __init__(self, *args, run_folders: bool = True, keep_runs: int | None = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run_folders = run_folders
        self.keep_runs = keep_runs
        self._root_dirpath = self.dirpath  # dirpath as configured; a run saves in <dirpath>/version_N
        self._earlier_runs: list[str] = []  # run folders of the runs this one was resumed from, oldest first
        self._pruned = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        keep = self.keep_runs  # checked here: jsonargparse turns an error of __init__ into a page of Union errors
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"ModelCheckpoint keep_runs ({keep}) must be an integer >= 1 (null: keep every run's "
                              "checkpoints): fix its init_args.keep_runs")
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
        return {**super().state_dict(), "earlier_runs": list(self._earlier_runs)}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.run_folders and os.path.dirname(str(state_dict.get("dirpath"))) == str(self._root_dirpath):
            # Resuming an earlier run of this folder: its best/last paths are in its own run folder, not this one.
            self.best_model_path = state_dict.get("best_model_path", "")
            self._earlier_runs = [*state_dict.get("earlier_runs", []), str(state_dict["dirpath"])]
            return
        super().load_state_dict(state_dict)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if not self._pruned:  # this run has a checkpoint of its own now
            self._pruned = True
            self._remove_older_runs(trainer)

    def _remove_older_runs(self, trainer: L.Trainer) -> None:
        """Delete the ``.ckpt`` files of the runs this one descends from, but for the last ``keep_runs`` - 1."""
        if self.keep_runs is None or not self._earlier_runs:
            return
        cut = len(self._earlier_runs) - (self.keep_runs - 1)
        older, self._earlier_runs = self._earlier_runs[:max(cut, 0)], self._earlier_runs[max(cut, 0):]
        if not trainer.is_global_zero:
            return
        removed = []
        for folder in older:
            # Only a run folder of this dirpath (a moved or renamed folder is left alone), never this run's own.
            if os.path.dirname(folder) != str(self._root_dirpath) or not _VERSION_FOLDER.fullmatch(
                    os.path.basename(folder)) or folder == self.dirpath or not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if name.endswith(".ckpt"):
                    os.remove(os.path.join(folder, name))
                    removed.append(f"{os.path.basename(folder)}/{name}")
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # if nothing else is in it
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
