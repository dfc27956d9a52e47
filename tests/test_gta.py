"""GTA attention and GTA GPT: the fast form against a per-head reference written out from the equation,
the degenerate setting against GQA, shared maps, the cache, sizes, and the seed's defects."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import run_in_pieces
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.derived import DERIVED_NOT_KEPT
from ltcx.models.gpt import GPT, GQAAttention
from ltcx.models.gta import GTAGPT, GTAAttention, GTAConfig

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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("split", [None, 4, 8])  # 8: the last token alone, the decode step's path
def test_fast_form_equals_naive_per_head_reference(variant, split):
    model = small_model(**VARIANTS[variant])
    attn, config = model.blocks[0].attn, model.config
    x = torch.randn(2, 9, SMALL["n_embd"], dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if split is None:
            y, cache = attn(x)
        else:  # the second piece attends over the cached keys and latents
            first, cache = attn(x[:, :split])
            second, cache = attn(x[:, split:], cache)
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


@pytest.mark.parametrize("variant", ["small", "lcm", "rope"])
@pytest.mark.parametrize("pieces", [[1] * 20, [7, 1, 5, 7], [20]])
def test_pieces_with_state_equal_the_full_forward(variant, pieces):
    model = small_model(**VARIANTS[variant])
    idx = tokens(3, sum(pieces))
    with torch.no_grad():
        full, _ = model(idx)
        logits, state = run_in_pieces(model, idx, pieces)
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-10)
    config = model.config
    for cache in state:  # keys and latents only, append-only
        assert cache.k.shape == (3, config.n_key_head, 20, config.key_dim)
        assert cache.latent.shape == (3, config.n_latent_head, 20, config.latent_dim)


def test_cached_decode_float32_tolerance():
    model = small_model(dtype=torch.float32)
    idx = tokens(2, 16)
    with torch.no_grad():
        full, _ = model(idx)
        _, state = model(idx[:, :9])
        piece, _ = model(idx[:, 9:], state)
        steps = []
        for t in range(9, 16):  # one token at a time: the decode step's own path
            logits, state = model(idx[:, t : t + 1], state)
            steps.append(logits)
    torch.testing.assert_close(piece, full[:, 9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 9:], rtol=1e-5, atol=1e-5)


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
            sizes.append(sum(t.numel() * t.element_size() for cache in state for t in vars(cache).values()) / 10)
    assert sizes == [6 * (64 + 96) * 4, 6 * 2 * 2 * 64 * 4] == [3840, 6144]
    assert sizes[0] / sizes[1] == 1 - 0.375


def test_causality_future_tokens_do_not_change_past_logits():
    model = small_model(**VARIANTS["lcm"])
    idx = tokens(2, 20)
    changed = idx.clone()
    changed[:, 12:] = tokens(2, 8, seed=1)
    with torch.no_grad():
        logits, changed_logits = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(logits[:, :12], changed_logits[:, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(logits[:, 12:], changed_logits[:, 12:])


def test_batch_rows_are_independent_and_inputs_are_not_mutated():
    model = small_model()
    idx = tokens(3, 12)
    with torch.no_grad():
        _, state = model(idx[:, :8])
        kept = copy.deepcopy(state)
        batched, new_state = model(idx[:, 8:], state)
        for b in range(3):
            one = model.reorder_cache(state, torch.tensor([b]))
            alone, _ = model(idx[b : b + 1, 8:], one)
            torch.testing.assert_close(batched[b : b + 1], alone, rtol=0, atol=1e-12)
    for old, before in zip(state, kept):  # the caller's cache is extended into new tensors, never in place
        assert torch.equal(old.k, before.k) and torch.equal(old.latent, before.latent)
    assert new_state[0].length == 12 and state[0].length == 8


def test_inference_keeps_the_decoder_matrix_until_the_decoder_changes():
    """A decode step does not rebuild D = J + B; an in-place update (an optimizer step) or a load rebuilds it,
    so the cached steps stay equal to the full forward. Under autograd D is part of the graph every call."""
    model = small_model()
    attn = model.blocks[0].attn
    idx = tokens(2, 12)
    with torch.no_grad():
        kept = attn.decoder_matrix()
        assert attn.decoder_matrix() is kept
        attn.decoder.mul_(1.5)  # in place, as an optimizer step writes
        assert attn.decoder_matrix() is not kept
        torch.testing.assert_close(attn.decoder_matrix(), attn.identity + attn.decoder, rtol=0, atol=0)
    model.load_state_dict(small_model(seed=3).state_dict())
    with torch.no_grad():
        full, _ = model(idx)
        steps, _ = run_in_pieces(model, idx, [1] * 12)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)
    assert attn.decoder_matrix().requires_grad and attn.decoder_matrix() is not attn.decoder_matrix()
    assert not any("derived" in name for name in model.state_dict())


def test_a_module_sharded_by_fsdp2_rebuilds_the_decoder_matrix_every_call():
    """FSDP2 gathers a step's new weights into the same tensors and keeps their version counters (as the write below
    does), so a kept D would go stale unseen; in a module ``shard_backbone`` marked, D is rebuilt every call."""
    model = small_model()
    attn = model.blocks[0].attn
    with torch.no_grad():
        kept = attn.decoder_matrix()
        with torch.autograd._unsafe_preserve_version_counter(attn.decoder):
            attn.decoder.mul_(1.5)
        assert attn.decoder_matrix() is kept  # unmarked: the write went unseen
        attn.__dict__[DERIVED_NOT_KEPT] = True
        torch.testing.assert_close(attn.decoder_matrix(), attn.identity + attn.decoder, rtol=0, atol=0)


def test_reorder_cache_equals_running_the_reordered_batch():
    model = small_model()
    idx = tokens(3, 10)
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = model(idx[:, :8])
        logits, _ = model(idx[index, 8:], model.reorder_cache(state, index))
        expected, _ = model(idx[index])
    torch.testing.assert_close(logits, expected[:, 8:], rtol=0, atol=1e-10)


def test_greedy_generation_with_cache_equals_without():
    model = small_model()
    prompt = tokens(2, 5)
    with torch.no_grad():
        with_cache, (logits, state) = prompt, model(prompt)
        without = prompt
        for _ in range(10):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            with_cache = torch.cat([with_cache, next_token], dim=1)
            logits, state = model(next_token, state)
            without = torch.cat([without, model(without)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(with_cache, without)


def test_context_overflow_is_a_clear_error():
    model = small_model(block_size=8)
    _, state = model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(LtcxError, match="exceeds the model's context block_size=8"):
        model(torch.zeros(1, 1, dtype=torch.long), state)


def test_gradients_reach_every_parameter_including_decoder_and_gate():
    model = small_model(dtype=torch.float32, dropout=0.1).train()
    logits, _ = model(tokens(2, 16))
    logits.square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    attn = model.blocks[0].attn
    gate_rows = attn.in_proj.weight.grad[-SMALL["n_embd"] :]  # W_g is the last block of rows
    assert gate_rows.abs().min(dim=1).values.gt(0).all()
    assert attn.decoder.grad.abs().gt(0).all()


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


# ------------------------------------------------------------------------------------------------
# The seed's form (a test-only transcription of seeds/002_*, kept to show why ltcx differs)


def seed_gta(x, w_q, w_k, w_dv, w_uv, w_out, groups, heads=4, mode="encoder"):
    """The seed's GTAAttention: H-head q and k averaged over each group's heads, values decoded with a SiLU
    per key token before attention, causal mask only in mode="decoder" (its default is "encoder")."""
    batch, length, width = x.shape
    head_dim = width // heads
    split = lambda t: t.view(batch, length, heads, head_dim).transpose(1, 2)  # noqa: E731
    q, k = split(x @ w_q.T), split(x @ w_k.T)
    v = split(F.silu((x @ w_dv.T) @ w_uv.T))
    q_bar = q.view(batch, groups, heads // groups, length, head_dim).mean(2)
    k_bar = k.view(batch, groups, heads // groups, length, head_dim).mean(2)
    scores = q_bar @ k_bar.transpose(-1, -2) / math.sqrt(head_dim)
    if mode == "decoder":
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, -1).repeat_interleave(heads // groups, dim=1)  # [B, H, T, T]
    return (weights @ v).transpose(1, 2).reshape(batch, length, width) @ w_out.T


def seed_weights(width=16, heads=4, rank=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(width, width), (width, width), (rank, width), (width, rank), (width, width)]
    return [torch.randn(*s, dtype=F64, generator=gen) / math.sqrt(s[1]) for s in shapes]


def test_seed_encoder_mode_leaks_the_future():
    weights = seed_weights()
    x = torch.randn(1, 10, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, 6:] = torch.randn(1, 4, 16, dtype=F64, generator=torch.Generator().manual_seed(2))
    leak = (seed_gta(x, *weights, groups=2) - seed_gta(changed, *weights, groups=2))[:, :6].abs().max()
    assert leak > 1e-2  # its default mode: the first tokens' outputs see tokens 6..9
    causal = seed_gta(x, *weights, groups=2, mode="decoder") - seed_gta(changed, *weights, groups=2, mode="decoder")
    assert causal[:, :6].abs().max() < 1e-12


def test_seed_silu_before_attention_is_not_decoding_after_attention():
    """The seed's values SiLU(c_j W_uv) are decoded per key token, so the latent c cannot be attended and
    cached as it is; GTA's linear decoder commutes with the weighted sum (its gate is of the query token)."""
    gen = torch.Generator().manual_seed(3)
    weights = torch.softmax(torch.randn(8, 8, dtype=F64, generator=gen) * 2, -1)
    latent, w_uv = torch.randn(8, 6, dtype=F64, generator=gen), torch.randn(6, 12, dtype=F64, generator=gen)
    seed_values = weights @ F.silu(latent @ w_uv)  # decode each key token, then attend
    after = F.silu((weights @ latent) @ w_uv)  # attend the latent, then decode
    assert (seed_values - after).abs().max() > 0.1
    torch.testing.assert_close(weights @ (latent @ w_uv), (weights @ latent) @ w_uv, rtol=0, atol=1e-12)


def test_seed_averaged_projections_are_one_linear_map():
    """The mean of a group's S query (key) projections is one linear map: (S - 1) / S of W_q and W_k add
    parameters but no expressiveness. One G-head projection with the averaged rows gives the same output."""
    w_q, w_k, w_dv, w_uv, w_out = seed_weights()
    x = torch.randn(2, 7, 16, dtype=F64, generator=torch.Generator().manual_seed(4))
    heads, groups, head_dim = 4, 2, 4
    mean_rows = lambda w: w.view(groups, heads // groups, head_dim, 16).mean(1)  # noqa: E731
    # the same G maps from 2 x 8 averaged rows, repeated to the H-head layout the seed expects
    w_q_small = mean_rows(w_q).repeat_interleave(heads // groups, dim=0).reshape(16, 16)
    w_k_small = mean_rows(w_k).repeat_interleave(heads // groups, dim=0).reshape(16, 16)
    torch.testing.assert_close(
        seed_gta(x, w_q_small, w_k_small, w_dv, w_uv, w_out, groups=2, mode="decoder"),
        seed_gta(x, w_q, w_k, w_dv, w_uv, w_out, groups=2, mode="decoder"),
        rtol=0, atol=1e-12,
    )
