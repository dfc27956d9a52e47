"""xLSTM language model (Beck et al. 2024, arXiv 2405.04517): mLSTM and sLSTM residual blocks.

Blocks, as in the paper's figures (and NX-AI's reference code):

* mLSTM block (pre up-projection): LayerNorm -> up-projection x2 into an mLSTM path and an
  output-gate path; mLSTM path -> causal depthwise conv over time (kernel 4) -> SiLU -> q, k
  (block-diagonal projections); v from the pre-conv path; gates from (q, k, v); mLSTM cell ->
  per-head group norm -> + learnable skip * conv output -> * silu(gate path) -> down-projection.
* sLSTM block (post up-projection): LayerNorm -> causal conv over time -> SiLU feeding the input
  and forget gates (z and o read the normed input); headwise input projections; sLSTM cell with
  block-diagonal recurrence -> per-head group norm -> residual; then LayerNorm -> gated-GeLU
  feed-forward (factor 4/3) -> residual.

Initialisation, as in the paper's reference implementation (NX-AI/xlstm: ``small_init_init_``,
``wang_init_``, ``bias_linspace_init_``, ``mLSTMLayer``/``sLSTMCell``/``GatedFeedForward.reset_parameters``).
E is the embedding width everywhere, also for the block-diagonal projections (not their block size):

* small init N(0, sqrt(2 / (5 E))) (Nguyen & Salazar 2019, "Transformers without tears"): the token
  embedding (and an untied head), the mLSTM up-projection and q/k/v, the sLSTM input weights of all four
  gates, the feed-forward up-projection;
* wang init N(0, 2 / (n_layer sqrt(E))) (GPT-J/NeoX): every projection back into the residual stream
  (mLSTM down-projection, feed-forward down-projection);
* mLSTM gates: weights 0, forget-gate biases linspace(3, 6) over the heads, input-gate biases N(0, 0.1);
* sLSTM: recurrent matrices R = 0 (``recurrent_weight_init="zeros"``); gate biases 0 except the forget
  gate's "powerlaw_blockdependent" profile over each head's units u = 0..d-1,
  b_f(u) = 5 - 12 (u / (d - 1))^(0.3 + 1.3 l / (n_layer - 1)) for the block at position l: from
  +5 (f ~ 0.993, long memory) down to -7 (f ~ 0.001); the exponent grows with depth, so deeper
  blocks keep more units at long memory;
* norms 1 (no biases), learnable skip 1, causal conv weights U(+-1/sqrt(K)) (PyTorch's Conv1d default), conv
  biases 0.

The up-projection widths are rounded up to multiples of 64 as the reference does (``proj_round_to``).

State (per block, a tuple): mLSTM ``(C, n, m, conv_buffer)``; sLSTM ``(c, n, h, m, conv_buffer)``;
the conv buffer holds the block's last ``conv_kernel_size - 1`` conv inputs ``[B, K-1, channels]``.
Training (T > 1) uses the chunkwise (or parallel) mLSTM, ltcx's fused Triton kernels of the parallel form
(``mlstm_backend: triton``, ltcx/ops/mlstm_triton.py) or on CUDA NX-AI's TFLA kernels (``mlstm_backend:
kernels``, :func:`mlstm_kernel_for` says when); one token uses the recurrent step. The sLSTM scan runs the torch
form (ltcx/ops/slstm.py) or, with ``slstm_backend: triton``, its fused Triton kernels (ltcx/ops/slstm_triton.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ltcx.errors import ConfigError, LtcxError, notice_once
from ltcx.models.base import Backbone
from ltcx.models.fused import triton_kernels
from ltcx.models.inference_cache import derived_in_inference
from ltcx.models.state import model_dtype
from ltcx.ops.conv import causal_depthwise_conv
from ltcx.ops.mlstm import FORGET_GATES, mlstm_chunkwise, mlstm_parallel, mlstm_step, state_dtype
from ltcx.ops.mlstm_kernels import (
    KERNEL_CHUNK,
    TRITON_KERNEL,
    kernels_unavailable,
    mlstm_chunkwise_kernels,
    padded_length,
)
from ltcx.ops.slstm import recurrent_weights, slstm_scan_head_major

MLSTM_BACKENDS = ("chunkwise", "parallel", "triton", "kernels")
SLSTM_BACKENDS = ("torch", "triton")


@dataclass
class XLSTMConfig:
    """Hyper-parameters of :class:`XLSTM`, its constructor arguments; checks itself on construction
    (``ConfigError``)."""

    vocab_size: int = 50304
    """Number of token ids (the CLI sets it from the tokenizer)."""
    n_embd: int = 384
    """Residual stream width E."""
    n_layer: int = 8
    """Total number of blocks (mLSTM + sLSTM)."""
    signature: tuple[int, int] = (7, 1)
    """Ratio (mLSTM, sLSTM) of blocks, tiled over the layers, e.g. (7, 1); ignored if slstm_at is set."""
    slstm_at: list[int] | None = None
    """Explicit 0-based positions of the sLSTM blocks (overrides signature); the rest are mLSTM."""
    n_head: int = 4
    """Heads of each mLSTM cell (must divide mlstm_proj_factor * n_embd)."""
    slstm_n_head: int = 4
    """Heads of each sLSTM cell (must divide n_embd); recurrence mixes within heads only."""
    mlstm_proj_factor: float = 2.0
    """Up-projection factor of the mLSTM block (the paper uses 2)."""
    slstm_ffn_factor: float = 4.0 / 3.0
    """Feed-forward factor after the sLSTM cell (the paper uses 4/3)."""
    proj_round_to: int = 64
    """The mLSTM up-projection and the feed-forward widths are rounded up to a multiple of this (64 in the
    reference implementation)."""
    qkv_proj_blocksize: int = 4
    """Block size of the block-diagonal q, k, v projections of the mLSTM block."""
    conv_kernel_size: int = 4
    """Kernel of the causal depthwise convolution over time."""
    chunk_size: int = 64
    """Chunk length of ltcx's chunkwise mLSTM used for training (T > 1); the kernels tile with their own (128)."""
    mlstm_backend: Literal["chunkwise", "parallel", "triton", "kernels"] = "chunkwise"
    """mLSTM form for T > 1: 'chunkwise' (O(T chunk) memory), 'parallel' (O(T^2)), 'triton' (ltcx's fused kernels
    of the parallel form, O(T) memory, where ltcx/models/fused.py says, else chunkwise; a carried state, a mask or a
    wanted final state run the chunkwise form) or 'kernels' (NX-AI's TFLA Triton kernels on CUDA,
    `pip install ltcx[kernels]`; on other devices ltcx's chunkwise form, with one notice)."""
    slstm_backend: Literal["torch", "triton"] = "torch"
    """sLSTM scan: 'torch' (a loop over time, any device) or 'triton' (one fused kernel a direction, where
    ltcx/models/fused.py says, else the torch loop)."""
    forget_gate: Literal["sigmoid", "exp"] = "sigmoid"
    """Forget-gate activation: 'sigmoid' (bounded, default) or 'exp'."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    bias: bool = False
    """Biases in the linear layers and norms (the gate biases always exist)."""
    dropout: float = 0.0
    """Dropout on the embedding and on each block's output."""

    def __post_init__(self) -> None:
        self.signature = tuple(self.signature)
        if self.slstm_at is not None:
            self.slstm_at = list(self.slstm_at)
        self._validate()

    def _round_up(self, width: float) -> int:
        # the reference rounds every up-projection up to a multiple of 64 (its UpProjConfigMixin)
        return self.proj_round_to * math.ceil(width / self.proj_round_to - 1e-9)

    @property
    def mlstm_inner_dim(self) -> int:
        """Width of the mLSTM path: mlstm_proj_factor * n_embd rounded up to proj_round_to."""
        return self._round_up(self.mlstm_proj_factor * self.n_embd)

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the sLSTM block's feed-forward: slstm_ffn_factor * n_embd rounded up to
        proj_round_to."""
        return self._round_up(self.slstm_ffn_factor * self.n_embd)

    @property
    def block_types(self) -> list[str]:
        """'m' or 's' for each of the n_layer blocks."""
        if self.slstm_at is not None:
            at = set(self.slstm_at)
            return ["s" if i in at else "m" for i in range(self.n_layer)]
        m, s = self.signature
        pattern = ["m"] * m + ["s"] * s
        return [pattern[i % len(pattern)] for i in range(self.n_layer)]

    def _validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} ({value!r}) must be a positive integer")

        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "slstm_n_head", "proj_round_to",
                     "qkv_proj_blocksize", "conv_kernel_size", "chunk_size"):
            positive(name)
        if len(self.signature) != 2 or any(not isinstance(x, int) or x < 0 for x in self.signature) \
                or sum(self.signature) < 1:
            raise ConfigError(
                f"signature ({list(self.signature)}) must be two non-negative integers "
                "(mLSTM blocks, sLSTM blocks) with a positive sum, e.g. [7, 1]"
            )
        if self.slstm_at is not None:
            bad = [i for i in self.slstm_at if not isinstance(i, int) or not 0 <= i < self.n_layer]
            if bad:
                raise ConfigError(
                    f"slstm_at ({self.slstm_at}) must hold block positions in [0, n_layer={self.n_layer})"
                )
            if len(set(self.slstm_at)) != len(self.slstm_at):
                raise ConfigError(f"slstm_at ({self.slstm_at}) must not repeat a position")
        if not self.mlstm_proj_factor > 0:
            raise ConfigError(f"mlstm_proj_factor ({self.mlstm_proj_factor}) must be > 0")
        if not self.slstm_ffn_factor > 0:
            raise ConfigError(f"slstm_ffn_factor ({self.slstm_ffn_factor}) must be > 0")
        inner = self.mlstm_inner_dim
        if inner < 1 or inner % self.n_head:
            raise ConfigError(
                f"n_head ({self.n_head}) must divide the mLSTM inner dimension ({inner} = mlstm_proj_factor "
                f"{self.mlstm_proj_factor} x n_embd {self.n_embd}, rounded up to {self.proj_round_to})"
            )
        if inner % self.qkv_proj_blocksize:
            raise ConfigError(
                f"qkv_proj_blocksize ({self.qkv_proj_blocksize}) must divide the mLSTM inner dimension ({inner})"
            )
        if self.n_embd % self.slstm_n_head:
            raise ConfigError(
                f"slstm_n_head ({self.slstm_n_head}) must divide n_embd ({self.n_embd})"
            )
        if self.mlstm_backend not in MLSTM_BACKENDS:
            raise ConfigError(f"mlstm_backend ({self.mlstm_backend!r}) must be one of {list(MLSTM_BACKENDS)}")
        if self.forget_gate not in FORGET_GATES:
            raise ConfigError(f"forget_gate ({self.forget_gate!r}) must be one of {list(FORGET_GATES)}")
        if self.slstm_backend not in SLSTM_BACKENDS:
            raise ConfigError(f"slstm_backend ({self.slstm_backend!r}) must be one of {list(SLSTM_BACKENDS)}")
        if self.mlstm_backend == "kernels" and self.forget_gate != "sigmoid":
            raise ConfigError(
                f"mlstm_backend 'kernels' needs forget_gate 'sigmoid' (NX-AI's kernels have no {self.forget_gate!r} "
                "forget gate): set forget_gate: sigmoid or mlstm_backend: chunkwise"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout ({self.dropout}) must be in [0, 1)")


# ----------------------------------------------------------------------------- layers


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time: out_t depends on x_{t-K+1..t} only.

    Carries the last K-1 inputs, so feeding a sequence in pieces equals feeding it whole
    (the empty buffer is the zero left-padding).
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels))
        bound = 1.0 / math.sqrt(kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Tensor, buffer: Tensor | None = None, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x ``[B, T, C]``, buffer ``[B, K-1, C]``, mask ``[B, T]`` or None (masked inputs skipped) -> (y ``[B, T, C]``,
        new buffer ``[B, K-1, C]``)."""
        return causal_depthwise_conv(x, self.weight, self.bias, buffer, mask=mask)


class HeadwiseLinear(nn.Module):
    """Block-diagonal linear map ``[..., dim] -> [..., dim]`` with blocks of ``block_size`` (no bias): y[n] = W[n] x[n]
    for each block n, one batched product over the blocks. The block-diagonal matrix is never built: assembling it
    would cost a fill and a copy each training step (and their backward), and its zeros would be multiplied.

    The product runs as W[n] x[n]^T (``[n, out, N]`` for N tokens), and y is returned as a view of it (tokens
    innermost): no copy either way, forward or backward; the mLSTM block's readers (the gates' products, the copy into
    heads) take that layout as it is, and the weight's gradient comes out in the weight's own layout."""

    def __init__(self, dim: int, block_size: int) -> None:
        super().__init__()
        self.num_blocks, self.block_size = dim // block_size, block_size
        self.weight = nn.Parameter(torch.empty(self.num_blocks, block_size, block_size))  # [n, out, in]
        nn.init.normal_(self.weight, std=math.sqrt(2.0 / (5.0 * block_size)))

    def forward(self, x: Tensor) -> Tensor:
        columns = x.reshape(-1, self.num_blocks, self.block_size).permute(1, 2, 0)  # [n, in, N]
        return torch.bmm(self.weight, columns).permute(2, 0, 1).reshape(x.shape)


class MultiHeadNorm(nn.Module):
    """Group norm with one group per head, applied per token: ``[..., H, Dh] -> [..., H*Dh]``."""

    def __init__(self, n_head: int, head_dim: int, bias: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_head * head_dim))
        self.bias = nn.Parameter(torch.zeros(n_head * head_dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x, x.shape[-1:], eps=self.eps).flatten(-2) * self.weight
        return y if self.bias is None else y + self.bias


def _small_init_std(dim: int) -> float:
    """'Transformers without tears' init: std = sqrt(2 / (5 dim)) (reference: small_init_init_)."""
    return math.sqrt(2.0 / (5.0 * dim))


def _wang_init_std(dim: int, num_blocks: int) -> float:
    """GPT-J's init of the projections into the residual stream: 2 / (num_blocks sqrt(dim)) (reference: wang_init_)."""
    return 2.0 / num_blocks / math.sqrt(dim)


def slstm_forget_bias(head_dim: int, block_index: int, num_blocks: int) -> Tensor:
    """The reference's "powerlaw_blockdependent" sLSTM forget-gate bias of one head: [head_dim], see the module
    docstring."""
    depth = block_index / (num_blocks - 1) if num_blocks > 1 else 0.0
    return 5.0 - 12.0 * torch.linspace(0.0, 1.0, head_dim) ** (0.3 + 1.3 * depth)


def mlstm_kernel_for(device: torch.device, training: bool) -> str | None:
    """The ``mlstm_kernels`` kernel that an mLSTM block with ``mlstm_backend: kernels`` runs on ``device``, or None for
    ltcx's chunkwise form (the same function: ``tests/test_mlstm_kernels.py``).

    * not CUDA: None, with one notice, so that one YAML runs on a CPU as on a GPU;
    * CUDA without the package (or Triton): training is an error naming ``pip install 'ltcx[kernels]'`` (a run that
      asked for the kernels should not silently train at another speed); evaluation and generation use ltcx's form,
      with one notice, so that a checkpoint trained with the kernels stays usable where they are not installed.
    """
    if device.type != "cuda":
        notice_once(f"mlstm_backend 'kernels' runs on CUDA only; on {device.type} the mLSTM runs ltcx's chunkwise "
                     "form (the same function)")
        return None
    missing = kernels_unavailable()
    if missing is None:
        return TRITON_KERNEL
    fix = ("install a Triton older than 3.9 (PyTorch's CUDA build pins its own)" if "block pointers" in missing
           else "pip install 'ltcx[kernels]'")
    if training:
        raise LtcxError(f"mlstm_backend 'kernels': {missing}: {fix}, or set mlstm_backend: chunkwise")
    notice_once(f"mlstm_backend 'kernels': {missing}; evaluating with ltcx's chunkwise mLSTM (the same function; "
                 f"{fix} for NX-AI's kernels)")
    return None


class MLSTMBlock(nn.Module):
    """Pre-LayerNorm residual mLSTM block. forward(x ``[B, T, E]``, state) -> (x', state)."""

    def __init__(self, cfg: XLSTMConfig) -> None:
        super().__init__()
        E, I, H = cfg.n_embd, cfg.mlstm_inner_dim, cfg.n_head  # noqa: E741 (I: the inner dimension)
        self.n_head, self.head_dim = H, I // H
        self.chunk_size, self.backend, self.forget_gate = cfg.chunk_size, cfg.mlstm_backend, cfg.forget_gate
        self.norm = nn.LayerNorm(E, bias=cfg.bias)
        self.proj_up = nn.Linear(E, 2 * I, bias=cfg.bias)
        self.conv = CausalConv1d(I, cfg.conv_kernel_size)
        self.q_proj = HeadwiseLinear(I, cfg.qkv_proj_blocksize)
        self.k_proj = HeadwiseLinear(I, cfg.qkv_proj_blocksize)
        self.v_proj = HeadwiseLinear(I, cfg.qkv_proj_blocksize)
        self.igate = nn.Linear(3 * I, H)
        self.fgate = nn.Linear(3 * I, H)
        self.out_norm = MultiHeadNorm(H, I // H, bias=cfg.bias)
        self.skip = nn.Parameter(torch.ones(I))
        self.proj_down = nn.Linear(I, E, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

        # initialisation (module docstring): small init with E for the up-projection and q/k/v (not the q/k/v block
        # size)
        for weight in (self.proj_up.weight, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight):
            nn.init.normal_(weight, std=_small_init_std(E))
        nn.init.normal_(self.proj_down.weight, std=_wang_init_std(E, cfg.n_layer))
        # gates start input-independent: input gate ~ 0, forget gate biases spread over 3..6 per head
        nn.init.zeros_(self.igate.weight)
        nn.init.normal_(self.igate.bias, std=0.1)
        nn.init.zeros_(self.fgate.weight)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, H))

    def _gates(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The input and forget gates' pre-activations ``[B, H, T]`` each: igate and fgate of [q, k, v] (each
        ``[B, T, I]``), as one product per part with both gates' weights side by side, so that neither [q, k, v]
        (``[B, T, 3I]``) nor a second pass over it is made. Each product is W part^T ``[2H, B T]``, not part W^T: the
        weight's gradient is then g part, one wide product, not (part^T g)^T, a product only 2H columns wide."""
        weight = torch.cat([self.igate.weight, self.fgate.weight])  # [2H, 3I]
        gates = torch.cat([self.igate.bias, self.fgate.bias]).unsqueeze(-1)  # [2H, 1]
        for part, w in zip((q, k, v), weight.split(q.shape[-1], dim=-1)):
            gates = torch.addmm(gates, w, part.flatten(0, -2).t())  # [2H, B T]
        return gates.view(-1, *q.shape[:-1]).transpose(0, 1).chunk(2, dim=1)

    def forward(self, x: Tensor, state: tuple | None = None, with_state: bool = True,
                mask: Tensor | None = None) -> tuple[Tensor, tuple | None]:
        """x ``[B, T, E]``, mask ``[B, T]`` or None (masked steps leave the cell and the conv buffer as they were; the
        kernels and triton backends then run ltcx's chunkwise form, as masks come with prompts, not training; so does
        the triton backend given a state or asked for one)."""
        B, T, _ = x.shape
        H, Dh = self.n_head, self.head_dim
        cell, buffer = (None, None) if state is None else (tuple(state[:3]), state[3])
        x_m, z = self.proj_up(self.norm(x)).chunk(2, dim=-1)  # [B, T, I] each
        x_c, buffer = self.conv(x_m, buffer, mask)
        x_c = F.silu(x_c)
        q, k, v = self.q_proj(x_c), self.k_proj(x_c), self.v_proj(x_m)
        i_pre, f_pre = self._gates(q, k, v)  # [B, H, T] each

        def heads(t: Tensor) -> Tensor:  # [B, T, I] -> [B, H, T, Dh]
            return t.view(B, T, H, Dh).transpose(1, 2)

        if T == 1:  # generation: the recurrent form
            h, cell = mlstm_step(q.view(B, H, Dh), k.view(B, H, Dh), v.view(B, H, Dh), i_pre[..., 0], f_pre[..., 0],
                                 cell, forget_gate=self.forget_gate, mask=None if mask is None else mask[:, 0])
            h = h.unsqueeze(2)
        elif self.backend == "parallel":
            h, cell = mlstm_parallel(heads(q), heads(k), heads(v), i_pre, f_pre, cell, forget_gate=self.forget_gate,
                                     with_state=with_state, mask=mask)
        elif (self.backend == "triton" and mask is None and cell is None and not with_state
              and (kernels := triton_kernels("ltcx.ops.mlstm_triton", "mlstm_backend", "chunkwise", x.device,
                                             self.training)) is not None):
            h = kernels.mlstm_parallel_triton(heads(q), heads(k), heads(v), i_pre, f_pre, forget_gate=self.forget_gate)
        elif (self.backend == "kernels" and mask is None
              and (kernel := mlstm_kernel_for(x.device, self.training)) is not None):
            h, cell = mlstm_chunkwise_kernels(heads(q), heads(k), heads(v), i_pre, f_pre, cell, kernel=kernel)
        else:
            h, cell = mlstm_chunkwise(heads(q), heads(k), heads(v), i_pre, f_pre, cell, chunk_size=self.chunk_size,
                                      forget_gate=self.forget_gate, with_state=with_state, mask=mask)
        h = self.out_norm(h.transpose(1, 2))  # [B, T, I]
        h = (h + self.skip * x_c) * F.silu(z)
        return x + self.dropout(self.proj_down(h)), (*cell, buffer) if with_state else None


class SLSTMBlock(nn.Module):
    """Pre-LayerNorm residual sLSTM block followed by a gated-GeLU feed-forward block."""

    def __init__(self, cfg: XLSTMConfig, block_index: int) -> None:
        super().__init__()
        E, H = cfg.n_embd, cfg.slstm_n_head
        Dh = E // H
        self.n_head, self.head_dim, self.forget_gate = H, Dh, cfg.forget_gate
        self.backend = cfg.slstm_backend
        self.norm = nn.LayerNorm(E, bias=cfg.bias)
        self.conv = CausalConv1d(E, cfg.conv_kernel_size)
        # headwise input weights: [0] maps the conv path to (i, f), [1] the normed input to (z, o)
        self.w_in = nn.Parameter(torch.empty(2, H, Dh, 2 * Dh))
        self.gate_bias = nn.Parameter(torch.zeros(4, H, Dh))  # i, f, z, o
        self.R = nn.Parameter(torch.empty(4, H, Dh, Dh))  # block-diagonal recurrent weights
        self.out_norm = MultiHeadNorm(H, Dh, bias=cfg.bias)
        self.ffn_norm = nn.LayerNorm(E, bias=cfg.bias)
        self.ffn_up = nn.Linear(E, 2 * cfg.ffn_dim, bias=cfg.bias)
        self.ffn_down = nn.Linear(cfg.ffn_dim, E, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

        # initialisation (module docstring): input weights small init with E; R = 0, so the recurrence starts as a
        # gated accumulator (the seed drew std-1 noise); forget-gate biases from +5 to -7 across each head's units
        nn.init.normal_(self.w_in, std=_small_init_std(E))
        nn.init.zeros_(self.R)
        with torch.no_grad():
            self.gate_bias[1].copy_(slstm_forget_bias(Dh, block_index, cfg.n_layer).expand(H, Dh))
        nn.init.normal_(self.ffn_up.weight, std=_small_init_std(E))
        nn.init.normal_(self.ffn_down.weight, std=_wang_init_std(E, cfg.n_layer))

    def forward(self, x: Tensor, state: tuple | None = None, with_state: bool = True,
                mask: Tensor | None = None) -> tuple[Tensor, tuple | None]:
        """x ``[B, T, E]``, mask ``[B, T]`` or None (masked steps leave c, n, h, m and the conv buffer as they were;
        ``slstm_backend: triton`` then runs the torch scan, as masks come with prompts, not training)."""
        B, T, E = x.shape
        H, Dh = self.n_head, self.head_dim
        cell, buffer = (None, None) if state is None else (tuple(state[:4]), state[4])
        xn = self.norm(x)
        x_c, buffer = self.conv(xn, buffer, mask)
        x_c = F.silu(x_c)
        # all steps' input projections, laid out as the scan reads them ([T, H, B, 4 Dh]: i, f from the conv path,
        # z, o from the normed input): per path one bmm of [H, T B, Dh] with [H, Dh, 2 Dh]. The bias is added after
        # the product, not by a baddbmm: under bf16 autocast that would round the forget gates' +5..-7 biases and
        # the sums to bf16 (a step of 1/32 at 5), where this sum is float32, the dtype the scan runs in
        def head_major(t: Tensor) -> Tensor:  # [B, T, E] -> [H, T B, Dh]
            return t.view(B, T, H, Dh).permute(2, 1, 0, 3).reshape(H, T * B, Dh)

        bias = self.gate_bias.view(4, H, Dh).transpose(0, 1).reshape(H, 1, 4 * Dh)
        g = torch.cat([torch.bmm(head_major(path), self.w_in[s]) for s, path in enumerate((x_c, xn))], dim=-1) + bias
        # R rearranged for one product per step, kept between decode steps (rebuilt when R changes)
        recurrent = derived_in_inference(self, "recurrent", (self.R,), lambda: recurrent_weights(self.R))
        steps = g.view(H, T, B, 4 * Dh).transpose(0, 1)
        if mask is not None:
            h, cell = slstm_scan_head_major(steps, self.R, cell, forget_gate=self.forget_gate, recurrent=recurrent,
                                            mask=mask)
        else:
            kernels = None if self.backend != "triton" else triton_kernels(
                "ltcx.ops.slstm_triton", "slstm_backend", "torch", x.device, self.training)
            scan = slstm_scan_head_major if kernels is None else kernels.slstm_scan_head_major_triton
            h, cell = scan(steps, self.R, cell, forget_gate=self.forget_gate, recurrent=recurrent)  # [T, H, B, Dh]
        x = x + self.dropout(self.out_norm(h.permute(2, 0, 1, 3)))
        u, gate = self.ffn_up(self.ffn_norm(x)).chunk(2, dim=-1)
        x = x + self.dropout(self.ffn_down(F.gelu(gate) * u))
        return x, (*cell, buffer) if with_state else None  # the scan's state is its last step: nothing to leave out


# ----------------------------------------------------------------------------- model


class XLSTM(Backbone):
    """xLSTM language model: ``logits, state = model(idx, state=None)``.

    Constructor: the fields of ``XLSTMConfig``.
    """

    config_class = XLSTMConfig
    # what a resumed run may change (ltcx/persist/file_fits.py): dropout, and how the mLSTM is computed (the same
    # function of the same weights), e.g. to continue a chunkwise run on NX-AI's kernels; so the sLSTM's
    resumable_fields = frozenset({"dropout", "mlstm_backend", "chunk_size", "slstm_backend"})
    # old name -> field: the names a checkpoint or export written before the xLSTM took the house's names holds
    # (ltcx/persist/file_fits.py's current_names reads them as the fields)
    renamed_fields = {"embedding_dim": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
                      "slstm_num_heads": "slstm_n_head"}

    def __init__(self, **fields) -> None:
        super().__init__()
        cfg = self.config = self.config_class(**fields)
        E = cfg.n_embd
        self.embedding = nn.Embedding(cfg.vocab_size, E)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            MLSTMBlock(cfg) if t == "m" else SLSTMBlock(cfg, i) for i, t in enumerate(cfg.block_types)
        )
        self.norm = nn.LayerNorm(E, bias=cfg.bias)
        self.head = nn.Linear(E, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embedding.weight, std=_small_init_std(E))
        if cfg.tie_embeddings:
            self.head.weight = self.embedding.weight
        else:
            nn.init.normal_(self.head.weight, std=_small_init_std(E))

    # -- the backbone contract

    def output_head(self) -> nn.Linear:
        """The head ``forward`` applies to ``forward_hidden``'s states."""
        return self.head

    def forward_hidden(self, idx: Tensor, state: list | None = None, with_state: bool = True,
                       mask: Tensor | None = None) -> tuple[Tensor, list | None]:
        """``forward`` before the head: (final hidden states ``[B, T, E]``, after the norm, state; None with
        ``with_state`` False, where the mLSTM blocks leave their final state out). ``mask`` ``[B, T]``: masked steps
        are identity steps of every cell and conv buffer."""
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state has {len(state)} entries but the model has {len(self.blocks)} blocks")
        x = self.dropout(self.embedding(idx))
        new_state = []
        for i, block in enumerate(self.blocks):
            if mask is None:
                x, s = block(x, None if state is None else state[i], with_state)
            else:
                x, s = block(x, None if state is None else state[i], with_state, mask)
            new_state.append(s)
        return self.norm(x), new_state if with_state else None

    def forward_recurrent(self, idx: Tensor, state: list | None = None) -> tuple[Tensor, list]:
        """Token-by-token evaluation: a loop calling forward on one token at a time (the seed's slow way;
        for tests and benchmarks). Same contract and result as ``forward``."""
        logits = []
        for t in range(idx.shape[1]):
            out, state = self(idx[:, t : t + 1], state)
            logits.append(out)
        return torch.cat(logits, dim=1), state

    def forward_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of the forward pass per token when training on sequences of ``seq_len`` tokens.

        Matrix products as the training forms execute them (element-wise gate, norm and conv work is not
        counted), 2 per
        multiply-add; E width, I inner width, H heads of head dim d = I / H, b the q/k/v block size, V vocabulary,
        T seq_len:

        * mLSTM block: up-projection 2 E 2I, block-diagonal q/k/v 3 * 2 I b, gates 2 * 2 (3I) H, down 2 I E,
          and the cell per head: chunkwise with chunks of L, each full chunk costs its state contribution
          k^T v (2 L d^2), the read of the carried state q C and q n (2 L d^2 + 2 L d) and the whole L x L
          intra-chunk products q k^T and S v (4 L^2 d, computed whole and masked by multiplication); a
          trailing chunk of r < L tokens costs 4 r^2 d + 2 r d^2 + 2 r d plus its final state k^T v
          (2 r d^2); the N full chunks' starting states (N + 1 with a trailing chunk) weigh the chunks'
          contributions (C, n) in one product, 2 (d^2 + d) N per state. The parallel form (and triton) is one chunk of
          T tokens; a sequence of one chunk (T <= L, or the parallel form) from the empty state, as training runs
          it, reads no carried state: 4 T^2 d + 2 T d^2.
          The kernels (``mlstm_backend: kernels``, as on CUDA) run the padded length S (``padded_length``) in
          chunks of min(S, 128), the padding counted.
        * sLSTM block (Hs heads of d_s = E / Hs): headwise input projections, 2 streams each E -> 2E in
          blocks d_s x 2 d_s (2 E 2 d_s), block-diagonal recurrence 4 gates x 2 E d_s, feed-forward 2 E 2F + 2 F E.
        * head: 2 E V (tied with the embedding: counted once).
        """
        cfg = self.config
        E, inner, V, T = cfg.n_embd, cfg.mlstm_inner_dim, cfg.vocab_size, seq_len
        d = inner // cfg.n_head
        if cfg.mlstm_backend == "kernels":
            S = padded_length(T)
            L = min(S, KERNEL_CHUNK)
            full, rest = S // L, 0  # S is a multiple of L
        else:
            L = T if cfg.mlstm_backend in ("parallel", "triton") else cfg.chunk_size
            full, rest = divmod(T, L)
        cell = full * (4 * L * d * d + 4 * L * L * d + 2 * L * d)
        if rest:
            cell += 4 * rest * rest * d + 4 * rest * d * d + 2 * rest * d
        if cfg.mlstm_backend != "kernels" and T <= L:  # one block from the empty state: no q C, q n
            cell = 4 * T * T * d + 2 * T * d * d
        elif cfg.mlstm_backend == "chunkwise":  # the chunks' starting states (and a trailing chunk's) from theirs
            cell += 2 * (full + (rest > 0)) * full * (d * d + d)
        mlstm = 2 * E * 2 * inner + 3 * 2 * inner * cfg.qkv_proj_blocksize + 2 * 2 * 3 * inner * cfg.n_head \
            + 2 * inner * E + cfg.n_head * cell / T
        d_s = E // cfg.slstm_n_head
        slstm = 2 * (2 * E * 2 * d_s) + 4 * (2 * E * d_s) + 2 * E * 2 * cfg.ffn_dim + 2 * cfg.ffn_dim * E
        blocks = sum(mlstm if t == "m" else slstm for t in cfg.block_types)
        return blocks + 2 * E * V

    def state_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of the inference state after ``tokens`` tokens at batch 1, the model in ``dtype`` (None: its
        parameters'); a constant from the first token on. The cells in float32 (float64 for a float64 model), the
        conv buffers (the last K - 1 conv inputs) in the model's dtype:

        * mLSTM block: C [1, H, d, d], n [1, H, d], m [1, H] (d = I / H), conv buffer [1, K - 1, I];
        * sLSTM block: c, n, h, m [1, Hs, E / Hs] each, conv buffer [1, K - 1, E].
        """
        if not tokens:
            return 0
        cfg = self.config
        numbers = model_dtype(self, dtype)
        cell, buffer = state_dtype(numbers).itemsize, numbers.itemsize
        inner, heads, kernel = cfg.mlstm_inner_dim, cfg.n_head, cfg.conv_kernel_size - 1
        d = inner // heads
        mlstm = heads * (d * d + d + 1) * cell + kernel * inner * buffer
        slstm = 4 * cfg.n_embd * cell + kernel * cfg.n_embd * buffer
        return sum(mlstm if t == "m" else slstm for t in cfg.block_types)

    def no_weight_decay_param_names(self) -> set[str]:
        """Parameters AdamW should not decay: norms, biases, gate biases, skip scales, embeddings."""
        names = set()
        for name, p in self.named_parameters():
            if p.ndim < 2 or name.endswith("gate_bias") or name.startswith("embedding."):
                names.add(name)
        return names
