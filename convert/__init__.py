"""convert: framework-free Needle checkpoint I/O and the Flax <-> torch mapping, for every model family.

Importing `convert` pulls in neither torch nor jax; the functions that return torch
tensors import torch when called. The family of a call is its config's class
(`convert.v1.TransformerConfig`, `convert.v2.TransformerConfig`).
"""

from convert.errors import CheckpointError, ConfigError, NeedleTwinError
from convert.mapping import (
    count_parameters,
    flax_to_torch,
    flax_to_torch_numpy,
    random_flax_params,
    torch_numpy_to_flax,
    torch_to_flax,
)
from convert.registry import FAMILIES, family_named, family_of
from convert.v1 import NEEDLE_V1_PUBLISHED, TransformerConfig
from convert.v2 import NEEDLE_V2_PUBLISHED

__all__ = [
    "FAMILIES", "NEEDLE_V1_PUBLISHED", "NEEDLE_V2_PUBLISHED", "CheckpointError", "ConfigError", "NeedleTwinError",
    "TransformerConfig", "count_parameters", "family_named", "family_of", "flax_to_torch", "flax_to_torch_numpy",
    "random_flax_params", "torch_numpy_to_flax", "torch_to_flax",
]
