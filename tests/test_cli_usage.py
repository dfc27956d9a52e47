"""The everyday CLI options a user meets: bf16 -> float32 on a CPU, extending a run's schedule, predict's CSV,
generate's streaming, plain progress lines, help listing the backbones, export, samples to loggers, local paths,
torch threads and checkpoint folders."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    ROOT,
    TINY_MODEL,
    assert_mentions,
    fit_args,
    lean_fit_args,
    one_error_line,
    write_checkpoint,
    write_corpus,
)
from ltcx.cli import LtcxCLI, main
from ltcx.data import TextDataModule
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.optim import lr_at_step
from ltcx.persist import load_language_model


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
    # typed by a prefix the parser takes as the flag: typed all the same
    (["--trainer.accelerator", "cpu", "--trainer.precisio", "bf16-mixed"], "bf16-mixed", None),
    (["--trainer.accelerator", "cpu", "--trainer.prec=bf16-true"], "bf16-true", None),
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
    assert_mentions(capsys.readouterr().err, "no CUDA device", "trainer.precision bf16-mixed -> 32-true")


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
    label = ' of 3, prompt "ab"\n'
    assert [s[: 1 + len(label)] for s in samples] == [f"{i}{label}" for i in (1, 2, 3)]
    assert all(s[1 + len(label):].startswith("ab") for s in samples)
    assert len(seen) == 18
    assert seen[6].startswith(f"--- sample 1{label}") and seen[6].endswith(f"--- sample 2{label}ab")  # 1 is out
    assert len(set(seen[6:12])) > 2  # sample 2 is written while it is sampled (bytes of a split character wait)


def test_generate_labels_each_sample_with_its_prompt_and_says_when_it_stopped_at_end_of_text(tmp_path, monkeypatch,
                                                                                          capsys):
    """Several prompts: each sample's line names its prompt. A sample that ends at the end-of-text token before
    --max_new_tokens says so on stderr, once, with the flag that goes on."""
    import ltcx.generation
    from ltcx.tokenizers import get_tokenizer

    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    real, eot = ltcx.generation.stream_tokens, get_tokenizer("bytes").eot_id

    def end_of_text_third(*args, **kwargs):  # a model that ends its text after two tokens
        for step, token in enumerate(real(*args, **kwargs)):
            yield torch.full_like(token, eot) if step == 2 else token

    monkeypatch.setattr(ltcx.generation, "stream_tokens", end_of_text_third)
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "The cat", "--prompt", "x" * 50,
          "--num_samples", "2", "--max_new_tokens", "10", "--seed", "0"])
    captured = capsys.readouterr()
    labels = [line for line in captured.out.splitlines() if line.startswith("--- ")]
    long = json.dumps("x" * 37 + "...")
    assert labels == ['--- sample 1 of 2, prompt "The cat"', '--- sample 2 of 2, prompt "The cat"',
                      f"--- sample 1 of 2, prompt {long}", f"--- sample 2 of 2, prompt {long}"]
    notices = [line for line in captured.err.splitlines() if "end-of-text" in line]
    assert_mentions(notices[0], 'sample 1 of 2, prompt "The cat"', "--max_new_tokens 10", "--no_stop_at_eot")
    assert len(notices) == 4 and all("after 2 new tokens" in line for line in notices)
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "ab", "--prompt", "cd", "--max_new_tokens", "5",
          "--no_stop_at_eot"])
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("--- ")] == ['--- prompt "ab"',
                                                                                       '--- prompt "cd"']
    assert "end-of-text" not in captured.err  # no stop token: nothing to say


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    data = write_corpus(tmp_path / "corpus", 60, 10)
    main(fit_args(data, "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "true",
                  "--trainer.log_every_n_steps", "2"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 2/4 (50%)"] * 2 + ["step 4/4 (100%)"] * 2
    assert "train/loss " in lines[0] and "work/tokens_per_sec " in lines[0] and lines[0].endswith(" s")
    assert "val/loss " in lines[1] and "val/ppl " in lines[1]


# -- 7: ecosystem habits -----------------------------------------------------------------------------------------


def test_lightning_load_from_checkpoint(tmp_path):
    path = write_checkpoint(tmp_path / "model.ckpt")
    model = LanguageModel.load_from_checkpoint(path)
    reference, _ = load_language_model(path, model_class=LanguageModel)
    assert type(model.backbone) is GPT and model.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert LanguageModel.load_from_checkpoint(str(path), learning_rate=1e-3).hparams.learning_rate == 1e-3


def test_fit_help_lists_ltcx_backbones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    known = text.split("--model.backbone BACKBONE the sequence model")[1].split("known subclasses: ")[1].split(")")[0]
    assert set(known.split(", ")) >= {"ltcx.models.gpt.GPT", "ltcx.models.gta.GTAGPT", "ltcx.models.ltc.LTCGPT",
                                      "ltcx.models.titans.Titans", "ltcx.models.xlstm.XLSTM"}
    assert "torch.nn" not in known


def test_export_is_weights_only_and_reloads_in_one_call(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "model.ckpt")
    out = tmp_path / "shared/gpt-bytes"
    main(["export", "--ckpt_path", str(path), "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1
    assert_mentions(printed, f"exported to {out}/", "config.json", "model.safetensors")
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt-bytes"]  # no temp folder left
    config = json.loads((out / "config.json").read_text())
    assert config["backbone_class"] == "ltcx.models.gpt.GPT" and config["tokenizer"] == "bytes"
    assert config["backbone_config"]["n_embd"] == 32 and config["hyper_parameters"]["warmup_steps"] == 2
    assert config["global_step"] == 3

    model = LanguageModel.from_pretrained(out)
    reference, _ = load_language_model(path, model_class=LanguageModel)
    idx = torch.randint(0, 256, (2, 9))
    assert not model.training and torch.equal(model(idx)[0], reference(idx)[0])
    generated = []
    for source in (path, out):
        main(["generate", "--ckpt_path", str(source), "--prompt", "ab", "--max_new_tokens", "5", "--temperature", "0"])
        generated.append(capsys.readouterr().out)
    assert generated[0] == generated[1] and generated[0].startswith("ab")

    line = one_error_line(["export", "--ckpt_path", str(path), "--out", str(out)], capsys)
    assert_mentions(line, f"'{out}' already exists", "--out a new folder")
    config["backbone_class"] = "os.system"
    (out / "config.json").write_text(json.dumps(config))
    line = one_error_line(["generate", "--ckpt_path", str(out), "--prompt", "a"], capsys)
    assert_mentions(line, "backbone class 'os.system'", "not a registered ltcx backbone")


def test_samples_reach_every_logger_that_holds_text_else_a_file(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from ltcx.callbacks import SampleGeneration
    from ltcx.tokenizers import get_tokenizer

    class TableLogger:  # the shape of Weights & Biases' logger
        def __init__(self):
            self.tables = []

        def log_text(self, key, columns, data, step):
            self.tables.append((key, columns, data, step))

    torch.manual_seed(0)
    lm = LanguageModel(GPT(block_size=32, vocab_size=320, n_layer=1, n_head=2, n_embd=16))
    table, csv = TableLogger(), CSVLogger(tmp_path / "logs", name="gpt")
    data = SimpleNamespace(tokenizer_obj=get_tokenizer("bytes"))
    for loggers, step in (([table], 5), ([csv], 7), ([csv], 9)):
        trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, global_step=step, datamodule=data,
                                  loggers=loggers, log_dir=loggers[0].__dict__.get("log_dir") or csv.log_dir,
                                  default_root_dir=str(tmp_path))
        SampleGeneration(prompts=["ab", "cd"], max_new_tokens=4).on_validation_end(trainer, lm)
    [(key, columns, rows, step)] = table.tables
    assert (key, columns, step) == ("samples", ["step", "prompt", "sample"], 5)
    assert [r[:2] for r in rows] == [[5, "ab"], [5, "cd"]] and rows[0][2].startswith("ab")
    text = (Path(csv.log_dir) / "samples.txt").read_text()
    assert text.startswith("=== step 7\nab") and "\n=== step 9\nab" in text


# -- 3: a local path that does not exist gets the local-files error, never the hub's ------------------------------


@pytest.mark.parametrize("path,local", [
    ("corpus/", True), ("data/local/", True), ("my.txt", True), ("texts/*.jsonl", True), ("a/b/c", True),
    ("notes.md", True), ("x/y.tar.gz", True), ("a//b", True), ("corpus\\train", True),
    ("roneneldan/TinyStories", False), ("HuggingFaceFW/fineweb-edu", False), ("jondurbin/airoboros-3.1", False),
    ("tinystories", False),
])
def test_what_looks_like_a_local_path(tmp_path, monkeypatch, path, local):
    from ltcx.data.files import looks_local

    monkeypatch.chdir(tmp_path)
    assert looks_local(path) is local
    (tmp_path / "data").mkdir()
    assert looks_local("data/local")  # an existing parent folder makes it a path


@pytest.mark.parametrize("extra,shown", [
    (["--data.path", "korpus/"], "korpus/"),  # mistyped: the corpus is in corpus/
    (["--config", str(ROOT / "configs/data/local.yaml")], "data/local/"),
])
def test_missing_local_path_is_the_local_files_error(tmp_path, fit_env, capsys, extra, shown):
    args = lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "1")
    at = args.index("--data.path")
    del args[at:at + 2]
    line = one_error_line([*args, *extra], capsys)
    assert_mentions(line, f"no data files match '{shown}'", "--data.path", ".txt/.jsonl/.parquet")
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()


# -- 8: thread count ---------------------------------------------------------------------------------------------


def test_num_threads_sets_torch_threads_and_omp_for_ddp_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # restored after the test
    before = torch.get_num_threads()
    try:
        parsed(["--data.path", str(write_corpus(tmp_path / "corpus", 5, 2)), "--num_threads", "1"])
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
    monkeypatch.chdir(tmp_path)
    line = one_error_line(["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--num_threads", "0"], capsys)
    assert_mentions(line, "num_threads (0)", ">= 1", "null: one per core", "--num_threads")


def test_a_checkpoint_folder_means_its_latest_runs_last_ckpt(tmp_path, capsys):
    folder = tmp_path / "checkpoints/gpt"
    for version, tokenizer in ((0, "bytes"), (2, "bytes"), (10, "gpt2")):
        (folder / f"version_{version}").mkdir(parents=True)
        write_checkpoint(folder / f"version_{version}/last.ckpt", tokenizer=tokenizer)
    (folder / "version_11").mkdir()  # a run that saved nothing (yet)
    # version_10, not version_2 (numeric order)
    assert load_language_model(folder, model_class=LanguageModel)[1]["tokenizer"] == "gpt2"
    write_checkpoint(folder / "version_10/last-v1.ckpt")
    line = one_error_line(["generate", "--ckpt_path", str(folder)], capsys)
    assert_mentions(line, f"'{folder}'", "several runs' last checkpoints", f"{folder}/version_10/last-v1.ckpt",
                    f"{folder}/version_10/last.ckpt", "--ckpt_path the .ckpt file")


@pytest.mark.parametrize("cores,devices,threads", [(1, "1", 1), (4, "2", 2), (64, "1", None)])
def test_threads_fit_the_usable_cores(tmp_path, monkeypatch, capsys, cores, devices, threads):
    """A CPU quota torch does not see (cores=1 of 2) or DDP processes sharing the cores cap torch's threads."""
    import ltcx.runtime

    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    monkeypatch.setattr(ltcx.runtime, "usable_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64 if cores == 4 else 2)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    cli = LtcxCLI(LanguageModel, TextDataModule, run=False, args=[
        "--config", str(ROOT / "configs/gpt.yaml"), *TINY_MODEL, "--trainer.accelerator", "cpu",
        "--trainer.devices", devices, "--data.path", str(write_corpus(tmp_path / "corpus", 5, 2))])
    assert cli.config.trainer.devices in (int(devices), devices)
    assert calls == ([threads] if threads else [])
    assert (os.environ["OMP_NUM_THREADS"] == str(threads)) if threads else os.environ["OMP_NUM_THREADS"] == ""
    if threads:
        assert f"torch thread(s) each, not {64 if cores == 4 else 2}" in capsys.readouterr().err


# -- a command builds its own parser only ----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["fit", "test"])
def test_a_command_builds_only_its_own_parser(command, monkeypatch, capsys):
    """``ltcx fit`` builds the fit parser, not validate's, test's and predict's as well (each a quarter of
    LightningCLI's parser building), and its help is the whole of fit's."""
    from lightning.pytorch.cli import LightningCLI

    built = []
    prepare = LightningCLI._prepare_subcommand_parser
    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser",
                        lambda self, klass, name, **kw: built.append(name) or prepare(self, klass, name, **kw))
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0 and built == [command]
    assert "--model.learning_rate" in capsys.readouterr().out


# -- the program's name in help and error lines ----------------------------------------------------------------


@pytest.mark.parametrize("argv0,name", [
    ("/venv/bin/ltcx", "ltcx"),
    ("/site-packages/ltcx/__main__.py", "python -m ltcx"),
    ("run.py", "run.py"),
    ("/site-packages/pytest/__main__.py", "ltcx"),  # another program's __main__ that calls main()
    ("", "ltcx"),
])
@pytest.mark.parametrize("command", ["generate", "export", "prepare", "evaluate", "lm-eval", "study"])
def test_every_argparse_command_names_the_program_it_was_started_as(argv0, name, command, monkeypatch, capsys):
    """Its usage line, and its argument errors as one line pointing to its --help, as `ltcx fit`'s are."""
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: {name} {command} ")
    line = one_error_line([command, "--no_such_flag"], capsys)  # a required flag missing, or this one unknown
    assert line.startswith("ltcx: error: ") and line.endswith(f"; see `{name} {command} --help`"), line


def test_an_argparse_command_names_the_flag_a_typo_meant(capsys):
    line = one_error_line(["generate", "--ckpt_path", "x", "--promt", "Once"], capsys)
    assert_mentions(line, "unrecognized arguments: --promt", "--prompt?", "`ltcx generate --help`")


def test_a_check_across_flags_is_the_parsers_own_error_line(capsys):
    line = one_error_line(["study", "--spec", "quick-recall", "--dry_run", "--report_only"], capsys)
    assert_mentions(line, "--dry_run and --report_only", "exclude each other", "`ltcx study --help`")
