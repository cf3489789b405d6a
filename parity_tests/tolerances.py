"""Tolerance profiles: how far the torch twin may be from the Flax twin, per family, compute dtype and device.

A probe passes when BOTH hold (torch = test, Flax = reference):
  rel_l2  = ||t - f|| / ||f||             <= budget.rel_l2
  max_abs = max |t - f|                   <= budget.atol + budget.max_rel * max |f|
and, for the logits only, the worst per-token KL(p_flax || p_torch) <= budget.kl_max.

Why these two norms: rel_l2 bounds the typical error of the whole tensor (one wrong row of
a layer moves it), max_abs catches a few badly wrong elements that an L2 average would
dilute. The max bound is scaled by the tensor's largest magnitude, not element by element,
because element-wise relative error is meaningless for values near zero (half of every
activation), where rounding noise of the large neighbours dominates. `atol` only keeps an
all-but-zero reference from demanding an exact match. Cosine is reported but not judged:
1 - cos ~ rel_l2^2 / 2, so it adds nothing rel_l2 does not already bound, and it is blind
to scale errors (a wrong gate multiplies a branch; cosine would not see it).
Top-1/top-5 agreement is reported but not judged either: with near-tied logits any
rounding flips an argmax, so a hard rule would flake; KL measures the same thing smoothly.

Two budgets per profile: `local` judges isolated mode (each torch stage fed the Flax
stage's input, so the error is that stage's own), `drift` judges propagated mode (end to
end, error accumulates over every stage). Gradients: `grads_total` judges the whole
gradient as one vector in every dtype, `grads` each parameter (float32 only).

The numbers are each family's (`parity_tests/<family>/tolerances.py`), with the measurements
and the reasoning beside them; all were measured on CPU (x86-64, XLA CPU, torch CPU) with
precision pinned (JAX matmul precision "highest", torch float32 matmul precision "highest",
no TF32, no reduced-precision fp16/bf16 reductions).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from convert.errors import NeedleTwinError
from parity_tests.adapter import Budgets

DEVICE_CLASSES = ("cpu", "gpu", "tpu", "mps")


@dataclass(frozen=True)
class Budget:
    rel_l2: float  # bound on ||t - f|| / ||f||
    max_rel: float  # bound on max|t - f| / max|f|
    atol: float  # absolute floor added to the max bound
    kl_max: float  # bound on the worst per-token KL(p_flax || p_torch), logits only

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Profile:
    name: str
    dtype: str
    device: str  # device class the figures are for: cpu, gpu, tpu, mps
    local: Budget  # isolated mode: one stage's own error
    drift: Budget  # propagated mode: error accumulated end to end
    grads_total: Budget  # the whole gradient, all parameters as one vector (kl_max unused)
    grads: Budget | None  # each parameter's gradient; None = reported, not judged
    why: str

    def budget(self, mode: str) -> Budget:
        return self.local if mode == "isolated" else self.drift

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "device": self.device, "local": self.local.to_dict(),
                "drift": self.drift.to_dict(), "grads_total": self.grads_total.to_dict(),
                "grads": None if self.grads is None else self.grads.to_dict(), "why": self.why}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        return cls(name=d["name"], dtype=d["dtype"], device=d["device"], local=Budget(**d["local"]),
                   drift=Budget(**d["drift"]), grads_total=Budget(**d["grads_total"]),
                   grads=None if d.get("grads") is None else Budget(**d["grads"]), why=d["why"])


# Accelerators: with precision pinned, float32 matmuls are true float32 on GPU (TF32 off)
# and on TPU ("highest" = 6-pass bf16 emulation, float32-accurate), and half-precision
# GEMMs accumulate in float32 (reduced-precision reductions off). What remains is a
# different summation order, the same kind of difference as between the two CPU
# libraries, so the CPU figures apply. These entries were NOT measured on an accelerator
# in this repository; parity_tests runs the suite there when a device is present.
_DEVICE_NOTE = {
    "cpu": "measured on CPU",
    "gpu": "GPU: CPU budgets; unmeasured here, valid only with precision pinned (no TF32)",
    "tpu": "TPU: CPU budgets; unmeasured here, valid only with matmul precision 'highest'",
    "mps": "MPS: CPU budgets; unmeasured here",
}


def get_profile(budgets: Mapping[str, Budgets], dtype: str, device: str = "cpu") -> Profile:
    """A family's profile for a compute dtype on a device class (cpu, gpu, tpu, mps)."""
    if dtype not in budgets:
        raise NeedleTwinError(f"no tolerance profile for dtype {dtype!r}; use one of {', '.join(budgets)}")
    if device not in DEVICE_CLASSES:
        raise NeedleTwinError(f"no tolerance profile for device {device!r}; use one of {', '.join(DEVICE_CLASSES)}")
    b = budgets[dtype]
    return Profile(f"{dtype}-{device}", dtype, device, b.local, b.drift, b.grads_total, b.grads,
                   f"{b.why} ({_DEVICE_NOTE[device]})")


def profile_by_name(budgets: Mapping[str, Budgets], name: str) -> Profile:
    """'bfloat16' or 'bfloat16-gpu' -> the family's Profile."""
    dtype, _, device = name.partition("-")
    try:
        return get_profile(budgets, dtype, device or "cpu")
    except NeedleTwinError:
        names = [f"{d}-{c}" for d in budgets for c in DEVICE_CLASSES]
        raise NeedleTwinError(f"unknown tolerance profile {name!r}; use one of {', '.join(names)}") from None


def device_class(torch_device: str, jax_platform: str) -> str:
    """The accelerator among the two twins' devices decides the profile (cpu only when both are)."""
    torch_kind = torch_device.split(":")[0]
    kinds = {"cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu", "mps": "mps"}
    for kind in (jax_platform, torch_kind):
        if kind in kinds:
            return kinds[kind]
    return "cpu"


def with_overrides(profile: Profile, *, rtol: float | None = None, atol: float | None = None,
                   kl_max: float | None = None, grad_rtol: float | None = None) -> Profile:
    """Replace budgets from the CLI: rtol sets rel_l2 and max_rel of both modes; grad_rtol those of the gradients."""
    for name, value in (("--rtol", rtol), ("--atol", atol), ("--kl-max", kl_max), ("--grad-rtol", grad_rtol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise NeedleTwinError(f"{name} must be a finite number >= 0, got {value}")
    changes: dict[str, float] = {}
    if rtol is not None:
        changes.update(rel_l2=rtol, max_rel=rtol)
    if atol is not None:
        changes["atol"] = atol
    if kl_max is not None:
        changes["kl_max"] = kl_max
    if not changes and grad_rtol is None:
        return profile
    grads_total, grads = profile.grads_total, profile.grads
    if grad_rtol is not None:
        grads_total = dataclasses.replace(grads_total, rel_l2=grad_rtol, max_rel=grad_rtol)
        grads = None if grads is None else dataclasses.replace(grads, rel_l2=grad_rtol, max_rel=grad_rtol)
    parts = [f"{k}={v:g}" for k, v in (("rtol", rtol), ("atol", atol), ("kl_max", kl_max),
                                       ("grad_rtol", grad_rtol)) if v is not None]
    return dataclasses.replace(profile, name=f"{profile.name} (overridden: {', '.join(parts)})",
                               local=dataclasses.replace(profile.local, **changes),
                               drift=dataclasses.replace(profile.drift, **changes), grads_total=grads_total,
                               grads=grads)


# ----------------------------------------------------------------------------- judging


def _le(value: float | None, bound: float) -> bool:
    """value <= bound, with None/NaN (non-finite metrics) failing."""
    return value is not None and not math.isnan(value) and value <= bound


def judge(metrics: Mapping[str, Any], budget: Budget, *, logits: bool = False) -> tuple[bool, dict[str, float]]:
    """(passed, tolerance actually applied) for one probe's metrics."""
    ref = metrics.get("ref_max_abs")
    ref = 0.0 if ref is None or not math.isfinite(ref) else ref
    tol = {"rel_l2": budget.rel_l2, "max_abs": budget.atol + budget.max_rel * ref,
           "max_rel": budget.max_rel, "atol": budget.atol}
    passed = _le(metrics.get("rel_l2"), tol["rel_l2"]) and _le(metrics.get("max_abs"), tol["max_abs"])
    if logits:
        tol["kl_max"] = budget.kl_max
        passed = passed and _le(metrics.get("kl_max"), budget.kl_max)
    return passed, tol
