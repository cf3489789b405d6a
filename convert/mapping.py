"""In-memory Flax <-> torch conversion for every family: the family is the config's, the engine is convert.plan.

A tree or state_dict in memory is opened as a `Source` and read through the same lazy views
that convert files, so one piece of code applies the rules everywhere. Everything works on
numpy arrays; `flax_to_torch` / `torch_to_flax` convert at the edges and import torch only
when they meet it, so `convert` itself imports neither torch nor jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from convert import plan
from convert.registry import family_of
from convert.source import source_from_state, source_from_tree
from convert.trees import np_dtype, numpy_to_torch, unflatten_tree


def flax_to_torch_numpy(params: Mapping[str, Any], config) -> dict[str, np.ndarray]:
    """Flax param tree -> {torch name: numpy array}, dtypes kept, after checking every name and shape."""
    source = source_from_tree(params)
    table = plan.check_names(source, family_of(config), config, "Flax params")
    return {p.name: p.array() for p in plan.torch_view(source, table)}


def torch_numpy_to_flax(state: Mapping[str, Any], config) -> dict[str, Any]:
    """{torch name: array or tensor} -> nested upstream Flax tree of numpy arrays, dtypes kept."""
    source = source_from_state(state)
    table = plan.check_names(source, family_of(config), config, "torch state_dict")
    return unflatten_tree({p.name: p.array() for p in plan.flax_view(source, table)})


def flax_to_torch(params: Mapping[str, Any], config) -> dict[str, Any]:
    """Flax param tree -> torch state_dict that `load_state_dict(strict=True)` accepts; dtypes kept."""
    return {name: numpy_to_torch(a) for name, a in flax_to_torch_numpy(params, config).items()}


def torch_to_flax(state_dict: Mapping[str, Any], config) -> dict[str, Any]:
    """torch state_dict -> upstream Flax param tree (nested dict of numpy arrays); dtypes kept."""
    return torch_numpy_to_flax(state_dict, config)


def random_flax_params(config, seed: int = 0, dtype: str = "float32", std: float = 0.02,
                       groups: Iterable[str] | None = None) -> dict[str, Any]:
    """A Flax tree with EVERY leaf random (norm scales and gates too, so a wrong mapping cannot hide).

    Matrices and tables ~ N(0, std); vectors and scalars (norm scales, gates, biases, routing offsets) ~ N(0, 0.1).
    groups: the optional groups to include (None: all of the family's)."""
    rng = np.random.default_rng(seed)
    table = family_of(config).table(config, groups)
    flat = {}
    for rule in table.rules:
        scale = std if len(rule.shape) >= 2 else 0.1
        flat[rule.flax] = (rng.standard_normal(table.flax_shape(rule), dtype=np.float32) * scale
                           ).astype(np_dtype(dtype))
    return unflatten_tree(flat)


def count_parameters(config, groups: Iterable[str] | None = None) -> int:
    """Parameters of a model of this config, from the mapping rules (groups: default = upstream's plain init)."""
    return family_of(config).count_parameters(config, groups)
