"""LTC GPT: the GQA GPT whose attention score is q_i^T M_{i-j}(x_0) k_j / sqrt(d).

Per KV head, M orthonormal decay modes u_m (QR of a learned matrix) each decay with their own time
constant tau_m(x_0) = tau_min / sigmoid(r_m + delta_m(x_0)), where x_0 is the attention input (after
ln_1) at position 0 of the sequence, visible to every position, so the controller is causal. The
time constants are fixed for the sequence and kept in the cache. The equations and the factorised
fast form live in ``ltcx.ops.ltc``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ltcx.errors import ConfigError, LtcxError
from ltcx.models.gpt import GPT, GPTConfig, GQAAttention, Padding
from ltcx.models.inference_cache import derived_in_inference
from ltcx.models.state import model_dtype
from ltcx.ops import ltc as ltc_ops
from ltcx.ops.attention import causal_gqa_attention


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# exp((block_size - 1) / (2 tau_min)) must stay far from float32/bf16 overflow (e^88) and its inverse
# from underflow; the default tau_min = block_size / 12 gives exponents within +-6.
MAX_EXPONENT = 40.0


@dataclass
class LTCConfig(GPTConfig):
    """Shape of an LTC GPT, the constructor arguments of ``LTCGPT``: the GPT fields plus the decay modes and their
    controller."""

    bias: bool = GPTConfig.bias  # re-documented here, its default (and place) the GPT's
    """use biases in Linear and LayerNorm layers (the LTC controller always has one)."""
    # LTC's attention has its own positions (learned, the decay's); the GPT's rotary option is not an argument
    position: str = field(default="learned", init=False, repr=False)
    rope_base: float = field(default=GPTConfig.rope_base, init=False, repr=False)
    num_decay_modes: int = 64
    """orthonormal decay modes per KV head, from 1 to head_dim (n_embd / n_head)."""
    controller_rank: int = 0
    """>0 makes the time-constant controller low rank (W = A B); only with one decay mode."""
    controller_hidden_size: int = 0
    """>0 makes the time-constant controller an MLP with this hidden width."""
    tau_min: float | None = None
    """smallest time constant in tokens; None means block_size / 12."""

    def __post_init__(self) -> None:
        super().__post_init__()
        head_dim = self.head_dim
        modes = self.num_decay_modes
        _require(
            isinstance(modes, int) and 1 <= modes <= head_dim,
            f"num_decay_modes ({modes}) must be between 1 and head_dim ({head_dim})",
        )
        for name in ("controller_rank", "controller_hidden_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 0, f"{name} ({value}) must be a non-negative integer")
        _require(
            self.controller_rank == 0 or modes == 1,
            f"controller_rank ({self.controller_rank}) must be 0 when num_decay_modes ({modes}) is more than 1",
        )
        _require(
            self.controller_rank == 0 or self.controller_hidden_size == 0,
            f"controller_rank ({self.controller_rank}) and controller_hidden_size ({self.controller_hidden_size}) "
            "can not both be positive: choose a low-rank linear or an MLP controller",
        )
        if self.tau_min is None:
            self.tau_min = self.block_size / 12
        _require(
            isinstance(self.tau_min, (int, float)) and math.isfinite(self.tau_min) and self.tau_min > 0,
            f"tau_min ({self.tau_min}) must be a positive number",
        )
        self.tau_min = float(self.tau_min)
        smallest = (self.block_size - 1) / (2 * MAX_EXPONENT)
        _require(
            self.tau_min >= smallest,
            f"tau_min ({self.tau_min}) must be at least (block_size - 1) / {2 * MAX_EXPONENT:g} = {smallest:g}, "
            "or the factorised exponents overflow; the default is block_size / 12",
        )


@dataclass
class LTCCache:
    """Append-only cache of one LTC attention layer, compact KV-head layout, every tensor batch-first.

    k: [B, G, T_cached, D] keys already rotated into the modal basis and scaled (valid for every later
       query thanks to the fixed centre); v: [B, G, T_cached, D].
    tau: [B, G, M] the time constants set by the first token of the prompt (float32/float64).
    mask: [B, T_cached] (True = a real token) once a padding mask was given, else None (every token real).
    The basis is not kept: it depends on the parameters only, and new queries and keys are rotated by
    the projection weights folded with it (``LTCAttention.rotated_projections``).
    """

    k: torch.Tensor
    v: torch.Tensor
    tau: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]


class LTCAttention(GQAAttention):
    """Grouped-query attention with modal, input-conditioned exponential decay of the scores.

    Parameters beyond GQA (reference config: 57,600 a layer):
      modal_matrix [G, D, M]: unconstrained; QR gives the modes (its scale is discarded).
      controller: x_0 [C] -> delta [G * M]; one Linear with bias by default, Linear(C, rank) then
        Linear(rank, G * M) with controller_rank > 0, Linear-GELU-Linear with controller_hidden_size > 0.
      tau_offset r [G, M]: tau = tau_min / sigmoid(r + delta).
    """

    def __init__(self, config: LTCConfig) -> None:
        super().__init__(config)
        groups, head_dim, modes = config.n_kv_head, config.head_dim, config.num_decay_modes
        self.num_decay_modes, self.tau_min = modes, config.tau_min
        self.block_size, self.centre = config.block_size, ltc_ops.centre(config.block_size)
        self.modal_matrix = nn.Parameter(torch.randn(groups, head_dim, modes))
        out = groups * modes
        if config.controller_rank > 0:
            self.controller = nn.Sequential(
                nn.Linear(config.n_embd, config.controller_rank, bias=False), nn.Linear(config.controller_rank, out)
            )
        elif config.controller_hidden_size > 0:
            hidden = config.controller_hidden_size
            self.controller = nn.Sequential(nn.Linear(config.n_embd, hidden), nn.GELU(), nn.Linear(hidden, out))
        else:
            self.controller = nn.Linear(config.n_embd, out)
        # Initial time constants spread log-uniformly from 2 tau_min (r = 0) up to 16 block_size (nearly
        # no decay), like ALiBi's spread of slopes; the controller (init N(0, init_std)) then moves them.
        low = min(0.5, config.tau_min / (16 * config.block_size))
        rate = torch.logspace(math.log10(0.5), math.log10(low), modes) if modes > 1 else torch.tensor([0.5])
        self.tau_offset = nn.Parameter(torch.logit(rate).repeat(groups, 1))

    def time_constants(self, x0: torch.Tensor) -> torch.Tensor:
        """x0 [B, C], the attention input at position 0 -> tau [B, G, M] (float32, or float64)."""
        delta = self.controller(x0).view(x0.shape[0], self.n_kv_head, self.num_decay_modes)
        dtype = torch.promote_types(self.tau_offset.dtype, torch.float32)
        return ltc_ops.time_constants(self.tau_offset.to(dtype) + delta.to(dtype), self.tau_min)

    def _fold_projections(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """q and kv projection weights (and biases) with the rotation Q^T folded into the q and k rows."""
        basis = ltc_ops.modal_basis(self.modal_matrix)  # [G, D, D]
        groups, head_dim = self.n_kv_head, self.head_dim
        q_w = ltc_ops.rotate_projection(self.q_proj.weight, basis)
        q_b = None if self.q_proj.bias is None else ltc_ops.rotate_projection(self.q_proj.bias, basis)
        k_w, v_w = self.kv_proj.weight.split(groups * head_dim)
        kv_w, kv_b = torch.cat([ltc_ops.rotate_projection(k_w, basis), v_w]), None
        if self.kv_proj.bias is not None:
            k_b, v_b = self.kv_proj.bias.split(groups * head_dim)
            kv_b = torch.cat([ltc_ops.rotate_projection(k_b, basis), v_b])
        return q_w, q_b, kv_w, kv_b

    def rotated_projections(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(W_q', b_q', W_kv', b_kv'): the projections whose q and k outputs come out in the modal basis.

        Folding costs (H + G) D^2 C multiply-adds and a QR. It is done every call (with gradients on the
        fold is part of the graph), except between the decode steps of one generation (``keeping_derived``),
        where it is done once, so a decode step costs what a GQA step costs.
        """
        params = (self.q_proj.weight, self.q_proj.bias, self.kv_proj.weight, self.kv_proj.bias, self.modal_matrix)
        return derived_in_inference(self, "rotated_projections", params, self._fold_projections)

    def project_rotated(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like ``project`` but q [B, H, T, D] and k [B, G, T, D] come out in the modal basis (Q^T q, Q^T k),
        not yet scaled; v as in ``project``.

        The rotation lives in the projection weights (no extra pass over [B, H, T, D]): on CPU that cut the
        extra cost of an LTC attention layer (forward + backward, reference shape, batch 4 x 512) from about
        11% to 7%, and it makes a decode step as cheap as GQA's.
        """
        batch, length, _ = x.shape
        q_w, q_b, kv_w, kv_b = self.rotated_projections()
        q = F.linear(x, q_w, q_b).view(batch, length, self.n_head, self.head_dim).transpose(1, 2)
        kv = F.linear(x, kv_w, kv_b).view(batch, length, 2, self.n_kv_head, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: LTCCache | None = None,
                padding: Padding | None = None) -> tuple[torch.Tensor, LTCCache]:
        """x [B, T, C] at positions [P, P+T), P the cache length -> (y [B, T, C], extended cache)."""
        if padding is not None:
            return self._forward_padded(x, cache, padding)
        batch, length, _ = x.shape
        start = 0 if cache is None else cache.length
        if start + length > self.block_size:
            raise LtcxError(
                f"LTC attention got positions up to {start + length}, past block_size={self.block_size}: "
                "the decay exponents are only bounded inside the context"
            )
        # time constants come from the sequence's first token: computed now, or kept in the cache
        tau = self.time_constants(x[:, 0]) if cache is None else cache.tau  # [B, G, M]
        q, k, v = self.project_rotated(x)
        if length == 1:  # a decode step: both scales from one exponent, fewer small ops per token
            q, k = ltc_ops.scale_modes_step(q, k, tau, start, self.centre)
        else:
            q = ltc_ops.scale_modes(q, tau, start, self.centre, is_query=True)
            k = ltc_ops.scale_modes(k, tau, start, self.centre, is_query=False)
        if cache is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        y = causal_gqa_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, length, -1)
        return self.resid_dropout(self.c_proj(y)), LTCCache(k, v, tau)

    def _forward_padded(self, x: torch.Tensor, cache: LTCCache | None,
                        padding: Padding) -> tuple[torch.Tensor, LTCCache]:
        """``forward`` where some tokens are masked: each row's decay offsets i - j count its real tokens, its time
        constants come from its first real token (in this call, where the cache holds none of the row's), and no
        query sees a masked key."""
        batch, length, _ = x.shape
        padding.check_context(self.block_size, "a sequence")
        new_mask = padding.key_mask[:, padding.past_mask.shape[1]:]  # [B, T]
        first = new_mask.to(torch.uint8).argmax(dim=1)  # a row's first real token here (0 where none)
        tau = self.time_constants(x[torch.arange(batch, device=x.device), first])  # [B, G, M]
        if cache is not None:
            seen = padding.past_mask.any(dim=1)[:, None, None]  # rows whose first real token is cached
            tau = torch.where(seen, cache.tau, tau)
        q, k, v = self.project_rotated(x)
        q = ltc_ops.scale_modes(q, tau, padding.positions, self.centre, is_query=True)
        k = ltc_ops.scale_modes(k, tau, padding.positions, self.centre, is_query=False)
        if cache is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        y = causal_gqa_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                 key_mask=padding.key_mask)
        y = y.transpose(1, 2).reshape(batch, length, -1)
        return self.resid_dropout(self.c_proj(y)), LTCCache(k, v, tau, padding.key_mask)


class LTCGPT(GPT):
    """GPT with LTC attention: modal, input-conditioned exponential decay of the attention scores.

    Keeps the backbone contract ``logits [B, T, V], state = model(idx [B, T], state=None)``; the state
    holds one ``LTCCache`` per layer, and the time constants are set by the first token of the sequence.
    Constructor: the fields of ``LTCConfig`` (the GPT's and the decay modes').
    """

    config_class = LTCConfig

    def make_attention(self, config: LTCConfig) -> nn.Module:
        return LTCAttention(config)

    def forward_flops_per_token(self, seq_len: int) -> float:
        """The GPT's count plus LTC's extra: the time-constant controller, which runs once per sequence on
        x_0 (its matmul FLOPs divided by ``seq_len``). Attention itself is the GPT's (one SDPA call on rotated,
        scaled q and k). Not per token and not counted: folding the basis into the q/k weights,
        2 (H + G) D^2 C per layer per call, and the QR of the modal matrix."""
        c = self.config
        out = c.n_kv_head * c.num_decay_modes
        if c.controller_rank:
            weights = c.controller_rank * (c.n_embd + out)
        elif c.controller_hidden_size:
            weights = c.controller_hidden_size * (c.n_embd + out)
        else:
            weights = c.n_embd * out
        return super().forward_flops_per_token(seq_len) + c.n_layer * 2 * weights / seq_len

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """The GPT's KV cache (keys in the modal basis, values) plus each layer's time constants tau [1, G, M], kept
        in float32 (float64 for a float64 model) from the first token on."""
        c = self.config
        tau = c.n_layer * c.n_kv_head * c.num_decay_modes * torch.promote_types(model_dtype(self, dtype),
                                                                                 torch.float32).itemsize
        return super().state_bytes(tokens, dtype) + (tau if tokens else 0)

    def no_weight_decay_param_names(self) -> set[str]:
        """LTC parameters AdamW should not decay (besides every 1-D parameter).

        modal_matrix: QR discards its scale, so decay would only shrink it, which makes the gradient of
        the modes grow as 1/scale (an ever larger effective learning rate) without any regularising use.
        tau_offset: an offset like a bias; decaying it would pull every time constant towards 2 tau_min.
        The controller weights are decayed: that pulls tau towards input-independent values.
        """
        return {
            name
            for name, _ in self.named_parameters()
            if name.endswith("attn.modal_matrix") or name.endswith("attn.tau_offset")
        }
