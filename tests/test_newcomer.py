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


# -- 6: output a user expects: predict's losses, streamed samples, progress lines in a file ----------------------


def test_predict_writes_each_blocks_loss_and_prints_a_summary(tmp_path, fit_env, capsys):
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1"))
    main(["predict", *lean_fit_args(tmp_path, fit_env)[1:], "--ckpt_path", "last", "--data.val_batches", "3"])
    out = capsys.readouterr().out
    csv = tmp_path / "lightning_logs/gpt/version_1/predictions.csv"
    rows = csv.read_text().splitlines()
    assert rows[0] == "block,loss" and len(rows) == 1 + 3 * 4
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    [line] = [line for line in out.splitlines() if line.startswith("ltcx: predict: ")]
    assert line.startswith(f"ltcx: predict: 12 blocks of 32 tokens, mean loss {sum(losses) / 12:.4f} (ppl ")
    assert line.endswith(f"each block's loss in {csv.relative_to(tmp_path)}")


def test_generate_streams_every_sample(tmp_path, monkeypatch):
    """With --num_samples 3 each token is on stdout before the next is sampled, sample after sample."""
    import io

    import ltcx.generation
    from test_failures import write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    stdout, seen = io.StringIO(), []
    real = ltcx.generation.stream_tokens

    def watched(*args, **kwargs):
        for token in real(*args, **kwargs):
            seen.append(stdout.getvalue())  # what was printed before this token
            yield token

    monkeypatch.setattr(ltcx.generation, "stream_tokens", watched)
    monkeypatch.setattr(sys, "stdout", stdout)
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "ab", "--num_samples", "3", "--max_new_tokens", "6",
          "--seed", "0", "--no_stop_at_eot"])
    out = stdout.getvalue()
    samples = out.split("--- sample ")[1:]
    assert [s[:2] for s in samples] == ["1\n", "2\n", "3\n"] and all(s[2:].startswith("ab") for s in samples)
    assert len(seen) == 18
    assert seen[6].startswith("--- sample 1\n") and seen[6].endswith("--- sample 2\nab")  # sample 1 already out
    assert len(set(seen[6:12])) > 2  # sample 2 is written while it is sampled (bytes of a split character wait)


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    from test_cli import fit_args

    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    data = write_corpus(tmp_path / "corpus", 60, 10)
    main(fit_args(data, "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "true",
                  "--trainer.log_every_n_steps", "2"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 2/4 (50%)"] * 2 + ["step 4/4 (100%)"] * 2
    assert "train/loss " in lines[0] and "train/tokens_per_sec " in lines[0] and lines[0].endswith(" s")
    assert "val/loss " in lines[1] and "val/ppl " in lines[1]
