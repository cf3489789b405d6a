"""Needle 3's engram hashing (NEEDLE_V3.md §3.4), shared by the model and the cached decoder: the twin of
needle_torch/v3/engram.py."""

from __future__ import annotations

import jax.numpy as jnp

from convert.v3 import TransformerConfig
from needle_flax.v2.engram import HASH_PRIME, HASH_SEED, HASH_SHIFT, shift_right  # Needle 2's hash, unchanged


def engram_indices(tokens, config: TransformerConfig):
    """(B, T, N) int32 table rows: an FNV-style hash of the last o tokens per table in uint32 arithmetic. The seed
    stride σ (not E) keeps a width-halved child's tables on their parent's seeds."""
    u = tokens.astype(jnp.uint32)
    E, stride, rows = config.engram_heads_resolved, config.engram_seed_stride, []
    for oi, order in enumerate(config.engram_orders):
        for e in range(E):
            seed = (HASH_SEED * (oi * stride + e + 1)) & 0xFFFFFFFF
            acc = jnp.full_like(u, jnp.uint32(seed))
            for j in range(order):  # j = 0 is the current token
                acc = (acc ^ shift_right(u, j)) * jnp.uint32(HASH_PRIME)
            acc = acc ^ (acc >> jnp.uint32(HASH_SHIFT))
            rows.append((acc % jnp.uint32(config.engram_slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)  # (B, T, N)


__all__ = ["HASH_PRIME", "HASH_SEED", "HASH_SHIFT", "engram_indices", "shift_right"]
