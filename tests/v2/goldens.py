"""Upstream's Needle 2 generation goldens, the float32 checks both twins' generation tests make against them, and
the prompts those tests build.

tests/data/needle-v2-tiny.npz (tests/data/README.md, "Needle 2"): `dec_*`, `decw_*`, `batch_*`, `rec_*`, from
upstream's decode.py and run.py. The checks take arrays, so each twin's test passes its own outputs (torch
tensors or JAX arrays) as they are. Relative error is max|Δ| / max|ref| per step.
"""

from __future__ import annotations

import numpy as np

from convert.v2.config import BOS_ID, FIRST_PLAIN_ID

F32_REL = 1e-5  # the project's float32 budget; upstream's own cached vs recompute: 2.9e-6, ours ~1e-6
G = 10  # new tokens in the goldens


def rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def chosen_from(g, kind: str) -> np.ndarray:
    """(B, G, V): the logits each golden token was chosen from: the prefill's last position, then steps 0..G-2."""
    if kind == "batch":
        return g["f32/batch_step_logits"]
    return np.concatenate([g[f"f32/{kind}_prefill_logits"][:, -1:], g[f"f32/{kind}_step_logits"][:, :-1]], axis=1)


def run_loop_reference(g, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompts, tokens, logits) of run.py's loop: rec_* on dec_prompt; for the left-padded batch, which has no
    run.py golden, its cached goldens stand in (upstream's cached and batched paths give run.py's tokens)."""
    if kind == "dec":
        return g["dec_prompt"], g["f32/rec_tokens"], g["f32/rec_logits"]
    return g["batch_prompts"], g["f32/batch_tokens"], g["f32/batch_step_logits"]


def assert_generated(tokens, logits, ref_tokens, ref_logits, logp=None, ref_logp=None) -> None:
    """The tokens exactly, the logits (B, G, V) within F32_REL at every step, the log-probs (float32) too."""
    np.testing.assert_array_equal(np.asarray(tokens), ref_tokens)
    logits = np.asarray(logits)
    assert logits.shape == ref_logits.shape
    for k in range(ref_logits.shape[1]):
        assert rel(logits[:, k], ref_logits[:, k]) <= F32_REL, f"step {k}"
    if ref_logp is not None:
        logp = np.asarray(logp)
        assert logp.dtype == np.float32 and logp.shape == ref_logp.shape
        assert rel(logp, ref_logp) <= F32_REL


def left_padded(vocab_size: int, lengths, seed: int = 0, dtype=np.int64) -> np.ndarray:
    """BOS + plain ids, left-padded with PAD to the longest: (len(lengths), max(lengths))."""
    rng = np.random.default_rng(seed)
    out = np.zeros((len(lengths), max(lengths)), dtype)
    for r, n in enumerate(lengths):
        out[r, -n:] = [BOS_ID, *rng.integers(FIRST_PLAIN_ID, vocab_size, n - 1)]
    return out
