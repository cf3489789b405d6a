"""Needle 3's deploy numerics beyond Needle 2's activation fake-quant (NEEDLE_V3.md §5, upstream's quantize.py).

Upstream switches these with process-global state (`configure_deploy(act_bits, kv_bits)`); here the config
says what `quant=True` means: the per-head A8 query whenever act_bits != 0, the KV quantiser from kv_bits
(0 none, >= 8 A8 per row, 1..7 CQ in groups of 64) and CQ-4 (group 128) of the probe heads' matrices.
Every quantiser is straight-through: the value is quantised, the gradient is the identity.
The twin of needle_flax/v3/quant.py.

Shapes: B batch, H heads, K kv heads, T length, hq qk head dim, hv v head dim, R rows, g group size.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from convert.v2.cq import cq_hadamard, lloyd_max_gaussian
from needle_torch.v2.lanes import fake_quant_act

KV_GROUP = 64  # upstream's _KV_GROUP, what configure_deploy leaves it at
HEAD_BITS, HEAD_GROUP = 4, 128  # upstream's HEAD_BITS and CQ_GROUP_SIZE


def quant_query(q: Tensor, quant: bool, config) -> Tensor:
    """Per-head A8 of q (B, H, T, hq), one scale per row of hq, whenever config.act_bits is not 0 (upstream's
    maybe_quant_query: 8 bits whatever act_bits says)."""
    if not config.act_bits or not quant:
        return q
    return fake_quant_act(q, 8)


def quant_kv(x: Tensor, quant: bool, config) -> Tensor:
    """The KV cache as the engine stores it, on k (B, K, T, hq) or v (B, K, T, hv): config.kv_bits 0 none, >= 8
    A8 per row, 1..7 CQ of that width in groups of 64 along the head dim (zero-padded to 64)."""
    bits = config.kv_bits
    if not bits or not quant:
        return x
    if bits >= 8:
        return fake_quant_act(x, 8)
    return x + (cq_quantize(x, bits, KV_GROUP) - x).detach()


def head_weight(w: Tensor, quant: bool) -> Tensor:
    """A probe head's matrix as the engine sees it: CQ-4 in groups of 128 under quant, straight-through, along
    the last axis: D for the probes (L1, k, D) and the query (Q, D), the input axis Q·D for a torch projection
    weight (out, Q·D) (Flax's kernel is (Q·D, out), hence its reduce_second_last)."""
    if not quant:
        return w
    return w + (cq_quantize(w, HEAD_BITS, HEAD_GROUP) - w).detach()


@functools.cache
def _codebook(bits: int, group: int) -> np.ndarray:
    """Upstream's `_cq_codebook_np`: Lloyd–Max centroids of N(0, 1) (±√(2/π) for 1 bit) / √group, float32."""
    unit = np.array([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)]) if bits == 1 else lloyd_max_gaussian(bits)
    return (unit / np.sqrt(group)).astype(np.float32)


def cq_quantize(w: Tensor, bits: int, group: int = HEAD_GROUP) -> Tensor:
    """Upstream's JAX `cq_quantize` along the last axis: groups rotated by H_g, split into an fp16-rounded norm
    and a unit vector snapped to the nearest codebook entry (ties to the lower), rotated back; w's dtype."""
    cb = torch.as_tensor(_codebook(bits, group), device=w.device)
    D = w.shape[-1]
    pad = (-D) % group
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    groups = wp.reshape(*wp.shape[:-1], -1, group).float()  # (..., D/g, g)
    h = torch.tensor(cq_hadamard(group), device=w.device)  # a copy: the cached numpy matrix is read-only
    rot = groups @ h  # (..., D/g, g)
    norm = torch.sqrt(rot.pow(2).sum(-1, keepdim=True))  # (..., D/g, 1)
    unit = rot / torch.clamp(norm, min=1e-12)
    norm = norm.half().float()  # the engine stores the norms in fp16
    flat = unit.reshape(-1)
    pos = torch.clamp(torch.searchsorted(cb, flat), 1, cb.shape[0] - 1)
    left, right = cb[pos - 1], cb[pos]
    snapped = cb[torch.where((flat - left).abs() <= (flat - right).abs(), pos - 1, pos)].reshape(unit.shape)
    deq = ((snapped * norm) @ h).reshape(wp.shape).to(w.dtype)  # (..., D + pad)
    return deq[..., :D] if pad else deq


__all__ = ["HEAD_BITS", "HEAD_GROUP", "KV_GROUP", "cq_quantize", "head_weight", "quant_kv", "quant_query"]
