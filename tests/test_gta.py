"""GTA attention and GTA GPT: the fast form against a per-head reference written out from the equation,
the degenerate setting against GQA, shared maps, the compact cache, sizes and init (the backbone contract:
tests/test_contract.py; why ltcx's form differs from the seed's: docs/models.md)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import run_in_pieces
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.gpt import GPT, GQAAttention
from ltcx.models.gta import GTAGPT, GTAAttention, GTAConfig
from ltcx.models.inference_cache import keeping_derived

pytestmark = pytest.mark.quick  # `pytest -m quick`: the equations, a first check

F64 = torch.float64
REFERENCE = dict(
    block_size=512, vocab_size=50304, n_layer=6, n_head=6, n_embd=384, bias=False,
    n_query_group=2, n_key_head=1, key_dim=64, n_latent_head=1, latent_dim=96, gate=True,
)
# n_embd 32, 4 output heads of 8; G = 2 maps of 2 heads; group width 16 = 2 x latent_dim 8
SMALL = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=32, bias=True,
             n_query_group=2, n_key_head=1, key_dim=6, n_latent_head=1, latent_dim=8)
VARIANTS = {
    "small": {},
    "lcm": dict(n_query_group=4, n_key_head=2, n_latent_head=1, latent_dim=4),  # keys and latents differ in heads
    "rope": dict(rope=True, bias=False),
    "no_gate": dict(gate=False, n_latent_head=2, latent_dim=16),  # expand factor 1
}


def small_model(dtype=F64, seed=0, **overrides) -> GTAGPT:
    torch.manual_seed(seed)
    model = GTAGPT(**{**SMALL, **overrides}).to(dtype).eval()
    with torch.no_grad():  # B ~ N(0, 0.02) barely moves D from [I I]; make the decoder's offset matter
        for block in model.blocks:
            block.attn.decoder.normal_(0.0, 0.5)
    return model


def tokens(batch, length, vocab=SMALL["vocab_size"], seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def rope_reference(x: torch.Tensor, position: int, base: float = 10000.0) -> torch.Tensor:
    """One vector [D] at one position, pairs (i, i + D/2) as complex numbers times e^{i pos theta_i}."""
    half = x.shape[-1] // 2
    theta = torch.tensor([base ** (-2 * i / x.shape[-1]) for i in range(half)], dtype=F64)
    z = torch.complex(x[:half], x[half:]) * torch.polar(torch.ones(half, dtype=F64), position * theta)
    return torch.cat([z.real, z.imag])


def naive_gta(attn: GTAAttention, config: GTAConfig, x: torch.Tensor) -> torch.Tensor:
    """GTA written out per output head h and query i: group g = h // S reads key head g // (G / n_k) and
    latent head g // (G / n_c); every key token's latent is decoded by head h's slice of D_g *before* the
    weighted sum; the gate of token i; c_proj. x [B, T, C] at positions 0..T-1 -> y [B, T, C]."""
    batch, length, width = x.shape
    groups, heads, head_dim = config.n_query_group, config.n_head, config.head_dim
    per_group = heads // groups
    d_k, d_l = config.key_dim, config.latent_dim
    proj = F.linear(x, attn.in_proj.weight, attn.in_proj.bias)
    q_all, k_all, c_all, *gate = proj.split(attn.widths, dim=-1)
    expand = torch.eye(d_l, dtype=F64).repeat(1, width // groups // d_l)
    out = torch.zeros(batch, length, width, dtype=F64)
    for b in range(batch):
        for h in range(heads):
            g = h // per_group
            kappa, nu = g // (groups // config.n_key_head), g // (groups // config.n_latent_head)
            decoder = (expand + attn.decoder[g])[:, (h % per_group) * head_dim : (h % per_group + 1) * head_dim]
            for i in range(length):
                q = q_all[b, i, g * d_k : (g + 1) * d_k]
                q = rope_reference(q, i) if config.rope else q
                scores, values = [], []
                for j in range(i + 1):
                    k = k_all[b, j, kappa * d_k : (kappa + 1) * d_k]
                    k = rope_reference(k, j) if config.rope else k
                    scores.append(q @ k / math.sqrt(d_k))
                    values.append(c_all[b, j, nu * d_l : (nu + 1) * d_l] @ decoder)  # decoded per key token
                head = (torch.softmax(torch.stack(scores), 0)[:, None] * torch.stack(values)).sum(0)
                if gate:
                    head = head * torch.sigmoid(gate[0][b, i, h * head_dim : (h + 1) * head_dim])
                out[b, i, h * head_dim : (h + 1) * head_dim] = head
    return attn.c_proj(out)


# ------------------------------------------------------------------------------------------------
# The fast form equals the equation


def layer_call(model, attn, x, cache=None):
    """The attention layer called as the model calls it: with the model's rotary tables of the new positions."""
    start = 0 if cache is None else cache.length
    return attn(x, cache, None, model.rope_tables(start, x.shape[1], None, x.device))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("split", [None, 4, 8])  # 8: the last token alone, the decode step's path
def test_fast_form_equals_naive_per_head_reference(variant, split):
    model = small_model(**VARIANTS[variant])
    attn, config = model.blocks[0].attn, model.config
    x = torch.randn(2, 9, SMALL["n_embd"], dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if split is None:
            y, cache = layer_call(model, attn, x)
        else:  # the second piece attends over the cached keys and latents
            first, cache = layer_call(model, attn, x[:, :split])
            second, cache = layer_call(model, attn, x[:, split:], cache)
            y = torch.cat([first, second], dim=1)
        reference = naive_gta(attn, config, x)
    torch.testing.assert_close(y, reference, rtol=0, atol=1e-12)
    assert cache.k.shape == (2, config.n_key_head, 9, config.key_dim)
    assert cache.latent.shape == (2, config.n_latent_head, 9, config.latent_dim)


def degenerate_pair(seed=0):
    """A GPT and the GTA GPT of the degenerate setting (G = n_head, n_k = n_c = n_kv_head, d_k = d_l =
    head_dim, B = 0, no gate) carrying the same weights."""
    shape = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=32, bias=True)
    torch.manual_seed(seed)
    gpt = GPT(**shape, n_kv_head=2).to(F64).eval()
    gta = GTAGPT(**shape, n_query_group=4, n_key_head=2, n_latent_head=2, key_dim=8, latent_dim=8, gate=False)
    gta = gta.to(F64).eval()
    weights = gpt.state_dict()
    for i in range(shape["n_layer"]):
        prefix = f"blocks.{i}.attn."
        for kind in ("weight", "bias"):
            weights[f"{prefix}in_proj.{kind}"] = torch.cat(
                [weights.pop(f"{prefix}q_proj.{kind}"), weights.pop(f"{prefix}kv_proj.{kind}")]
            )
        weights[f"{prefix}decoder"] = torch.zeros(4, 8, 8, dtype=F64)
    gta.load_state_dict(weights)
    return gpt, gta


def test_degenerate_setting_equals_gqa_attention():
    gpt, gta = degenerate_pair()
    x = torch.randn(3, 11, 32, dtype=F64, generator=torch.Generator().manual_seed(2))
    gqa_attn, gta_attn = gpt.blocks[0].attn, gta.blocks[0].attn
    assert isinstance(gqa_attn, GQAAttention) and isinstance(gta_attn, GTAAttention)
    with torch.no_grad():
        expected, gqa_cache = gqa_attn(x)
        got, gta_cache = gta_attn(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(gta_cache.latent, gqa_cache.v, rtol=0, atol=1e-14)
    idx = tokens(3, 20)
    with torch.no_grad():
        full_gpt, state_gpt = gpt(idx[:, :12])
        full_gta, state_gta = gta(idx[:, :12])
        step_gpt, _ = gpt(idx[:, 12:], state_gpt)
        step_gta, _ = gta(idx[:, 12:], state_gta)
    torch.testing.assert_close(full_gta, full_gpt, rtol=0, atol=1e-13)
    torch.testing.assert_close(step_gta, step_gpt, rtol=0, atol=1e-13)


def test_heads_of_a_group_share_one_attention_map():
    """Recover each output head's attention map from the fast form alone: with no gate and c_proj = I the
    output of head h is A_h V_h, where V_h = c D_g[:, slice(h)] has full row rank, so A_h = y_h V_h^+."""
    model = small_model(gate=False, bias=False)
    attn, config = model.blocks[0].attn, model.config
    length, head_dim, per_group = 6, config.head_dim, config.n_head // config.n_query_group
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(config.n_embd, dtype=F64))
        x = torch.randn(1, length, config.n_embd, dtype=F64, generator=torch.Generator().manual_seed(3))
        y, cache = attn(x)
        decoder = attn.identity + attn.decoder
        maps = []
        for h in range(config.n_head):
            g, s = divmod(h, per_group)
            values = cache.latent[0, 0] @ decoder[g][:, s * head_dim : (s + 1) * head_dim]  # [T, d_h]
            maps.append(y[0, :, h * head_dim : (h + 1) * head_dim] @ torch.linalg.pinv(values))
    maps = torch.stack(maps)  # [H, T, T]
    torch.testing.assert_close(maps.sum(-1), torch.ones(config.n_head, length, dtype=F64), rtol=0, atol=1e-9)
    assert maps.triu(1).abs().max() < 1e-9  # causal
    for g in range(config.n_query_group):
        group = maps[g * per_group : (g + 1) * per_group]
        torch.testing.assert_close(group, group[:1].expand_as(group), rtol=0, atol=1e-9)
    assert (maps[0] - maps[per_group]).abs().max() > 1e-3  # different groups, different maps


# ------------------------------------------------------------------------------------------------
# The cache and the contract


def gta_and_gpt_for_bf16():
    """A GTA GPT and a GPT of one shape (float32 weights) whose bf16 errors are compared."""
    shape = dict(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=128, bias=False)
    torch.manual_seed(0)
    return GTAGPT(**shape, n_query_group=2, key_dim=32, latent_dim=32).eval(), GPT(**shape, n_kv_head=2).eval()


@pytest.mark.parametrize("mode", ["bf16 weights", "autocast"])
def test_bf16_decode_step_error_is_at_the_gqa_level(mode):
    """One-token decode steps in bf16 (softmax in float32) against the float64 forward: no worse than the GPT's."""
    gta, gpt = gta_and_gpt_for_bf16()
    idx = tokens(2, 48, vocab=97)
    errors = []
    for net in (gta, gpt):
        with torch.no_grad():
            exact = copy.deepcopy(net).to(F64)(idx)[0][:, 32:]
            low = copy.deepcopy(net).to(torch.bfloat16) if mode == "bf16 weights" else net
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                _, state = low(idx[:, :32])
                steps = []
                for t in range(32, 48):
                    logits, state = low(idx[:, t : t + 1], state)
                    steps.append(logits.to(F64))
        approx = torch.cat(steps, dim=1)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    assert errors[0] < 2 * errors[1] and errors[0] < 5e-2, errors


def test_reference_cache_bytes_per_token_are_three_eighths_below_the_gpt():
    model = GTAGPT(**{**REFERENCE, "block_size": 16, "vocab_size": 64})
    baseline = GPT(block_size=16, vocab_size=64, n_layer=6, n_head=6, n_kv_head=2, n_embd=384, bias=False)
    idx = torch.zeros(2, 5, dtype=torch.long)
    sizes = []
    with torch.no_grad():
        for net in (model, baseline):
            _, state = net(idx)
            sizes.append(sum(t.numel() * t.element_size() for cache in state for t in vars(cache).values()
                             if t is not None) / 10)  # no padding mask: none kept
    assert sizes == [6 * (64 + 96) * 4, 6 * 2 * 2 * 64 * 4] == [3840, 6144]
    assert sizes[0] / sizes[1] == 1 - 0.375


@pytest.mark.parametrize("variant", ["small", "lcm"])
def test_cache_holds_keys_and_latents_only_extended_into_new_tensors(variant):
    """GTA's compact cache: the group keys [B, n_key_head, T, key_dim] and the latent [B, n_latent_head, T,
    latent_dim], never per-head values; a step extends the caller's cache into new tensors, never in place.
    (Pieces == whole, causality, reorder_cache: tests/test_contract.py, for every catalogued variant.)"""
    model = small_model(**VARIANTS[variant])
    idx = tokens(3, 20)
    with torch.no_grad():
        _, state = run_in_pieces(model, idx[:, :8], [7, 1])
        kept = copy.deepcopy(state)
        _, new_state = model(idx[:, 8:], state)
    config = model.config
    for cache in new_state:
        assert cache.k.shape == (3, config.n_key_head, 20, config.key_dim)
        assert cache.latent.shape == (3, config.n_latent_head, 20, config.latent_dim)
    for old, before in zip(state, kept):
        assert torch.equal(old.k, before.k) and torch.equal(old.latent, before.latent) and old.length == 8


def test_decoder_and_gate_get_a_gradient_in_every_entry():
    """The decoder offset B_g and the gate's rows W_g learn from a loss, entry by entry (every parameter has a
    gradient: tests/test_contract.py)."""
    model = small_model(dtype=torch.float32, dropout=0.1).train()
    logits, _ = model(tokens(2, 16))
    logits.square().mean().backward()
    attn = model.blocks[0].attn
    gate_rows = attn.in_proj.weight.grad[-SMALL["n_embd"] :]  # W_g is the last block of rows
    assert gate_rows.abs().min(dim=1).values.gt(0).all()
    assert attn.decoder.grad.abs().gt(0).all()


def test_a_generation_keeps_the_decoder_matrix_until_the_decoder_changes():
    """Within a generation (``keeping_derived``) a decode step does not rebuild D = J + B; an in-place write or a
    load rebuilds it, so the cached steps stay equal to the full forward. Outside one, and under autograd, D is
    built every call; leaving the scope drops the kept D."""
    model = small_model()
    attn = model.blocks[0].attn
    idx = tokens(2, 12)
    with torch.no_grad():
        assert attn.decoder_matrix() is not attn.decoder_matrix()  # no generation: nothing kept
        with keeping_derived(model):
            kept = attn.decoder_matrix()
            assert attn.decoder_matrix() is kept
            attn.decoder.mul_(1.5)  # in place, seen through the version counter
            assert attn.decoder_matrix() is not kept
            torch.testing.assert_close(attn.decoder_matrix(), attn.identity + attn.decoder, rtol=0, atol=0)
        assert not [key for key in attn.__dict__ if key.startswith("_derived_")]
    model.load_state_dict(small_model(seed=3).state_dict())
    with torch.no_grad(), keeping_derived(model):
        full, _ = model(idx)
        steps, _ = run_in_pieces(model, idx, [1] * 12)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)
    with keeping_derived(model):
        assert attn.decoder_matrix().requires_grad and attn.decoder_matrix() is not attn.decoder_matrix()
    assert not any("derived" in name for name in model.state_dict())


def test_a_write_that_keeps_the_version_counter_is_seen_after_the_generation():
    """FSDP2's gathers and the fused AdamW write new weights into the same tensors and keep their version counters
    (as the write below does): within a generation, which no such write interrupts, the kept D does not see it; the
    next call after the generation builds D from the new weights."""
    model = small_model()
    attn = model.blocks[0].attn
    with torch.no_grad():
        with keeping_derived(model):
            kept = attn.decoder_matrix()
            with torch.autograd._unsafe_preserve_version_counter(attn.decoder):
                attn.decoder.mul_(1.5)
            assert attn.decoder_matrix() is kept  # within the scope the write went unseen
        torch.testing.assert_close(attn.decoder_matrix(), attn.identity + attn.decoder, rtol=0, atol=0)


def test_context_overflow_is_a_clear_error():
    model = small_model(block_size=8)
    _, state = model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(LtcxError, match="exceeds the model's context block_size=8"):
        model(torch.zeros(1, 1, dtype=torch.long), state)


def test_bf16_autocast_error_is_at_the_gqa_level():
    gta, gpt = gta_and_gpt_for_bf16()
    idx = tokens(2, 64, vocab=97)
    errors = []
    for net in (gta, gpt):
        with torch.no_grad():
            exact = copy.deepcopy(net).to(F64)(idx)[0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                approx = net(idx)[0].to(F64)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    assert errors[0] < 2 * errors[1] and errors[0] < 2e-2, errors


# ------------------------------------------------------------------------------------------------
# Sizes and config


@pytest.mark.parametrize(
    "overrides,attention,total",
    [
        ({}, 442_368, 29_053_824),  # the reference: G = 2, d_l = 96 (expand 2), gate
        (dict(latent_dim=64), 417_792, 28_906_368),  # expand 3
        (dict(n_query_group=3, latent_dim=64), 442_368, 29_053_824),  # 2 heads per map
        (dict(gate=False), 294_912, 28_169_088),
        (dict(mlp_hidden=1472), 442_368, 28_758_912),  # the spec's equal-parameter row: exactly the GPT's count
    ],
)
def test_exact_parameter_counts(overrides, attention, total):
    model = GTAGPT(**{**REFERENCE, **overrides})
    assert sum(p.numel() for p in model.blocks[0].attn.parameters()) == attention
    assert model.parameter_count() == total
    assert model.parameter_count(exclude_position_embeddings=False) == total + 512 * 384
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("init_std", [0.02, 0.125])
def test_init_matches_the_gpt(init_std):
    torch.manual_seed(0)
    model = GTAGPT(block_size=64, vocab_size=512, n_layer=8, n_head=4, n_embd=256, n_query_group=2,
                   init_std=init_std)
    attn = model.blocks[0].attn
    assert attn.c_proj.weight.std().item() == pytest.approx(init_std / math.sqrt(16), rel=0.05)  # residual
    assert attn.in_proj.weight.std().item() == pytest.approx(init_std, rel=0.05)
    assert attn.decoder.std().item() == pytest.approx(init_std, rel=0.1)  # D_g starts near [I I]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(n_query_group=4), r"n_head \(6\) must be divisible by n_query_group \(4\)"),
        (dict(n_key_head=2, n_query_group=3, latent_dim=64),
         r"n_query_group \(3\) must be divisible by n_key_head \(2\)"),
        (dict(n_latent_head=4), r"n_query_group \(2\) must be divisible by n_latent_head \(4\)"),
        (dict(latent_dim=100), r"latent_dim \(100\) must divide n_embd / n_query_group \(192\)"),
        (dict(key_dim=0), r"key_dim \(0\) must be a positive integer"),
        (dict(n_query_group=0), r"n_query_group \(0\) must be a positive integer"),
        (dict(key_dim=63, rope=True), r"key_dim \(63\) must be even with rope"),
        (dict(gate="yes"), r"gate \('yes'\) must be true or false"),
        (dict(n_head=5), r"n_embd \(384\) must be divisible by n_head \(5\)"),
    ],
)
def test_config_errors_name_the_field_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GTAGPT(**{**REFERENCE, **overrides})


def test_config_defaults_and_round_trip():
    model = GTAGPT(block_size=16, vocab_size=50, n_layer=1, n_head=4, n_embd=32, n_query_group=2)
    assert model.config.key_dim == 8 and model.config.latent_dim == 8  # head_dim; n_embd / (2 G)
    assert "n_kv_head" not in model.config_dict()
    again = GTAGPT(**model.config_dict())
    assert again.config == model.config
    assert GTAGPT.from_config(model.config).config == model.config
    with pytest.raises(TypeError):
        GTAGPT(n_kv_head=2)  # GTA's keys and latents have their own head counts
