"""Shared test fixtures: the upstream golden files (one definition, in parity_tests.conftest) and precision."""

from __future__ import annotations

import pytest

from parity_tests.conftest import DATA, FIXTURE_NPZ, FIXTURE_PKL, fixture_checkpoint, golden  # noqa: F401


@pytest.fixture(autouse=True, scope="session")
def _pin_precision():
    """float32 parity needs full-precision matmuls on both sides (no TF32, no bf16 passes)."""
    from parity_tests.engine import pinned_precision

    with pinned_precision():
        yield
