"""The mLSTM through NX-AI's ``mlstm_kernels`` package (``pip install ltcx[kernels]``): TFLA, the Triton kernels of
the xLSTM reference implementation and xLSTM-7B, behind ltcx's signature and state convention.

:func:`mlstm_chunkwise_kernels` computes what :func:`ltcx.ops.mlstm.mlstm_chunkwise` computes (sigmoid forget gate)
with one of the package's chunkwise kernels: ``chunkwise--triton_xl_chunk`` (TFLA, CUDA) in training, its native
PyTorch form ``chunkwise--native_autograd`` (any device) in the CPU tests. Where the two conventions differ, and
how this module bridges them (``tests/test_mlstm_kernels.py`` checks each against ltcx's forms):

* **Gates: the same.** The input gate is exponential (the kernels take its pre-activation i~ as log i) and the
  forget gate is ``log f = log sigmoid(f~)``; the kernels have no exponential forget gate (ltcx's
  ``forget_gate: exp``). TFLA evaluates ``log(sigmoid(f~))`` rather than a stable log-sigmoid: -inf, not a finite
  value, for f~ below about -88 in float32.
* **Normaliser: the same**, ``h = C^T q / (max(|n . q|, exp(-m)) + eps)`` with eps 1e-6.
* **Key scale.** The kernels scale ``q . k`` by ``1/sqrt(d)`` inside (TFLA's call takes no scale) and keep C and n
  in units of the raw keys; ltcx scales the keys, so ltcx's (C, n) = the kernels' (C, n) / sqrt(d). The state is
  converted on the way in and out.
* **The empty state.** The kernels start from m = 0 (xLSTM-7B passes no state), ltcx from m = -inf. Both are the
  same empty memory (C = n = 0), and the outputs do not depend on m except through eps: ``h = C~^T q /
  (max(|n~ . q|, 1) + eps exp(m))`` in the unscaled (C~, n~). From the empty state the kernels' m is
  ``max(ltcx's m, sum of log f so far)``, so their eps term can be larger: the outputs differ by about
  eps relative (they agree to rounding with eps = 0). A carried state with m = -inf (the empty state, C = n = 0)
  is handed over with m = 0, the same memory.
* **Lengths.** TFLA needs 16, 32 or 64 steps, or a multiple of 128 (its chunk). Other lengths are padded after the
  last step, as NX-AI's inference wrapper pads them, with steps that write nothing and forget nothing: q = k = v = 0,
  f~ = 50, i~ = -50 (the wrapper's 25 gives f = sigmoid(25) = 1 in float32 but 1 - 1.4e-11 a step in float64; 50
  gives 1 in both). The padded steps come after every real one, so the real steps' outputs are exact, and the state
  after them is the state after the real steps (m rises to -50 if it was below: the same memory).
* **Backward.** TFLA's backward passes no gradient to the carried-in n and m and takes none from the returned n
  and m (only C's). ltcx never needs one: training blocks start from the empty state and the returned state is
  used only for generation, without gradients.
* **Dtypes.** q, k, v reach the kernel in their own dtype (bf16 under bf16 autocast: TFLA's fast path), the gates
  and the state in float32 (float64 with float64 inputs), with autocast off so the kernel's own autocast wrapper
  does not cast the state to bf16. h comes back in q's dtype.

Shapes as :func:`ltcx.ops.mlstm.mlstm_chunkwise`: q, k, v ``[B, H, T, D]``, i_pre, f_pre ``[B, H, T]``,
state (C ``[B, H, D, D]``, n ``[B, H, D]``, m ``[B, H]``).

What only a GPU can confirm: the Triton kernels' numerics (bf16 and float32 against these forms) and their speed.
The CPU tests run the same bridge (state conversion, padding, dtypes) around the package's native PyTorch kernel;
Triton's interpreter can not run TFLA's kernels: they address memory through ``tl.make_block_ptr``, which Triton
removed in favour of tensor descriptors (3.9 raises NotImplementedError, compiled or interpreted), so with such a
Triton :func:`kernels_unavailable` says so and training with the kernels is refused.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ltcx.ops.mlstm import EPS, MLSTMState, state_dtype
from ltcx.ops.precision import without_autocast

TRITON_KERNEL = "chunkwise--triton_xl_chunk"
"""TFLA's chunkwise kernel (forward and backward in Triton), the one used on CUDA."""
NATIVE_KERNEL = "chunkwise--native_autograd"
"""The package's chunkwise form in plain PyTorch (autograd backward): any device; the CPU tests' reference."""

KERNEL_CHUNK = 128
"""TFLA's chunk (its default tiling): lengths of 128 and more are padded to a multiple of it."""
PAD_FORGET, PAD_INPUT = 50.0, -50.0
"""Gate pre-activations of the padded steps (NX-AI's padding): forget nothing, write nothing."""


def kernels_unavailable() -> str | None:
    """Why TFLA can not run here, as a phrase ("the mlstm_kernels package is not installed"), or None when it can."""
    return _unavailable()


@functools.cache
def _unavailable() -> str | None:
    if importlib.util.find_spec("mlstm_kernels") is None:
        return "the mlstm_kernels package is not installed"
    triton = importlib.util.find_spec("triton")
    if triton is None:
        return "Triton is not installed (it comes with PyTorch's CUDA build)"
    if not _has_block_pointers(triton.submodule_search_locations or []):
        return (f"Triton {importlib.metadata.version('triton')} has no block pointers (tl.make_block_ptr), "
                "which TFLA's kernels are written with")
    return None


BLOCK_POINTERS_REMOVED = "Block pointers have been removed"
"""What ``tl.make_block_ptr`` says in a Triton without block pointers (removed in favour of tensor descriptors)."""


def _has_block_pointers(package_dirs: list[str]) -> bool:
    """Whether the installed Triton (its package folders) still compiles ``tl.make_block_ptr``: read from its
    source, as importing Triton is left to the kernels (and TFLA's kernels fail only when first compiled)."""
    for folder in package_dirs:
        core = Path(folder) / "language" / "core.py"
        if core.is_file():
            return BLOCK_POINTERS_REMOVED not in core.read_text()
    return True


def padded_length(seq_len: int) -> int:
    """The length the kernels run: 16, 32 or 64 below 128 (the next power of two, at least 16), else the next
    multiple of 128 (TFLA's rule: ``select_heuristic_xl_chunk_kernel_params``)."""
    if seq_len >= KERNEL_CHUNK:
        return KERNEL_CHUNK * math.ceil(seq_len / KERNEL_CHUNK)
    return max(16, 1 << (seq_len - 1).bit_length())


def mlstm_chunkwise_kernels(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: MLSTMState | None = None,
    *,
    kernel: str = TRITON_KERNEL,
    eps: float = EPS,
) -> tuple[Tensor, MLSTMState]:
    """The mLSTM of :func:`ltcx.ops.mlstm.mlstm_chunkwise` (sigmoid forget gate) computed by ``kernel``, one of
    ``mlstm_kernels``' chunkwise kernels, continuing from ``state`` (ltcx's convention in and out; module docstring).

    q, k (raw keys: the kernel scales them), v ``[B, H, T, D]``; i_pre, f_pre ``[B, H, T]``. Returns h
    ``[B, H, T, D]`` (dtype of q) and (C ``[B, H, D, D]``, n ``[B, H, D]``, m ``[B, H]``) in float32 (float64 for
    float64 inputs).
    """
    from mlstm_kernels.torch import get_mlstm_kernel

    B, H, T, D = q.shape
    sdt = state_dtype(q.dtype)
    scale = math.sqrt(D)  # the kernels' (C, n) = sqrt(D) x ltcx's
    if state is None:
        c0 = n0 = m0 = None  # the kernel's own empty state (m = 0)
    else:
        C, n, m = (s.to(sdt) for s in state)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # m = -inf only with C = n = 0: the same memory
        c0, n0, m0 = (C * scale).contiguous(), (n * scale).contiguous(), m.unsqueeze(-1).contiguous()
    S = padded_length(T)
    pad = S - T
    i_pre, f_pre = i_pre.to(sdt), f_pre.to(sdt)
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        i_pre = F.pad(i_pre, (0, pad), value=PAD_INPUT)
        f_pre = F.pad(f_pre, (0, pad), value=PAD_FORGET)
    kernel_dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    with without_autocast(q.device):
        h, (C, n, m) = get_mlstm_kernel(kernel)(
            q=q, k=k, v=v, i=i_pre, f=f_pre, c_initial=c0, n_initial=n0, m_initial=m0,
            return_last_states=True, eps=eps, chunk_size=min(S, KERNEL_CHUNK), autocast_kernel_dtype=kernel_dtype,
        )
    return h[:, :, :T], (C.to(sdt) / scale, n.to(sdt) / scale, m.to(sdt).squeeze(-1))
