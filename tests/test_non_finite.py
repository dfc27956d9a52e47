"""Non-finite losses, updates and weights stop a run before anything saves them, in one line."""


import pytest
import torch

from helpers import (
    assert_mentions,
    fit_args,
    lean_fit_args,
    one_error_line,
    step_and_weights,
)
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.persist import SafeCheckpointIO

# the fix each non-finite stop names
LOWER_THE_RATE = ("model.learning_rate", "model.warmup_steps", "trainer.gradient_clip_val")


@pytest.mark.parametrize("poison_at,facts", [
    (4, ("training loss became nan", "step 5", "before updating the weights")),
    (6, ("weights backbone.wte.weight and 1 more", "not finite", "step 6", "'{last}' was not written",
         "previous checkpoint is kept")),
])
def test_nan_stops_before_any_non_finite_weights_are_saved(tmp_path, fit_env, capsys, poison_at, facts):
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
    resumed = tmp_path / "checkpoints/gpt/version_1/last.ckpt"  # the resumed run's folder
    assert_mentions(line, *(fact.format(last=resumed) for fact in facts))
    assert last.read_bytes() == before
    step, weights = step_and_weights(last)
    assert step == 3 and all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    assert sorted(p.relative_to(last.parent.parent).as_posix() for p in last.parent.parent.rglob("*")) == [
        "version_0", "version_0/last.ckpt"]  # --ckpt_path last still finds the good one



def test_non_finite_update_stops_before_anything_saves_it(tmp_path, fit_env, capsys):
    """A finite loss whose update writes NaN into the weights at step 4 (the huge learning rate case): stopped right
    after that optimizer step (gradient clipping spread the NaN to every weight), before the periodic save of step 4;
    the good step 2 stays last."""
    line = one_error_line(lean_fit_args(
        tmp_path, fit_env, "--trainer.max_steps", "6", "--trainer.callbacks+=fault_injection.PoisonGradient",
        "--trainer.callbacks.at_step=4", every=2), capsys)
    assert_mentions(line, "weights became non-finite", "backbone.wte.weight and 9 more", "step 4",
                    "stopped before saving or validating", "last good one", *LOWER_THE_RATE)
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
    assert_mentions(line, "validation loss became nan", "step 2", "stopped before sampling from or saving",
                    "last good one", *LOWER_THE_RATE)
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



def test_checkpoint_io_refuses_non_finite_weights(tmp_path):
    target = tmp_path / "last.ckpt"
    with pytest.raises(LtcxError) as error:
        SafeCheckpointIO().save_checkpoint({"global_step": 7, "state_dict": {"w": torch.tensor([1.0, float("inf")])}},
                                           target)
    assert_mentions(str(error.value), "weights w", "not finite", "step 7", f"'{target}'", "not written")
    assert not list(tmp_path.iterdir())

