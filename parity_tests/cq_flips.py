"""Rounding flips at the CQ weight quantiser: tell a group that fell one code apart in two correct builds from a bug.

CQ (upstream's `cq_quantize`) rotates each group of g weights by H_g, stores the norm as fp16 and snaps each unit
coordinate to the nearest codebook entry. Both steps are discontinuous: a coordinate within float32 noise of the
midpoint between two entries, or a norm within float32 noise of an fp16 rounding midpoint, lands one step apart in
two correct implementations (numpy's sgemm against XLA's, pairwise sums against a tree reduction). The `.cact`
fixtures name such a group (`fragile_groups`). So a comparison of two CQ results of the same weights recovers each
side's codes and fp16 norm per group and sorts every group that differs:

- a flip: every differing code one step apart with the float64 unit coordinate within CQ_FLIP_ULPS of the midpoint
  between the two entries, and the norms equal or neighbouring fp16 values with the float64 norm within CQ_FLIP_ULPS
  of their midpoint: reported (tensor, row, group, margin) and left out of the judged values;
- anything else that differs: a real divergence, the comparison fails.

The groups that agree are then judged at the caller's float32 budget. This is the weight-side twin of
parity_tests/flips.py (the A8 activation quantisers); numpy only.

Shapes: R rows of the group view (kernels and φ along their input axis, embeddings, tables, probes and queries
along their last axis), I the grouped axis, G = ⌈I / g⌉ groups per row, g the group size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convert.v2.cq import GROUP, codebook, cq_hadamard

# Margins in units of float32 eps at 1 (2^-23): unit coordinates lie in [-1, 1] and the norm is compared at its own
# float32 spacing. A coordinate is a sum of g products in float32 (~√g · 2^-24 of the norm, ~3 units at g = 128;
# numpy's sgemm against the .cact fixtures agree to 5.2e-8 abs, ~1 unit); 64 admits every rounding either side could
# make and nothing a real change makes: a 1e-3 relative weight error moves a coordinate by ~10^3 · 2^-23 units.
CQ_FLIP_ULPS = 64.0
_EPS = 2.0**-23


@dataclasses.dataclass(frozen=True)
class GroupEvent:
    """A CQ group that differs between the two sides: a flip or a real divergence."""

    tensor: str
    row: int
    group: int
    kind: str  # "code" (a coordinate's codebook entry), "norm" (the fp16 norm), "both" or "values"
    coordinate: int | None  # the first differing rotated coordinate (None for a norm-only event)
    codes: tuple[int, int] | None  # (ref, got) at that coordinate
    margin: float  # the largest margin among the group's differences, in CQ_FLIP_ULPS units

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "row": self.row, "group": self.group, "kind": self.kind,
                "coordinate": self.coordinate, "codes": None if self.codes is None else list(self.codes),
                "margin_ulps": self.margin}

    def __str__(self) -> str:
        at = "" if self.coordinate is None else f" coordinate {self.coordinate} codes {self.codes[0]} vs " \
                                                 f"{self.codes[1]}"
        return f"{self.tensor} row {self.row} group {self.group}: {self.kind}{at}, margin {self.margin:.1f} ulp"


@dataclasses.dataclass(frozen=True)
class CQComparison:
    """Two CQ results of one tensor's weights compared group by group."""

    tensor: str
    groups: int
    flips: list[GroupEvent]
    divergences: list[GroupEvent]
    rel_outside: float  # max|got - ref| / max|ref| over the groups neither flipped nor divergent
    max_abs_outside: float

    def ok(self, budget: float) -> bool:
        return not self.divergences and self.rel_outside <= budget


def _group_view(a: np.ndarray, group: int) -> np.ndarray:
    """(R, I) -> (R, G, g) float64, zero-padded to whole groups as the quantiser pads."""
    a = np.asarray(a, np.float64)
    pad = (-a.shape[1]) % group
    if pad:
        a = np.pad(a, ((0, 0), (0, pad)))
    return a.reshape(a.shape[0], -1, group)


def _nearest(y: np.ndarray, cb: np.ndarray) -> np.ndarray:
    pos = np.clip(np.searchsorted(cb, y), 1, len(cb) - 1)
    left, right = cb[pos - 1], cb[pos]
    return np.where(np.abs(y - left) <= np.abs(y - right), pos - 1, pos)


def _codes_and_norms(rot: np.ndarray, norm64: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A side's codes (R, G, g) and fp16 norms (R, G) from its rotated dequantised groups rot = q @ H: the norm is
    the fp16 value next to the exact norm (it, or one fp16 step either way) for which rot / norm sits on codebook
    entries; a wrong candidate leaves residuals of ~2^-11 of a coordinate, far above float32 noise."""
    n16 = norm64.astype(np.float16)
    candidates = np.stack([np.nextafter(n16, np.float16(-np.inf)), n16, np.nextafter(n16, np.float16(np.inf))])
    candidates = np.maximum(candidates.astype(np.float64), 0)  # (3, R, G)
    best_codes, best_norm, best_resid = None, None, None
    for c in candidates:
        y = rot / np.where(c > 0, c, 1)[..., None]
        codes = _nearest(y, cb)
        resid = np.abs(y - cb[codes]).max(-1)
        if best_resid is None:
            best_codes, best_norm, best_resid = codes, c, resid
        else:
            better = resid < best_resid
            best_codes = np.where(better[..., None], codes, best_codes)
            best_norm = np.where(better, c, best_norm)
            best_resid = np.minimum(resid, best_resid)
    return best_codes, best_norm


def compare_cq(weights: np.ndarray, ref: np.ndarray, got: np.ndarray, bits: float, *, group: int = GROUP,
               name: str = "", max_ulps: float = CQ_FLIP_ULPS) -> CQComparison:
    """Two CQ results ref and got (R, I) of the same float weights (R, I), each grouped along I (module doc)."""
    w, r, q = (np.asarray(a) for a in (weights, ref, got))
    if not (w.shape == r.shape == q.shape) or w.ndim != 2:
        raise ValueError(f"{name}: weights {w.shape}, ref {r.shape} and got {q.shape} must be one (R, I) shape")
    cb = codebook(bits, group).astype(np.float64)
    h = np.asarray(cq_hadamard(group), np.float64)
    h = np.sign(h) / np.sqrt(group)  # the exact ±1/√g matrix: the float64 reference of the rotation
    rot_w = _group_view(w, group) @ h  # (R, G, g)
    norm64 = np.sqrt((rot_w**2).sum(-1))  # (R, G)
    unit = rot_w / np.maximum(norm64, 1e-300)[..., None]
    codes_r, norm_r = _codes_and_norms(_group_view(r, group) @ h, norm64, cb)
    codes_q, norm_q = _codes_and_norms(_group_view(q, group) @ h, norm64, cb)
    ref_g, got_g = _group_view(r, group), _group_view(q, group)

    flips, divergences = [], []
    differ = (codes_r != codes_q).any(-1) | (norm_r != norm_q) | (np.abs(ref_g - got_g).max(-1) > 0)
    judged = np.ones(norm64.shape, bool)
    for row, g in zip(*np.nonzero(differ), strict=True):
        cr, cq_, u = codes_r[row, g], codes_q[row, g], unit[row, g]
        coords = np.flatnonzero(cr != cq_)
        margins, flip = [], True
        for j in coords:
            lo, hi = sorted((int(cr[j]), int(cq_[j])))
            if hi - lo != 1:
                flip = False
                margins.append(np.inf)
                continue
            margins.append(abs(u[j] - (cb[lo] + cb[hi]) / 2) / _EPS)
        norm_differs = norm_r[row, g] != norm_q[row, g]
        if norm_differs:
            a, b = sorted((norm_r[row, g], norm_q[row, g]))
            adjacent = np.nextafter(np.float16(a), np.float16(np.inf)) == np.float16(b)
            spacing = np.spacing(np.float32(norm64[row, g])) / _EPS  # float32 spacing at the norm, as a unit
            margins.append(abs(norm64[row, g] - (a + b) / 2) / (spacing * _EPS) if adjacent else np.inf)
            flip = flip and bool(adjacent)
        if not len(coords) and not norm_differs:
            continue  # same codes and norm: the values are judged with the rest
        margin = float(max(margins)) if margins else 0.0
        flip = flip and margin <= max_ulps
        kind = "both" if len(coords) and norm_differs else ("code" if len(coords) else "norm")
        j = int(coords[0]) if len(coords) else None
        event = GroupEvent(name, int(row), int(g), kind, j, None if j is None else (int(cr[j]), int(cq_[j])), margin)
        (flips if flip else divergences).append(event)
        judged[row, g] = False
    diff = np.abs(ref_g - got_g)[judged]
    top = np.abs(ref_g).max() if ref_g.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    return CQComparison(name, int(norm64.size), flips, divergences, float(max_abs / top) if top else max_abs, max_abs)


def group_view(leaf: np.ndarray, along_input: bool) -> np.ndarray:
    """A leaf as the (R, I) rows its groups run along: kernels and φ along their input (second to last) axis,
    embeddings, tables, probes and queries along the last."""
    a = np.asarray(leaf)
    if along_input:
        a = np.swapaxes(a, -1, -2)
    return a.reshape(-1, a.shape[-1])


def summarize(comparisons: Sequence[CQComparison], budget: float, *, max_events: int = 20) -> dict[str, Any]:
    """The JSON section: per tensor counts and the judged error outside flips, the first events, the verdict."""
    flips = [e for c in comparisons for e in c.flips]
    divergences = [e for c in comparisons for e in c.divergences]
    groups = sum(c.groups for c in comparisons)
    return {
        "flip_ulps": CQ_FLIP_ULPS, "budget_rel": budget, "groups": groups, "flips": len(flips),
        "divergent_groups": len(divergences),
        "ok": all(c.ok(budget) for c in comparisons),
        "rel_outside_max": float(max((c.rel_outside for c in comparisons), default=0.0)),
        "per_tensor": [{"tensor": c.tensor, "groups": c.groups, "flips": len(c.flips),
                        "divergent_groups": len(c.divergences), "rel_outside": float(c.rel_outside),
                        "max_abs_outside": float(c.max_abs_outside), "ok": c.ok(budget)} for c in comparisons],
        "flip_events": [e.to_dict() for e in flips[:max_events]],
        "divergence_events": [e.to_dict() for e in divergences[:max_events]],
    }


def compare_trees(float_flat: Mapping[str, np.ndarray], ref_flat: Mapping[str, np.ndarray],
                  got_flat: Mapping[str, np.ndarray], leaves: Mapping[str, tuple[float, bool]], *,
                  group: int = GROUP) -> list[CQComparison]:
    """compare_cq on every leaf of `leaves` {path: (bits, along_input)}."""
    return [compare_cq(group_view(float_flat[p], along), group_view(ref_flat[p], along),
                       group_view(got_flat[p], along), bits, group=group, name=p)
            for p, (bits, along) in leaves.items()]


__all__ = ["CQ_FLIP_ULPS", "CQComparison", "GroupEvent", "compare_cq", "compare_trees", "group_view", "summarize"]
