"""Damaged files and files of another shape or version: a flipped byte is named damaged by its SHA-256 digest,
weights of other shapes and settings of another version or type are named as such (never 'damaged'), in every
entry point that reads a checkpoint or an export."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_mentions,
    lean_fit_args,
    one_error_line,
    write_checkpoint,
    write_corpus,
)
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.persist import atomic_save, load_language_model, read_checkpoint


def test_generate_metadata_not_matching_weights(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "bad.ckpt")
    state = torch.load(path, weights_only=True)
    state["ltcx"]["backbone_config"]["n_layer"] = 2
    torch.save(state, path)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert_mentions(line, f"checkpoint '{path}'", "does not fit", "backbone.blocks.1.ln_1.weight [32]",
                    "not in the file", "and 13 more", *OTHER_VERSION)



def test_weights_that_are_no_tensors_are_still_a_damaged_file(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "bad.ckpt")
    state = torch.load(path, weights_only=True)
    state["state_dict"]["backbone.wpe.weight"] = "not a tensor"
    torch.save(state, path)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert line.startswith(f"ltcx: error: checkpoint '{path}': its weights could not be loaded (")
    assert line.endswith("); the file is damaged")



def test_digest_covers_every_value_type_lightning_saves(tmp_path):
    """The digest of what was saved is that of what loads back, for each kind of value in a Lightning checkpoint;
    any changed value or byte changes it."""
    from collections import OrderedDict

    from ltcx.persist import DIGEST_KEY, content_digest

    values = {
        "state_dict": OrderedDict(w=torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(), s=torch.tensor(2.5)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}, 1: {}}, "param_groups": [
            {"betas": (0.9, 0.95), "lr": 1e-3, "params": [0, 1], "foreach": None, "fused": False}]}],
        "floats": [float("nan"), -0.0, float("inf"), 1 / 3], "size": torch.Size([2, 3]), "nested": [[1, [2, "x"]], ()],
        "tags": {"b", "a"}, "dtype": torch.float16, "text": "ünï", "ltcx": {"backbone_class": "ltcx.models.gpt.GPT"},
    }
    atomic_save(values, tmp_path / "all.ckpt")
    stored = torch.load(tmp_path / "all.ckpt", weights_only=True)
    assert list(stored)[-1] == DIGEST_KEY and stored[DIGEST_KEY]["sha256"] == content_digest(values)
    loaded = read_checkpoint(tmp_path / "all.ckpt")
    assert DIGEST_KEY not in loaded and content_digest(loaded) == content_digest(values)
    for change in (lambda v: v["state_dict"]["w"][1, 0].add_(1),
                   lambda v: v["optimizer_states"][0]["state"].update({2: {}}),
                   lambda v: v["floats"].__setitem__(1, 0.0), lambda v: v.update(size=(2, 3))):
        change(loaded)
        assert content_digest(loaded) != content_digest(values)



def flip_tensor_bytes(path: Path, tensor: torch.Tensor, count: int = 20) -> None:
    """Flip ``count`` bytes in the middle of ``tensor``'s data inside the file ``path`` (torch stores records
    uncompressed, so the tensor's bytes are there as they are in memory)."""
    data, raw = bytearray(path.read_bytes()), tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    middle = at + len(raw) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))



@pytest.mark.parametrize("entry", ["read_checkpoint", "load_from_checkpoint", "generate", "export", "fit"])
def test_checkpoint_with_flipped_bytes_is_named_damaged(tmp_path, fit_env, capsys, trained, entry):
    saved, data = trained
    path = tmp_path / "flipped.ckpt"
    shutil.copy(saved, path)
    flip_tensor_bytes(path, read_checkpoint(saved)["optimizer_states"][0]["state"][0]["exp_avg"])
    assert torch.load(path, weights_only=True)["global_step"] == 1  # torch reads it without a word
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    facts = (f"checkpoint '{path}' is damaged", "SHA-256", "use another checkpoint")
    if entry in ("read_checkpoint", "load_from_checkpoint"):
        with pytest.raises(LtcxError) as error:
            (read_checkpoint if entry == "read_checkpoint" else LanguageModel.load_from_checkpoint)(path)
        assert_mentions(str(error.value), *facts)
    else:
        args = {
            "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
            "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
            "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
        }[entry]
        assert_mentions(one_error_line(args, capsys), *facts)
    assert_nothing_written(tmp_path, before)



def test_export_with_flipped_bytes_is_named_damaged(tmp_path, trained, capsys):
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    capsys.readouterr()
    assert len(json.loads((out / "config.json").read_text())["weights_sha256"]) == 64
    flip_tensor_bytes(out / "model.safetensors", read_checkpoint(trained[0])["state_dict"]["backbone.wpe.weight"])
    facts = (f"exported model '{out}' is damaged", "model.safetensors", "SHA-256", "config.json",
             "export it again from its checkpoint")
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert_mentions(str(error.value), *facts)
    assert one_error_line(["generate", "--ckpt_path", str(out), "--max_new_tokens", "2"], capsys) == \
        f"ltcx: error: {error.value}"  # the CLI says what the Python error says
    assert capsys.readouterr().out == ""



def test_files_without_a_digest_load_with_one_notice(tmp_path, trained, capsys, checkpoint):
    load_language_model(checkpoint, model_class=LanguageModel)  # written by torch.save, as an earlier ltcx did
    [notice] = capsys.readouterr().err.splitlines()
    assert_mentions(notice, f"ltcx: checkpoint '{checkpoint}'", "no SHA-256 digest", "could not be checked")
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    LanguageModel.from_pretrained(out)
    assert capsys.readouterr().err.splitlines() == [
        f"ltcx: exported model '{out}' has no weights_sha256 in config.json (exported by an earlier ltcx), so its "
        "model.safetensors could not be checked for damage"]



OTHER_VERSION = ("another version of ltcx", "the version that wrote it", "start a new run")  # the fix it names



@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint saved by `ltcx fit` (one step of the tiny GPT) and its corpus, shared by the tests below."""
    root = tmp_path_factory.mktemp("trained")
    data = write_corpus(root / "corpus", 60, 10)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ltcx"])
        for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            patch.setenv(flag, "1")
        main(lean_fit_args(root, data, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(root)))
    return root / "checkpoints/gpt/version_0/last.ckpt", data



def as_an_older_version(trained: Path, path: Path, change) -> Path:
    """The trained checkpoint with ``change(checkpoint)`` applied, as an older ltcx would have written it."""
    checkpoint = torch.load(trained, weights_only=True)
    del checkpoint["ltcx_digest"]  # which no earlier ltcx wrote
    change(checkpoint)
    torch.save(checkpoint, path)
    return path



def other_shapes(checkpoint: dict) -> None:
    """A wider q_proj (the way xLSTM's 408 -> 404 changed its projections), a key gone and one not known here."""
    weights = checkpoint["state_dict"]
    weights["backbone.blocks.0.attn.q_proj.weight"] = torch.zeros(48, 32)
    del weights["backbone.blocks.0.mlp.c_fc.weight"]
    weights["backbone.blocks.0.attn.rotary.inv_freq"] = torch.zeros(8)



def assert_nothing_written(folder: Path, before: set) -> None:
    assert {p for p in folder.rglob("*") if p.name != "lean.yaml"} == before



@pytest.mark.parametrize("entry", ["fit", "validate", "generate", "export"])
def test_checkpoint_of_other_shapes_is_not_called_damaged(tmp_path, fit_env, capsys, trained, entry):
    saved, data = trained
    path = as_an_older_version(saved, tmp_path / "old.ckpt", other_shapes)
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    args = {
        "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
        "validate": ["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)],
        "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
        "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
    }[entry]
    line = one_error_line(args, capsys)
    assert_mentions(line, f"checkpoint '{path}'", "does not fit", "backbone.blocks.0.attn.q_proj.weight",
                    "[48, 32] in the file", "[32, 32] here", "and 2 more", *OTHER_VERSION)
    assert capsys.readouterr().out == ""
    assert_nothing_written(tmp_path, before)



def test_python_loaders_name_a_checkpoint_of_other_shapes(tmp_path, trained):
    path = as_an_older_version(trained[0], tmp_path / "old.ckpt", other_shapes)
    for load in (LanguageModel.load_from_checkpoint, lambda path: load_language_model(path, model_class=LanguageModel)):
        with pytest.raises(LtcxError, match="does not fit") as error:
            load(path)
        assert_mentions(str(error.value), "and 2 more", *OTHER_VERSION)



def test_exported_model_of_other_shapes_is_not_called_damaged(tmp_path, trained, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    assert LanguageModel.from_pretrained(out).backbone.lm_head.weight is not None  # its tied weights, stored once, load
    weights = load_file(out / "model.safetensors")
    weights["blocks.0.mlp.c_fc.weight"] = torch.zeros(96, 32)
    save_file(weights, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    del config["weights_sha256"]  # as an earlier ltcx exported it
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert_mentions(str(error.value), f"exported model '{out}'", "does not fit", "blocks.0.mlp.c_fc.weight",
                    "[96, 32] in the file", "[128, 32] here", *OTHER_VERSION)
    (out / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file: damaged
    line = one_error_line(["generate", "--ckpt_path", str(out)], capsys)
    assert line.startswith(f"ltcx: error: exported model '{out}': its weights could not be loaded (")
    assert line.endswith("the file is damaged")



def test_settings_of_another_version_are_named(tmp_path, fit_env, capsys, trained):
    saved, data = trained
    again = ("another version of ltcx", "the version that wrote it", "start a new run")  # the fix it names

    def old_hyper_parameter(checkpoint):
        checkpoint["hyper_parameters"]["label_smoothing"] = 0.1

    def old_backbone_setting(checkpoint):
        checkpoint["ltcx"]["backbone_config"]["round_to"] = 64

    path = as_an_older_version(saved, tmp_path / "old-hparams.ckpt", old_hyper_parameter)
    line = one_error_line(lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)), capsys)
    assert_mentions(line, f"checkpoint '{path}'", "model.label_smoothing", *again)
    path = as_an_older_version(saved, tmp_path / "old-config.ckpt", old_backbone_setting)
    line = one_error_line(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)], capsys)
    assert_mentions(line, f"checkpoint '{path}'", "another model", "round_to: 64 in the file", *again)
    line = one_error_line(["generate", "--ckpt_path", str(path)], capsys)
    assert_mentions(line, f"checkpoint '{path}'", "backbone_config round_to", "GPT", *again)
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()



WRONG_TYPES = [
    ("decay_steps", {"steps": 5}, "an integer or null"),
    ("learning_rate", "abc", "a number"),
    ("betas", "x", "a list [a number, a number]"),
    ("backbone.bias", "yes", "true or false"),
]



@pytest.mark.parametrize("setting,value,expected", WRONG_TYPES)
@pytest.mark.parametrize("entry", ["fit", "generate", "export", "load_from_checkpoint"])
def test_hyper_parameter_of_the_wrong_type_in_a_checkpoint(tmp_path, fit_env, capsys, trained, entry, setting, value,
                                                           expected):
    saved, data = trained
    where, _, name = setting.rpartition(".")

    def change(checkpoint):
        (checkpoint["ltcx"]["backbone_config"] if where else checkpoint["hyper_parameters"])[name] = value

    path = as_an_older_version(saved, tmp_path / "typed.ckpt", change)
    capsys.readouterr()
    before = {p for p in tmp_path.rglob("*") if p.name != "lean.yaml"}
    shown = f"model.backbone.init_args.{name}" if where else f"model.{name}"
    facts = (f"checkpoint '{path}'", f"{shown} {value!r}", expected, "fix it in the file", "use another one")
    if entry == "load_from_checkpoint":
        with pytest.raises(LtcxError) as error:
            LanguageModel.load_from_checkpoint(path)
        assert_mentions(str(error.value), *facts)
    else:
        args = {
            "fit": lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)),
            "generate": ["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2"],
            "export": ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "exported")],
        }[entry]
        assert_mentions(one_error_line(args, capsys), *facts)
    assert_nothing_written(tmp_path, before)



@pytest.mark.parametrize("setting,value,expected", WRONG_TYPES)
def test_hyper_parameter_of_the_wrong_type_in_an_export(tmp_path, trained, capsys, setting, value, expected):
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(trained[0]), "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    where, _, name = setting.rpartition(".")
    (config["backbone_config"] if where else config["hyper_parameters"])[name] = value
    (out / "config.json").write_text(json.dumps(config))
    shown = f"config.json's backbone_config.{name}" if where else f"config.json's hyper_parameters.{name}"
    with pytest.raises(LtcxError) as error:
        LanguageModel.from_pretrained(out)
    assert_mentions(str(error.value), f"exported model '{out}'", f"{shown} {value!r}", expected, "fix it in the file",
                    "use another one")
    assert one_error_line(["generate", "--ckpt_path", str(out), "--max_new_tokens", "2"], capsys) == \
        f"ltcx: error: {error.value}"  # the CLI says what the Python error says



def test_checkpoint_from_before_a_new_setting_loads_at_its_default(tmp_path, fit_env, capsys, trained):
    """A setting added later (the GPT's mlp_hidden) is absent from older files: at its default it builds the model
    they hold, so they resume, validate and generate; typing another value is named as another model."""
    saved, data = trained

    def before_mlp_hidden(checkpoint):
        del checkpoint["ltcx"]["backbone_config"]["mlp_hidden"]

    path = as_an_older_version(saved, tmp_path / "older.ckpt", before_mlp_hidden)
    main(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "2", "--seed", "0"])
    main(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path)])
    main(lean_fit_args(tmp_path, data, "--trainer.max_steps", "2", "--ckpt_path", str(path)))
    assert torch.load(tmp_path / "checkpoints/gpt/version_1/last.ckpt", weights_only=True)["global_step"] == 2
    capsys.readouterr()
    line = one_error_line(["validate", *lean_fit_args(tmp_path, data)[1:], "--ckpt_path", str(path),
                           "--model.backbone.init_args.mlp_hidden", "64"], capsys)
    assert_mentions(line, f"checkpoint '{path}'", "another model", "mlp_hidden: None (the default) in the file",
                    "64 configured", "the config that trained it")

