"""Framework-free pieces of generation shared by both twins of a family: argument checks, token-id parsing.

Both twins validate their arguments here, so a bad token id or length fails with the same
one-line message whichever backend runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from convert.errors import GenerationError


def check_generate_args(config, src, src_mask, max_new_tokens: int, eos_token_id: int,
                        pad_token_id: int, suppress_tokens: Iterable[int] | None) -> np.ndarray | None:
    """Validate generation arguments as given (numpy, jax or torch arrays, or nested lists), before a twin converts
    them; returns the suppressed ids as a bool (V,) mask, or None: one shape whatever the set, so a compiled loop
    never recompiles for it."""
    V = config.vocab_size
    shape = _check_src(src, V)
    if src_mask is not None:
        _check_src_mask(src_mask, shape)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if not _is_int(value) or not 0 <= value < V:
            raise GenerationError(f"{name}={value!r} is outside the vocabulary [0, {V}); use an id in that range")
    if suppress_tokens is None:
        ids = []
    else:  # a list, range or set of ids, or a 1-d numpy / jax / torch array of them
        ids = suppress_tokens.tolist() if hasattr(suppress_tokens, "tolist") else list(suppress_tokens)
    if not all(_is_int(t) for t in ids):
        raise GenerationError(f"suppress_tokens must be integer token ids, got {suppress_tokens!r}")
    ids = [int(t) for t in ids]
    bad = sorted({t for t in ids if not 0 <= t < V})
    if bad:
        raise GenerationError(f"suppress_tokens {bad} are outside the vocabulary [0, {V}); drop them")
    if not ids:
        return None
    suppress = np.zeros(V, dtype=bool)
    suppress[ids] = True
    if suppress.all():
        raise GenerationError(f"suppress_tokens covers all {V} ids, so no token can be chosen; suppress fewer ids")
    return suppress


# What torch's embedding takes (and jax's gather): other integer dtypes fail there, or in torch's min() (uint32).
# str() of a numpy or jax dtype is "int32"; of a torch dtype "torch.int32" (torch.long is "torch.int64").
_INT_DTYPES = ("int32", "int64")


def _is_int(value) -> bool:
    """A Python or numpy integer, not a bool (True would pass as id 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_array(value, name: str, dtype=None):
    """An array (numpy, jax, torch) as it is; a nested sequence as a numpy array of `dtype`."""
    if hasattr(value, "dtype"):
        return value
    try:
        np.shape(value)  # refuses ragged rows, which np.asarray(dtype=object) would keep as list items
        return np.asarray(value, dtype=dtype)
    except ValueError:
        raise GenerationError(f"{name} is not a rectangular array (rows of different lengths?); pad its rows to "
                              "one length") from None


def _check_src(src, V: int) -> tuple[int, ...]:
    """Shape, dtype and vocabulary range of the encoder ids; returns the shape (B, S).

    Python sequences are checked as Python ints (an object array), so an id too large for any integer dtype
    (3000000000 for int32, 2**64) is reported as out of vocabulary rather than overflowing in a conversion."""
    src = _as_array(src, "src", dtype=object)
    shape = tuple(src.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise GenerationError(f"src must be a (batch, length) array of token ids with both >= 1, got shape "
                              f"{shape}; add a batch axis for a single sequence")
    if src.dtype == object:
        items = src.ravel().tolist()
        odd = next((t for t in items if not _is_int(t)), None)
        if odd is not None:
            raise GenerationError(f"src holds {type(odd).__name__} values such as {odd!r}; token ids must be int32 "
                                  "or int64 (in a list: Python ints)")
        bad = sorted({int(t) for t in items if not 0 <= t < V})
    else:
        dtype = str(src.dtype).removeprefix("torch.")
        if dtype not in _INT_DTYPES:
            raise GenerationError(f"src holds {dtype} values; token ids must be int32 or int64: convert it, e.g. "
                                  "src.astype(np.int32) (numpy, jax) or src.long() (torch)")
        bad = []
        if int(src.min()) < 0 or int(src.max()) >= V:
            ids = np.asarray(src.cpu() if hasattr(src, "cpu") else src)
            bad = sorted(set(ids[(ids < 0) | (ids >= V)].tolist()))
    if bad:
        raise GenerationError(f"src has ids {bad[:5]} outside the model's vocabulary [0, {V}); is the tokenizer "
                              "the one this model was trained with?")
    return shape


def _check_src_mask(src_mask, src_shape: tuple[int, ...]) -> None:
    """src_mask: bool (B|1, 1, 1, S), like make_padding_mask(src) gives."""
    src_mask = _as_array(src_mask, "src_mask")
    B, S = src_shape
    shape = tuple(src_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, B) or shape[1:3] != (1, 1) or shape[3] != S:
        raise GenerationError(f"src_mask must be (batch, 1, 1, {S}) like make_padding_mask(src) gives, got "
                              f"shape {shape}")
    if str(src_mask.dtype).removeprefix("torch.") != "bool":  # numpy, jax and torch all spell it "bool"
        raise GenerationError(f"src_mask holds {src_mask.dtype} values; it must be bool (True = attend), as "
                              "make_padding_mask(src) gives")


# ----------------------------------------------------------------------------- CLI support (`needle-twin generate`)


def parse_token_ids(text: str) -> list[int]:
    """Token ids from "391 385 418", "391,385,418" or "[391, 385, 418]"."""
    parts = text.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise GenerationError(f"--tokens {text!r} is not a list of integer token ids; "
                              "write e.g. --tokens '391 385 418'") from None
    if not ids:
        raise GenerationError("--tokens is empty; give at least one encoder token id, e.g. --tokens '391 385 418'")
    return ids


@dataclass(frozen=True)
class EmbedRequest:
    """`needle-twin embed`'s options, as a family's embed command receives them."""

    texts: Sequence[str]
    tokenizer: str  # a SentencePiece .model
    backend: str  # torch or flax
    dtype: str | None  # None: the checkpoint config's
    as_json: bool
