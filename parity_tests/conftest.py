"""Parity-suite fixtures: devices (CPU always, accelerators where present) and the upstream fixture files."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from convert.io import read_checkpoint
from parity_tests.devices import DeviceError, jax_device, torch_device
from parity_tests.fixtures import FIXTURE_NPZ, FIXTURE_PKL
from parity_tests.inputs import Batch


@dataclass(frozen=True)
class Device:
    """Where each twin runs for one parametrisation."""

    name: str
    torch: str  # --torch-device
    jax: str  # --jax-platform


DEVICES = {
    "cpu": Device("cpu", "cpu", "cpu"),
    "cuda": Device("cuda", "cuda", "gpu"),  # both twins on the GPU
    "tpu": Device("tpu", "cpu", "tpu"),  # torch has no TPU backend: JAX on TPU against torch on CPU
}


def _missing(device: Device) -> str | None:
    """Why this machine cannot run `device` (the engine's own device checks), or None when it can."""
    try:
        torch_device(device.torch)
        jax_device(device.jax)
    except DeviceError as e:
        return str(e)
    return None


@pytest.fixture(params=list(DEVICES), scope="session")
def device(request) -> Device:
    """CPU always; CUDA and TPU where this machine has them (skipped with the reason otherwise)."""
    d = DEVICES[request.param]
    reason = _missing(d)
    if reason:
        pytest.skip(f"{d.name}: {reason}")
    return d


@pytest.fixture(scope="session")
def fixture_checkpoint():
    """The upstream-format tiny checkpoint, read through the safe loader."""
    return read_checkpoint(FIXTURE_PKL)


@pytest.fixture(scope="session")
def golden():
    """Inputs and activations computed by the upstream Flax code (tests/data/README.md)."""
    with np.load(FIXTURE_NPZ) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def fixture_batch(golden):
    return Batch({"src": golden["src"], "tgt": golden["tgt"]}, "upstream fixture")
