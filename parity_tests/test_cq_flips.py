"""Rounding flips at the CQ weight quantiser (parity_tests/cq_flips.py): a group whose rotated coordinate (or fp16
norm) is placed on a rounding boundary and nudged across it is reported as one flip and left out of the judged
values; a weight perturbed by more than float32 noise still fails. The A8 activation quantisers have the same pair
of tests on the Needle 3 torch twin in tests/v3/test_flips.py.

The two sides here are this project's numpy CQ (`convert.v2.cq.cq_quantize`, upstream's algorithm) of two inputs
one float32 step apart, which is what two correct implementations differ by.
"""

from __future__ import annotations

import numpy as np
import pytest

from convert.v2.cq import codebook, cq_hadamard, cq_quantize
from parity_tests.cq_flips import CQ_FLIP_ULPS, compare_cq, group_view, summarize

G = 128
BUDGET = 1e-5  # the project's float32 budget, unchanged: groups that agree are compared exactly here (0.0)


def _group(u: np.ndarray, norm: float) -> np.ndarray:
    """The weights (g,) whose rotation is norm · u (H is symmetric and its own inverse)."""
    h = np.sign(np.asarray(cq_hadamard(G), np.float64)) / np.sqrt(G)
    return (u * norm) @ h


def _weights(seed: int = 0) -> np.ndarray:
    """(3, 256): three rows of two groups, float32, N(0, 0.02) like upstream's init."""
    return (np.random.default_rng(seed).standard_normal((3, 2 * G)) * 0.02).astype(np.float32)


def _straddle(make, probe) -> tuple[np.ndarray, np.ndarray]:
    """The first pair of adjacent inputs make(t), make(t + 1), t in -256..255, whose CQ differs at `probe`."""
    last = None
    for t in range(-256, 256):
        w = make(t)
        q = cq_quantize(w, 4)
        if last is not None and probe(last[1], q):
            return last[0], w
        last = (w, q)
    raise AssertionError("no rounding boundary within the nudges: the construction is wrong")


def _code_boundary(w: np.ndarray, row: int, group: int, coord: int, k: int = 9):
    """w with group (row, group) rebuilt so its rotated unit coordinate `coord` sits on the midpoint between
    codebook entries k and k + 1, then moved by t · 2^-26 (1/8 of the margin unit); make(t) -> the matrix."""
    cb = codebook(4, G).astype(np.float64)
    mid = (cb[k] + cb[k + 1]) / 2
    rng = np.random.default_rng(1)
    rest = rng.standard_normal(G)
    rest[coord] = 0
    rest *= np.sqrt(1 - mid**2) / np.linalg.norm(rest)
    norm = float(np.linalg.norm(w[row, group * G:(group + 1) * G]))

    def make(t: int) -> np.ndarray:
        u = rest.copy()
        u[coord] = mid + t * 2.0**-26
        out = w.copy()
        out[row, group * G:(group + 1) * G] = _group(u, norm).astype(np.float32)
        return out

    return make


def test_a_code_placed_on_a_boundary_is_one_flip_and_the_rest_is_judged():
    w = _weights()
    make = _code_boundary(w, row=1, group=1, coord=37)
    below, above = _straddle(make, lambda a, b: not np.array_equal(a, b))
    ref, got = cq_quantize(below, 4), cq_quantize(above, 4)
    assert np.abs(ref - got).max() > 100 * BUDGET * np.abs(ref).max()  # one code step is visible ...
    c = compare_cq(below, ref, got, 4, name="w")
    assert c.ok(BUDGET) and not c.divergences, [str(e) for e in c.divergences]
    (flip,) = c.flips
    assert (flip.row, flip.group, flip.kind, flip.coordinate) == (1, 1, "code", 37)
    assert abs(flip.codes[0] - flip.codes[1]) == 1 and flip.margin <= 1  # within an ulp of the midpoint
    assert c.rel_outside == 0.0 and c.groups == 6  # ... and the other five groups are judged, exactly equal


def test_a_norm_placed_on_an_fp16_midpoint_is_one_flip():
    w = _weights()
    g = w[2, :G].astype(np.float64)
    n = np.linalg.norm(g)
    a = np.float16(n)
    b = np.nextafter(a, np.float16(np.inf))
    mid = (float(a) + float(b)) / 2

    def make(t: int) -> np.ndarray:
        out = w.copy()
        target = mid * (1 + t * 2.0**-26)
        out[2, :G] = (g * (target / n)).astype(np.float32)
        return out

    below, above = _straddle(make, lambda p, q: not np.array_equal(p, q))
    c = compare_cq(below, cq_quantize(below, 4), cq_quantize(above, 4), 4, name="w")
    assert c.ok(BUDGET), [str(e) for e in c.divergences]
    (flip,) = c.flips
    assert (flip.row, flip.group, flip.kind) == (2, 0, "norm") and flip.margin <= CQ_FLIP_ULPS


def test_a_weight_perturbed_beyond_float32_noise_still_fails():
    """Each weight moved by ±1e-3 of itself (~10^4 times float32 noise): codes move far from their midpoints."""
    w = _weights()
    bad = (w * (1 + 1e-3 * np.random.default_rng(2).choice([-1.0, 1.0], w.shape))).astype(np.float32)
    c = compare_cq(w, cq_quantize(w, 4), cq_quantize(bad, 4), 4, name="w")
    assert not c.ok(BUDGET) and c.divergences
    assert max(e.margin for e in c.divergences) > CQ_FLIP_ULPS


def test_one_weight_moved_a_whole_code_is_a_divergence_even_near_a_boundary():
    """Two code steps apart is not one rounding decision, wherever the value sits."""
    w = _weights()
    make = _code_boundary(w, row=0, group=0, coord=3, k=7)
    below, _ = _straddle(make, lambda a, b: not np.array_equal(a, b))
    far = make(0)
    cb = codebook(4, G).astype(np.float64)
    u_shift = (cb[9] - cb[7]) * float(np.linalg.norm(below[0, :G]))
    h = np.sign(np.asarray(cq_hadamard(G), np.float64)) / np.sqrt(G)
    far[0, :G] = (far[0, :G] + u_shift * h[3]).astype(np.float32)  # coordinate 3 two entries up
    c = compare_cq(below, cq_quantize(below, 4), cq_quantize(far, 4), 4, name="w")
    assert not c.ok(BUDGET) and len(c.divergences) == 1 and not c.flips


def test_identical_results_compare_clean_and_summarize():
    w = _weights()
    q = cq_quantize(w, 4)
    c = compare_cq(w, q, q.copy(), 4, name="w")
    assert c.ok(BUDGET) and not c.flips and not c.divergences and c.rel_outside == 0.0
    s = summarize([c], BUDGET)
    assert s["ok"] and s["groups"] == 6 and s["flips"] == 0 and s["per_tensor"][0]["tensor"] == "w"


def test_group_view_follows_the_quantisers_axis():
    k = np.arange(2 * 3 * 4).reshape(2, 3, 4)  # a stacked kernel (L, in, out): groups along in
    assert group_view(k, True).shape == (8, 3) and group_view(k, True)[0].tolist() == [0, 4, 8]
    assert group_view(k, False).shape == (6, 4)


def test_shapes_must_agree():
    w = _weights()
    with pytest.raises(ValueError, match="one \\(R, I\\) shape"):
        compare_cq(w, w, w[:2], 4)
