"""GTA GPT: the GQA GPT with grouped-head latent attention (GTA, Sun et al. 2025, arXiv 2506.17286).

G query heads each give one attention map, shared by the S = n_head / G output heads of its group; n_k
key heads are shared by the groups; values are n_c latent heads of width d_l, attended as they are and
decoded after attention by a linear per-group map D_g = [I ... I] + B_g; a sigmoid gate of the current
token's input scales the decoded heads before the output projection. The cache keeps only the keys
and the latents. Everything outside attention is the GPT's. Equations in ``ltcx.ops.gta``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ltcx.errors import ConfigError
from ltcx.models.gpt import GPT, GPTConfig, Padding
from ltcx.models.inference_cache import derived_in_inference
from ltcx.models.state import model_dtype
from ltcx.ops import gta as gta_ops
from ltcx.ops.attention import RopeTables, apply_rope


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class GTAConfig(GPTConfig):
    """Shape of a GTA GPT, the constructor arguments of ``GTAGPT``: the GPT fields (less n_kv_head) plus the GTA
    attention's."""

    # GTA has no KV heads (keys: n_key_head, values: n_latent_head), so this GPT field is not an argument.
    n_kv_head: int | None = field(default=None, init=False, repr=False)
    # GTA has its own rotary option (``rope``, on its keys); the GPT's ``position`` is not an argument
    position: str = field(default="learned", init=False, repr=False)
    rope_base: float = field(default=GPTConfig.rope_base, init=False, repr=False)
    # GPT fields whose meaning GTA refines: re-documented here, their defaults (and places) the GPT's
    n_head: int = GPTConfig.n_head
    """number of output heads (head_dim = n_embd / n_head); a multiple of n_query_group."""
    dropout: float = GPTConfig.dropout
    """dropout on attention weights (one mask per shared map), residual branches and embeddings."""
    mlp_hidden: int | None = GPTConfig.mlp_hidden
    """hidden width of each block's MLP; None means 4 n_embd (1,472 in the reference shape gives exactly the GPT's
    parameter count)."""
    n_query_group: int = 2
    """G, query heads; each map is shared by n_head / G output heads."""
    n_key_head: int = 1
    """n_k, key heads; divides n_query_group."""
    key_dim: int | None = None
    """d_k, query and key width; None means head_dim."""
    n_latent_head: int = 1
    """n_c, latent value heads; divides n_query_group."""
    latent_dim: int | None = None
    """d_l, latent width; must divide n_embd / n_query_group; None means n_embd / (2 G)."""
    gate: bool = True
    """multiply the decoded heads by sigmoid(W_g x) of the current token."""
    rope: bool = False
    """rotary embedding on queries and keys (in addition to the learned position embeddings)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_query_group", "n_key_head", "n_latent_head"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} ({value}) must be a positive integer")
        groups = self.n_query_group
        _require(
            self.n_head % groups == 0,
            f"n_head ({self.n_head}) must be divisible by n_query_group ({groups}): a group owns whole heads",
        )
        for name in ("n_key_head", "n_latent_head"):
            value = getattr(self, name)
            _require(groups % value == 0, f"n_query_group ({groups}) must be divisible by {name} ({value})")
        if self.key_dim is None:
            self.key_dim = self.head_dim
        width = self.n_embd // groups  # output width of one group
        if self.latent_dim is None and width % 2 == 0:
            self.latent_dim = width // 2
        for name in ("key_dim", "latent_dim"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} ({value}) must be a positive integer")
        _require(
            width % self.latent_dim == 0,
            f"latent_dim ({self.latent_dim}) must divide n_embd / n_query_group ({width}): "
            "the decoder repeats the latent a whole number of times",
        )
        for name in ("gate", "rope"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"{name} ({value!r}) must be true or false")
        _require(not self.rope or self.key_dim % 2 == 0, f"key_dim ({self.key_dim}) must be even with rope")


@dataclass
class GTACache:
    """Append-only cache of one GTA layer, every tensor batch-first.

    k: [B, n_k, T_cached, d_k] keys (after RoPE when enabled); latent: [B, n_c, T_cached, d_l]; mask: [B, T_cached]
    (True = a real token) once a padding mask was given, else None (every token real).
    """

    k: torch.Tensor
    latent: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]


class GTAAttention(nn.Module):
    """Grouped-head latent attention: one SDPA call over G maps, linear decode after it, gate, c_proj.

    Parameters (bias false): in_proj [G d_k + n_k d_k + n_c d_l (+ C with the gate), C] holds W_q, W_k,
    W_v (to the latent) and W_g in one matrix, so one matmul projects the input; decoder B [G, d_l, C / G];
    c_proj [C, C]. Per layer C (G d_k + n_k d_k + n_c d_l) + C d_l + C^2 (+ C^2 with the gate).
    """

    def __init__(self, config: GTAConfig) -> None:
        super().__init__()
        self.groups, self.n_key_head, self.n_latent_head = config.n_query_group, config.n_key_head, config.n_latent_head
        self.key_dim, self.latent_dim = config.key_dim, config.latent_dim
        width = config.n_embd // self.groups
        self.widths = [self.groups * self.key_dim, self.n_key_head * self.key_dim, self.n_latent_head * self.latent_dim]
        if config.gate:
            self.widths.append(config.n_embd)
        self.in_proj = nn.Linear(config.n_embd, sum(self.widths), bias=config.bias)
        # B_g ~ N(0, init_std) like every matrix (the official init), so D_g starts near [I ... I].
        self.decoder = nn.Parameter(torch.randn(self.groups, self.latent_dim, width) * config.init_std)
        self.register_buffer("identity", gta_ops.expand_identity(self.groups, self.latent_dim, width), persistent=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, ...]:
        """x [B, T, C] (with ``rope``, the tables of its positions: q and k rotated) -> q [B, G, T, d_k],
        k [B, n_k, T, d_k], latent [B, n_c, T, d_l], gate logits [B, T, C] or None."""
        batch, length, _ = x.shape
        q, k, latent, *gate = self.in_proj(x).split(self.widths, dim=-1)
        q = q.view(batch, length, self.groups, self.key_dim).transpose(1, 2)
        k = k.view(batch, length, self.n_key_head, self.key_dim).transpose(1, 2)
        latent = latent.view(batch, length, self.n_latent_head, self.latent_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q, k, latent, (gate[0] if gate else None)

    def decoder_matrix(self) -> torch.Tensor:
        """D = J_e + B [G, d_l, C / G]; in inference built once and kept until the decoder changes."""
        return derived_in_inference(self, "decoder", (self.decoder,), lambda: self.identity + self.decoder)

    def forward(self, x: torch.Tensor, cache: GTACache | None = None, padding: Padding | None = None,
                rope: RopeTables | None = None) -> tuple[torch.Tensor, GTACache]:
        """x [B, T, C] at positions [P, P+T), where P is the cache length (with ``padding``: its positions, masked
        keys left out) -> (y [B, T, C], extended cache). ``rope``: the tables of those positions (``rope``;
        ``GTAGPT.rope_tables``)."""
        q, k, latent, gate = self.project(x, rope)
        if cache is not None:
            k, latent = torch.cat([cache.k, k], dim=2), torch.cat([cache.latent, latent], dim=2)
        key_mask = None if padding is None else padding.key_mask
        o = gta_ops.latent_attention(q, k, latent, dropout_p=self.dropout if self.training else 0.0,
                                     key_mask=key_mask)
        u = gta_ops.decode_latent(o, self.decoder_matrix())  # [B, T, C]
        if gate is not None:
            u = torch.sigmoid(gate) * u
        return self.resid_dropout(self.c_proj(u)), GTACache(k, latent, key_mask)


class GTAGPT(GPT):
    """GPT with grouped-head latent attention (GTA).

    Keeps the backbone contract ``logits [B, T, V], state = model(idx [B, T], state=None)``; the state
    holds one ``GTACache`` (keys and latents) per layer. Constructor: the fields of ``GTAConfig`` (the GPT's less
    n_kv_head, plus GTA's).
    """

    config_class = GTAConfig

    def make_attention(self, config: GTAConfig) -> nn.Module:
        return GTAAttention(config)

    def rope_tables(self, start: int, length: int, padding: Padding | None,
                    device: torch.device) -> RopeTables | None:
        """GTA's own rotary option: tables of key_dim wide heads with ``rope``, else None."""
        return self._rope_tables(start, length, padding, device, self.config.key_dim) if self.config.rope else None

    def forward_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of the forward pass per token, counted as the GPT's (matrix products, 2 per multiply-add) with
        GTA's attention: the one input projection (q, k, latent and gate), the per-group decoder after attention
        (d_l x C / G for each of the G groups), c_proj, and scores and latent values of G maps over the
        (T + 1) / 2 keys a query sees on average:

            2 (L (C (G d_k + n_k d_k + n_c d_l [+ C]) + d_l C + C^2 + 2 C F) + C V) + L 2 G (d_k + d_l) (T + 1) / 2

        (F the MLP width, ``ffn_hidden``).

        The zero-padding of q, k and the latent to one width (for the fused kernel) is not counted.
        """
        c = self.config
        attention = self.blocks[0].attn
        projections = c.n_embd * sum(attention.widths) + c.latent_dim * c.n_embd + c.n_embd * c.n_embd
        layer_weights = projections + 2 * c.n_embd * c.ffn_hidden
        scores_and_values = 2 * c.n_query_group * (c.key_dim + c.latent_dim) * (seq_len + 1) / 2
        return 2 * (c.n_layer * layer_weights + c.n_embd * c.vocab_size) + c.n_layer * scores_and_values

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'): each layer's group keys [1, n_k, tokens, d_k] and latents [1, n_c, tokens, d_l]."""
        c = self.config
        _require(0 <= tokens <= c.block_size, f"tokens ({tokens}) must be in [0, block_size={c.block_size}]")
        per_token = c.n_key_head * c.key_dim + c.n_latent_head * c.latent_dim
        return c.n_layer * per_token * tokens * model_dtype(self, dtype).itemsize
