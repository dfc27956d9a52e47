"""Generation: cached sampling equals recomputation, filtering, stop token, reproducibility, errors."""

import pytest
import torch

from helpers import assert_mentions, one_error_line, write_checkpoint
from ltcx.errors import LtcxError
from ltcx.generation import filter_logits, generate, stream_tokens
from ltcx.models import catalog
from ltcx.models.gpt import GPT
from ltcx.models.inference_cache import keeping_derived

pytestmark = pytest.mark.quick  # `pytest -m quick`: the equations, a first check

# what the line on non-finite logits says: what, where, why and the fix
NOT_FINITE = ("logits are not finite", "generated token 1", "damaged or diverged", "earlier checkpoint")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32).double().eval()


def test_greedy_with_cache_equals_greedy_recomputing_everything(model):
    prompt = torch.randint(0, 64, (2, 5))
    cached = generate(model, prompt, 20, temperature=0)
    ids = prompt
    for _ in range(20):
        logits, _ = model(ids)  # no state: the whole sequence every step
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_seeded_sampling_is_reproducible(model):
    prompt = torch.randint(0, 64, (3, 4))
    runs = [generate(model, prompt, 10, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_filter_logits_top_k_top_p_vocab_limit():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    kept = ~torch.isinf(filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert (~torch.isinf(filter_logits(logits, top_p=0.4))).tolist() == [[True, False, False, False]]
    assert torch.isinf(filter_logits(logits, vocab_limit=3)[0, 3])


def test_vocab_limit_and_stop_token(model):
    prompt = torch.randint(0, 64, (4, 3))
    out = generate(model, prompt, 25, temperature=2.0, vocab_limit=50, generator=torch.Generator().manual_seed(0))
    assert out[:, 3:].max() < 50
    stop = int(out[0, 4])  # a token row 0 produces at its second step
    out = generate(model, prompt, 25, temperature=2.0, vocab_limit=50, stop_token=stop,
                   generator=torch.Generator().manual_seed(0))
    first = (out[0, 3:] == stop).nonzero()[0].item()
    assert (out[0, 3 + first :] == stop).all()  # a stopped row keeps the stop token


def test_prompt_longer_than_context_is_a_clear_error(model):
    with pytest.raises(LtcxError) as error:
        next(stream_tokens(model, torch.zeros(1, 30, dtype=torch.long), 5))
    assert_mentions(str(error.value), "prompt (30 tokens)", "max_new_tokens (5)", "35 tokens", "context of 32",
                    "shorten the prompt", "lower max_new_tokens")
    with pytest.raises(LtcxError) as error:
        next(stream_tokens(model, torch.zeros(1, 0, dtype=torch.long), 5))
    assert_mentions(str(error.value), "prompt is empty", "at least one token")


def test_generate_texts_batches_prompts_of_any_length(model):
    """Prompts of different token lengths come back in order, each as if generated alone."""
    from ltcx.generation import generate_texts
    from ltcx.tokenizers import ByteTokenizer

    tokenizer = ByteTokenizer()
    small = GPT(block_size=32, vocab_size=320, n_layer=1, n_head=2, n_embd=16).double().eval()
    prompts = ["ab", "xyz", "cd", "q"]
    together = generate_texts(small, tokenizer, prompts, 6, temperature=0, stop_at_eot=False)
    alone = [generate_texts(small, tokenizer, [p], 6, temperature=0, stop_at_eot=False)[0] for p in prompts]
    assert together == alone and [t[: len(p)] for t, p in zip(together, prompts)] == prompts


@pytest.mark.parametrize("temperature", [1.0, 0])
def test_non_finite_logits_raise_one_line(model, temperature):
    prompt = torch.randint(0, 64, (2, 3))
    generate(model, prompt, 3, temperature=temperature)  # healthy weights sample
    with torch.no_grad():
        for weights in model.parameters():
            weights.fill_(float("nan"))
    with pytest.raises(LtcxError) as info:
        generate(model, prompt, 3, temperature=temperature)
    assert_mentions(str(info.value), *NOT_FINITE)
    assert "\n" not in str(info.value)


def test_non_finite_logits_name_the_token(model):
    calls = []

    def diverge_on_third_call(module, inputs, output):  # fed the prompt, token 1, token 2: token 3 has NaN logits
        calls.append(1)
        return (output[0] * float("nan"), output[1]) if len(calls) == 3 else output

    model.register_forward_hook(diverge_on_third_call)
    with pytest.raises(LtcxError) as error:
        generate(model, torch.randint(0, 64, (1, 3)), 5, temperature=1.0)
    assert_mentions(str(error.value), "not finite", "generated token 3")


@pytest.mark.parametrize("temperature", ["0.8", "0"])
def test_generate_cli_with_non_finite_weights_is_one_line(tmp_path, capsys, temperature):
    path = write_checkpoint(tmp_path / "nan.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    for weights in checkpoint["state_dict"].values():
        weights.fill_(float("nan"))
    torch.save(checkpoint, path)
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "5",
                           "--temperature", temperature], capsys)
    assert_mentions(line, "non-finite", "backbone.wte.weight", "earlier checkpoint")  # refused as it loads


def test_a_temperature_too_small_for_float32_samples_greedily(model):
    """logits / 1e-40 overflows float32 (softmax would be NaN and multinomial raise): sampling's limit as the
    temperature goes to 0 is the argmax, with top_k and top_p too; a row whose logits are small enough to scale
    is still sampled."""
    prompt = torch.randint(0, 64, (2, 5))
    greedy = generate(model, prompt, 12, temperature=0)
    for filters in ({}, {"top_k": 5}, {"top_p": 0.9}):
        tiny = generate(model, prompt, 12, temperature=1e-40, generator=torch.Generator().manual_seed(0), **filters)
        assert torch.equal(tiny, greedy), filters
    from ltcx.generation import sample_next

    logits = torch.stack([torch.randn(64) * 3, torch.zeros(64)])  # the second row: 0 / 1e-40 = 0, uniform
    tokens = torch.stack([sample_next(logits, 1e-40, generator=torch.Generator().manual_seed(s)) for s in range(20)])
    assert (tokens[:, 0] == logits[0].argmax()).all() and len(set(tokens[:, 1].tolist())) > 1


def test_generate_cli_with_a_temperature_too_small_for_float32_is_greedy(tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    flags = ("--prompt", "The cat", "--max_new_tokens", "12", "--no_stop_at_eot")
    assert cli_output(checkpoint, capsys, *flags, "--temperature", "1e-40") == cli_output(
        checkpoint, capsys, *flags, "--temperature", "0")


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_generate_cli_seed_outside_64_bits_is_one_line(tmp_path, capsys, seed):
    line = one_error_line(["generate", "--ckpt_path", str(tmp_path / "none.ckpt"), "--seed", seed], capsys)
    assert_mentions(line, f"--seed ({seed})", f"0..{2**64 - 1}")


# -- LanguageModel.generate: the same loop from Python -------------------------------------------------------------


def cli_output(checkpoint, capsys, *flags: str) -> tuple[str, str]:
    """(stdout, stderr) of ``ltcx generate --ckpt_path checkpoint *flags``."""
    from ltcx.cli import main

    capsys.readouterr()
    main(["generate", "--ckpt_path", str(checkpoint), *flags])
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_model_generate_from_ids_equals_the_cli_under_a_seed(tmp_path, capsys):
    """The CLI's defaults (temperature 0.8, top_k 50, stop at end-of-text, the tokenizer's ids only) and its loop:
    ids in, ids out, the same tokens as `ltcx generate --seed`; a model loaded in train mode is left in it."""
    from ltcx.lm import LanguageModel
    from ltcx.tokenizers import get_tokenizer

    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    model = LanguageModel.load_from_checkpoint(checkpoint)
    tokenizer = get_tokenizer("bytes")
    for seed in range(3):
        out, _ = cli_output(checkpoint, capsys, "--prompt", "The cat", "--max_new_tokens", "24", "--seed", str(seed))
        prompt = torch.tensor([tokenizer.encode("The cat")])
        ids = model.generate(prompt, 24, generator=torch.Generator().manual_seed(seed))
        assert ids.dtype == torch.long and ids.shape[0] == 1 and 7 < ids.shape[1] <= 7 + 24
        assert torch.equal(ids[:, :7], prompt) and model.training
        new = ids[0, 7:].tolist()
        new = new[: new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new
        assert out == tokenizer.decode(tokenizer.encode("The cat") + new) + "\n"


def test_model_generate_text_in_text_out(tmp_path, capsys):
    """A str gives a str, a list a list (each prompt followed by its completion), with the tokenizer the checkpoint
    or export names; greedy, each equals the CLI's output."""
    from ltcx.lm import LanguageModel
    from ltcx.persist import export_model

    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    exported = LanguageModel.from_pretrained(export_model(checkpoint, tmp_path / "export", model_class=LanguageModel))
    for model in (LanguageModel.load_from_checkpoint(checkpoint), exported):
        one = model.generate("The cat", 16, temperature=0)
        both = model.generate(["The cat", "A dog ran"], 16, temperature=0)
        assert isinstance(one, str) and isinstance(both, list) and both[0] == one
        assert both[1] == model.generate("A dog ran", 16, temperature=0)
        for prompt, text in zip(["The cat", "A dog ran"], both):
            assert text.startswith(prompt) and len(text) > len(prompt)
            out, _ = cli_output(checkpoint, capsys, "--prompt", prompt, "--max_new_tokens", "16", "--temperature", "0")
            assert out == text + "\n"


def test_model_generate_needs_a_tokenizer_for_text_and_never_a_folder_a_file_names(tmp_path):
    from ltcx.lm import LanguageModel

    torch.manual_seed(0)
    fresh = LanguageModel(GPT(block_size=32, vocab_size=320, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(LtcxError) as error:
        fresh.generate("ab", 4)
    assert_mentions(str(error.value), "needs a tokenizer", "pass tokenizer='gpt2'")
    assert fresh.generate("ab", 4, tokenizer="bytes", temperature=0).startswith("ab")
    with pytest.raises(LtcxError) as error:
        fresh.generate("ab", 4, tokenizer="gpt2")
    assert_mentions(str(error.value), "tokenizer 'gpt2' (50257 ids)", "vocabulary of 320",
                    "the tokenizer it was trained with")
    with pytest.raises(LtcxError) as error:
        fresh.generate(torch.tensor([1, 2, 3]), 4)
    assert_mentions(str(error.value), "LongTensor [B, T]", "torch.int64", "shape [3]", "use ids[None]")
    folder = tmp_path / "tok"
    folder.mkdir()
    model = LanguageModel.load_from_checkpoint(write_checkpoint(tmp_path / "m.ckpt", tokenizer=str(folder)))
    with pytest.raises(LtcxError) as error:
        model.generate("ab", 4)
    assert_mentions(str(error.value), repr(str(folder)), "a path on this machine", "tokenizer=FOLDER")


def test_model_generate_greedy_equals_argmax_of_the_full_forward_each_step(model):
    """Greedy generate() with the cached state equals recomputing every position each step (float64)."""
    from ltcx.lm import LanguageModel

    lm = LanguageModel(model).double()
    prompt = torch.randint(0, 64, (3, 4))
    cached = lm.generate(prompt, 20, temperature=0)
    ids = prompt
    for _ in range(20):
        logits, _ = lm(ids)  # the whole sequence, no state
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_a_generation_keeps_derived_weights_only_while_it_runs():
    """``stream_tokens`` keeps derived weights (here GTA's D = J + B) for its steps and drops them when it ends:
    run out, stopped early by its caller (the generator closed), or nested in an outer scope (dropped with the
    outer one)."""
    torch.manual_seed(0)
    model = catalog.build_tiny("gta", vocab_size=32).eval()
    prompt = torch.randint(0, 32, (1, 3))

    def kept() -> list[str]:
        return [key for module in model.modules() for key in module.__dict__ if key.startswith("_derived_")]

    steps = stream_tokens(model, prompt, 5, temperature=0.0)
    next(steps)
    assert kept()  # during the generation
    steps.close()
    assert not kept()
    generate(model, prompt, 3, temperature=0.0)
    assert not kept()
    with torch.no_grad(), keeping_derived(model):
        generate(model, prompt, 3, temperature=0.0)
        assert kept()  # the outer scope still open
    assert not kept()
    with pytest.raises(RuntimeError), torch.no_grad(), keeping_derived(model):
        model(prompt)
        raise RuntimeError
    assert not kept()


def test_generate_cli_batches_prompts_of_different_lengths(tmp_path, capsys):
    """Several --prompt of different lengths run as one padded batch: each labelled sample is the prompt's own
    greedy continuation (the CLI on that prompt alone), with the end-of-text notice where a sample stops there."""
    checkpoint = write_checkpoint(tmp_path / "model.ckpt")
    prompts = ["The cat", "A", "Once upon a time"]
    flags = ["--max_new_tokens", "12", "--temperature", "0"]
    out, err = cli_output(checkpoint, capsys, *[arg for p in prompts for arg in ("--prompt", p)], *flags)
    expected, notices = "", []
    for prompt in prompts:
        alone, alone_err = cli_output(checkpoint, capsys, "--prompt", prompt, *flags)
        expected += f'--- prompt "{prompt}"\n' + alone
        notices += [line.replace("ltcx: ", f'ltcx: prompt "{prompt}": ') for line in alone_err.splitlines()
                    if "stopped at end-of-text" in line]
    assert out == expected
    assert [line for line in err.splitlines() if "stopped at end-of-text" in line] == notices


def test_a_backbone_without_a_padding_mask_generates_prompts_by_length():
    """``generate_texts`` batches a backbone whose ``forward_hidden`` takes no mask by token length, with the texts of
    the same weights through the mask."""
    from ltcx.generation import generate_texts, takes_mask
    from ltcx.tokenizers import ByteTokenizer

    class NoMask(GPT):
        def forward_hidden(self, idx, state=None, with_state=True):
            return super().forward_hidden(idx, state, with_state)

    torch.manual_seed(0)
    masked = GPT(block_size=32, vocab_size=320, n_layer=1, n_head=2, n_embd=16).double().eval()
    unmasked = NoMask(**masked.config_dict()).double().eval()
    unmasked.load_state_dict(masked.state_dict())
    assert takes_mask(masked) and not takes_mask(unmasked)
    prompts = ["ab", "xyz", "q", "cd"]
    texts = [generate_texts(m, ByteTokenizer(), prompts, 5, temperature=0, stop_at_eot=False)
             for m in (unmasked, masked)]
    assert texts[0] == texts[1] and all(t.startswith(p) for t, p in zip(texts[0], prompts))
