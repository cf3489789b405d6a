"""Greedy-generation parity: the torch twin's cached decoding against the Flax twin's, and each against its
recompute reference, for the parity report's generation section (every family's runs feed it).

Logits are compared only while both twins have fed the same tokens: up to and including the
first step whose chosen tokens differ (after that the inputs differ and so must the logits).
Relative errors divide by the reference's largest magnitude (Flax for torch-vs-Flax, the
recompute loop for cached-vs-recompute), as `parity_tests.metrics.max_rel` defines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from convert.errors import GenerationError
from convert.fields import DTYPES
from parity_tests.metrics import max_rel

Run = tuple[np.ndarray, np.ndarray]  # (tokens (B, 1 + steps) int64, logits (B, steps, V) float32)


def generation_config(config: Any, backend: str, dtype: str | None, compile: bool) -> Any:
    """The checkpoint's config in the compute dtype a generate-from-checkpoint call asked for (None: the
    config's own), after checking the backend, dtype and compile choices (one-line errors naming the fix)."""
    if backend not in ("torch", "flax"):
        raise GenerationError(f"--backend {backend!r} is unknown; use torch or flax")
    if compile and backend != "torch":
        raise GenerationError("--compile is for the torch backend (the flax loop is always jitted); drop it or "
                              "use --backend torch")
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise GenerationError(f"--dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    return config.replace(dtype=dtype)


def first_diff_step(a: np.ndarray, b: np.ndarray, pad: int) -> int | None:
    """First generation step (0-based) where two (B, 1 + steps) token arrays differ in any row; None if none.

    The shorter run is padded with `pad`, which is what it would have emitted after all rows stopped.
    """
    width = max(a.shape[1], b.shape[1])
    a = np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=pad)
    b = np.pad(b, ((0, 0), (0, width - b.shape[1])), constant_values=pad)
    differs = np.flatnonzero((a != b).any(axis=0))
    return None if differs.size == 0 else int(differs[0]) - 1


def _compared_steps(tokens_a: np.ndarray, tokens_b: np.ndarray, logits_a: np.ndarray, logits_b: np.ndarray,
                    pad: int) -> int:
    """How many leading steps saw the same inputs in both runs (so their logits must agree)."""
    common = min(logits_a.shape[1], logits_b.shape[1])
    diff = first_diff_step(tokens_a, tokens_b, pad)
    return common if diff is None else min(common, diff + 1)


def _cached_vs_recompute(cached, recompute, pad: int) -> tuple[float, bool]:
    (tok_c, log_c), (tok_r, log_r) = cached, recompute
    n = _compared_steps(tok_c, tok_r, log_c, log_r, pad)
    return max_rel(log_c[:, :n], log_r[:, :n]), first_diff_step(tok_c, tok_r, pad) is None


def generation_parity(cached: Mapping[str, Run], recompute: Mapping[str, Run], pad: int, max_new_tokens: int,
                      suppress_tokens: Iterable[int] | None = None) -> dict[str, Any]:
    """Greedy tokens of both twins (cached), where they first differ, per-step logits errors and cached-vs-recompute.

    cached, recompute: {"flax": (tokens (B, 1 + steps), logits (B, steps, V)), "torch": ...} as numpy, each twin
    in its own dtype and on its own device."""
    (f_tok, f_log), (t_tok, t_log) = cached["flax"], cached["torch"]
    n = _compared_steps(t_tok, f_tok, t_log, f_log, pad)
    step_abs = [float(np.max(np.abs(t_log[:, k].astype(np.float64) - f_log[:, k]))) for k in range(n)]
    step_rel = [max_rel(t_log[:, k], f_log[:, k]) for k in range(n)]
    rows_equal = int(sum(first_diff_step(f_tok[i : i + 1], t_tok[i : i + 1], pad) is None
                         for i in range(f_tok.shape[0])))
    flax_cvr, flax_same = _cached_vs_recompute(cached["flax"], recompute["flax"], pad)
    torch_cvr, torch_same = _cached_vs_recompute(cached["torch"], recompute["torch"], pad)
    return {
        "first_diff_step": first_diff_step(f_tok, t_tok, pad),
        "max_new_tokens": int(max_new_tokens),
        "steps_compared": n,
        "rows_equal": rows_equal,
        "rows": int(f_tok.shape[0]),
        "tokens_equal": rows_equal == f_tok.shape[0],
        "logits_max_abs": max(step_abs, default=0.0),
        "logits_max_rel": max(step_rel, default=0.0),
        "flax_cached_vs_recompute_max_rel": flax_cvr,
        "torch_cached_vs_recompute_max_rel": torch_cvr,
        "cached_equals_recompute_tokens": flax_same and torch_same,
        "suppress_tokens": sorted({int(t) for t in (suppress_tokens or ())}),
        "flax_tokens": f_tok.tolist(),
        "torch_tokens": t_tok.tolist(),
        "step_logits_max_abs": step_abs,
        "step_logits_max_rel": step_rel,
    }
