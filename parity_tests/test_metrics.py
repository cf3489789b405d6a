"""Each metric against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity_tests import metrics


def test_identical_arrays_have_zero_error():
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    m = metrics.compare(a, a.copy())
    assert m["max_abs"] == 0.0 and m["mean_abs"] == 0.0 and m["rel_l2"] == 0.0
    assert m["cosine"] == pytest.approx(1.0, abs=1e-15)
    assert m["ref_max_abs"] == 6.0


def test_known_differences():
    ref = np.array([3.0, 4.0])  # ||ref|| = 5
    test = np.array([3.0, 5.0])  # diff (0, 1)
    assert metrics.max_abs(test, ref) == 1.0
    assert metrics.mean_abs(test, ref) == 0.5
    assert metrics.rel_l2(test, ref) == pytest.approx(1 / 5)
    assert metrics.cosine(test, ref) == pytest.approx((9 + 20) / (5 * math.sqrt(34)))


def test_rel_l2_divides_by_the_reference():
    ref, test = np.array([2.0, 0.0]), np.array([1.0, 0.0])
    assert metrics.rel_l2(test, ref) == 0.5  # |1-2| / |2|, not / |1|
    assert metrics.rel_l2(ref, test) == 1.0


def test_zero_references():
    z = np.zeros(3)
    assert metrics.rel_l2(z, z) == 0.0  # identical zeros agree
    assert metrics.rel_l2(np.ones(3), z) == math.inf
    assert metrics.cosine(z, z) == 1.0
    assert metrics.cosine(np.ones(3), z) == 0.0


def test_cosine_sign_and_orthogonality():
    assert metrics.cosine(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
    assert metrics.cosine(np.array([-1.0, -2.0]), np.array([1.0, 2.0])) == pytest.approx(-1.0)


def test_nan_propagates():
    ref, test = np.ones(4), np.array([1.0, np.nan, 1.0, 1.0])
    m = metrics.compare(test, ref)
    assert math.isnan(m["max_abs"]) and math.isnan(m["rel_l2"])


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes"):
        metrics.max_abs(np.ones(3), np.ones(4))


def test_bfloat16_inputs_are_widened():
    import ml_dtypes

    a = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    b = np.array([1.0, 2.0078125], dtype=np.float32)  # 2 + 1 bf16 ulp
    assert metrics.max_abs(a, b) == 0.0078125


def test_token_kl_two_classes_closed_form():
    # p = softmax([0, 0]) = (.5, .5), q = softmax([0, log 3]) = (.25, .75)
    ref = np.array([[0.0, 0.0]])
    test = np.array([[0.0, math.log(3.0)]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert metrics.token_kl(test, ref)[0] == pytest.approx(expected, rel=1e-12)


def test_token_kl_ignores_a_per_token_shift():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 3, 50))
    shifted = ref + rng.standard_normal((2, 3, 1)) * 10  # softmax is shift-invariant
    kl = metrics.token_kl(shifted, ref)
    assert kl.shape == (2, 3)
    assert np.all(np.abs(kl) < 1e-12)


def test_token_kl_is_positive_for_different_distributions():
    rng = np.random.default_rng(1)
    kl = metrics.token_kl(rng.standard_normal((4, 20)), rng.standard_normal((4, 20)))
    assert np.all(kl > 0)


def test_topk_agreement():
    ref = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    test = np.array([[4.0, 5.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    assert metrics.topk_agreement(test, ref, 1) == 0.5  # row 0's argmax moved
    assert metrics.topk_agreement(test, ref, 2) == 1.0  # but its top-2 set did not
    test2 = ref.copy()
    test2[0] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # row 0 reversed: top-2 sets disjoint
    assert metrics.topk_agreement(test2, ref, 2) == 0.5


def test_topk_rejects_bad_k():
    with pytest.raises(ValueError, match="k=7"):
        metrics.topk_agreement(np.zeros((1, 6)), np.zeros((1, 6)), 7)


def test_compare_logits_fields():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 3, 10))
    m = metrics.compare_logits(ref, ref)
    assert m == {"kl_mean": pytest.approx(0.0, abs=1e-15), "kl_max": pytest.approx(0.0, abs=1e-15),
                 "top1": 1.0, "top5": 1.0}
