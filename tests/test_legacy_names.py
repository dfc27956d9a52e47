"""Files written before the xLSTM took the house's names (its ``embedding_dim``, ``num_layers``, ``num_heads``,
``slstm_num_heads``, now ``n_embd``, ``n_layer``, ``n_head``, ``slstm_n_head``) still load, export and resume. Each
test writes a file the normal way and then writes its stored config's keys back under the old names: what such a
file holds. The renaming is ``XLSTM.renamed_fields``, applied by ``ltcx.persist.file_fits.current_names``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ltcx.hf  # noqa: F401 - registers the ltcx architectures with transformers
from helpers import write_model_checkpoint
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG, config_path
from ltcx.models.xlstm import XLSTM
from ltcx.persist import load_language_model
from ltcx.persist.digest import DIGEST_KEY, with_digest

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320  # the bytes tokenizer's 257 ids, padded
OLD_NAMES = {new: old for old, new in XLSTM.renamed_fields.items()}


def old_names(config: dict) -> dict:
    """``config`` (an xLSTM's backbone_config) under the names it had before the rename."""
    return {OLD_NAMES.get(key, key): value for key, value in config.items()}


def rewrite_checkpoint(path, rename=old_names) -> None:
    """``path``'s stored backbone_config under ``rename``'s names, the file's digest made afresh (an old file's digest
    covers the names it was written with)."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint.pop(DIGEST_KEY, None)
    checkpoint["ltcx"]["backbone_config"] = rename(checkpoint["ltcx"]["backbone_config"])
    torch.save(with_digest(checkpoint), path)


def tiny_xlstm() -> XLSTM:
    torch.manual_seed(0)
    return CATALOG["xlstm"].build_tiny(VOCAB).eval()


def old_checkpoint(tmp_path) -> tuple[XLSTM, object]:
    """(backbone, the path of its checkpoint as written before the rename)."""
    backbone = tiny_xlstm()
    path = write_model_checkpoint(tmp_path / "old.ckpt", backbone)
    rewrite_checkpoint(path)
    stored = torch.load(path, weights_only=True)["ltcx"]["backbone_config"]
    assert {"embedding_dim", "num_layers", "num_heads", "slstm_num_heads"} <= stored.keys()
    assert not {"n_embd", "n_layer", "n_head", "slstm_n_head"} & stored.keys()
    return backbone, path


IDX = torch.tensor([[1, 5, 9, 200, 17, 3, 64]])


@torch.no_grad()
def assert_same_model(loaded: torch.nn.Module, backbone: XLSTM) -> None:
    assert loaded.config_dict() == backbone.config_dict()
    for name, value in backbone.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
    torch.testing.assert_close(loaded(IDX)[0], backbone(IDX)[0], rtol=0, atol=0)


def test_a_checkpoint_written_before_the_rename_loads(tmp_path):
    backbone, path = old_checkpoint(tmp_path)
    model, meta = load_language_model(path, model_class=LanguageModel)
    assert_same_model(model.backbone, backbone)
    assert meta["backbone_config"]["n_embd"] == backbone.config.n_embd and "embedding_dim" not in meta[
        "backbone_config"]


def test_an_export_written_before_the_rename_loads(tmp_path):
    backbone, path = old_checkpoint(tmp_path)
    folder = tmp_path / "export"
    main(["export", "--ckpt_path", str(path), "--out", str(folder)])
    config = json.loads((folder / "config.json").read_text())
    assert config["backbone_config"] == backbone.config_dict()  # an old checkpoint exports in the new names
    config["backbone_config"] = old_names(config["backbone_config"])
    (folder / "config.json").write_text(json.dumps(config))
    assert_same_model(LanguageModel.from_pretrained(folder).backbone, backbone)


def test_an_hf_export_written_before_the_rename_loads(tmp_path):
    backbone, path = old_checkpoint(tmp_path)
    folder = tmp_path / "hf"
    main(["export", "--ckpt_path", str(path), "--out", str(folder), "--format", "hf"])
    config = json.loads((folder / "config.json").read_text())
    config["backbone_config"] = old_names(config["backbone_config"])
    (folder / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.backbone_config["n_embd"] == backbone.config.n_embd
    assert_same_model(loaded.backbone, backbone)


def test_both_names_of_one_field_are_refused(tmp_path):
    _, path = old_checkpoint(tmp_path)
    rewrite_checkpoint(path, lambda config: {**config, "n_embd": config["embedding_dim"]})
    with pytest.raises(LtcxError, match="embedding_dim and n_embd") as raised:
        load_language_model(path, model_class=LanguageModel)
    assert "keep only n_embd" in str(raised.value)


def test_a_run_saved_before_the_rename_resumes(fit_env, tmp_path):
    """`ltcx fit --ckpt_path` of such a file, the shape not typed: the checkpoint's shape replaces the YAML's (its
    width 404), and the resumed run saves the new names. Lightning's hyper_parameters hold no backbone (the
    LanguageModel saves its own, the backbone left out), so the backbone_config is the one place the names live."""
    smoke = config_path("gpt").parent / "trainer/smoke.yaml"
    args = ["fit", "--config", str(config_path("xlstm")), "--config", str(smoke), "--data.path", str(fit_env),
            "--data.block_size", "32", "--data.batch_size", "2",
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    main([*args, *CATALOG["xlstm"].tiny_cli(), "--trainer.max_steps", "2"])
    first = tmp_path / "checkpoints/xlstm/version_0/last.ckpt"
    saved = torch.load(first, weights_only=True)
    assert not {"backbone", *XLSTM.renamed_fields} & saved["hyper_parameters"].keys()
    rewrite_checkpoint(first)
    main([*args, "--trainer.max_steps", "3", "--ckpt_path", str(first)])
    resumed = torch.load(tmp_path / "checkpoints/xlstm/version_1/last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3
    assert resumed["ltcx"]["backbone_config"] == saved["ltcx"]["backbone_config"]
