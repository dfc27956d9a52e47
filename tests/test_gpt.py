"""GPT with grouped-query attention: the attention equation, the KV cache's layout, its size and init, its config's
rules (the backbone contract: tests/test_contract.py)."""

import math

import pytest
import torch

from helpers import run_in_pieces
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.gpt import GPT, GPTConfig
from ltcx.ops.attention import causal_gqa_attention
from ltcx.ops.naive.attention import naive_attention

pytestmark = pytest.mark.quick  # `pytest -m quick`: the equations, a first check

REFERENCE = dict(block_size=512, vocab_size=50304, n_layer=6, n_head=6, n_kv_head=2, n_embd=384, dropout=0.0,
                 bias=False)


def tiny(**overrides):
    config = dict(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, dropout=0.0, bias=True)
    config.update(overrides)
    return GPT(**config)


@pytest.mark.parametrize("n_head,n_kv_head,past", [(4, 2, 0), (4, 1, 3), (2, 2, 0), (6, 3, 5)])
def test_gqa_attention_equals_naive_softmax(n_head, n_kv_head, past):
    torch.manual_seed(0)
    new = 6
    q = torch.randn(2, n_head, new, 8, dtype=torch.float64)
    k = torch.randn(2, n_kv_head, past + new, 8, dtype=torch.float64)
    v = torch.randn(2, n_kv_head, past + new, 8, dtype=torch.float64)
    torch.testing.assert_close(causal_gqa_attention(q, k, v), naive_attention(q, k, v), atol=1e-10, rtol=0)


def test_kv_cache_is_compact_and_from_config_rebuilds():
    """The cache holds the KV heads only, [B, n_kv_head, T, head_dim] (pieces == whole: tests/test_contract.py)."""
    model = tiny().double().eval()
    _, state = run_in_pieces(model, torch.randint(0, 97, (3, 20)), [7, 1, 12])
    assert state[0].k.shape == (3, 2, 20, 8)
    assert GPT.from_config(GPTConfig(**model.config_dict())).config == model.config


def test_context_overflow_is_a_clear_error():
    model = tiny(block_size=8).eval()
    _, state = model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(LtcxError, match="exceeds the model's context block_size=8"):
        model(torch.zeros(1, 1, dtype=torch.long), state)


def test_reference_parameter_count():
    model = GPT(**REFERENCE)
    assert model.parameter_count() == 28_758_912
    assert model.parameter_count(exclude_position_embeddings=False) == 28_758_912 + 512 * 384
    assert model.lm_head.weight is model.wte.weight
    # mlp_hidden sets the MLP's width (default 4 n_embd): 2 C F weights a layer, plus F biases when bias is on
    assert GPT(**REFERENCE, mlp_hidden=1472).parameter_count() == 28_758_912 - 6 * 2 * 384 * 64
    assert GPT(**REFERENCE, mlp_hidden=1536).config_dict()["mlp_hidden"] == 1536
    assert GPT(**REFERENCE).config_dict()["mlp_hidden"] is None  # kept unset: files from before it have none


@pytest.mark.parametrize("init_std", [None, 0.02, 0.125])
def test_init_draws_matrices_at_init_std_and_scales_residual_projections(init_std):
    torch.manual_seed(0)
    std = init_std or 0.02  # the default is GPT-2's
    model = GPT(block_size=64, vocab_size=512, n_layer=8, n_head=4, n_embd=256,
                **({} if init_std is None else dict(init_std=init_std)))
    assert model.blocks[0].attn.c_proj.weight.std().item() == pytest.approx(std / math.sqrt(16), rel=0.03)
    assert model.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(std / math.sqrt(16), rel=0.03)
    for weight in (model.blocks[0].mlp.c_fc.weight, model.blocks[0].attn.kv_proj.weight, model.wte.weight,
                   model.wpe.weight):
        assert weight.std().item() == pytest.approx(std, rel=0.03)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(n_head=6, n_kv_head=4, n_embd=48), r"n_head \(6\) must be divisible by n_kv_head \(4\)"),
        (dict(n_head=5, n_embd=32, n_kv_head=5), r"n_embd \(32\) must be divisible by n_head \(5\)"),
        (dict(n_layer=0), r"n_layer \(0\) must be a positive integer"),
        (dict(dropout=1.5), r"dropout \(1.5\) must be in \[0, 1\)"),
        (dict(mlp_hidden=0), r"mlp_hidden \(0\) must be a positive integer or null \(4 n_embd\)"),
        (dict(init_std=0.0), r"init_std \(0.0\) must be a positive number"),
    ],
)
def test_config_errors_name_field_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**overrides)
    assert issubclass(ConfigError, ValueError)
