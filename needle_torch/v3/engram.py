"""Needle 3's engram hashing (NEEDLE_V3.md §3.4), shared by the model and the cached decoder (which imports nothing
from the model file: the model's `generate` method imports the decoder): the twin of needle_flax/v3/engram.py."""

from __future__ import annotations

import torch
from torch import Tensor

from convert.v3 import TransformerConfig

HASH_SEED = 0x9E3779B9  # table (oi, e) starts from SEED·(oi·σ + e + 1) mod 2^32
HASH_PRIME = 0x01000193  # FNV-1a's 32-bit prime
MASK32 = 0xFFFFFFFF


def shift_right(x: Tensor, offset: int) -> Tensor:
    """x[:, t - offset] along the time axis 1, zeros before the start (upstream's _shift_right)."""
    if offset == 0:
        return x
    zeros = x.new_zeros((x.shape[0], offset, *x.shape[2:]))
    return torch.cat([zeros, x], dim=1)[:, :x.shape[1]]


def engram_indices(tokens: Tensor, config: TransformerConfig) -> Tensor:
    """Table rows (B, T, N) int64 for table oi·E + e: acc = SEED·(oi·σ + e + 1); for j < order acc = (acc XOR
    u[t - j])·PRIME (zeros before the start are hashed; the masks drop them later); acc ^= acc >> 15; mod S.

    Upstream hashes in uint32; torch has no dependable uint32 multiply, so this runs in int64 reduced mod 2^32
    after every multiply (products stay below 2^57), which makes the final shift the logical one."""
    u = tokens.long() & MASK32
    E, sigma, S = config.engram_heads_resolved, config.engram_seed_stride, config.engram_slots
    idx = []
    for oi, order in enumerate(config.engram_orders):
        for e in range(E):
            acc = torch.full_like(u, (HASH_SEED * (oi * sigma + e + 1)) & MASK32)
            for j in range(order):
                acc = ((acc ^ shift_right(u, j)) * HASH_PRIME) & MASK32
            acc = acc ^ (acc >> 15)
            idx.append(acc % S)
    return torch.stack(idx, dim=-1)  # (B, T, N)


__all__ = ["HASH_PRIME", "HASH_SEED", "MASK32", "engram_indices", "shift_right"]
