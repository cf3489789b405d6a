"""Parity inputs: seeded random batches with varied right padding, token files, or text through a tokenizer.

A batch is an encoder input `src` (B, S) and a decoder input `tgt` (B, T), both int32,
right-padded with the config's pad id; `tgt` starts with EOS like upstream's decoder buffer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convert.config import EOS_ID, FIRST_PLAIN_ID, TransformerConfig
from convert.errors import NeedleTwinError


class InputError(NeedleTwinError, ValueError):
    """Token inputs are malformed or do not fit the model."""


@dataclass(frozen=True)
class Batch:
    src: np.ndarray  # (B, S) int32
    tgt: np.ndarray  # (B, T) int32
    source: str  # where the tokens came from, for the report

    def describe(self, pad_id: int) -> dict[str, Any]:
        return {
            "source": self.source,
            "batch": int(self.src.shape[0]),
            "src_len": int(self.src.shape[1]),
            "tgt_len": int(self.tgt.shape[1]),
            "src_lengths": _lengths(self.src, pad_id),
            "tgt_lengths": _lengths(self.tgt, pad_id),
        }


def _lengths(tokens: np.ndarray, pad_id: int) -> list[int]:
    return [int(n) for n in (tokens != pad_id).sum(axis=1)]


def _plain_ids(rng: np.random.Generator, shape: tuple[int, ...], config: TransformerConfig) -> np.ndarray:
    """Random ids that are neither special nor padding (tiny vocabularies fall back to any non-pad id)."""
    low = FIRST_PLAIN_ID if config.vocab_size > FIRST_PLAIN_ID + 1 else 0
    ids = rng.integers(low, config.vocab_size, size=shape)
    if config.vocab_size > 1:
        ids[ids == config.pad_token_id] = (config.pad_token_id + 1) % config.vocab_size
    return ids.astype(np.int32)


def varied_lengths(rng: np.random.Generator, batch: int, length: int, empty_rows: int = 0) -> list[int]:
    """Row 0 full, the others random in [1, length) longest first, then `empty_rows` fully padded rows."""
    if not 0 <= empty_rows <= batch - 1:
        raise InputError(f"empty_rows={empty_rows} must leave at least one non-empty row in a batch of {batch}")
    n = batch - 1 - empty_rows
    rest = sorted(rng.integers(1, length, size=n).tolist(), reverse=True) if length > 1 else [1] * n
    return [length, *rest, *[0] * empty_rows]


def _pad_rows(ids: np.ndarray, lengths: Sequence[int], pad_id: int) -> np.ndarray:
    out = ids.copy()
    for row, n in enumerate(lengths):
        out[row, n:] = pad_id
    return out


def random_batch(config: TransformerConfig, batch: int = 4, src_len: int = 64, tgt_len: int = 32, seed: int = 0,
                 empty_rows: int = 0) -> Batch:
    """Seeded random tokens with varied right padding; `empty_rows` rows fully padded in src and tgt."""
    for name, value in (("batch", batch), ("src-len", src_len), ("tgt-len", tgt_len)):
        if value < 1:
            raise InputError(f"--{name} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    src = _pad_rows(_plain_ids(rng, (batch, src_len), config), varied_lengths(rng, batch, src_len, empty_rows),
                    config.pad_token_id)
    return Batch(src, random_tgt(config, batch, tgt_len, rng, empty_rows), f"random (seed {seed})")


def random_tgt(config: TransformerConfig, batch: int, tgt_len: int, rng: np.random.Generator,
               empty_rows: int = 0) -> np.ndarray:
    """Decoder inputs: EOS then random ids, varied right padding."""
    tgt = _plain_ids(rng, (batch, tgt_len), config)
    tgt[:, 0] = EOS_ID
    return _pad_rows(tgt, varied_lengths(rng, batch, tgt_len, empty_rows), config.pad_token_id)


# ----------------------------------------------------------------------------- files


def _as_token_array(value: Any, what: str, pad_id: int) -> np.ndarray:
    """A 2-D int array from an array or a list of (possibly ragged) rows, right-padded with pad_id."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        if not isinstance(value, list) or not value or not all(isinstance(r, list) for r in value):
            raise InputError(f"{what} must be a non-empty list of token-id lists, e.g. [[12, 7, 5], [9, 4]]")
        width = max(len(r) for r in value)
        if width == 0:
            raise InputError(f"{what} has only empty rows; give at least one token")
        arr = np.full((len(value), width), pad_id, dtype=np.int64)
        for i, row in enumerate(value):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise InputError(f"{what} row {i} holds non-integer values; token ids are integers")
            arr[i, : len(row)] = row
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{what} must be a non-empty 2-D (batch, length) array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what} has dtype {arr.dtype}; token ids must be integers")
    return arr


def check_tokens(tokens: np.ndarray, config: TransformerConfig, what: str) -> np.ndarray:
    """int32 tokens within the vocabulary, or an error naming the bad id."""
    bad = (tokens < 0) | (tokens >= config.vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"{what}[{row}, {col}] = {int(tokens[row, col])} is outside the vocabulary "
                         f"[0, {config.vocab_size}); use ids of this model's tokenizer")
    return tokens.astype(np.int32)


def load_token_file(path: str | Path, config: TransformerConfig, tgt_len: int = 32, seed: int = 0) -> Batch:
    """Tokens from .npy (src array), .npz (src, optional tgt) or .json ({"src": rows, "tgt": rows} or rows).

    Without a tgt, decoder inputs are drawn as in `random_batch` (EOS + random ids, seeded).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such token file; give a .npy, .npz or .json file of token ids")
    suffix = path.suffix.lower()
    tgt = None
    try:
        if suffix == ".npy":
            src = np.load(path, allow_pickle=False)
        elif suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                if "src" not in z.files:
                    raise InputError(f"{path} has no 'src' array (found {', '.join(z.files) or 'none'})")
                src, tgt = z["src"], (z["tgt"] if "tgt" in z.files else None)
        elif suffix == ".json":
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                if "src" not in data:
                    raise InputError(f"{path}: a JSON object needs a 'src' key with token-id rows")
                src, tgt = data["src"], data.get("tgt")
            else:
                src = data
        else:
            raise InputError(f"{path}: unknown token file type {suffix!r}; use .npy, .npz or .json")
    except (ValueError, OSError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"{path}: cannot read token ids ({e}); give a .npy, .npz or .json file") from None
    src_arr = check_tokens(_as_token_array(src, "src", config.pad_token_id), config, "src")
    if tgt is None:
        tgt_arr = random_tgt(config, src_arr.shape[0], tgt_len, np.random.default_rng(seed))
        source = f"{path} (src; tgt random, seed {seed})"
    else:
        tgt_arr = check_tokens(_as_token_array(tgt, "tgt", config.pad_token_id), config, "tgt")
        source = str(path)
    if tgt_arr.shape[0] != src_arr.shape[0]:
        raise InputError(f"{path}: src has {src_arr.shape[0]} rows but tgt has {tgt_arr.shape[0]}; give one tgt "
                         "row per src row")
    return Batch(src_arr, tgt_arr, source)


# ----------------------------------------------------------------------------- text


def text_batch(tokenizer_path: str | Path, queries: Sequence[str], tools: str, config: TransformerConfig,
               tgt_len: int = 32, seed: int = 0) -> Batch:
    """Encoder inputs in upstream's format ([query, <tools>, tools]) through a SentencePiece tokenizer."""
    from convert.tokenizer import build_encoder_input, load_tokenizer

    if not queries:
        raise InputError("--tokenizer needs at least one --query TEXT")
    tokenizer = load_tokenizer(tokenizer_path)
    rows = [list(map(int, build_encoder_input(tokenizer, q, tools))) for q in queries]
    src = check_tokens(_as_token_array(rows, "tokenized text", config.pad_token_id), config, "tokenized text")
    tgt = random_tgt(config, src.shape[0], tgt_len, np.random.default_rng(seed))
    return Batch(src, tgt, f"text via {tokenizer_path} ({len(rows)} queries; tgt random, seed {seed})")
