"""Long context (``ltcx/data/niah.py``, ``ltcx/eval/long_context.py``): the needle generator's layout (the needle at
its exact depth, the passkey's digit tokens, targets only at the answer), determinism, disjoint splits, one-line
errors (in Python and through the CLI with ``configs/data/niah.yaml``); the evaluator against a direct
per-sequence loop (float64, needle and MQAR); the context-limit line; a tiny GPT learning the needle at its training
length (a deterministic learning test)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_mentions, one_error_line, read_events
from ltcx.batches import IGNORE_INDEX
from ltcx.data.mqar import TEST, VALIDATION, mqar_batch
from ltcx.data.niah import REPEAT_FILLER, NeedleBatches, NeedleDataModule, needle_position, needle_task, niah_batch
from ltcx.errors import ConfigError
from ltcx.eval.long_context import evaluate_mqar, evaluate_niah, lengths_within_context
from ltcx.models.catalog import CATALOG

ROOT = Path(__file__).resolve().parents[1]
SHORT = dict(needle="#{passkey}. ", question=" ?")  # a short needle and question: a tiny model's short sequences
DIGIT_IDS = list(range(ord("0"), ord("9") + 1))  # the bytes tokenizer's digits

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(depth, block_size=96, num_digits=5, haystack="repeat", seed=0, b=4, **text):
    task = needle_task("bytes", haystack, "train", **text)
    return task, niah_batch(np.random.default_rng(seed), task, b, block_size, num_digits, depth)


# -- the generator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_needle_starts_at_its_exact_depth_and_the_rest_is_haystack_question_answer(depth):
    task, (inputs, targets) = batch(depth)
    T, D = 96, 5
    n = T + 1 - len("The passkey is 12345. ") - len(" What is the passkey? The passkey is ") - D
    p = needle_position(task, T, D, depth)
    assert n == task.haystack_length(T, D) and p == round(depth * n)
    needle_len = len("The passkey is 12345. ")
    sequence = torch.cat([inputs, targets[:, -1:]], dim=1)  # the T + 1 tokens
    filler = np.resize(np.frombuffer(REPEAT_FILLER.encode(), dtype=np.uint8), n).tolist()
    for row in sequence.tolist():
        text = bytes(row).decode()
        passkey = text[p + len("The passkey is ") : p + len("The passkey is ") + D]
        assert text[p : p + needle_len] == f"The passkey is {passkey}. "
        assert row[:p] + row[p + needle_len : p + needle_len + n - p] == filler
        assert text[p + needle_len + n - p :] == f" What is the passkey? The passkey is {passkey}"


def test_the_passkey_is_its_digits_one_token_each_and_only_the_answer_is_asked():
    task, (inputs, targets) = batch(0.5, num_digits=7, b=64)
    asked = targets != IGNORE_INDEX
    assert asked[:, -7:].all() and not asked[:, :-7].any()  # the last 7 inputs: the question's end, then the digits
    answers = targets[:, -7:]
    p = needle_position(task, 96, 7, 0.5) + len("The passkey is ")
    assert torch.equal(inputs[:, p : p + 7], answers)  # the needle's passkey is the answer
    assert torch.equal(inputs[:, -6:], answers[:, :-1])  # teacher forcing: each digit read after it is asked
    assert set(answers.flatten().tolist()) <= set(DIGIT_IDS) and (answers[:, 0] != ord("0")).all()
    assert len({tuple(row) for row in answers.tolist()}) > 60  # random passkeys


def test_the_sample_haystack_is_a_window_of_the_split_s_shipped_text():
    task, (inputs, _) = batch(0.0, haystack="sample", **SHORT)
    p_end = len("#12345. ")
    text = (ROOT / "ltcx/data/sample/train.txt").read_bytes()
    n = task.haystack_length(96, 5)
    for row in inputs.tolist():
        assert bytes(row[p_end : p_end + n]) in text
    assert not np.array_equal(needle_task("bytes", "sample", "train").haystack,
                              needle_task("bytes", "sample", "val").haystack)  # validation.txt for val and test


def test_training_draws_the_depth_per_sequence():
    task, (inputs, _) = batch(None, haystack="repeat", b=64, **SHORT)
    starts = {bytes(row).decode().index("#") for row in inputs.tolist()}
    assert len(starts) > 20 and min(starts) >= 0 and max(starts) <= task.haystack_length(96, 5)


def test_the_same_seed_split_and_index_give_the_same_batch_and_splits_differ():
    def stream(split, seed=0):
        return NeedleBatches(split=split, rank=0, world_size=1, batch_size=4, block_size=96, num_digits=5,
                             tokenizer="bytes", haystack="sample", seed=seed)

    first, again = stream("train").batch(3), stream("train").batch(3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    others = [stream("train").batch(4), stream("train", seed=1).batch(3), stream("val").batch(3),
              stream("test").batch(3)]
    assert all(not torch.equal(first[0], other[0]) for other in others)
    val, test = stream(VALIDATION).batch(0), stream(TEST).batch(0)
    assert not torch.equal(val[1], test[1])  # the validation and test passkeys come from different seeds


def test_the_data_module_serves_its_splits_and_resumes_at_the_next_batch():
    dm = NeedleDataModule(block_size=96, batch_size=3, val_batches=2, test_batches=1, haystack="repeat", seed=5)
    assert dm.padded_vocab_size == 320 and dm.tokenizer_obj.name == "bytes"
    val = list(dm.val_dataloader())
    assert len(val) == 2 and val[0][0].shape == (3, 96) and len(list(dm.test_dataloader())) == 1
    dm.load_state_dict({"train_batches_consumed": 4})
    resumed = next(iter(dm.train_dataloader()))
    assert torch.equal(resumed[0], dm.train_dataset(skip_batches=0).batch(4)[0])


@pytest.mark.parametrize(("kw", "facts"), [
    (dict(haystack="noise"), ("data.haystack='noise'", "sample, repeat", "--data.haystack")),
    (dict(needle="The key."), ("data.needle='The key.'", "'{passkey}' exactly once", "--data.needle")),
    (dict(num_digits=0), ("data.num_digits=0", "1..18", "--data.num_digits")),
    (dict(block_size=60), ("data.block_size=60", "5-digit answer", "block_size >= 63", "raise --data.block_size",
                           "--data.needle", "--data.question")),
    (dict(block_size=400_000), ("data.block_size=400000", "399937 haystack tokens", "sample has 329990",
                                "--data.haystack repeat", "lower --data.block_size")),
    (dict(batch_size=0), ("data.batch_size=0", ">= 1", "--data.batch_size")),
])
def test_bad_settings_are_one_line(kw, facts):
    with pytest.raises(ConfigError) as error:
        NeedleDataModule(**kw)
    assert_mentions(str(error.value), *facts)
    assert "\n" not in str(error.value)


def test_bad_settings_through_the_cli_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(["fit", "--config", str(ROOT / "configs/gpt.yaml"),
                           "--config", str(ROOT / "configs/data/niah.yaml"), "--data.haystack", "noise"], capsys)
    assert_mentions(line, "data.haystack='noise'", "sample, repeat", "--data.haystack")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cli_fit_on_the_needle_logs_recall_and_samples_text_and_checkpoints_the_position(tmp_path, monkeypatch,
                                                                                          capsys):
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(ROOT / "configs/gpt.yaml"), "--config", str(ROOT / "configs/data/niah.yaml"),
          *CATALOG["gpt"].tiny_cli(), "--data.block_size", "64", "--data.batch_size", "4", "--data.val_batches", "2",
          "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"])
    assert "no sample generations" not in capsys.readouterr().err  # bytes are text: the samples are written
    events = read_events(tmp_path / "lightning_logs/gpt/version_0")
    assert {"val/recall_acc", "val/loss"} <= set(events.Tags()["scalars"])
    checkpoint = torch.load(tmp_path / "checkpoints/gpt/version_0/last.ckpt", weights_only=False)
    assert checkpoint["NeedleDataModule"] == {"train_batches_consumed": 3}
    assert checkpoint["ltcx"]["tokenizer"] == "bytes" and checkpoint["ltcx"]["backbone_config"]["vocab_size"] == 320


# -- the evaluator -----------------------------------------------------------------------------------------------


def _train_tiny_gpt(steps: int) -> torch.nn.Module:
    """The catalogue's tiny GPT (context 64) trained on 2-digit needles at length 32, fixed seeds."""
    torch.manual_seed(0)
    data = NeedleBatches(split="train", rank=0, world_size=1, batch_size=32, block_size=32, num_digits=2,
                         tokenizer="bytes", haystack="sample", seed=0, **SHORT)
    backbone = CATALOG["gpt"].build_tiny(257, init_std=16 ** -0.5)  # N(0, 1/width), as test_recall's learning test
    optimizer = torch.optim.AdamW(backbone.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        inputs, targets = data.batch(step)
        logits, _ = backbone(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(backbone.parameters(), 1.0)
        optimizer.step()
    return backbone.eval()


STEPS_TO_LEARN = 400


@pytest.fixture(scope="module")
def trained():
    return _train_tiny_gpt(STEPS_TO_LEARN)


def test_a_tiny_gpt_learns_the_needle_at_its_training_length(trained):
    """A deterministic learning test (fixed seeds and steps, not a timed one): the catalogue's tiny GPT answers a
    2-digit passkey hidden in the TinyStories sample at length 32, at every depth, on the validation split's
    sequences; at twice the length (still in its context of 64) it has not learned to."""
    grid = evaluate_niah(trained, 32, factors=(1, 2), depths=(0.0, 0.5, 1.0), num_sequences=64, num_digits=2,
                         split="val", **SHORT)
    assert all(grid.accuracy[(32, depth)] >= 0.9 for depth in (0.0, 0.5, 1.0)), grid.accuracy
    assert all(grid.accuracy[(64, depth)] <= 0.5 for depth in (0.0, 0.5, 1.0)), grid.accuracy
    assert grid.note is None and grid.count[(32, 0.5)] == 64


@torch.no_grad()
def _direct(backbone, batches, per_sequence):
    """The reference: each sequence fed whole, alone; the argmax and log p at each asked target."""
    right = answers = tokens = 0
    total = 0.0
    for inputs, targets in batches:
        for x, y in zip(inputs, targets):
            logits, _ = backbone(x[None])
            log_p = logits[0].log_softmax(-1)
            asked = (y != IGNORE_INDEX).nonzero()[:, 0].tolist()
            hits = [int(logits[0, t, :257 if per_sequence else 64].argmax()) == int(y[t]) for t in asked]
            total += sum(float(log_p[t, y[t]]) for t in asked)
            tokens += len(asked)
            right, answers = (right + all(hits), answers + 1) if per_sequence else (right + sum(hits),
                                                                                     answers + len(hits))
    return right / answers, total / tokens, answers


def test_the_needle_evaluator_matches_a_direct_per_sequence_loop():
    backbone = _train_tiny_gpt(150).double()  # part-trained: accuracies between 0 and 1
    grid = evaluate_niah(backbone, 32, factors=(1, 2), depths=(0.0, 0.4, 1.0), num_sequences=5, batch_size=2,
                         num_digits=2, seed=7, split="test", piece_len=7, **SHORT)
    task = needle_task("bytes", "sample", "test", **SHORT)
    for length in (32, 64):
        for depth in (0.0, 0.4, 1.0):
            batches = [niah_batch(np.random.default_rng([7, TEST, length, b]), task, size, length, 2, depth)
                       for b, size in enumerate([2, 2, 1])]
            accuracy, log_prob, count = _direct(backbone, batches, per_sequence=True)
            assert grid.accuracy[(length, depth)] == accuracy and grid.count[(length, depth)] == count == 5
            assert grid.log_prob[(length, depth)] == pytest.approx(log_prob, abs=1e-10)
    assert 0 < np.mean(list(grid.accuracy.values())) < 1


@pytest.mark.parametrize("scale_pairs", [False, True])
def test_the_mqar_evaluator_matches_a_direct_per_sequence_loop(scale_pairs):
    torch.manual_seed(0)
    backbone = CATALOG["gpt"].build_tiny(64).double().eval()
    grid = evaluate_mqar(backbone, 16, 2, 64, factors=(1, 2, 4), scale_pairs=scale_pairs, num_sequences=3,
                         batch_size=2, seed=3, piece_len=5)
    for factor in (1, 2, 4):
        length, pairs = 16 * factor, 2 * factor if scale_pairs else 2
        batches = [mqar_batch(np.random.default_rng([3, TEST, length, b]), size, length, pairs, 64)
                   for b, size in enumerate([2, 1])]
        accuracy, log_prob, count = _direct(backbone, batches, per_sequence=False)
        assert grid.accuracy[(length, pairs)] == accuracy and grid.count[(length, pairs)] == count == 3 * pairs
        assert grid.log_prob[(length, pairs)] == pytest.approx(log_prob, abs=1e-10)


def test_mqar_pairs_that_do_not_fit_a_length_are_one_line_before_any_scoring():
    backbone = CATALOG["gpt"].build_tiny(32)
    with pytest.raises(ConfigError) as error:
        evaluate_mqar(backbone, 16, 4, 32, factors=(1, 4), scale_pairs=True)
    assert_mentions(str(error.value), "MQAR at length 64", "16 pairs", "data.vocab_size=32", "too small",
                    "--data.vocab_size")


def test_a_model_with_a_context_limit_stops_there_in_one_line(capsys):
    backbone = CATALOG["gpt"].build_tiny(257).eval()  # learned positions: a context of 64
    grid = evaluate_niah(backbone, 32, factors=(1, 2, 4, 8), depths=(0.5,), num_sequences=1, num_digits=2,
                         haystack="repeat", **SHORT)
    [said] = capsys.readouterr().err.splitlines()
    assert grid.note == said
    assert_mentions(said, "GPT", "context limit of 64 tokens", "max_seq_len", "128, 256 not evaluated")
    assert sorted(grid.accuracy) == [(32, 0.5), (64, 0.5)]
    mqar = evaluate_mqar(CATALOG["gpt"].build_tiny(64).eval(), 16, 2, 64, num_sequences=1, report=lambda _: None)
    assert sorted(mqar.accuracy) == [(16, 2), (32, 2), (64, 2)] and "lengths 128 not evaluated" in mqar.note


def test_a_model_without_a_context_limit_is_evaluated_at_every_length():
    backbone = CATALOG["xlstm"].build_tiny(64).eval()
    assert lengths_within_context(backbone, [16, 128]) == ([16, 128], None)


# -- the command: ltcx evaluate --task long_context ------------------------------------------------------------

NEEDLE_DATA = {"_class_path": "ltcx.data.niah.NeedleDataModule", "tokenizer": "bytes", "block_size": 32,
               "num_digits": 2, "haystack": "sample", **SHORT}
MQAR_DATA = {"_class_path": "ltcx.data.RecallDataModule", "vocab_size": 64, "block_size": 16, "num_kv_pairs": 2,
             "power_a": 0.01, "random_fillers": True}


def task_checkpoint(path, backbone, data):
    """A checkpoint of ``backbone`` (untrained) recording that its data module had the settings ``data``."""
    from helpers import write_model_checkpoint

    write_model_checkpoint(path, backbone, train_block_size=data["block_size"])
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["datamodule_hyper_parameters"] = dict(data)
    torch.save(checkpoint, path)
    return path


def test_the_command_scores_each_checkpoint_on_its_task_and_writes_json_and_pngs(tmp_path, capsys):
    """A rope GPT on the needle (no context limit: every length) and a learned-position GPT on MQAR (context 64:
    stops there in one line) in one call; the JSON's cells are the evaluators' on the same sequences."""
    from ltcx.cli import main

    torch.manual_seed(0)
    rope, learned = CATALOG["gpt"].build_tiny(320, "rope"), CATALOG["gpt"].build_tiny(320)
    needle = task_checkpoint(tmp_path / "needle.ckpt", rope, NEEDLE_DATA)
    mqar = task_checkpoint(tmp_path / "mqar.ckpt", learned, MQAR_DATA)
    out = tmp_path / "eval"
    main(["evaluate", "--task", "long_context", "--ckpt_path", str(needle), "--ckpt_path", str(mqar),
          "--factors", "1,2,8", "--depths", "0,0.5,1", "--num_sequences", "3", "--batch_size", "2", "--out", str(out)])
    captured = capsys.readouterr()
    [limit] = [line for line in captured.err.splitlines() if "context limit" in line]
    assert_mentions(limit, "GPT", "context limit of 64 tokens", "max_seq_len", "128 not evaluated")
    assert sorted(p.name for p in out.iterdir()) == ["long_context.json", "long_context.png", "needle_heatmaps.png"]
    for png in ("long_context.png", "needle_heatmaps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((out / "long_context.json").read_text())
    assert document["settings"]["factors"] == [1, 2, 8] and document["settings"]["depths"] == [0.0, 0.5, 1.0]
    first, second = document["results"]
    assert {"label", "ckpt_path", "backbone", "architecture", "position", "context_limit", "task", "train_length",
            "lengths", "accuracy", "note", "data", "parameters"} <= set(first) & set(second)
    assert first["parameters"] == rope.parameter_count()
    assert (first["task"], first["position"], first["context_limit"], first["lengths"]) == ("needle", "rope", None,
                                                                                           [32, 64, 256])
    assert np.array(first["heatmap"]).shape == (3, 3) and first["note"] is None and first["count"] == 3
    assert (second["task"], second["context_limit"], second["lengths"]) == ("mqar", 64, [16, 32])
    assert second["kept"]["pairs"] == [2, 2] and second["scaled"]["pairs"] == [2, 4] and "128" in second["note"]

    model_rope = rope.eval()
    grid = evaluate_niah(model_rope, 32, factors=(1, 2, 8), depths=(0.0, 0.5, 1.0), num_sequences=3, batch_size=2,
                         num_digits=2, **SHORT)
    assert first["heatmap"] == [[grid.accuracy[(n, d)] for n in (32, 64, 256)] for d in (0.0, 0.5, 1.0)]
    assert first["log_prob"][1][2] == pytest.approx(grid.log_prob[(256, 0.5)], rel=1e-6)
    scaled = evaluate_mqar(learned.eval(), 16, 2, 64, factors=(1, 2, 8), scale_pairs=True, num_sequences=3,
                           batch_size=2, report=lambda _: None)
    assert second["scaled"]["accuracy"] == [scaled.accuracy[(16, 2)], scaled.accuracy[(32, 4)]]


@pytest.mark.parametrize(("extra", "facts"), [
    (["--factors", "0,2"], ("--factors '0,2'", "comma-separated", "distinct", ">= 1", "(1,2,4,8)")),
    (["--depths", "0,1.5"], ("--depths '0,1.5'", "comma-separated", "distinct", "[0, 1]", "(0,0.5,1)")),
    (["--data.path", "sample"], ("--data.path", "position_loss", "--task long_context", "--factors")),
    (["--num_sequences", "0"], ("--num_sequences (0)", ">= 1")),
])
def test_bad_long_context_arguments_are_one_line_and_write_nothing(tmp_path, capsys, extra, facts):
    monkeypatch_out = tmp_path / "eval"
    line = one_error_line(["evaluate", "--task", "long_context", "--ckpt_path", str(tmp_path / "none.ckpt"),
                           "--out", str(monkeypatch_out), *extra], capsys)
    assert_mentions(line, *facts)
    assert not monkeypatch_out.exists()


def test_checkpoints_that_cannot_be_scored_are_one_line_before_anything_is_scored(tmp_path, capsys):
    from helpers import write_model_checkpoint
    from ltcx.lm import LanguageModel
    from ltcx.persist import export_model

    out = tmp_path / "eval"
    text = write_model_checkpoint(tmp_path / "text.ckpt", CATALOG["xlstm"].build_tiny(320), train_block_size=32)
    needle = task_checkpoint(tmp_path / "needle.ckpt", CATALOG["gpt"].build_tiny(320, "rope"), NEEDLE_DATA)
    mqar = task_checkpoint(tmp_path / "mqar.ckpt", CATALOG["gpt"].build_tiny(320, "rope"),
                           {**MQAR_DATA, "vocab_size": 8})
    export_model(needle, tmp_path / "export", model_class=LanguageModel)
    tasks = ("configs/data/niah.yaml", "configs/data/mqar.yaml")
    cases = [
        ([], ("--task long_context needs --ckpt_path", *tasks, "--train cpu")),
        (["--ckpt_path", str(needle), "--ckpt_path", str(text)],
         (f"checkpoint '{text}'", "not trained on the needle or on MQAR", *tasks)),
        (["--ckpt_path", str(tmp_path / "export")],
         (f"'{tmp_path / 'export'}' is an export", "no data settings", "pass the checkpoint it was exported from")),
        (["--ckpt_path", str(mqar)], ("MQAR at length 32", "4 pairs", "data.vocab_size=8", "too small",
                                      "data.num_kv_pairs=4")),
    ]
    for args, facts in cases:
        line = one_error_line(["evaluate", "--task", "long_context", *args, "--out", str(out)], capsys)
        assert_mentions(line, *facts)
        assert not out.exists()


def test_position_loss_without_its_text_or_models_is_one_line(tmp_path, capsys):
    line = one_error_line(["evaluate", "--ckpt_path", str(tmp_path / "a.ckpt")], capsys)
    assert_mentions(line, "--task position_loss", "needs --data.path", "the text to score")
    line = one_error_line(["evaluate", "--train", "cpu", "--data.path", "sample"], capsys)
    assert_mentions(line, "--train", "needs --task long_context")


def test_the_cpu_default_trains_each_run_once_then_scores_it(tmp_path, monkeypatch, capsys):
    """``--train cpu`` with its plan cut to the rope GPT on the needle and 4 steps: a fit through the CLI, its
    checkpoint scored past the training length; a second call keeps the trained run."""
    from ltcx.cli import main
    from ltcx.study import long_context as default

    assert {run.arch for run in default.plan()} == set(CATALOG) and len(default.plan()) == 2 * (len(CATALOG) + 1)
    run = next(r for r in default.plan() if r.label == "gpt-rope" and r.task == "needle")
    args = run.fit_args(tmp_path)
    assert args[args.index("--model.backbone.init_args.position") + 1] == "rope"
    assert args[args.index("--model.backbone.init_args.block_size") + 1] == str(default.LENGTH)
    monkeypatch.setattr(default, "plan", lambda: [run])
    monkeypatch.setattr(default, "STEPS", 4)
    out = tmp_path / "results"
    command = ["evaluate", "--task", "long_context", "--train", "cpu", "--factors", "1,4", "--depths", "0.5",
               "--num_sequences", "2", "--out", str(out)]
    main(command)
    [said] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("gpt-rope-needle: ")]
    assert_mentions(said, "training 4 steps", "length 32", "new")
    document = json.loads((out / "long_context.json").read_text())
    (result,) = document["results"]
    assert (result["label"], result["task"], result["lengths"], result["global_step"]) == ("gpt-rope", "needle",
                                                                                          [32, 128], 4)
    main(command)
    [said] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("gpt-rope-needle: ")]
    assert_mentions(said, "trained before", "kept")
