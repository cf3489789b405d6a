"""Sentence embeddings from text with the Needle 3 torch twin: upstream's `forward_embedding` on tokenized texts.

Shapes: B texts or prompts, P prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from convert.v3.embedding import embedding_ids, right_padded


@torch.inference_mode()
def embed(model: nn.Module, tokenizer: Any, texts: Sequence[str], quant: bool = False) -> Tensor:
    """The normalised sentence vectors (B, embedding_dim) in float32, one per text (convert.v3.embedding: the ids,
    and why a batch is right-padded). tokenizer: a SentencePiece processor (convert.v3.chat.load_chat_tokenizer).
    quant: upstream's deploy numerics (a .cact's)."""
    tokens = torch.from_numpy(embedding_ids(tokenizer, texts, model.config.max_seq_len))
    return model.forward_embedding(tokens.long().to(model.embedding.weight.device), quant=quant).float()


@torch.inference_mode()
def scores(model: nn.Module, prompts, quant: bool = False) -> tuple[Tensor, Tensor]:
    """The confidence head's score (B,) and the router head's three values (B, 3), float32, for prompt id rows
    (a list of rows, or a (B, P) array; pads anywhere are dropped): upstream's forward_confidence and forward_router
    on each prompt right-padded (convert.v3.embedding.right_padded). quant: upstream's deploy numerics."""
    rows = prompts.tolist() if hasattr(prompts, "tolist") else prompts
    tokens = torch.from_numpy(right_padded(rows)).long().to(model.embedding.weight.device)
    return model.forward_confidence(tokens, quant=quant).float(), model.forward_router(tokens, quant=quant).float()


__all__ = ["embed", "scores"]
