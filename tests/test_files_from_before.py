"""Files written by ltcx before issue 18's restructuring (a tiny GPT on the bytes tokenizer: its `ltcx fit` checkpoint
at step 2 and its `ltcx export` folder, in tests/data/made_before_issue_18/) still load, give the same numbers,
generate, export and resume. A change of the checkpoint format or of a module path that breaks them fails here."""

import torch

from helpers import ROOT, fit_args, run_cli, write_corpus
from ltcx.generation import generate
from ltcx.lm import LanguageModel
from ltcx.persist import load_language_model
from ltcx.tokenizers import get_tokenizer

FOLDER = ROOT / "tests/data/made_before_issue_18"
CHECKPOINT, EXPORT = FOLDER / "gpt-bytes.ckpt", FOLDER / "gpt-bytes-export"
PROMPT = "Once upon a time"
# What the model computed when the files were written (float32 on a CPU).
LAST_LOGITS = [-0.10185551643371582, -0.09187241643667221, 0.03909623250365257, 0.03712126240134239,
               -0.02269350178539753, 0.03559739515185356, 0.0010163596598431468, -0.028832534328103065]
GREEDY = [79, 110, 99, 101, 32, 117, 112, 111, 110, 32, 97, 32, 116, 105, 109, 101, 101, 222, 222, 222, 222, 222, 222,
          222, 222, 222, 222, 222]


def prompt_ids() -> torch.Tensor:
    return torch.tensor([get_tokenizer("bytes").encode(PROMPT)])


def test_checkpoint_loads_with_the_same_numbers():
    model, meta = load_language_model(CHECKPOINT, model_class=LanguageModel)
    assert meta["backbone_class"] == "ltcx.models.gpt.GPT" and meta["tokenizer"] == "bytes"
    with torch.no_grad():
        logits, _ = model.backbone(prompt_ids())
    torch.testing.assert_close(logits[0, -1, :8], torch.tensor(LAST_LOGITS), rtol=1e-5, atol=1e-6)
    assert generate(model.backbone, prompt_ids(), 12, temperature=0)[0].tolist() == GREEDY


def test_export_loads_with_the_same_numbers():
    model = LanguageModel.from_pretrained(EXPORT)
    with torch.no_grad():
        logits, _ = model.backbone(prompt_ids())
    torch.testing.assert_close(logits[0, -1, :8], torch.tensor(LAST_LOGITS), rtol=1e-5, atol=1e-6)


def test_checkpoint_generates_exports_and_resumes(tmp_path):
    generated = run_cli(["generate", "--ckpt_path", str(CHECKPOINT), "--prompt", PROMPT, "--temperature", "0",
                         "--max_new_tokens", "12"], tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith(PROMPT + get_tokenizer("bytes").decode(GREEDY[len(PROMPT):])[:1])
    exported = run_cli(["export", "--ckpt_path", str(CHECKPOINT), "--out", "again"], tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["config.json", "model.safetensors"]
    data = write_corpus(tmp_path / "corpus", train_docs=100, val_docs=20)
    resumed = run_cli(fit_args(data, "--data.tokenizer", "bytes", "--trainer.max_steps", "3",
                               "--ckpt_path", str(CHECKPOINT)), tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    last = torch.load(next((tmp_path / "checkpoints/gpt").glob("version_*/last.ckpt")), weights_only=True)
    assert last["global_step"] == 3
