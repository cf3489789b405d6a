"""Needle 2's CQ weight quantizer (NEEDLE_V2.md §5), numpy only and equal to upstream's bit for bit.

A weight matrix is cut along its reduction axis into groups of g = 128 values. Each group is
rotated by the normalised Walsh matrix H_g, split into a norm (stored fp16) and a unit vector,
and every unit coordinate is snapped to the nearest entry of a Lloyd–Max codebook of N(0, 1)
scaled by 1/√g (or the ternary {-c, 0, c}/√g). Dequantising is `(cb[idx] · norm16) · H_g`.

Shapes: R rows of a 2-D view (out, in), I = in, Ip = in padded to a multiple of g, G = Ip/g
groups per row, g the group size.

Why the exact numpy calls matter: upstream's exporter computes `rot = group @ H` with numpy
float32 (OpenBLAS sgemm) on a (R, G, g) array and the norm with numpy's pairwise sum over the
last axis; a norm within an ulp of an fp16 midpoint, or a unit coordinate at a codebook
midpoint, rounds the other way under any other summation order. We make the same calls on the
same shapes, so the codes and fp16 norms equal upstream's. Upstream's tree quantizer
(`cq_quantize_params`) does the same arithmetic in JAX: its codes and norms agree with the
exporter's on the fixtures, and its dequantised float32 values differ from ours by float32
rounding of `(cb·norm)·H` only (≤ 7.2e-7 there), which can move an fp16 result by one ulp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from convert import cact as container
from convert.cact import GROUP, TERNARY_RECORD_BITS, hadamard, lloyd_max_gaussian
from convert.cact import cq_nbytes as cq_nbytes
from convert.cact import nearest_index as nearest_index
from convert.cact import packed_row_bytes as packed_row_bytes
from convert.cact import padded as padded
from convert.cact import unpack_codes as unpack_codes
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.bits import TERNARY_BITS, Bits, bits_for, check_bits, groups_along_input, is_quant_leaf

# The matrix-level CQ arithmetic is the .cact codec's (by record bits); this module speaks Needle 2's widths.
cq_hadamard = hadamard  # upstream's _cq_hadamard_np


def record_bits(bits: Bits) -> int:
    """The `bits` field of a .cact record: the width, or 5 for ternary."""
    bits = check_bits(bits)
    return TERNARY_RECORD_BITS if bits == TERNARY_BITS else int(bits)


def width_of_record(rec_bits: int) -> Bits:
    """Inverse of record_bits."""
    return TERNARY_BITS if rec_bits == TERNARY_RECORD_BITS else check_bits(rec_bits, "record bits")


def unit_codebook(bits: Bits) -> np.ndarray:
    """The float64 centroids before scaling: Lloyd–Max for 2/3/4 bits, upstream's ternary constants for 1.58."""
    return container.TERNARY_UNIT if check_bits(bits) == TERNARY_BITS else lloyd_max_gaussian(int(bits))


def codebook(bits: Bits, group: int = GROUP) -> np.ndarray:
    """Upstream's `_cq_codebook_np(bits, group)`: the unit centroids / √group as float32 (read-only)."""
    return container.codebook(record_bits(bits), group)


def cq_encode(mat: np.ndarray, bits: Bits, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a 2-D (R, I) matrix grouped along I: (idx (R, Ip) uint8, norm16 (R, G) float16)."""
    return container.cq_encode(mat, record_bits(bits), group)


def cq_decode(idx: np.ndarray, norm16: np.ndarray, in_dim: int, bits: Bits, group: int = GROUP) -> np.ndarray:
    """(R, Ip) codes and (R, G) fp16 norms -> the (R, in_dim) float32 matrix: `(cb[idx] · norm) @ H`, unpadded."""
    return container.cq_decode(idx, norm16, in_dim, record_bits(bits), group)


def pack_codes(idx: np.ndarray, bits: Bits) -> np.ndarray:
    """(R, Ip) indices -> (R, row bytes) uint8, as `convert.cact.pack_codes` for a Needle 2 width."""
    return container.pack_codes(idx, record_bits(bits))


# ----------------------------------------------------------------------------- fake-quant (what the model sees)


def cq_quantize(w: Any, bits: Bits, g: int = GROUP) -> np.ndarray:
    """Upstream's `cq_quantize(w, bits, g)`: fake-quantise along the last axis (any leading shape).

    Returns w's dtype for float16/bfloat16/float32 input (upstream casts back to w.dtype), else float32.
    """
    w = np.asarray(w)
    rows = w.reshape(-1, w.shape[-1]) if w.ndim else w.reshape(1, 1)  # (R, I)
    idx, norm16 = cq_encode(rows, bits, g)
    deq = cq_decode(idx, norm16, rows.shape[1], bits, g).reshape(w.shape)
    return deq.astype(_result_dtype(w.dtype), copy=False)


def _result_dtype(dtype: np.dtype) -> np.dtype:
    """Upstream casts back to w.dtype; float64 and integers would be float32 under JAX's defaults."""
    if (dtype.kind == "f" and dtype.itemsize <= 4) or dtype.name == "bfloat16":
        return dtype
    return np.dtype(np.float32)


def quantize_leaf(path: str, leaf: Any, bits: Bits, g: int = GROUP) -> np.ndarray:
    """One quantised leaf as upstream's tree quantizer does it: kernels and φ along their input axis."""
    a = np.asarray(leaf)
    if groups_along_input(path):
        return np.swapaxes(cq_quantize(np.swapaxes(a, -1, -2), bits, g), -1, -2)
    return cq_quantize(a, bits, g)


def quant_leaf_names(params: Mapping[str, Any]) -> list[str]:
    """The "/"-joined paths upstream's quantizer changes (`_is_quant_leaf`), in tree order."""
    return [p for p, leaf in flatten_tree(params).items() if is_quant_leaf(p, np.ndim(leaf))]


def cq_quantize_params(params: Mapping[str, Any], bits: Bits, g: int = GROUP) -> dict[str, Any]:
    """Upstream's `cq_quantize_params`: every quant leaf fake-quantised at `bits`; other leaves returned as given.

    Quantised leaves are float32 for float32 input; for float16 input they are the fp16 rounding of the float32
    result, as upstream returns them.
    """
    return cq_mixed_params(params, {}, bits, g)


def cq_mixed_params(params: Mapping[str, Any], bits_map: Mapping[str, Bits], default: Bits, g: int = GROUP
                    ) -> dict[str, Any]:
    """Upstream's `cq_mixed_params`: like cq_quantize_params with each leaf's width from a parsed bits map
    (`convert.v2.bits.parse_bits_map`): the longest key prefixing the leaf's canonical name, else `default`."""
    flat = flatten_tree(params)
    out = {}
    for path, leaf in flat.items():
        if is_quant_leaf(path, np.ndim(leaf)):
            out[path] = quantize_leaf(path, leaf, bits_for(path, bits_map, default), g)
        else:
            out[path] = leaf
    return unflatten_tree(out)
