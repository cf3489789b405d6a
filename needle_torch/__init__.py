"""needle_torch: the PyTorch twins of every Needle family (`needle_torch.v1`, `needle_torch.v2`).

The top-level names are Needle v1's, as before families existed; `from_pretrained` picks the
family a file records (or its tensor names say).
"""

import importlib
import pkgutil

from convert.errors import CheckpointError
from convert.io import open_source, source_family
from convert.registry import FAMILIES
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


def _models() -> dict[str, type]:
    """The torch model of every registered family that has its `needle_torch/<family>` folder."""
    folders = {m.name for m in pkgutil.iter_modules(__path__) if m.ispkg}
    return {name: importlib.import_module(f"{__name__}.{name}").SimpleAttentionNetwork
            for name in FAMILIES if name in folders}


MODELS = _models()


def from_pretrained(path, dtype=None, device=None):
    """Load a .safetensors file or HF-style directory as the torch model of the family it holds."""
    source = open_source(path)
    family = source_family(source)
    if family.name not in MODELS:
        raise CheckpointError(f"{path} holds a {family.title} model, which has no torch twin yet; "
                              f"needle_torch has {', '.join(MODELS)}")
    return load(MODELS[family.name], source, dtype, device)


__all__ = [
    "MODELS", "TORCH_DTYPES", "Decoder", "DecoderBlock", "DecoderCache", "Encoder", "EncoderBlock", "FeedForward",
    "LayerCache", "MultiHeadAttention", "SimpleAttentionNetwork", "Tap", "TransformerConfig", "ZCRMSNorm",
    "apply_rope", "dot_product_attention", "from_pretrained", "generate", "generate_recompute",
    "make_attention_mask", "make_causal_mask", "make_causal_packing_mask", "make_cross_packing_mask",
    "make_packing_mask", "make_padding_mask", "precompute_rope_freqs", "repeat_kv", "v1", "v2",
]
