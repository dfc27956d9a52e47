"""Every YAML in configs/ parses, alone or composed, and keeps the catalogue's model sizes (the README's); an
architecture's YAML holds only its backbone and pulls in configs/recipe.yaml."""

import sys
from pathlib import Path

import pytest
import yaml

from helpers import assert_mentions
from ltcx.cli import LtcxCLI, main
from ltcx.data import TextDataModule
from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG, architecture_name

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs/recipe.yaml"
MODELS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p != RECIPE)
PIECES = [None] + sorted(str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.yaml")
                         if p.parent.name != "study")  # study specs (ltcx study --spec), not fit configs


def test_the_architecture_yamls_are_the_catalogues():
    assert MODELS == sorted(Path(entry.yaml).name for entry in CATALOG.values())


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("model", MODELS)
def test_config_composes(model, piece, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    args = ["fit", "--config", str(ROOT / "configs" / model)]
    if piece:
        args += ["--config", str(ROOT / "configs" / piece)]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"]["backbone"]["class_path"].startswith("ltcx.models.")
    assert "vocab_size" not in resolved["model"]["backbone"]["init_args"]  # linked from the tokenizer
    # the recipe's values reach every architecture; a piece given after it overrides them
    smoke = piece == "trainer/smoke.yaml"
    assert resolved["seed_everything"] == 1337 and resolved["model"]["learning_rate"] == 6e-4
    assert resolved["model"]["warmup_steps"] == (10 if smoke else 1170)
    assert resolved["trainer"]["max_steps"] == (40 if smoke else 23404)
    mqar = piece == "data/mqar.yaml"  # --data is a class: the recipe's TextDataModule, or MQAR's by class_path
    niah = piece == "data/niah.yaml"  # the needle task's module, by its full class_path
    expected = "ltcx.data.RecallDataModule" if mqar else "ltcx.data.niah.NeedleDataModule" if niah else None
    assert resolved["data"]["class_path"] == (expected or "ltcx.data.TextDataModule")
    assert resolved["data"]["init_args"]["block_size"] == (128 if smoke else 64 if mqar else 256 if niah else 512)
    assert len(resolved["trainer"]["callbacks"]) == 4


def test_an_architecture_yaml_holds_only_its_backbone():
    """The trainer, callbacks, optimizer and data are written once, in configs/recipe.yaml: an architecture's YAML
    pulls it in (``config:``, relative to the YAML's folder) and adds ``model.backbone`` (a dotted key: a nested
    ``model:`` after ``config:`` would replace the recipe's whole ``model:`` section, its learning rate included)."""
    for model in MODELS:
        config = yaml.safe_load((ROOT / "configs" / model).read_text())
        assert list(config) == ["config", "model.backbone"], model
        assert config["config"] == "recipe.yaml"
    recipe = yaml.safe_load(RECIPE.read_text())
    assert "backbone" not in recipe["model"]
    assert recipe["trainer"]["logger"]["init_args"]["name"] is None  # named after the architecture by the CLI
    assert recipe["trainer"]["callbacks"][0]["init_args"]["dirpath"] is None


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_architecture_names_its_logs_and_checkpoints(name):
    """A null logger name and checkpoint dirpath become the architecture's catalogue name: lightning_logs/<arch>/,
    checkpoints/<arch>/ (Titans' four variants share one class: the variant tells them apart)."""
    backbone = yaml.safe_load((ROOT / CATALOG[name].yaml).read_text())["model.backbone"]
    assert architecture_name(backbone["class_path"], backbone["init_args"]) == name


@pytest.mark.parametrize("flags,logs,checkpoints", [
    ([], "lightning_logs/titans_mal", "checkpoints/titans_mal"),
    (["--trainer.logger.init_args.name", "mine"], "lightning_logs/mine", "checkpoints/titans_mal"),
])
def test_cli_names_logs_and_checkpoints_after_the_architecture(flags, logs, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    cli = LtcxCLI(LanguageModel, TextDataModule, run=False, args=[
        "--config", str(ROOT / "configs/titans_mal.yaml"), *CATALOG["titans_mal"].tiny_cli(),
        "--trainer.accelerator", "cpu", *flags])
    assert cli.trainer.logger.log_dir == f"{logs}/version_0"
    assert [Path(c.dirpath) for c in cli.trainer.callbacks if hasattr(c, "dirpath")] == [tmp_path / checkpoints]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_config_model_sizes(name):
    """The YAML's model has the catalogue's parameter count, and the README's table says the same."""
    import importlib

    expected = CATALOG[name].yaml_parameters
    backbone = yaml.safe_load((ROOT / CATALOG[name].yaml).read_text())["model.backbone"]
    module, class_name = backbone["class_path"].rsplit(".", 1)
    init_args = dict(backbone["init_args"])
    if "block_size" in init_args and init_args["block_size"] is None:  # the CLI's context_from_data
        init_args["block_size"] = yaml.safe_load(RECIPE.read_text())["data"]["block_size"]
    instance = getattr(importlib.import_module(module), class_name)(vocab_size=50304, **init_args)
    assert instance.parameter_count() == expected
    readme = (ROOT / "README.md").read_text().splitlines()
    [row] = [line for line in readme if line.startswith(f"| `{CATALOG[name].yaml}`")]
    assert row.endswith(f" | {expected:,} |"), row


@pytest.mark.parametrize("flags,context", [
    ([], 128),  # null: data.block_size
    (["--model.backbone.init_args.block_size", "256"], 256),  # a typed context is kept
])
def test_model_context_is_the_training_length_unless_given(flags, context, tmp_path, monkeypatch):
    """The GPT family's ``block_size: null`` is ``data.block_size``: the length is written once, in the recipe (or
    a piece such as smoke.yaml that changes it), and the model's learned positions are the ones it trains."""
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    monkeypatch.chdir(tmp_path)
    cli = LtcxCLI(LanguageModel, TextDataModule, run=False, args=[
        "--config", str(ROOT / "configs/ltc.yaml"), "--config", str(ROOT / "configs/trainer/smoke.yaml"),
        "--model.backbone.init_args.n_layer", "1", "--model.backbone.init_args.n_embd", "48",
        "--model.backbone.init_args.num_decay_modes", "8", *flags,
    ])
    assert cli.model.backbone.config.block_size == context
    assert cli.model.backbone.config.tau_min == context / 12  # LTC's tau_min: null follows the resolved context
    assert cli.datamodule.block_size == 128


def test_a_backbone_built_in_python_needs_a_number_for_its_context():
    from ltcx.errors import ConfigError
    from ltcx.models.gpt import GPT

    with pytest.raises(ConfigError) as error:
        GPT(block_size=None, n_layer=1, n_head=2, n_embd=16)
    assert_mentions(str(error.value), "block_size", "is null", "give a number")
