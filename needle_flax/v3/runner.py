"""The Flax twin behind `needle-twin generate` and `embed` for Needle 3: a checkpoint's model, ready to decode,
score a prompt and embed texts (convert.v3.commands drives it; needle_torch.v3.runner is the same interface).

Shapes: B batch, P prompt length, N new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from needle_flax.v3.embed import embed, scores
from needle_flax.v3.generate import generate
from needle_flax.v3.model import SimpleAttentionNetwork


class Runner:
    """params: the checkpoint's Flax tree; config: in the compute dtype (float32 pins full-precision matmuls)."""

    def __init__(self, params: Any, config: Any) -> None:
        if config.dtype == "float32":
            jax.config.update("jax_default_matmul_precision", "highest")
        self.model = SimpleAttentionNetwork(config)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, config.dtype), params)  # upstream casts every param

    def generate(self, prompts: np.ndarray, max_new_tokens: int, streamer: Callable | None = None,
                 **options: Any) -> np.ndarray:
        """(B, N) new ids for (B, P) left-padded prompts; options: needle_flax.v3.generate's."""
        out = generate(self.model, self.params, np.asarray(prompts, np.int32), max_new_tokens, streamer=streamer,
                       **options)
        return np.asarray(out)

    def scores(self, prompts: np.ndarray, quant: bool = False) -> tuple[np.ndarray, np.ndarray]:
        confidence, router = scores(self.model, self.params, prompts, quant)
        return np.asarray(confidence), np.asarray(router)

    def embed(self, tokenizer: Any, texts: Sequence[str], quant: bool = False) -> np.ndarray:
        return np.asarray(embed(self.model, self.params, tokenizer, texts, quant))


__all__ = ["Runner"]
