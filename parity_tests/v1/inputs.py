"""Needle v1 parity inputs: seeded random batches, token files, or text through a tokenizer.

A batch is an encoder input `src` (B, S) and a decoder input `tgt` (B, T), both int32,
right-padded with the config's pad id; `tgt` starts with EOS like upstream's decoder buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from convert.v1.config import EOS_ID, FIRST_PLAIN_ID, TransformerConfig
from convert.v1.tokenizer import build_encoder_input, load_tokenizer
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


def _ids(rng: np.random.Generator, shape: tuple[int, ...], config: TransformerConfig) -> np.ndarray:
    return plain_ids(rng, shape, config.vocab_size, config.pad_token_id, FIRST_PLAIN_ID)


def random_batch(config: TransformerConfig, batch: int = 4, src_len: int = 64, tgt_len: int = 32, seed: int = 0,
                 empty_rows: int = 0) -> Batch:
    """Seeded random tokens with varied right padding; `empty_rows` rows fully padded in src and tgt."""
    check_sizes(batch=batch, src_len=src_len, tgt_len=tgt_len)
    rng = np.random.default_rng(seed)
    src = pad_rows(_ids(rng, (batch, src_len), config), varied_lengths(rng, batch, src_len, empty_rows),
                   config.pad_token_id)
    return Batch({"src": src, "tgt": random_tgt(config, batch, tgt_len, rng, empty_rows)}, f"random (seed {seed})")


def random_tgt(config: TransformerConfig, batch: int, tgt_len: int, rng: np.random.Generator,
               empty_rows: int = 0) -> np.ndarray:
    """Decoder inputs: EOS then random ids, varied right padding."""
    tgt = _ids(rng, (batch, tgt_len), config)
    tgt[:, 0] = EOS_ID
    return pad_rows(tgt, varied_lengths(rng, batch, tgt_len, empty_rows), config.pad_token_id)


def load_token_file(path: str | Path, config: TransformerConfig, tgt_len: int = 32, seed: int = 0, src_len: int = 0
                    ) -> Batch:
    """Tokens from .npy (src array), .npz (src, optional tgt) or .json ({"src": rows, "tgt": rows} or rows).

    Without a tgt, decoder inputs are drawn as in `random_batch` (EOS + random ids, seeded). src_len is the
    file's own (the argument is accepted so every input source takes the same lengths, and ignored).
    """
    found = read_token_file(path, "src", ("src", "tgt"))
    pad, V = config.pad_token_id, config.vocab_size
    src = check_tokens(as_token_array(found["src"], "src", pad), V, "src")
    if found.get("tgt") is None:
        tgt = random_tgt(config, src.shape[0], tgt_len, np.random.default_rng(seed))
        source = f"{path} (src; tgt random, seed {seed})"
    else:
        tgt = check_tokens(as_token_array(found["tgt"], "tgt", pad), V, "tgt")
        source = str(path)
    if tgt.shape[0] != src.shape[0]:
        raise InputError(f"{path}: src has {src.shape[0]} rows but tgt has {tgt.shape[0]}; give one tgt "
                         "row per src row")
    return Batch({"src": src, "tgt": tgt}, source)


def text_batch(tokenizer_path: str | Path, queries: Sequence[str], tools: str, config: TransformerConfig,
               tgt_len: int = 32, seed: int = 0, src_len: int = 0) -> Batch:
    """Encoder inputs in upstream's format ([query, <tools>, tools]) through a SentencePiece tokenizer (src_len:
    the text's own, as for token files)."""
    if not queries:
        raise InputError("--tokenizer needs at least one --query TEXT")
    tokenizer = load_tokenizer(tokenizer_path)
    rows = [list(map(int, build_encoder_input(tokenizer, q, tools))) for q in queries]
    src = check_tokens(as_token_array(rows, "tokenized text", config.pad_token_id), config.vocab_size,
                       "tokenized text")
    tgt = random_tgt(config, src.shape[0], tgt_len, np.random.default_rng(seed))
    return Batch({"src": src, "tgt": tgt}, f"text via {tokenizer_path} ({len(rows)} queries; tgt random, seed {seed})")
