"""Mamba-2 (Dao & Gu 2024, arXiv 2405.21060): pre-norm residual blocks of the SSD mixer alone (no MLP), as mamba_ssm's
``Mamba2`` layer and ``MambaLMHeadModel`` build them, with one group of B and C.

Mixer, with D_in = n_head x head_dim inner channels and state width N:

* one input projection to z ``[D_in]``, x ``[D_in]``, B, C ``[N]`` and dt ``[H]``;
* a causal depthwise convolution over time (kernel 4, with bias) over (x, B, C), then SiLU;
* dt = softplus(dt + dt_bias), A = -exp(A_log) per head; the SSD recurrence h_t = e^{dt A} h_{t-1} + dt x_t B_t^T,
  y_t = h_t C_t + D x_t (``ltcx/ops/ssd.py``);
* the gated norm RMSNorm(y * silu(z)) over the D_in channels, then the output projection.

Initialisation as mamba_ssm's: A ~ U(1, 16); softplus(dt_bias) log-uniform in [0.001, 0.1]; D = 1; the projections
PyTorch's default (the output projection's divided by sqrt(n_layer), its ``rescale_prenorm_residual``), the
embedding N(0, 0.02), the convolution PyTorch's default; norms 1. The output head is tied to the embedding.

State (per block): (h ``[B, H, P, N]`` float32 (float64 for a float64 model), the convolution's last K - 1 inputs
``[B, K - 1, D_in + 2 N]``). Training runs the chunked dual form (or fla's kernels on CUDA, ``backend: kernels``);
one token runs the recurrent step.
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
from ltcx.ops.fla_kernels import fla_kernels_for, ssd_fla
from ltcx.ops.precision import compute_dtype
from ltcx.ops.ssd import ssd_chunked, ssd_step

BACKENDS = ("torch", "kernels")
EPS = 1e-5


@dataclass
class Mamba2Config:
    """Hyper-parameters of :class:`Mamba2`, its constructor arguments; checks itself on construction
    (``ConfigError``)."""

    vocab_size: int = 50304
    """Number of token ids (the CLI sets it from the tokenizer)."""
    n_embd: int = 384
    """Residual stream width E."""
    n_layer: int = 10
    """Number of Mamba-2 blocks."""
    n_head: int = 12
    """SSD heads H; the inner width is n_head x head_dim (mamba_ssm's expand 2 at 2 n_embd)."""
    head_dim: int = 64
    """Channels P of a head (mamba_ssm's headdim)."""
    d_state: int = 64
    """State width N (the width of B and C)."""
    conv_kernel_size: int = 4
    """Kernel of the short causal convolution over x, B and C."""
    chunk_size: int = 64
    """Chunk length of the chunked dual form (training)."""
    backend: Literal["torch", "kernels"] = "torch"
    """'torch' (ltcx's chunked form, any device) or 'kernels' (flash-linear-attention's chunk_simple_gla, the same
    recurrence, on CUDA, `pip install 'ltcx[kernels]'`; on other devices the torch form, with one notice)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "head_dim", "d_state", "conv_kernel_size",
                     "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} ({value!r}) must be a positive integer")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend ({self.backend!r}) must be one of {list(BACKENDS)}")

    @property
    def inner(self) -> int:
        """D_in = n_head x head_dim."""
        return self.n_head * self.head_dim


class Mamba2Mixer(nn.Module):
    """The SSD mixer: forward(x ``[B, T, E]`` normed, state, mask) -> (y ``[B, T, E]``, state)."""

    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        H, inner, N = cfg.n_head, cfg.inner, cfg.d_state
        self.n_head, self.head_dim, self.d_state = H, cfg.head_dim, N
        self.chunk_size, self.backend = cfg.chunk_size, cfg.backend
        self.split = [inner, inner + 2 * N, H]  # z | x, B, C | dt
        self.in_proj = nn.Linear(cfg.n_embd, sum(self.split), bias=False)
        conv = nn.Conv1d(inner + 2 * N, inner + 2 * N, cfg.conv_kernel_size, groups=inner + 2 * N)  # its init
        self.conv_weight, self.conv_bias = conv.weight, conv.bias
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.D = nn.Parameter(torch.ones(H))
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, cfg.n_embd, bias=False)
        with torch.no_grad():
            self.out_proj.weight /= math.sqrt(cfg.n_layer)

    def forward(self, x: Tensor, state: tuple | None, with_state: bool,
                mask: Tensor | None) -> tuple[Tensor, tuple | None]:
        H, P, N = self.n_head, self.head_dim, self.d_state
        h, buffer = (None, None) if state is None else state
        z, xBC, dt = self.in_proj(x).split(self.split, dim=-1)
        xBC, buffer = causal_depthwise_conv(xBC, self.conv_weight, self.conv_bias, buffer, mask)
        u, B, C = F.silu(xBC).split([H * P, N, N], dim=-1)
        u = u.unflatten(-1, (H, P)).transpose(1, 2)  # [B, H, T, P]
        dtype = compute_dtype(x.dtype)  # dt and A in float32: bf16 would round the decays
        dt = F.softplus(dt.to(dtype) + self.dt_bias.to(dtype)).transpose(1, 2)  # [B, H, T]
        if mask is not None:  # a padded position: e^0 = 1, no input
            dt = dt * mask.unsqueeze(1).to(dtype)
        A = -self.A_log.to(dtype).exp()
        if x.shape[1] == 1:
            y, h = ssd_step(u[:, :, 0], dt[..., 0], A, B[:, 0], C[:, 0], h)
            y = y.unsqueeze(2)
        elif self.backend == "kernels" and fla_kernels_for("Mamba-2", x.device, self.training):
            y, h = ssd_fla(u, dt, A, B, C, h)
        else:
            y, h = ssd_chunked(u, dt, A, B, C, h, chunk_size=self.chunk_size)
        y = (y + self.D.to(y.dtype)[:, None, None] * u).transpose(1, 2).flatten(-2)  # [B, T, D_in]
        y = F.rms_norm(y * F.silu(z), (y.shape[-1],), self.norm_weight, EPS)
        return self.out_proj(y), (h, buffer) if with_state else None


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.n_embd, eps=EPS)
        self.mixer = Mamba2Mixer(cfg)

    def forward(self, x: Tensor, state: tuple | None, with_state: bool,
                mask: Tensor | None) -> tuple[Tensor, tuple | None]:
        y, state = self.mixer(self.norm(x), state, with_state, mask)
        return x + y, state


class Mamba2(Backbone):
    """Mamba-2 language model: ``logits, state = model(idx, state=None)``.

    Constructor: the fields of ``Mamba2Config``.
    """

    config_class = Mamba2Config
    # how the recurrence is computed (the same function of the same weights) may change on resume
    resumable_fields = frozenset({"backend", "chunk_size"})

    def __init__(self, **fields) -> None:
        super().__init__()
        cfg = self.config = self.config_class(**fields)
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=EPS)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.head.weight = self.embedding.weight

    def output_head(self) -> nn.Linear:
        return self.head

    def forward_hidden(self, idx: Tensor, state: list | None = None, with_state: bool = True,
                       mask: Tensor | None = None) -> tuple[Tensor, list | None]:
        """(final hidden states ``[B, T, E]`` after the norm, state: a (h, conv buffer) per block; None with
        ``with_state`` False)."""
        x, new_state = run_blocks(self.blocks, self.embedding(idx), state, with_state, mask)
        return self.norm(x), new_state

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (matrix products, 2 per multiply-add) when training on ``seq_len`` tokens; E width,
        H heads of P channels (D_in = H P), state width N, V vocabulary:

        * per block: the input projection 2 E (2 D_in + 2 N + H), the output projection 2 D_in E;
        * the chunked dual form, in chunks of L = min(chunk_size, T) (the last padded; M of them): per chunk C B^T
          once for all heads (2 L^2 N), and per head the intra-chunk product (2 L^2 P), the chunk's state
          contribution and the read of the state before it (4 L P N); per head the product of the (M + 1)^2 decays
          between chunk boundaries with the chunks' contributions (2 (M + 1)^2 P N);
        * head: 2 E V (tied with the embedding: counted once).
        """
        cfg = self.config
        E, H, P, N, inner, V, T = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.d_state, cfg.inner, cfg.vocab_size, seq_len
        size = min(cfg.chunk_size, T)
        chunks = -(-T // size)
        ssd = chunks * (2 * size * size * N + H * (2 * size * size * P + 4 * size * P * N)) \
            + H * 2 * (chunks + 1) ** 2 * P * N
        block = 2 * E * (2 * inner + 2 * N + H) + 2 * inner * E + ssd / T
        return cfg.n_layer * block + 2 * E * V

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'); a constant from the first token on: per block h [1, H, P, N] in float32 (float64 for a
        float64 model) and the convolution's buffer [1, K - 1, D_in + 2 N] in the model's dtype."""
        if not tokens:
            return 0
        cfg = self.config
        numbers = model_dtype(self, dtype)
        per_block = cfg.inner * cfg.d_state * compute_dtype(numbers).itemsize \
            + (cfg.conv_kernel_size - 1) * (cfg.inner + 2 * cfg.d_state) * numbers.itemsize
        return cfg.n_layer * per_block

    def no_weight_decay_param_names(self) -> set[str]:
        """The embedding (tied to the head), A_log, dt_bias and D (mamba_ssm's ``_no_weight_decay``) besides the
        vectors."""
        return {name for name, p in self.named_parameters()
                if p.ndim < 2 or name.startswith("embedding.") or name.endswith(("A_log", "dt_bias", ".D"))}
