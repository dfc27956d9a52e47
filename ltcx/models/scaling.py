"""How each architecture grows: its init_args at a width, a depth and a sequence length, keeping the proportions of
its YAML (``configs/<name>.yaml``), and the grid of widths and the fine knob the budget search walks
(``ltcx/study/budget.py``, docs/compare.md "Matched budgets").

The rules (head dim ``D`` = 64, the YAMLs'; a caller may ask for another, as the recall study asks for 32):

* GPT, LTC, GTA, Titans: ``n_embd / D`` heads, a third of them KV heads (GTA: query groups) as the YAMLs' 6:2 (the
  divisor of the heads nearest a third where 3 does not divide them); the widths searched are D and 2 D (one KV
  head) and then multiples of 3 D, where the 3:1 ratio is exact. LTC: as many decay modes as the head dim. GTA: key
  heads of D and latent heads of ``n_embd / (2 G)`` (expand factor 2), one of each per two query groups; its widths
  searched are D, 2 D, 3 D (one group) and then multiples of 6 D (an even number of groups). Titans: memory heads
  of D, as many as the attention heads (``mem_heads x mem_head_dim = n_embd``), memory MLP of 2 D, window and
  segment of 128 tokens (the sequence's length when shorter, the segment rounded up to the memory's chunks of 16).
* xLSTM: 4 mLSTM and 4 sLSTM heads, one sLSTM block in 8 (7:1), the last of each 8; widths multiples of 4.
* Gated DeltaNet: ``n_embd / D`` heads of keys 3 D / 4 and values 3 D / 2 (the YAML's 6 of 48 and 96: fla's
  n_head x head_dim = 0.75 n_embd, expand_v 2), SwiGLU MLP of 8 n_embd / 3. Mamba-2: heads of D, 2 n_embd / D of
  them (expand 2), state width 64. Both: chunks of 64.
* The context (``block_size``) is the sequence length; the xLSTM's chunk is 128 tokens where its mLSTM heads are
  wider than 128 (configs/xlstm.yaml's 208), else 64, or the sequence when shorter.
* The fine knob lands a budget within 2%: the MLP's hidden width for parameters and FLOPs (the GPT family's
  ``mlp_hidden``, home 4 x width; Titans', home 2 x width, the YAMLs' 2.1-3.2 x having been set to match the
  GPT), Titans' memory MLP (``mem_hidden``, home 2 D) for the state; in steps of 8, from a quarter of its home value
  to twice it. Gated DeltaNet's knobs: the MLP (parameters, FLOPs) and the value width (state, steps of 2);
  Mamba-2's: the state width N for all three (steps of 2). The xLSTM has no knob: its widths step by 4, its inner
  widths by 64 (``proj_round_to``).

No torch here: the catalogue imports this module, and importing the catalogue stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HEAD_DIM", "Knob", "ScalingRule", "gated_deltanet", "gpt", "gqa_heads", "gqa_widths", "gta", "gta_widths",
           "head_widths", "ltc", "mamba2", "titans", "xlstm", "xlstm_widths"]

HEAD_DIM = 64  # every YAML's attention head
MAX_WIDTH = 8192


@dataclass(frozen=True)
class Knob:
    """The init_args field a search moves, in steps of ``step``, within [low, high] x its value at the rule's shape
    (its home)."""

    field: str
    step: int = 8
    low: float = 0.25
    high: float = 2.0


@dataclass(frozen=True)
class ScalingRule:
    """``shape(width, n_layer, seq_len, **options)`` -> init_args (less vocab_size); ``widths(max_width)`` the grid
    searched (ascending); ``depth`` the YAML's, the depth searched unless the caller gives others; ``knobs``: budget
    kind (params, flops, state) -> the fine knob."""

    shape: Callable[..., dict[str, Any]]
    widths: Callable[[int], list[int]]
    depth: int
    knobs: dict[str, Knob] = field(default_factory=dict)


def gqa_heads(width: int, head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(heads, KV heads) at ``width``: heads of ``head_dim``, the divisor of the heads nearest a third as KV heads
    (ties: the larger)."""
    heads = max(1, width // head_dim)
    kv = min((d for d in range(1, heads + 1) if heads % d == 0), key=lambda d: (abs(d - heads / 3), -d))
    return heads, kv


def gqa_widths(max_width: int = MAX_WIDTH, head_dim: int = HEAD_DIM) -> list[int]:
    """D, 2 D (one KV head), then the multiples of 3 D (an exact 3:1), up to ``max_width``."""
    return [w for w in (head_dim, 2 * head_dim) if w <= max_width] + list(range(3 * head_dim, max_width + 1,
                                                                               3 * head_dim))


def gta_widths(max_width: int = MAX_WIDTH, head_dim: int = HEAD_DIM) -> list[int]:
    """D, 2 D, 3 D (one query group), then the multiples of 6 D (an even number of groups, so that half of them is
    the number of key and latent heads)."""
    return [w for w in (head_dim, 2 * head_dim, 3 * head_dim) if w <= max_width] + list(
        range(6 * head_dim, max_width + 1, 6 * head_dim))


def head_widths(max_width: int = MAX_WIDTH, head_dim: int = HEAD_DIM) -> list[int]:
    """The multiples of D (Gated DeltaNet's and Mamba-2's widths: whole heads)."""
    return list(range(head_dim, max_width + 1, head_dim))


def xlstm_widths(max_width: int = MAX_WIDTH) -> list[int]:
    """Multiples of 4 (the sLSTM heads divide the width) from 32."""
    return list(range(32, max_width + 1, 4))


def gpt(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
    """configs/gpt.yaml's proportions at ``width`` x ``n_layer``, context ``seq_len``."""
    heads, kv = gqa_heads(width, head_dim)
    return dict(block_size=seq_len, n_layer=n_layer, n_head=heads, n_kv_head=kv, n_embd=width, dropout=0.0,
                bias=False, mlp_hidden=4 * width)


def ltc(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
    """configs/ltc.yaml's: the GPT's, with as many decay modes as the head has dimensions (64 of 64)."""
    shape = gpt(width, n_layer, seq_len, head_dim)
    return {**shape, "num_decay_modes": width // shape["n_head"], "controller_rank": 0, "controller_hidden_size": 0,
            "tau_min": None}


def gta(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
    """configs/gta.yaml's: query groups as the GPT's KV heads, key and latent heads half as many (the YAML's one
    of each for two groups; the divisor of the groups nearest half), keys of the head dim, latents of
    width / (2 groups)."""
    heads, groups = gqa_heads(width, head_dim)
    shared = min((d for d in range(1, groups + 1) if groups % d == 0), key=lambda d: (abs(d - groups / 2), d))
    return dict(block_size=seq_len, n_layer=n_layer, n_head=heads, n_embd=width, dropout=0.0, bias=False,
                n_query_group=groups, n_key_head=shared, key_dim=width // heads, n_latent_head=shared,
                latent_dim=width // groups // 2, gate=True, rope=False, mlp_hidden=4 * width)


def xlstm(width: int, n_layer: int, seq_len: int, head_dim: int | None = None) -> dict[str, Any]:
    """configs/xlstm.yaml's: 4 heads (``width / head_dim`` when a head dim is given); round(n_layer / 8) sLSTM blocks
    (at least one from 2 layers), each the last of its share of the layers: 7:1 at 8 layers, 1:1 at 2."""
    heads = 4 if head_dim is None else max(1, width // head_dim)
    # the mLSTM's heads, 2 x width / heads (mlstm_proj_factor 2); XLSTMConfig rounds the inner width up to a multiple
    # of 64, which moves no head across 128 (128 x heads is such a multiple)
    mlstm_head = 2 * width / heads
    slstm = max(1, round(n_layer / 8)) if n_layer > 1 else 0
    if slstm == 0 or n_layer % slstm == 0:
        pattern = dict(signature=[n_layer // slstm - 1, 1] if slstm else [1, 0])
    else:
        pattern = dict(slstm_at=[round((i + 1) * n_layer / slstm) - 1 for i in range(slstm)])
    chunk = 128 if mlstm_head > 128 else 64
    return dict(n_embd=width, n_layer=n_layer, **pattern, n_head=heads, slstm_n_head=heads,
                chunk_size=min(chunk, seq_len), mlstm_backend="chunkwise", forget_gate="sigmoid", tie_embeddings=True)


def titans(variant: str) -> Callable[..., dict[str, Any]]:
    """configs/titans_<variant>.yaml's proportions (its mlp_hidden aside: the knob)."""

    def shape(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
        heads, kv = gqa_heads(width, head_dim)
        chunk = 16
        return dict(variant=variant, n_layer=n_layer, n_embd=width, n_head=heads, n_kv_head=kv, mlp_hidden=2 * width,
                    window=min(128, seq_len), segment=min(128, -(-seq_len // chunk) * chunk), n_persistent=16,
                    mem_heads=heads, mem_head_dim=width // heads, mem_hidden=2 * (width // heads),
                    memory_chunk_size=chunk, theta_mode="chunk", normalize_step=True, dropout=0.0, bias=False)

    shape.__name__ = shape.__qualname__ = f"titans_{variant}"
    return shape


def gated_deltanet(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
    """configs/gated_deltanet.yaml's proportions (its mlp_hidden aside: the knob)."""
    heads = max(1, width // head_dim)
    key = max(1, 3 * width // (4 * heads))
    return dict(n_embd=width, n_layer=n_layer, n_head=heads, head_dim=key, head_v_dim=2 * key,
                mlp_hidden=8 * -(-width // 3), conv_kernel_size=4, chunk_size=64, backend="torch")


def mamba2(width: int, n_layer: int, seq_len: int, head_dim: int = HEAD_DIM) -> dict[str, Any]:
    """configs/mamba2.yaml's proportions."""
    return dict(n_embd=width, n_layer=n_layer, n_head=max(1, 2 * width // head_dim), head_dim=head_dim, d_state=64,
                conv_kernel_size=4, chunk_size=64, backend="torch")
