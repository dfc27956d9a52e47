"""The lm-evaluation-harness adapter (``ltcx/eval/harness.py``) and ``ltcx lm-eval``: small local tasks in lm_eval's
YAML format (JSONL data the test writes; hub tasks cannot be fetched here), the adapter's log-likelihoods, rolling
log-likelihoods and greedy generations against direct float64 computations from the model, the command end to end,
its one-line errors, and ``lm_eval`` staying unimported by the other commands."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, assert_mentions, one_error_line, write_checkpoint

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from ltcx.eval.harness import LtcxLM  # noqa: E402
from ltcx.models.catalog import build_tiny  # noqa: E402
from ltcx.tokenizers import get_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320  # the bytes tokenizer's 257 ids, padded
CHOICE_ITEMS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "tree"], "answer": 0},
    {"question": "Birds can", "choices": ["fly", "swim"], "answer": 0},
    {"question": "Snow is", "choices": ["cold", "hot", "loud", "green"], "answer": 0},
    {"question": "One plus one is", "choices": ["two", "three"], "answer": 0},
    {"question": "At night we see the", "choices": ["moon", "sun", "sea"], "answer": 0},
]
ROLLING_DOCS = [{"text": "Once upon a time there was a little dog. " * 3}, {"text": "It ran."}]
GEN_ITEMS = [{"question": "Q: name a colour.\nA:", "answer": " red"}, {"question": "Q: say hi.\nA:", "answer": " hi"}]


def write_tasks(folder: Path) -> Path:
    """Three tasks in lm_eval's YAML format over JSONL files in ``folder``: ``ltcx_tiny_choice`` (multiple choice),
    ``ltcx_tiny_rolling`` (perplexity: loglikelihood_rolling) and ``ltcx_tiny_gen`` (generate_until)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("choice", CHOICE_ITEMS), ("rolling", ROLLING_DOCS), ("gen", GEN_ITEMS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "choice.yaml").write_text(
        "task: ltcx_tiny_choice\n" + head.format(data=folder / "choice.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\ndoc_to_choice: choices\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "rolling.yaml").write_text(
        "task: ltcx_tiny_rolling\n" + head.format(data=folder / "rolling.jsonl")
        + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "gen.yaml").write_text(
        "task: ltcx_tiny_gen\n" + head.format(data=folder / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_tiny(arch, VOCAB, **({"block_size": 24} if arch == "gpt" else {})).double().eval()


@torch.no_grad()
def direct_log_prob(backbone, context: list[int], continuation: list[int]) -> float:
    """sum of log p(continuation token | everything before it), the sequence fed whole, one row, float64."""
    whole = context + continuation
    logits, _ = backbone(torch.tensor([whole[:-1]]))
    log_probs = logits[0].to(torch.float64).log_softmax(-1)
    return sum(float(log_probs[t - 1, whole[t]]) for t in range(len(context), len(whole)))


@pytest.mark.parametrize("arch", ["gpt", "xlstm"])
def test_multiple_choice_log_likelihoods_match_the_model(tmp_path, arch):
    """Through the harness (a local YAML task, batches of 2 padded on the right): every choice's log-likelihood is
    the direct computation's to float64 tolerance, and the accuracy is that of the direct argmax."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    backbone, tokenizer = tiny(arch), get_tokenizer("bytes")
    manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)
    results = simple_evaluate(model=LtcxLM(backbone, tokenizer, batch_size=2), tasks=["ltcx_tiny_choice"],
                              task_manager=manager, bootstrap_iters=0)
    samples = sorted(results["samples"]["ltcx_tiny_choice"], key=lambda s: s["doc_id"])
    assert len(samples) == len(CHOICE_ITEMS)
    correct = 0
    for sample, item in zip(samples, CHOICE_ITEMS):
        direct = []
        for (context, continuation), (log_prob, _) in zip(sample["arguments"], sample["filtered_resps"]):
            assert (context, continuation.strip() in item["choices"]) == (item["question"], True)
            direct.append(direct_log_prob(backbone, tokenizer.encode(context), tokenizer.encode(continuation)))
            assert math.isclose(log_prob, direct[-1], rel_tol=1e-10), (context, continuation)
        correct += max(range(len(direct)), key=direct.__getitem__) == item["answer"]
    assert results["results"]["ltcx_tiny_choice"]["acc,none"] == correct / len(CHOICE_ITEMS)


def test_loglikelihood_is_greedy_only_when_every_token_is_the_argmax():
    backbone, tokenizer = tiny("xlstm"), get_tokenizer("bytes")
    context = tokenizer.encode("Hello")
    with torch.no_grad():
        greedy = []
        for _ in range(3):  # the model's own greedy continuation
            logits, _ = backbone(torch.tensor([context + greedy]))
            greedy.append(int(logits[0, -1, :257].argmax()))
    lm = LtcxLM(backbone, tokenizer)
    (_, is_greedy), (_, other) = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, greedy[:2] + [(greedy[2] + 1) % 256])]
    )
    assert is_greedy and not other


def test_loglikelihood_past_the_context_limit_scores_with_the_last_tokens():
    """A context longer than the GPT's 24 positions: the continuation is scored after the last 24 - 3 + 1 tokens, as
    lm_eval's Hugging Face model truncates."""
    backbone, tokenizer = tiny("gpt"), get_tokenizer("bytes")
    context, continuation = tokenizer.encode("a long question that does not fit"), tokenizer.encode(" ok")
    ((log_prob, _),) = LtcxLM(backbone, tokenizer)._loglikelihood_tokens([(None, context, continuation)])
    assert math.isclose(log_prob, direct_log_prob(backbone, context[-(25 - 3) :], continuation), rel_tol=1e-10)


@pytest.mark.parametrize("arch", ["gpt", "xlstm", "titans_mac"])
def test_rolling_log_likelihood_matches_the_model(arch):
    """A GPT with a context of 24 scores a 123-byte text in windows predicting 24 tokens each after the token before
    them (the last, shorter one after as many as fit: lm_eval's rolling windows); an xLSTM scores it whole after the
    end-of-text token, as does a Titans MAC (both batched with a short text, padded on the right, in pieces of 10);
    a short text is one window for all."""
    backbone, tokenizer = tiny(arch), get_tokenizer("bytes")
    lm = LtcxLM(backbone, tokenizer, batch_size=3, piece_len=10)
    texts = [row["text"] for row in ROLLING_DOCS]
    scores = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), idx) for idx, text in enumerate(texts)], disable_tqdm=True
    )
    for text, score in zip(texts, scores):
        tokens = tokenizer.encode(text)
        window = backbone.max_seq_len or len(tokens)
        expected = direct_log_prob(backbone, [tokenizer.eot_id], tokens[:window])
        for start in range(window, len(tokens), window):  # the last window keeps a full context before its part
            end = min(start + window, len(tokens))
            expected += direct_log_prob(backbone, tokens[end - window - 1 : start], tokens[start:end])
        assert math.isclose(score, expected, rel_tol=1e-10)
    assert len(tokenizer.encode(texts[0])) > 4 * 24  # the GPT's text does span several windows


@torch.no_grad()
def direct_greedy(backbone, prompt: list[int], max_new: int, eot: int) -> list[int]:
    """Greedy decoding written out: the whole sequence fed again for every new token (no state)."""
    ids = list(prompt)
    for _ in range(max_new):
        logits, _ = backbone(torch.tensor([ids]))
        token = int(logits[0, -1, :257].argmax())
        if token == eot:
            break
        ids.append(token)
    return ids[len(prompt) :]


def test_generate_until_is_the_models_greedy_text_cut_at_the_stop_string():
    backbone, tokenizer = tiny("xlstm"), get_tokenizer("bytes")
    prompts = ["Once upon", "A dog sat", "Hi"]  # different lengths: one padded batch
    free = [tokenizer.decode(direct_greedy(backbone, tokenizer.encode(p), 12, tokenizer.eot_id)) for p in prompts]
    stop = next(ch for ch in free[1][1:] if ch.isascii() and ch.isprintable())  # a stop string that does occur
    requests = [
        Instance("generate_until", {}, (prompts[0], {"until": [], "max_gen_toks": 12}), 0),
        Instance("generate_until", {}, (prompts[1], {"until": [stop], "max_gen_toks": 12}), 1),
        Instance("generate_until", {}, (prompts[2], {"until": "\n\n", "max_gen_toks": 12, "do_sample": False}), 2),
    ]
    texts = LtcxLM(backbone, tokenizer, batch_size=4).generate_until(requests, disable_tqdm=True)
    assert texts == [free[0], free[1].split(stop, 1)[0], free[2].split("\n\n", 1)[0]]
    assert len(texts[1]) < len(free[1])


def test_lm_eval_command_runs_local_tasks_and_writes_results(tmp_path, capsys):
    from ltcx.cli import main

    checkpoint = write_checkpoint(tmp_path / "gpt.ckpt")
    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "results"
    main(["lm-eval", "--ckpt_path", str(checkpoint), "--tasks", "ltcx_tiny_choice,ltcx_tiny_rolling",
          "--tasks", "ltcx_tiny_gen", "--include_path", str(tasks), "--batch_size", "2", "--bootstrap_iters", "0",
          "--out", str(out)])
    table = capsys.readouterr().out
    assert "ltcx_tiny_choice" in table and "word_perplexity" in table and "exact_match" in table
    results = json.loads((out / "results.json").read_text())["results"]
    assert 0.0 <= results["ltcx_tiny_choice"]["acc,none"] <= 1.0
    assert results["ltcx_tiny_rolling"]["word_perplexity,none"] > 1.0
    assert results["ltcx_tiny_gen"]["exact_match,none"] in (0.0, 0.5, 1.0)


@pytest.fixture
def no_default_tasks(monkeypatch):
    """lm_eval's own task index (thousands of YAML files, a minute here) is not what these tests check."""
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)


def test_lm_eval_unknown_task_is_one_line(tmp_path, capsys, no_default_tasks):
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_tiny_choice,hellaswag_typo", "--include_path",
                           str(write_tasks(tmp_path / "tasks"))], capsys)
    assert_mentions(line, "no task 'hellaswag_typo'", "`lm_eval ls tasks`", "--include_path")


def test_lm_eval_missing_task_data_file_is_named(tmp_path, capsys, no_default_tasks):
    """A local task's data file that is not there: named, with no hint about the hub it is not read from."""
    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "choice.jsonl").unlink()
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_tiny_choice", "--include_path", str(tasks)], capsys)
    assert_mentions(line, "task 'ltcx_tiny_choice'", f"data file '{tasks / 'choice.jsonl'}'", "does not exist",
                    "data_files (dataset_kwargs)", "write the file")


def test_lm_eval_unreadable_task_data_is_one_line(tmp_path, capsys, no_default_tasks):
    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "choice.jsonl").write_text("{not json\n")
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_tiny_choice", "--include_path", str(tasks)], capsys)
    assert line.startswith("ltcx: error: cannot load lm_eval task(s) ltcx_tiny_choice (")
    assert line.endswith("): check the task's YAML file and its dataset_path / data_files")


BROKEN_YAML = "task: ltcx_tiny_choice\ndataset_path: json\n  bad: [unclosed\n"


@pytest.mark.parametrize("given", ["include_path", "path"])
def test_lm_eval_malformed_task_yaml_names_the_file_and_line(tmp_path, capsys, no_default_tasks, given):
    """Not "knows no task" (lm_eval's index skips a file it can not read): the file, and where its YAML breaks;
    under --include_path or given to --tasks as a path."""
    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "choice.yaml").write_text(BROKEN_YAML)
    named = ["ltcx_tiny_choice", "--include_path", str(tasks)] if given == "include_path" else [
        str(tasks / "choice.yaml")]
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")), "--tasks", *named],
                          capsys)
    assert_mentions(line, f"task YAML file '{tasks / 'choice.yaml'}'", "malformed", "line 3, column 6", "fix it")


def test_lm_eval_unknown_task_beside_a_malformed_yaml_is_unknown_and_says_what_was_skipped(tmp_path, capsys,
                                                                                           no_default_tasks):
    tasks = write_tasks(tmp_path / "tasks")
    (tasks / "other.yaml").write_text(BROKEN_YAML.replace("ltcx_tiny_choice", "ltcx_other"))
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_typo", "--include_path", str(tasks)], capsys)
    assert_mentions(line, "no task 'ltcx_typo'", "`lm_eval ls tasks`", "--include_path",
                    f"malformed task YAML file '{tasks / 'other.yaml'}'", "line 3, column 6")


@pytest.fixture
def not_evaluated(monkeypatch):
    """For checks made before any work: the evaluation must not start."""
    import lm_eval

    def refuse(*args, **kwargs):
        raise AssertionError("simple_evaluate ran")

    monkeypatch.setattr(lm_eval, "simple_evaluate", refuse)


@pytest.mark.parametrize("flag, value, facts", [
    ("--seed", "-1", ("--seed (-1)", f"0..{2**32 - 1}")),
    ("--seed", str(2**32), (f"--seed ({2**32})", f"0..{2**32 - 1}")),
    *[("--limit", value, (f"--limit ({value})", "whole number of examples per task (>= 1)", "fraction in (0, 1)"))
      for value in ("inf", "nan", "-1", "0", "2.5")],
])
def test_lm_eval_bad_seed_or_limit_is_one_line(tmp_path, capsys, not_evaluated, flag, value, facts):
    line = one_error_line(["lm-eval", "--ckpt_path", "x", "--tasks", "hellaswag", flag, value], capsys)
    assert_mentions(line, *facts)


def test_lm_eval_out_that_can_not_hold_results_is_refused_before_evaluating(tmp_path, capsys, not_evaluated):
    """--out is a folder (made if missing) for results.json: a file there, or a file on the way to it, is one line
    before anything is loaded, not a traceback after the whole evaluation; the file is left as it was."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    for out, facts in [(taken, (f"--out '{taken}'", "is a file")),
                       (taken / "sub", (f"--out '{taken / 'sub'}'", "can not be made", f"'{taken}' is a file"))]:
        line = one_error_line(["lm-eval", "--ckpt_path", "x", "--tasks", "hellaswag", "--out", str(out)], capsys)
        assert_mentions(line, *facts, "pass a folder for results.json")
    assert taken.read_text() == "mine"


def hub_task(folder: Path) -> Path:
    """A task whose data set is on the hub (an id no cache holds)."""
    folder.mkdir()
    (folder / "hub.yaml").write_text(
        "task: ltcx_hub_choice\ndataset_path: ltcx-tests/no-such-dataset\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\ndoc_to_choice: choices\n"
    )
    return folder


def test_lm_eval_hub_task_offline_fails_at_once(tmp_path, capsys, no_default_tasks, no_backoff):
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_hub_choice", "--include_path", str(hub_task(tmp_path / "tasks"))], capsys)
    assert_mentions(line, "cannot load lm_eval task(s) ltcx_hub_choice", "offline", "HF_HUB_OFFLINE",
                    "Hugging Face hub is reachable", "--include_path")


def test_lm_eval_unreachable_hub_is_found_by_one_short_probe(tmp_path, capsys, monkeypatch, no_default_tasks,
                                                              no_backoff):
    """No offline flag, but no hub: one connection attempt (to a closed local port), then datasets reads its cache
    alone (no retries with back-off: the no_backoff fixture) and the line comes."""
    import datasets.config
    import huggingface_hub.constants

    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    for module, name in [(huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_DATASETS_OFFLINE")]:
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "*")
    line = one_error_line(["lm-eval", "--ckpt_path", str(write_checkpoint(tmp_path / "gpt.ckpt")),
                           "--tasks", "ltcx_hub_choice", "--include_path", str(hub_task(tmp_path / "tasks"))], capsys)
    assert line.startswith("ltcx: error: cannot load lm_eval task(s) ltcx_hub_choice (not in datasets' cache and no "
                           "connection to 127.0.0.1:9 within 3 s")
    assert not huggingface_hub.constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE  # restored after


def test_lm_eval_without_the_package_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    line = one_error_line(["lm-eval", "--ckpt_path", "x", "--tasks", "hellaswag"], capsys)
    assert_mentions(line, "needs the lm_eval package", "pip install lm_eval==0.4.13", "pip install -e .[eval]")


def test_other_commands_do_not_import_lm_eval():
    code = ("import sys\nfrom ltcx.cli import main\n"
            "for verb in ('evaluate', 'generate', 'lm-eval'):\n"
            "    try:\n        main([verb, '--help'])\n    except SystemExit:\n        pass\n"
            "print('lm_eval' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr
