"""torch's thread count for a block of tests, shared by the torch test modules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads (its OpenMP pool, which the C++ kernels share) set to n inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
