"""Needle v1's text side: load the SentencePiece tokenizer and build upstream's encoder input.

Upstream's encoder reads `[query tokens, <tools>, tool tokens]` (ids from plain
`SentencePieceProcessor.Encode`, no BOS/EOS); the decoder starts from EOS. sentencepiece
is an optional dependency (`needle-twin[tokenizer]`), imported only when a tokenizer loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from convert.errors import TokenizerError
from convert.v1.config import TOOLS_ID


def load_tokenizer(path: str | os.PathLike):
    """A `sentencepiece.SentencePieceProcessor` for the `.model` file at `path`."""
    try:
        import sentencepiece as spm
    except ImportError:
        raise TokenizerError(
            "reading a tokenizer needs the sentencepiece package; install it with "
            "`pip install 'needle-twin[tokenizer]'` or pass token ids with --tokens"
        ) from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: no such tokenizer file; give the SentencePiece .model file")
    try:
        tokenizer = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"{path}: not a readable SentencePiece model ({e}); give the tokenizer's .model file") \
            from None
    if tokenizer.get_piece_size() <= TOOLS_ID:
        raise TokenizerError(f"{path}: has {tokenizer.get_piece_size()} pieces, too few for Needle's special ids "
                             f"0..{TOOLS_ID} (PAD, EOS, BOS, UNK, <tool_call>, <tools>); is it a Needle tokenizer?")
    return tokenizer


def build_encoder_input(tokenizer: Any, query: str, tools: str, max_len: int | None = None) -> list[int]:
    """Upstream's encoder ids: query ids + [<tools> (5)] + tool ids; tools (normally a JSON list) is encoded as given.

    max_len: truncate as upstream does (query to max_len - 2, then tools to what is left); None keeps all.
    """
    if not isinstance(query, str) or not isinstance(tools, str):
        raise TokenizerError(f"query and tools must be strings, got {type(query).__name__} and "
                             f"{type(tools).__name__}; pass tools as a JSON string, e.g. json.dumps(tool_list)")
    query_ids = list(tokenizer.encode(query, out_type=int))
    tool_ids = list(tokenizer.encode(tools, out_type=int))
    if max_len is not None:
        if max_len < 2:
            raise TokenizerError(f"max_len={max_len} leaves no room for the query and <tools>; use max_len >= 2")
        query_ids = query_ids[: max_len - 2]
        tool_ids = tool_ids[: max_len - len(query_ids) - 1]
    return query_ids + [TOOLS_ID] + tool_ids


def decode_tokens(tokenizer: Any, ids: Iterable[int]) -> str:
    """Text for token ids; control ids (PAD, EOS, BOS) decode to nothing, as in SentencePiece."""
    ids = [int(i) for i in ids]
    size = tokenizer.get_piece_size()
    bad = sorted({i for i in ids if not 0 <= i < size})
    if bad:
        raise TokenizerError(f"token ids {bad[:5]} are outside the tokenizer's {size} pieces; "
                             "is this the tokenizer the model was trained with?")
    return tokenizer.decode(ids)


def check_tools_json(tools: str) -> str:
    """tools unchanged if it parses as JSON; otherwise a TokenizerError that says how to fix it."""
    try:
        json.loads(tools)
    except ValueError as e:
        raise TokenizerError(f"--tools is not valid JSON ({e}); pass the tool list as a JSON string, e.g. '[]' or "
                             '\'[{"name": "get_weather", "parameters": {}}]\'') from None
    return tools
