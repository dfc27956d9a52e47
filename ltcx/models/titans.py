"""Titans (Behrouz, Zhong, Mirrokni 2025, "Titans: Learning to Memorize at Test Time", arXiv 2501.00663).

A neural long-term memory (LMM, ``ltcx/ops/titans.py``: a per-head residual MLP written by gradient descent
with momentum and forgetting at test time) combined with local attention in one of four ways:

* ``mag`` (memory as gate, eq. 26-28): each layer runs sliding-window attention y and the memory m on the
  same input and mixes them as ``W_O(N_y(y) * sigmoid(N_m(m)))``.
* ``mac`` (memory as context, eq. 21-25, read causally): per segment of ``segment`` tokens, the memory read
  h_j = M(q_j; W^seg) with the weights of the segment start joins the attention as extra keys/values
  (token i sees h_j and x_j for j <= i of its segment); the attention output y is written into the memory
  and mixed with the memory's read of it, ``W_O(N_y(y) * sigmoid(N_m(m)))``.
* ``mal`` (memory as layer, eq. 29-31, H3-like): memory blocks and sliding-window attention blocks alternate.
* ``lmm``: memory blocks only (the paper's "Titans (LMM)").

Every attention uses RoPE at absolute positions and per-layer persistent key/value slots (eq. 19) that every
query sees, scored position-free. There is no absolute position embedding and no context limit: the
generation state has a constant size (memory weights, momentum, short-conv buffers and a bounded window or
segment cache). Where the paper's MAC text would read the future within a segment (h from every token of the
segment, and o_t read from memory written with the whole segment) this module keeps the causal reading;
the README says why.

The state, per layer, batch-first: ``MemoryCache`` (memory state + conv buffer) for the memory,
``(k, v)`` of the last ``window - 1`` positions for sliding-window attention, and for MAC the current
segment's keys/values, the segment-start memory weights and the x-stream query conv buffer. In a padded batch (a
mask) each row keeps its own position: the memory skips masked steps (``neural_memory_recurrent``), the window
cache keeps each row's last real keys; MAC, whose segment caches would differ in length, runs row by row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ltcx.errors import ConfigError
from ltcx.models.base import Backbone
from ltcx.models.fused import triton_kernels
from ltcx.models.gpt import MLP
from ltcx.models.state import RowStates, model_dtype, reorder_state
from ltcx.ops.attention import (
    RopeTables,
    WindowPlan,
    apply_rope,
    attend_with_slots,
    attention_with_persistent,
    rope_tables,
    sliding_window_attention,
    slot_keys_values,
    window_plan,
    with_slot_columns,
)
from ltcx.ops.conv import causal_depthwise_conv
from ltcx.ops.l2norm import l2_normalize
from ltcx.ops.precision import activation_dtype, compute_dtype, without_autocast
from ltcx.ops.titans import (
    MemoryState,
    chunk_sizes,
    initial_memory_state,
    memory_apply,
    memory_gates,
    neural_memory,
    neural_memory_recurrent,
)

VARIANTS = ("mag", "mac", "mal", "lmm")
THETA_MODES = ("chunk", "free")
MEMORY_BACKENDS = ("torch", "triton")


@dataclass
class TitansConfig:
    """Hyper-parameters of :class:`Titans`, its constructor arguments; checks itself on construction
    (``ConfigError`` naming the field)."""

    vocab_size: int = 50304
    """output vocabulary; set by the CLI from the data's tokenizer."""
    n_embd: int = 384
    """residual stream width."""
    n_layer: int = 6
    """number of blocks (mal: memory and attention blocks alternate, memory first)."""
    variant: str = "mag"
    """how memory and attention combine: mag (memory as gate), mac (as context), mal (as layer) or lmm (memory
    only)."""
    n_head: int = 6
    """attention query heads; head_dim = n_embd / n_head must be even (RoPE)."""
    n_kv_head: int = 2
    """attention key/value heads (grouped-query attention); divides n_head."""
    mlp_hidden: int | None = None
    """hidden width of each block's MLP; None means 4 n_embd."""
    window: int = 128
    """sliding-window attention (mag, mal): query i sees tokens i - window < j <= i."""
    segment: int = 128
    """MAC's attention segment; a multiple of memory_chunk_size."""
    n_persistent: int = 16
    """persistent key/value slots per attention layer, seen by every query."""
    mem_heads: int = 6
    """memory heads; mem_heads x mem_head_dim must equal n_embd for mag and mac."""
    mem_head_dim: int = 64
    """width of each memory head's keys, values and queries."""
    mem_hidden: int = 128
    """hidden width of each head's memory MLP."""
    memory_chunk_size: int | None = 16
    """b: the memory's gradients are taken at the weights of the chunk start; None means never moved (always at
    the learned initial memory)."""
    conv_kernel: int = 4
    """kernel of the short causal conv after the memory's q, k, v projections."""
    theta_mode: str = "chunk"
    """the memory's step size: chunk, theta = rho (1 - eta) / b; free, theta = theta_max sigmoid(.)."""
    rho_max: float = 1.0
    """largest rho (chunk mode), in (0, 1]: a chunk of aligned tokens moves the memory by at most 2 rho."""
    theta_max: float = 0.1
    """largest theta (free mode)."""
    normalize_step: bool = True
    """divide theta by the curvature kappa of the token's loss."""
    memory_backend: str = "torch"
    """the memory's training and prefill form: torch (``ltcx/ops/titans.py``, any device) or triton (two fused kernels
    a layer, ``ltcx/ops/titans_triton.py``, where ``ltcx/models/fused.py`` says). One token steps in torch."""
    rope_base: float = 10000.0
    """base of the rotary position embedding."""
    dropout: float = 0.0
    """dropout on embeddings and residual branches."""
    bias: bool = False
    """biases in attention/MLP Linear layers and LayerNorms."""
    tie_embeddings: bool = True
    """share the token embedding with the output head."""
    init_std: float = 0.02
    """standard deviation of the normal draw of the embeddings, linear maps, memory projections and persistent
    slots (residual output projections: init_std / sqrt(2 n_layer)); 0.02 is the spec's (A.2); narrow models may want
    about n_embd ** -0.5. M_0 keeps its own unit-scale draw."""

    def __post_init__(self) -> None:
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.n_embd
        self._validate()

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def memory_width(self) -> int:
        return self.mem_heads * self.mem_head_dim

    def _validate(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ConfigError(message)

        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "n_kv_head", "mlp_hidden", "window", "segment",
                     "mem_heads", "mem_head_dim", "mem_hidden", "conv_kernel"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    f"{name} ({value!r}) must be a positive integer")
        chunk = self.memory_chunk_size
        require(chunk is None or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0),
                f"memory_chunk_size ({chunk!r}) must be a positive integer or null (gradients always at the initial "
                "memory)")
        require(isinstance(self.n_persistent, int) and self.n_persistent >= 0,
                f"n_persistent ({self.n_persistent!r}) must be a non-negative integer")
        require(self.variant in VARIANTS, f"variant ({self.variant!r}) must be one of {list(VARIANTS)}")
        require(self.theta_mode in THETA_MODES, f"theta_mode ({self.theta_mode!r}) must be one of {list(THETA_MODES)}")
        require(self.memory_backend in MEMORY_BACKENDS,
                f"memory_backend ({self.memory_backend!r}) must be one of {list(MEMORY_BACKENDS)}")
        require(self.n_embd % self.n_head == 0, f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        require(self.head_dim % 2 == 0, f"head dim n_embd / n_head ({self.head_dim}) must be even for RoPE")
        require(self.n_head % self.n_kv_head == 0,
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.variant in ("mag", "mac"):
            require(self.memory_width == self.n_embd,
                    f"mem_heads x mem_head_dim ({self.mem_heads} x {self.mem_head_dim} = {self.memory_width}) must "
                    f"equal n_embd ({self.n_embd}) for variant {self.variant!r}: the memory gates the attention output")
        if self.variant == "mac" and chunk is not None:
            require(self.segment % chunk == 0,
                    f"segment ({self.segment}) must be a multiple of memory_chunk_size ({chunk})")
        require(0.0 < self.rho_max <= 1.0, f"rho_max ({self.rho_max}) must be in (0, 1]")
        require(self.theta_max > 0, f"theta_max ({self.theta_max}) must be > 0")
        require(self.rope_base > 0, f"rope_base ({self.rope_base}) must be > 0")
        require(0.0 <= self.dropout < 1.0, f"dropout ({self.dropout}) must be in [0, 1)")
        require(isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std > 0,
                f"init_std ({self.init_std!r}) must be a positive number")


# ----------------------------------------------------------------------------- state


class MemoryCache(NamedTuple):
    """One memory stream: the memory's weights and momentum, and its conv buffer [B, K-1, 3 mem width]."""

    memory: MemoryState
    conv: Tensor


class WindowCache(NamedTuple):
    """Rotated keys and values of the last window - 1 positions: [B, H_kv, <= window - 1, D] each; after a padded
    batch, each row's last window - 1 real ones, with mask [B, L] (False: none there) and their positions [B, L]."""

    k: Tensor
    v: Tensor
    mask: Tensor | None = None
    positions: Tensor | None = None


class Padding(NamedTuple):
    """A padded batch's call: positions [B, T] (each token's count of real tokens before it in its row), past [B]
    (each row's tokens before the call), mask [B, T] (True = a real token)."""

    positions: Tensor
    past: Tensor
    mask: Tensor


def memory_position(position: int, padding: Padding | None) -> tuple[int | Tensor, Tensor | None]:
    """The memory's (position, mask) for a call at ``position``: a padded batch's rows each count their own."""
    return (position, None) if padding is None else (padding.past, padding.mask)


class MAGState(NamedTuple):
    attention: WindowCache
    memory: MemoryCache


class MACState(NamedTuple):
    """segment: keys/values (h-stream, x-stream) of the current segment so far, [B, H_kv, L, D] each, or
    None at a segment start; segment_weights: memory (W1, W2) at the segment start; query_conv: conv buffer
    of the x-stream memory queries [B, K-1, mem width]; memory: the y-stream memory."""

    segment: tuple[Tensor, Tensor, Tensor, Tensor] | None
    segment_weights: tuple[Tensor, Tensor]
    query_conv: Tensor
    memory: MemoryCache


class SegmentPiece(NamedTuple):
    """The part of a MAC call in one segment: ``length`` tokens at the call's offsets [start, start + length), the
    first at absolute position ``position``; mask [length, N_p + 2 L]: every slot, then the segment's L memory-read
    keys and its L token keys up to the piece's end (causal)."""

    start: int
    length: int
    position: int
    mask: Tensor


class AttentionSetup(NamedTuple):
    """What the attention layers of one call share, made once per forward (``attention_setup``): the rotary tables
    of the call's positions, the sliding window's plan (mag, mal; unpadded calls) and MAC's pieces."""

    rope: RopeTables
    window: WindowPlan | None = None
    pieces: tuple[SegmentPiece, ...] | None = None


def segment_pieces(position: int, length: int, cached: int, segment: int, slots: int,
                   device: torch.device) -> tuple[SegmentPiece, ...]:
    """MAC's pieces of ``length`` tokens at positions [P, P + T) (P = ``position``) in segments of ``segment``, the
    first piece's segment holding ``cached`` tokens before it."""
    pieces, start = [], 0
    while start < length:
        n = min(segment - (position + start) % segment, length - start)
        keys = n + (cached if start == 0 else 0)  # the segment's tokens up to the piece's end
        causal = torch.ones(n, keys, dtype=torch.bool, device=device).tril(keys - n)  # key j <= query i
        pieces.append(SegmentPiece(start, n, position + start, with_slot_columns(torch.cat([causal, causal], 1),
                                                                                  slots)))
        start += n
    return tuple(pieces)


def attention_setup(config: TitansConfig, position: int, length: int, cached: int, batch: int,
                    device: torch.device, dtype: torch.dtype) -> AttentionSetup:
    """The ``AttentionSetup`` of an unpadded call of ``length`` tokens after ``position`` tokens, each attention layer
    holding ``cached`` keys before them (its window cache, or MAC's current segment), rotary tables in ``dtype``."""
    rope = rope_tables(torch.arange(position, position + length, device=device), config.head_dim, dtype,
                       config.rope_base)
    if config.variant == "mac":
        return AttentionSetup(rope, pieces=segment_pieces(position, length, cached, config.segment,
                                                          config.n_persistent, device))
    return AttentionSetup(rope, window_plan(position, length, cached + length, config.window, config.n_persistent,
                                            batch, device))


@dataclass
class TitansState:
    """position: tokens consumed so far (absolute position of the next token), or after a padded batch each row's
    real tokens [B]; layers: one state per block."""

    position: int | Tensor
    layers: tuple


# ----------------------------------------------------------------------------- layers

Projection = tuple[Tensor, Tensor | None]
"""A linear map's (weight [out, C], bias [out] or None), as ``stacked_linear`` reads it."""


def stacked_linear(x: Tensor, groups: list[list[Projection]]) -> list[Tensor]:
    """Every map of ``groups`` applied to x [B, T, C], in one product with the weights stacked (its backward two
    products and a cat, not two products a map and a sum of the input's gradients) -> [B, T, out] a group, the
    outputs of its maps side by side. A bias-free map's bias is zeros, padded onto its neighbours' (one pad where
    a single map has a bias, not a zero tensor a map and a cat)."""
    maps = [projection for group in groups for projection in group]
    weight = torch.cat([w for w, _ in maps]) if len(maps) > 1 else maps[0][0]
    biases, zeros = [], 0  # [zeros before, bias, zeros after]; zeros: the bias-free width since the last bias
    for w, b in maps:
        if b is None:
            zeros += w.shape[0]
        else:
            biases.append([zeros, b, 0])
            zeros = 0
    if biases:
        biases[-1][2] = zeros
    biases = [F.pad(b, (before, after)) if before or after else b for before, b, after in biases]
    bias = torch.cat(biases) if len(biases) > 1 else biases[0] if biases else None
    return list(F.linear(x, weight, bias).split([sum(w.shape[0] for w, _ in group) for group in groups], dim=-1))


class NeuralMemory(nn.Module):
    """The LMM core: projections, short causal conv, per-token gates, and the memory of ``ltcx/ops/titans.py``.

    forward(u [B, T, C], cache, position) -> (m [B, T, mem width], cache): writes every token (key k_t,
    value v_t) and reads y_t = M_t(q_t) after writing it. q and k are l2-normalised SiLU outputs, v a SiLU
    output (paper section 4.4). The memory runs in float32 (float64 stays float64) with autocast off, and
    its state stays in that dtype whatever the model's dtype.
    """

    def __init__(self, config: TitansConfig, input_width: int) -> None:
        super().__init__()
        self.config = config
        width = config.memory_width
        self.qkv = nn.Linear(input_width, 3 * width, bias=False)  # W_Q^m, W_K^m, W_V^m
        self.conv_weight = nn.Parameter(torch.empty(3 * width, 1, config.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(3 * width))
        self.gates = nn.Linear(input_width, 3 * config.mem_heads)  # pre-activations of alpha, eta, theta
        self.w1_init = nn.Parameter(torch.empty(config.mem_heads, config.mem_hidden, config.mem_head_dim))
        self.w2_init = nn.Parameter(torch.empty(config.mem_heads, config.mem_head_dim, config.mem_hidden))
        self.compiled = False  # compile: ops (Titans.compile_ops): training calls through the compiled memory
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Spec A.2: projections N(0, init_std = 0.02); conv U(+-1/sqrt(K)); gate weights 0 with biases -6 (alpha, a
        retention of 0.28 over 512 tokens), 0 (eta = 0.5), 0 (rho = 0.5); M_0 with unit-scale
        pre-activations for unit queries: W1 ~ N(0, 1/dk), W2 ~ N(0, 1/dm)."""
        config = self.config
        nn.init.normal_(self.qkv.weight, std=config.init_std)
        bound = 1.0 / math.sqrt(config.conv_kernel)
        nn.init.uniform_(self.conv_weight, -bound, bound)
        nn.init.zeros_(self.conv_bias)
        nn.init.zeros_(self.gates.weight)
        with torch.no_grad():
            self.gates.bias.copy_(torch.tensor([-6.0, 0.0, 0.0]).repeat_interleave(config.mem_heads))
        nn.init.normal_(self.w1_init, std=config.mem_head_dim ** -0.5)
        nn.init.normal_(self.w2_init, std=config.mem_hidden ** -0.5)

    def initial_weights(self, batch_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """M_0 expanded over the batch: (W1 [B, H, dm, dk], W2 [B, H, dk, dm])."""
        state = initial_memory_state(self.w1_init.to(dtype), self.w2_init.to(dtype), batch_size)
        return state.w1, state.w2

    def _heads(self, x: Tensor) -> Tensor:
        """[B, T, H * dk] -> [B, H, T, dk]."""
        return x.unflatten(-1, (self.config.mem_heads, self.config.mem_head_dim)).transpose(1, 2)

    def projections(self) -> list[Projection]:
        """The maps of the memory's input u, for ``stacked_linear``: W_Q^m | W_K^m | W_V^m, then the gates."""
        return [(self.qkv.weight, None), (self.gates.weight, self.gates.bias)]

    def query_projection(self) -> Projection:
        """W_Q^m alone (MAC's read of the x-stream), for ``stacked_linear``."""
        return self.qkv.weight[:self.config.memory_width], None

    def read_queries(self, projected: Tensor, buffer: Tensor | None) -> tuple[Tensor, Tensor]:
        """The query path alone (MAC's read of the x-stream, sharing W_Q^m and the q conv): projected = u W_Q^m
        [B, T, mem width] (``query_projection``) -> (q [B, H, T, dk] in the compute dtype, new conv buffer)."""
        width = self.config.memory_width
        projected, buffer = causal_depthwise_conv(projected, self.conv_weight[:width], self.conv_bias[:width], buffer)
        q = l2_normalize(F.silu(self._heads(projected.to(compute_dtype(projected.dtype)))))
        return q, buffer

    def forward(self, u: Tensor, cache: MemoryCache | None, position: int | Tensor,
                with_state: bool = True, mask: Tensor | None = None) -> tuple[Tensor, MemoryCache | None]:
        """u [B, T, C] after ``position`` tokens (with ``mask`` [B, T]: each row's own count [B], and masked steps
        skipped by the conv and the memory, token by token, whatever the memory backend) -> (m, cache)."""
        qkv, gates = stacked_linear(u, [[p] for p in self.projections()])
        return self.from_projections(qkv, gates, u.dtype, cache, position, with_state, mask)

    def from_projections(self, qkv: Tensor, gates: Tensor, out_dtype: torch.dtype, cache: MemoryCache | None,
                         position: int | Tensor, with_state: bool = True,
                         mask: Tensor | None = None) -> tuple[Tensor, MemoryCache | None]:
        """``forward`` from the projections of u (``projections``): qkv [B, T, 3 mem width], gates [B, T, 3 H];
        m comes back in ``out_dtype`` (u's)."""
        config = self.config
        batch, length, _ = qkv.shape
        projected, conv = causal_depthwise_conv(
            qkv, self.conv_weight, self.conv_bias, None if cache is None else cache.conv, mask=mask
        )
        dtype = compute_dtype(out_dtype)
        with without_autocast(qkv.device):
            # One SiLU over q | k | v, split as views: its backward one stack and one copy back to [B, T, 3 H dk].
            q, k, v = F.silu(projected.to(dtype)).unflatten(-1, (3, config.mem_heads, -1)).permute(2, 0, 3, 1, 4)
            q, k = l2_normalize(torch.stack((q, k))).unbind(0)  # one call for both
            if config.theta_mode == "chunk":
                # theta = rho (1 - eta) / b: a chunk of b aligned tokens moves the memory by at most 2 rho (A.4).
                scale, coupled = config.rho_max / (config.memory_chunk_size or 1), True
            else:
                scale, coupled = config.theta_max, False
            log_retain, log_momentum, step = memory_gates(gates.to(dtype), config.mem_heads, scale, coupled)
            state = cache.memory if cache is not None else initial_memory_state(
                self.w1_init.to(dtype), self.w2_init.to(dtype), batch
            )
            if mask is not None:
                y, state = neural_memory_recurrent(q, k, v, log_retain, log_momentum, step, state, position,
                                                   config.memory_chunk_size, config.normalize_step, mask=mask)
                return y.transpose(1, 2).flatten(2).to(out_dtype), MemoryCache(state, conv) if with_state else None
            memory_fn = neural_memory_recurrent if length == 1 else neural_memory
            kernels = None if config.memory_backend != "triton" or length == 1 else triton_kernels(
                "ltcx.ops.titans_triton", "memory_backend", "torch", qkv.device, self.training)
            if kernels is not None:
                memory_fn = kernels.neural_memory_triton
            elif self.compiled and length > 1 and torch.is_grad_enabled():  # compile: ops (Titans.compile_ops)
                memory_fn = _compiled_neural_memory()
            y, state = memory_fn(
                q, k, v, log_retain, log_momentum, step, state, position, config.memory_chunk_size,
                config.normalize_step, with_state=with_state,
            )
        return y.transpose(1, 2).flatten(2).to(out_dtype), MemoryCache(state, conv) if with_state else None


class TitansAttention(nn.Module):
    """Grouped-query attention with RoPE and per-layer persistent key/value slots; the projections and the
    attention itself (each block applies its own output projection)."""

    def __init__(self, config: TitansConfig) -> None:
        super().__init__()
        self.config = config
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=config.bias)
        self.kv_proj = nn.Linear(config.n_embd, 2 * config.n_kv_head * self.head_dim, bias=config.bias)
        slots = (config.n_kv_head, config.n_persistent, self.head_dim)
        self.persistent_k = nn.Parameter(torch.randn(slots) * config.init_std)
        self.persistent_v = nn.Parameter(torch.randn(slots) * config.init_std)

    def projections(self) -> list[Projection]:
        """The maps of the attention's input x, for ``stacked_linear``: W_Q, then W_K | W_V."""
        return [(self.q_proj.weight, self.q_proj.bias), (self.kv_proj.weight, self.kv_proj.bias)]

    def heads(self, projected: Tensor, rope: RopeTables) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """projected = x [W_Q | W_K | W_V] [B, T, (H + 2 H_kv) D] (``projections``), ``rope`` the tables of its
        positions -> (q, RoPE(q)) [B, H, T, D], (RoPE(k), v) [B, H_kv, T, D]; q and k rotated in one call."""
        heads = projected.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # [B, H + 2 H_kv, T, D]
        qk, v = heads.split([self.n_head + self.n_kv_head, self.n_kv_head], dim=1)
        q_rot, k_rot = apply_rope(qk, rope).split([self.n_head, self.n_kv_head], dim=1)
        return qk[:, :self.n_head], q_rot, k_rot, v

    def project(self, x: Tensor, rope: RopeTables) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``heads`` of x [B, T, C]."""
        return self.heads(*stacked_linear(x, [self.projections()]), rope)

    def keys_values(self, x: Tensor, rope: RopeTables) -> tuple[Tensor, Tensor]:
        """x [B, T, C], ``rope`` the tables of its positions -> (RoPE(k), v) [B, H_kv, T, D]."""
        k, v = self.kv_proj(x).unflatten(-1, (2, self.n_kv_head, self.head_dim)).permute(2, 0, 3, 1, 4)
        return apply_rope(k, rope), v

    def attend(self, q: Tensor, q_rot: Tensor, k_rot: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """-> merged heads [B, T, H * D]."""
        dropout = self.config.dropout if self.training else 0.0
        y = attention_with_persistent(q, q_rot, k_rot, v, self.persistent_k, self.persistent_v, mask, dropout)
        return y.transpose(1, 2).flatten(2)

    def sliding_window(self, heads: tuple[Tensor, Tensor, Tensor, Tensor], cache: WindowCache | None,
                       setup: AttentionSetup) -> tuple[Tensor, WindowCache]:
        """``heads`` (q, q_rot, k_rot, v) of x [B, T, C], ``setup`` the call's (its window plan over the cached and
        new keys) -> (y [B, T, H * D], the keys/values of the last window - 1 positions)."""
        window = self.config.window
        q, q_rot, k_rot, v = heads
        if cache is not None:
            k_rot, v = torch.cat([cache.k, k_rot], dim=2), torch.cat([cache.v, v], dim=2)
        dropout = self.config.dropout if self.training else 0.0
        y = sliding_window_attention(q, q_rot, k_rot, v, self.persistent_k, self.persistent_v, setup.window,
                                     dropout).transpose(1, 2).flatten(2)
        keep = min(window - 1, k_rot.shape[2])
        return y, WindowCache(k_rot[:, :, k_rot.shape[2] - keep:], v[:, :, v.shape[2] - keep:])

    def sliding_window_padded(self, heads: tuple[Tensor, Tensor, Tensor, Tensor], cache: WindowCache | None,
                              padding: Padding) -> tuple[Tensor, WindowCache]:
        """``sliding_window`` of a padded batch: query i sees the real keys at its row's positions (p_i - window,
        p_i] (a masked query its own key too, so it stays finite), one masked call over all cached and new keys ->
        (y [B, T, H * D], each row's last window - 1 real keys with their mask and positions); ``heads`` rotated by
        the tables of padding's positions."""
        positions, past, mask = padding
        q, q_rot, k_rot, v = heads
        (batch, length), window, device = mask.shape, self.config.window, mask.device
        key_mask, key_positions = mask, positions
        if cache is not None and cache.k.shape[2]:
            cached = cache.k.shape[2]
            if cache.mask is None:  # an unpadded cache: the positions just before each row's
                cache_mask = torch.ones(batch, cached, dtype=torch.bool, device=device)
                cache_positions = past[:, None] - cached + torch.arange(cached, device=device)
            else:
                cache_mask, cache_positions = cache.mask, cache.positions
            k_rot, v = torch.cat([cache.k, k_rot], dim=2), torch.cat([cache.v, v], dim=2)
            key_mask = torch.cat([cache_mask, mask], dim=1)
            key_positions = torch.cat([cache_positions, positions], dim=1)
        total = key_mask.shape[1]
        columns = torch.arange(total, device=device)
        query_columns = columns[total - length:]
        offset = positions[:, :, None] - key_positions[:, None, :]  # [B, T, L]
        visible = (offset >= 0) & (offset < window) & key_mask[:, None, :] \
            & (columns[None, None, :] <= query_columns[None, :, None])
        visible = visible | (columns[None, None, :] == query_columns[None, :, None])
        y = self.attend(q, q_rot, k_rot, v, visible[:, None])
        keep = min(window - 1, total)
        last = torch.argsort(key_mask.to(torch.uint8), dim=1, stable=True)[:, total - keep:]  # the last real keys
        pick = last[:, None, :, None]
        kept_k = k_rot.gather(2, pick.expand(-1, k_rot.shape[1], -1, k_rot.shape[3]))
        kept_v = v.gather(2, pick.expand(-1, v.shape[1], -1, v.shape[3]))
        return y, WindowCache(kept_k, kept_v, key_mask.gather(1, last), key_positions.gather(1, last))


def block_setup(config: TitansConfig, x: Tensor, position: int, cached: int,
                padding: Padding | None) -> AttentionSetup:
    """The setup of a block's call x [B, T, C] (``attention_setup``; with ``padding``, the tables of its positions
    alone), for a block called without the model's."""
    dtype = activation_dtype(x.dtype, x.device)
    if padding is not None:
        return AttentionSetup(rope_tables(padding.positions, config.head_dim, dtype, config.rope_base))
    return attention_setup(config, position, x.shape[1], cached, x.shape[0], x.device, dtype)


def _layer_norm(config: TitansConfig, width: int) -> nn.LayerNorm:
    return nn.LayerNorm(width, bias=config.bias)


class MAGBlock(nn.Module):
    """Memory as gate: x += W_O(N_y(SWA(x')) * sigmoid(N_m(LMM(x')))), x' = LN(x); then the MLP."""

    def __init__(self, config: TitansConfig) -> None:
        super().__init__()
        self.ln_1 = _layer_norm(config, config.n_embd)
        self.attn = TitansAttention(config)
        self.memory = NeuralMemory(config, config.n_embd)
        self.norm_y = _layer_norm(config, config.n_embd)
        self.norm_m = _layer_norm(config, config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.ln_2 = _layer_norm(config, config.n_embd)
        self.mlp = MLP(config, config.mlp_hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, state: MAGState | None, position: int, with_state: bool = True,
                padding: Padding | None = None, setup: AttentionSetup | None = None) -> tuple[Tensor, MAGState | None]:
        """``setup``: the call's (``attention_setup``; None: made here)."""
        normed = self.ln_1(x)
        cache = None if state is None else state.attention
        if setup is None:
            setup = block_setup(self.attn.config, x, position, 0 if cache is None else cache.k.shape[2], padding)
        # the attention's q | k | v, the memory's q | k | v and its gates: one product
        qkv_map, gates_map = self.memory.projections()
        projected, qkv, gates = stacked_linear(normed, [self.attn.projections(), [qkv_map], [gates_map]])
        heads = self.attn.heads(projected, setup.rope)
        if padding is None:
            y, attention = self.attn.sliding_window(heads, cache, setup)
        else:
            y, attention = self.attn.sliding_window_padded(heads, cache, padding)
        where, mask = memory_position(position, padding)
        m, memory = self.memory.from_projections(qkv, gates, normed.dtype, None if state is None else state.memory,
                                                 where, with_state, mask)
        x = x + self.dropout(self.gated_output(y, m))
        return x + self.mlp(self.ln_2(x)), MAGState(attention, memory) if with_state else None

    def gated_output(self, y: Tensor, m: Tensor) -> Tensor:
        """W_O(N_y(y) * sigmoid(N_m(m))), y, m [B, T, C] -> [B, T, C]."""
        # glu(a | b) = a * sigmoid(b): one backward op for the product and the sigmoid
        return self.out_proj(F.glu(torch.cat([self.norm_y(y), self.norm_m(m)], dim=-1)))


class MACBlock(MAGBlock):
    """Memory as context, segment by segment (segments at absolute positions [sC, (s+1)C)):

    h_j = M(q^x_j; W^seg) read with the segment-start weights; query i attends over the persistent slots and
    the projections of N_h(h_j) and x'_j for the j <= i of its segment; the attention output y is written into the
    memory (write-then-read, its own conv and gates) and x += W_O(N_y(y) * sigmoid(N_m(M_i(q^y_i)))).
    The modules are MAG's plus N_h.
    """

    def __init__(self, config: TitansConfig) -> None:
        super().__init__(config)
        self.config = config
        self.norm_h = _layer_norm(config, config.n_embd)

    def forward(self, x: Tensor, state: MACState | None, position: int, with_state: bool = True,
                setup: AttentionSetup | None = None) -> tuple[Tensor, MACState | None]:
        """``setup``: the call's (``attention_setup``; None: made here)."""
        batch, dim = x.shape[0], self.config.head_dim
        if setup is None:
            cached = 0 if state is None or state.segment is None else state.segment[0].shape[2]
            setup = block_setup(self.config, x, position, cached, None)
        normed = self.ln_1(x)
        projected, projected_memory = stacked_linear(normed, [self.attn.projections(),
                                                              [self.memory.query_projection()]])
        q, q_rot, k_x, v_x = self.attn.heads(projected, setup.rope)
        q_memory, query_conv = self.memory.read_queries(projected_memory, None if state is None else state.query_conv)
        shared = None  # the segment's weights where every row has the same (M_0), read per head: [H, ...]
        if state is None:
            segment, memory = None, None
            segment_weights = self.memory.initial_weights(batch, q_memory.dtype)  # M_0 expanded, as states carry it
            shared = tuple(w[0] for w in segment_weights)
        else:
            segment, segment_weights, memory = state.segment, state.segment_weights, state.memory
        # Split once (its backward one cat) rather than slice per piece (each slice's backward a zero-filled tensor).
        sizes = [piece.length for piece in setup.pieces]
        query = torch.cat([q_rot, q], dim=-1)  # [B, H, T, 2D]
        parts = zip(setup.pieces, *(t.split(sizes, dim=2) for t in (query, q_memory, k_x, v_x, F.pad(k_x, (0, dim)))))
        slot_k, slot_v = slot_keys_values(self.attn.persistent_k, self.attn.persistent_v, batch, k_x.dtype)
        dropout = self.config.dropout if self.training else 0.0
        ys, ms = [], []  # per piece; the output gating runs once over them all
        for piece, query, q_memory_piece, k_x_piece, v_x_piece, token_k_piece in parts:  # a piece per segment touched
            with without_autocast(x.device):
                h = memory_apply(*(shared or segment_weights), q_memory_piece)  # eq. 21: read with W^seg
            rope = setup.rope.at(slice(piece.start, piece.start + piece.length))
            k_h, v_h = self.attn.keys_values(self.norm_h(h.transpose(1, 2).flatten(2).to(x.dtype)), rope)
            keys_values = (k_h, v_h, k_x_piece, v_x_piece)
            if segment is None:  # keys [slots | h | x]: the x keys' zero half padded once for every piece
                keys, values = [slot_k, F.pad(k_h, (0, dim)), token_k_piece], [slot_v, v_h, v_x_piece]
            else:
                keys_values = tuple(torch.cat([old, new], dim=2) for old, new in zip(segment, keys_values))
                keys = [slot_k, F.pad(torch.cat(keys_values[::2], dim=2), (0, dim))]  # [k_h | k_x]
                values = [slot_v, torch.cat(keys_values[1::2], dim=2)]
            mask, total = piece.mask, keys_values[0].shape[2]  # the setup's, unless the segment holds other keys
            if mask.shape[-1] != slot_k.shape[2] + 2 * total:
                mask = segment_pieces(piece.position, piece.length, total - piece.length, self.config.segment,
                                      slot_k.shape[2], x.device)[0].mask
            y = attend_with_slots(query, keys, values, mask, dropout).transpose(1, 2).flatten(2)
            end = piece.position + piece.length
            discarded = not with_state and piece.start + piece.length == x.shape[1]  # the last piece's state: unread
            m, memory = self.memory(y, memory, piece.position, not discarded)
            ys.append(y)
            ms.append(m)
            if discarded:
                break
            if end % self.config.segment == 0:  # segment finished: the next one reads the updated memory
                segment, segment_weights, shared = None, (memory.memory.w1, memory.memory.w2), None
            else:
                segment = keys_values
        x = x + self.dropout(self.gated_output(torch.cat(ys, dim=1), torch.cat(ms, dim=1)))
        new_state = MACState(segment, segment_weights, query_conv, memory) if with_state else None
        return x + self.mlp(self.ln_2(x)), new_state


class MemoryBlock(nn.Module):
    """A memory layer (MAL, LMM): x += W_O^m(N_m(LMM(x')) * SiLU(x' W_G)), x' = LN(x); then the MLP."""

    def __init__(self, config: TitansConfig) -> None:
        super().__init__()
        width = config.memory_width
        self.ln_1 = _layer_norm(config, config.n_embd)
        self.memory = NeuralMemory(config, config.n_embd)
        self.norm_m = _layer_norm(config, width)
        self.gate_proj = nn.Linear(config.n_embd, width, bias=config.bias)
        self.out_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.ln_2 = _layer_norm(config, config.n_embd)
        self.mlp = MLP(config, config.mlp_hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, state: MemoryCache | None, position: int, with_state: bool = True,
                padding: Padding | None = None,
                setup: AttentionSetup | None = None) -> tuple[Tensor, MemoryCache | None]:
        """``setup``: the attention layers' (none here)."""
        normed = self.ln_1(x)
        # the memory's q | k | v, its gates and the output gate: one product
        qkv_map, gates_map = self.memory.projections()
        qkv, gates, gate = stacked_linear(normed, [[qkv_map], [gates_map], [(self.gate_proj.weight,
                                                                             self.gate_proj.bias)]])
        where, mask = memory_position(position, padding)
        m, state = self.memory.from_projections(qkv, gates, normed.dtype, state, where, with_state, mask)
        x = x + self.dropout(self.out_proj(self.norm_m(m) * F.silu(gate)))
        return x + self.mlp(self.ln_2(x)), state


class SWABlock(nn.Module):
    """Sliding-window attention layer (MAL): x += c_proj(SWA(LN(x))); then the MLP."""

    def __init__(self, config: TitansConfig) -> None:
        super().__init__()
        self.ln_1 = _layer_norm(config, config.n_embd)
        self.attn = TitansAttention(config)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.ln_2 = _layer_norm(config, config.n_embd)
        self.mlp = MLP(config, config.mlp_hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, state: WindowCache | None, position: int, with_state: bool = True,
                padding: Padding | None = None,
                setup: AttentionSetup | None = None) -> tuple[Tensor, WindowCache | None]:
        """``setup``: the call's (``attention_setup``; None: made here)."""
        if setup is None:
            setup = block_setup(self.attn.config, x, position, 0 if state is None else state.k.shape[2], padding)
        heads = self.attn.project(self.ln_1(x), setup.rope)
        if padding is None:
            y, state = self.attn.sliding_window(heads, state, setup)
        else:
            y, state = self.attn.sliding_window_padded(heads, state, padding)
        x = x + self.dropout(self.c_proj(y))
        return x + self.mlp(self.ln_2(x)), state if with_state else None


def _make_blocks(config: TitansConfig) -> list[nn.Module]:
    if config.variant == "mag":
        return [MAGBlock(config) for _ in range(config.n_layer)]
    if config.variant == "mac":
        return [MACBlock(config) for _ in range(config.n_layer)]
    if config.variant == "mal":  # (memory, attention) pairs, as H3 alternates its layers
        return [MemoryBlock(config) if i % 2 == 0 else SWABlock(config) for i in range(config.n_layer)]
    return [MemoryBlock(config) for _ in range(config.n_layer)]


class Titans(Backbone):
    """Titans language model: token embedding, ``n_layer`` blocks of the chosen variant, LayerNorm, tied head.

    Keeps the backbone contract ``logits [B, T, V], state = model(idx [B, T], state=None)``; the state
    (:class:`TitansState`) has a constant size, so there is no context limit (``max_seq_len`` is None).

    Constructor: the fields of :class:`TitansConfig`.
    """

    config_class = TitansConfig

    def __init__(self, **fields) -> None:
        super().__init__()
        config = self.config = self.config_class(**fields)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_make_blocks(config))
        self.ln_f = _layer_norm(config, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """N(0, init_std) for embeddings and linear maps, residual output projections N(0, init_std / sqrt(2
        n_layer)) (GPT-2's rule), then each memory's own initialisation (gates, conv, M_0)."""
        init_std = self.config.init_std
        residual_std = init_std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("out_proj", "c_proj")) else init_std
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, NeuralMemory):
                module.reset_parameters()

    def forward_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of the forward pass per token when training on sequences of ``seq_len`` tokens from position 0.

        Matrix products as the training forms execute them (element-wise work, the short convolutions and the
        curvature are not counted), 2 per multiply-add; C width, H/G query/KV heads of dim D, V vocabulary.

        * Attention (eq. 19 with persistent slots): one SDPA whose queries [RoPE(q) | q] are 2D wide, so each
          visible key costs 2 (2D) for the score and 2 D for the value: 6 D H per key. A query sees the
          n_persistent slots and, under a sliding window, min(window, i + 1) tokens; in MAC the h_j and x_j
          of its own segment up to itself (2 (j + 1) keys); averaged over the T positions.
        * Memory (spec section A.3, per head of width dk, hidden dm, per piece of n tokens at the chunk
          boundaries): key-side forward and analytic backward 6 n dk dm, the four base/momentum products on
          the query side 8 n dk dm (the first piece, whose momentum is M_0's zero, only the two base ones:
          4 n dk dm), the end-of-piece state 8 n dk dm, the intra-piece products
          4 n^2 (dk + dm) and the decay matrices 2 n^3 + 2 n^2; plus its projections 2 C (3 W) and gates
          2 C (3 H_m) (W = H_m dk).
        * MAC also reads the memory at the segment-start weights (2 C W for its queries, 4 dk dm per head)
          and projects k/v a second time from the read.
        * Projections, output projections, the MLP (2 C F twice) and the head 2 C V (tied: counted once).
        """
        c = self.config
        T, C, D, W = seq_len, c.n_embd, c.head_dim, c.memory_width
        dk, dm, heads = c.mem_head_dim, c.mem_hidden, c.mem_heads
        q_kv = 2 * C * (c.n_head * D + 2 * c.n_kv_head * D)
        mlp = 2 * 2 * C * c.mlp_hidden

        def attention(visible_tokens: float) -> float:  # per token: visible keys of one query, all heads
            return 6 * D * c.n_head * (c.n_persistent + visible_tokens)

        window = sum(min(c.window, i + 1) for i in range(T)) / T
        # per token, projections and gates included
        memory = 2 * C * 3 * W + 2 * C * 3 * heads + self._memory_op_flops(self._memory_pieces(T)) / T
        if c.variant == "mac":
            in_segment = sum(2 * (i % c.segment + 1) for i in range(T)) / T
            block = q_kv + 2 * C * W + heads * 4 * dk * dm + 2 * C * 2 * c.n_kv_head * D \
                + attention(in_segment) + memory + 2 * C * C + mlp
            blocks = c.n_layer * block
        else:
            gated = memory + 2 * C * W + 2 * W * C + mlp  # MemoryBlock: gate and output projections
            swa = q_kv + attention(window) + 2 * C * C + mlp
            mag = q_kv + attention(window) + memory + 2 * C * C + mlp
            kinds = {"mag": [mag] * c.n_layer, "lmm": [gated] * c.n_layer,
                     "mal": [gated if i % 2 == 0 else swa for i in range(c.n_layer)]}
            blocks = sum(kinds[c.variant])
        return blocks + 2 * C * c.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x ``forward_flops_per_token`` (the outer backward differentiates every
        product of the forward, including the memory's closed form)."""
        return 3 * self.forward_flops_per_token(seq_len)

    def _memory_pieces(self, seq_len: int) -> list[int]:
        """The pieces ``neural_memory`` cuts a training sequence into: its chunks, or without them MAC's segments
        (each segment's call one piece) and the whole sequence elsewhere."""
        c = self.config
        if c.variant == "mac" and c.memory_chunk_size is None:
            return chunk_sizes(0, seq_len, c.segment)
        return chunk_sizes(0, seq_len, c.memory_chunk_size)

    def _memory_op_flops(self, pieces: list[int]) -> float:
        """Forward FLOPs of the chunkwise memory op (``neural_memory``, the "Memory" terms of
        ``forward_flops_per_token`` less the projections and gates) over ``pieces``, all heads of one layer."""
        c = self.config
        dk, dm = c.mem_head_dim, c.mem_hidden
        work = sum(22 * n * dk * dm + 4 * n * n * (dk + dm) + 2 * n ** 3 + 2 * n * n for n in pieces)
        return c.mem_heads * (work - 4 * pieces[0] * dk * dm)  # no momentum to read in the first piece

    def memory_op_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the memory op alone, summed over the layers that run it (3 x its forward's, as
        ``flops_per_token``): the products any form of ``neural_memory`` has to do."""
        layers = sum(isinstance(module, NeuralMemory) for module in self.modules())  # as built (MAL: every other)
        return 3 * layers * self._memory_op_flops(self._memory_pieces(seq_len)) / seq_len

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'). The memory in float32 (float64 for a float64 model), the rest in the model's dtype
        (G KV heads of D, H_m memory heads of dk, hidden dm, W = H_m dk, K the conv kernel):

        * each memory: weights at the chunk start, current weights and momentum, (W1, W2) of [1, H_m, dm, dk]
          each (6 H_m dm dk numbers; at a chunk boundary the first two equal the next two, and a decoder
          keeping them in place needs both mid-chunk), and the conv buffer [1, K - 1, 3 W];
        * sliding-window attention (mag, mal): RoPE'd keys and values of the last min(window - 1, tokens)
          positions [1, G, ., D] each;
        * MAC: the current segment's keys and values, of the memory's reads and of the tokens (4 x [1, G,
          tokens mod segment, D]), the memory (W1, W2) at the segment start, the query conv buffer [1, K - 1, W].
        """
        if not tokens:
            return 0
        c = self.config
        numbers = model_dtype(self, dtype)
        memory_size, size = compute_dtype(numbers).itemsize, numbers.itemsize
        weights = c.mem_heads * c.mem_hidden * c.mem_head_dim
        kernel, width, kv = c.conv_kernel - 1, c.memory_width, c.n_kv_head * c.head_dim
        memory = 6 * weights * memory_size + kernel * 3 * width * size
        window = 2 * kv * min(c.window - 1, tokens) * size
        if c.variant == "mac":
            segment = 4 * kv * (tokens % c.segment) * size
            return c.n_layer * (memory + segment + 2 * weights * memory_size + kernel * width * size)
        kinds = {"mag": [memory + window] * c.n_layer, "lmm": [memory] * c.n_layer,
                 "mal": [memory if i % 2 == 0 else window for i in range(c.n_layer)]}
        return sum(kinds[c.variant])

    def compile_ops(self) -> None:
        """``compile: ops``: every memory's training calls (a gradient wanted, more than one token) run through one
        ``torch.compile``d ``neural_memory``, a graph per input shape with its chunk loop unrolled: seconds of
        compiling on a CPU where the whole backbone takes minutes. Evaluation, prefill and decoding stay eager, so a
        new length there never waits for a compile."""
        for module in self.modules():
            if isinstance(module, NeuralMemory):
                module.compiled = True

    def no_weight_decay_param_names(self) -> set[str]:
        """The memory's initial weights (decaying M_0 to 0 would kill the inner gradient: with W2 = 0 both the
        write and the read's MLP branch vanish) and the persistent slots (learned tokens, like embeddings)."""
        exempt = ("w1_init", "w2_init", "persistent_k", "persistent_v")
        return {name for name, _ in self.named_parameters() if name.rsplit(".", 1)[-1] in exempt}

    def output_head(self) -> nn.Linear:
        """The tied head ``forward`` applies to ``forward_hidden``'s states."""
        return self.lm_head

    def forward_hidden(self, idx: Tensor, state: TitansState | RowStates | None = None, with_state: bool = True,
                       mask: Tensor | None = None) -> tuple[Tensor, TitansState | RowStates | None]:
        """``forward`` before the head: (final hidden states [B, T, C], after ln_f, new state; None with
        ``with_state`` False, where the memories leave their last chunk's carry out).

        With ``mask`` [B, T], positions (RoPE, the window, the memory's chunks) count each row's real tokens, and
        the rows of the padded batch sit at positions of their own: the state's position is then each row's count
        [B], the window caches keep each row's last real keys, and later calls take this path too (the memory token
        by token, whatever its backend). MAC's segments would each need a cache of their own length per row: a
        padded MAC batch runs row by row, its state ``RowStates`` (one per row; a masked position's hidden state 0).
        """
        if self.config.variant == "mac" and (mask is not None or isinstance(state, RowStates)):
            return self._forward_rows(idx, state, with_state, mask)
        if mask is not None or (state is not None and isinstance(state.position, Tensor)):
            return self._forward_padded(idx, state, with_state, mask)
        position = 0 if state is None else state.position
        x = self.drop(self.wte(idx))
        setup = None if self.config.variant == "lmm" else attention_setup(
            self.config, position, idx.shape[1], self._cached_keys(state), idx.shape[0], idx.device,
            activation_dtype(x.dtype, x.device))
        layer_states = []
        for i, block in enumerate(self.blocks):
            x, layer_state = block(x, None if state is None else state.layers[i], position, with_state, setup=setup)
            layer_states.append(layer_state)
        return self.ln_f(x), TitansState(position + idx.shape[1], tuple(layer_states)) if with_state else None

    def _cached_keys(self, state: TitansState | None) -> int:
        """The keys each attention layer of an unpadded ``state`` holds before the next call: its window cache (mag,
        mal), MAC's current segment."""
        first = 1 if self.config.variant == "mal" else 0  # mal: memory first, then attention
        if state is None or len(state.layers) <= first:
            return 0
        layer = state.layers[first]
        if self.config.variant == "mac":
            return 0 if layer.segment is None else layer.segment[0].shape[2]
        return (layer.attention if self.config.variant == "mag" else layer).k.shape[2]

    def _forward_padded(self, idx: Tensor, state: TitansState | None, with_state: bool,
                        mask: Tensor | None) -> tuple[Tensor, TitansState | None]:
        """``forward_hidden`` of a padded batch (mag, mal, lmm): every row at its own positions."""
        batch, length = idx.shape
        mask = torch.ones_like(idx, dtype=torch.bool) if mask is None else mask.to(torch.bool)
        if state is None:
            past = torch.zeros(batch, dtype=torch.long, device=idx.device)
        elif isinstance(state.position, Tensor):
            past = state.position
        else:
            past = torch.full((batch,), state.position, dtype=torch.long, device=idx.device)
        padding = Padding((past[:, None] + mask.long().cumsum(1) - 1).clamp(min=0), past, mask)
        x = self.drop(self.wte(idx))
        setup = block_setup(self.config, x, 0, 0, padding)
        layer_states = []
        for i, block in enumerate(self.blocks):
            x, layer_state = block(x, None if state is None else state.layers[i], 0, with_state, padding, setup)
            layer_states.append(layer_state)
        return self.ln_f(x), TitansState(past + mask.sum(1), tuple(layer_states)) if with_state else None

    def _forward_rows(self, idx: Tensor, state: TitansState | RowStates | None, with_state: bool,
                      mask: Tensor | None) -> tuple[Tensor, RowStates | None]:
        """``forward_hidden`` row by row over each row's real tokens (all, where ``mask`` is None)."""
        batch, length = idx.shape
        if isinstance(state, RowStates):
            rows = list(state.rows)
        elif state is None:
            rows = [None] * batch
        else:
            rows = [reorder_state(state, torch.tensor([row], device=idx.device)) for row in range(batch)]
        hidden = self.wte.weight.new_zeros(batch, length, self.config.n_embd)
        for row in range(batch):
            real = torch.arange(length, device=idx.device) if mask is None else mask[row].nonzero().flatten()
            if len(real):
                row_hidden, rows[row] = self.forward_hidden(idx[row:row + 1, real], rows[row], with_state)
                hidden[row, real] = row_hidden[0].to(hidden.dtype)
        return hidden, RowStates(tuple(rows)) if with_state else None


@functools.cache
def _compiled_neural_memory():
    """``neural_memory`` through ``torch.compile`` (static shapes), made once per process for every memory."""
    return torch.compile(neural_memory, dynamic=False)
