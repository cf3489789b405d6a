"""Needle 3's engram hashing (NEEDLE_V3.md §3.4), shared by the model and the cached decoder: the twin of
needle_torch/v3/engram.py.

Shapes: B batch, T length, N = |O|·E tables (O the n-gram orders, E heads).
"""

from __future__ import annotations

from convert.v3 import TransformerConfig
from needle_flax.v2.engram import engram_indices as v2_engram_indices
from needle_flax.v2.engram import shift_right  # the decoder's import: Needle 2's, unchanged


def engram_indices(tokens, config: TransformerConfig):
    """(B, T, N) int32 table rows: Needle 2's hash with the seed stride σ (not E), which keeps a width-halved
    child's tables on their parent's seeds."""
    return v2_engram_indices(tokens, config, stride=config.engram_seed_stride)


__all__ = ["engram_indices", "shift_right"]
