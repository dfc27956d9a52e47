"""A checkpoint or export is data: a pickle payload runs no code, a backbone class named by a file is never imported,
and the registry is the only source of classes a file may name."""

import os
import pickle
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_mentions,
    one_error_line,
    write_checkpoint,
)
from ltcx.errors import LtcxError
from ltcx.models import registry
from ltcx.models.gpt import GPT
from ltcx.models.ltc import LTCGPT


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))



@pytest.mark.parametrize("kind", ["torch.save", "plain pickle"])
def test_pickle_payload_runs_no_code(tmp_path, capsys, kind):
    marker, path = tmp_path / "pwned", tmp_path / "evil.ckpt"
    payload = {"state_dict": {}, "ltcx": {"backbone_class": "ltcx.models.gpt.GPT"}, "x": RunsCode(marker)}
    if kind == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a"], capsys)
    facts = ("more than tensors and plain data", "will not run code") if kind == "torch.save" else (
        "could not be read", "use another one")
    assert_mentions(line, f"checkpoint '{path}'", *facts)
    assert not marker.exists()



def test_backbone_class_from_the_file_is_never_imported(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = write_checkpoint(tmp_path / "evil.ckpt", backbone_class="os.system",
                            backbone_config={"command": f"touch {marker}"})
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a"], capsys)
    assert_mentions(line, "backbone class 'os.system'", "not a registered ltcx backbone", "register_backbone")
    assert not marker.exists()



def test_registry_knows_ltcx_backbones_and_registered_ones(monkeypatch):
    assert registry.resolve_backbone("ltcx.models.gpt.GPT") is GPT
    assert registry.resolve_backbone("ltcx.models.ltc.LTCGPT") is LTCGPT
    with pytest.raises(LtcxError) as error:
        registry.resolve_backbone("tests.somewhere.MyBackbone")
    assert_mentions(str(error.value), "'tests.somewhere.MyBackbone'", "not a registered", "register_backbone")
    # An allow-listed class whose module is not there (yet) is a clear error, not an ImportError.
    monkeypatch.setitem(registry._BUILTIN, "ltcx.models.nowhere.Model", ("ltcx.models.nowhere", "Model"))
    with pytest.raises(LtcxError) as error:
        registry.resolve_backbone("ltcx.models.nowhere.Model")
    assert_mentions(str(error.value), "'ltcx.models.nowhere.Model'", "not available")

    @registry.register_backbone
    class MyBackbone(GPT):
        pass

    assert registry.resolve_backbone(registry.class_path(MyBackbone)) is MyBackbone

