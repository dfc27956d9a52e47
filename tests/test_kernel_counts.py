"""Kernels per training step (``ltcx.throughput.kernels_per_step``), held under a ceiling for every catalogue entry at
its tiny shape: on a GPU a small model's step is bounded by its kernel launches, so a change that multiplies them
fails here (counts are deterministic; timings never go into tests), and with the fused backends in Triton's
interpreter. The 29M configs' counts are in docs/benchmarks.md (``python scripts/benchmark.py kernels``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG
from ltcx.throughput import KernelCounter, kernels_per_step, launches_kernel

# Eager kernels of one training step at the tiny shape, batch 2 x 32, about 1.2x each entry's count: a new entry
# states its own (run this test: the failure says its count).
CEILINGS = {"gpt": 130, "gta": 145, "ltc": 330, "xlstm": 1_220, "titans_mag": 3_900, "titans_mac": 7_800,
            "titans_mal": 2_020, "titans_lmm": 3_700, "gated_deltanet": 655, "mamba2": 450}


def tiny_count(name: str, batch_size: int = 2) -> int:
    torch.manual_seed(0)
    model = LanguageModel(CATALOG[name].build_tiny(64), decay_steps=1)
    return sum(kernels_per_step(model, torch.randint(0, 64, (batch_size, 33))).values())


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_training_step_kernels_stay_under_the_ceiling(name):
    count = tiny_count(name)
    assert name in CEILINGS, f"{name}: {count} kernels per tiny step; add a ceiling (about 1.2x) to CEILINGS"
    assert 0 < count <= CEILINGS[name], f"{name}: {count} kernels per tiny step, ceiling {CEILINGS[name]}"


def test_counts_are_deterministic():
    assert tiny_count("gpt") == tiny_count("gpt")


def test_views_and_metadata_launch_nothing_and_compute_does():
    aten = torch.ops.aten
    for op in (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.expand.default,
               aten.split.Tensor, aten.detach.default, aten.empty.memory_format, aten.promote_types.default):
        assert not launches_kernel(op), op
    for op in (aten.mm.default, aten.add_.Tensor, aten.copy_.default, aten._to_copy.default, aten.zeros.default,
               aten._fused_adamw_.default, aten._foreach_add_.List):
        assert launches_kernel(op), op
    x = torch.randn(4, 6)
    with KernelCounter() as counter:
        y = x.view(6, 4).t().contiguous()  # a view, a transpose (views), then one copy
        (y @ x.t()).sum()
    assert dict(counter.counts) == {"clone": 1, "mm": 1, "sum": 1}


# Kernels of one training step at batch 1 x 8 with the fused backends (ltcx.throughput.FUSED_BACKENDS), each Triton
# launch one kernel, about 1.2x each count: every Titans entry (the memory's kernels) and the xLSTM (the sLSTM
# scan's and the mLSTM's). One child process: Triton reads TRITON_INTERPRET when imported.
FUSED_CEILINGS = {"titans_lmm": 235, "titans_mac": 800, "titans_mag": 355, "titans_mal": 245, "xlstm": 220}
FUSED_COUNT = """
import json, torch
from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG
from ltcx.throughput import FUSED_BACKENDS, kernels_per_step
counts = {}
for name in NAMES:
    torch.manual_seed(0)
    tiny = CATALOG[name].build_tiny(64, **FUSED_BACKENDS[CATALOG[name].backbone_class().__name__])
    counts[name] = kernels_per_step(LanguageModel(tiny, decay_steps=1), torch.randint(0, 64, (1, 9)))
print(json.dumps(counts))
"""


def test_fused_training_step_kernels_stay_under_the_ceiling():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    script = FUSED_COUNT.replace("NAMES", repr(sorted(FUSED_CEILINGS)))
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    for name, ceiling in FUSED_CEILINGS.items():
        total = sum(counts[name].values())
        assert 0 < total <= ceiling, f"{name}: {total} fused kernels per step, ceiling {ceiling}"
    # each kernel is one launch a layer and direction; the interpreter's own aten ops are not counted
    assert {op: n for op, n in counts["titans_mal"].items() if op.startswith("triton:")} == \
        {"triton:_memory_forward_kernel": 1, "triton:_memory_backward_kernel": 1}
    assert {op: n for op, n in counts["xlstm"].items() if op.startswith("triton:")} == \
        {"triton:_scan_forward_kernel": 1, "triton:_scan_backward_kernel": 1, "triton:_mlstm_forward_kernel": 1,
         "triton:_mlstm_backward_queries_kernel": 1, "triton:_mlstm_backward_keys_kernel": 1}
