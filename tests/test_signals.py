"""SIGTERM and Ctrl-C stop a run after its step, save it, exit 143 / 130, and the run resumes exactly."""

import signal

import torch

from helpers import (
    lean_fit_args,
    run_cli,
    step_and_weights,
    write_corpus,
)


def test_sigterm_saves_the_step_exits_143_and_resumes_exactly(tmp_path):
    """Bit for bit: every run on one thread, so no BLAS thread count chosen under load changes a rounding."""
    data = write_corpus(tmp_path / "corpus", 60, 10)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    one_thread = ("--num_threads", "1")
    done = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", *one_thread), whole)
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6",
                                    "--trainer.callbacks+=fault_injection.SignalSelf",
                                    "--trainer.callbacks.at_step=3", "--trainer.callbacks.signal_name=SIGTERM",
                                    *one_thread), parts)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "ltcx: SIGTERM at step 3: saved" in stopped.stderr and "Traceback" not in stopped.stderr
    assert step_and_weights(parts / "checkpoints/gpt/version_0/last.ckpt")[0] == 3

    resumed = run_cli(lean_fit_args(tmp_path, data, "--trainer.max_steps", "6", "--ckpt_path", "last", *one_thread),
                      parts)
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

