"""Weights complete and finite on every load: a Hugging Face folder missing a tensor is refused naming it (transformers
would leave it as uninitialised memory); one NaN or inf in any tensor of a checkpoint, an ltcx export or a Hugging Face
folder is refused in one line naming the tensor (one NaN in q_proj otherwise generates normal-looking text); a
``backbone_config`` naming code (``class_path``, ``auto_map``) is one line, not a TypeError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ltcx.hf  # noqa: F401 - registers the ltcx architectures
from helpers import assert_mentions, one_error_line, write_checkpoint
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.persist import DIGEST_KEY, atomic_save
from ltcx.persist.digest import file_sha256

pytestmark = pytest.mark.usefixtures("one_thread")

Q_PROJ = "backbone.blocks.0.attn.q_proj.weight"
C_FC = "backbone.blocks.0.mlp.c_fc.weight"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small checkpoint (tiny GPT, bytes tokenizer), its ltcx export and its ``--format hf`` folder."""
    root = tmp_path_factory.mktemp("files")
    checkpoint = write_checkpoint(root / "small.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(root / "export")])
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(root / "hf"), "--format", "hf"])
    return checkpoint, root / "export", root / "hf"


def poison(tensor: torch.Tensor, value: float) -> None:
    tensor.view(-1)[tensor.numel() // 2] = value  # one number of the tensor, not all of it


def edited_weights(folder: Path, out: Path, change) -> Path:
    """A copy of the folder ``folder`` whose model.safetensors is ``change``d (a dict of tensors); an ltcx export's
    weights_sha256 recomputed, so the file is consistent, only wrong."""
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    change(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if "weights_sha256" in config:
        config["weights_sha256"] = file_sha256(out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_non_finite_names_are_each_tensor_holding_nan_or_inf():
    from ltcx.persist.finite import non_finite_names

    named = [("a", torch.ones(3)), ("b", torch.tensor([1.0, float("nan")])), ("c", torch.arange(3)),
             ("d", torch.tensor([float("-inf")], dtype=torch.bfloat16)), ("e", torch.empty(0))]
    assert non_finite_names(named) == ["b", "d"]


# -- a Hugging Face folder missing a tensor ---------------------------------------------------------------------

@pytest.mark.parametrize("header", ["read", "not readable"])
def test_an_hf_folder_missing_a_tensor_is_refused_naming_it(tmp_path, files, monkeypatch, header):
    """Whether the folder's header is read before the build (a local folder) or not (``_stored_shapes`` None: as
    for a source it can not read), the missing tensor is named."""
    folder = edited_weights(files[2], tmp_path / "missing", lambda w: w.pop(C_FC))
    if header == "not readable":
        monkeypatch.setattr(ltcx.hf, "_stored_shapes", lambda *args: None)
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert_mentions(str(error.value), str(folder), C_FC)
    assert "\n" not in str(error.value)


def test_a_complete_hf_folder_loads_with_its_loading_info(files):
    from ltcx.persist.finite import non_finite_names

    model, info = AutoModelForCausalLM.from_pretrained(files[2], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert non_finite_names(model.state_dict().items()) == []


# -- one non-finite number, on every load path ------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_one_non_finite_number_in_a_checkpoint_is_refused_naming_the_tensor(tmp_path, files, capsys, value):
    checkpoint = torch.load(files[0], weights_only=True)
    checkpoint.pop(DIGEST_KEY, None)
    poison(checkpoint["state_dict"][Q_PROJ], value)
    path = tmp_path / "poisoned.ckpt"
    atomic_save(checkpoint, path)  # with its digest: not damaged in transfer, only wrong
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"], capsys)
    assert_mentions(line, f"checkpoint '{path}'", Q_PROJ, "non-finite", "earlier checkpoint")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_one_non_finite_number_in_an_export_is_refused_naming_the_tensor(tmp_path, files, capsys, value):
    folder = edited_weights(files[1], tmp_path / "poisoned", lambda w: poison(w[Q_PROJ.removeprefix("backbone.")],
                                                                             value))
    line = one_error_line(["generate", "--ckpt_path", str(folder), "--prompt", "a", "--max_new_tokens", "2"], capsys)
    assert_mentions(line, f"exported model '{folder}'", Q_PROJ.removeprefix("backbone."), "non-finite",
                    "export it again")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_one_non_finite_number_in_an_hf_folder_is_refused_naming_the_tensor(tmp_path, files, value):
    folder = edited_weights(files[2], tmp_path / "poisoned", lambda w: poison(w[Q_PROJ], value))
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert_mentions(str(error.value), str(folder), Q_PROJ, "non-finite", "export it again")


# -- a backbone_config naming code --------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("class_path", "os.system"), ("auto_map", {"AutoModel": "x.Y"}),
                                       ("backbone_class", "os.system")])
def test_code_named_inside_backbone_config_is_one_line(tmp_path, files, key, value):
    folder = tmp_path / "code"
    shutil.copytree(files[2], folder)
    config = json.loads((folder / "config.json").read_text())
    config["backbone_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert_mentions(str(error.value), f"backbone_config.{key}", "remove the key")
    assert "\n" not in str(error.value)


def test_an_unknown_backbone_setting_of_an_hf_folder_is_one_line(tmp_path, files):
    folder = tmp_path / "unknown"
    shutil.copytree(files[2], folder)
    config = json.loads((folder / "config.json").read_text())
    config["backbone_config"]["n_wings"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LtcxError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert_mentions(str(error.value), "backbone_config n_wings", "re-export")


def test_generate_on_an_hf_folder_says_what_it_is_and_how_to_load_it(files, capsys):
    """An `ltcx export --format hf` folder was written by ltcx export: generate says it is one, names the transformers
    loader and the formats it reads, rather than that export did not write it."""
    _, _, hf_folder = files
    line = one_error_line(["generate", "--ckpt_path", str(hf_folder), "--prompt", "a"], capsys)
    assert_mentions(line, "--format hf", "AutoModelForCausalLM.from_pretrained", "--format ltcx")
    assert "was not written by" not in line
