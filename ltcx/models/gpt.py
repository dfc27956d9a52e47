"""nanoGPT-style GPT with grouped-query attention: the controlled baseline and the base of LTC GPT.

Learned position embeddings (or, with ``position: rope``, rotary queries and keys and no context limit), pre-LayerNorm
blocks, GELU MLP (4x), tied input/output embeddings,
optional biases, init N(0, init_std) (0.02, GPT-2's) with residual projections scaled by 1/sqrt(2 n_layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ltcx.errors import ConfigError, LtcxError
from ltcx.models.base import Backbone
from ltcx.models.state import model_dtype
from ltcx.ops.attention import RopeTables, apply_rope, causal_gqa_attention, padded_positions, rope_tables
from ltcx.ops.precision import activation_dtype

POSITIONS = ("learned", "rope")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class GPTConfig:
    """Shape of a GPT, the constructor arguments of ``GPT``. Field names follow nanoGPT and the LTC seed."""

    block_size: int | None = 1024
    """context length (prompt plus generated tokens can not exceed it); in a YAML, null takes data.block_size (the
    length the model trains on, filled in by the CLI)."""
    vocab_size: int = 50304
    """output vocabulary; set by the CLI from the data's tokenizer."""
    n_layer: int = 12
    """number of transformer blocks."""
    n_head: int = 12
    """number of query heads."""
    n_kv_head: int | None = None
    """number of key/value heads (grouped-query attention); None means n_head."""
    n_embd: int = 768
    """residual stream width."""
    dropout: float = 0.0
    """dropout on attention weights, residual branches and embeddings."""
    bias: bool = True
    """use biases in Linear and LayerNorm layers."""
    mlp_hidden: int | None = None  # kept None, not 4 n_embd, in config_dict: older files lack it
    """hidden width of each block's MLP; None means 4 n_embd."""
    init_std: float = 0.02
    """standard deviation of the normal draw of every matrix and embedding (residual output projections: init_std
    / sqrt(2 n_layer)); 0.02 is GPT-2's, made for width 768; narrow models may want about n_embd ** -0.5."""
    activation: str = "gelu"
    """the MLP's GELU: gelu (exact, erf) or gelu_tanh (the tanh approximation GPT-2's weights were trained with)."""
    position: str = "learned"
    """learned: an embedding per position up to block_size, which is then the context limit; rope: rotary
    embedding of queries and keys (no position parameters, no context limit: block_size is only the training
    length), so attention is scored past it (docs/models.md)."""
    rope_base: float = 10000.0
    """position: rope's base: pair i of a head turns by position * rope_base^(-2i/head_dim)."""

    def __post_init__(self) -> None:
        _require(self.activation in ("gelu", "gelu_tanh"),
                 f"activation ({self.activation!r}) must be 'gelu' or 'gelu_tanh'")
        _require(self.position in POSITIONS,
                 f"position ({self.position!r}) must be one of {', '.join(map(repr, POSITIONS))}")
        _require(isinstance(self.rope_base, (int, float)) and math.isfinite(self.rope_base) and self.rope_base > 0,
                 f"rope_base ({self.rope_base}) must be a positive number")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        _require(
            self.mlp_hidden is None or (isinstance(self.mlp_hidden, int) and self.mlp_hidden > 0),
            f"mlp_hidden ({self.mlp_hidden}) must be a positive integer or null (4 n_embd)",
        )
        _require(
            self.block_size is not None,
            "block_size (the model's context) is null: give a number (null means data.block_size only in a config "
            "the CLI reads)",
        )
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} ({value}) must be a positive integer")
        _require(self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        _require(
            self.n_head % self.n_kv_head == 0,
            f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})",
        )
        _require(self.position != "rope" or self.head_dim % 2 == 0,
                 f"head_dim (n_embd / n_head = {self.head_dim}) must be even with position 'rope'")
        _require(0.0 <= self.dropout < 1.0, f"dropout ({self.dropout}) must be in [0, 1)")
        _require(
            isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std > 0,
            f"init_std ({self.init_std}) must be a positive number",
        )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_hidden(self) -> int:
        """The MLP's hidden width: mlp_hidden, or 4 n_embd."""
        return self.mlp_hidden or 4 * self.n_embd


@dataclass
class KVCache:
    """Append-only cache of one attention layer, compact KV-head layout.

    k, v: [B, n_kv_head, T_cached, head_dim]; mask: [B, T_cached] (True = a real token) once a padding mask was
    given, else None (every cached token real).
    """

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]


@dataclass
class Padding:
    """Where a batch's real tokens are, for one call of every layer: positions [B, T] (each new token's count of
    real tokens before it in its row) and key_mask [B, P + T] (the cached tokens' mask, then the new ones')."""

    positions: torch.Tensor
    key_mask: torch.Tensor

    @classmethod
    def of(cls, mask: torch.Tensor | None, cache, idx: torch.Tensor) -> Padding | None:
        """The padding of new tokens idx [B, T] with ``mask`` [B, T] or None after a layer's ``cache`` (its ``mask``
        and ``length``) or None; None when every token, cached and new, is real (the unmasked path)."""
        past_mask = None if cache is None else cache.mask
        if mask is None and past_mask is None:
            return None
        batch, length = idx.shape
        if mask is None:
            mask = torch.ones(batch, length, dtype=torch.bool, device=idx.device)
        if past_mask is None:
            past_mask = torch.ones(batch, 0 if cache is None else cache.length, dtype=torch.bool, device=idx.device)
        return cls(*padded_positions(mask.to(torch.bool), past_mask))

    @property
    def past_mask(self) -> torch.Tensor:
        """[B, P]: the cached tokens' mask."""
        return self.key_mask[:, :self.key_mask.shape[1] - self.positions.shape[1]]

    def check_context(self, block_size: int, what: str) -> None:
        """One line when a row's real tokens pass ``block_size``."""
        if self.positions.numel() and int(self.positions.max()) >= block_size:
            raise LtcxError(f"{what} of {int(self.positions.max()) + 1} real tokens exceeds the model's context "
                            f"block_size={block_size}; use a shorter prompt or fewer new tokens")


class GQAAttention(nn.Module):
    """Causal grouped-query self-attention through ``scaled_dot_product_attention``; with ``position: rope`` queries
    and keys are rotated by their absolute positions (the model's tables of the call; the cache keeps rotated
    keys)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=config.bias)
        self.kv_proj = nn.Linear(config.n_embd, 2 * config.n_kv_head * config.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] -> q [B, H, T, D], k and v [B, H_kv, T, D]."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(batch, length, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, padding: Padding | None = None,
                rope: RopeTables | None = None) -> tuple[torch.Tensor, KVCache]:
        """x [B, T, C] at positions [P, P+T), where P is the cache length (with ``padding``: its positions, masked
        keys left out) -> (y [B, T, C], extended cache). ``rope``: the tables of those positions (``position: rope``;
        ``GPT.rope_tables``)."""
        q, k, v = self.project(x)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        key_mask = None if padding is None else padding.key_mask
        y = causal_gqa_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, key_mask=key_mask)
        y = y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.resid_dropout(self.c_proj(y)), KVCache(k, v, key_mask)


class MLP(nn.Module):
    """GELU feed-forward n_embd -> hidden_size (default 4 n_embd) -> n_embd."""

    def __init__(self, config: GPTConfig, hidden_size: int | None = None) -> None:
        super().__init__()
        hidden_size = hidden_size or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden_size, bias=config.bias)
        self.c_proj = nn.Linear(hidden_size, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = "tanh" if getattr(config, "activation", "gelu") == "gelu_tanh" else "none"  # Titans: none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: nn.Module) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = attention
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, config.ffn_hidden)

    def forward(self, x: torch.Tensor, cache=None, padding: Padding | None = None, rope: RopeTables | None = None):
        """``rope``: the call's rotary tables, given to an attention that rotates (None: the others, unchanged)."""
        normed = self.ln_1(x)
        attended, cache = self.attn(normed, cache, padding) if rope is None else self.attn(normed, cache, padding, rope)
        x = x + attended
        return x + self.mlp(self.ln_2(x)), cache


class GPT(Backbone):
    """GPT language model with grouped-query attention.

    Keeps the backbone contract: ``logits [B, T, V], state = model(idx [B, T], state=None)``, where the
    state is a tuple with one append-only cache per layer. Constructor: the fields of ``config_class``
    (``GPT(block_size=..., n_layer=...)``); a subclass extends the config and swaps the attention
    through ``make_attention``.
    """

    config_class = GPTConfig

    def __init__(self, **fields) -> None:
        super().__init__()
        config = self.config = self.config_class(**fields)
        if config.position == "rope" and type(self).make_attention is not GPT.make_attention:
            raise ConfigError(f"position ('rope') rotates the GPT's own attention; {type(self).__name__}'s attention "
                              "takes position 'learned' only")
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # rope: no position parameters (the rotation is in each attention)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.position == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self.make_attention(config)) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        residual_std = config.init_std / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    @classmethod
    def from_hf(cls, folder) -> GPT:
        """A GPT holding the weights of a GPT-2-layout folder (``GPT2LMHeadModel.save_pretrained``): multi-head, with
        biases, its logits those of the folder's model (``ltcx/models/gpt2_layout.py``)."""
        if cls is not GPT:
            raise LtcxError(f"{cls.__name__}.from_hf: only GPT has GPT-2's layout")
        from ltcx.models.gpt2_layout import gpt_from_gpt2_folder

        return gpt_from_gpt2_folder(folder, GPT)

    def make_attention(self, config: GPTConfig) -> nn.Module:
        """The attention of one block; subclasses swap in another kind."""
        return GQAAttention(config)

    def rope_tables(self, start: int, length: int, padding: Padding | None,
                    device: torch.device) -> RopeTables | None:
        """The rotary tables of a call's new tokens at positions [start, start + length) (with ``padding``: its
        positions), made once for every layer; None without rotary positions."""
        if self.config.position != "rope":
            return None
        return self._rope_tables(start, length, padding, device, self.config.head_dim)

    def _rope_tables(self, start: int, length: int, padding: Padding | None, device: torch.device,
                     dim: int) -> RopeTables:
        positions = torch.arange(start, start + length, device=device) if padding is None else padding.positions
        dtype = activation_dtype(self.wte.weight.dtype, device)  # the rotated projections' (autocast's, where on)
        return rope_tables(positions, dim, dtype, self.config.rope_base)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    @property
    def max_seq_len(self) -> int | None:
        """The context limit: block_size with learned positions, None with rope."""
        return None if self.config.position == "rope" else self.config.block_size

    def parameter_count(self, exclude_position_embeddings: bool = True) -> int:
        """Number of distinct parameters; nanoGPT's convention leaves out the position embeddings."""
        total = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        return total - self.wpe.weight.numel() if exclude_position_embeddings and self.wpe is not None else total

    def forward_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of the forward pass per token when training on sequences of ``seq_len`` tokens.

        Matrix products only (element-wise work, norms and softmax are not counted): 2 per weight per token
        for every projection, the MLP and the head (the tied embedding counted once, as the head's matmul;
        lookups are free), plus causal attention: a query at position i sees i + 1 keys, (T + 1) / 2 on
        average, and scores and values cost 2 D each per key and query head:

            2 (L (C (H D + 2 G D + H D) + 2 C F) + C V) + L * 2 H D (T + 1)

        (C n_embd, H/G query/KV heads, D head dim, F the MLP width (mlp_hidden, 4 C by default), V vocabulary,
        L layers, T seq_len).
        """
        c = self.config
        head_dim, ffn = c.head_dim, c.ffn_hidden
        layer_weights = c.n_embd * (2 * c.n_head * head_dim + 2 * c.n_kv_head * head_dim) + 2 * c.n_embd * ffn
        attention = 2 * c.n_head * head_dim * (seq_len + 1)
        return 2 * (c.n_layer * layer_weights + c.n_embd * c.vocab_size) + c.n_layer * attention

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'): each layer's KV cache, keys and values [1, G, tokens, D], 2 L G D tokens numbers. Reads the
        config alone, so a search may call it on a config (``ltcx/study/budget.py``)."""
        c = self.config
        _require(0 <= tokens and (c.position == "rope" or tokens <= c.block_size),
                 f"tokens ({tokens}) must be in [0, block_size={c.block_size}]")
        return 2 * c.n_layer * c.n_kv_head * c.head_dim * tokens * model_dtype(self, dtype).itemsize

    def output_head(self) -> nn.Linear:
        """The tied head ``forward`` applies to ``forward_hidden``'s states."""
        return self.lm_head

    def forward_hidden(self, idx: torch.Tensor, state: tuple | None = None, with_state: bool = True,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple | None]:
        """``forward`` before the head: (final hidden states [B, T, C], after ln_f, new state; None with ``with_state``
        False, as every backbone's: the caches are the keys and values the layers computed anyway).

        With ``mask`` [B, T] (or a cache that kept one), positions count each row's real tokens and attention leaves
        the masked keys out; the caches keep the mask, so later calls (``mask`` None: all real) leave them out too."""
        past_len = 0 if state is None else state[0].length
        length = idx.shape[1]
        padding = Padding.of(mask, None if state is None else state[0], idx)
        x = self.wte(idx)
        if padding is not None:
            if self.wpe is not None:
                padding.check_context(self.config.block_size, "a sequence")
                x = x + self.wpe(padding.positions)
        elif self.wpe is not None:
            if past_len + length > self.config.block_size:
                raise LtcxError(
                    f"sequence of {past_len + length} tokens exceeds the model's context block_size="
                    f"{self.config.block_size}; use a shorter prompt or fewer new tokens"
                )
            x = x + self.wpe(torch.arange(past_len, past_len + length, device=idx.device))
        x = self.drop(x)
        rope = self.rope_tables(past_len, length, padding, idx.device)
        new_state = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, None if state is None else state[i], padding, rope)
            new_state.append(cache)
        return self.ln_f(x), tuple(new_state) if with_state else None
