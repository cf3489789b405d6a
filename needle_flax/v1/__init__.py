"""Needle v1 in Flax: upstream's encoder-decoder, parameter for parameter."""

from convert.v1.config import TransformerConfig
from needle_flax.v1.generate import generate, generate_recompute
from needle_flax.v1.model import (
    Decoder,
    DecoderBlock,
    Encoder,
    EncoderBlock,
    FeedForward,
    MultiHeadAttention,
    SimpleAttentionNetwork,
)

__all__ = [
    "Decoder", "DecoderBlock", "Encoder", "EncoderBlock", "FeedForward", "MultiHeadAttention",
    "SimpleAttentionNetwork", "TransformerConfig", "generate", "generate_recompute",
]
