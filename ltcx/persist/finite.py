"""Weights are finite on every load: one NaN or inf in any tensor of a checkpoint, an export or a Hugging Face folder
is refused in one line naming the tensor, before the model is used (a NaN query can look like a normal answer: the
CPU attention kernel turns it into zeros). Saving refuses them too (``SafeCheckpointIO``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ltcx.errors import LtcxError

__all__ = ["non_finite_names", "check_finite"]


def non_finite_names(named: Iterable[tuple[str, object]]) -> list[str]:
    """The names of the floating-point tensors of ``named`` (name, tensor pairs: ``state_dict().items()``) holding
    NaN or inf, in order. One pass over the data: a tensor's min and max are NaN or inf exactly when it holds one
    (a sum can overflow first), and they are tested together, one stack per device."""
    floats = [(name, t) for name, t in named
              if torch.is_tensor(t) and t.is_floating_point() and t.numel() and not t.is_meta]
    by_device: dict[torch.device, list[int]] = {}
    for at, (_, tensor) in enumerate(floats):
        by_device.setdefault(tensor.device, []).append(at)
    broken: set[int] = set()
    with torch.no_grad():
        for indices in by_device.values():
            extremes = torch.stack([torch.stack(torch.aminmax(floats[at][1].detach())).float() for at in indices])
            bad = (~torch.isfinite(extremes).all(dim=1)).tolist()
            broken.update(at for at, b in zip(indices, bad) if b)
    return [floats[at][0] for at in sorted(broken)]


def check_finite(source: str, named: Iterable[tuple[str, object]], fix: str) -> None:
    """One ``LtcxError`` line naming the first tensor of ``named`` (name, tensor pairs) of ``source``
    (``checkpoint '...'``) that holds NaN or inf, and ``fix``."""
    bad = non_finite_names(named)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise LtcxError(f"{source} holds non-finite weights (NaN or inf) in {bad[0]}{more}: the file is damaged or "
                        f"its training diverged; {fix}")
