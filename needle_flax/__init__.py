"""needle_flax: the upstream Needle v1 model in Flax."""

from convert.config import TransformerConfig
from needle_flax.generate import generate, generate_recompute
from needle_flax.model import (
    DTYPE_MAP,
    PROBES,
    Decoder,
    DecoderBlock,
    Encoder,
    EncoderBlock,
    FeedForward,
    MultiHeadAttention,
    SimpleAttentionNetwork,
    ZCRMSNorm,
    apply_rope,
    make_causal_mask,
    make_causal_packing_mask,
    make_cross_packing_mask,
    make_packing_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
)

__all__ = [
    "DTYPE_MAP", "PROBES", "Decoder", "DecoderBlock", "Encoder", "EncoderBlock", "FeedForward",
    "MultiHeadAttention", "SimpleAttentionNetwork", "TransformerConfig", "ZCRMSNorm", "apply_rope",
    "make_causal_mask", "make_causal_packing_mask", "make_cross_packing_mask", "make_packing_mask",
    "make_padding_mask", "precompute_rope_freqs", "repeat_kv",
    "generate", "generate_recompute",
]
