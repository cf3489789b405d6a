"""convert: framework-free Needle checkpoint I/O and the Flax <-> torch mapping.

Importing `convert` pulls in neither torch nor jax; the functions that return torch
tensors import torch when called.
"""

from convert.config import NEEDLE_V1_PUBLISHED, TransformerConfig, count_parameters
from convert.errors import CheckpointError, ConfigError, NeedleTwinError
from convert.mapping import (
    flax_to_torch,
    flax_to_torch_numpy,
    random_flax_params,
    rules,
    torch_numpy_to_flax,
    torch_to_flax,
)

__all__ = [
    "NEEDLE_V1_PUBLISHED", "CheckpointError", "ConfigError", "NeedleTwinError", "TransformerConfig",
    "count_parameters", "flax_to_torch", "flax_to_torch_numpy", "random_flax_params", "rules",
    "torch_numpy_to_flax", "torch_to_flax",
]
