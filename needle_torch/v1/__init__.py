"""Needle v1 in PyTorch: the twin of needle_flax.v1."""

from convert.v1.config import TransformerConfig
from needle_torch.v1.generate import generate, generate_recompute
from needle_torch.v1.model import (
    Decoder,
    DecoderBlock,
    DecoderCache,
    Encoder,
    EncoderBlock,
    FeedForward,
    LayerCache,
    MultiHeadAttention,
    SimpleAttentionNetwork,
    dot_product_attention,
)

__all__ = [
    "Decoder", "DecoderBlock", "DecoderCache", "Encoder", "EncoderBlock", "FeedForward", "LayerCache",
    "MultiHeadAttention", "SimpleAttentionNetwork", "TransformerConfig", "dot_product_attention", "generate",
    "generate_recompute",
]
