"""Build both twins from one Flax param tree and run them on the same inputs (test helper)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import needle_flax
import needle_torch
from convert.config import FIRST_PLAIN_ID, TransformerConfig
from convert.generation import max_rel_error
from convert.mapping import np_dtype
from needle_torch.model import TORCH_DTYPES


def rel_err(actual, expected) -> float:
    """max |a - b| / max |b| (convert.generation.max_rel_error), once `actual` is known to be finite."""
    assert np.isfinite(np.asarray(actual, dtype=np.float64)).all(), "non-finite values"
    return max_rel_error(actual, expected)


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


def run_flax(params, config: TransformerConfig, src, tgt, dtype: str = "float32"):
    """encoder out, logits and contrastive embedding from the Flax twin (params cast to `dtype`)."""
    cfg = config.replace(dtype=dtype)
    model = needle_flax.SimpleAttentionNetwork(cfg)
    p = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a).astype(np_dtype(dtype))), params)
    src, tgt = jnp.asarray(src), jnp.asarray(tgt)
    src_mask = needle_flax.make_padding_mask(src, cfg.pad_token_id)
    tgt_mask = needle_flax.make_causal_mask(tgt.shape[1]) & needle_flax.make_padding_mask(tgt, cfg.pad_token_id)
    enc, _ = model.apply({"params": p}, src, src_mask, method="encode")
    logits = model.apply({"params": p}, tgt, enc, tgt_mask, src_mask, method="decode")
    contrastive = model.apply({"params": p}, src, method="encode_contrastive")
    return {"encoder_out": enc, "logits": logits, "contrastive": contrastive}


def torch_model(params, config: TransformerConfig, dtype: str = "float32") -> needle_torch.SimpleAttentionNetwork:
    return needle_torch.SimpleAttentionNetwork.from_flax(params, config, TORCH_DTYPES[dtype])


def run_torch(params, config: TransformerConfig, src, tgt, dtype: str = "float32"):
    """encoder out, logits and contrastive embedding from the torch twin (params cast to `dtype`)."""
    model = torch_model(params, config, dtype)
    src, tgt = torch.as_tensor(np.asarray(src)).long(), torch.as_tensor(np.asarray(tgt)).long()
    src_mask = needle_torch.make_padding_mask(src, config.pad_token_id)
    tgt_mask = needle_torch.make_causal_mask(tgt.shape[1]) & needle_torch.make_padding_mask(tgt, config.pad_token_id)
    with torch.inference_mode():
        enc, _ = model.encode(src, src_mask)
        logits = model.decode(tgt, enc, tgt_mask, src_mask)
        contrastive = model.encode_contrastive(src)
    return {"encoder_out": enc, "logits": logits, "contrastive": contrastive}
