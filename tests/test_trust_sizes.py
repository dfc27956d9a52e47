"""Every size a user or a file gives is checked against the memory here before anything is allocated, in one line
naming the option or the file: ``ltcx evaluate --task long_context --factors`` (the lengths it implies, with the
model's state), a Hugging Face folder's config.json (as ``ltcx generate`` checks an export), and the flags of ``fit``
(``--data.block_size``, the needle's too, and the model ``--model.backbone.init_args`` describe). The machine's
memory is patched small (``memory_limit``), so that nothing here allocates much."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import ltcx.hf  # noqa: F401 - registers the ltcx architectures
from helpers import assert_mentions, lean_fit_args, one_error_line, write_checkpoint, write_model_checkpoint
from ltcx.cli import main
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.catalog import CATALOG

pytestmark = pytest.mark.usefixtures("one_thread")

MEMORY = "ltcx.persist.file_fits.memory_limit"
GIB = 2**30


# -- a Hugging Face folder's config.json --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    checkpoint = write_checkpoint(root / "small.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(root / "hf"), "--format", "hf"])
    return root / "hf"


def edited_config(folder, out, **settings):
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["backbone_config"].update(settings)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("setting,value", [("n_layer", 100000), ("n_embd", 10**7), ("vocab_size", 10**9)])
def test_an_absurd_hf_config_is_refused_before_building(tmp_path, hf_folder, nothing_built, setting, value):
    folder = edited_config(hf_folder, tmp_path / "absurd", **{setting: value})
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert_mentions(str(error.value), f"'{folder}'", "does not fit", "builds more weights than the file holds")
    assert nothing_built == []


def test_an_hf_model_larger_than_memory_is_refused_before_building(hf_folder, monkeypatch, nothing_built):
    monkeypatch.setattr(MEMORY, lambda: 2**16)  # 64 KiB: less than the tiny model's 100 KB
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(hf_folder)
    assert_mentions(str(error.value), f"'{hf_folder}'", "parameters", "0.0 GiB of memory here", "more memory")
    assert nothing_built == []


# -- ltcx evaluate --task long_context --factors --------------------------------------------------------------------

NEEDLE = {"_class_path": "ltcx.data.niah.NeedleDataModule", "tokenizer": "bytes", "block_size": 32, "num_digits": 2,
          "needle": "#{passkey}. ", "question": " ?"}


def needle_checkpoint(path, haystack: str):
    """A rope GPT (no context limit) untrained, recording that it learned the needle over ``haystack``."""
    torch.manual_seed(0)
    write_model_checkpoint(path, CATALOG["gpt"].build_tiny(320, "rope"), train_block_size=32)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["datamodule_hyper_parameters"] = {**NEEDLE, "haystack": haystack}
    torch.save(checkpoint, path)
    return path


def test_factors_past_memory_are_one_line_naming_the_largest_that_fits(tmp_path, capsys, monkeypatch):
    from ltcx.eval.long_context import scoring_bytes

    path = needle_checkpoint(tmp_path / "needle.ckpt", "repeat")
    monkeypatch.setattr(MEMORY, lambda: GIB)
    out = tmp_path / "eval"
    line = one_error_line(["evaluate", "--task", "long_context", "--ckpt_path", str(path), "--factors", "1,1000000000",
                           "--num_sequences", "1", "--batch_size", "1", "--out", str(out)], capsys)
    assert_mentions(line, "--factors 1000000000", f"checkpoint '{path}'", "1.0 GiB of memory here",
                    "use --factors up to")
    most = int(line.rsplit("up to ", 1)[1])
    backbone = CATALOG["gpt"].build_tiny(320, "rope")
    assert scoring_bytes(backbone, most * 32, 1, None) <= GIB < scoring_bytes(backbone, (most + 1) * 32, 1, None)
    assert not out.exists()


def test_factors_past_the_shipped_haystack_name_evaluates_own_flag(tmp_path, capsys):
    """The model trained on the shipped sample: the line names --factors and its largest, not the training data's
    flags (--data.haystack, --data.block_size), which evaluate does not take."""
    path = needle_checkpoint(tmp_path / "needle.ckpt", "sample")
    line = one_error_line(["evaluate", "--task", "long_context", "--ckpt_path", str(path), "--factors", "1,1000000000",
                           "--out", str(tmp_path / "eval")], capsys)
    assert_mentions(line, "--factors 1000000000", "haystack tokens", "use --factors up to")
    assert "--data." not in line


# -- fit's flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [[], ["--config", "data/niah", "--data.haystack", "repeat"]])
def test_an_absurd_block_size_is_one_line_before_building(tmp_path, fit_env, capsys, nothing_built, data):
    args = lean_fit_args(tmp_path, fit_env, *data, "--data.block_size", "100000000000")
    if data:  # the needle's data: no corpus
        at = args.index("--data.path")
        args = args[:at] + args[at + 2:]
    line = one_error_line(args, capsys)
    assert_mentions(line, "data.block_size=100,000,000,000", "memory here", "fix --data.block_size", "at most")
    assert nothing_built == []


def test_a_model_larger_than_memory_is_refused_naming_its_flags(monkeypatch):
    """The check the CLI runs on its parsed settings, before Lightning builds the model."""
    from jsonargparse import Namespace

    from ltcx.cli.sizes import check_run_sizes

    monkeypatch.setattr(MEMORY, lambda: 8 * GIB)
    config = Namespace(
        model=Namespace(backbone=Namespace(class_path="ltcx.models.gpt.GPT", init_args=Namespace(
            n_layer=100000, n_embd=1000002, n_head=6, vocab_size=320, block_size=32))),
        data=Namespace(class_path="ltcx.data.TextDataModule", init_args=Namespace(block_size=32, batch_size=4)))
    with pytest.raises(ConfigError) as error:
        check_run_sizes(config)
    assert_mentions(str(error.value), "n_layer 100,000", "n_embd 1,000,002", "8.0 GiB of memory here",
                    "--model.backbone.init_args.n_layer", "--model.backbone.init_args.n_embd")
    config.model.backbone.init_args.n_layer, config.model.backbone.init_args.n_embd = 1, 32
    check_run_sizes(config)  # a tiny model fits


def test_absurd_model_flags_are_one_line_before_building(tmp_path, fit_env, capsys, monkeypatch, nothing_built):
    """As a user meets it, with a width small enough that a regression stops at the thousandth layer, not in the
    allocator (the width's own refusal is the test above)."""
    monkeypatch.setattr(MEMORY, lambda: GIB)
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--model.backbone.init_args.n_layer", "100000"), capsys)
    assert_mentions(line, "n_layer 100,000", "more than 10,000 weight tensors",
                    "lower --model.backbone.init_args.n_layer")
    assert nothing_built == []


def test_a_max_len_past_memory_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """ltcx evaluate's loss by position: --max_len, not the data module's --data.block_size, is named."""
    from helpers import write_corpus

    torch.manual_seed(0)
    path = write_model_checkpoint(tmp_path / "rope.ckpt", CATALOG["gpt"].build_tiny(320, "rope"), train_block_size=32)
    monkeypatch.setattr(MEMORY, lambda: GIB)
    out = tmp_path / "eval"
    line = one_error_line(["evaluate", "--ckpt_path", str(path), "--data.path", str(write_corpus(tmp_path / "c", 6, 2)),
                           "--max_len", "1000000000", "--out", str(out)], capsys)
    assert_mentions(line, "--max_len 1000000000", f"'{path}'", "1.0 GiB of memory here", "or less")
    assert "--data." not in line and not out.exists()
