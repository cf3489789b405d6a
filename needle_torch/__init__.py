"""needle_torch: the PyTorch twin of Needle v1."""

from convert.config import TransformerConfig
from needle_torch.generate import generate, generate_recompute
from needle_torch.model import (
    Decoder,
    DecoderBlock,
    DecoderCache,
    Encoder,
    EncoderBlock,
    FeedForward,
    LayerCache,
    MultiHeadAttention,
    SimpleAttentionNetwork,
    Tap,
    ZCRMSNorm,
    apply_rope,
    dot_product_attention,
    make_causal_mask,
    make_causal_packing_mask,
    make_cross_packing_mask,
    make_packing_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
)

__all__ = [
    "Decoder", "DecoderBlock", "DecoderCache", "Encoder", "EncoderBlock", "FeedForward", "LayerCache",
    "MultiHeadAttention", "SimpleAttentionNetwork", "Tap", "TransformerConfig", "ZCRMSNorm", "apply_rope",
    "dot_product_attention", "make_causal_mask", "make_causal_packing_mask", "make_cross_packing_mask",
    "make_packing_mask", "make_padding_mask", "precompute_rope_freqs", "repeat_kv",
    "generate", "generate_recompute",
]
