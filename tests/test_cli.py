"""End to end: real `run.py fit` subprocesses on a small fixture, resume, generate, DDP, and user errors."""

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    ROOT,
    TINY_MODEL,
    assert_mentions,
    assert_one_error_line,
    fit_args,
    one_error_line,
    read_events,
    run_cli,
    write_corpus,
)
from ltcx.cli import main
from ltcx.models.catalog import CATALOG, config_path


def test_fit_resume_and_generate(tmp_path):
    data = write_corpus(tmp_path / "corpus")
    first = run_cli(fit_args(data, "--trainer.max_steps", "4"), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints/gpt/version_0/last.ckpt"  # beside its logs' version_0
    assert checkpoint.is_file()
    run_dir = tmp_path / "lightning_logs/gpt/version_0"
    assert (run_dir / "config.yaml").is_file()
    saved = (run_dir / "config.yaml").read_text()
    assert "ltcx.models.gpt.GPT" in saved and "n_embd: 32" in saved

    events = read_events(run_dir)
    samples = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    assert sorted(samples) == [2, 4] and all(text.startswith("Once upon a time") for text in samples.values())
    for tag in ("train/loss", "val/loss", "val/ppl", "val/bpb", "work/tokens_per_sec", "work/tokens_seen", "train/lr"):
        assert tag in events.Tags()["scalars"], tag
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 4
    # TensorBoard's first view holds train/ and val/ only (no epoch or hp_metric placeholder), on one step axis:
    # optimizer steps done, as the samples and checkpoints count them.
    scalars = events.Tags()["scalars"]
    assert not {"epoch", "hp_metric"} & set(scalars)
    # Its Time Series view shows groups (a tag's part before "/") alphabetically, two charts a row at 1400 px: train/
    # (loss, lr) then val/ (bpb, loss; ppl below) fill the first screen, the rates (work/) come below them
    # (scripts/tensorboard_view.py sees it in Chromium: tests/test_tensorboard_view.py).
    groups = sorted({tag.split("/")[0] for tag in scalars})
    assert groups[:2] == ["train", "val"], groups
    assert sorted(t for t in scalars if t.startswith(("train/", "val/"))) == ["train/loss", "train/lr", "val/bpb",
                                                                             "val/loss", "val/ppl"]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("train/loss")][0] >= 1
    # The console: where the run writes, first and last; none of Lightning's lines that say nothing on a CPU.
    assert "ltcx: GPT, " in first.stderr and "logs lightning_logs/gpt/version_0" in first.stderr
    notices = [line for line in first.stderr.splitlines() if line.startswith("ltcx: ")]
    assert notices[-1].startswith("ltcx: step 4: ") and notices.index(next(
        line for line in notices if line.startswith("ltcx: GPT, "))) < notices.index(next(
            line for line in notices if line.startswith("ltcx: work/mfu against "))), notices  # the start line first
    assert "ltcx: step 4: checkpoint checkpoints/gpt/version_0/last.ckpt" in first.stderr
    for noise in ("GPU available", "TPU available", "Tip:", "LeafSpec", "Total FLOPs"):
        assert noise not in first.stderr + first.stdout, noise

    resumed = run_cli(fit_args(data, "--trainer.max_steps", "6", "--ckpt_path", "last"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 4  # the first run's file is its own
    [start] = [line for line in resumed.stderr.splitlines() if line.startswith("ltcx: GPT, ")]
    assert_mentions(start, "lightning_logs/gpt/version_1", "checkpoints/gpt/version_1", "resumed at step 4 of 6")
    checkpoint = tmp_path / "checkpoints/gpt/version_1/last.ckpt"
    state = torch.load(checkpoint, weights_only=False)
    assert state["global_step"] == 6
    steps = [e.step for e in read_events(tmp_path / "lightning_logs/gpt/version_1").Scalars("train/loss")]
    assert min(steps) >= 4, steps  # continued from step 4, not from scratch
    assert state["ltcx"]["tokens_seen"] == 6 * 4 * 32

    generated = run_cli(["generate", "--ckpt_path", str(checkpoint), "--prompt", "Once upon a time",
                         "--max_new_tokens", "10", "--seed", "0"], tmp_path)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith("Once upon a time") and len(generated.stdout) > len("Once upon a time") + 5

    too_long = run_cli(["generate", "--ckpt_path", str(checkpoint), "--prompt", "cat " * 60,
                        "--max_new_tokens", "10"], tmp_path)
    assert too_long.returncode == 2
    assert_mentions(assert_one_error_line(too_long.stderr), "max_new_tokens (10)", "context of 64",
                    "shorten the prompt", "lower max_new_tokens")


def test_ddp_two_cpu_processes_see_disjoint_blocks(tmp_path):
    data = write_corpus(tmp_path / "corpus", train_docs=200)
    record = tmp_path / "record"
    result = run_cli(
        fit_args(data, "--trainer.max_steps", "3", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                 "--trainer.strategy", "ddp",
                 "--trainer.callbacks+=batch_recorder.RecordBatches", f"--trainer.callbacks.out_dir={record}"),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0 = json.loads((record / "rank0.json").read_text())
    rank1 = json.loads((record / "rank1.json").read_text())
    assert len(rank0) == len(rank1) == 3 * 4
    assert not {tuple(b) for b in rank0} & {tuple(b) for b in rank1}


@pytest.mark.slow  # about 10 s an architecture on 2 cores
@pytest.mark.parametrize("arch", sorted(CATALOG))
def test_every_architecture_trains_with_two_ddp_processes(arch, tmp_path):
    """Every parameter of every architecture takes part in its loss: DDP's gradient reduction would fail on one
    that does not (Lightning's ddp does not look for unused parameters)."""
    data = write_corpus(tmp_path / "corpus", train_docs=200)
    args = [
        "fit", "--config", str(config_path(arch)), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
        "--data.path", str(data), "--data.block_size", "32", "--data.batch_size", "4", "--data.val_batches", "2",
        "--trainer.val_check_interval", "2", "--trainer.max_steps", "3", "--trainer.accelerator", "cpu",
        "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.enable_progress_bar", "false",
        *CATALOG[arch].tiny_cli(),
    ]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`max_steps=3` reached" in result.stderr


@pytest.mark.parametrize(
    "override,facts",
    [
        (["--model.backbone.init_args.n_kv_head", "3"], ("n_head (2) must be divisible by n_kv_head (3)",)),
        (["--data.path", "/nonexistent/corpus"], ("no data files match '/nonexistent/corpus'", "pass --data.path")),
        (["--data.text_column", "body"], ("column 'body' not found", "set --data.text_column")),
        (["--data.tokenizer", "no-such-tokenizer"], ("unknown tokenizer 'no-such-tokenizer'", "'gpt2', 'bytes'")),
        (["--data.block_size", "128"], ("data.block_size (128)", "context (64)",
                                        "model.backbone.init_args.block_size to at least 128",
                                        "lower data.block_size")),
    ],
)
def test_user_errors_are_one_clear_line(tmp_path, monkeypatch, capsys, override, facts):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    data = write_corpus(tmp_path / "corpus", 20, 5)
    assert_mentions(one_error_line(fit_args(data, "--trainer.max_steps", "1", *override), capsys), *facts)
    assert not (tmp_path / "checkpoints").exists()


def test_unreachable_hub_names_the_offline_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    line = one_error_line(fit_args(Path("roneneldan/TinyStories"), "--trainer.max_steps", "1"), capsys)
    assert_mentions(line, "cannot load data set 'roneneldan/TinyStories'", "--data.path")
    assert not list(tmp_path.glob("lightning_logs/*/*/config.yaml"))


@pytest.mark.quick
def test_smoke_config_trains_on_the_builtin_sample(tmp_path, monkeypatch, capsys):
    """The README's quickstart, shrunk: smoke.yaml alone (no --data.path, no hub) fits, validates, samples, saves."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
          "--data.block_size", "32", "--data.batch_size", "2", "--data.val_batches", "1", "--trainer.max_steps", "2",
          "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false", *TINY_MODEL])
    assert torch.load(tmp_path / "checkpoints/gpt/version_0/last.ckpt", weights_only=False)["global_step"] == 2
    events = read_events(tmp_path / "lightning_logs/gpt/version_0")
    assert [e.step for e in events.Tensors("samples/text_summary")] == [2]
    assert "sample" in (tmp_path / "lightning_logs/gpt/version_0/config.yaml").read_text()
