"""Building blocks every Needle family shares, in Flax: the norm, RoPE, masks and GQA helpers.

The twin of needle_torch/layers.py, piece for piece. Shapes: B batch, T query length,
S key length, H heads, K kv heads, h head dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
from jax.nn import initializers as jinit

DTYPE_MAP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PROBES = "intermediates"  # the collection probes are sown into


def compute_dtype(config):
    return DTYPE_MAP[config.dtype]


def default_init():
    return jinit.normal(stddev=0.02)


def residual_init(num_layers: int):
    return jinit.normal(stddev=0.02 / math.sqrt(2 * num_layers))


class ZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm, (1 + scale) * x / RMS(x); statistics in float32."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", jinit.zeros, (x.shape[-1],))
        rms = jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + self.epsilon)
        # (1 + scale) * x stays in the param/compute dtype; dividing by the f32 rms promotes.
        return ((1 + scale) * x / rms).astype(self.dtype)


def precompute_rope_freqs(head_dim: int, seq_len: int, theta: float = 10000.0):
    """cos, sin tables, each (seq_len, h/2) float32, for positions 0..seq_len-1."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2).astype(jnp.float32) / head_dim))
    angles = jnp.outer(jnp.arange(seq_len).astype(jnp.float32), inv_freq)  # (T, h/2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Half-split RoPE on (B, H, T, h); the float32 tables promote the result to float32."""
    T, half = x.shape[2], x.shape[-1] // 2
    cos = cos[:T][None, None, :, :]  # (1, 1, T, h/2)
    sin = sin[:T][None, None, :, :]  # (1, 1, T, h/2)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def repeat_kv(x, repeats: int):
    """GQA: each KV head repeated `repeats` times consecutively, (B, K, T, h) -> (B, K*repeats, T, h)."""
    return x if repeats == 1 else jnp.repeat(x, repeats, axis=1)


# ----------------------------------------------------------------------------- masks (bool, True = may attend)


def make_padding_mask(tokens, pad_token_id: int = 0):
    """(B, 1, 1, T): keys that are not padding."""
    return (tokens != pad_token_id)[:, None, None, :]


def make_causal_mask(seq_len: int):
    """(1, 1, T, T) lower-triangular."""
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))[None, None, :, :]


def make_attention_mask(tokens, pad_token_id: int = 0):
    """(B, 1, T, T): causal and not padding, the decoder self-attention mask of a right-padded batch."""
    return make_causal_mask(tokens.shape[1]) & make_padding_mask(tokens, pad_token_id)


def make_packing_mask(seg_ids):
    """(B, 1, T, T): attend within the same non-zero segment (0 = padding)."""
    same = (seg_ids[:, :, None] == seg_ids[:, None, :]) & (seg_ids[:, :, None] > 0)  # (B, T, T)
    return same[:, None, :, :]


def make_causal_packing_mask(seg_ids, prefix=None, window: int = 0):
    """(B, 1, T, T): (i, j) iff seg_i = seg_j > 0 and j <= i; with a window, also i - j < window or prefix_j > 0."""
    T = seg_ids.shape[1]
    mask = make_packing_mask(seg_ids) & make_causal_mask(T)
    if window:
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        near = jnp.broadcast_to((i - j) < window, (seg_ids.shape[0], T, T))  # (B, T, T)
        if prefix is not None:
            near = near | (prefix[:, None, :] > 0)  # prefix keys (the tools) stay visible
        mask = mask & near[:, None]
    return mask


def make_cross_packing_mask(enc_seg_ids, dec_seg_ids):
    """(B, 1, T, S): decoder token attends to encoder tokens of its own non-zero segment."""
    same = (dec_seg_ids[:, :, None] == enc_seg_ids[:, None, :]) & (dec_seg_ids[:, :, None] > 0)  # (B, T, S)
    return same[:, None, :, :]
