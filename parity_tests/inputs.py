"""Parity inputs every family shares: a batch of named token arrays, seeded padding, token files, id checks.

Each family's `inputs` module builds its batches from these (Needle v1: an encoder `src` and a
decoder `tgt`); the decoder families (Needle 2 and 3: one `tokens` array) share `DecoderInputs`.
Batches are right-padded with the config's pad id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convert.errors import NeedleTwinError


class InputError(NeedleTwinError, ValueError):
    """Token inputs are malformed or do not fit the model."""


@dataclass(frozen=True)
class Batch:
    """Named (B, T) int32 token arrays (e.g. `batch.src`, `batch.tokens`) and where they came from."""

    arrays: Mapping[str, np.ndarray]
    source: str  # for the report

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = self.__dict__.get("arrays", {})
        if name in arrays:
            return arrays[name]
        raise AttributeError(f"this batch has no {name!r} array (it has {', '.join(arrays) or 'none'})")

    def describe(self, pad_id: int) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "batch": int(next(iter(self.arrays.values())).shape[0])}
        for name, a in self.arrays.items():
            out[f"{name}_len"] = int(a.shape[1])
        for name, a in self.arrays.items():
            out[f"{name}_lengths"] = [int(n) for n in (a != pad_id).sum(axis=1)]
        return out


def plain_ids(rng: np.random.Generator, shape: tuple[int, ...], vocab: int, pad_id: int, first_plain: int
              ) -> np.ndarray:
    """Random ids that are neither special nor padding (tiny vocabularies fall back to any non-pad id)."""
    low = first_plain if vocab > first_plain + 1 else 0
    ids = rng.integers(low, vocab, size=shape)
    if vocab > 1:
        ids[ids == pad_id] = (pad_id + 1) % vocab
    return ids.astype(np.int32)


def varied_lengths(rng: np.random.Generator, batch: int, length: int, empty_rows: int = 0) -> list[int]:
    """Row 0 full, the others random in [1, length) longest first, then `empty_rows` fully padded rows."""
    if not 0 <= empty_rows <= batch - 1:
        raise InputError(f"empty_rows={empty_rows} must leave at least one non-empty row in a batch of {batch}")
    n = batch - 1 - empty_rows
    rest = sorted(rng.integers(1, length, size=n).tolist(), reverse=True) if length > 1 else [1] * n
    return [length, *rest, *[0] * empty_rows]


def pad_rows(ids: np.ndarray, lengths: Sequence[int], pad_id: int) -> np.ndarray:
    out = ids.copy()
    for row, n in enumerate(lengths):
        out[row, n:] = pad_id
    return out


def check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def as_token_array(value: Any, what: str, pad_id: int) -> np.ndarray:
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


def check_tokens(tokens: np.ndarray, vocab: int, what: str) -> np.ndarray:
    """int32 tokens within the vocabulary, or an error naming the bad id."""
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"{what}[{row}, {col}] = {int(tokens[row, col])} is outside the vocabulary "
                         f"[0, {vocab}); use ids of this model's tokenizer")
    return tokens.astype(np.int32)


def read_token_file(path: str | Path, main: str, names: Sequence[str]) -> dict[str, Any]:
    """The token arrays of a .npy (the `main` array), .npz or .json ({name: rows} or rows of `main`) file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such token file; give a .npy, .npz or .json file of token ids")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            found = {main: np.load(path, allow_pickle=False)}
        elif suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                found = {k: z[k] for k in z.files if k in names}
                if main not in found:
                    raise InputError(f"{path} has no {main!r} array (found {', '.join(z.files) or 'none'})")
        elif suffix == ".json":
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                if main not in data:
                    raise InputError(f"{path}: a JSON object needs a {main!r} key with token-id rows")
                found = {k: v for k, v in data.items() if k in names}
            else:
                found = {main: data}
        else:
            raise InputError(f"{path}: unknown token file type {suffix!r}; use .npy, .npz or .json")
    except (ValueError, OSError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"{path}: cannot read token ids ({e}); give a .npy, .npz or .json file") from None
    return found


@dataclass(frozen=True)
class DecoderInputs:
    """A decoder family's batches: one `tokens` array (B, T) int32 starting with BOS, right-padded with the pad id.

    first_plain: the first id that is no special or chat-marker id; chat: the family's convert chat module
    (load_chat_tokenizer, prompt_ids, render_prompt)."""

    bos_id: int
    first_plain: int
    chat: Any

    def random_batch(self, config: Any, batch: int = 4, seq_len: int = 64, seed: int = 0,
                     empty_rows: int = 0) -> Batch:
        """BOS, then random ordinary ids (never special), varied right padding; `empty_rows` rows fully padded."""
        check_sizes(batch=batch, seq_len=seq_len)
        rng = np.random.default_rng(seed)
        tokens = plain_ids(rng, (batch, seq_len), config.vocab_size, config.pad_token_id, self.first_plain)
        tokens[:, 0] = self.bos_id
        lengths = varied_lengths(rng, batch, seq_len, empty_rows)
        return Batch({"tokens": pad_rows(tokens, lengths, config.pad_token_id)}, f"random (seed {seed})")

    def load_token_file(self, path: str | Path, config: Any, seed: int = 0, seq_len: int = 0) -> Batch:
        """Tokens from .npy (the array), .npz or .json ({"tokens": rows} or rows); rows may be ragged (right-padded
        here). seq_len and seed are the file's own (accepted so every input source takes the same arguments)."""
        found = read_token_file(path, "tokens", ("tokens",))
        tokens = check_tokens(as_token_array(found["tokens"], "tokens", config.pad_token_id), config.vocab_size,
                              "tokens")
        return Batch({"tokens": tokens}, str(path))

    def text_batch(self, tokenizer_path: str | Path, queries: Sequence[str], tools: str, config: Any,
                   seed: int = 0, seq_len: int = 0) -> Batch:
        """Upstream's chat prompts ([BOS] + the rendered system/tools/query turn) through a SentencePiece
        tokenizer."""
        if not queries:
            raise InputError("--tokenizer needs at least one --query TEXT")
        tokenizer = self.chat.load_chat_tokenizer(tokenizer_path, vocab_size=config.vocab_size)
        rows = [self.chat.prompt_ids(tokenizer, self.chat.render_prompt(q, tools or None), config.max_seq_len)
                for q in queries]
        tokens = check_tokens(as_token_array(rows, "tokenized text", config.pad_token_id), config.vocab_size,
                              "tokenized text")
        return Batch({"tokens": tokens}, f"text via {tokenizer_path} ({len(rows)} queries)")
