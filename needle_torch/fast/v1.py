"""The fast forms of Needle v1's plain pieces (needle_torch/v1/model.py), put in place by seam.fast_paths.

Under torch.compile on CPU, products of few rows (a decode step's) are written as multiply-and-sums that inductor
fuses with their neighbours and that read each weight once in its stored dtype; the decoder's norms that feed such
products are stored once rather than recomputed inside each (kernels.stored). Elsewhere each form is the plain
piece's computation, with bf16 products upcast on CPUs without bf16 units (kernels.bf16_path).

Shapes: B batch, T queries, S keys, H heads, K kv heads, G = H/K, h head dim, D d_model, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from needle_torch.fast.kernels import Linear, as_reduction, matmul_nt, stored
from needle_torch.layers import ZCRMSNorm
from needle_torch.v1 import model
from needle_torch.v1.model import SimpleAttentionNetwork


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """model.dot_product_attention; a compiled CPU step of few rows as fused multiply-and-sums."""
    B, H, T, h = q.shape
    K, S = k.shape[1], k.shape[2]
    qk_dtype = torch.promote_types(q.dtype, k.dtype)
    reduce = as_reduction(B * T, q.device)
    if qk_dtype == torch.float32 and not reduce:
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device)
            bias.masked_fill_(~mask, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=bias, scale=1.0 / math.sqrt(h),
            enable_gqa=q.shape[1] != k.shape[1],
        )
    q = q.reshape(B, K, H // K * T, h)  # (B, K, G*T, h): head K*g+j reads kv head K
    scores = matmul_nt(q, k, qk_dtype, reduce)  # (B, K, G*T, S)
    scores = scores.float().view(B, K, H // K, T, S) / math.sqrt(h)  # (B, K, G, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    probs = scores.softmax(dim=-1).view(B, K, H // K * T, S)  # (B, K, G*T, S)
    out = matmul_nt(probs, v.float().transpose(-1, -2), torch.float32, reduce)  # (B, K, G*T, h)
    return out.reshape(B, H, T, h)


def logits(self: SimpleAttentionNetwork, x: Tensor, weight: Tensor | None = None) -> Tensor:
    """SimpleAttentionNetwork._logits; a compiled CPU step of few rows reads the embedding in its own dtype."""
    if as_reduction(x.shape[:-1].numel(), x.device):
        return self.logits_tap(matmul_nt(x, self.embedding.weight, torch.float32, reduce=True))
    weight = self.embedding.weight.float() if weight is None else weight
    return self.logits_tap(matmul_nt(x, weight, torch.float32))  # (B, T, V) float32, tied


class StoredNorm(ZCRMSNorm):
    """ZCRMSNorm whose output a compiled CPU graph stores once for the few-row products that read it."""

    def forward(self, x: Tensor) -> Tensor:
        return stored(super().forward(x))


def module_swaps(net: nn.Module) -> list[tuple[nn.Module, type]]:
    """The decoder's norms that feed products (each block's attention norms, the final norm) as StoredNorm."""
    decoder = getattr(net, "decoder", None)
    if decoder is None:
        return []
    norms = [n for block in decoder.layers for n in (block.self_attn_norm, block.cross_attn_norm)]
    return [(n, StoredNorm) for n in (*norms, decoder.final_norm) if type(n) is ZCRMSNorm]


# What replaces the plain pieces inside fast_paths: (owner, attribute, fast form).
SWAPS = (
    (model, "dot_product_attention", dot_product_attention),
    (SimpleAttentionNetwork, "_logits", logits),
)
LINEAR = Linear  # the class the model's nn.Linear modules take inside fast_paths
