"""Generation: cached sampling equals recomputation, filtering, stop token, reproducibility, errors."""

import pytest
import torch

from helpers import one_error_line, write_checkpoint
from ltcx.errors import LtcxError
from ltcx.generation import filter_logits, generate, stream_tokens
from ltcx.models.gpt import GPT


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
    with pytest.raises(LtcxError, match=r"prompt \(30 tokens\) plus max_new_tokens \(5\) is 35 tokens, "
                       r"more than the model's context of 32"):
        next(stream_tokens(model, torch.zeros(1, 30, dtype=torch.long), 5))
    with pytest.raises(LtcxError, match="prompt is empty"):
        next(stream_tokens(model, torch.zeros(1, 0, dtype=torch.long), 5))


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
    assert str(info.value) == ("the model's logits are not finite at generated token 1: its weights are damaged or "
                               "diverged; sample from an earlier checkpoint")


def test_non_finite_logits_name_the_token(model):
    calls = []

    def diverge_on_third_call(module, inputs, output):  # fed the prompt, token 1, token 2: token 3 has NaN logits
        calls.append(1)
        return (output[0] * float("nan"), output[1]) if len(calls) == 3 else output

    model.register_forward_hook(diverge_on_third_call)
    with pytest.raises(LtcxError, match="not finite at generated token 3: "):
        generate(model, torch.randint(0, 64, (1, 3)), 5, temperature=1.0)


@pytest.mark.parametrize("temperature", ["0.8", "0"])
def test_generate_cli_with_non_finite_weights_is_one_line(tmp_path, capsys, temperature):
    path = write_checkpoint(tmp_path / "nan.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    for weights in checkpoint["state_dict"].values():
        weights.fill_(float("nan"))
    torch.save(checkpoint, path)
    line = one_error_line(["generate", "--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "5",
                           "--temperature", temperature], capsys)
    assert line == ("ltcx: error: the model's logits are not finite at generated token 1: its weights are damaged or "
                    "diverged; sample from an earlier checkpoint")
