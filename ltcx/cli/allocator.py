"""glibc's malloc set for training: the memory a step frees is kept for the next step, not returned to the system.

By default glibc maps each block above a threshold (128 KiB at start, raised as such blocks are freed) as pages of its
own and returns them on ``free``, and gives the top of its heap back past a threshold that moves with it. A training
step frees and allocates its activations again every step, in a mix of sizes that the moving thresholds do not settle
on, and each page given back is zero-filled again by the kernel at its next first touch (a minor page fault): system
time in every step.

``keep_freed_memory`` fixes both thresholds: blocks under 32 MiB (glibc's largest mapping threshold) come from the
heap, and the heap keeps up to 2 GiB free at its top, for the same peak memory. Blocks of 32 MiB and more (the tied
embedding's gradient, the fused loss's logits at the 29M configs) are still mapped on their own. A user's own malloc
settings (``MALLOC_*`` variables, ``GLIBC_TUNABLES``) are left as they are; an allocator preloaded in glibc's place
(jemalloc, tcmalloc) does not read these.
"""

from __future__ import annotations

import os

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (module docstring); whether it was set. A no-op (False) off glibc and
    where the user chose malloc's settings."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
    except (AttributeError, ValueError, OSError):  # not a GNU C library (or not Unix)
        return False
    if "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(name.startswith("MALLOC_") for name in os.environ):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # no mallopt in this process's C library
        return False
