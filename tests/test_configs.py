"""Every YAML in configs/ parses, alone or composed, and keeps the documented model sizes."""

import sys
from pathlib import Path

import pytest
import yaml

from ltcx.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
PIECES = [None] + sorted(str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.yaml"))


def test_every_model_has_a_config():
    assert MODELS == [
        "gpt.yaml", "gta.yaml", "ltc.yaml", "titans_lmm.yaml", "titans_mac.yaml", "titans_mag.yaml", "titans_mal.yaml",
        "xlstm.yaml",
    ]


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


@pytest.mark.parametrize("model,expected", [
        ("gpt", 28_758_912), ("ltc", 29_104_512), ("xlstm", 28_664_616), ("gta", 29_053_824),
        ("titans_mag", 28_753_644), ("titans_mac", 28_755_948), ("titans_mal", 28_773_558), ("titans_lmm", 28_763_628),
    ])
def test_config_model_sizes(model, expected):
    import importlib

    backbone = yaml.safe_load((ROOT / "configs" / f"{model}.yaml").read_text())["model"]["backbone"]
    module, name = backbone["class_path"].rsplit(".", 1)
    instance = getattr(importlib.import_module(module), name)(vocab_size=50304, **backbone["init_args"])
    assert instance.parameter_count() == expected
