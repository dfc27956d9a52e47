"""Callbacks: sample generations in the loggers (TensorBoard, ...), a guard against non-finite losses, model FLOPs
utilisation, and Lightning's ModelCheckpoint that also saves the final step and the step a signal stopped at."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import lightning as L
import torch
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ltcx.errors import ConfigError, LtcxError, StoppedOnAllRanks
from ltcx.generation import generate_texts
from ltcx.persist import atomic_copy, remove_stale_temps, run_versions
from ltcx.throughput import default_peak_flops, model_flops_per_token


class SampleGeneration(L.Callback):
    """After each validation (not the sanity check), complete the prompts and log the text with the step to every
    logger that holds text (TensorBoard, Weights & Biases, MLflow, Comet); with none such (CSVLogger, no logger)
    append it to ``samples.txt`` in the run's log folder.

    Runs on global rank 0 only; the model is put back in train mode afterwards.

    Args:
        prompts: texts to complete.
        max_new_tokens: tokens generated per prompt (capped so the longest prompt fits the model's context).
        temperature: sampling temperature (0 = greedy).
        top_k: sample among the k most likely tokens.
        seed: seed of the sampler, so samples at different steps are comparable.
    """

    def __init__(
        self,
        prompts: list[str] = ["Once upon a time"],  # noqa: B006 (a list for jsonargparse; copied, never mutated)
        max_new_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = 50,
        seed: int = 0,
    ) -> None:
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or not self.prompts:
            return
        tokenizer = trainer.datamodule.tokenizer_obj
        backbone = pl_module.backbone
        budget = self.max_new_tokens
        context = getattr(backbone, "max_seq_len", None)
        if context is not None:  # every prompt must fit with its completion
            budget = min(budget, context - max(len(tokenizer.encode(p)) for p in self.prompts))
        was_training = backbone.training
        backbone.eval()
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        try:
            lines = generate_texts(
                backbone, tokenizer, self.prompts, max(budget, 0),
                temperature=self.temperature, top_k=self.top_k, generator=generator,
            )
        finally:
            backbone.train(was_training)
        step = trainer.global_step
        text = "\n\n---\n\n".join(lines)
        held = False
        for logger in trainer.loggers:
            held |= _log_text(logger, step, self.prompts, lines, text)
        if not held:  # no logger that holds text (CSVLogger, none): a plain file in the run's folder
            path = os.path.join(trainer.log_dir or trainer.default_root_dir, "samples.txt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"=== step {step}\n{text}\n\n")


def _log_text(logger, step: int, prompts: list[str], lines: list[str], text: str) -> bool:
    """Log the samples to ``logger`` if it can hold text (TensorBoard, Weights & Biases, MLflow, Comet); whether
    it did."""
    if hasattr(logger, "log_text"):  # Weights & Biases: a table of (step, prompt, sample)
        logger.log_text(key="samples", columns=["step", "prompt", "sample"],
                        data=[[step, p, t] for p, t in zip(prompts, lines)], step=step)
        return True
    experiment = getattr(logger, "experiment", None)
    if hasattr(experiment, "add_text"):  # TensorBoard
        # Two trailing spaces per line keep line breaks in TensorBoard's markdown view.
        experiment.add_text("samples", text.replace("\n", "  \n"), step)
        return True
    if hasattr(experiment, "log_text"):
        if getattr(logger, "run_id", None) is not None:  # MLflow: a text artifact per step
            experiment.log_text(logger.run_id, text, f"samples/step_{step:08d}.txt")
        else:  # Comet
            experiment.log_text(text, step=step)
        return True
    return False


class MFUMonitor(L.Callback):
    """Log ``train/mfu``, the model FLOPs utilisation of each training step, and ``train/flops_per_sec``.

    mfu = (B x T tokens of this device's batch) x backbone.flops_per_token(T) / (step time x peak_flops),
    the step time being the wall time between two training batch ends (data loading and the optimizer step
    included, validation excluded). A backbone without ``flops_per_token`` counts 6 N.

    A CPU's peak is measured (the best of a few short matmuls), and on a shared machine it can read low; a step
    that runs faster than it raises the peak to that step's rate, with one notice line, so ``train/mfu`` never
    goes above 1. A peak set in the config or a GPU's data-sheet peak is kept: a step above it logs its MFU
    above 1 with one warning line, since that points at a wrong ``peak_flops`` or ``flops_per_token``.

    Args:
        peak_flops: FLOP/s of one device. None: the dense bf16 peak of a known GPU (H100/H200 989e12, A100
            312e12, ...), or on a CPU a float32 matmul rate measured when training starts (about 0.3 s).
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and not 0 < peak_flops < math.inf:
            raise LtcxError(f"MFUMonitor peak_flops ({peak_flops}) must be a positive number of FLOP/s")
        self.peak_flops = peak_flops
        self._peak: float | None = None
        self._measured = False  # whether _peak is this run's own measurement (raised when a step beats it)
        self._told = False  # the one line about a step above the peak is printed
        self._last_end: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops is not None:
            self._peak, source = float(self.peak_flops), "set in the config"
        else:
            self._peak, source = default_peak_flops(pl_module.device)
        self._measured = self.peak_flops is None and pl_module.device.type == "cpu"
        self._told = False
        if self._peak is None:
            rank_zero_warn(f"ltcx: no train/mfu: {source}; set MFUMonitor's peak_flops (FLOP/s of one device)")
        else:
            rank_zero_info(f"ltcx: train/mfu against {self._peak:.3g} FLOP/s per device ({source})")
        self._last_end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: torch.Tensor, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._peak is not None and self._last_end is not None and now > self._last_end:
            length = batch.shape[1] - 1  # blocks of T + 1 tokens: T predictions each
            flops = batch.shape[0] * length * model_flops_per_token(pl_module.backbone, length) / (now - self._last_end)
            if flops > self._peak:
                self._above_peak(trainer, flops)
            pl_module.log("train/flops_per_sec", flops)
            pl_module.log("train/mfu", flops / self._peak)
        self._last_end = now

    def _above_peak(self, trainer, flops: float) -> None:
        """A step ran at ``flops`` FLOP/s, above the peak: a measured peak read low and is raised to it; a given
        one is kept. Either way one line, the first time."""
        if self._measured:
            text = (f"step {trainer.global_step} ran at {flops:.3g} FLOP/s, above the measured CPU peak of "
                    f"{self._peak:.3g} (the machine was busier while measuring): train/mfu is against the fastest rate "
                    "seen from now on; set MFUMonitor's peak_flops for a fixed figure")
            self._peak = flops
        else:
            text = (f"train/mfu {flops / self._peak:.3g} > 1 at step {trainer.global_step}: {flops:.3g} FLOP/s is "
                    f"above the peak of {self._peak:.3g}; check MFUMonitor's peak_flops and the backbone's "
                    "flops_per_token")
        if not self._told and getattr(trainer, "is_global_zero", True):
            print(f"ltcx: {text}", file=sys.stderr)
        self._told = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last_end = None  # time spent validating is not a training step


FIX = "lower model.learning_rate, raise model.warmup_steps or set trainer.gradient_clip_val"


class FiniteLossGuard(L.Callback):
    """Stop training with a clear message as soon as the training loss, the weights or the validation loss is NaN
    or infinite.

    The training loss is checked before the backward pass, so the optimizer never steps on it and the weights stay
    those of the last good step. A finite loss can still give a non-finite update (a learning rate far too high): the
    weights are checked after each optimizer step (each tensor's min and max), before anything saves or validates
    them; and the validation loss at the end of each validation, before ``SampleGeneration`` samples from the model
    or ``ModelCheckpoint`` saves it. ``SafeCheckpointIO`` refuses to write non-finite weights in any case. Under DDP
    the ranks' losses and weight checks are gathered first (one scalar per rank and step), so every rank stops at the
    same step; the validation loss is already averaged over the ranks.
    """

    def __init__(self) -> None:
        self._checked_step = -1  # the optimizer step whose weights were checked last

    def setup(self, trainer, pl_module, stage: str) -> None:
        # First among the callbacks: its validation check runs before SampleGeneration's and every other
        # on_validation_end, whatever the order of the config's callbacks (ModelCheckpoint is last in any case).
        if trainer.callbacks and trainer.callbacks[0] is not self:
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        losses = self._gather(trainer, loss.detach().float().reshape(1))
        bad = [(rank, value) for rank, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            self._stop(trainer, f"training loss became {bad[0][1]}", bad, trainer.global_step + 1,
                       "before updating the weights")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._checked_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._checked_step = trainer.global_step
        named = [(name, p.detach()) for name, p in pl_module.named_parameters() if p.numel()]
        # Each tensor's min and max are NaN or inf exactly when it holds one (a sum or a norm can overflow first);
        # on a CPU one aminmax per tensor is ~10x faster than torch._foreach_norm(..., inf).
        extremes = torch.stack([torch.stack(torch.aminmax(p)).float() for _, p in named])
        broken = ~torch.isfinite(extremes).all(dim=1)
        counts = self._gather(trainer, broken.sum().float().reshape(1))
        bad = [(rank, count) for rank, count in enumerate(counts) if count]
        if not bad:
            return
        names = [name for (name, _), b in zip(named, broken.tolist()) if b]
        which = f" ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''})" if names else ""
        self._stop(trainer, f"weights became non-finite{which}", bad, trainer.global_step,
                   "before saving or validating them")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":  # nothing samples or saves after a sanity check
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and not math.isfinite(float(loss)):
            # Averaged over the ranks: every rank has the same value and stops here with the same message.
            where = f" (averaged over the {trainer.world_size} ranks)" if trainer.world_size > 1 else ""
            self._stop(trainer, f"validation loss{where} became {float(loss)}", [], trainer.global_step,
                       "before sampling from or saving the model")

    @staticmethod
    def _gather(trainer, value: torch.Tensor) -> list[float]:
        """``value`` (one scalar) of every rank, in rank order: all-gathered under DDP."""
        if trainer.world_size > 1:
            value = trainer.strategy.all_gather(value).reshape(-1)
        return value.tolist()

    @staticmethod
    def _stop(trainer, what: str, bad: list[tuple[int, float]], step: int, before: str) -> None:
        if trainer.world_size == 1:
            where, stopped = "", "training stopped"
        else:
            ranks = f" on rank {', '.join(str(rank) for rank, _ in bad)} of {trainer.world_size}" if bad else ""
            where, stopped = ranks, "every rank stopped"
            _launcher_outlives_workers(trainer)
        raise StoppedOnAllRanks(
            f"{what}{where} at step {step}, so {stopped} {before} (the last checkpoint is the last good one); {FIX}"
        )


def _launcher_outlives_workers(trainer: L.Trainer) -> None:
    """In a stop every rank agreed on, the process that started the others (rank 0 under Lightning's ``ddp``
    launcher) exits after them, with its own exit status.

    Lightning's child-process observer in that process SIGKILLs it (exit -9, its last line maybe lost) as soon as a
    worker exits non-zero, which here each one does on purpose (2, 143); it is told there is nothing left to watch,
    and the workers are waited for when this process exits (killed after 60 s, so nothing hangs)."""
    procs = list(getattr(trainer.strategy.launcher, "procs", None) or [])
    if not procs:  # a worker, or processes started by torchrun / SLURM: each exits on its own
        return
    try:  # Lightning's private observer (lightning is pinned in requirements.txt); without it, nothing to quiet
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:
        _ChildProcessObserver = None
    for thread in threading.enumerate():
        if _ChildProcessObserver is not None and isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next poll finds all (none) fine and stops
    atexit.register(_wait_for, procs, 60.0)


def _wait_for(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _step_total(bar_class: type) -> type:
    """``bar_class`` whose training total is the run's batches up to ``max_steps``: Lightning shows the steps
    left (2 after resuming at step 4 of 6) against a count that continues from the resumed step ("6/2")."""

    class StepProgressBar(bar_class):
        @property
        def total_train_batches(self) -> int | float:
            trainer = self.trainer
            if trainer.max_epochs == -1 and trainer.max_steps > 0:
                return trainer.max_steps * trainer.accumulate_grad_batches
            return super().total_train_batches

    StepProgressBar.__qualname__ = StepProgressBar.__name__ = f"Step{bar_class.__name__}"
    return StepProgressBar


StepRichProgressBar = _step_total(pl_callbacks.RichProgressBar)
StepTQDMProgressBar = _step_total(pl_callbacks.TQDMProgressBar)


class LineProgress(pl_callbacks.ProgressBar):
    """Progress as plain lines for output that is not a terminal (a file, a pipe, a job log), where a live bar
    prints nothing until the end or fills the file with redraws: one line every ``trainer.log_every_n_steps``
    optimizer steps and one after each validation, flushed at once.

        step 20/40 (50%)  train/loss 5.1234  train/tokens_per_sec 702.1  12.3 s
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._printed_step = -1
        self._start = time.perf_counter()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        self._printed_step = trainer.global_step

    def _line(self, trainer, pl_module, keys=None) -> str:
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        if keys is not None:
            metrics = {k: trainer.callback_metrics[k] for k in keys if k in trainer.callback_metrics}
        step, total = trainer.global_step, trainer.max_steps
        where = f"step {step}/{total} ({100 * step / total:.0f}%)" if total and total > 0 else f"step {step}"
        values = "  ".join(f"{k} {float(v):.4g}" for k, v in metrics.items() if isinstance(v, (int, float)) or (
            torch.is_tensor(v) and v.numel() == 1))
        return f"{where}  {values}  {time.perf_counter() - self._start:.1f} s".replace("   ", "  ")

    def _print_step(self, trainer, pl_module) -> None:
        # Called once the step's own hooks have logged everything (tokens/s is logged at its batch end).
        step, every = trainer.global_step, max(1, trainer.log_every_n_steps)
        if self._enabled and step != self._printed_step and step % every == 0:
            self._printed_step = step
            self.print(self._line(trainer, pl_module), flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._print_step(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._print_step(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._print_step(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._enabled and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.print(self._line(trainer, pl_module, keys=["val/loss", "val/ppl"]), flush=True)


def _run_folder(trainer: L.Trainer, root: str) -> str:
    """``version_N`` with N the first logger's version (its log folder's name), else the next free N in ``root``."""
    version = trainer.loggers[0].version if trainer.loggers else None
    if version is None:
        version = max(run_versions(root), default=-1) + 1
    return version if isinstance(version, str) else f"version_{version}"


_VERSION_FOLDER = re.compile(r"version_\d+")


class ModelCheckpoint(pl_callbacks.ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that also saves the final step and the step a signal stopped at.

    Lightning saves ``last.ckpt`` at the end of training only if nothing was saved before, so a run ending
    between periodic saves lost its last steps. On SIGTERM Lightning stops after the current step and exits
    0 without saving; Ctrl-C (SIGINT) stops wherever it lands. Here both stop after the current step, save it
    (as ``last.ckpt`` when ``save_last``) and exit with 128 + the signal number (143, 130), so a preempted
    job never looks finished. A second Ctrl-C stops at once without saving. Under DDP a signal reaching any
    rank (the launching process, or the whole process group) stops every rank after the same training step,
    decided together at its end; every rank exits with the same status.

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
        self._stop_signal = signal.SIGTERM
        self._previous_sigint = None
        self._pending_signal = 0  # under DDP: the signal this rank received, until the ranks agree on it

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

    def _save_current_step(self, trainer: L.Trainer) -> None:
        if self._should_skip_saving_checkpoint(trainer):  # also: already saved at this step
            return
        candidates = self._monitor_candidates(trainer)
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
        else:
            self._save_topk_checkpoint(trainer, candidates)

    def on_train_start(self, trainer, pl_module) -> None:
        self._pending_signal = 0
        if trainer.world_size > 1:
            # Under DDP a signal only marks the rank it reached; the ranks agree on stopping at the end of each
            # training step (on_train_batch_end). Lightning's own SIGTERM handler is replaced: it runs a broadcast
            # inside the handler, at whatever point each rank is, and the ranks' collectives then no longer match
            # (a SIGTERM to the launching process hung the run).
            signal.signal(signal.SIGTERM, self._note_signal)
            self._previous_sigint = signal.signal(signal.SIGINT, self._note_signal)
        else:
            # Lightning turns SIGTERM into a stop after the current step: route the first Ctrl-C there too.
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _note_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._restore_sigint()  # a second Ctrl-C interrupts at once
        self._pending_signal = max(self._pending_signal, int(signum))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size > 1:
            # Every rank, every step: the highest signal any rank received (0: none), so all stop at this same step
            # with the same exit status, whichever ranks the signal reached (the launching process, the group).
            flag = torch.tensor(self._pending_signal, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max"))
            if signum:
                self._stop_signal = signal.Signals(signum)
                # What Lightning's handler sets: its loop raises SIGTERMException after this step on every rank.
                trainer._signal_connector.received_sigterm = True
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _on_sigint(self, signum, frame) -> None:
        self._stop_signal = signal.SIGINT
        signal.signal(signal.SIGINT, self._previous_sigint)  # a second Ctrl-C interrupts at once
        lightning_handler = signal.getsignal(signal.SIGTERM)
        if not callable(lightning_handler):  # Lightning installs none outside the main thread
            raise KeyboardInterrupt
        lightning_handler(signal.SIGTERM, frame)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_sigint()
        self._save_current_step(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException):  # other errors stop mid-step: nothing consistent to save
            return
        self._save_current_step(trainer)
        # SIGTERMException is a SystemExit: its code becomes the process's exit status.
        exception.code = 128 + self._stop_signal
        if trainer.world_size > 1:
            _launcher_outlives_workers(trainer)
        saved = self.last_model_path or self.best_model_path
        step = trainer.global_step
        rank_zero_info(f"ltcx: {self._stop_signal.name} at step {step}: saved {saved}; resume with --ckpt_path last")
