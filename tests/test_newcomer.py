"""Issue 13, the newcomer's path: what a new user meets on a fresh clone following the README."""

import sys
from pathlib import Path

import pytest

from ltcx.cli import LtcxCLI
from ltcx.data import TextDataModule
from ltcx.lm import LanguageModel
from test_cli import ROOT, TINY_MODEL, write_corpus


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
