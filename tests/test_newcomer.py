"""Issue 13, the newcomer's path: what a new user meets on a fresh clone following the README."""

import sys
from pathlib import Path

import pytest
import torch

from ltcx.cli import LtcxCLI, main
from ltcx.data import TextDataModule
from ltcx.lm import LanguageModel, lr_at_step
from test_cli import ROOT, TINY_MODEL, write_corpus
from test_failures import fit_env, lean_fit_args  # noqa: F401 (fit_env is a fixture)


def parsed(args: list[str]) -> LtcxCLI:
    """The CLI built (nothing run) from configs/gpt.yaml plus ``args``."""
    return LtcxCLI(LanguageModel, TextDataModule, run=False,
                   args=["--config", str(ROOT / "configs/gpt.yaml"), *TINY_MODEL, *args])


# -- 1: bf16 falls back to float32 on a CPU unless typed on the command line -------------------------------------


@pytest.mark.parametrize("flags,precision,notice", [
    (["--trainer.accelerator", "cpu"], "32-true",
     "ltcx: training on the CPU, so trainer.precision bf16-mixed -> 32-true (pass --trainer.precision bf16-mixed "
     "to keep it)"),
    (["--trainer.accelerator", "cpu", "--trainer.precision", "bf16-mixed"], "bf16-mixed", None),
    (["--trainer.accelerator=cpu", "--trainer.precision=bf16-true"], "bf16-true", None),
])
def test_bf16_on_a_cpu_falls_back_unless_asked_for(tmp_path, monkeypatch, capsys, flags, precision, notice):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    cli = parsed(["--data.path", str(write_corpus(tmp_path / "corpus", 5, 2)), *flags])
    assert cli.config.trainer.precision == precision
    notices = [line for line in capsys.readouterr().err.splitlines() if "trainer.precision" in line]
    assert notices == ([notice] if notice else [])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_bf16_without_cuda_falls_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    cli = parsed(["--data.path", str(write_corpus(tmp_path / "corpus", 5, 2))])
    assert cli.config.trainer.precision == "32-true"
    assert "ltcx: no CUDA device, so trainer.precision bf16-mixed -> 32-true" in capsys.readouterr().err


# -- 5: extending a finished run keeps the checkpoint's learning-rate schedule ----------------------------------


def final_lr(path: Path) -> float:
    return torch.load(path, weights_only=True)["optimizer_states"][0]["param_groups"][0]["lr"]


@pytest.mark.parametrize("typed,end,notice", [
    ([], 4, "ltcx: resuming with the checkpoint's learning-rate schedule (cosine to min_lr ends at step 4, not at "
            "trainer.max_steps 7); pass --model.decay_steps N to change it"),
    (["--model.decay_steps", "10"], 10, "ltcx: model.decay_steps 10 replaces the checkpoint's learning-rate schedule "
                                        "end (4)"),
])
def test_extending_a_run_keeps_its_schedule(tmp_path, fit_env, capsys, typed, end, notice):
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4"))
    first = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    assert final_lr(first) == pytest.approx(6e-5) and torch.load(first, weights_only=True)["ltcx"]["decay_steps"] == 4
    capsys.readouterr()
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "7", "--ckpt_path", "last", *typed))
    assert [line for line in capsys.readouterr().err.splitlines() if "schedule" in line] == [notice]
    extended = torch.load(tmp_path / "checkpoints/gpt/version_1/last.ckpt", weights_only=True)
    assert extended["ltcx"]["decay_steps"] == end
    assert extended["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(
        lr_at_step(7, 6e-4, 6e-5, 2, end))  # the rate of the next step after 7 done
