"""Model FLOPs and the machine's limit: FLOPs per token of any backbone, and the peak FLOP/s that MFU divides by.

MFU (model FLOPs utilisation) = tokens/s x training FLOPs per token / peak FLOP/s of the device.
"""

from __future__ import annotations

import functools
import time

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


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(threads: int, size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of a float32 ``size`` x ``size`` matmul on this CPU with ``threads`` threads: the best of
    ``repeats`` after a warm-up (about a second on two cores). Cached per process and thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool, caches
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best


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
        return measured_matmul_flops(threads), f"measured float32 2048^3 matmul on {threads} CPU threads"
    return None, f"no known peak for a {device.type} device"
