"""Callbacks: sample text logged once per run after validation, model back in train mode; finite-loss guard."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from ltcx.callbacks import FiniteLossGuard, MFUMonitor, SampleGeneration
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.tokenizers import get_tokenizer


class FakeExperiment:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))


def make_trainer(**overrides):
    experiment = FakeExperiment()
    trainer = SimpleNamespace(
        sanity_checking=False, is_global_zero=True, global_step=7,
        datamodule=SimpleNamespace(tokenizer_obj=get_tokenizer("bytes")),
        loggers=[SimpleNamespace(experiment=experiment)],
    )
    trainer.__dict__.update(overrides)
    return trainer, experiment


@pytest.fixture
def lm():
    torch.manual_seed(0)
    return LanguageModel(GPT(block_size=32, vocab_size=320, n_layer=1, n_head=2, n_embd=16))


def test_samples_are_logged_with_the_step_and_the_model_returns_to_train_mode(lm):
    trainer, experiment = make_trainer()
    lm.train()
    SampleGeneration(prompts=["ab", "cde"], max_new_tokens=50).on_validation_end(trainer, lm)
    [(tag, text, step)] = experiment.texts
    assert tag == "samples" and step == 7 and text.startswith("ab") and "cde" in text
    assert lm.backbone.training  # back in train mode after generating


@pytest.mark.parametrize("overrides", [{"sanity_checking": True}, {"is_global_zero": False}])
def test_no_samples_during_sanity_check_or_on_other_ranks(lm, overrides):
    trainer, experiment = make_trainer(**overrides)
    SampleGeneration().on_validation_end(trainer, lm)
    assert experiment.texts == []


def test_finite_loss_guard_stops_before_the_backward_pass():
    guard = FiniteLossGuard()
    trainer = SimpleNamespace(global_step=3, world_size=1)  # steps done; this loss belongs to step 4
    guard.on_before_backward(trainer, None, torch.tensor(1.0))
    with pytest.raises(LtcxError, match="training loss became nan at step 4, so training stopped before updating"):
        guard.on_before_backward(trainer, None, torch.tensor(float("nan")))


def _fit_tiny(callback: MFUMonitor, steps: int = 3) -> L.Trainer:
    torch.manual_seed(0)
    model = LanguageModel(GPT(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16), decay_steps=steps)
    blocks = torch.randint(0, 64, (4 * steps, 17))  # 4 blocks of 16 + 1 tokens a step
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, callbacks=[callback], accelerator="cpu")
    trainer.fit(model, torch.utils.data.DataLoader(blocks, batch_size=4))
    return trainer


def test_mfu_is_model_flops_per_second_over_the_configured_peak():
    trainer = _fit_tiny(MFUMonitor(peak_flops=1e9))
    metrics = trainer.callback_metrics
    assert metrics["train/flops_per_sec"] > 0
    torch.testing.assert_close(metrics["train/mfu"], metrics["train/flops_per_sec"] / 1e9)


def test_mfu_peak_defaults_to_the_measured_cpu_matmul_rate(monkeypatch):
    import ltcx.throughput

    monkeypatch.setattr(ltcx.throughput, "measured_matmul_flops", lambda threads: 2e9)
    trainer = _fit_tiny(MFUMonitor())
    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["train/mfu"], metrics["train/flops_per_sec"] / 2e9)


def test_mfu_peak_must_be_positive():
    with pytest.raises(LtcxError, match="peak_flops"):
        MFUMonitor(peak_flops=0)
