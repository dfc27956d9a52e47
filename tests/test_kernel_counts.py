"""Kernels per training step (``ltcx.throughput.kernels_per_step``), held under a ceiling for every catalogue entry at
its tiny shape: on a GPU a small model's step is bounded by its kernel launches, so a change that multiplies them
fails here (counts are deterministic; timings never go into tests). The 29M configs' counts are in
docs/benchmarks.md (``python scripts/benchmark.py kernels``)."""

from __future__ import annotations

import pytest
import torch

from ltcx.lm import LanguageModel
from ltcx.models.catalog import CATALOG
from ltcx.throughput import KernelCounter, kernels_per_step, launches_kernel

# Eager kernels of one training step at the tiny shape, batch 2 x 32, about 1.2x each entry's count: a new entry
# states its own (run this test: the failure says its count).
CEILINGS = {"gpt": 130, "gta": 145, "ltc": 330, "xlstm": 1_700, "titans_mag": 4_200, "titans_mac": 10_000,
            "titans_mal": 2_150, "titans_lmm": 3_850, "gated_deltanet": 1_170, "mamba2": 570}


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
