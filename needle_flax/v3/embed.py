"""Sentence embeddings from text with the Needle 3 Flax twin: upstream's `forward_embedding` on tokenized texts.

Shapes: B texts or prompts, P prompt length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from convert.v3.embedding import embedding_ids, right_padded
from needle_flax.v3.model import SimpleAttentionNetwork


@functools.lru_cache(maxsize=8)
def _heads(model: SimpleAttentionNetwork, method: str, quant: bool):
    """One jitted head per (model, method); jit then caches a compilation per batch shape (an eager call traces
    the whole stack op by op, slower than compiling it once)."""
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens, quant=quant, method=method))


def embed(model: SimpleAttentionNetwork, params, tokenizer: Any, texts: Sequence[str],
          quant: bool = False) -> jax.Array:
    """The normalised sentence vectors (B, embedding_dim) in float32, one per text (convert.v3.embedding: the ids,
    and why a batch is right-padded). tokenizer: a SentencePiece processor (convert.v3.chat.load_chat_tokenizer).
    quant: upstream's deploy numerics (a .cact's)."""
    tokens = jnp.asarray(embedding_ids(tokenizer, texts, model.config.max_seq_len))
    vectors = _heads(model, "forward_embedding", bool(quant))(params, tokens)
    return vectors.astype(jnp.float32)


def scores(model: SimpleAttentionNetwork, params, prompts, quant: bool = False) -> tuple[jax.Array, jax.Array]:
    """The confidence head's score (B,) and the router head's three values (B, 3), float32, for prompt id rows
    (a list of rows, or a (B, P) array; pads anywhere are dropped): upstream's forward_confidence and forward_router
    on each prompt right-padded (convert.v3.embedding.right_padded). quant: upstream's deploy numerics."""
    rows = prompts.tolist() if hasattr(prompts, "tolist") else prompts
    tokens = jnp.asarray(right_padded(rows))
    confidence = _heads(model, "forward_confidence", bool(quant))(params, tokens)
    router = _heads(model, "forward_router", bool(quant))(params, tokens)
    return confidence.astype(jnp.float32), router.astype(jnp.float32)


__all__ = ["embed", "scores"]
