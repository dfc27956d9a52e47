"""LTC attention and LTC GPT: the factorised form against the equation written out, numerics in bf16,
the cache's layout and time constants, the controller's causality, parameter figures of the seed (the backbone
contract: tests/test_contract.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import relative_error, run_in_pieces
from ltcx.errors import ConfigError, LtcxError
from ltcx.models.gpt import GPT
from ltcx.models.inference_cache import keeping_derived
from ltcx.models.ltc import LTCGPT, LTCAttention, LTCCache, LTCConfig
from ltcx.ops import ltc as ltc_ops
from ltcx.ops.naive.ltc import ltc_attention_reference

pytestmark = pytest.mark.quick  # `pytest -m quick`: the equations, a first check

F64 = torch.float64
REFERENCE = dict(block_size=512, vocab_size=50304, n_layer=6, n_head=6, n_kv_head=2, n_embd=384, bias=False)
SMALL = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True)  # head_dim 8


def small_model(dtype=F64, seed=0, **overrides) -> LTCGPT:
    torch.manual_seed(seed)
    config = {**SMALL, "num_decay_modes": 5, **overrides}
    return LTCGPT(**config).to(dtype).eval()


def random_qkv(batch, heads, groups, length, head_dim, dtype=F64, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=gen, dtype=F64) * scale
    k = torch.randn(batch, groups, length, head_dim, generator=gen, dtype=F64) * scale
    v = torch.randn(batch, groups, length, head_dim, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def orthonormal_modes(groups, head_dim, modes, seed=0):
    """A random modal matrix [G, D, M] and its QR modes U."""
    matrix = torch.randn(groups, head_dim, modes, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return matrix, torch.linalg.qr(matrix).Q


def set_all_tau(model: LTCGPT, logit: float) -> None:
    """Make every time constant input-independent: tau = tau_min / sigmoid(logit) (clamped)."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.tau_offset.fill_(logit)
            block.attn.controller.weight.zero_()
            block.attn.controller.bias.zero_()


# ------------------------------------------------------------------------------------------------
# The factorised form equals the equation


@pytest.mark.parametrize("modes", [1, 3, 8])
def test_factorised_attention_equals_explicit_metric(modes):
    batch, heads, groups, length, head_dim = 2, 6, 2, 13, 8  # 3 query heads per KV head
    q, k, v = random_qkv(batch, heads, groups, length, head_dim)
    matrix, u = orthonormal_modes(groups, head_dim, modes)
    tau = 1.0 + 6.0 * torch.rand(batch, groups, modes, generator=torch.Generator().manual_seed(1), dtype=F64)
    basis = ltc_ops.modal_basis(matrix)
    fast = ltc_ops.ltc_attention(q, k, v, basis, tau, centre=(length - 1) / 2)
    reference = ltc_attention_reference(q, k, v, u, tau)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-10)


def test_model_attention_equals_explicit_metric():
    """LTCAttention's training path (rotation folded into the projections) against the equation."""
    config = LTCConfig(**{**SMALL, "num_decay_modes": 3})
    torch.manual_seed(0)
    attn = LTCAttention(config).to(F64)
    x = torch.randn(2, 20, SMALL["n_embd"], dtype=F64)
    y, cache = attn(x)
    q, k, v = attn.project(x)
    u = torch.linalg.qr(attn.modal_matrix).Q
    ref = ltc_attention_reference(q, k, v, u, cache.tau)
    ref = attn.c_proj(ref.transpose(1, 2).reshape(2, 20, -1))
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-10)


def test_gradient_through_completed_basis_is_exact():
    """With M < D the completion of the basis is derived without gradient; the gradient is still exact."""
    batch, heads, groups, length, head_dim, modes = 1, 4, 2, 9, 6, 2
    q, k, v = random_qkv(batch, heads, groups, length, head_dim)
    matrix, _ = orthonormal_modes(groups, head_dim, modes)
    tau = torch.tensor([[[2.0, 5.0], [3.0, 9.0]]], dtype=F64)
    weights = torch.randn(batch, heads, length, head_dim, dtype=F64)
    grads = []
    for fast in (True, False):
        a = matrix.clone().requires_grad_()
        if fast:
            out = ltc_ops.ltc_attention(q, k, v, ltc_ops.modal_basis(a), tau, centre=4.0)
        else:
            out = ltc_attention_reference(q, k, v, torch.linalg.qr(a).Q, tau)
        (out * weights).sum().backward()
        grads.append(a.grad)
    assert grads[0].abs().max() > 1e-3
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-10)


def test_metric_modes_are_eigenvectors_and_zero_age_is_identity():
    groups, head_dim, modes = 2, 8, 3
    matrix, u = orthonormal_modes(groups, head_dim, modes)
    tau = torch.tensor([[[2.0, 7.0, 40.0], [1.5, 3.0, 11.0]]], dtype=F64)  # [1, G, M]
    for age in (0.0, 1.0, 5.0, 17.0):
        metric = ltc_ops.decay_metric(u, tau, age)[0]  # [G, D, D]
        lam = torch.exp(-age / tau[0])  # [G, M]
        torch.testing.assert_close(metric @ u, u * lam[:, None, :], rtol=0, atol=1e-12)
        complement = ltc_ops.modal_basis(matrix)[..., modes:]  # untouched directions
        torch.testing.assert_close(metric @ complement, complement, rtol=0, atol=1e-12)
    identity = torch.eye(head_dim, dtype=F64).expand(groups, -1, -1)
    torch.testing.assert_close(ltc_ops.decay_metric(u, tau, 0.0)[0], identity, rtol=0, atol=1e-14)


def test_infinite_time_constants_give_the_gqa_baseline():
    model = small_model(num_decay_modes=8)
    set_all_tau(model, -1e4)  # clamped: tau = tau_min * e^30, exponents below 1e-11
    baseline = GPT(**SMALL).to(F64).eval()
    shared = {name: p for name, p in model.state_dict().items() if name in baseline.state_dict()}
    assert set(shared) == set(baseline.state_dict())
    baseline.load_state_dict(shared)
    idx = torch.randint(0, SMALL["vocab_size"], (3, SMALL["block_size"]), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(idx)[0], baseline(idx)[0], rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------------------------
# bf16 numerics


def _bf16_case(modes, seed=0):
    """T = 512, head_dim 64, every tau at tau_min = 512 / 12 (exponents up to +-6), q.k / 8 of std ~2."""
    batch, heads, groups, length, head_dim = 1, 6, 2, 512, 64
    q, k, v = random_qkv(batch, heads, groups, length, head_dim, scale=1.5, seed=seed)
    matrix, u = orthonormal_modes(groups, head_dim, modes, seed=seed)
    tau = torch.full((batch, groups, modes), length / 12, dtype=F64)
    return q, k, v, matrix, u, tau, (length - 1) / 2


def _plain_bf16_error(q, k, v):
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    return relative_error(F.scaled_dot_product_attention(*bf, is_causal=True, enable_gqa=True), exact)


@pytest.mark.parametrize("modes", [64, 32])
def test_bf16_error_stays_at_plain_attention_level(modes):
    q, k, v, matrix, _, tau, c = _bf16_case(modes)
    basis = ltc_ops.modal_basis(matrix)
    exact = ltc_ops.ltc_attention(q, k, v, basis, tau, c)  # float64 (equals the reference, tested above)
    plain = _plain_bf16_error(q, k, v)
    bf_v = v.to(torch.bfloat16)
    # float32 q and k, rotated and scaled in float32, cast to bf16 once for SDPA
    from_f32 = relative_error(ltc_ops.ltc_attention(q.float(), k.float(), bf_v, basis.float(), tau.float(), c), exact)
    # bf16 q and k, as a bf16 projection under autocast hands them over
    from_bf16 = ltc_ops.ltc_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), bf_v, basis.float(), tau.float(), c)
    from_bf16 = relative_error(from_bf16, exact)
    assert from_f32 <= 1.5 * plain, (from_f32, plain)
    assert from_bf16 <= 1.5 * plain, (from_bf16, plain)


def naive_factorised_queries_keys(q, k, u, tau, c):
    """The seed's form: q' = q + sum_m (e_m - 1)(q.u_m) u_m, exact in float64 (kept here to show why not)."""
    heads, groups, length = q.shape[1], k.shape[1], q.shape[2]
    offset = torch.arange(length, dtype=F64) - c
    e_q = torch.exp(-offset[:, None] / tau[:, :, None, :])  # [B, G, T, M]
    e_k = torch.exp(offset[:, None] / tau[:, :, None, :])
    group = torch.arange(heads) // (heads // groups)
    u_h = u[group]  # [H, D, M]
    q_modal = torch.einsum("bhtd,hdm->bhtm", q, u_h)
    k_modal = torch.einsum("bgtd,gdm->bgtm", k, u)
    q_naive = q + torch.einsum("bhtm,hdm->bhtd", q_modal * (e_q[:, group] - 1), u_h)
    k_naive = k + torch.einsum("bgtm,gdm->bgtd", k_modal * (e_k - 1), u)
    return q_naive, k_naive


def test_naive_in_place_factorisation_loses_precision_in_bf16():
    """Why the rotation: adding (e - 1)(q.u) u back onto q mixes terms of size e^6 into every coordinate,
    which cancel in q'.k'; bf16 keeps 8 bits, so the small ordinary part drowns."""
    q, k, v, matrix, u, tau, c = _bf16_case(modes=32)
    exact = ltc_ops.ltc_attention(q, k, v, ltc_ops.modal_basis(matrix), tau, c)
    q_naive, k_naive = naive_factorised_queries_keys(q, k, u, tau, c)
    naive_exact = F.scaled_dot_product_attention(q_naive, k_naive, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(naive_exact, exact, rtol=0, atol=1e-10)  # right in float64 ...
    bf = [t.to(torch.bfloat16) for t in (q_naive, k_naive, v)]
    naive_bf16 = relative_error(F.scaled_dot_product_attention(*bf, is_causal=True, enable_gqa=True), exact)
    plain = _plain_bf16_error(q, k, v)
    assert naive_bf16 > 10 * plain, (naive_bf16, plain)  # ... and about 30x worse than plain in bf16


def test_model_bf16_autocast_error_matches_the_gqa_baseline():
    config = dict(block_size=128, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=256, bias=False)
    torch.manual_seed(0)
    model = LTCGPT(**config, num_decay_modes=48).eval()
    set_all_tau(model, 20.0)  # every tau at tau_min
    baseline = GPT(**config).eval()
    baseline.load_state_dict({n: p for n, p in model.state_dict().items() if n in baseline.state_dict()})
    idx = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(0))
    errors = []
    for net in (model, baseline):
        exact = copy.deepcopy(net).to(F64)(idx)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors.append(relative_error(net(idx)[0], exact))
    assert errors[0] <= 1.5 * errors[1], errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "autocast"])
def test_no_inf_or_nan_at_full_context_with_tau_at_tau_min(dtype):
    config = dict(block_size=256, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=128, bias=False)
    torch.manual_seed(0)
    model = LTCGPT(**config, num_decay_modes=32)
    set_all_tau(model, 20.0)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        logits, state = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    tau = state[0].tau
    torch.testing.assert_close(tau, torch.full_like(tau, 256 / 12), rtol=1e-5, atol=0)
    assert (255 / 2) / tau.min() < 6.0  # the largest exponent
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(state[i].k).all() for i in range(2))
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# ------------------------------------------------------------------------------------------------
# Modes, time constants, causality


def test_modal_directions_are_orthonormal():
    model = small_model(num_decay_modes=5)
    for block in model.blocks:
        basis = ltc_ops.modal_basis(block.attn.modal_matrix)  # [G, D, D]
        eye = torch.eye(basis.shape[-1], dtype=F64).expand_as(basis)
        torch.testing.assert_close(basis.transpose(-1, -2) @ basis, eye, rtol=0, atol=1e-12)
        modes = torch.linalg.qr(block.attn.modal_matrix).Q  # the first M columns are the QR modes
        torch.testing.assert_close(basis[..., :5].abs(), modes.abs(), rtol=0, atol=1e-12)


def test_time_constants_exceed_tau_min_and_depend_only_on_the_first_token():
    model = small_model(dtype=torch.float32)
    tau_min = model.config.tau_min
    assert tau_min == SMALL["block_size"] / 12
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SMALL["vocab_size"], (4, 24), generator=gen)
    with torch.no_grad():  # push the controller towards saturation on both sides
        for block in model.blocks:
            block.attn.controller.weight.mul_(300.0)
    _, state = model(idx)
    changed = idx.clone()
    changed[:, 1:] = torch.randint(0, SMALL["vocab_size"], (4, 23), generator=gen)
    _, state_changed = model(changed)
    for cache, cache_changed in zip(state, state_changed):
        assert (cache.tau > tau_min).all()
        assert torch.equal(cache.tau, cache_changed.tau)
    first_changed = idx.clone()
    first_changed[:, 0] = (idx[:, 0] + 1) % SMALL["vocab_size"]
    assert not torch.equal(model(first_changed)[1][0].tau, state[0].tau)


def test_time_constants_at_extreme_logits_stay_finite_and_above_tau_min():
    tau = ltc_ops.time_constants(torch.tensor([-1e6, -50.0, 0.0, 30.0, 1e6]), tau_min=10.0)
    assert torch.isfinite(tau).all() and (tau > 10.0).all()
    assert tau[2] == 20.0


# ------------------------------------------------------------------------------------------------
# Cache


def test_cache_keeps_the_first_tokens_time_constants_and_stops_at_block_size():
    """The cache carries tau from the first token (it never changes as decoding proceeds) up to block_size, then
    refuses (pieces == whole: tests/test_contract.py)."""
    model = small_model(num_decay_modes=6)
    idx = torch.randint(0, SMALL["vocab_size"], (3, SMALL["block_size"]), generator=torch.Generator().manual_seed(0))
    _, full_state = model(idx)
    _, state = run_in_pieces(model, idx, [5, 1, 7, 3, 16])
    assert isinstance(state[0], LTCCache) and state[0].length == 32
    torch.testing.assert_close(state[0].tau, full_state[0].tau, rtol=0, atol=0)
    with pytest.raises(LtcxError, match="block_size=32"):
        model(idx[:, :1], state)


def test_cache_layout_is_compact_and_batch_first():
    model = small_model(num_decay_modes=5)
    _, state = model(torch.zeros(3, 7, dtype=torch.long))
    cache = state[0]
    assert cache.k.shape == cache.v.shape == (3, 2, 7, 8)  # [B, n_kv_head, T, head_dim]
    assert cache.tau.shape == (3, 2, 5)
    assert not hasattr(cache, "basis")  # the basis is folded into the projections, not carried per sequence


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modes", [8, 5])  # all coordinates, and fewer modes than head_dim
def test_decode_step_scales_equal_scale_modes_bit_for_bit(dtype, modes):
    """The one-token scaling (both scales from one exponent) is the same float work as scale_modes."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 1, 8, generator=generator).to(dtype)  # 4 query heads over 2 KV heads
    k = torch.randn(3, 2, 1, 8, generator=generator).to(dtype)
    tau = (torch.rand(3, 2, modes, generator=generator) * 40 + 2).to(ltc_ops.compute_dtype(dtype))
    for position in (0, 17, 63):
        q_step, k_step = ltc_ops.scale_modes_step(q, k, tau, position, centre=31.5)
        expected_q = ltc_ops.scale_modes(q, tau, position, 31.5, is_query=True)
        expected_k = ltc_ops.scale_modes(k, tau, position, 31.5, is_query=False)
        assert q_step.dtype == k_step.dtype == dtype
        torch.testing.assert_close(q_step, expected_q, rtol=0, atol=0)
        torch.testing.assert_close(k_step, expected_k, rtol=0, atol=0)


def test_a_generation_reuses_the_folded_projections_until_a_parameter_changes():
    """Within a generation (``keeping_derived``) decoding folds the basis into the q/k weights once; an in-place
    write or new weights refold them, so cached decoding keeps equal to the full forward. Outside one they are
    folded every call."""
    model = small_model(num_decay_modes=5)
    attn = model.blocks[0].attn
    idx = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert attn.rotated_projections() is not attn.rotated_projections()
    with torch.no_grad(), keeping_derived(model):
        model(idx[:, :4])
        folded = attn.rotated_projections()
        assert attn.rotated_projections() is folded  # reused, not recomputed
        attn.modal_matrix.add_(0.5)  # in place, as an optimizer step writes
        attn.q_proj.weight.mul_(1.5)
        assert attn.rotated_projections() is not folded
        full, _ = model(idx)
        pieces, _ = run_in_pieces(model, idx, [5] + [1] * 7)
    torch.testing.assert_close(pieces, full, rtol=0, atol=1e-10)
    model.load_state_dict(small_model(seed=3, num_decay_modes=5).state_dict())
    with torch.no_grad(), keeping_derived(model):
        full, _ = model(idx)
        pieces, _ = run_in_pieces(model, idx, [5] + [1] * 7)
    torch.testing.assert_close(pieces, full, rtol=0, atol=1e-10)
    assert not any("derived" in name or "folded" in name for name in model.state_dict())


def test_attention_refuses_positions_past_block_size():
    config = LTCConfig(**{**SMALL, "num_decay_modes": 2})
    attn = LTCAttention(config)
    with pytest.raises(LtcxError, match="block_size=32"):
        attn(torch.randn(1, 33, SMALL["n_embd"]))
    model = small_model()
    with pytest.raises(LtcxError, match="exceeds"):
        model(torch.zeros(1, 33, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# Gradients, parameters, config


def test_parameter_count_of_the_reference_config():
    ltc = LTCGPT(**REFERENCE, num_decay_modes=64, controller_rank=0, controller_hidden_size=0)
    gpt = GPT(**REFERENCE)
    assert ltc.parameter_count() == 29_104_512
    assert gpt.parameter_count() == 28_758_912
    assert ltc.parameter_count() - gpt.parameter_count() == 6 * (2 * 64 * 64 + 384 * 128 + 128 + 128)
    assert round(100 * (ltc.parameter_count() / gpt.parameter_count() - 1), 2) == 1.20
    assert ltc.config.tau_min == 512 / 12
    no_decay = ltc.no_weight_decay_param_names()
    assert no_decay == {f"blocks.{i}.attn.{n}" for i in range(6) for n in ("modal_matrix", "tau_offset")}


def test_readme_examples_in_spirit(tmp_path):
    """Build from a config, loss and backward, checkpoint round trip, cached greedy = uncached greedy."""
    config = LTCConfig(**{**SMALL, "num_decay_modes": 8, "dropout": 0.1})
    model = LTCGPT.from_config(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    logits, _ = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert logits.shape == (2, 16, config.vocab_size) and math.isfinite(loss.item())

    path = tmp_path / "ltc-model.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config_dict()}, path)
    payload = torch.load(path, weights_only=False)
    restored = LTCGPT(**payload["model_config"])
    restored.load_state_dict(payload["model"])
    assert restored.config == model.config
    model.eval(), restored.eval()
    torch.testing.assert_close(restored(tokens)[0], model(tokens)[0], rtol=0, atol=0)

    restored = restored.to(F64)
    prompt = tokens[:, :5]
    assert torch.equal(_greedy(restored, prompt, 20, use_cache=True), _greedy(restored, prompt, 20, use_cache=False))


def _greedy(model, prompt, steps, use_cache):
    idx = prompt
    with torch.no_grad():
        if use_cache:
            logits, state = model(prompt)
            for _ in range(steps):
                next_token = logits[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, next_token], dim=1)
                logits, state = model(next_token, state)
        else:
            for _ in range(steps):
                next_token = model(idx)[0][:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, next_token], dim=1)
    return idx


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_decay_modes=65), r"num_decay_modes \(65\) must be between 1 and head_dim \(64\)"),
        (dict(num_decay_modes=0), r"num_decay_modes \(0\) must be between 1 and head_dim \(64\)"),
        (dict(controller_rank=4), r"controller_rank \(4\) must be 0 when num_decay_modes \(64\) is more than 1"),
        (dict(controller_hidden_size=-1), r"controller_hidden_size \(-1\) must be a non-negative integer"),
        (
            dict(num_decay_modes=1, controller_rank=2, controller_hidden_size=8),
            r"controller_rank \(2\) and controller_hidden_size \(8\) can not both be positive",
        ),
        (dict(tau_min=0.0), r"tau_min \(0.0\) must be a positive number"),
        (dict(tau_min=3.0), r"tau_min \(3.0\) must be at least \(block_size - 1\) / 80"),
        (dict(n_kv_head=4), r"n_head \(6\) must be divisible by n_kv_head \(4\)"),
    ],
)
def test_config_errors_name_the_field_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LTCGPT(**{**REFERENCE, **overrides})
    with pytest.raises(ValueError):
        LTCConfig(**{**REFERENCE, **overrides})


def test_config_defaults_and_round_trip():
    model = LTCGPT(block_size=96, vocab_size=50, n_layer=1, n_head=2, n_embd=32, num_decay_modes=16, tau_min=None)
    assert model.config.tau_min == 8.0 and model.config.n_kv_head == 2
    again = LTCGPT(**model.config_dict())
    assert again.config == model.config
    explicit = LTCGPT(block_size=96, vocab_size=50, n_layer=1, n_head=2, n_embd=32, num_decay_modes=16, tau_min=5)
    assert explicit.config.tau_min == 5.0
