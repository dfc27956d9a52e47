"""Where each fused Triton backend runs (ltcx/models/fused.py), for every catalogue entry with one
(``ltcx.throughput.FUSED_BACKENDS``): on a CPU outside Triton's interpreter the block runs its torch form, the same
logits to the bit, with one notice; on a device where the kernels would run but Triton cannot be imported, training is
one error line naming the install and evaluation runs the torch form. (The kernels themselves: the
tests/test_*_triton.py modules.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ltcx import errors
from ltcx.errors import LtcxError
from ltcx.models import fused
from ltcx.models.catalog import CATALOG
from ltcx.throughput import FUSED_BACKENDS

KERNEL_MODULES = [f"ltcx.ops.{path.stem}" for path in (Path(fused.__file__).parents[1] / "ops").glob("*_triton.py")]
WITH_FUSED = sorted(name for name, entry in CATALOG.items() if entry.backbone_class().__name__ in FUSED_BACKENDS)


def _pair(name: str):
    """(the tiny model with its fused backends, the same weights with its torch forms), in training mode."""
    torch.manual_seed(0)
    plain = CATALOG[name].build_tiny(64)
    model = CATALOG[name].build_tiny(64, **FUSED_BACKENDS[CATALOG[name].backbone_class().__name__])
    model.load_state_dict(plain.state_dict())
    return model.train(), plain.train()


def test_every_fused_entry_is_covered():
    assert WITH_FUSED and len(KERNEL_MODULES) == 3  # xLSTM (sLSTM, mLSTM) and the Titans variants


@pytest.mark.parametrize("name", WITH_FUSED)
def test_off_cuda_the_torch_form_runs_with_one_notice(name, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(errors, "_notices_given", set())
    model, plain = _pair(name)
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        torch.testing.assert_close(model(idx, with_state=False)[0], plain(idx, with_state=False)[0], rtol=0, atol=0)
    notices = capsys.readouterr().err.splitlines()
    fields = FUSED_BACKENDS[CATALOG[name].backbone_class().__name__]
    assert len(notices) == len(fields), notices  # one a backend, however many layers and calls
    for field in fields:
        assert any(field in line and "runs on CUDA" in line and "the same function" in line for line in notices)


@pytest.mark.parametrize("name", WITH_FUSED)
def test_without_triton_training_is_refused_and_evaluation_runs_the_torch_form(name, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernels would run
    for module in KERNEL_MODULES:
        monkeypatch.setitem(sys.modules, module, None)  # as if Triton were missing: the import fails
    monkeypatch.setattr(errors, "_notices_given", set())
    model, plain = _pair(name)
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(LtcxError, match="pip install -r requirements-kernels.txt") as error:
        model(idx, with_state=False)
    assert "\n" not in str(error.value) and ", or set " in str(error.value)
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx, with_state=False)[0], plain(idx, with_state=False)[0], rtol=0, atol=0)
    assert "needs Triton" in capsys.readouterr().err
