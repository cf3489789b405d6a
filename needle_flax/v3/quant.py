"""Needle 3's deploy numerics beyond Needle 2's activation fake-quant (NEEDLE_V3.md §5, upstream's quantize.py).

Upstream switches these with process-global state (`configure_deploy(act_bits, kv_bits)`); here the config
says what `quant=True` means: the per-head A8 query whenever act_bits != 0, the KV quantiser from kv_bits
(0 none, >= 8 A8 per row, 1..7 CQ in groups of 64) and CQ-4 (group 128) of the probe heads' matrices.
Every quantiser is straight-through: the value is quantised, the gradient is the identity.
The twin of needle_torch/v3/quant.py.

Shapes: B batch, H heads, K kv heads, T length, hq qk head dim, hv v head dim, R rows, g group size.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from convert.v2.cq import cq_hadamard, lloyd_max_gaussian

KV_GROUP = 64  # upstream's _KV_GROUP, what configure_deploy leaves it at
HEAD_BITS, HEAD_GROUP = 4, 128  # upstream's HEAD_BITS and CQ_GROUP_SIZE


def _fake_quant(x, bits: int):
    """Symmetric per-row fake quant over the whole last axis, straight-through: upstream's
    `fake_quant(x, x.shape[-1], bits)` op for op. The same arithmetic as needle_flax.v2.lanes.fake_quant_act, but
    with upstream's (..., 1, D) group view: XLA fuses bf16 ops with excess precision, so its roundings follow the
    graph, and the fixture's bf16 quant logits come back exactly only from upstream's graph (1.4e-2 off without)."""
    qmax = 2 ** (bits - 1) - 1
    g = x.reshape(*x.shape[:-1], 1, x.shape[-1]).astype(jnp.float32)  # (..., 1, D): one group per row
    absmax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    q = (jnp.clip(jnp.round(g / scale), -qmax - 1, qmax) * scale).reshape(x.shape).astype(x.dtype)
    return x + jax.lax.stop_gradient(q - x)


def quant_query(q, quant, config):
    """Per-head A8 of q (B, H, T, hq), one scale per row of hq, whenever config.act_bits is not 0 (upstream's
    maybe_quant_query: 8 bits whatever act_bits says)."""
    if not config.act_bits or quant is False:
        return q
    return jax.lax.cond(quant, lambda t: _fake_quant(t, 8), lambda t: t, q)


def quant_kv(x, quant, config):
    """The KV cache as the engine stores it, on k (B, K, T, hq) or v (B, K, T, hv): config.kv_bits 0 none, >= 8
    A8 per row, 1..7 CQ of that width in groups of 64 along the head dim (zero-padded to 64)."""
    bits = config.kv_bits
    if not bits or quant is False:
        return x

    def fake(t):
        if bits >= 8:
            return _fake_quant(t, 8)
        return t + jax.lax.stop_gradient(cq_quantize(t, bits, KV_GROUP) - t)

    return jax.lax.cond(quant, fake, lambda t: t, x)


def head_weight(w, quant, reduce_second_last: bool = False):
    """A probe head's matrix as the engine sees it: CQ-4 in groups of 128 under quant, straight-through.
    Probes (L1, k, D) and the query (Q, D) quantise along D; the projection kernel (Q·D, out) along its input
    axis (reduce_second_last)."""
    if quant is False:
        return w

    def fake(x):
        if reduce_second_last:
            x = jnp.swapaxes(x, -1, -2)  # (out, Q·D)
        x = x + jax.lax.stop_gradient(cq_quantize(x, HEAD_BITS, HEAD_GROUP) - x)
        return jnp.swapaxes(x, -1, -2) if reduce_second_last else x

    return jax.lax.cond(quant, fake, lambda x: x, w)


@functools.cache
def _codebook(bits: int, group: int) -> np.ndarray:
    """Upstream's `_cq_codebook_np`: Lloyd–Max centroids of N(0, 1) (±√(2/π) for 1 bit) / √group, float32."""
    unit = np.array([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)]) if bits == 1 else lloyd_max_gaussian(bits)
    return (unit / np.sqrt(group)).astype(np.float32)


def cq_quantize(w, bits: int, group: int = HEAD_GROUP):
    """Upstream's JAX `cq_quantize` along the last axis: groups rotated by H_g, split into an fp16-rounded norm
    and a unit vector snapped to the nearest codebook entry (ties to the lower), rotated back; w's dtype."""
    cb = jnp.asarray(_codebook(bits, group))
    D = w.shape[-1]
    pad = (-D) % group
    wp = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]) if pad else w
    groups = wp.reshape(*wp.shape[:-1], -1, group).astype(jnp.float32)  # (..., D/g, g)
    h = jnp.asarray(cq_hadamard(group))
    rot = groups @ h  # (..., D/g, g)
    norm = jnp.sqrt(jnp.sum(rot**2, axis=-1, keepdims=True))  # (..., D/g, 1)
    unit = rot / jnp.maximum(norm, 1e-12)
    norm = norm.astype(jnp.float16).astype(jnp.float32)  # the engine stores the norms in fp16
    flat = unit.reshape(-1)
    pos = jnp.clip(jnp.searchsorted(cb, flat), 1, cb.shape[0] - 1)
    left, right = cb[pos - 1], cb[pos]
    snapped = cb[jnp.where(jnp.abs(flat - left) <= jnp.abs(flat - right), pos - 1, pos)].reshape(unit.shape)
    deq = ((snapped * norm) @ h).reshape(wp.shape).astype(w.dtype)  # (..., D + pad)
    return deq[..., :D] if pad else deq
