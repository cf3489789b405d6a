"""needle_flax: upstream's Flax models of every Needle family (`needle_flax.v1`, `needle_flax.v2`).

The top-level names are Needle v1's, as before families existed.
"""

from needle_flax import v1
from needle_flax.layers import (
    DTYPE_MAP,
    PROBES,
    ZCRMSNorm,
    apply_rope,
    make_attention_mask,
    make_causal_mask,
    make_causal_packing_mask,
    make_cross_packing_mask,
    make_packing_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
)
from needle_flax.v1 import (
    Decoder,
    DecoderBlock,
    Encoder,
    EncoderBlock,
    FeedForward,
    MultiHeadAttention,
    SimpleAttentionNetwork,
    TransformerConfig,
    generate,
    generate_recompute,
)

__all__ = [
    "DTYPE_MAP", "PROBES", "Decoder", "DecoderBlock", "Encoder", "EncoderBlock", "FeedForward",
    "MultiHeadAttention", "SimpleAttentionNetwork", "TransformerConfig", "ZCRMSNorm", "apply_rope",
    "generate", "generate_recompute", "make_attention_mask", "make_causal_mask", "make_causal_packing_mask",
    "make_cross_packing_mask", "make_packing_mask", "make_padding_mask", "precompute_rope_freqs", "repeat_kv", "v1",
]
