"""Tolerance profiles: the judging rule at its edges, overrides, names, and the ordering the reasoning implies."""

from __future__ import annotations

import math

import pytest

from convert.errors import NeedleTwinError
from convert.fields import DTYPES
from parity_tests import tolerances
from parity_tests.families import ADAPTERS
from parity_tests.tolerances import DEVICE_CLASSES, Budget, Profile, device_class, judge, with_overrides

B = Budget(rel_l2=1e-3, max_rel=2e-3, atol=1e-6, kl_max=1e-4)


def _m(rel, mx, ref=10.0, kl=None):
    m = {"rel_l2": rel, "max_abs": mx, "ref_max_abs": ref}
    if kl is not None:
        m["kl_max"] = kl
    return m


def test_judge_at_the_boundary():
    bound = 1e-6 + 2e-3 * 10.0
    assert judge(_m(1e-3, bound), B) == (True, {"rel_l2": 1e-3, "max_abs": bound, "max_rel": 2e-3, "atol": 1e-6})
    assert not judge(_m(1.0001e-3, 0.0), B)[0]  # rel_l2 just over
    assert not judge(_m(0.0, bound * 1.0001), B)[0]  # max_abs just over


def test_max_bound_scales_with_the_reference():
    assert judge(_m(0.0, 0.015, ref=10.0), B)[0]
    assert not judge(_m(0.0, 0.015, ref=1.0), B)[0]
    assert judge(_m(0.0, 5e-7, ref=0.0), B)[0]  # an all-zero reference still gets the atol floor


@pytest.mark.parametrize("bad", [None, math.nan])
def test_non_finite_metrics_fail(bad):
    assert not judge(_m(bad, 0.0), B)[0]
    assert not judge(_m(0.0, bad), B)[0]
    assert not judge(_m(0.0, 0.0, kl=bad), B, logits=True)[0]


def test_kl_is_judged_for_logits_only():
    m = _m(0.0, 0.0, kl=1.0)
    assert judge(m, B)[0]
    passed, tol = judge(m, B, logits=True)
    assert not passed and tol["kl_max"] == 1e-4


def get_profile(dtype, device="cpu", family="v1"):
    return tolerances.get_profile(ADAPTERS[family].budgets, dtype, device)


def profile_by_name(name, family="v1"):
    return tolerances.profile_by_name(ADAPTERS[family].budgets, name)


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_profile_exists_and_says_why(family):
    for dtype in DTYPES:
        for dev in DEVICE_CLASSES:
            p = get_profile(dtype, dev, family)
            assert p.name == f"{dtype}-{dev}" and p.dtype == dtype and p.why
            assert profile_by_name(p.name, family) == p
            assert Profile.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_budgets_follow_the_reasoning(family):
    """Drift >= local (errors accumulate); float32 < float16 < bfloat16 (spacing 2^-23 < 2^-11 < 2^-8)."""
    f32, f16, bf16 = (get_profile(d, family=family) for d in ("float32", "float16", "bfloat16"))
    for p in (f32, f16, bf16):
        for field in ("rel_l2", "max_rel", "kl_max"):
            assert getattr(p.drift, field) >= getattr(p.local, field)
    for field in ("rel_l2", "max_rel", "kl_max"):
        assert getattr(f32.drift, field) < getattr(f16.drift, field) < getattr(bf16.drift, field)
    assert f32.grads_total.rel_l2 < f16.grads_total.rel_l2 < bf16.grads_total.rel_l2
    assert f32.grads is not None and f16.grads is None and bf16.grads is None
    assert f32.local.rel_l2 == f32.local.max_rel == 1e-5  # the README's float32 promise


def test_profile_by_name_defaults_to_cpu_and_rejects_unknown():
    assert profile_by_name("bfloat16").device == "cpu"
    with pytest.raises(NeedleTwinError, match="unknown tolerance profile 'int8'.*float32-cpu"):
        profile_by_name("int8")
    with pytest.raises(NeedleTwinError, match="float32-quantum"):
        profile_by_name("float32-quantum")


@pytest.mark.parametrize("torch_dev, jax_platform, want", [
    ("cpu", "cpu", "cpu"), ("cuda", "cpu", "gpu"), ("cuda:1", "gpu", "gpu"), ("cpu", "gpu", "gpu"),
    ("cpu", "tpu", "tpu"), ("mps", "cpu", "mps"),
])
def test_device_class(torch_dev, jax_platform, want):
    assert device_class(torch_dev, jax_platform) == want


def test_overrides():
    base = get_profile("bfloat16")
    p = with_overrides(base, rtol=0.5, atol=0.25, kl_max=0.125, grad_rtol=0.75)
    for b in (p.local, p.drift):
        assert (b.rel_l2, b.max_rel, b.atol, b.kl_max) == (0.5, 0.5, 0.25, 0.125)
    assert (p.grads_total.rel_l2, p.grads_total.max_rel) == (0.75, 0.75)
    assert "overridden" in p.name and "rtol=0.5" in p.name
    assert with_overrides(base) is base
    f32 = with_overrides(get_profile("float32"), grad_rtol=0.5)
    assert f32.grads.rel_l2 == 0.5 and f32.grads_total.rel_l2 == 0.5


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_bad_overrides(value):
    with pytest.raises(NeedleTwinError, match="--rtol must be a finite number >= 0"):
        with_overrides(get_profile("float32"), rtol=value)
