"""Needle 3's sentence embeddings, framework-free: the ids a text becomes and the cosine similarities of vectors.

Upstream's Python has no text -> embedding path (`needle_embed` is the C++ engine's, unverified, NEEDLE_V3.md §12);
its model method is `forward_embedding(tokens)`, whose probe pooling reads every non-pad token under causal ∧
key-not-pad. A text here becomes `[BOS] + sp.Encode(text)`, as upstream's generate paths build every sequence, and a
batch is right-padded with PAD: later pads change nothing a valid position sees (causal), and the pooling skips
them, so each row's vector is the text's alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from convert.errors import TokenizerError
from convert.v3.config import BOS_ID, PAD_ID


def embedding_ids(tokenizer: Any, texts: Sequence[str], max_len: int) -> np.ndarray:
    """(B, T) int32: `[BOS] + sp.Encode(text)` per text, cut to max_len (the model's max_seq_len), right-padded with
    PAD to the longest."""
    if isinstance(texts, str) or not len(texts):
        raise TokenizerError("give the texts as a non-empty list of strings (one vector each)")
    rows = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TokenizerError(f"text {i} is a {type(text).__name__}, not a string")
        rows.append(([BOS_ID] + list(tokenizer.encode(text)))[:max_len])
    return right_padded(rows)


def right_padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, T) int32: id rows right-padded with PAD to the longest. The heads read a batch so (later pads change
    nothing a valid position sees); a left-padded generate batch would shift RoPE positions."""
    rows = [[int(t) for t in row if t != PAD_ID] for row in rows]  # a left-padded row's pads go too
    out = np.full((len(rows), max(1, *map(len, rows))), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


ROUTER_NAMES = ("router_head[0]", "router_head[1]", "router_head[2]")  # upstream 3.2.8 names no output of the
# router head (RouterHead.out_dim = 3; only its export calibration (0.90, 0.00, 0.60) is stored), so its index


def prompt_scores(confidence, router) -> list[dict[str, Any]]:
    """Per row {"confidence": float, "router": {name: float}} from (B,) confidence and (B, 3) router outputs."""
    confidence, router = np.asarray(confidence, np.float64), np.asarray(router, np.float64)
    return [{"confidence": float(c), "router": dict(zip(ROUTER_NAMES, map(float, r), strict=True))}
            for c, r in zip(confidence, router, strict=True)]


def cosine_similarities(vectors) -> np.ndarray:
    """(B, B) float64 cosine similarities of the rows of (B, c) vectors (upstream's are unit length already, in the
    model's dtype; dividing again keeps a bf16 vector's rounding out of the diagonal)."""
    v = np.asarray(vectors, np.float64)
    v = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
    return v @ v.T


__all__ = ["ROUTER_NAMES", "cosine_similarities", "embedding_ids", "prompt_scores", "right_padded"]
