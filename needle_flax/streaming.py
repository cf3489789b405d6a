"""Streaming out of a jitted generation loop, for every family: the loop calls one fixed host function
(`emit`, through an ordered io_callback), which forwards to the streamer of the running call, so a new
streamer never means a new compilation. XLA runs the callback on its own thread, so the streamer is a
process-wide slot (not thread-local), held under a lock while a call streams."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

Streamer = Callable[[np.ndarray], None]  # called with the (B,) int32 tokens of each step, in order
T = TypeVar("T")

_lock = threading.Lock()
_current: Streamer | None = None


def emit(tokens) -> None:
    """The host side of the loop's io_callback: hand one step's tokens to the running call's streamer."""
    if _current is not None:
        _current(np.asarray(tokens))


def run_streaming(loop: Callable[[], T], streamer: Streamer | None) -> T:
    """loop(), with `streamer` in the slot while it runs and until every ordered callback has run."""
    global _current
    if streamer is None:  # the loop emits nothing: no need for the slot
        return loop()
    with _lock:
        _current = streamer
        try:
            result = loop()
            jax.effects_barrier()  # ordered callbacks have all run before the slot is cleared
        finally:
            _current = None
    return result
