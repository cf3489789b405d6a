"""Needle 2's hashed n-gram memory (engram, NEEDLE_V2.md §3.6): the hash, its validity masks, the module.

Every site (`engrams_{g}`) reads the same table rows and masks; only its tables,
projections and taps differ. The masks are read off the attention mask, so padding,
windows and packing reach the engram exactly as they reach attention.

Shapes: B batch, T length, D d_model, O the n-gram orders, E engram heads, N = |O|·E tables (order-major), S
slots per table, s sub_dim (N·s <= D).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from convert.v2.config import ENGRAM_TAPS, TransformerConfig
from needle_flax.layers import compute_dtype, default_init, residual_init
from needle_flax.v2.lanes import aq

HASH_SEED = 0x9E3779B9  # table k starts from HASH_SEED·(k+1) mod 2³²
HASH_PRIME = 0x01000193  # the FNV-1a prime
HASH_SHIFT = 15


def shift_right(x, offset: int):
    """x moved `offset` steps later on the time axis (axis 1), zeros shifted in at the start."""
    if offset == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (offset, 0)
    return jnp.pad(x, pad)[:, : x.shape[1]]


def mask_diag(mask, offset: int):
    """diag_o[b, t] = mask[b, 0, t, t - o], 0 where t < o: may position t see position t - o? (B|1, T)."""
    m = mask[:, 0]  # (B|1, T, T)
    T = m.shape[-1]
    if offset >= T:
        return jnp.zeros(m.shape[:-2] + (T,), m.dtype)
    d = jnp.diagonal(m, offset=-offset, axis1=-2, axis2=-1)  # (B|1, T - o)
    return d if offset == 0 else jnp.pad(d, ((0, 0), (offset, 0)))


def engram_indices(tokens, config: TransformerConfig, stride: int | None = None):
    """(B, T, N) int32 table rows: an FNV-style hash of the last o tokens per table, in uint32 wrap-around
    arithmetic. The zeros before the start are hashed like tokens (the masks discard them later). stride: the seed
    stride σ of table (oi, e), SEED·(oi·σ + e + 1); None is E (Needle 2's)."""
    u = tokens.astype(jnp.uint32)
    E, rows = config.engram_heads_resolved, []
    stride = E if stride is None else stride
    for oi, order in enumerate(config.engram_orders):
        for e in range(E):
            seed = (HASH_SEED * (oi * stride + e + 1)) & 0xFFFFFFFF
            acc = jnp.full_like(u, jnp.uint32(seed))
            for j in range(order):  # j = 0 is the current token
                acc = (acc ^ shift_right(u, j)) * jnp.uint32(HASH_PRIME)
            acc = acc ^ (acc >> jnp.uint32(HASH_SHIFT))  # logical: acc is unsigned
            rows.append((acc % jnp.uint32(config.engram_slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)  # (B, T, N)


def engram_masks(mask, config: TransformerConfig):
    """(ngram_ok (B|1, T, N), tap_ok (4, B|1, T)), bool, from the attention mask (B|1, 1, T, T).

    ngram_ok[..., k]: table k's n-gram lies inside what the query may see (its oldest token,
    o - 1 back); tap_ok[j]: the conv tap j·max(O) back is visible. B is 1 for a shared mask.
    """
    E, dil = config.engram_heads_resolved, config.engram_dilation
    ngram_ok = jnp.stack([mask_diag(mask, o - 1) for o in config.engram_orders for _ in range(E)], axis=-1)
    tap_ok = jnp.stack([mask_diag(mask, j * dil) for j in range(ENGRAM_TAPS)])
    return ngram_ok, tap_ok


def _taps_init(key, shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype).at[0].set(1.0)  # identity conv: only the current position


class Engram(nn.Module):
    """One engram site: gather the hashed rows, project to key and value, then a causal dilated 4-tap conv on v."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, indices, ngram_ok, tap_ok, quant=False):
        cfg, dt = self.config, compute_dtype(self.config)
        N, s, D = cfg.num_engram_tables, cfg.engram_sub_dim, cfg.d_model
        tables = self.param("embedding", default_init(), (N, cfg.engram_slots, s))
        fetched = tables[jnp.arange(N), indices] * ngram_ok[..., None]  # (B, T, N, s)
        e = fetched.reshape(*indices.shape[:2], N * s)  # (B, T, N·s) table-major
        e = aq(e.astype(dt), quant)
        k = nn.Dense(D, dtype=dt, use_bias=False, kernel_init=default_init(), name="key_proj")(e)
        v = nn.Dense(D, dtype=dt, use_bias=False, kernel_init=residual_init(cfg.num_layers), name="value_proj")(e)
        taps = self.param("taps", _taps_init, (ENGRAM_TAPS, D)).astype(dt)
        # Python's sum (0 + tap 0 + tap 1 ...) is upstream's order of additions.
        v = sum(taps[j] * shift_right(v, j * cfg.engram_dilation) * tap_ok[j][..., None] for j in range(ENGRAM_TAPS))
        return k, v
