"""Needle 3 in Flax: upstream's laddered decoder (split head dims, conv taps, sliding windows, the Monarch MLP,
engram memory, mHC lanes, depth rungs and three probe heads), param for param; `quant.py` holds its deploy
quantisers, `generate.py` its cached decoding (`generate(model, params, tokens, max_new_tokens)`)."""

from convert.v3.config import TransformerConfig
from needle_flax.layers import make_causal_mask, make_padding_mask
from needle_flax.v3.embed import embed, scores
from needle_flax.v3.generate import generate, generate_recompute
from needle_flax.v3.model import (
    Block,
    ConfidenceHead,
    EmbeddingHead,
    Engram,
    HadamardMLP,
    HeadProjection,
    MHCLayer,
    MultiHeadAttention,
    ProbeHead,
    RouterHead,
    SimpleAttentionNetwork,
    Stack,
    conv_taps,
    engram_indices,
    kron_apply,
    make_window_mask,
    mask_diag,
    probe_pool,
    shift_right,
)
from needle_flax.v3.quant import cq_quantize, head_weight, quant_kv, quant_query

__all__ = [
    "Block", "ConfidenceHead", "EmbeddingHead", "Engram", "HadamardMLP", "HeadProjection", "MHCLayer",
    "MultiHeadAttention", "ProbeHead", "RouterHead", "SimpleAttentionNetwork", "Stack", "TransformerConfig",
    "conv_taps", "cq_quantize", "embed", "engram_indices", "generate", "generate_recompute", "head_weight",
    "kron_apply", "make_causal_mask", "make_padding_mask", "make_window_mask", "mask_diag", "probe_pool", "quant_kv",
    "quant_query", "scores", "shift_right",
]
