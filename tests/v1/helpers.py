"""Needle v1 test helpers: both twins of one Flax tree (through parity_tests.twins) run on the same inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

import needle_flax
import needle_torch
from convert.v1.config import FIRST_PLAIN_ID, TransformerConfig
from needle_torch.layers import TORCH_DTYPES
from parity_tests.metrics import max_rel
from parity_tests.twins import build_twins
from parity_tests.v1.adapter import ADAPTER

__all__ = ["TORCH_DTYPES", "padded_tokens", "rel_err", "run_twins", "to_np", "torch_model"]


def rel_err(actual, expected) -> float:
    """max |a - b| / max |b| (parity_tests.metrics.max_rel), once `actual` is known to be finite."""
    assert np.isfinite(np.asarray(actual, dtype=np.float64)).all(), "non-finite values"
    return max_rel(actual, expected)


def to_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(jnp.asarray(x, jnp.float32))


def padded_tokens(rng: np.random.Generator, lengths, T: int, vocab: int) -> np.ndarray:
    """Right-padded (B, T) int32 tokens; ids drawn from 6..vocab-1 so no special id appears mid-row."""
    out = np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        out[b, :n] = rng.integers(FIRST_PLAIN_ID, vocab, n)
    return out


def torch_model(params, config: TransformerConfig, dtype: str = "float32") -> needle_torch.SimpleAttentionNetwork:
    return needle_torch.SimpleAttentionNetwork.from_flax(params, config, dtype)


def run_twins(params, config: TransformerConfig, src, tgt, dtype: str = "float32") -> tuple[dict, dict]:
    """(Flax, torch) encoder out, logits and contrastive embedding of one pair of twins (parity_tests.twins) in
    `dtype`, with upstream's training masks."""
    twins = build_twins(ADAPTER, config, params, dtype)
    model, p, pad = twins.flax_model, twins.flax_params, config.pad_token_id
    fsrc, ftgt = jnp.asarray(src), jnp.asarray(tgt)
    src_mask = needle_flax.make_padding_mask(fsrc, pad)
    enc, _ = model.apply({"params": p}, fsrc, src_mask, method="encode")
    flax_out = {"encoder_out": enc,
                "logits": model.apply({"params": p}, ftgt, enc, needle_flax.make_attention_mask(ftgt, pad), src_mask,
                                      method="decode"),
                "contrastive": model.apply({"params": p}, fsrc, method="encode_contrastive")}
    tm = twins.torch_model
    tsrc, ttgt = torch.as_tensor(np.asarray(src)).long(), torch.as_tensor(np.asarray(tgt)).long()
    tmask = needle_torch.make_padding_mask(tsrc, pad)
    with torch.inference_mode():
        tenc, _ = tm.encode(tsrc, tmask)
        torch_out = {"encoder_out": tenc,
                     "logits": tm.decode(ttgt, tenc, needle_torch.make_attention_mask(ttgt, pad), tmask),
                     "contrastive": tm.encode_contrastive(tsrc)}
    return flax_out, torch_out
