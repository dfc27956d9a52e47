"""`fit --ckpt_path`: which configuration a resumed run trains with. Flags typed on the command line win over the
checkpoint (one notice line each, and the optimizer follows them after Lightning restores its state); every other
value, a YAML's included, is the checkpoint's; a typed flag that changes the architecture is one error line."""

import pytest
import torch

from helpers import assert_mentions, lean_fit_args, one_error_line
from ltcx.cli import main
from ltcx.cli.resume import checkpoint_backbone
from ltcx.errors import LtcxError
from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG
from ltcx.optim import lr_at_step
from ltcx.persist import atomic_save, read_checkpoint
from ltcx.study.budget import match_shape

FIRST = ("--trainer.max_steps", "3", "--model.decay_steps", "10")  # warmup 2 (TINY_MODEL), cosine to step 10


def notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ltcx: resuming with")]


def without(args: list[str], *flags: str) -> list[str]:
    """``args`` less each ``flag value`` pair named."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


@pytest.fixture
def first_run(tmp_path, fit_env, capsys):
    main(lean_fit_args(tmp_path, fit_env, *FIRST))
    capsys.readouterr()
    return tmp_path / "checkpoints/gpt/version_0/last.ckpt"


def test_typed_learning_rate_and_weight_decay_win_and_drive_the_optimizer(tmp_path, fit_env, first_run, capsys,
                                                                         monkeypatch):
    used = []  # the rate and weight decay each resumed step runs with, read before its optimizer step
    start = LanguageModel.on_train_batch_start

    def record(self, batch, batch_idx):
        used.append([(g["lr"], g["weight_decay"]) for g in self.trainer.optimizers[0].param_groups])
        start(self, batch, batch_idx)

    monkeypatch.setattr(LanguageModel, "on_train_batch_start", record)
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "5", "--ckpt_path", "last",
                       "--model.learning_rate", "1e-3", "--model.weight_decay", "0.05"))
    assert notices(capsys.readouterr().err) == [
        "ltcx: resuming with model.learning_rate 0.001 (the checkpoint has 0.0006)",
        "ltcx: resuming with model.weight_decay 0.05 (the checkpoint has 0.1)",
    ]
    # The two resumed steps (3 and 4) follow the new peak at once, on the checkpoint's schedule (cosine to step 10).
    rates = [pytest.approx(lr_at_step(step, 1e-3, 6e-5, 2, 10)) for step in (3, 4)]
    assert used == [[(rate, 0.05), (rate, 0.0)] for rate in rates]
    resumed = read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")
    assert resumed["global_step"] == 5 and resumed["ltcx"]["tokens_seen"] == 5 * 4 * 32
    assert resumed["hyper_parameters"]["learning_rate"] == 1e-3 and resumed["hyper_parameters"]["weight_decay"] == 0.05
    decay, no_decay = resumed["optimizer_states"][0]["param_groups"]
    assert decay["lr"] == no_decay["lr"] == pytest.approx(lr_at_step(5, 1e-3, 6e-5, 2, 10))  # the next step's
    assert decay["initial_lr"] == 1e-3 and (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert resumed["lr_schedulers"][0]["base_lrs"] == [1e-3, 1e-3] and resumed["lr_schedulers"][0]["last_epoch"] == 5
    assert resumed["optimizer_states"][0]["state"][0]["step"] == 5  # AdamW's moments were resumed, not reset


def test_a_flag_typed_by_a_prefix_wins_too(tmp_path, fit_env, first_run, capsys):
    """The parser takes a unique prefix of a flag as the flag (``--model.learning_rat``): it is typed all the same, so
    the run resumes with its value and says so, as for the whole name."""
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", "last",
                       "--model.learning_rat", "1e-3"))
    assert notices(capsys.readouterr().err) == [
        "ltcx: resuming with model.learning_rate 0.001 (the checkpoint has 0.0006)"]
    resumed = read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")
    assert resumed["hyper_parameters"]["learning_rate"] == 1e-3
    assert resumed["lr_schedulers"][0]["base_lrs"] == [1e-3, 1e-3]


def test_untyped_values_are_the_checkpoints(tmp_path, fit_env, capsys):
    """A first run's typed flags need not be typed again: configs/gpt.yaml's values (learning_rate 6e-4, n_layer 6)
    do not replace the checkpoint's; each such YAML value is named once, and no override notice is printed."""
    main(lean_fit_args(tmp_path, fit_env, *FIRST, "--model.learning_rate", "1e-3"))
    first = read_checkpoint(tmp_path / "checkpoints/gpt/version_0/last.ckpt")
    capsys.readouterr()
    main(lean_fit_args(tmp_path, fit_env, *FIRST, "--model.learning_rate", "1e-3", "--trainer.max_steps", "4",
                       "--ckpt_path", "last"))  # the same command: nothing to say
    assert "ltcx: resuming" not in capsys.readouterr().err
    bare = without(lean_fit_args(tmp_path, fit_env), "--model.backbone.init_args.n_layer")
    main([*bare, "--trainer.max_steps", "5", "--ckpt_path", "last"])
    assert notices(capsys.readouterr().err) == [
        "ltcx: resuming with the checkpoint's model.learning_rate 0.001, not 0.0006 from the config (type "
        "--model.learning_rate 0.0006 to change it)",
        "ltcx: resuming with the checkpoint's model.backbone.init_args.n_layer 1, not 6 from the config",
    ]
    resumed = read_checkpoint(tmp_path / "checkpoints/gpt/version_2/last.ckpt")
    assert resumed["global_step"] == 5
    assert resumed["hyper_parameters"] == first["hyper_parameters"]
    assert resumed["ltcx"]["backbone_config"] == first["ltcx"]["backbone_config"]
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(lr_at_step(5, 1e-3, 6e-5, 2, 10))
    main(["validate", *bare[1:], "--ckpt_path", "last"])  # evaluation takes the architecture from the checkpoint too
    assert "ltcx: resuming" not in capsys.readouterr().err


# the fixes a typed architecture change names: keep the checkpoint, or keep the flag
DROP_OR_START_AGAIN = ("drop the flag", "new run without --ckpt_path")


@pytest.mark.parametrize("flags,facts", [
    (["--model.backbone.init_args.n_layer", "2"],
     ("--model.backbone.init_args.n_layer 2", "would change the architecture", "n_layer 1", *DROP_OR_START_AGAIN)),
    (["--model.backbone.n_embd=64"],
     ("--model.backbone.init_args.n_embd 64", "would change the architecture", "n_embd 32", *DROP_OR_START_AGAIN)),
    (["--model.backbone", "ltcx.models.ltc.LTCGPT"],
     ("--model.backbone ltcx.models.ltc.LTCGPT", "another architecture", "ltcx.models.gpt.GPT",
      *DROP_OR_START_AGAIN)),
])
def test_a_typed_architecture_change_is_one_line_and_writes_nothing(tmp_path, fit_env, first_run, capsys, flags,
                                                                    facts):
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "5", "--ckpt_path", "last",
                                        *flags), capsys)
    assert_mentions(line, "checkpoint 'checkpoints/gpt/version_0/last.ckpt'", *facts)
    assert [p.name for p in (tmp_path / "checkpoints/gpt").iterdir()] == ["version_0"]
    assert [p.name for p in (tmp_path / "lightning_logs/gpt").iterdir()] == ["version_0"]


def test_a_typed_dropout_is_resumed_with(tmp_path, fit_env, first_run, capsys):
    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", "last",
                       "--model.backbone.init_args.dropout", "0.1"))
    assert notices(capsys.readouterr().err) == [
        "ltcx: resuming with model.backbone.init_args.dropout 0.1 (the checkpoint has 0.0)"]
    resumed = read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")
    assert resumed["global_step"] == 4 and resumed["ltcx"]["backbone_config"]["dropout"] == 0.1
    before = read_checkpoint(first_run)["state_dict"]
    assert {k: v.shape for k, v in resumed["state_dict"].items()} == {k: v.shape for k, v in before.items()}
    assert torch.equal(resumed["optimizer_states"][0]["state"][0]["step"], torch.tensor(4.0))


def test_a_checkpoint_with_impossible_betas_is_one_line_naming_the_file(tmp_path, fit_env, first_run, capsys):
    """A checkpoint whose hyper-parameters hold betas [2.0, 3.0] (its digest recomputed: not damaged, just wrong):
    one line naming the file and the setting, nothing written, instead of AdamW's traceback once the run has
    started; typing --model.betas, as the line says, resumes it."""
    checkpoint = torch.load(first_run, weights_only=True)
    checkpoint["hyper_parameters"]["betas"] = (2.0, 3.0)
    path = tmp_path / "betas.ckpt"
    atomic_save(checkpoint, path)  # with the digest of the changed contents
    line = one_error_line(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", str(path)),
                          capsys)
    assert_mentions(line, f"checkpoint '{path}'", "model.betas [2.0, 3.0]", "two numbers in [0, 1)",
                    "type --model.betas", "another checkpoint")
    assert [p.name for p in (tmp_path / "checkpoints/gpt").iterdir()] == ["version_0"]
    assert [p.name for p in (tmp_path / "lightning_logs/gpt").iterdir()] == ["version_0"]

    main(lean_fit_args(tmp_path, fit_env, "--trainer.max_steps", "4", "--ckpt_path", str(path),
                       "--model.betas", "[0.9, 0.95]"))
    [said] = [line for line in capsys.readouterr().err.splitlines() if "resuming with model.betas" in line]
    assert_mentions(said, "model.betas [0.9, 0.95]", "the checkpoint has [2.0, 3.0]")
    assert read_checkpoint(tmp_path / "checkpoints/gpt/version_1/last.ckpt")["global_step"] == 4


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_a_study_shape_typed_on_its_own_checkpoint_resumes_it(name):
    """The study runner types every field of its shapes on ``fit`` and ``test`` with ``--ckpt_path``, a derived
    field's null included (LTC's ``tau_min: null`` = block_size / 12, stored resolved): the same architecture, so no
    error; a null that derives another value (another block_size) still is one."""
    from jsonargparse import Namespace

    init_args = dict(match_shape(name, "params", 2e5, 64, 128).init_args)
    backbone_class = CATALOG[name].backbone_class()
    stored = backbone_class(**init_args).config_dict()
    checkpoint = {"ltcx": {"backbone_class": CATALOG[name].class_path, "backbone_config": stored}}
    typed = {f"backbone.{key}" for key in init_args}
    backbone = Namespace(class_path=CATALOG[name].class_path, init_args=Namespace(**init_args))
    assert checkpoint_backbone(checkpoint, backbone, typed, "last.ckpt", None) is None
    derived = [key for key, value in init_args.items() if value is None and stored[key] is not None]
    assert name != "ltc" or derived == ["tau_min"]
    for key in derived:  # a checkpoint whose value is not the one its other fields derive: a typed null changes it
        other = {**stored, "block_size": 2 * stored["block_size"]}
        with pytest.raises(LtcxError) as error:
            checkpoint_backbone({"ltcx": {"backbone_class": CATALOG[name].class_path, "backbone_config": other}},
                                backbone, {f"backbone.{key}"}, "last.ckpt", None)
        assert_mentions(str(error.value), f"--model.backbone.init_args.{key} null", "would change the architecture")
