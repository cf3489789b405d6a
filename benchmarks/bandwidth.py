"""Memory bandwidth for the benchmarks' bounds: a copy into a buffer allocated and touched before timing."""

from __future__ import annotations

import time

import numpy as np
import torch


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s (read + write) of a torch copy_ of `mib` MiB into a preallocated, already written buffer, best of
    `repeats`. A fresh destination would time its page faults too (8.6 against 23.8 GB/s on a 2-core Xeon VM)."""
    a = torch.ones(mib * 2**20 // 4)
    b = torch.zeros_like(a)  # every page written now, so none faults in while timed
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * 4 / best


def numpy_copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """copy_bandwidth for numpy's single-threaded copyto (the same preallocated, touched destination)."""
    a = np.ones(mib * 2**20 // 4, np.float32)
    b = np.zeros_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best
