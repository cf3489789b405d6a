"""A CQ weight group placed on a rounding boundary, for the forced-flip tests of the Needle 2 and Needle 3 quant
reports: two float32 copies of one weight group, a few float32 steps apart, whose CQ codes differ at one rotated
coordinate, as two correct implementations' roundings of the same weights can.

Built from the definition (numpy, float64): CQ rotates a group of g weights by the ±1/√g Walsh matrix H, divides by
the norm and snaps each unit coordinate to the nearest codebook entry; the boundary is the midpoint of two entries.
"""

from __future__ import annotations

import numpy as np

from convert.v2.cq import GROUP, codebook, cq_hadamard, cq_quantize

NUDGE = 2.0**-26  # one step of the unit coordinate: 1/8 of the float32 eps at 1, below the noise of a rotation


def straddle(row: np.ndarray, bits: float = 4, group: int = GROUP) -> tuple[np.ndarray, np.ndarray, int]:
    """One CQ group `row` (its I <= g weights, zero-padded to g as CQ pads) moved as little as possible so that its
    rotated unit coordinate nearest a codebook midpoint sits on it; returns (below, above, coordinate): float32
    copies one nudge either side of the boundary whose CQ differs at that coordinate only."""
    w0 = np.asarray(row, np.float64)
    width = w0.size
    if width > group:
        raise ValueError(f"a row of {width} weights is more than one CQ group of {group}")
    h = np.sign(np.asarray(cq_hadamard(group), np.float64)) / np.sqrt(group)
    cb = codebook(bits, group).astype(np.float64)
    mids = (cb[:-1] + cb[1:]) / 2
    u = np.pad(w0, (0, group - width)) @ h / np.linalg.norm(w0)
    j, m = np.unravel_index(np.argmin(np.abs(u[:, None] - mids[None, :])), (group, len(mids)))
    d = h[j, :width]  # moving w along d moves rotated coordinate j by (d·d) per unit

    def make(t: int) -> np.ndarray:
        w = w0.copy()
        for _ in range(4):  # Newton on rot_j(w) = (mid + t·NUDGE)·‖w‖ (the norm moves with w)
            rot_j, n = np.pad(w, (0, group - width)) @ h[:, j], np.linalg.norm(w)
            w = w + ((mids[m] + t * NUDGE) * n - rot_j) / (d @ d) * d
        return w.astype(np.float32)

    for t in range(-256, 256):
        below, above = make(t), make(t + 1)
        if not np.array_equal(cq_quantize(below[None], bits), cq_quantize(above[None], bits)):
            return below, above, int(j)
    raise AssertionError("no rounding boundary within the nudges: the construction is wrong")


__all__ = ["NUDGE", "straddle"]
