"""Callbacks: sample text logged once per run after validation, model back in train mode; finite-loss guard."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from helpers import assert_mentions
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
    with pytest.raises(LtcxError) as error:
        guard.on_before_backward(trainer, None, torch.tensor(float("nan")))
    assert_mentions(str(error.value), "training loss became nan", "step 4", "before updating")


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
    assert metrics["work/flops_per_sec"] > 0
    torch.testing.assert_close(metrics["work/mfu"], metrics["work/flops_per_sec"] / 1e9)


def test_mfu_peak_defaults_to_the_measured_cpu_matmul_rate(monkeypatch):
    import ltcx.throughput

    monkeypatch.setattr(ltcx.throughput, "measured_matmul_flops", lambda threads: 1e15)  # never exceeded
    trainer = _fit_tiny(MFUMonitor())
    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["work/mfu"], metrics["work/flops_per_sec"] / 1e15)


def test_per_step_metrics_are_logged_on_the_steps_the_loggers_write(monkeypatch):
    """self.log costs as much as a small model's step: the per-step metrics go through it only on Lightning's
    logging steps (every log_every_n_steps), and those steps' values are each step's own."""
    logged: list[tuple[int, str]] = []
    real_log = L.LightningModule.log

    def spy(self, name, value, *args, **kwargs):
        if self.trainer.state.fn == "fit" and not self.trainer.validating:
            logged.append((self.trainer.global_step, name))
        return real_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", spy)
    torch.manual_seed(0)
    model = LanguageModel(GPT(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16), decay_steps=6)
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=3, callbacks=[MFUMonitor(peak_flops=1e9)],
                        accelerator="cpu", limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(torch.randint(0, 64, (24, 17)), batch_size=4))
    per_step = {"train/loss", "work/tokens_per_sec", "work/tokens_seen", "train/lr", "step", "work/flops_per_sec",
                "work/mfu"}
    # train/loss is logged in training_step, before the optimizer step that makes global_step 3 and 6
    steps = sorted({step + (name == "train/loss") for step, name in logged})
    assert steps == [3, 6] and {name for _, name in logged} == per_step
    assert trainer.callback_metrics["work/tokens_seen"] == 6 * 4 * 16


def test_mfu_peak_must_be_positive():
    with pytest.raises(LtcxError, match="peak_flops"):
        MFUMonitor(peak_flops=0)


class FakeClock:
    """A clock that moves only when told: each call returns the next of ``times``."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_best_rate_is_the_fastest_trial():
    from ltcx.throughput import best_rate

    calls = []
    # Clock reads: the start, then before and after each trial; trials of 2, 1 (the fastest) and 4 s.
    clock = FakeClock(0.0, 0.0, 2.0, 2.0, 3.0, 3.0, 7.0)
    assert best_rate(lambda: calls.append(1), work=10.0, trials=3, budget_s=100.0, clock=clock) == 10.0
    assert len(calls) == 3 and clock.times == []


def test_best_rate_stops_at_its_time_budget_after_one_trial_at_least():
    from ltcx.throughput import best_rate

    calls = []
    # A busy machine: the first trial alone takes longer than the budget, so it is the only one.
    assert best_rate(lambda: calls.append(1), 8.0, trials=5, budget_s=0.25, clock=FakeClock(0.0, 0.0, 4.0)) == 2.0
    assert len(calls) == 1
    # Trials of 0.1 s: the third ends past the budget of 0.25 s, so no fourth starts.
    clock = FakeClock(0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3)
    assert best_rate(lambda: calls.append(1), 1.0, trials=5, budget_s=0.25, clock=clock) == pytest.approx(10.0)
    assert len(calls) == 4


def test_measured_matmul_flops_is_the_best_trial_of_a_bounded_probe(monkeypatch):
    import ltcx.throughput

    seen = {}

    def fake_best_rate(run, work, trials, budget_s):
        seen.update(work=work, trials=trials, budget_s=budget_s)
        return 5e10

    monkeypatch.setattr(ltcx.throughput, "best_rate", fake_best_rate)
    rate = ltcx.throughput.measured_matmul_flops.__wrapped__(1, size=64)
    assert rate == 5e10 and seen == {"work": 2.0 * 64**3, "trials": 5, "budget_s": 0.25}


def _mfu_steps(monitor: MFUMonitor, times: list[float], monkeypatch) -> list[dict]:
    """``monitor`` through training batch ends at the clock ``times`` (4 blocks of 16 + 1 tokens each); the
    values it logged per step."""
    import ltcx.callbacks.throughput

    clock = FakeClock(*times)
    monkeypatch.setattr(ltcx.callbacks.throughput.time, "perf_counter", clock)
    backbone = SimpleNamespace(flops_per_token=lambda length: 1e6)  # 64 tokens: 6.4e7 FLOP a step
    logged: list[dict] = []
    module = SimpleNamespace(backbone=backbone, device=torch.device("cpu"), log=lambda k, v: logged[-1].update({k: v}))
    trainer = SimpleNamespace(global_step=0, is_global_zero=True,
                              _logger_connector=SimpleNamespace(should_update_logs=True))
    monitor.on_train_start(trainer, module)
    for step in range(len(times)):
        trainer.global_step = step + 1
        logged.append({})
        monitor.on_train_batch_end(trainer, module, None, torch.zeros(4, 17), step)
    return logged[1:]


def test_a_step_above_a_measured_peak_raises_it_with_one_line(monkeypatch, capsys):
    import ltcx.throughput

    monkeypatch.setattr(ltcx.throughput, "measured_matmul_flops", lambda threads: 1e9)  # read low
    steps = _mfu_steps(MFUMonitor(), [0.0, 0.1, 0.12, 0.135, 0.235], monkeypatch)  # 0.64, 3.2, 4.27, 0.64 GFLOP/s
    mfu = [s["work/mfu"] for s in steps]
    assert mfu == pytest.approx([0.64, 1.0, 1.0, 0.64 / 4.2667], rel=1e-3)
    assert max(mfu) <= 1.0
    [said] = capsys.readouterr().err.splitlines()  # once
    assert_mentions(said, "step 3", "3.2e+09 FLOP/s", "measured CPU peak of 1e+09", "fastest rate seen",
                    "MFUMonitor's peak_flops")


def test_a_step_above_a_configured_peak_keeps_it_and_says_so_once(monkeypatch, capsys):
    steps = _mfu_steps(MFUMonitor(peak_flops=1e9), [0.0, 0.02, 0.04], monkeypatch)  # 3.2 GFLOP/s twice
    assert [s["work/mfu"] for s in steps] == pytest.approx([3.2, 3.2])
    [said] = capsys.readouterr().err.splitlines()  # once
    assert_mentions(said, "work/mfu 3.2 > 1", "step 2", "3.2e+09 FLOP/s", "peak of 1e+09", "MFUMonitor's peak_flops",
                    "flops_per_token")
