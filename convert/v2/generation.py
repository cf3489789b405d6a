"""Framework-free argument checks for Needle 2 generation, shared by both v2 twins.

Upstream's batched path (NEEDLE_V2.md §6, `batched_generate`) lays a batch of prompts out
left-padded with PAD into (B, P) and decodes them together; its `valid` mask is False on the
left pads and True from each row's first real token on. Both twins check their arguments here,
as given (numpy, jax or torch arrays, or nested lists) and before converting them, so a bad
prompt or length fails with the same one-line message whichever backend runs.
"""

from __future__ import annotations

import math

import numpy as np

from convert.errors import GenerationError
from convert.generation import _as_array, _is_int

# What both twins' embeddings take (and jax's gather); str() of a torch dtype is "torch.int32".
_INT_DTYPES = ("int32", "int64")


def check_generate_args(config, tokens, max_new_tokens, kv_window=0, sink=None, temperature=0.0, seed=None,
                        eos_token_id=1, pad_token_id=0) -> np.ndarray:
    """Validate the arguments of v2 generation; returns the prompts as a numpy int64 (B, P) array.

    tokens: (B, P) ids, left-padded with pad_token_id (each row: pads, then at least one token, the last of them
    not a pad); P + max_new_tokens <= config.max_seq_len (the buffer holds every prompt and new token, as
    upstream's). kv_window: an int >= 0 (0: attend to everything). sink: None or a (B, P) bool (or 0/1 integer)
    array of prompt positions that stay visible under kv_window. temperature: a finite float >= 0 (0: greedy).
    seed: None or an int in [0, 2**63). eos_token_id: an id in the vocabulary, or None to never stop early."""
    V = config.vocab_size
    for name, value in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id)):
        if value is None and name == "eos_token_id":
            continue
        if not _is_int(value) or not 0 <= value < V:
            raise GenerationError(f"{name}={value!r} is outside the vocabulary [0, {V}); use an id in that range")
    prompts = _check_tokens(tokens, V, pad_token_id)
    B, P = prompts.shape
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if P + max_new_tokens > config.max_seq_len:
        raise GenerationError(f"{P} prompt positions + max_new_tokens={max_new_tokens} exceed the model's "
                              f"max_seq_len={config.max_seq_len}; shorten the prompts or ask for at most "
                              f"{max(config.max_seq_len - P, 0)} new tokens")
    if not _is_int(kv_window) or kv_window < 0:
        raise GenerationError(f"kv_window must be an integer >= 0 (0: no window), got {kv_window!r}")
    if sink is not None:
        _check_sink(sink, (B, P))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise GenerationError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise GenerationError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
    return prompts


def _check_tokens(tokens, V: int, pad: int) -> np.ndarray:
    """Shape, dtype, vocabulary range and left padding of the prompts; returns them as int64 (B, P).

    Python sequences are checked as Python ints, so an id too large for any integer dtype is reported as out of
    vocabulary rather than overflowing in a conversion."""
    arr = _as_array(tokens, "tokens", dtype=object)
    shape = tuple(arr.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise GenerationError(f"tokens must be a (batch, prompt length) array of token ids with both >= 1, got "
                              f"shape {shape}; add a batch axis for a single prompt")
    if arr.dtype == object:
        items = arr.ravel().tolist()
        odd = next((t for t in items if not _is_int(t)), None)
        if odd is not None:
            raise GenerationError(f"tokens holds {type(odd).__name__} values such as {odd!r}; token ids must be "
                                  "int32 or int64 (in a list: Python ints)")
        bad = sorted({int(t) for t in items if not 0 <= t < V})
        ids = None if bad else np.asarray(items, np.int64).reshape(shape)
    else:
        dtype = str(arr.dtype).removeprefix("torch.")
        if dtype not in _INT_DTYPES:
            raise GenerationError(f"tokens holds {dtype} values; token ids must be int32 or int64: convert them, "
                                  "e.g. tokens.astype(np.int32) (numpy, jax) or tokens.long() (torch)")
        ids = np.asarray(arr.cpu() if hasattr(arr, "cpu") else arr).astype(np.int64)
        bad = sorted(set(ids[(ids < 0) | (ids >= V)].tolist()))
    if bad:
        raise GenerationError(f"tokens has ids {bad[:5]} outside the model's vocabulary [0, {V}); is the tokenizer "
                              "the one this model was trained with?")
    real = ids != pad
    empty = np.flatnonzero(~real.any(axis=1))
    if empty.size:
        raise GenerationError(f"prompt row {int(empty[0])} is all padding (pad_token_id={pad}); give every row at "
                              "least one token (upstream starts each prompt with BOS)")
    ends_padded = np.flatnonzero(~real[:, -1])
    if ends_padded.size:
        raise GenerationError(f"prompt row {int(ends_padded[0])} ends with pad_token_id={pad}: prompts must be "
                              "left-padded (pads before the first token), as upstream's batched path lays them out")
    return ids


def _check_sink(sink, shape: tuple[int, int]) -> None:
    """sink: (B, P) bool or integer (nonzero = sink), over the prompt positions."""
    sink = _as_array(sink, "sink")
    if tuple(sink.shape) != shape:
        raise GenerationError(f"sink must have the prompts' shape {shape} (True = a prompt position that stays "
                              f"visible under kv_window), got shape {tuple(sink.shape)}")
    dtype = str(sink.dtype).removeprefix("torch.")
    if dtype != "bool" and not dtype.startswith(("int", "uint")):
        raise GenerationError(f"sink holds {dtype} values; it must be bool (or integer, nonzero = sink)")


def prompt_validity(prompts: np.ndarray, pad: int) -> np.ndarray:
    """Upstream's `valid` over the prompt positions (B, P): False on the left pads, True from each row's first
    non-pad token on (a pad id after it counts as a token, as upstream's)."""
    return np.cumsum(prompts != pad, axis=1) > 0
