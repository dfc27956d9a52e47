"""A tokenizer name a file holds never runs code nor asks to, and a tokenizer of another vocabulary than
the model's is refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import GPT_CONFIG, ROOT, assert_mentions, one_error_line, write_checkpoint
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.persist import export_model
from ltcx.tokenizers import get_tokenizer, stored_tokenizer_name


def custom_code_tokenizer(folder: Path, marker: Path) -> Path:
    """A Hugging Face tokenizer folder whose tokenizer_config.json maps AutoTokenizer to a class in the folder's own
    ``custom_tokenizer.py``; importing that file creates ``marker``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "a": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="CustomTokenizer",
                  auto_map={"AutoTokenizer": ["custom_tokenizer.CustomTokenizer", "custom_tokenizer.CustomTokenizer"]})
    config_file.write_text(json.dumps(config))
    (folder / "custom_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


def export_naming(tmp_path: Path, tokenizer: str) -> Path:
    """A folder written by `ltcx export` whose config.json was then edited to name ``tokenizer``."""
    folder = export_model(write_checkpoint(tmp_path / "for-export.ckpt"), tmp_path / "export",
                          model_class=LanguageModel)
    config = json.loads((folder / "config.json").read_text())
    config["tokenizer"] = tokenizer
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("where", ["checkpoint", "export config.json", "--tokenizer"])
def test_custom_tokenizer_code_never_runs_nor_asks(tmp_path, where):
    marker = tmp_path / "pwned"
    folder = str(custom_code_tokenizer(tmp_path / "tok", marker))
    if where == "checkpoint":
        args = ["--ckpt_path", str(write_checkpoint(tmp_path / "evil.ckpt", tokenizer=folder))]
    elif where == "export config.json":
        args = ["--ckpt_path", str(export_naming(tmp_path, folder))]
    else:
        args = ["--ckpt_path", str(write_checkpoint(tmp_path / "good.ckpt")), "--tokenizer", folder]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers would copy the code to import it
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "generate", *args, "--prompt", "a"],
                            input="y\n", cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # no "[y/N]" question, no text
    errors = [line for line in result.stderr.splitlines() if line.startswith("ltcx: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    if where == "--tokenizer":
        assert_mentions(errors[0], f"tokenizer '{folder}'", "its own Python code", "auto_map", "never runs",
                        "'gpt2', 'bytes'", "without custom code")
    else:
        assert_mentions(errors[0], f"names tokenizer '{folder}'", "a path on this machine",
                        "pass --tokenizer FOLDER yourself")
    assert not marker.exists()


def test_get_tokenizer_refuses_custom_code_in_process(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    folder = str(custom_code_tokenizer(tmp_path / "tok", marker))
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked to run the code"))
    with pytest.raises(LtcxError, match="needs its own Python code"):
        get_tokenizer(folder)
    assert not marker.exists()


@pytest.mark.parametrize("name", [None, "gpt2", "bytes", "openai-community/gpt2", "gpt2-medium", "org/name.v2_x"])
def test_names_a_file_may_give(name):
    assert stored_tokenizer_name(name, "file names tokenizer", "fix") == name


@pytest.mark.parametrize("name", ["/abs/tok", "./tok", "../tok", "a/b/c", "org--x/name", "org/..", "a b", "x\ny",
                                  {"class": "x"}, 7, "local"])
def test_names_a_file_may_not_give(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()  # hub-shaped, but a folder here
    with pytest.raises(LtcxError) as info:
        stored_tokenizer_name(name, "file names tokenizer", "fix")
    message = str(info.value)
    assert message.startswith(f"file names tokenizer {name!r}, which is ") and message.endswith(": fix")
    assert "\n" not in message
    assert ("a path on this machine" in message) == (name == "local")


def test_export_never_records_a_tokenizer_folder(tmp_path, capsys):
    folder = str(custom_code_tokenizer(tmp_path / "tok", tmp_path / "pwned"))
    checkpoint = write_checkpoint(tmp_path / "local-tokenizer.ckpt", tokenizer=folder)
    line = one_error_line(["export", "--ckpt_path", str(checkpoint), "--out", str(tmp_path / "out")], capsys)
    assert_mentions(line, f"checkpoint '{checkpoint}'", f"tokenizer '{folder}'", "a path on this machine",
                    "gpt2, bytes or a Hugging Face hub id", "--tokenizer with the tokenizer's hub id")
    line = one_error_line(["export", "--ckpt_path", str(checkpoint), "--out", str(tmp_path / "out"),
                           "--tokenizer", folder], capsys)
    assert_mentions(line, f"--tokenizer '{folder}'", "a path on this machine", "gpt2, bytes or a Hugging Face hub id")
    assert not (tmp_path / "out").exists()
    export_model(checkpoint, tmp_path / "out", tokenizer="some-org/my-tokenizer", model_class=LanguageModel)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tokenizer"] == "some-org/my-tokenizer"


def checkpoint_of_vocabulary(path: Path, vocab_size: int, tokenizer: str) -> Path:
    """A tiny GPT checkpoint of ``vocab_size`` embedding rows that names ``tokenizer``."""
    torch.manual_seed(0)
    model = LanguageModel(GPT(**{**GPT_CONFIG, "vocab_size": vocab_size}))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams), "global_step": 1,
                "ltcx": {"backbone_class": "ltcx.models.gpt.GPT", "backbone_config": model.backbone.config_dict(),
                         "tokenizer": tokenizer, "tokens_seen": 0}}, path)
    return path


@pytest.mark.parametrize("stored,flag,fix", [
    ("gpt2", ["--tokenizer", "bytes"], ("trained with tokenizer 'gpt2'", "pass that --tokenizer")),
    ("bytes", [], ("checkpoint '{path}'", "names another tokenizer than its model's", "pass the --tokenizer")),
])
def test_generate_refuses_a_tokenizer_of_another_vocabulary(tmp_path, capsys, stored, flag, fix):
    path = checkpoint_of_vocabulary(tmp_path / "gpt2.ckpt", 50304, stored)  # gpt2's 50257 ids padded to 64
    line = one_error_line(["generate", "--ckpt_path", str(path), *flag, "--prompt", "a"], capsys)
    assert_mentions(line, "tokenizer 'bytes' (257 ids)", "vocabulary of 50304", *(f.format(path=path) for f in fix))
    assert capsys.readouterr().out == ""


def test_generate_accepts_a_vocabulary_padded_to_another_multiple(tmp_path, capsys):
    path = checkpoint_of_vocabulary(tmp_path / "bytes128.ckpt", 384, "bytes")  # bytes' 257 ids padded to 128
    main(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "3", "--seed", "0"])
    assert capsys.readouterr().out.startswith("a")
