"""`fit --ckpt_path`: `last` finds the latest run, a missing or unreadable file is one line before anything is
written, a finished run asked to resume writes nothing, and the progress bar counts from the resumed step."""

import shutil

import pytest

from helpers import (
    assert_mentions,
    damaged,
    fit_args,
    lean_fit_args,
    one_error_line,
    step_and_weights,
)
from ltcx.cli import main
from ltcx.persist import read_checkpoint


@pytest.mark.parametrize("max_steps", ["2", "3"])
def test_resuming_at_or_past_max_steps_says_so_and_writes_nothing(tmp_path, fit_env, capsys, max_steps):
    """A finished run asked to resume (a resumed study's run does so) exits 0 with a notice, leaving no new folder."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "3"))
    capsys.readouterr()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", max_steps, "--ckpt_path", "last"))
    last = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    [notice] = [line for line in capsys.readouterr().err.splitlines() if "nothing to train" in line]
    assert_mentions(notice, f"'{last.relative_to(tmp_path)}'", "step 3", f"trainer.max_steps {max_steps}",
                    "raise --trainer.max_steps")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before



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



def test_a_checkpoint_saved_every_n_steps_holds_the_tokens_of_its_steps(tmp_path, fit_env):
    """``every_n_train_steps`` saves in the step's ``on_train_batch_end``, before the model's own hook: the tokens of
    that step are counted already (6 steps of 4 x 32 tokens: 768, not 640), and a run resumed from it continues the
    count."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "7", every=3))
    folder = tmp_path / "checkpoints/gpt/version_0"
    periodic = read_checkpoint(folder / "epoch=0-step=6.ckpt")
    assert (periodic["global_step"], periodic["ltcx"]["tokens_seen"]) == (6, 6 * 4 * 32)
    assert read_checkpoint(folder / "last.ckpt")["ltcx"]["tokens_seen"] == 7 * 4 * 32
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "8", "--ckpt_path",
                       str(folder / "epoch=0-step=6.ckpt")))
    assert read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")["ltcx"]["tokens_seen"] == 8 * 4 * 32


def test_ckpt_path_last_refuses_when_runs_share_the_folder(tmp_path, fit_env, capsys, checkpoint):
    folder = tmp_path / "checkpoints/gpt"
    folder.mkdir(parents=True)
    shutil.copy(checkpoint, folder / "last.ckpt")
    shutil.copy(checkpoint, folder / "last-v1.ckpt")
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1", "--ckpt_path", "last"), capsys)
    assert_mentions(line, "--ckpt_path last", "ambiguous", "checkpoints/gpt/last-v1.ckpt", "checkpoints/gpt/last.ckpt",
                    "pass --ckpt_path the one")
    assert not (tmp_path / "lightning_logs").exists()



@pytest.mark.parametrize("how,facts", [
    ("missing", ("does not exist", "pass --ckpt_path")),
    ("empty", ("is empty (0 bytes)", "use another checkpoint")),
    ("truncated", ("truncated or not a checkpoint",)),
    ("random", ("could not be read",)),
    ("another architecture", ("--model.backbone.init_args.n_embd 16", "would change the architecture",
                              "n_embd 32", "drop the flag")),
    ("another vocabulary", ("is of another model", "vocab_size: 320 in the file, 50304 configured",
                            "pass the config")),
])
def test_fit_ckpt_path_failures(tmp_path, fit_env, capsys, checkpoint, how, facts):
    path = checkpoint if how.startswith("another") else damaged(tmp_path, checkpoint, how)
    typed = [] if how == "another vocabulary" else ["--model.backbone.init_args.n_embd", "16"]  # gpt2 here, bytes there
    line = one_error_line(fit_args(fit_env, "--trainer.max_steps", "1", "--ckpt_path", str(path), *typed), capsys)
    assert_mentions(line, f"checkpoint '{path}'", *facts)
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()



def test_progress_bar_total_after_resume():
    from ltcx.callbacks import StepTQDMProgressBar

    class Trainer:
        max_epochs, max_steps, accumulate_grad_batches, global_step, num_training_batches = -1, 6, 1, 4, float("inf")

    bar = StepTQDMProgressBar()
    bar._trainer = Trainer()
    assert bar.total_train_batches == 6  # Lightning's own bar says 2 (the steps left) against a count of 6

