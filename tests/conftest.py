"""Shared test fixtures: the upstream golden files (one definition, in parity_tests.conftest) and precision."""

from __future__ import annotations

import pytest

from parity_tests.conftest import fixture_checkpoint, golden  # noqa: F401


@pytest.fixture(autouse=True, scope="session")
def _pin_precision():
    """float32 parity needs full-precision matmuls on both sides (no TF32, no bf16 passes)."""
    try:  # pinned_precision sets both libraries: import them here so a run without one fails no test's setup
        import jax  # noqa: F401
        import torch  # noqa: F401

        from parity_tests.devices import pinned_precision
    except ImportError:  # a framework-free run (e.g. jax hidden for test_safe_pickle): no matmul to pin
        yield
        return
    with pinned_precision():
        yield
