"""Titans backbone: no hidden state (a forward changes no parameter or buffer), MAC's causal segment attention
against an explicit per-query loop, exact parameter counts, bf16, the state's constant size, config rules, and the
CLI's divergence stop. The backbone contract (pieces and one-token decode equal the whole, causality, batch
independence, reordering, gradients, the CLI round trip) is checked for every variant and memory chunk size in the
catalogue by tests/test_contract.py.

The memory's own fast form is proven against autograd token loops in tests/test_titans_memory.py, the
attention ops in tests/test_titans_attention.py.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from helpers import relative_error, write_corpus
from ltcx.errors import ConfigError
from ltcx.models.state import map_state_tensors
from ltcx.models.titans import MACBlock, MemoryCache, Titans, TitansConfig, stacked_linear
from ltcx.ops.naive.attention import reference_rope
from ltcx.ops.titans import memory_apply

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["mag", "mac", "mal", "lmm"]
VOCAB = 64


def tiny(variant: str = "mag", **overrides) -> Titans:
    """Small enough for float64 loops; T = 29 crosses 3 segments (8) and 7 memory chunks (4)."""
    args = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, variant=variant, n_head=4, n_kv_head=2, mlp_hidden=48,
                window=6, segment=8, n_persistent=3, mem_heads=4, mem_head_dim=8, mem_hidden=16, memory_chunk_size=4)
    return Titans(**{**args, **overrides})


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_changes_no_parameter_or_buffer(variant):
    """titans-torch writes the memory into its module's weights on every forward; ours never does."""
    torch.manual_seed(2)
    model = tiny(variant).double()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    idx = torch.randint(0, VOCAB, (2, 29))
    model.train()
    model(idx)
    model.eval()
    first, _ = model(idx)
    second, _ = model(idx)
    assert torch.equal(first, second)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def reference_mac_block(block: MACBlock, x: torch.Tensor) -> torch.Tensor:
    """MAC block from position 0, one query at a time, with the visible keys listed explicitly: the persistent
    slots (scored with the unrotated query), then h_j and x_j for every j <= i of i's segment; h_j read with the
    memory weights of the segment start; the attention output written into the memory one token at a time."""
    config = block.config
    batch, length, _ = x.shape
    heads, kv_heads, dim = config.n_head, config.n_kv_head, config.head_dim
    attn, positions = block.attn, list(range(length))

    def heads_of(t: torch.Tensor, width: int) -> torch.Tensor:  # [B, T, n width] -> [B, n, T, width]
        return t.unflatten(-1, (-1, width)).transpose(1, 2)

    def keys_values(u: torch.Tensor, at: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # RoPE(u W_K), u W_V
        k, v = heads_of(u @ attn.kv_proj.weight.T, dim).split(kv_heads, dim=1)
        return reference_rope(k, at, config.rope_base), v

    normed = block.ln_1(x)
    q = heads_of(normed @ attn.q_proj.weight.T, dim)
    q_rot = reference_rope(q, positions, config.rope_base)
    k_x, v_x = keys_values(normed, positions)
    # the x-stream memory queries: W_Q^m, the short causal conv written out tap by tap, SiLU, l2 normalisation
    memory, width, taps = block.memory, config.memory_width, config.conv_kernel
    projected = normed @ memory.qkv.weight[:width].T
    conv = memory.conv_bias[:width] + sum(
        F.pad(projected, (0, 0, taps - 1 - j, 0))[:, :length] * memory.conv_weight[:width, 0, j] for j in range(taps))
    q_memory = F.normalize(F.silu(heads_of(conv, config.mem_head_dim)), dim=-1)
    segment_weights, memory = block.memory.initial_weights(batch, x.dtype), None
    k_h, v_h, outputs = [], [], []
    for i in range(length):
        if i > 0 and i % config.segment == 0:
            segment_weights = (memory.memory.w1, memory.memory.w2)
        h = memory_apply(*segment_weights, q_memory[:, :, i:i + 1]).transpose(1, 2).flatten(2)  # [B, 1, C]
        k, v = keys_values(block.norm_h(h), [i])
        k_h.append(k[:, :, 0])
        v_h.append(v[:, :, 0])
        visible = range(i - i % config.segment, i + 1)
        y = torch.empty(batch, heads, dim, dtype=x.dtype)
        for head in range(heads):
            group = head // (heads // kv_heads)
            keys = [block.attn.persistent_k[group, s] for s in range(config.n_persistent)]
            values = [block.attn.persistent_v[group, s] for s in range(config.n_persistent)]
            scores = [q[:, head, i] @ key for key in keys]
            for j in visible:
                for key, value in ((k_h[j][:, group], v_h[j][:, group]), (k_x[:, group, j], v_x[:, group, j])):
                    scores.append((q_rot[:, head, i] * key).sum(-1))
                    values.append(value)
            weights = torch.softmax(torch.stack(scores, -1) / math.sqrt(dim), dim=-1)  # [B, n_visible]
            y[:, head] = sum(weights[:, n, None] * value for n, value in enumerate(values))
        y = y.reshape(batch, 1, heads * dim)
        m, memory = block.memory(y, memory, i)
        outputs.append(block.out_proj(block.norm_y(y) * torch.sigmoid(block.norm_m(m))))
    x = x + torch.cat(outputs, dim=1)
    return x + block.mlp(block.ln_2(x))


def test_mac_block_equals_explicit_per_query_reference():
    torch.manual_seed(3)
    model = tiny("mac").double().eval()
    block = model.blocks[0]
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    fast, _ = block(x, None, 0)
    assert relative_error(fast, reference_mac_block(block, x), norm="max") < 1e-12


@pytest.mark.parametrize("with_bias", [[False, True, False, True], [True, False, False], [False, False], [True]])
def test_stacked_linear_equals_each_maps_own_product(with_bias):
    """One product over stacked weights, the biases of bias-free maps padded in as zeros: each group's output is its
    maps' own F.linear side by side (float64, tight)."""
    torch.manual_seed(4)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    maps = [(torch.randn(3 + i, 6, dtype=torch.float64), torch.randn(3 + i, dtype=torch.float64) if bias else None)
            for i, bias in enumerate(with_bias)]
    groups = [maps[:1], maps[1:]] if len(maps) > 1 else [maps]
    for group, out in zip(groups, stacked_linear(x, groups)):
        assert relative_error(out, torch.cat([F.linear(x, w, b) for w, b in group], dim=-1)) < 1e-12


def parameter_formula(c: TitansConfig) -> int:
    """Spec A.6, written out (no biases in attention/MLP/norms)."""
    d, h, h_kv, d_h, n_p = c.n_embd, c.n_head, c.n_kv_head, c.head_dim, c.n_persistent
    h_m, d_k, d_m, k, f = c.mem_heads, c.mem_head_dim, c.mem_hidden, c.conv_kernel, c.mlp_hidden
    attention = d * h * d_h + d * 2 * h_kv * d_h + 2 * h_kv * n_p * d_h
    memory = 3 * d * h_m * d_k + 3 * (h_m * d_k * k + h_m * d_k) + 3 * (d * h_m + h_m) + h_m * 2 * d_k * d_m
    mag = 2 * d + attention + memory + 2 * h * d_h + h * d_h * d + 2 * d * f
    layers = {
        "mag": [mag] * c.n_layer,
        "mac": [mag + d] * c.n_layer,
        "lmm": [2 * d + memory + h_m * d_k + 2 * d * h_m * d_k + 2 * d * f] * c.n_layer,
        "mal": [2 * d + memory + h_m * d_k + 2 * d * h_m * d_k + 2 * d * f if i % 2 == 0
                else 2 * d + attention + h * d_h * d + 2 * d * f for i in range(c.n_layer)],
    }[c.variant]
    return c.vocab_size * d + d + sum(layers)


@pytest.mark.parametrize(
    "variant,expected", [("mag", 28_753_644), ("mac", 28_755_948), ("mal", 28_773_558), ("lmm", 28_763_628)]
)
def test_reference_configs_have_the_exact_parameter_counts(variant, expected):
    backbone = yaml.safe_load((ROOT / f"configs/titans_{variant}.yaml").read_text())["model.backbone"]
    model = Titans(vocab_size=50304, **backbone["init_args"])
    assert model.parameter_count() == parameter_formula(model.config) == expected
    assert abs(expected / 28_758_912 - 1) < 0.001  # within 0.1% of the GQA GPT baseline
    assert type(model)(**model.config_dict()).parameter_count() == expected


@pytest.mark.parametrize("init_std", [0.02, 0.125])
def test_init_draws_at_init_std_and_keeps_the_memorys_own_scales(init_std):
    torch.manual_seed(0)
    model = Titans(vocab_size=512, n_embd=256, n_layer=8, variant="mag", n_head=4, n_kv_head=2, mem_heads=4,
                   mem_head_dim=64, mem_hidden=128, n_persistent=64, init_std=init_std)
    block = model.blocks[0]
    for weight in (model.wte.weight, block.attn.q_proj.weight, block.mlp.c_fc.weight, block.memory.qkv.weight,
                   block.attn.persistent_k):
        assert weight.std().item() == pytest.approx(init_std, rel=0.05)
    for weight in (block.out_proj.weight, block.mlp.c_proj.weight):  # residual projections: / sqrt(2 n_layer)
        assert weight.std().item() == pytest.approx(init_std / 4, rel=0.05)
    assert block.memory.w1_init.std().item() == pytest.approx(64 ** -0.5, rel=0.05)  # M_0: unit pre-activations
    assert block.memory.w2_init.std().item() == pytest.approx(128 ** -0.5, rel=0.05)


def test_no_weight_decay_covers_the_initial_memory_and_persistent_slots():
    names = tiny("mag").no_weight_decay_param_names()
    assert {"blocks.0.memory.w1_init", "blocks.0.memory.w2_init", "blocks.0.attn.persistent_k",
            "blocks.1.attn.persistent_v"} <= names


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_autocast_keeps_the_memory_state_float32(variant):
    torch.manual_seed(5)
    model = tiny(variant).eval()
    idx = torch.randint(0, VOCAB, (2, 29))
    reference, _ = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, state = model(idx)
        _, state = model(idx[:, :1], state)  # a decode step under autocast too
    memory_dtypes = set()
    for layer in state.layers:  # MemoryCache for memory blocks, a NamedTuple with a .memory cache for MAG/MAC
        cache = layer if isinstance(layer, MemoryCache) else getattr(layer, "memory", None)
        if cache is not None:
            memory_dtypes |= {t.dtype for t in cache.memory}
    assert memory_dtypes == {torch.float32}
    gap = (F.log_softmax(logits.float(), -1) - F.log_softmax(reference, -1)).abs().max()
    assert gap < 5e-2


def state_bytes(state) -> int:
    sizes = []
    map_state_tensors(state, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_size_is_constant_in_length(variant):
    torch.manual_seed(7)
    model = tiny(variant, segment=40, memory_chunk_size=20).eval()  # longer segments: fewer Python steps
    state, sizes = None, {}
    with torch.no_grad():
        for _ in range(6):
            _, state = model(torch.randint(0, VOCAB, (1, 200)), state)
            sizes[state.position] = state_bytes(state)
    assert sizes[600] == sizes[1200] == sizes[800]
    assert model.max_seq_len is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"n_head": 5}, "n_embd (32) must be divisible by n_head (5)"),
        ({"n_kv_head": 3}, "n_head (4) must be divisible by n_kv_head (3)"),
        ({"n_embd": 36, "mem_heads": 4, "mem_head_dim": 9}, "head dim n_embd / n_head (9) must be even"),
        ({"mem_heads": 2}, "mem_heads x mem_head_dim (2 x 8 = 16) must equal n_embd (32)"),
        ({"variant": "mac", "segment": 6}, "segment (6) must be a multiple of memory_chunk_size (4)"),
        ({"memory_chunk_size": 0}, "memory_chunk_size (0) must be a positive integer or null"),
        ({"window": 0}, "window (0) must be a positive integer"),
        ({"variant": "mat"}, "variant ('mat') must be one of"),
        ({"theta_mode": "fixed"}, "theta_mode ('fixed') must be one of"),
        ({"rho_max": 1.5}, "rho_max (1.5) must be in (0, 1]"),
        ({"dropout": 1.0}, "dropout (1.0) must be in [0, 1)"),
        ({"init_std": -1.0}, "init_std (-1.0) must be a positive number"),
        ({"n_persistent": -1}, "n_persistent (-1) must be a non-negative integer"),
    ],
)
def test_config_rules_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        tiny(**{"variant": "mag", **overrides})
    assert message in str(error.value)


@pytest.mark.parametrize("variant", ["lmm", "mal"])
def test_lmm_and_mal_need_no_memory_width_match(variant):
    """Only MAG and MAC gate the attention output with the memory's; LMM and MAL run with a narrower memory."""
    model = tiny(variant, mem_heads=2, mem_head_dim=8).eval()
    assert model.config.memory_width == 16 != model.config.n_embd
    logits, _ = model(torch.randint(0, VOCAB, (2, 9)))
    assert logits.shape == (2, 9, VOCAB) and torch.isfinite(logits).all()


def test_diverging_memory_is_non_finite_not_silent():
    """The paper-literal raw step without normalisation can blow the memory up; the loss then says so (the
    FiniteLossGuard turns that into one clear line), and the default parametrisation on the same input does not."""
    torch.manual_seed(9)
    idx = torch.full((1, 256), 7)  # one repeated token: perfectly aligned keys
    blown = tiny("lmm", theta_mode="free", theta_max=50.0, normalize_step=False, memory_chunk_size=64).eval()
    logits, _ = blown(idx)
    assert not torch.isfinite(logits).all() or logits.abs().max() > 1e6
    stable = tiny("lmm", memory_chunk_size=64).eval()
    assert torch.isfinite(stable(idx)[0]).all()


TINY_CLI = [
    "--model.backbone.init_args.n_embd", "32", "--model.backbone.init_args.n_layer", "2",
    "--model.backbone.init_args.n_head", "2", "--model.backbone.init_args.n_kv_head", "1",
    "--model.backbone.init_args.mlp_hidden", "48", "--model.backbone.init_args.window", "8",
    "--model.backbone.init_args.segment", "8", "--model.backbone.init_args.n_persistent", "2",
    "--model.backbone.init_args.mem_heads", "2", "--model.backbone.init_args.mem_head_dim", "16",
    "--model.backbone.init_args.mem_hidden", "16", "--model.backbone.init_args.memory_chunk_size", "4",
    "--model.warmup_steps", "2",
]


def test_cli_diverging_memory_stops_with_one_line(tmp_path, monkeypatch, capsys):
    """The paper-literal raw step at an absurd size blows the memory up: the finite-loss guard stops the run
    with one line and exit code 2, and no checkpoint holds the non-finite weights."""
    from ltcx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ltcx"])
    data = write_corpus(tmp_path / "corpus", 30, 5)
    with pytest.raises(SystemExit) as exit_info:
        main([
            "fit", "--config", str(ROOT / "configs/titans_lmm.yaml"),
            "--config", str(ROOT / "configs/trainer/smoke.yaml"),
            "--data.path", str(data), "--data.block_size", "24", "--data.batch_size", "2", "--data.val_batches", "1",
            "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false", *TINY_CLI,
            "--model.backbone.init_args.theta_mode", "free", "--model.backbone.init_args.normalize_step", "false",
            "--model.backbone.init_args.theta_max", "1.0e+30",
        ])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "ltcx: error: training loss became" in err and "Traceback" not in err
    assert not list(tmp_path.glob("checkpoints/**/*.ckpt"))
