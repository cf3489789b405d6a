"""Needle 3 (cactus-needle 3.x, the laddered decoder): its config, mapping rules and ladder operations."""

from convert.v3.config import NEEDLE_V3_DEFAULT, TransformerConfig, engram_geometry, head_dims
from convert.v3.family import FAMILY
from convert.v3.ladder import (
    ladder_config,
    ladder_layer_indices,
    ladder_layer_ranks,
    ladder_order,
    ladder_slice,
    width_config,
    width_slice,
)

__all__ = ["FAMILY", "NEEDLE_V3_DEFAULT", "TransformerConfig", "engram_geometry", "head_dims", "ladder_config",
           "ladder_layer_indices", "ladder_layer_ranks", "ladder_order", "ladder_slice", "width_config",
           "width_slice"]
