"""Shared test fixtures: the upstream golden files and small helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
FIXTURE_PKL = DATA / "needle-v1-tiny.pkl"
FIXTURE_NPZ = DATA / "needle-v1-tiny.npz"


@pytest.fixture(scope="session")
def golden():
    """Inputs and activations computed by the upstream Flax code (tests/data/README.md)."""
    with np.load(FIXTURE_NPZ) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def fixture_checkpoint():
    """The upstream-format checkpoint, read through the safe loader."""
    from convert.io import read_checkpoint

    return read_checkpoint(FIXTURE_PKL)


@pytest.fixture(autouse=True, scope="session")
def _pin_precision():
    """float32 parity needs full-precision matmuls on both sides (no TF32, no bf16 passes)."""
    try:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    except ImportError:
        pass
    try:
        import torch

        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except ImportError:
        pass
