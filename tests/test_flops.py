"""flops_per_token of every backbone against torch's FlopCounterMode on tiny models.

FlopCounterMode counts matrix products (mm, bmm, addmm, baddbmm); it knows no in-place product, and on a CPU it
does not count the fused SDPA kernel at all, so the tests register formulas for both: ``baddbmm_`` (Titans' memory
chunk accumulates its products in place) as ``baddbmm``, and for SDPA what the backbones' formulas count: scores
and values of the (query, key) pairs a query may see (causal or masked), 2 FLOPs per multiply-add.

``test_every_catalogue_shape_counts_its_flops`` checks every catalogue entry and variant: the counted forward,
less the work each formula leaves out on purpose (named there, each checked exactly by the tests after it), x 3
equals ``flops_per_token`` to 1e-9 (the sums' float rounding).
"""

from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from ltcx.models import titans as titans_module
from ltcx.models.catalog import CATALOG
from ltcx.models.gpt import GPT
from ltcx.models.ltc import LTCGPT
from ltcx.models.titans import Titans
from ltcx.models.xlstm import XLSTM
from ltcx.ops.titans import chunk_sizes
from ltcx.throughput import model_flops_per_token


def _visible_pairs_sdpa(query, key, value, dropout_p=0.0, is_causal=False, *args, attn_mask=None, out_val=None,
                        **kwargs) -> int:
    batch, heads, length, dim = query.shape
    keys = key.shape[-2]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        pairs = int(attn_mask.expand(batch, heads, length, keys).sum())
    elif is_causal:  # top-left aligned: query i sees keys j <= i
        pairs = batch * heads * sum(min(i + 1, keys) for i in range(length))
    else:
        pairs = batch * heads * length * keys
    return 2 * pairs * dim + 2 * pairs * value.shape[-1]


def _as_baddbmm(*args, out_val=None, **kwargs) -> int:
    return flop_registry[torch.ops.aten.baddbmm](*args, out_val=out_val, **kwargs)


_visible_pairs_sdpa._get_raw = True  # FlopCounterMode hands it the tensors, not their shapes
_as_baddbmm._get_raw = True  # the registry's formula reads the shapes itself
COUNTED_TOO = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _visible_pairs_sdpa,
               torch.ops.aten.baddbmm_: _as_baddbmm}


def counted_forward_flops_per_token(model, batch: int, length: int) -> float:
    idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    # with grad: its module tracker hooks outputs
    with FlopCounterMode(display=False, custom_mapping=COUNTED_TOO) as counter:
        model(idx)
    return counter.get_total_flops() / (batch * length)


def uncounted_forward_flops_per_token(model, batch: int, length: int) -> float:
    """What the counter sees and a formula leaves out on purpose, per token of a forward of ``batch`` x ``length``:

    * LTC: the fold of the modal basis into the q/k weights, once per call, not per token
      (``test_ltc_counts_within_the_per_call_fold``);
    * Titans: the keys its attention's math kernel scores and then masks (``masked_keys_per_token``);
    * GTA: the zero columns padding q, k and the latent to one width for the fused kernel, when d_k != d_l;
    * xLSTM: the chunks covering T, the chunkwise form's state after its last chunk (one more row of its chunk-starts
      product), which a call that keeps no state (training) leaves out.
    """
    c = model.config
    if isinstance(model, LTCGPT):
        return c.n_layer * 2 * (c.n_head + c.n_kv_head) * c.head_dim ** 2 * (c.n_embd + c.bias) / (batch * length)
    if isinstance(model, Titans):
        return 6 * c.head_dim * c.n_head * masked_keys_per_token(model, length)
    if isinstance(model, XLSTM):
        full, rest = divmod(length, c.chunk_size)
        if c.mlstm_backend != "chunkwise" or rest or length <= c.chunk_size:
            return 0.0
        d = c.mlstm_inner_dim // c.n_head
        return c.block_types.count("m") * c.n_head * 2 * full * (d * d + d) / length
    if type(model).__name__ == "GTAGPT" and c.key_dim != c.latent_dim:
        padding = 2 * max(c.key_dim, c.latent_dim) - c.key_dim - c.latent_dim
        return c.n_layer * 2 * c.n_query_group * (length + 1) / 2 * padding
    return 0.0


CATALOGUE_SHAPES = [(name, variant) for name, entry in CATALOG.items() for variant in entry.shapes()]


@pytest.mark.parametrize("name,variant", CATALOGUE_SHAPES, ids=[f"{n}-{v}" for n, v in CATALOGUE_SHAPES])
def test_every_catalogue_shape_counts_its_flops(name, variant):
    """flops_per_token(T) = 3 x (the counted forward - the uncounted terms above), to 1e-9: the formulas count every
    matrix product of the training forms (the 3: the backward's two products per forward product)."""
    torch.manual_seed(0)
    model = CATALOG[name].build_tiny(96, variant).eval()
    batch, length = 2, 24
    counted = counted_forward_flops_per_token(model, batch, length)
    uncounted = uncounted_forward_flops_per_token(model, batch, length)
    assert model.flops_per_token(length) == pytest.approx(3 * (counted - uncounted), rel=1e-9)


GPT_TINY = dict(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True)
TITANS_TINY = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_kv_head=2, mlp_hidden=48, window=6, segment=8,
                   n_persistent=3, mem_heads=2, mem_head_dim=16, mem_hidden=24, memory_chunk_size=4)


@pytest.mark.parametrize("length,mlp_hidden", [(32, None), (13, None), (13, 40)])
def test_gpt_counts_exactly(length, mlp_hidden):
    model = GPT(**GPT_TINY, mlp_hidden=mlp_hidden).eval()
    assert counted_forward_flops_per_token(model, 2, length) == model.forward_flops_per_token(length)
    assert model.flops_per_token(length) == 3 * model.forward_flops_per_token(length)


@pytest.mark.parametrize("controller",
                         [{}, {"controller_hidden_size": 16}, {"num_decay_modes": 1, "controller_rank": 4}])
def test_ltc_counts_within_the_per_call_fold(controller):
    """The fold of the basis into the q/k weights, 2 (H + G) D^2 (C + 1) per layer per call, is not per token:
    the formula leaves it out, so the count may exceed it by that over B T tokens (here under 1%)."""
    model = LTCGPT(**GPT_TINY, **{"num_decay_modes": 5, **controller}).eval()
    batch, length = 4, 32
    counted = counted_forward_flops_per_token(model, batch, length)
    c = model.config
    fold_inputs = c.n_embd + c.bias  # the biases of the q and k rows are rotated too
    fold = c.n_layer * 2 * (c.n_head + c.n_kv_head) * c.head_dim ** 2 * fold_inputs / (batch * length)
    assert counted == pytest.approx(model.forward_flops_per_token(length) + fold, rel=1e-12)
    assert fold / counted < 0.01


@pytest.mark.parametrize("backend,length", [("chunkwise", 32), ("chunkwise", 21), ("parallel", 21)])
def test_xlstm_counts_exactly(backend, length):
    model = XLSTM(vocab_size=96, n_embd=32, n_layer=3, slstm_at=[1], n_head=2, slstm_n_head=2,
                  chunk_size=8, mlstm_backend=backend).eval()
    counted = counted_forward_flops_per_token(model, 2, length) - uncounted_forward_flops_per_token(model, 2, length)
    assert counted == pytest.approx(model.forward_flops_per_token(length), rel=1e-12)


def masked_keys_per_token(model: Titans, length: int) -> float:
    """Keys (and slots) that Titans' attention scores but its mask hides, per token, summed over its attention layers.

    Its queries [RoPE(q) | q] are twice as wide as its values, so on a CPU SDPA takes the math kernel, which
    computes every (query, key) pair and masks afterwards; the formula counts only the visible ones."""
    c = model.config
    if c.variant == "mac":  # a piece of n tokens of a segment: 2 n keys per query, 2 (j + 1) visible
        masked = sum(2 * n * n - n * (n + 1) for n in chunk_sizes(0, length, c.segment))
        layers = c.n_layer
    else:  # sliding window: min(window, i + 1) keys and the slots visible
        window, slots = c.window, c.n_persistent
        if length > 2 * window:  # queries in blocks of the window (the last padded), each row 2 window - 1 keys
            scored = -(-length // window) * window * (2 * window - 1 + slots)
        else:  # one call: every query scores all T keys
            scored = length * (length + slots)
        masked = scored - sum(slots + min(window, i + 1) for i in range(length))
        layers = {"mag": c.n_layer, "mal": c.n_layer // 2, "lmm": 0}[c.variant]
    return layers * masked / length


@pytest.mark.parametrize("variant", ["mag", "mac", "mal", "lmm"])
@pytest.mark.parametrize("length,chunk", [(19, 4), (16, None)])
def test_titans_counts_exactly(variant, length, chunk):
    model = Titans(**{**TITANS_TINY, "variant": variant, "memory_chunk_size": chunk}).eval()
    c = model.config
    masked = 6 * c.head_dim * c.n_head * masked_keys_per_token(model, length)  # 2 (2D) score + 2 D value
    assert counted_forward_flops_per_token(model, 2, length) == pytest.approx(
        model.forward_flops_per_token(length) + masked, rel=1e-12
    )


@pytest.mark.parametrize("variant", ["mag", "mac", "mal", "lmm"])
@pytest.mark.parametrize("length,chunk", [(19, 4), (16, None)])
def test_titans_memory_op_counts_exactly(variant, length, chunk):
    """memory_op_flops_per_token: 3 x what the counter sees inside every ``neural_memory`` call of a forward (MAC:
    one call per segment piece; MAL: its memory blocks only), per token; the rest of flops_per_token is outside it."""
    model = Titans(**{**TITANS_TINY, "variant": variant, "memory_chunk_size": chunk}).eval()
    real, counted = titans_module.neural_memory, []

    def counting(*args, **kwargs):
        with FlopCounterMode(display=False, custom_mapping=COUNTED_TOO) as counter:
            result = real(*args, **kwargs)
        counted.append(counter.get_total_flops())
        return result

    idx = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(titans_module, "neural_memory", counting):
        model(idx)
    assert counted  # the patched op ran
    assert model.memory_op_flops_per_token(length) == pytest.approx(3 * sum(counted) / (2 * length), rel=1e-12)
    assert model.memory_op_flops_per_token(length) < model.flops_per_token(length)


def test_unknown_backbones_fall_back_to_six_n():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    assert model_flops_per_token(model, 16) == 6 * (40 + 40 + 10)
    gpt = GPT(**GPT_TINY)
    assert model_flops_per_token(gpt, 16) == gpt.flops_per_token(16)


@pytest.mark.parametrize("gate,mlp_hidden", [(True, None), (False, None), (True, 48)])
def test_gta_counts_exactly(gate, mlp_hidden):
    """key_dim = latent_dim, so the fused kernel needs no padding and counts what the formula counts."""
    from ltcx.models.gta import GTAGPT

    model = GTAGPT(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_embd=32, n_query_group=2, n_key_head=1,
                   key_dim=8, n_latent_head=1, latent_dim=8, gate=gate, mlp_hidden=mlp_hidden).eval()
    assert counted_forward_flops_per_token(model, 2, 13) == model.forward_flops_per_token(13)
