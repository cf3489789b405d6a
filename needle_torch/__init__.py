"""needle_torch: the PyTorch twins of every Needle family (`needle_torch.v1`, `needle_torch.v2`).

The top-level names are Needle v1's, as before families existed; `from_pretrained` picks the
family a file records (or its tensor names say).
"""

from convert.io import open_source, source_family
from needle_torch import v1, v2
from needle_torch.layers import (
    TORCH_DTYPES,
    Tap,
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
from needle_torch.pretrained import load
from needle_torch.v1 import (
    Decoder,
    DecoderBlock,
    DecoderCache,
    Encoder,
    EncoderBlock,
    FeedForward,
    LayerCache,
    MultiHeadAttention,
    SimpleAttentionNetwork,
    TransformerConfig,
    dot_product_attention,
    generate,
    generate_recompute,
)

MODELS = {"v1": v1.SimpleAttentionNetwork, "v2": v2.SimpleAttentionNetwork}


def from_pretrained(path, dtype=None, device=None):
    """Load a .safetensors file or HF-style directory as the torch model of the family it holds."""
    source = open_source(path)
    return load(MODELS[source_family(source).name], source, dtype, device)


__all__ = [
    "MODELS", "TORCH_DTYPES", "Decoder", "DecoderBlock", "DecoderCache", "Encoder", "EncoderBlock", "FeedForward",
    "LayerCache", "MultiHeadAttention", "SimpleAttentionNetwork", "Tap", "TransformerConfig", "ZCRMSNorm",
    "apply_rope", "dot_product_attention", "from_pretrained", "generate", "generate_recompute",
    "make_attention_mask", "make_causal_mask", "make_causal_packing_mask", "make_cross_packing_mask",
    "make_packing_mask", "make_padding_mask", "precompute_rope_freqs", "repeat_kv", "v1", "v2",
]
