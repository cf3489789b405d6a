"""Building blocks every Needle family shares, in torch: the norm, RoPE, masks, GQA helpers and capture points.

The twin of needle_flax/layers.py, piece for piece. Shapes: B batch, T query length,
S key length, H heads, K kv heads, h head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from convert.fields import DTYPES

# The compute dtypes by name: every name in convert.fields.DTYPES is also torch's name for it.
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


class ZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm, (1 + scale) * x / RMS(x); statistics in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        rms = torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        # (1 + scale) * x stays in the param/compute dtype; dividing by the f32 rms promotes.
        return ((1 + self.scale) * x / rms).to(x.dtype)


def precompute_rope_freqs(head_dim: int, seq_len: int, theta: float = 10000.0, device=None):
    """cos, sin tables, each (seq_len, h/2) float32, for positions 0..seq_len-1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (T, h/2)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split RoPE on (B, H, T, h); the float32 tables promote the result to float32."""
    T, half = x.shape[2], x.shape[-1] // 2
    cos, sin = cos[:T], sin[:T]  # (T, h/2), broadcast over (B, H)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def repeat_kv(x: Tensor, repeats: int) -> Tensor:
    """GQA: each KV head repeated `repeats` times consecutively, (B, K, T, h) -> (B, K*repeats, T, h)."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)


def make_padding_mask(tokens: Tensor, pad_token_id: int = 0) -> Tensor:
    """(B, 1, 1, T) bool, True = attend."""
    return (tokens != pad_token_id)[:, None, None, :]


def make_causal_mask(seq_len: int, device=None) -> Tensor:
    """(1, 1, T, T) bool lower-triangular."""
    return torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device))[None, None, :, :]


def make_packing_mask(seg_ids: Tensor) -> Tensor:
    """(B, 1, T, T): attend within the same non-zero segment (0 = padding)."""
    same = (seg_ids[:, :, None] == seg_ids[:, None, :]) & (seg_ids[:, :, None] > 0)  # (B, T, T)
    return same[:, None, :, :]


def make_attention_mask(tokens: Tensor, pad_token_id: int = 0) -> Tensor:
    """(B, 1, T, T): causal and not padding, the decoder self-attention mask of a right-padded batch."""
    return make_causal_mask(tokens.shape[1], tokens.device) & make_padding_mask(tokens, pad_token_id)


def make_causal_packing_mask(seg_ids: Tensor, prefix: Tensor | None = None, window: int = 0) -> Tensor:
    """(B, 1, T, T): (i, j) iff seg_i = seg_j > 0 and j <= i; with a window, also i - j < window or prefix_j > 0."""
    T = seg_ids.shape[1]
    mask = make_packing_mask(seg_ids) & make_causal_mask(T, seg_ids.device)
    if window:
        i = torch.arange(T, device=seg_ids.device)
        near = ((i[:, None] - i[None, :]) < window).expand(seg_ids.shape[0], T, T)  # (B, T, T)
        if prefix is not None:
            near = near | (prefix[:, None, :] > 0)  # prefix keys (the tools) stay visible
        mask = mask & near[:, None]
    return mask


def make_cross_packing_mask(enc_seg_ids: Tensor, dec_seg_ids: Tensor) -> Tensor:
    """(B, 1, T, S): decoder token attends to encoder tokens of its own non-zero segment."""
    same = (dec_seg_ids[:, :, None] == enc_seg_ids[:, None, :]) & (dec_seg_ids[:, :, None] > 0)  # (B, T, S)
    return same[:, None, :, :]


class Tap(nn.Identity):
    """A named capture point: forward hooks see the value, the output is the input."""


