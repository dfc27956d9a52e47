"""Every catalogue architecture in transformers (``ltcx/hf.py``, ``ltcx export --format hf``): the exported folder
loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` offline and without remote code, its logits are the backbone's
(float64), greedy ``generate`` is ``ltcx generate``'s, sampling and beam search run on the backbone's state, padded
prompts batch in ``generate`` and ``pipeline(batch_size=4)`` through the padding mask; a folder
asking for code of its own is refused and runs none; lm_eval's own ``hf`` model scores as ``ltcx lm-eval`` does."""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import ltcx.hf  # noqa: F401 - registers the ltcx architectures
from helpers import assert_mentions, fit_args, one_error_line, write_model_checkpoint
from ltcx.cli import main
from ltcx.errors import LtcxError
from ltcx.generation import generate as ltcx_generate
from ltcx.models.catalog import CATALOG

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, TOKENIZER_VOCAB, EOT = 320, 257, 256  # the bytes tokenizer's 257 ids, padded to 320
EXPORTED = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md"}


def exported(tmp_path, name: str, seed: int = 0):
    """(backbone, checkpoint, folder): a tiny ``name`` backbone's checkpoint exported with ``--format hf``."""
    torch.manual_seed(seed)
    backbone = CATALOG[name].build_tiny(VOCAB).eval()
    checkpoint = write_model_checkpoint(tmp_path / f"{name}.ckpt", backbone)
    folder = tmp_path / f"{name}-hf"
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(folder), "--format", "hf"])
    return backbone, checkpoint, folder


@pytest.mark.parametrize("name", sorted(CATALOG))
@torch.no_grad()
def test_every_architecture_loads_generates_and_round_trips_in_transformers(tmp_path, capsys, name):
    backbone, checkpoint, folder = exported(tmp_path, name)
    assert {p.name for p in folder.iterdir()} == EXPORTED
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and f"- {name}\n" in card and "license: " in card
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LtcxForCausalLM" and model.dtype == torch.float32
    assert tokenizer.encode("héllo <|endoftext|>") == list("héllo <|endoftext|>".encode())  # the bytes tokenizer

    # logits: the backbone's, in float64, whole and in pieces through the cache; the loss from labels
    ids = torch.randint(0, TOKENIZER_VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = backbone.double()(ids)[0]
    model64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    out = model64(ids, labels=ids)
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=1e-12)
    expected_loss = torch.nn.functional.cross_entropy(reference[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert math.isclose(out.loss.item(), expected_loss.item(), rel_tol=1e-12)
    first = model64(ids[:, :6], use_cache=True)
    second = model64(ids[:, 6:], cache=first.cache, use_cache=True)
    assert second.cache.get_seq_length() == 11
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), reference, rtol=0, atol=1e-12)
    backbone.float()

    # greedy generate: ltcx generate's tokens (its sampling loop) and text (the command)
    prompt = tokenizer("The cat", return_tensors="pt").input_ids
    scoped = []  # each step runs inside keeping_derived (derived weights built once), and nothing is kept after
    hook = model.backbone.register_forward_pre_hook(lambda m, _: scoped.append("_ltcx_keeping_derived" in m.__dict__))
    hf_ids = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    hook.remove()
    assert scoped and all(scoped)
    assert not [key for m in model.modules() for key in m.__dict__ if key.startswith(("_derived_", "_ltcx_keeping"))]
    ours = ltcx_generate(backbone, prompt, 8, temperature=0, stop_token=EOT, vocab_limit=TOKENIZER_VOCAB)
    assert hf_ids == ours[0, prompt.shape[1]:].tolist()
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(checkpoint), "--prompt", "The cat", "--max_new_tokens", "8",
          "--temperature", "0"])
    stopped = hf_ids[:hf_ids.index(EOT)] if EOT in hf_ids else hf_ids
    assert capsys.readouterr().out == "The cat" + tokenizer.decode(stopped) + "\n"

    # sampling, batched (equal-length prompts, several samples each); the padding ids never come out
    prompts = torch.tensor([list(b"Once"), list(b"Onto")])
    sampled = model.generate(prompts, do_sample=True, top_k=20, max_new_tokens=5, num_return_sequences=2)
    assert sampled.shape[0] == 4 and sampled.shape[1] <= 9 and int(sampled.max()) < TOKENIZER_VOCAB

    # beam search reorders the state: the best beam's score is its tokens' log-probabilities from a full forward
    beams = model64.generate(prompts[:1], generation_config=GenerationConfig(
        num_beams=3, max_new_tokens=4, length_penalty=0.0, pad_token_id=EOT, output_scores=True,
        return_dict_in_generate=True, suppress_tokens=list(range(TOKENIZER_VOCAB, VOCAB))))
    sequence = beams.sequences[:1]
    log_probs = torch.log_softmax(model64(sequence).logits[0, 3:-1], -1)
    assert math.isclose(beams.sequences_scores[0].item(),
                        log_probs.gather(1, sequence[0, 4:, None]).sum().item(), rel_tol=1e-6)  # scores: float32

    # save_pretrained then from_pretrained: the same model
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def _until_eot(ids: list[int]) -> list[int]:
    return ids[:ids.index(EOT) + 1] if EOT in ids else ids


@pytest.mark.parametrize("name", sorted(CATALOG))
@torch.no_grad()
def test_padded_prompts_batch_in_generate_and_the_pipeline(tmp_path, name):
    """Prompts of different lengths, left-padded by the exported tokenizer as it is: ``generate`` gives each its own
    greedy tokens (ltcx's sampling loop on that prompt alone), and ``pipeline(..., batch_size=4)`` each its own text
    (the pipeline one prompt at a time); right padding leaves the real tokens' logits as they are (float64)."""
    from transformers import pipeline

    backbone, _, folder = exported(tmp_path, name)
    backbone.double()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.pad_token, tokenizer.padding_side) == (tokenizer.eos_token, "left")  # as exported
    prompts = ["The cat", "A", "Once upon a time", "xy", "Hello there"]
    batch = tokenizer(prompts[:4], padding=True, return_tensors="pt")
    assert not batch.attention_mask.all()
    out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    for row, text in enumerate(prompts[:4]):
        ids = torch.tensor([list(text.encode())])
        ours = ltcx_generate(backbone, ids, 6, temperature=0, stop_token=EOT, vocab_limit=TOKENIZER_VOCAB)
        assert _until_eot(out[row, batch.input_ids.shape[1]:].tolist()) == _until_eot(ours[0, ids.shape[1]:].tolist())

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, batch_size=4)
    batched = pipe(prompts, max_new_tokens=6, do_sample=False)
    alone = [pipe(text, max_new_tokens=6, do_sample=False) for text in prompts]
    assert [answer[0]["generated_text"] for answer in batched] == [answer[0]["generated_text"] for answer in alone]

    right = tokenizer(prompts[:4], padding=True, padding_side="right", return_tensors="pt")
    logits = model(**right).logits
    for row, text in enumerate(prompts[:4]):
        real = right.attention_mask[row].bool()
        torch.testing.assert_close(logits[row, real], model(torch.tensor([list(text.encode())])).logits[0],
                                   rtol=1e-10, atol=1e-10)


def test_an_attention_mask_of_another_shape_is_one_line(tmp_path):
    _, _, folder = exported(tmp_path, "gpt")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(LtcxError) as error:
        model(torch.tensor([[65, 66, 67]]), attention_mask=torch.ones(1, 5))
    assert_mentions(str(error.value), "attention_mask of shape [1, 5]", "input_ids [1, 3]")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("change", ["unknown architecture", "class path", "auto_map"])
def test_config_naming_code_is_refused_and_runs_none(tmp_path, change):
    _, _, folder = exported(tmp_path, "gpt")
    marker = tmp_path / "pwned"
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\n"
        "from transformers import PreTrainedModel, PretrainedConfig\n\n\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'ltcx'\n\n\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    if change == "unknown architecture":
        config["architecture"] = "mamba"
        facts = ("config.json", "architecture 'mamba'", "not one of ltcx's", "gpt, gta, ltc, ")
    elif change == "class path":
        config["architecture"] = "evil.EvilModel"
        facts = ("config.json", "architecture 'evil.EvilModel'", "not one of ltcx's")
    else:
        config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
        facts = ("(auto_map)", "ltcx never runs", "remove the key or re-export the model")
    (folder / "config.json").write_text(json.dumps(config))
    for load in (AutoModelForCausalLM.from_pretrained, ltcx.hf.LtcxForCausalLM.from_pretrained):
        with pytest.raises(LtcxError) as error:
            load(folder)
        assert_mentions(str(error.value), *facts)
        assert "\n" not in str(error.value)
    assert not marker.exists()


def test_export_hf_errors_are_one_line(tmp_path, capsys):
    backbone, checkpoint, folder = exported(tmp_path, "gpt")
    line = one_error_line(["export", "--ckpt_path", str(checkpoint), "--out", str(folder), "--format", "hf"], capsys)
    assert_mentions(line, f"'{folder}'", "not an empty folder", "pass --out a new folder")


def test_lm_eval_hf_model_scores_as_ltcx_lm_eval(tmp_path):
    """lm_eval's own ``hf`` model on the exported folder and ``ltcx lm-eval``'s adapter on the checkpoint give the
    same per-sample log-likelihoods on a local multiple-choice task (float64 both)."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate", reason="lm_eval's hf model imports accelerate, which is not in requirements.txt")
    from lm_eval.tasks import TaskManager

    from ltcx.eval.harness import LtcxLM
    from ltcx.tokenizers import get_tokenizer
    from test_harness import write_tasks

    backbone, _, folder = exported(tmp_path, "gpt")
    tasks = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)

    def per_sample(model) -> list:
        results = lm_eval.simple_evaluate(model=model, tasks=["ltcx_tiny_choice"], task_manager=tasks,
                                          log_samples=True, bootstrap_iters=0, batch_size=2)
        # resps: per choice [(log-likelihood, is_greedy)]
        return [[(float(r[0][0]), bool(r[0][1])) for r in sample["resps"]]
                for sample in results["samples"]["ltcx_tiny_choice"]]

    from lm_eval.models.huggingface import HFLM

    theirs = per_sample(HFLM(pretrained=str(folder), dtype="float64", batch_size=2, device="cpu"))
    ours = per_sample(LtcxLM(backbone.double(), get_tokenizer("bytes"), batch_size=2))
    assert len(ours) == 5 and all(len(a) == len(b) for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        assert [greedy for _, greedy in a] == [greedy for _, greedy in b]
        assert [ll for ll, _ in a] == pytest.approx([ll for ll, _ in b], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("given", ["file", "run folder"])
def test_the_model_card_reports_the_runs_last_validation(tmp_path, fit_env, capsys, given):
    """A fit records its latest validation in each checkpoint (ltcx entry); the card's metadata and text give its
    loss in nats per token and its bits per byte, whether --ckpt_path is the file or the run's folder (the README's
    `ltcx export --ckpt_path checkpoints/gpt ...`)."""
    main(fit_args(fit_env, "--trainer.max_steps", "2"))
    checkpoint = tmp_path / "checkpoints/gpt/version_0/last.ckpt"
    validation = torch.load(checkpoint, weights_only=True)["ltcx"]["validation"]
    assert validation["step"] == 2 and {"val/loss", "val/bpb"} <= set(validation)
    path = checkpoint if given == "file" else tmp_path / "checkpoints/gpt"
    main(["export", "--ckpt_path", str(path), "--out", str(tmp_path / "card"), "--format", "hf"])
    card = (tmp_path / "card/README.md").read_text()
    assert_mentions(card, f"{validation['val/loss']:.5f} nats per token", "bits per byte",
                    f"{validation['val/bpb']:.5f}", "type: bits_per_byte")
    assert "not recorded" not in card


def test_a_plain_generate_with_max_new_tokens_draws_no_warning(tmp_path):
    """The exported generation_config.json sets no max_length, so transformers does not warn that both it and
    max_new_tokens are set (a model's context is config.json's max_position_embeddings)."""
    _, _, folder = exported(tmp_path, "gpt")
    assert "max_length" not in json.loads((folder / "generation_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            model.generate(torch.tensor([list(b"The")]), max_new_tokens=3, do_sample=False)
    finally:
        transformers_logger.removeHandler(handler)
    assert not [r.getMessage() for r in records] and not [str(w.message) for w in warned]
