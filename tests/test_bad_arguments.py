"""Bad flags and config files for fit and generate: one line naming the problem and the fix, exit 2, nothing written;
`--help` and `--print_config` still work."""

import subprocess
import sys

import pytest
import torch

from helpers import (
    ROOT,
    assert_mentions,
    fit_args,
    one_error_line,
)
from ltcx.cli import main
from ltcx.lm import LanguageModel
from ltcx.models.catalog import shipped_config_names
from ltcx.models.gpt import GPT
from ltcx.persist import atomic_save, load_language_model


@pytest.mark.parametrize("override,message", [
    (["--model.learning_rate", "0"], "model.learning_rate (0.0) must be a positive number"),
    (["--model.learning_rate=-1e-3"], "model.learning_rate (-0.001) must be a positive number"),
    (["--model.min_lr", "1e-2"], "model.min_lr (0.01) must be in [0, model.learning_rate=0.0006]"),
    (["--model.warmup_steps", "-1"], "model.warmup_steps (-1) must be >= 0"),
    (["--trainer.max_steps", "-2"], "trainer.max_steps (-2) must be >= -1 (-1: no limit)"),
    (["--seed_everything", "-5"], "seed_everything (-5) must be in [0, 4294967295], or true for a random seed"),
    (["--model.betas", "[2,3]"], "model.betas ([2.0, 3.0]) must be two numbers in [0, 1), such as [0.9, 0.95]: fix "
                                 "--model.betas"),
    (["--model.eps", "-1"], "model.eps (-1.0) must be a positive number, such as 1e-8: fix --model.eps"),
    (["--model.weight_decay", "-0.1"], "model.weight_decay (-0.1) must be >= 0: fix --model.weight_decay"),
    pytest.param(["--trainer.accelerator", "gpu"], "trainer.accelerator gpu: no GPU found on this machine: use "
                 "--trainer.accelerator cpu or auto",
                 marks=pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                                          reason="a GPU is there")),
    (["--trainer.devices", "abc"], "trainer.devices (abc) must be a number of "),  # processes, or on a GPU: GPUs
    (["--trainer.accelerator", "cpu", "--trainer.devices", "-1"], "trainer.devices (-1) must be a number of "
                                                                  "processes (such as 2) or auto on the CPU"),
])
def test_bad_training_flags(tmp_path, fit_env, capsys, override, message):
    line = one_error_line(fit_args(fit_env, "--trainer.max_steps", "1", *override), capsys)
    assert message in line
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()



@pytest.mark.parametrize("flags,message", [
    (["--trainer.max_steps", "abc"], "--trainer.max_steps: Expected a int. Got value: abc"),
    (["--model.learning_rate", "nan"], "--model.learning_rate: Expected a float. Got value: nan"),
    (["--trainer.precision", "7"], "--trainer.precision: Does not validate against any of the Union subtypes "
                                   "(accepted: [Literal[64, 32, 16], "),
    (["--bogus_flag", "1"], "unrecognized arguments: --bogus_flag 1"),
    (["--trainer.max_stepz", "5"], "unrecognized arguments: --trainer.max_stepz 5 (did you mean --trainer.max_steps?)"),
    (["--model.lr", "1e-3"], "unrecognized arguments: --model.lr 1e-3 (did you mean --model.learning_rate?)"),
    (["--model.backbone.init_args.dropou", "0.1"], "--model.backbone: ltcx.models.gpt.GPT has no option 'dropou' "
                                                   "(its options: --model.backbone.help GPT)"),
], ids=["int", "float", "union", "unknown", "misspelt", "initials", "a class's option"])
def test_flags_jsonargparse_refuses_are_one_line_not_its_usage(tmp_path, fit_env, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(fit_env, *flags))
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()  # no usage, no traceback, no notice
    assert line.startswith(f"ltcx: error: {message}") and line.endswith("; see `ltcx fit --help`"), line
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()



@pytest.mark.parametrize("devices", [2, "2", " 2 ", "auto", -1, "-1", 0, "0", "0,1", [0, 1], "abc", "", 1.5])
def test_the_devices_check_refuses_what_lightning_refuses_on_a_cpu(devices):
    """On a CPU Lightning takes a positive count or auto, and raises a TypeError or MisconfigurationException for
    the rest: the CLI's check (one line, before anything is built) draws the same line."""
    import lightning as L
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ltcx.cli.lightning import check_devices
    from ltcx.errors import ConfigError

    try:
        L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
        lightning_takes = True
    except (TypeError, MisconfigurationException):
        lightning_takes = False
    try:
        check_devices(devices, on_cpu=True)
        ltcx_takes = True
    except ConfigError:
        ltcx_takes = False
    assert ltcx_takes == lightning_takes


@pytest.mark.parametrize("devices,ok", [(2, True), ("auto", True), (-1, True), ("-1", True), ("0,1", True),
                                        ("1,", True), ([0, 1], True), (0, False), ("abc", False), ("-2", False),
                                        ("0,a", False)])
def test_the_devices_check_on_gpus(devices, ok):
    """With GPUs Lightning also takes -1 (every GPU) and indices, as ``0,1`` or a list."""
    from ltcx.cli.lightning import check_devices
    from ltcx.errors import ConfigError

    if ok:
        check_devices(devices, on_cpu=False)
    else:
        with pytest.raises(ConfigError) as error:
            check_devices(devices, on_cpu=False)
        assert_mentions(str(error.value), "number of GPUs", "-1", "auto", "GPU indices", "--trainer.devices")


def test_nan_learning_rate_from_yaml_is_refused(tmp_path, fit_env, capsys):
    """YAML's .nan is a float that reaches LanguageModel, whose check refuses it (NaN fails 0 < lr < inf)."""
    line = one_error_line(fit_args(fit_env, "--model.learning_rate", ".nan"), capsys)
    assert_mentions(line, "model.learning_rate (nan)", "positive number", "--model.learning_rate")



@pytest.mark.parametrize("content,message", [
    (None, "--config: File does not exist: '{path}' (nor is it a config shipped with ltcx: "
           + ", ".join(shipped_config_names()) + "); see `ltcx fit --help`"),
    (bytes(range(128, 256)), "--config '{path}' is not a YAML text file (its bytes are not UTF-8 text): pass the path "
                             "of a YAML config"),
    (b"model:\n  learning_rate: [1,\n", "--config '{path}' is not valid YAML (did not find expected node content at "
                                       "line 3, column 1): fix the file"),
], ids=["missing", "binary", "not YAML"])
def test_bad_config_file_is_one_line_naming_it(tmp_path, fit_env, capsys, content, message):
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(fit_env, "--config", str(path)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"ltcx: error: {message.format(path=path)}"]



def test_help_and_print_config_still_work(fit_env, capsys):
    for flag in ("--help", "--print_config"):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), flag])
        assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "learning_rate: " in out



@pytest.mark.parametrize("flags,message", [
    (["--num_samples", "0"], "--num_samples (0) must be >= 1"),
    (["--temperature", "nan"], "temperature (nan) must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature (inf) must be a finite number >= 0"),
    (["--tokenizer", "gpt2"], "tokenizer 'gpt2' (50257 ids) does not fit the model's vocabulary of 320: it was trained "
                              "with tokenizer 'bytes': pass that --tokenizer"),
    (["--prompt", "x" * 80], "prompt (80 tokens) plus max_new_tokens (5) is 85 tokens, more than the model's context"),
])
def test_generate_flag_errors_print_nothing_else(capsys, checkpoint, flags, message):
    line = one_error_line(["generate", "--ckpt_path", str(checkpoint), "--max_new_tokens", "5", *flags], capsys)
    assert message in line
    assert capsys.readouterr().out == ""  # the prompt is not echoed before it is checked



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_generate_device_cuda_without_cuda(capsys, checkpoint):
    line = one_error_line(["generate", "--ckpt_path", str(checkpoint), "--device", "cuda"], capsys)
    assert_mentions(line, "--device cuda", "no usable CUDA device", "--device cpu")



def test_generate_reads_a_good_checkpoint(capsys, checkpoint):
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "ab", "--max_new_tokens", "4", "--seed", "0"])
    assert capsys.readouterr().out.startswith("ab")
    model, meta = load_language_model(checkpoint, model_class=LanguageModel)
    assert type(model.backbone) is GPT and meta["tokenizer"] == "bytes"


@pytest.mark.parametrize("key,value,facts", [
    ("betas", (2.0, 3.0), ("model.betas [2.0, 3.0]", "two numbers in [0, 1)", "[0.9, 0.95]")),
    ("eps", -1.0, ("model.eps -1.0", "positive number", "1e-8")),
])
def test_generate_names_the_file_whose_settings_break_their_rule(tmp_path, capsys, checkpoint, key, value, facts):
    """Not LanguageModel's line, which names a flag generate does not have (`fix --model.betas`)."""
    state = torch.load(checkpoint, weights_only=True)
    state["hyper_parameters"][key] = value
    path = tmp_path / "bad.ckpt"
    atomic_save(state, path)
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "ab"], capsys)
    assert_mentions(line, f"checkpoint '{path}'", *facts, "fix it in the file", "use another one")
    assert "--model." not in line



@pytest.mark.parametrize("flags", [["--optimizer", "torch.optim.SGD"], ["--optimizer=torch.optim.SGD"],
                                   ["--lr_scheduler.class_path", "torch.optim.lr_scheduler.StepLR"]])
def test_lightning_optimizer_flags_are_refused_not_silently_replacing_adamw(tmp_path, fit_env, capsys, flags):
    line = one_error_line(fit_args(fit_env, *flags), capsys)
    assert line.startswith("ltcx: error: --optimizer and --lr_scheduler are not ltcx options: every run trains with "
                           "AdamW and a warmup + cosine schedule")


def test_an_optimizer_section_in_a_yaml_is_refused(tmp_path, fit_env, capsys):
    config = tmp_path / "sgd.yaml"
    config.write_text("optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n")
    line = one_error_line(fit_args(fit_env, "--config", str(config)), capsys)
    assert_mentions(line, "--optimizer", "--lr_scheduler", "not ltcx options")



@pytest.mark.parametrize("flags,message", [
    (["--config", "configs/no-such.yaml"], "ltcx: error: --config: File does not exist: '{root}/configs/no-such.yaml' "
                                            "(nor is it a config shipped with ltcx: data/fineweb_edu, "),
    (["--config=no-such.yaml"], "ltcx: error: --config: File does not exist: '{root}/no-such.yaml' (nor is it a "
                                "config shipped with ltcx: "),
    (["--config", "configs/gpt.yaml", "--ckpt_path", "no-such.ckpt"],
     "ltcx: error: checkpoint 'no-such.ckpt' does not exist: pass --ckpt_path the path of a .ckpt file"),
    (["--optimizer", "torch.optim.SGD"], "ltcx: error: --optimizer and --lr_scheduler are not ltcx options"),
], ids=["config", "config=", "ckpt_path", "optimizer"])
def test_a_missing_file_or_an_optimizer_flag_is_answered_before_lightning_is_imported(flags, message):
    """What needs no parser, without the ~8 CPU-s of importing Lightning: neither torch nor Lightning is imported."""
    code = ("import sys; sys.argv = ['ltcx']\nfrom ltcx.cli import main\n"
            "try:\n    main(['fit', *sys.stdin.read().split('\\0')])\n"
            "except SystemExit as stop:\n    print(stop.code, 'torch' in sys.modules, 'lightning' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], input="\0".join(flags), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert done.stderr.splitlines()[0].startswith(message.format(root=ROOT)), done.stderr
