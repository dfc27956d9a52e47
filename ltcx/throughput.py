"""Model FLOPs and the machine's limit: FLOPs per token of any backbone, and the peak FLOP/s that MFU divides by.

MFU (model FLOPs utilisation) = tokens/s x training FLOPs per token / peak FLOP/s of the device.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
import torch.nn as nn

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from NVIDIA's data sheets; matched in this order against
# the lower-cased device name. Lightning's table lists some of these at their 2:4-sparsity figure.
GPU_BF16_PEAKS = (
    ("h200 nvl", 835e12),
    ("h200", 989e12),
    ("h100 nvl", 835e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
)


def model_flops_per_token(backbone: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the backbone's ``flops_per_token(seq_len)``, or 6 N (N = its parameter count:
    2 FLOPs per weight per token forward, twice that backward) for a backbone that does not say."""
    if hasattr(backbone, "flops_per_token"):
        return float(backbone.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in backbone.parameters())


def best_rate(run: Callable[[], object], work: float, trials: int = 5, budget_s: float = 0.25,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The highest ``work / seconds`` over up to ``trials`` timed calls of ``run``, starting no new trial once
    ``budget_s`` seconds have gone by (one trial at least).

    The best trial, not the mean: on a shared machine another process can only slow a trial down, never speed
    it up, so the fastest trial is the closest to the machine's peak rate.
    """
    start = clock()
    best = 0.0
    for _ in range(max(1, trials)):
        before = clock()
        run()
        after = clock()
        if after > before:
            best = max(best, work / (after - before))
        if after - start >= budget_s:
            break
    if best == 0.0:
        raise RuntimeError("the clock did not advance during any trial")
    return best


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(threads: int, size: int = 1024, trials: int = 5, budget_s: float = 0.25) -> float:
    """FLOP/s of a float32 ``size`` x ``size`` matmul on this CPU with ``threads`` threads: ``best_rate`` of up to
    ``trials`` products within ``budget_s`` seconds after one warm-up (2.1 GFLOP each, tens of ms on two cores:
    about 0.3 s in all). Cached per process and thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool, caches
        return best_rate(lambda: a @ b, 2.0 * size**3, trials, budget_s)
    finally:
        torch.set_num_threads(previous)


def gpu_bf16_peak(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known GPU, else Lightning's figure for it (None when unknown)."""
    name = torch.cuda.get_device_name(device).lower()
    for key, peak in GPU_BF16_PEAKS:
        if key in name:
            return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, torch.bfloat16)


def default_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from): a GPU's dense bf16 peak, a CPU's measured
    float32 matmul rate (the CPU has no published peak that a framework reaches)."""
    if device.type == "cuda":
        peak = gpu_bf16_peak(device)
        return peak, f"dense bf16 peak of {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return measured_matmul_flops(threads), f"best of a few float32 1024^3 matmuls measured on {threads} CPU threads"
    return None, f"no known peak for a {device.type} device"
