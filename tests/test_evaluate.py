"""Loss by position (``ltcx/eval/position_loss.py``, ``ltcx evaluate``): the pieces-through-the-state evaluator
against a direct per-sequence, per-position loop in float64; spans and buckets; the command on several checkpoints
and an export, with a context-limited model stopping at its limit in one line; its one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import one_error_line, write_checkpoint, write_model_checkpoint
from ltcx.eval.position_loss import PositionLoss, context_spans, position_loss
from ltcx.eval.scoring import target_log_probs
from ltcx.models.catalog import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320  # the bytes tokenizer's 257 ids, padded


@torch.no_grad()
def direct_position_loss(backbone, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The slow reference: every sequence fed whole, the loss of each position written out as logsumexp minus the
    target's logit, averaged over sequences one position at a time."""
    losses = torch.zeros(length, dtype=torch.float64)
    for block in blocks:
        logits, _ = backbone(block[None, :length])
        for t in range(length):
            row = logits[0, t].to(torch.float64)
            losses[t] += torch.logsumexp(row, 0) - row[block[t + 1]]
    return losses / blocks.shape[0]


@pytest.mark.parametrize("arch", ["gpt", "xlstm", "titans_mac"])
def test_position_loss_in_pieces_matches_a_direct_loop(arch):
    torch.manual_seed(0)
    backbone = build_tiny(arch, VOCAB).double().eval()
    length = 40
    blocks = torch.randint(0, 257, (5, length + 3))  # longer than needed: the first length + 1 tokens are scored
    # pieces of 7 (not dividing 40) and batches of 2 (not dividing 5): both boundaries are crossed
    losses = position_loss(backbone, [blocks[:3], blocks[3:]], length=length, piece_len=7, batch_size=2)
    assert losses.count.tolist() == [5] * length
    reference = direct_position_loss(backbone, blocks, length)
    torch.testing.assert_close(losses.loss_sum / losses.count, reference, rtol=1e-10, atol=1e-12)
    assert math.isclose(losses.mean(), float(reference.mean()), rel_tol=1e-12)


def test_target_log_probs_greedy_flags_ignore_padding_ids():
    """The argmax that decides ``is_greedy`` is over the tokenizer's ids only: a padding id with the largest logit
    does not make a real target non-greedy."""

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, idx, state=None):
            logits = torch.zeros(*idx.shape, 6)
            logits[..., 2] = 1.0  # the best real id
            logits[..., 5] = 9.0  # a padding id
            return logits, state

    inputs, targets = torch.zeros(1, 3, dtype=torch.long), torch.tensor([[2, 1, 2]])
    log_probs, greedy = target_log_probs(Fixed(), inputs, targets, piece_len=2, vocab_limit=5)
    assert greedy.tolist() == [[True, False, True]]
    expected = torch.tensor([1.0, 0.0, 1.0]) - torch.logsumexp(torch.tensor([0, 0, 1.0, 0, 0, 9.0]), 0)
    torch.testing.assert_close(log_probs[0], expected)


def test_spans_double_from_the_training_context_and_buckets_weight_every_prediction():
    assert context_spans(64, 300) == [(0, 64), (64, 128), (128, 256), (256, 300)]
    assert context_spans(64, 64) == [(0, 64)]
    assert context_spans(None, 50) == [(0, 50)]
    losses = PositionLoss(torch.tensor([1.0, 3.0, 6.0, 2.0, 5.0], dtype=torch.float64), torch.tensor([1, 1, 2, 2, 1]))
    assert losses.buckets(2) == [
        {"start": 0, "end": 2, "loss": 2.0}, {"start": 2, "end": 4, "loss": 2.0}, {"start": 4, "end": 5, "loss": 5.0},
    ]
    assert losses.mean() == 17.0 / 7


def test_evaluate_scores_several_models_up_to_their_lengths(tmp_path, capsys):
    """A GPT (context limit 64: says so in one line and stops there) and an exported xLSTM trained on 32-token blocks
    (no limit: runs to 4 x 32) in one call; the JSON's losses are those of ``position_loss`` on the same text."""
    from ltcx.cli import main
    from ltcx.lm import LanguageModel
    from ltcx.persist import export_model, load_language_model

    gpt = write_checkpoint(tmp_path / "gpt.ckpt")
    torch.manual_seed(0)
    xlstm = write_model_checkpoint(tmp_path / "xlstm.ckpt", build_tiny("xlstm", VOCAB), train_block_size=32)
    export_model(xlstm, tmp_path / "xlstm-export", model_class=LanguageModel)
    capsys.readouterr()
    out = tmp_path / "eval"
    main(["evaluate", "--ckpt_path", str(gpt), "--ckpt_path", str(tmp_path / "xlstm-export"), "--data.path", "sample",
          "--max_len", "4x", "--num_sequences", "3", "--batch_size", "2", "--piece_len", "24", "--out", str(out)])
    captured = capsys.readouterr()
    limit_lines = [line for line in captured.err.splitlines() if "context limit" in line]
    assert limit_lines == [f"ltcx: '{gpt}' (GPT) has a context limit of 64 tokens (learned position embeddings): "
                           "scored up to 64, not 256"]
    document = json.loads((out / "position_loss.json").read_text())
    gpt_result, xlstm_result = document["results"]
    assert (gpt_result["context_limit"], gpt_result["requested_len"], gpt_result["evaluated_len"]) == (64, 256, 64)
    assert (xlstm_result["context_limit"], xlstm_result["train_context"], xlstm_result["evaluated_len"]) == (
        None, 32, 128)
    assert [(s["start"], s["end"]) for s in xlstm_result["spans"]] == [(0, 32), (32, 64), (64, 128)]
    assert document["settings"]["bucket_size"] == 4 and len(xlstm_result["buckets"]) == 32
    assert (out / "position_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the same three sequences scored directly: the first validation blocks of 129 bytes of the sample
    from ltcx.data.module import TextDataModule

    data = TextDataModule(path="sample", tokenizer="bytes", block_size=128, batch_size=3, val_batches=1)
    blocks = next(iter(data.val_dataloader()))
    model, _ = load_language_model(tmp_path / "xlstm-export", model_class=LanguageModel)
    expected = position_loss(model.backbone, [blocks], length=128)
    assert math.isclose(xlstm_result["mean_loss"], expected.mean(), rel_tol=1e-6)
    for span in xlstm_result["spans"]:
        assert math.isclose(span["loss"], expected.mean(span["start"], span["end"]), rel_tol=1e-6)
    assert math.isclose(gpt_result["mean_loss"], position_loss(
        load_language_model(gpt, model_class=LanguageModel)[0].backbone, [blocks], length=64).mean(), rel_tol=1e-6)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--max_len", "0"], "--max_len '0' is neither a number of tokens"),
        (["--max_len", "four"], "--max_len 'four' is neither a number of tokens"),
        (["--num_sequences", "0"], "--num_sequences (0) must be >= 1"),
    ],
)
def test_evaluate_bad_arguments_are_one_line(tmp_path, capsys, extra, expected):
    line = one_error_line(["evaluate", "--ckpt_path", str(tmp_path / "none.ckpt"), "--data.path", "sample", *extra],
                          capsys)
    assert expected in line


def test_evaluate_a_multiple_of_an_unknown_training_length_is_one_line(tmp_path, capsys):
    xlstm = write_model_checkpoint(tmp_path / "xlstm.ckpt", build_tiny("xlstm", VOCAB))  # no datamodule entry
    line = one_error_line(["evaluate", "--ckpt_path", str(xlstm), "--data.path", "sample", "--max_len", "2x"], capsys)
    assert "records no training length" in line and "pass --max_len in tokens" in line
