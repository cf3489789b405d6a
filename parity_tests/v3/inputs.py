"""Needle 3 parity inputs: seeded random batches or token files.

A batch is one `tokens` array (B, T) int32 starting with BOS, right-padded with the config's pad id.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from convert.v3.chat import MARKER_IDS
from convert.v3.config import BOS_ID, TransformerConfig
from parity_tests.inputs import (
    Batch,
    InputError,
    as_token_array,
    check_sizes,
    check_tokens,
    pad_rows,
    plain_ids,
    read_token_file,
    varied_lengths,
)

FIRST_PLAIN_ID = max(MARKER_IDS.values()) + 1  # after PAD, EOS, BOS, UNK and the fixed chat markers


def random_batch(config: TransformerConfig, batch: int = 4, seq_len: int = 64, seed: int = 0,
                 empty_rows: int = 0) -> Batch:
    """BOS, then random ordinary ids (never special), varied right padding; `empty_rows` rows fully padded."""
    check_sizes(batch=batch, seq_len=seq_len)
    rng = np.random.default_rng(seed)
    tokens = plain_ids(rng, (batch, seq_len), config.vocab_size, config.pad_token_id, FIRST_PLAIN_ID)
    tokens[:, 0] = BOS_ID
    lengths = varied_lengths(rng, batch, seq_len, empty_rows)
    return Batch({"tokens": pad_rows(tokens, lengths, config.pad_token_id)}, f"random (seed {seed})")


def load_token_file(path: str | Path, config: TransformerConfig, seed: int = 0, seq_len: int = 0) -> Batch:
    """Tokens from .npy (the array), .npz or .json ({"tokens": rows} or rows); ragged rows are right-padded here."""
    found = read_token_file(path, "tokens", ("tokens",))
    tokens = check_tokens(as_token_array(found["tokens"], "tokens", config.pad_token_id), config.vocab_size,
                          "tokens")
    return Batch({"tokens": tokens}, str(path))


def text_batch(tokenizer_path: str | Path, queries: Sequence[str], tools: str, config: TransformerConfig,
               seed: int = 0, seq_len: int = 0) -> Batch:
    raise InputError("Needle 3 parity does not tokenize text yet: encode the prompts with the checkpoint's "
                     "SentencePiece model and pass the ids with --inputs FILE")
