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


def pytest_configure(config):
    """Under --dist loadgroup (scripts/test.sh) each xdist_group must reach one worker: the compiled-generation tests
    share their torch.compile graphs that way. pytest 9.2 with pytest-xdist <= 3.8 drops the groups without a word
    (pytest-xdist#1386), so such a run stops here instead of silently doubling its compile time."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    xdist_major_minor = tuple(int(p) for p in xdist.__version__.split(".")[:2])
    if pytest.version_tuple[:2] >= (9, 2) and xdist_major_minor <= (3, 8):
        raise pytest.UsageError(f"--dist loadgroup is broken in pytest {pytest.__version__} with pytest-xdist "
                                f"{xdist.__version__} (pytest-xdist#1386): install scripts/constraints.txt's pytest")


@pytest.fixture
def upcast(monkeypatch):
    """This process's bf16 products through the upcast path, whatever the CPU (eager code reads it per call)."""
    from needle_torch.fast import kernels

    monkeypatch.setattr(kernels, "_native_bf16", lambda: False)
