"""Bits per byte and ``ltcx test``: the bytes each token id decodes to (gpt2, bytes; none for a Hugging Face
tokenizer, said once), ``val/bpb`` and ``test/bpb`` against a hand computation (the targets decoded to bytes, the
per-token losses of a direct forward), and ``test_metrics.json`` through the CLI for text and MQAR."""

import json
import math
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, TINY_MODEL, assert_mentions, assert_one_error_line, fit_args, write_corpus
from ltcx.data import TextDataModule
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.tokenizers import Tokenizer, get_tokenizer

# Words of 1, 2 and 3 UTF-8 bytes a character, so bytes, characters and tokens all differ.
WORDS = ["the", "cat", "sat", "héllo", "wörld", "日本", "語", "naïve", "café", "and", "then", "slept"]


def corpus(folder, docs: int = 40):
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.txt", docs), ("validation.txt", docs // 4), ("test.txt", docs // 4)):
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(count)]
        (folder / name).write_text("\n\n".join(texts), encoding="utf-8")
    return folder


def decoded_bytes(tokenizer: str, ids: list[int]) -> bytes:
    """What ``ids`` decode to, as bytes (a block can cut a character: no text to count there), end-of-text none."""
    tok = get_tokenizer(tokenizer)
    ids = [i for i in ids if i != tok.eot_id]
    return tok.encoding.decode_bytes(ids) if tokenizer == "gpt2" else bytes(ids)


def test_token_bytes_tables():
    gpt2 = get_tokenizer("gpt2").token_bytes()
    assert len(gpt2) == 50257 and gpt2[50256] == 0  # end-of-text decodes to no bytes of the text
    text = "Once upon a time, 日本語 naïve"
    ids = get_tokenizer("gpt2").encode(text)
    assert sum(gpt2[i] for i in ids) == len(text.encode("utf-8"))
    assert get_tokenizer("bytes").token_bytes() == [1] * 256 + [0]
    assert Tokenizer().token_bytes() is None  # a Hugging Face tokenizer: no fixed bytes per token


def test_a_tokenizer_without_fixed_bytes_logs_no_bpb_and_says_so_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(type(get_tokenizer("bytes")), "token_bytes", lambda self: None)
    dm = TextDataModule(path=str(corpus(tmp_path / "c")), tokenizer="bytes")
    assert dm.token_bytes is None and dm.token_bytes is None
    [said] = capsys.readouterr().err.splitlines()  # once
    assert_mentions(said, "tokenizer 'bytes'", "no fixed bytes per token", "val/bpb and test/bpb are not logged")


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_bpb_is_the_summed_nats_over_the_bytes_the_targets_decode_to(tmp_path, tokenizer):
    dm = TextDataModule(path=str(corpus(tmp_path / "c")), tokenizer=tokenizer, block_size=24, batch_size=3,
                        val_batches=3, test_batches=2, shuffle_buffer=0, pad_vocab_to_multiple_of=64)
    torch.manual_seed(0)
    model = LanguageModel(GPT(vocab_size=dm.padded_vocab_size, block_size=24, n_layer=1, n_head=2, n_kv_head=1,
                              n_embd=16))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    logged = {**trainer.validate(model, datamodule=dm, verbose=False)[0],
              **trainer.test(model, datamodule=dm, verbose=False)[0]}
    model.eval()
    for split, data in (("val", dm.val_dataset()), ("test", dm.test_dataset())):
        blocks = torch.stack(list(data))
        with torch.no_grad():
            logits, _ = model.backbone(blocks[:, :-1])
        nats = F.cross_entropy(logits.flatten(0, 1).double(), blocks[:, 1:].flatten(), reduction="sum").item()
        n_bytes = sum(len(decoded_bytes(tokenizer, row[1:].tolist())) for row in blocks)
        assert n_bytes > blocks[:, 1:].numel() / (4 if tokenizer == "gpt2" else 1.1)  # sanity: real text bytes
        assert logged[f"{split}/bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
        assert logged[f"{split}/loss"] == pytest.approx(nats / blocks[:, 1:].numel(), rel=1e-5)
        assert logged[f"{split}/ppl"] == pytest.approx(math.exp(logged[f"{split}/loss"]), rel=1e-5)
    assert model.test_counts == {"tokens": 2 * 3 * 24, "bytes": n_bytes}


def test_ltcx_test_writes_test_metrics_json(tmp_path, monkeypatch, capsys):
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    data = write_corpus(tmp_path / "corpus", 60, 10)
    args = fit_args(data, "--data.tokenizer", "bytes", "--trainer.max_steps", "2")
    main(args)
    checkpoint = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    capsys.readouterr()
    main(["test", *args[1:], "--data.test_batches", "3", "--ckpt_path", str(checkpoint)])
    written = tmp_path / "lightning_logs/gpt/version_1/test_metrics.json"
    metrics = json.loads(written.read_text())
    assert list(metrics) == ["test/loss", "test/ppl", "test/bpb", "tokens", "bytes"]
    assert metrics["tokens"] == 3 * 4 * 32  # test_batches x batch_size x block_size targets
    assert 0 < metrics["bytes"] < metrics["tokens"]  # a byte a token, none for end-of-text
    assert metrics["test/ppl"] == pytest.approx(math.exp(metrics["test/loss"]), rel=1e-5)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("ltcx: test: ")
    assert_mentions(last, f"test/loss {metrics['test/loss']:.4f}", f"test/ppl {metrics['test/ppl']:.4f}",
                    f"test/bpb {metrics['test/bpb']:.4f}", str(written.relative_to(tmp_path)))
    assert not [p for p in written.parent.iterdir() if ".tmp" in p.name]


def test_fit_with_test_after_fit_writes_what_ltcx_test_writes(tmp_path, monkeypatch, capsys):
    """``fit --test_after_fit true`` (what a study's seed runs do, one process start fewer) tests the weights it trained
    to the end: its test_metrics.json equals ``ltcx test --ckpt_path`` of the run's last.ckpt, exactly; the run's
    last line still says where its checkpoint and logs are. Any other command refuses the flag in one line."""
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    args = ["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/data/mqar.yaml"),
            *TINY_MODEL, "--model.backbone.init_args.block_size", "32", "--model.warmup_steps", "1",
            "--data.vocab_size", "64", "--data.block_size", "32", "--data.batch_size", "4", "--data.val_batches", "2",
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"]
    main([*args, "--test_after_fit", "true"])
    said = capsys.readouterr()
    assert said.out.splitlines()[-1].startswith("ltcx: test: test/loss ")
    assert said.err.splitlines()[-1].startswith("ltcx: step 3: checkpoint ")
    in_fit = json.loads((tmp_path / "lightning_logs/gpt/version_0/test_metrics.json").read_text())
    main(["test", *args[1:], "--ckpt_path", str(tmp_path / "checkpoints/gpt/version_0/last.ckpt")])
    assert json.loads((tmp_path / "lightning_logs/gpt/version_1/test_metrics.json").read_text()) == in_fit
    assert list(in_fit) == ["test/loss", "test/ppl", "test/recall_acc", "tokens"]
    with pytest.raises(SystemExit) as stopped:
        main(["validate", *args[1:], "--test_after_fit", "true"])
    assert stopped.value.code == 2
    line = assert_one_error_line(capsys.readouterr().err)
    assert_mentions(line, "--test_after_fit", "fit", "validate", "drop it")


def test_ltcx_test_on_mqar_writes_recall_accuracy(tmp_path, monkeypatch, capsys):
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    args = ["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/data/mqar.yaml"),
            *TINY_MODEL, "--model.backbone.init_args.block_size", "32", "--model.warmup_steps", "1",
            "--data.vocab_size", "64", "--data.block_size", "32", "--data.batch_size", "4", "--data.val_batches", "2",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]
    main(args)
    checkpoint = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    main(["test", *args[1:], "--ckpt_path", str(checkpoint)])
    metrics = json.loads((tmp_path / "lightning_logs/gpt/version_1/test_metrics.json").read_text())
    assert list(metrics) == ["test/loss", "test/ppl", "test/recall_acc", "tokens"]  # no bytes: no text
    assert 0.0 <= metrics["test/recall_acc"] <= 1.0 and metrics["tokens"] == 2 * 4 * 4  # 4 queries a sequence
