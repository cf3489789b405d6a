"""Needle 2 in PyTorch: the twin of needle_flax.v2 (NEEDLE_V2.md)."""

from convert.v2.config import TransformerConfig
from needle_torch.v2.engram import Engram, engram_indices, engram_masks
from needle_torch.v2.lanes import aq, fake_quant_act, lane_offsets, rms_unit, sinkhorn
from needle_torch.v2.model import (
    Attention,
    Block,
    ConfidenceHead,
    ContrastiveHead,
    HadamardMLP,
    MHCLayer,
    SimpleAttentionNetwork,
    Stack,
    dot_product_attention,
    make_window_mask,
    probe_pool,
    walsh_matrix,
    walsh_transform,
)

__all__ = [
    "Attention", "Block", "ConfidenceHead", "ContrastiveHead", "Engram", "HadamardMLP", "MHCLayer",
    "SimpleAttentionNetwork", "Stack", "TransformerConfig", "aq", "dot_product_attention", "engram_indices",
    "engram_masks", "fake_quant_act", "lane_offsets", "make_window_mask", "probe_pool", "rms_unit", "sinkhorn",
    "walsh_matrix", "walsh_transform",
]
