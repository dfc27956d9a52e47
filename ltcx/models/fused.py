"""Where a block's fused Triton kernels run (``slstm_backend``, ``mlstm_backend`` or ``memory_backend: triton``):
on CUDA with Triton, or on any device under ``TRITON_INTERPRET=1`` (Triton's interpreter, as the tests run them).
Elsewhere the block runs its torch form, the same function, with one notice, so that one YAML or checkpoint serves
a CPU and a GPU; under ``torch.compile`` it runs the torch form too (Dynamo traces it, Inductor fuses it). On CUDA
without Triton, training is an error naming the install (a run that asked for the kernels should not silently train
at another speed); evaluation and generation run the torch form, with one notice.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from ltcx.errors import LtcxError, notice_once


def triton_kernels(module: str, field: str, torch_form: str, device: torch.device,
                   training: bool) -> ModuleType | None:
    """The kernel module ``module`` (``ltcx.ops.*_triton``, imported here: only those modules import Triton) where
    its kernels run on ``device``, else None: the block runs ``field: torch_form`` (the module docstring says
    when)."""
    if torch.compiler.is_compiling():  # Dynamo can not trace the launches
        return None
    fallback = f"the {field} '{torch_form}' form runs (the same function)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        notice_once(f"{field} 'triton' runs on CUDA (or under TRITON_INTERPRET=1); on {device.type} {fallback}")
        return None
    try:
        kernels = importlib.import_module(module)
    except ImportError as error:
        problem = f"{field} 'triton' needs Triton ({error})"
        if training:
            raise LtcxError(f"{problem}: pip install -r requirements-kernels.txt, or set {field}: {torch_form}"
                            ) from None
        notice_once(f"{problem}; {fallback}")
        return None
    if device.type != "cuda" and not kernels.INTERPRETED:  # Triton was imported before TRITON_INTERPRET=1 was set
        notice_once(f"{field} 'triton': Triton was imported without TRITON_INTERPRET=1; on {device.type} {fallback}")
        return None
    return kernels
