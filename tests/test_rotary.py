"""Rotary positions for the GPT (``position: rope``): the rotation (``ltcx.ops.attention.apply_rope``, shared with
Titans and GTA) against its 2x2-matrix reference in float64, the relative-position property, the GPT's rope attention
against softmax attention written out, cached decode past the training length equal to the full forward, the context
limit (learned positions: block_size; rope: none) and the settings it refuses in one line."""

import math

import pytest
import torch

from helpers import assert_mentions, rope_at
from ltcx.errors import ConfigError, LtcxError
from ltcx.eval.long_context import lengths_within_context
from ltcx.models.catalog import CATALOG
from ltcx.models.gpt import GPT, GPTConfig, GQAAttention
from ltcx.ops import attention as attention_ops
from ltcx.ops.attention import apply_rope, rope_tables
from ltcx.ops.naive.attention import naive_attention, reference_rope, rope_matrix

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("base", [10000.0, 50.0])
def test_the_rotation_matches_its_2x2_reference_in_float64(base):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    positions = [0, 1, 5, 63, 64, 200, 4095]
    fast = rope_at(x, torch.tensor(positions), base)
    torch.testing.assert_close(fast, reference_rope(x, positions, base), rtol=0, atol=1e-12)
    for p in (0, 17, 4095):  # each rotation is orthogonal: lengths and dot products at one position are kept
        rot = rope_matrix(p, 8, base)
        torch.testing.assert_close(rot @ rot.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_row", [False, True], ids=["positions", "per-row"])
def test_the_written_backward_equals_autograd_of_the_plain_form_in_float64(per_row):
    """Where a gradient is wanted the rotation runs as ``_Rotate``: its values (bit for bit) and its gradient of x equal
    autograd's through ``_rotate`` (tables of positions [T], or per row [B, T] broadcast over the heads)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    rows = [[0, 1, 2, 40, 41], [3, 3, 4, 900, 5000]]
    positions = torch.tensor(rows if per_row else rows[1])
    tables = rope_tables(positions, 8, torch.float64)
    cotangent = torch.randn(x.shape, generator=g, dtype=torch.float64)
    out = apply_rope(x, tables)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_RotateBackward"
    expected = attention_ops._rotate(x, *tables)
    assert torch.equal(out, expected)  # the same forward: with or without a gradient, a token rounds alike
    grad, = torch.autograd.grad(out, x, cotangent)
    expected_grad, = torch.autograd.grad(expected, x, cotangent)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    with torch.no_grad():  # without a gradient: the plain form, bit for bit
        assert torch.equal(apply_rope(x, tables), expected)


def test_a_rotated_query_key_product_depends_on_the_offset_only():
    """(R_m q) . (R_n k) = q . R_{n-m} k: the same pair of vectors at positions (m, n) and (m + s, n + s) scores the
    same, and other offsets score otherwise."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 16, dtype=torch.float64).unbind(0)

    def score(m, n):
        rotated = rope_at(torch.stack([q, k]), torch.tensor([m, n]))
        return float(rotated[0] @ rotated[1])

    for m, n in [(0, 0), (3, 0), (10, 2), (100, 37)]:
        for shift in (1, 64, 1000, 10_000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-11)
        assert float(q @ (rope_matrix(n - m, 16) @ k)) == pytest.approx(score(m, n), abs=1e-11)
    assert abs(score(5, 0) - score(6, 0)) > 1e-3


def test_the_gpt_rope_attention_is_softmax_attention_over_rotated_queries_and_keys():
    """GQAAttention with position rope, fed in two pieces (a cache), against the equation written out: rotate q and
    k by their absolute positions (reference_rope), then softmax attention (naive_attention), then c_proj."""
    torch.manual_seed(2)
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=16, bias=True,
                       position="rope", rope_base=100.0)
    attention = GQAAttention(config).double().eval()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    first, cache = attention(x[:, :9], rope=rope_tables(torch.arange(9), 4, torch.float64, 100.0))
    second, _ = attention(x[:, 9:], cache, rope=rope_tables(torch.arange(9, 13), 4, torch.float64, 100.0))
    q, k, v = attention.project(x)
    positions = list(range(13))
    q, k = reference_rope(q, positions, 100.0), reference_rope(k, positions, 100.0)
    expected = naive_attention(q, k, v).transpose(1, 2).reshape(2, 13, 16)
    torch.testing.assert_close(torch.cat([first, second], dim=1), attention.c_proj(expected), rtol=0, atol=1e-12)


def test_cached_decode_past_the_training_length_equals_the_full_forward():
    """The catalogue's rope GPT (trained length block_size 64) fed 192 tokens one at a time through its cache gives
    the logits of one forward over all of them (float64)."""
    torch.manual_seed(3)
    model = CATALOG["gpt"].build_tiny(64, "rope").double().eval()
    idx = torch.randint(0, 64, (2, 3 * 64))
    with torch.no_grad():
        full, _ = model(idx)
        state, steps = None, []
        for t in range(idx.shape[1]):
            logits, state = model(idx[:, t : t + 1], state)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert state[0].length == 192 and model.state_bytes(192) == 2 * 2 * 1 * 8 * 192 * 8


def test_learned_positions_have_a_context_limit_and_rope_has_none(capsys):
    learned, rope = CATALOG["gpt"].build_tiny(64), CATALOG["gpt"].build_tiny(64, "rope")
    assert learned.max_seq_len == 64 and rope.max_seq_len is None
    assert "wpe.weight" in learned.state_dict() and not any("wpe" in key for key in rope.state_dict())
    assert rope.parameter_count() == learned.parameter_count()  # only the excluded position embeddings go
    assert rope.parameter_count(exclude_position_embeddings=False) == learned.parameter_count() == \
        learned.parameter_count(exclude_position_embeddings=False) - 64 * 16
    kept, note = lengths_within_context(learned, [32, 64, 128, 256])
    assert kept == [32, 64]
    assert_mentions(note, "GPT", "context limit of 64 tokens", "max_seq_len", "128, 256 not evaluated")
    assert lengths_within_context(rope, [32, 64, 128, 256]) == ([32, 64, 128, 256], None)
    with pytest.raises(LtcxError) as error:
        learned(torch.zeros(1, 65, dtype=torch.long))
    assert_mentions(str(error.value), "65 tokens", "block_size=64", "shorter prompt")
    logits, _ = rope(torch.zeros(1, 65, dtype=torch.long))
    assert logits.shape == (1, 65, 64) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(("build", "message"), [
    (lambda: GPT(vocab_size=16, n_embd=16, n_head=2, n_layer=1, position="alibi"),
     "position ('alibi') must be one of 'learned', 'rope'"),
    (lambda: GPT(vocab_size=16, n_embd=18, n_head=6, n_layer=1, position="rope"),
     "head_dim (n_embd / n_head = 3) must be even with position 'rope'"),
    (lambda: GPT(vocab_size=16, n_embd=16, n_head=2, n_layer=1, position="rope", rope_base=-1.0),
     "rope_base (-1.0) must be a positive number"),
])
def test_bad_position_settings_are_one_line(build, message):
    with pytest.raises(ConfigError) as error:
        build()
    assert str(error.value) == message


@pytest.mark.parametrize("arch", ["ltc", "gta"])
def test_ltc_and_gta_have_no_gpt_position_option(arch):
    """Their attention keeps its own positions (LTC's learned ones and decay, GTA's ``rope`` on its keys): the GPT's
    ``position`` and ``rope_base`` are not among their arguments."""
    import inspect

    backbone = CATALOG[arch].backbone_class()
    assert not {"position", "rope_base"} & set(inspect.signature(backbone).parameters)
    with pytest.raises(TypeError, match="unexpected keyword argument 'position'"):
        CATALOG[arch].build_tiny(64, position="rope")


def test_gpt2_layout_refuses_rope_in_one_line():
    from ltcx.models.gpt2_layout import check_gpt2_layout

    check_gpt2_layout(CATALOG["gpt"].build_tiny(64))
    with pytest.raises(LtcxError) as error:
        check_gpt2_layout(CATALOG["gpt"].build_tiny(64, "rope"))
    assert_mentions(str(error.value), "--format gpt2", "learned positions only", "position 'rope'", "use --format hf")


def test_rope_angles_are_those_of_the_documented_formula():
    """Pair i of a head of width D turns by position * base^(-2i/D) (GPTConfig.rope_base's docstring)."""
    rot = rope_matrix(3, 8, 10000.0)
    for i in range(4):
        angle = 3 * 10000.0 ** (-2 * i / 8)
        assert float(rot[i, i]) == pytest.approx(math.cos(angle)) and float(rot[i + 4, i]) == pytest.approx(
            math.sin(angle))


def test_a_bad_position_through_the_cli_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from helpers import ROOT, one_error_line

    monkeypatch.chdir(tmp_path)
    line = one_error_line(["fit", "--config", str(ROOT / "configs/ltc.yaml"), "--model.backbone.init_args.position",
                           "rope", "--trainer.max_steps", "1"], capsys)
    assert_mentions(line, "ltcx.models.ltc.LTCGPT", "no option 'position'", "--model.backbone.help LTCGPT")
    assert list(tmp_path.iterdir()) == []
