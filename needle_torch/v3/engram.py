"""Needle 3's engram hashing (NEEDLE_V3.md §3.4), shared by the model and the cached decoder (which imports nothing
from the model file: the model's `generate` method imports the decoder): the twin of needle_flax/v3/engram.py.

Shapes: B batch, T length, N = |O|·E tables (O the n-gram orders, E heads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from convert.v3 import TransformerConfig
from needle_torch.v2.engram import engram_indices as v2_engram_indices


def shift_right(x: Tensor, offset: int) -> Tensor:
    """x[:, t - offset] along the time axis 1, zeros before the start (upstream's _shift_right)."""
    if offset == 0:
        return x
    zeros = x.new_zeros((x.shape[0], offset, *x.shape[2:]))
    return torch.cat([zeros, x], dim=1)[:, :x.shape[1]]


def engram_indices(tokens: Tensor, config: TransformerConfig) -> Tensor:
    """Table rows (B, T, N) int64: Needle 2's hash with the seed stride σ (not E), which keeps a width-halved
    child's tables on their parent's seeds."""
    return v2_engram_indices(tokens, config, stride=config.engram_seed_stride)


__all__ = ["engram_indices", "shift_right"]
