"""LanguageModel: learning-rate schedule, weight-decay groups, the optimizer, checkpoint round trip."""

import copy
import math

import pytest
import torch

from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models.gpt import GPT
from ltcx.optim import lr_at_step, weight_decay_groups
from ltcx.persist import load_language_model


def test_lr_schedule_values():
    kwargs = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=1170, decay_steps=23404)
    assert lr_at_step(0, **kwargs) == pytest.approx(6e-4 / 1170)
    assert lr_at_step(1169, **kwargs) == pytest.approx(6e-4)  # last warmup step reaches the peak
    assert lr_at_step(1170, **kwargs) == pytest.approx(6e-4)  # cosine starts at the peak
    middle = 1170 + (23404 - 1170) // 2
    assert lr_at_step(middle, **kwargs) == pytest.approx((6e-4 + 6e-5) / 2)
    assert lr_at_step(23404, **kwargs) == pytest.approx(6e-5)
    assert lr_at_step(30000, **kwargs) == pytest.approx(6e-5)
    quarter = 1170 + (23404 - 1170) / 4
    expected = 6e-5 + 0.5 * (1 + math.cos(math.pi / 4)) * (6e-4 - 6e-5)
    assert lr_at_step(int(quarter), **kwargs) == pytest.approx(expected, rel=1e-4)


def tiny_lm(**kwargs):
    backbone = GPT(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, bias=True)
    return LanguageModel(backbone, **kwargs)


def test_weight_decay_on_matrices_only():
    model = tiny_lm()
    decay, no_decay = weight_decay_groups(model.backbone)
    params = dict(model.backbone.named_parameters())
    assert all(params[n].dim() == 2 for n in decay)
    assert all(params[n].dim() == 1 for n in no_decay)
    assert "wte.weight" in decay and "lm_head.weight" not in params  # tied: listed once
    assert "blocks.0.ln_1.weight" in no_decay and "blocks.0.attn.q_proj.bias" in no_decay
    assert sorted(decay + no_decay) == sorted(params)


def test_optimizer_groups_and_schedule():
    model = tiny_lm(learning_rate=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, weight_decay=0.1)
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3) and lrs[11] == pytest.approx(1e-4)


def test_the_optimizer_is_torchs_fused_adamw_on_a_cpu_and_makes_the_plain_update():
    """Fused on a CPU (one kernel for every parameter, not the foreach path's passes); the update it makes is the
    single-tensor AdamW's, to float64 rounding, decayed and undecayed groups alike."""
    torch.manual_seed(0)
    model = tiny_lm(learning_rate=1e-2, warmup_steps=0, decay_steps=10, weight_decay=0.1).double()
    reference = copy.deepcopy(model)
    fused = model.configure_optimizers()["optimizer"]
    assert all(group["fused"] for group in fused.param_groups)
    plain = reference.configure_optimizers()["optimizer"]
    for group in plain.param_groups:
        group["fused"], group["foreach"] = False, False
    batch = torch.randint(0, 64, (2, 9))
    for lm, optimizer in ((model, fused), (reference, plain)):
        for _ in range(3):
            lm.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        # 1e-12 of steps of 1e-2: the key bias's gradient is rounding noise (softmax ignores a shift of the keys),
        # which Adam's normalisation scales up to the step size; every other parameter agrees to 2e-16
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    model = tiny_lm()
    batch = torch.randint(0, 64, (2, 9))
    logits, _ = model.backbone(batch[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
    torch.testing.assert_close(model.loss(batch), expected)


def test_compile_keeps_checkpoint_keys():
    model = tiny_lm(compile=True)
    model.configure_model()
    assert all(key.startswith(("backbone.",)) for key in model.state_dict())


def test_load_language_model_errors(tmp_path):
    with pytest.raises(LtcxError, match="does not exist"):
        load_language_model(tmp_path / "missing.ckpt", model_class=LanguageModel)
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    with pytest.raises(LtcxError, match="could not be read"):
        load_language_model(junk, model_class=LanguageModel)
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(LtcxError, match="not written by ltcx"):
        load_language_model(tmp_path / "foreign.ckpt", model_class=LanguageModel)


class Mine(LanguageModel):
    """A user's subclass that changes nothing ltcx reads."""


class Smoothed(LanguageModel):
    """A user's subclass with a setting of its own, passing LanguageModel's on."""

    def __init__(self, backbone, label_smoothing: float = 0.0, **kwargs):
        super().__init__(backbone, **kwargs)


def test_a_subclass_loads_as_itself(tmp_path):
    """``load_from_checkpoint`` / ``from_pretrained`` called on a subclass return that subclass (the class is handed
    to ltcx.persist, which builds it), with the file's weights and settings; on LanguageModel, a LanguageModel."""
    from helpers import write_checkpoint
    from ltcx.persist import export_model

    path = write_checkpoint(tmp_path / "good.ckpt")
    stored = torch.load(path, weights_only=True)["state_dict"]
    plain = LanguageModel.load_from_checkpoint(path)
    mine = Mine.load_from_checkpoint(path)
    changed = Mine.load_from_checkpoint(path, learning_rate=1e-3)
    exported = Mine.from_pretrained(export_model(path, tmp_path / "export", model_class=Mine))
    assert type(plain) is LanguageModel
    assert type(mine) is Mine and type(changed) is Mine and type(exported) is Mine
    assert changed.hparams.learning_rate == 1e-3 and mine.hparams.warmup_steps == 2
    for model in (mine, changed, exported):
        assert all(torch.equal(value, stored[name]) for name, value in model.state_dict().items())

    own = Smoothed(GPT(block_size=64, vocab_size=320, n_layer=1, n_head=2, n_kv_head=1, n_embd=32),
                   label_smoothing=0.1, warmup_steps=2)
    torch.save({**torch.load(path, weights_only=True), "hyper_parameters": dict(own.hparams),
                "state_dict": own.state_dict()}, tmp_path / "smoothed.ckpt")
    loaded = Smoothed.load_from_checkpoint(tmp_path / "smoothed.ckpt")
    assert type(loaded) is Smoothed and loaded.hparams.label_smoothing == 0.1 and loaded.hparams.warmup_steps == 2
