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

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from convert.errors import CheckpointError
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.bits import TERNARY_BITS, Bits, bits_for, check_bits, groups_along_input, is_quant_leaf

GROUP = 128  # upstream's _WEIGHT_GROUP: the export and the tree quantizer both use it
TERNARY_UNIT = np.array([-1.2240064, 0.0, 1.2240064])  # upstream's _TERNARY_CB: 3-level Lloyd-Max of N(0,1)
TERNARY_RECORD_BITS = 5  # how a .cact record marks ternary codes (stored as 2-bit crumbs)
_CRUMB_OF_INDEX = np.array([3, 0, 1], np.uint8)  # index 0,1,2 -> signed 2-bit -1,0,+1
_INDEX_OF_CRUMB = np.array([1, 2, 255, 0], np.uint8)  # crumb 0,1,2,3 -> index; 2 (-2) is no code


# ----------------------------------------------------------------------------- codebooks and rotation


@functools.cache
def lloyd_max_gaussian(bits: int, iters: int = 200, samples: int = 400_000, seed: int = 0) -> np.ndarray:
    """Upstream's `_lloyd_max_gaussian`: 2**bits Lloyd–Max centroids of N(0, 1) fitted on RandomState(seed) samples.

    float64 throughout. The 4-bit fit has not converged at 200 iterations, so the result depends on exactly
    these iterations and this sample stream (README-cact "Checks"): nothing here may be "improved".
    """
    levels = 1 << bits
    x = np.sort(np.random.RandomState(seed).randn(samples))
    c = x[((np.arange(levels) + 0.5) / levels * samples).astype(int)].astype(np.float64)
    for _ in range(iters):
        bnd = (c[:-1] + c[1:]) / 2.0
        # Upstream assigns searchsorted(bnd, x) (left) and averages each cell through a boolean mask; x is
        # sorted, so each cell is the contiguous slice between these edges and its mean is the same sum.
        edges = np.concatenate([[0], np.searchsorted(x, bnd, side="right"), [samples]])
        for k in range(levels):
            lo, hi = edges[k], edges[k + 1]
            if hi > lo:  # an empty cell keeps its centroid
                c[k] = x[lo:hi].mean()
    c = np.sort(c)
    c.flags.writeable = False  # cached: shared by every caller
    return c


def unit_codebook(bits: Bits) -> np.ndarray:
    """The float64 centroids before scaling: Lloyd–Max for 2/3/4 bits, upstream's ternary constants for 1.58."""
    bits = check_bits(bits)
    return TERNARY_UNIT if bits == TERNARY_BITS else lloyd_max_gaussian(bits)


@functools.cache
def _codebook(bits: Bits, group: int) -> np.ndarray:
    cb = (unit_codebook(bits) / np.sqrt(group)).astype(np.float32)  # upstream's _cq_codebook_np
    cb.flags.writeable = False
    return cb


def codebook(bits: Bits, group: int = GROUP) -> np.ndarray:
    """Upstream's `_cq_codebook_np(bits, group)`: the unit centroids / √group as float32 (read-only)."""
    return _codebook(check_bits(bits), group)


@functools.cache
def cq_hadamard(group: int) -> np.ndarray:
    """Upstream's `_cq_hadamard_np`: the Sylvester–Walsh matrix of size `group` / √group, float32 (read-only)."""
    h = np.array([[1.0]], dtype=np.float32)
    while h.shape[0] < group:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(group)).astype(np.float32)
    h.flags.writeable = False
    return h


def record_bits(bits: Bits) -> int:
    """The `bits` field of a .cact record: the width, or 5 for ternary."""
    bits = check_bits(bits)
    return TERNARY_RECORD_BITS if bits == TERNARY_BITS else int(bits)


def width_of_record(rec_bits: int) -> Bits:
    """Inverse of record_bits."""
    return TERNARY_BITS if rec_bits == TERNARY_RECORD_BITS else check_bits(rec_bits, "record bits")


def padded(width: int, group: int = GROUP) -> int:
    """Ip: `width` rounded up to whole groups."""
    return -(-width // group) * group


def packed_row_bytes(in_pad: int, rec_bits: int) -> int:
    """Bytes of one row of packed codes (ternary: 2-bit crumbs)."""
    return in_pad * (2 if rec_bits == TERNARY_RECORD_BITS else rec_bits) // 8


def cq_nbytes(out: int, in_dim: int, rec_bits: int, group: int = GROUP) -> int:
    """A CQ blob's size: packed codes, then one fp16 norm per group."""
    in_pad = padded(in_dim, group)
    return out * packed_row_bytes(in_pad, rec_bits) + out * (in_pad // group) * 2


# ----------------------------------------------------------------------------- one matrix


def cq_encode(mat: np.ndarray, bits: Bits, group: int = GROUP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes of a 2-D (R, I) matrix grouped along I: (idx (R, Ip) uint8, norm (R, G) float32, norm16 (R, G) float16).

    `norm` is the unrounded norm the unit vector was divided by; `norm16` is what is stored and dequantised with.
    """
    cb = codebook(bits, group)
    h = cq_hadamard(group)
    w = np.asarray(mat, np.float32)  # upstream's np.asarray(mat, np.float32): float64 rounds here
    if w.ndim != 2:
        raise ValueError(f"cq_encode takes a 2-D (rows, in) matrix, got shape {w.shape}")
    rows, width = w.shape
    pad = (-width) % group
    wp = np.pad(w, ((0, 0), (0, pad))) if pad else w
    in_pad = wp.shape[1]
    g = np.ascontiguousarray(wp.reshape(rows, in_pad // group, group), np.float32)  # (R, G, g)
    rot = g @ h  # (R, G, g): numpy sgemm on these shapes, as upstream's exporter
    norm = np.sqrt((rot**2).sum(-1, keepdims=True))  # (R, G, 1): numpy's pairwise sum, as upstream
    unit = rot / np.maximum(norm, 1e-12)
    idx = nearest_index(unit, cb).reshape(rows, in_pad)  # (R, Ip)
    return idx, norm[:, :, 0], norm[:, :, 0].astype(np.float16)


def nearest_index(x: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Index of the nearest codebook entry (uint8); a tie goes to the lower entry, as upstream's `_nearest_idx`."""
    flat = x.reshape(-1)
    pos = np.clip(np.searchsorted(cb, flat), 1, len(cb) - 1)
    left, right = cb[pos - 1], cb[pos]
    idx = np.where(np.abs(flat - left) <= np.abs(flat - right), pos - 1, pos)
    return idx.reshape(x.shape).astype(np.uint8)


def cq_decode(idx: np.ndarray, norm16: np.ndarray, in_dim: int, bits: Bits, group: int = GROUP) -> np.ndarray:
    """(R, Ip) codes and (R, G) fp16 norms -> the (R, in_dim) float32 matrix: `(cb[idx] · norm) @ H`, unpadded."""
    cb = codebook(bits, group)
    h = cq_hadamard(group)
    rows, in_pad = idx.shape
    if idx.size and int(idx.max()) >= len(cb):
        raise CheckpointError(f"CQ code {int(idx.max())} is outside the {len(cb)}-entry {bits}-bit codebook; "
                              "the codes are damaged, re-export the file")
    unit = cb[idx].reshape(rows, in_pad // group, group)  # (R, G, g)
    with np.errstate(invalid="ignore", over="ignore"):  # a damaged inf/nan norm gives nan, as upstream (lint says so)
        rot = unit * np.asarray(norm16).reshape(rows, in_pad // group, 1).astype(np.float32)
        return (rot @ h).reshape(rows, in_pad)[:, :in_dim]  # (R, I)


# ----------------------------------------------------------------------------- packing


def pack_codes(idx: np.ndarray, bits: Bits) -> np.ndarray:
    """(R, Ip) indices -> (R, row bytes) uint8: one LSB-first bitstream per row (index k at bits [k·b, (k+1)·b)).

    At 4 bits the even column is the low nibble. Ternary indices {0, 1, 2} are stored as the 2-bit crumbs
    {3, 0, 1}, i.e. the signed values -1, 0, +1.
    """
    bits = check_bits(bits)
    idx = np.asarray(idx, np.uint8)
    if bits == TERNARY_BITS:
        idx, width = _CRUMB_OF_INDEX[idx], 2
    else:
        width = int(bits)
    rows, cols = idx.shape
    if (cols * width) % 8:
        raise ValueError(f"{cols} codes of {width} bits do not fill whole bytes")
    planes = (idx[:, :, None] >> np.arange(width, dtype=np.uint8)) & 1  # (R, Ip, b): bit j of each index
    return np.packbits(planes.reshape(rows, cols * width), axis=-1, bitorder="little")  # (R, Ip·b/8)


def unpack_codes(packed: np.ndarray, rec_bits: int, in_pad: int) -> np.ndarray:
    """Inverse of pack_codes for a record's `bits` field (5 = ternary crumbs): (R, row bytes) -> (R, Ip) uint8."""
    width = 2 if rec_bits == TERNARY_RECORD_BITS else rec_bits
    rows = packed.shape[0]
    planes = np.unpackbits(packed, axis=-1, bitorder="little").reshape(rows, in_pad, width)  # (R, Ip, b)
    idx = (planes << np.arange(width, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    if rec_bits == TERNARY_RECORD_BITS:
        idx = _INDEX_OF_CRUMB[idx]  # crumb 2 becomes 255: cq_decode refuses it
    return idx


# ----------------------------------------------------------------------------- fake-quant (what the model sees)


def cq_quantize(w: Any, bits: Bits, g: int = GROUP) -> np.ndarray:
    """Upstream's `cq_quantize(w, bits, g)`: fake-quantise along the last axis (any leading shape).

    Returns w's dtype for float16/bfloat16/float32 input (upstream casts back to w.dtype), else float32.
    """
    w = np.asarray(w)
    rows = w.reshape(-1, w.shape[-1]) if w.ndim else w.reshape(1, 1)  # (R, I)
    idx, _, norm16 = cq_encode(rows, bits, g)
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
