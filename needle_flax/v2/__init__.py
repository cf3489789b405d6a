"""Needle 2 in Flax: upstream's decoder-only model (engram memory, mHC lanes, MTP and probe heads), param for
param; cached generation compiled once (`generate`), upstream's recompute loop (`generate_recompute`), and the
port of upstream's own decode.py (`tests.v2.upstream_decode`, the reference and benchmark baseline)."""

from convert.v2.config import TransformerConfig
from needle_flax.layers import make_attention_mask, make_causal_mask, make_causal_packing_mask, make_padding_mask
from needle_flax.v2.engram import Engram, engram_indices, engram_masks
from needle_flax.v2.generate import (
    DecodeCache,
    decode_step,
    engram_history_masks,
    generate,
    generate_recompute,
    make_decode_mask,
    new_cache,
)
from needle_flax.v2.lanes import aq, fake_quant_act, lane_offsets, rms_unit, sinkhorn
from needle_flax.v2.model import (
    Attention,
    Block,
    ConfidenceHead,
    ContrastiveHead,
    HadamardMLP,
    MHCLayer,
    SimpleAttentionNetwork,
    Stack,
    make_window_mask,
    next_tokens,
    probe_pool,
    walsh_matrix,
)

__all__ = [
    "Attention", "Block", "ConfidenceHead", "ContrastiveHead", "DecodeCache", "Engram", "HadamardMLP", "MHCLayer",
    "SimpleAttentionNetwork", "Stack", "TransformerConfig", "aq", "decode_step", "engram_history_masks",
    "engram_indices", "engram_masks", "fake_quant_act", "generate", "generate_recompute", "lane_offsets",
    "make_attention_mask", "make_causal_mask", "make_causal_packing_mask", "make_decode_mask", "make_padding_mask",
    "make_window_mask", "new_cache", "next_tokens", "probe_pool", "rms_unit", "sinkhorn", "walsh_matrix",
]
