"""The gated delta rule and SSD through flash-linear-attention's Triton kernels (``fla-core``, ``pip install
'ltcx[kernels]'``), behind the signatures and state layouts of ``ltcx/ops/gated_delta.py`` and ``ltcx/ops/ssd.py``
(``backend: kernels`` of Gated DeltaNet and Mamba-2).

* Gated delta rule: ``chunk_gated_delta_rule`` with ltcx's q, k (already L2-normalised), v, the log-decay g
  (natural log), beta after its sigmoid and state ``[B, H, Dk, Dv]`` (fla's default layout).
* SSD: fla has no Mamba-2 kernel of its own; SSD with one group is ``chunk_simple_gla`` (a scalar decay per head and
  step) with q = C and k = B repeated over the heads, v = dt x, g = dt A, scale 1 and the state in mamba_ssm's
  ``[P, N]`` layout (``state_v_first``).

fla takes ``[B, T, H, D]``; ltcx's forms ``[B, H, T, D]``. The state goes in and comes out in float32. What only a
GPU checks: the kernels against ltcx's forms (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from ltcx.errors import LtcxError, notice_once

__all__ = ["fla_kernels_for", "gated_delta_fla", "kernels_unavailable", "ssd_fla"]



def kernels_unavailable() -> str | None:
    """Why fla's kernels can not run here (a missing package), or None."""
    for module, package in (("triton", "triton"), ("fla", "fla-core")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed"
    return None


def fla_kernels_for(model: str, device: torch.device, training: bool) -> bool:
    """Whether a block of ``model`` with ``backend: kernels`` runs fla's kernels on ``device``; else ltcx's torch
    form, the same function:

    * not CUDA: the torch form, with one notice, so that one YAML runs on a CPU as on a GPU;
    * CUDA without fla: training is an error naming ``pip install 'ltcx[kernels]'``; evaluation and generation use
      the torch form, with one notice.
    """
    if device.type != "cuda":
        notice_once(f"{model} backend 'kernels' runs on CUDA only; on {device.type} it runs ltcx's torch form "
                     "(the same function)")
        return False
    missing = kernels_unavailable()
    if missing is None:
        return True
    if training:
        raise LtcxError(f"{model} backend 'kernels': {missing}: pip install 'ltcx[kernels]', or set backend: torch")
    notice_once(f"{model} backend 'kernels': {missing}; evaluating with ltcx's torch form")
    return False


def gated_delta_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``gated_delta_chunked`` (ltcx/ops/gated_delta.py) through fla's ``chunk_gated_delta_rule`` (chunks of 64)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def tokens_first(t: Tensor) -> Tensor:
        return t.transpose(1, 2).contiguous()

    o, final = chunk_gated_delta_rule(
        *map(tokens_first, (q, k, v, g.float(), beta.float())),
        initial_state=None if state is None else state.float(), output_final_state=True)
    return o.transpose(1, 2), final


def ssd_fla(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
            state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``ssd_chunked`` (ltcx/ops/ssd.py) through fla's ``chunk_simple_gla``."""
    from fla.ops.simple_gla import chunk_simple_gla

    heads = x.shape[1]
    q, k = (t.unsqueeze(2).expand(-1, -1, heads, -1).to(x.dtype).contiguous() for t in (C, B))  # [B, T, H, N]
    v = (x * dt.unsqueeze(-1).to(x.dtype)).transpose(1, 2).contiguous()
    g = (dt.float() * A.float()[:, None]).transpose(1, 2).contiguous()
    y, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=None if state is None else state.float(),
                                output_final_state=True, state_v_first=True)
    return y.transpose(1, 2), final
