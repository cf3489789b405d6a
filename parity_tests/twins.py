"""The one harness that runs both twins: a family's Flax model and torch model on bit-identical weights.

Both twins compute in the run's dtype: the Flax tree is cast once (as upstream does for bf16
inference) and the torch twin is built from the same cast arrays. Every parity run, gradient
check, generation check and test builds its twins here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from convert.trees import np_dtype, numpy_to_torch
from parity_tests.adapter import Adapter
from parity_tests.devices import jax_device, torch_device


@dataclass
class Twins:
    """Both models on their devices, with bit-identical weights in the compute dtype."""

    adapter: Adapter
    config: Any  # the family's config, dtype = compute dtype
    flax_model: Any
    flax_params: Any  # jax arrays on jax_device
    torch_model: Any
    jax_device: Any
    torch_device: Any
    depths: tuple[int, ...] = ()  # depth rungs the run compares too (families with a ladder)

    def to_jax(self, a: np.ndarray):
        return jax.device_put(a, self.jax_device)

    def to_torch(self, a: np.ndarray):
        """numpy (bf16 included) -> torch tensor on the torch twin's device."""
        return numpy_to_torch(np.asarray(a)).to(self.torch_device)  # copies read-only arrays (jax.device_get's)


def cast_tree(params: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """A copy of a nested numpy tree in `dtype` (upstream casts every leaf for bf16 inference): the twins own it."""
    target = np_dtype(dtype)
    return {k: cast_tree(v, dtype) if isinstance(v, Mapping) else np.array(v, dtype=target)
            for k, v in params.items()}


def build_twins(adapter: Adapter, config: Any, flax_params: Mapping[str, Any], dtype: str,
                torch_params: Mapping[str, Any] | None = None, torch_device_name: str = "cpu",
                jax_platform: str = "cpu") -> Twins:
    """Flax twin from `flax_params`, torch twin from `torch_params` (default: the same tree), both in `dtype`."""
    tdev, jdev = torch_device(torch_device_name), jax_device(jax_platform)
    cfg = config.replace(dtype=dtype)
    flax_tree = cast_tree(flax_params, dtype)
    # A copy of its own even from the same tree: torch tensors and jax arrays may alias host memory, and a change to
    # one twin's weights (a test's deliberate corruption, a training step) must not reach the other.
    torch_tree = cast_tree(flax_params if torch_params is None else torch_params, dtype)
    tmodel = adapter.torch_model(torch_tree, cfg, dtype).to(tdev).eval()
    return Twins(adapter, cfg, adapter.flax_model(cfg), jax.device_put(flax_tree, jdev), tmodel, jdev, tdev)
