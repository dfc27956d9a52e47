"""ltcx's GPT in GPT-2's layout (``ltcx export --format gpt2``, ``ltcx/models/gpt2_layout.py``): the folder loads as
``GPT2LMHeadModel`` in a process where ltcx can not be imported, its logits ltcx's (float64 tight, float32 within
1e-5 of the logits' scale); the architectures without a GPT-2 equivalent are refused in one line; and back:
``GPT.from_hf`` on a randomly initialised ``GPT2LMHeadModel`` saved locally gives its logits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import assert_mentions, one_error_line, write_model_checkpoint
from ltcx.cli import main
from ltcx.models.catalog import CATALOG
from ltcx.models.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, TOKENIZER_VOCAB = 320, 257  # bytes, padded: the GPT-2 folder keeps the tokenizer's 257 rows
WITHOUT_LTCX = """
import sys
sys.modules["ltcx"] = None  # import ltcx fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, out = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = torch.tensor([tokenizer.encode("The cat sat on the mat.")])
logits = {}
for dtype in (torch.float64, torch.float32):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert type(model).__name__ == "GPT2LMHeadModel"
    logits[str(dtype)] = model(ids).logits
torch.save({"ids": ids, **logits}, out)
"""


@pytest.mark.parametrize("variant", ["tiny", "mha_bias", "gelu_tanh"])
def test_gpt2_export_loads_without_ltcx_with_ltcx_logits(tmp_path, capsys, variant):
    torch.manual_seed(0)
    overrides = {"activation": "gelu_tanh"} if variant == "gelu_tanh" else {}
    backbone = CATALOG["gpt"].build_tiny(VOCAB, "tiny" if variant == "gelu_tanh" else variant, **overrides).eval()
    folder = tmp_path / "gpt2"
    main(["export", "--ckpt_path", str(write_model_checkpoint(tmp_path / "gpt.ckpt", backbone)), "--out",
          str(folder), "--format", "gpt2"])
    assert "- gpt2\n" in (folder / "README.md").read_text()
    result = subprocess.run([sys.executable, "-c", WITHOUT_LTCX, str(folder), str(tmp_path / "logits.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    got = torch.load(tmp_path / "logits.pt")
    assert got["ids"].tolist() == [list(b"The cat sat on the mat.")]
    with torch.no_grad():
        ours = backbone.double()(got["ids"])[0][..., :TOKENIZER_VOCAB]
    torch.testing.assert_close(got["torch.float64"], ours, rtol=0, atol=1e-12)
    scale = ours.abs().max().item()
    assert (got["torch.float32"].double() - ours).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("name", sorted(n for n, entry in CATALOG.items() if entry.class_name != "GPT"))
def test_architectures_without_a_gpt2_layout_are_refused_naming_format_hf(tmp_path, capsys, name):
    torch.manual_seed(0)
    checkpoint = write_model_checkpoint(tmp_path / "m.ckpt", CATALOG[name].build_tiny(VOCAB))
    line = one_error_line(["export", "--ckpt_path", str(checkpoint), "--out", str(tmp_path / "out"), "--format",
                           "gpt2"], capsys)
    assert_mentions(line, "--format gpt2", "GPT only", f"{CATALOG[name].class_name} has no GPT-2 equivalent",
                    "use --format hf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_gpt_from_a_gpt2_folder_gives_its_logits(tmp_path, activation):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_layer=2, n_head=3,
                                           activation_function=activation)).eval()
    with torch.no_grad():  # GPT-2 starts its biases at zero: random ones check that they map
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    reference.save_pretrained(tmp_path / "gpt2")
    model = GPT.from_hf(tmp_path / "gpt2")
    assert model.config.n_kv_head == 3 and model.config.bias
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.double()(ids)[0], reference.double()(ids).logits, rtol=0, atol=1e-12)


def test_from_hf_refuses_what_is_not_a_gpt2_folder(tmp_path):
    from ltcx.errors import LtcxError
    from ltcx.models.ltc import LTCGPT

    with pytest.raises(LtcxError) as error:
        LTCGPT.from_hf(tmp_path)
    assert_mentions(str(error.value), "LTCGPT.from_hf", "only GPT")
    with pytest.raises(LtcxError) as error:
        GPT.from_hf(tmp_path)
    assert_mentions(str(error.value), f"'{tmp_path}'", "no config.json", "GPT2LMHeadModel.save_pretrained")
