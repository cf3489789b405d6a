"""The torch twin behind `needle-twin generate` and `embed` for Needle 3: a checkpoint's model, ready to decode,
score a prompt and embed texts (convert.v3.commands drives it; needle_flax.v3.runner is the same interface).

Shapes: B batch, P prompt length, N new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from needle_torch.v3.embed import embed, scores
from needle_torch.v3.generate import generate
from needle_torch.v3.model import SimpleAttentionNetwork


class Runner:
    """params: the checkpoint's Flax tree; config: in the compute dtype (float32 pins full-precision matmuls)."""

    def __init__(self, params: Any, config: Any) -> None:
        if config.dtype == "float32":
            torch.set_float32_matmul_precision("highest")
        self.model = SimpleAttentionNetwork.from_flax(params, config, dtype=config.dtype)

    def generate(self, prompts: np.ndarray, max_new_tokens: int, streamer: Callable | None = None,
                 **options: Any) -> np.ndarray:
        """(B, N) new ids for (B, P) left-padded prompts; options: needle_torch.v3.generate's."""
        def stream(step):
            streamer(np.asarray(step))
        out = generate(self.model, torch.from_numpy(np.asarray(prompts, np.int64)), max_new_tokens,
                       streamer=None if streamer is None else stream, **options)
        return out.cpu().numpy()

    def scores(self, prompts: np.ndarray, quant: bool = False) -> tuple[np.ndarray, np.ndarray]:
        confidence, router = scores(self.model, prompts, quant)
        return confidence.cpu().numpy(), router.cpu().numpy()

    def embed(self, tokenizer: Any, texts: Sequence[str], quant: bool = False) -> np.ndarray:
        return embed(self.model, tokenizer, texts, quant).cpu().numpy()


__all__ = ["Runner"]
