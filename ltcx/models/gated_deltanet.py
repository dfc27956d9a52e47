"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464): pre-norm residual blocks of a gated delta rule
token mixer and a SwiGLU MLP, as flash-linear-attention's ``GatedDeltaNet`` layer and model build them.

Token mixer, per head h of key width Dk and value width Dv:

* q, k, v: one projection of the normed input, a causal depthwise convolution over time (kernel 4, no bias) and
  SiLU; q and k L2-normalised per head;
* b_t = sigmoid(w_b . x_t), g_t = -exp(A_log) softplus(w_a . x_t + dt_bias) (Mamba-2's decay: a_t = e^{g_t});
* S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t / sqrt(Dk) (``ltcx/ops/gated_delta.py``);
* output: RMSNorm(o_t) per head times silu(gate_t) (the gated norm), then the output projection.

Initialisation as fla's: matrices N(0, 0.02), the projections back into the residual stream N(0, 0.02 /
sqrt(2 n_layer)); A = e^{A_log} ~ U(0, 16); softplus(dt_bias) log-uniform in [0.001, 0.1]; convolutions U(+-1 /
sqrt(K)) (PyTorch's default); norms 1. The output head is tied to the embedding.

State (per block): (S ``[B, H, Dk, Dv]`` float32 (float64 for a float64 model), the convolution's last K - 1 inputs
``[B, K - 1, 2 H Dk + H Dv]``). Training runs the chunked form (or fla's kernels on CUDA, ``backend: kernels``); one
token runs the recurrent step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ltcx.errors import ConfigError
from ltcx.models.base import Backbone, run_blocks
from ltcx.models.state import model_dtype
from ltcx.ops.conv import causal_depthwise_conv
from ltcx.ops.fla_kernels import fla_kernels_for, gated_delta_fla
from ltcx.ops.gated_delta import gated_delta_chunked, gated_delta_step
from ltcx.ops.l2norm import l2_normalize
from ltcx.ops.precision import compute_dtype

BACKENDS = ("torch", "kernels")
FLA_CHUNK = 64  # the chunks fla's kernels tile with
EPS = 1e-6
INIT_STD = 0.02


@dataclass
class GatedDeltaNetConfig:
    """Hyper-parameters of :class:`GatedDeltaNet`, its constructor arguments; checks itself on construction
    (``ConfigError``)."""

    vocab_size: int = 50304
    """Number of token ids (the CLI sets it from the tokenizer)."""
    n_embd: int = 384
    """Residual stream width E."""
    n_layer: int = 6
    """Number of blocks (token mixer + MLP)."""
    n_head: int = 6
    """Heads of the gated delta rule."""
    head_dim: int = 48
    """Query and key width Dk of a head (fla's rule of thumb: n_head x head_dim = 0.75 n_embd)."""
    head_v_dim: int | None = None
    """Value width Dv of a head; None: 2 x head_dim (fla's expand_v 2)."""
    mlp_hidden: int | None = None
    """Hidden width of the SwiGLU MLP; None: 8 n_embd / 3 rounded up to a multiple of 8."""
    conv_kernel_size: int = 4
    """Kernel of the short causal convolutions over q, k and v."""
    chunk_size: int = 64
    """Chunk length of ltcx's chunked form (training); fla's kernels tile with their own (64)."""
    backend: Literal["torch", "kernels"] = "torch"
    """'torch' (ltcx's chunked form, any device) or 'kernels' (flash-linear-attention's chunk_gated_delta_rule on
    CUDA, `pip install 'ltcx[kernels]'`; on other devices the torch form, with one notice)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "head_dim", "conv_kernel_size", "chunk_size"):
            _positive(self, name)
        for name in ("head_v_dim", "mlp_hidden"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend ({self.backend!r}) must be one of {list(BACKENDS)}")

    @property
    def value_dim(self) -> int:
        """Dv: head_v_dim, or 2 x head_dim."""
        return self.head_v_dim or 2 * self.head_dim

    @property
    def hidden(self) -> int:
        """The MLP's hidden width."""
        return self.mlp_hidden or 8 * math.ceil(self.n_embd / 3)


def _positive(config, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} ({value!r}) must be a positive integer")


class GatedDeltaMixer(nn.Module):
    """The gated delta rule token mixer: forward(x ``[B, T, E]`` normed, state, mask) -> (y ``[B, T, E]``, state)."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        H, dk, dv = cfg.n_head, cfg.head_dim, cfg.value_dim
        self.n_head, self.head_dim, self.value_dim = H, dk, dv
        self.chunk_size, self.backend = cfg.chunk_size, cfg.backend
        # q, k, v | output gate | a | b: one product
        self.split = [2 * H * dk + H * dv, H * dv, H, H]
        self.in_proj = nn.Linear(cfg.n_embd, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.split[0], 1, cfg.conv_kernel_size))
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(0, 16)))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.norm_weight = nn.Parameter(torch.ones(dv))
        self.out_proj = nn.Linear(H * dv, cfg.n_embd, bias=False)
        nn.init.normal_(self.in_proj.weight, std=INIT_STD)
        nn.init.normal_(self.out_proj.weight, std=INIT_STD / math.sqrt(2 * cfg.n_layer))
        bound = 1 / math.sqrt(cfg.conv_kernel_size)
        nn.init.uniform_(self.conv_weight, -bound, bound)

    def forward(self, x: Tensor, state: tuple | None, with_state: bool,
                mask: Tensor | None) -> tuple[Tensor, tuple | None]:
        batch, length, _ = x.shape
        H, dk, dv = self.n_head, self.head_dim, self.value_dim
        S, buffer = (None, None) if state is None else state
        qkv, gate, a, b = self.in_proj(x).split(self.split, dim=-1)
        qkv, buffer = causal_depthwise_conv(qkv, self.conv_weight, None, buffer, mask)
        qk, v = F.silu(qkv).split([2 * H * dk, H * dv], dim=-1)
        # q's heads then k's, normalised in one call: [B, T, 2H, Dk] -> q, k [B, H, T, Dk]
        q, k = l2_normalize(qk.unflatten(-1, (2 * H, dk)), EPS).transpose(1, 2).chunk(2, dim=1)
        v = v.unflatten(-1, (H, dv)).transpose(1, 2)  # [B, H, T, Dv]
        dtype = compute_dtype(x.dtype)  # the gates in float32: bf16 would round the decays
        beta = torch.sigmoid(b.to(dtype)).transpose(1, 2)  # [B, H, T]
        g = (-self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))).transpose(1, 2)
        if mask is not None:  # a padded position: no write, no decay
            real = mask.unsqueeze(1).to(dtype)
            beta, g = beta * real, g * real
        if length == 1:
            o, S = gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[..., 0], beta[..., 0], S)
            o = o.unsqueeze(2)
        elif self.backend == "kernels" and fla_kernels_for("Gated DeltaNet", x.device, self.training):
            o, S = gated_delta_fla(q, k, v, g, beta, S)
        else:
            o, S = gated_delta_chunked(q, k, v, g, beta, S, chunk_size=self.chunk_size)
        o = o.transpose(1, 2)  # [B, T, H, Dv]
        o = F.rms_norm(o, (dv,), self.norm_weight, EPS) * F.silu(gate.unflatten(-1, (H, dv)))
        return self.out_proj(o.flatten(-2)), (S, buffer) if with_state else None


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one product."""

    def __init__(self, width: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        nn.init.normal_(self.up.weight, std=INIT_STD)
        nn.init.normal_(self.down.weight, std=INIT_STD / math.sqrt(2 * n_layer))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GatedDeltaNetBlock(nn.Module):
    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.mixer_norm = nn.RMSNorm(cfg.n_embd, eps=EPS)
        self.mixer = GatedDeltaMixer(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=EPS)
        self.mlp = SwiGLU(cfg.n_embd, cfg.hidden, cfg.n_layer)

    def forward(self, x: Tensor, state: tuple | None, with_state: bool,
                mask: Tensor | None) -> tuple[Tensor, tuple | None]:
        y, state = self.mixer(self.mixer_norm(x), state, with_state, mask)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class GatedDeltaNet(Backbone):
    """Gated DeltaNet language model: ``logits, state = model(idx, state=None)``.

    Constructor: the fields of ``GatedDeltaNetConfig``.
    """

    config_class = GatedDeltaNetConfig
    # how the rule is computed (the same function of the same weights) may change on resume
    resumable_fields = frozenset({"backend", "chunk_size"})

    def __init__(self, **fields) -> None:
        super().__init__()
        cfg = self.config = self.config_class(**fields)
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(GatedDeltaNetBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=EPS)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=INIT_STD)
        self.head.weight = self.embedding.weight

    def output_head(self) -> nn.Linear:
        return self.head

    def forward_hidden(self, idx: Tensor, state: list | None = None, with_state: bool = True,
                       mask: Tensor | None = None) -> tuple[Tensor, list | None]:
        """(final hidden states ``[B, T, E]`` after the norm, state: a (S, conv buffer) per block; None with
        ``with_state`` False)."""
        x, new_state = run_blocks(self.blocks, self.embedding(idx), state, with_state, mask)
        return self.norm(x), new_state

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (matrix products, 2 per multiply-add) when training on ``seq_len`` tokens; E width,
        H heads of Dk and Dv, F the MLP's hidden width, V vocabulary:

        * per block: the input projection 2 E (2 H Dk + 2 H Dv + 2 H), the output projection 2 H Dv E, the MLP
          2 E 2F + 2 F E;
        * the chunked rule per head, in chunks of L = min(chunk_size, T) (the last padded; N of them): each chunk's
          k k^T and q k^T (4 L^2 Dk), the intra-chunk read P U (2 L^2 Dv), and the products with the chunk's state
          W S, (e^{G_L - G} k)^T U and (e^G q) S (6 L Dk Dv); the triangular solve (a ``solve_triangular``, not a
          product) is not counted. fla's kernels (``backend: kernels``, as on CUDA) tile with L = 64;
        * head: 2 E V (tied with the embedding: counted once).
        """
        cfg = self.config
        E, H, dk, dv, V = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.value_dim, cfg.vocab_size
        size = min(FLA_CHUNK if cfg.backend == "kernels" else cfg.chunk_size, seq_len)
        chunks = -(-seq_len // size)
        rule = H * chunks * (4 * size * size * dk + 2 * size * size * dv + 6 * size * dk * dv) / seq_len
        block = 2 * E * (2 * H * dk + 2 * H * dv + 2 * H) + 2 * H * dv * E + 6 * E * cfg.hidden + rule
        return cfg.n_layer * block + 2 * E * V

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'); a constant from the first token on: per block S [1, H, Dk, Dv] in float32 (float64 for a
        float64 model) and the convolution's buffer [1, K - 1, 2 H Dk + H Dv] in the model's dtype."""
        if not tokens:
            return 0
        cfg = self.config
        numbers = model_dtype(self, dtype)
        H, dk, dv = cfg.n_head, cfg.head_dim, cfg.value_dim
        per_block = H * dk * dv * compute_dtype(numbers).itemsize \
            + (cfg.conv_kernel_size - 1) * (2 * H * dk + H * dv) * numbers.itemsize
        return cfg.n_layer * per_block

    def no_weight_decay_param_names(self) -> set[str]:
        """The embedding (tied to the head) and A_log, dt_bias (fla's ``_no_weight_decay``) besides the vectors."""
        return {name for name, p in self.named_parameters()
                if p.ndim < 2 or name.startswith("embedding.") or name.endswith(("A_log", "dt_bias"))}
