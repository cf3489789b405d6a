"""Needle v1's text side: upstream's encoder input from a query and its tools.

Upstream's encoder reads `[query tokens, <tools>, tool tokens]` (ids from plain
`SentencePieceProcessor.Encode`, no BOS/EOS); the decoder starts from EOS.
"""

from __future__ import annotations

import json
from typing import Any

from convert.errors import TokenizerError
from convert.sentencepiece import decode_tokens, load_tokenizer
from convert.v1.config import TOOLS_ID

__all__ = ["build_encoder_input", "check_tools_json", "decode_tokens", "load_tokenizer"]


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


def check_tools_json(tools: str) -> str:
    """tools unchanged if it parses as JSON; otherwise a TokenizerError that says how to fix it."""
    try:
        json.loads(tools)
    except ValueError as e:
        raise TokenizerError(f"--tools is not valid JSON ({e}); pass the tool list as a JSON string, e.g. '[]' or "
                             '\'[{"name": "get_weather", "parameters": {}}]\'') from None
    return tools
