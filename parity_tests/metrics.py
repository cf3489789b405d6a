"""Error metrics between a candidate (torch) and a reference (Flax) array: pure numpy, float64.

Every function takes `test` first and `ref` second; relative metrics divide by the
reference. Non-finite inputs give non-finite metrics, which never pass a budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _pair(test, ref) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(test, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare arrays of shapes {a.shape} and {b.shape}")
    return a, b


def _ratio(num: float, den: float) -> float:
    """num / den with 0/0 = 0 (identical zeros agree) and x/0 = inf."""
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def max_abs(test, ref) -> float:
    a, b = _pair(test, ref)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def mean_abs(test, ref) -> float:
    a, b = _pair(test, ref)
    return float(np.mean(np.abs(a - b))) if a.size else 0.0


def ref_max_abs(ref) -> float:
    """The reference's largest magnitude: the scale that `max_abs` budgets are relative to."""
    b = np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(b))) if b.size else 0.0


def max_rel(test, ref) -> float:
    """max |test - ref| / max |ref|: one number per tensor, scale-free, robust to near-zero entries (the 1e-5 of
    the README and the fixture tests). Non-finite values give a non-finite result."""
    a, b = _pair(test, ref)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny))


def max_rel_of(m) -> float | None:
    """The same metric from a probe's stored metrics (max_abs, ref_max_abs), as reports and budgets scale it."""
    mx, ref = m.get("max_abs"), m.get("ref_max_abs")
    if mx is None or ref is None:
        return None
    return mx / ref if ref > 0 else (0.0 if mx == 0 else math.inf)


def rel_l2(test, ref) -> float:
    """||test - ref|| / ||ref|| over the whole array."""
    a, b = _pair(test, ref)
    return _ratio(float(np.linalg.norm(a - b)), float(np.linalg.norm(b)))


def cosine(test, ref) -> float:
    """Cosine similarity of the flattened arrays; two zero arrays count as identical (1.0)."""
    a, b = _pair(test, ref)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a.ravel(), b.ravel()) / (na * nb))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def token_kl(test_logits, ref_logits) -> np.ndarray:
    """KL(p_ref || p_test) per token over the last (vocab) axis: shape = logits.shape[:-1]."""
    a, b = _pair(test_logits, ref_logits)
    log_p, log_q = log_softmax(b), log_softmax(a)
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


def topk_agreement(test_logits, ref_logits, k: int) -> float:
    """Mean over tokens of |top-k(test) ∩ top-k(ref)| / k; k=1 is the argmax agreement rate."""
    a, b = _pair(test_logits, ref_logits)
    V = a.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"k={k} must be in [1, {V}]")
    a2, b2 = a.reshape(-1, V), b.reshape(-1, V)  # (N, V)
    if k == 1:
        return float(np.mean(np.argmax(a2, -1) == np.argmax(b2, -1))) if len(a2) else 1.0
    top_a = np.argpartition(-a2, k - 1, axis=-1)[:, :k]  # (N, k), unordered
    top_b = np.argpartition(-b2, k - 1, axis=-1)[:, :k]  # (N, k)
    overlap = [len(np.intersect1d(x, y)) for x, y in zip(top_a, top_b, strict=True)]
    return float(np.mean(overlap) / k) if overlap else 1.0


@dataclass
class Sums:
    """What `compare`'s metrics are made of, summable over many tensors (one pass each, float64): the metrics of a
    whole gradient are those of its concatenation, without building it."""

    n: int = 0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    diff_sq: float = 0.0
    test_sq: float = 0.0
    ref_sq: float = 0.0
    dot: float = 0.0
    ref_max: float = 0.0
    nan_matched: int = 0
    nan_mismatch: int = 0

    def add(self, test, ref) -> Sums:
        """Fold one pair in. NaN where the reference has NaN is agreement, not error: upstream's probe pooling gives
        NaN for an all-pad row on purpose, and a twin must do the same. NaN anywhere else poisons the metrics."""
        a, b = _pair(test, ref)
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if nan_a.any() or nan_b.any():
            self.nan_mismatch += int(np.count_nonzero(nan_a ^ nan_b))
            self.nan_matched += int(np.count_nonzero(nan_a & nan_b))
            keep = ~(nan_a | nan_b)
            a, b = a[keep], b[keep]
        if a.size:
            a, b = a.ravel(), b.ravel()
            d = np.abs(a - b)
            self.abs_sum += float(d.sum())
            self.abs_max = max(self.abs_max, float(d.max()))
            self.diff_sq += float(np.dot(d, d))
            self.test_sq += float(np.dot(a, a))
            self.ref_sq += float(np.dot(b, b))
            self.dot += float(np.dot(a, b))
            self.ref_max = max(self.ref_max, float(np.abs(b).max()))
            self.n += a.size
        return self

    def metrics(self) -> dict[str, float]:
        na, nb = math.sqrt(self.test_sq), math.sqrt(self.ref_sq)
        out = {
            "max_abs": self.abs_max,
            "mean_abs": self.abs_sum / self.n if self.n else 0.0,
            "rel_l2": _ratio(math.sqrt(self.diff_sq), nb),
            "cosine": 1.0 if na == 0.0 and nb == 0.0 else (0.0 if na == 0.0 or nb == 0.0 else self.dot / (na * nb)),
            "ref_max_abs": self.ref_max,
        }
        if self.nan_mismatch:
            out.update(max_abs=math.nan, mean_abs=math.nan, rel_l2=math.nan, cosine=math.nan,
                       nan_mismatch=float(self.nan_mismatch))
        if self.nan_matched:
            out["nan_matched"] = float(self.nan_matched)
        return out


def compare(test, ref) -> dict[str, float]:
    """The metrics every probe reports (see Sums.add for NaN that both sides have)."""
    return Sums().add(test, ref).metrics()


def compare_logits(test, ref) -> dict[str, float]:
    """Distribution metrics over the vocab axis, added to `compare` for the logits probe."""
    kl = token_kl(test, ref)
    V = np.shape(ref)[-1]
    return {
        "kl_mean": float(np.mean(kl)) if kl.size else 0.0,
        "kl_max": float(np.max(kl)) if kl.size else 0.0,
        "top1": topk_agreement(test, ref, 1),
        "top5": topk_agreement(test, ref, min(5, V)),
    }
