"""Needle 2's text side: upstream's chat rendering, prompt/training ids, decoding and tool-call extraction.

NEEDLE_V2.md §8 and NEEDLE_V3.md §13.1: since cactus-needle 2.0.15 Needle 2 renders with the same
`finetune.render_example` as Needle 3 (`<think>\\n{reasoning}\\n</think>\\n` only with reasoning, stripped system
and reasoning, raw UTF-8 JSON), so the rule, decoding and extraction live in `convert.chat`; this module binds
them to Needle 2's ids and keeps the names its callers use. NEEDLE_V2.md §6 gives how `generate_cached` /
`batched_generate` cap a prompt. The model is decoder-only: a prompt is the rendered chat up to
`<|im_start|>assistant\\n`, and the model continues with `[<think>…</think>\\n]<tool_call>[…]</tool_call><|im_end|>`.

Upstream hard-codes PAD/EOS/BOS/UNK at 0–3 and the ten chat markers at 4–13; `check_tokenizer` refuses a
SentencePiece model that puts them elsewhere.
"""

from __future__ import annotations

from typing import Any

from convert.chat import (
    IM_END,
    IM_START,
    LENGTH_BUCKET,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOLS_END,
    TOOLS_START,
    Call,
    ChatFormat,
    ToolCall,
    ToolCallError,
    extract_tool_call,
    length_bucket,
    load_tools,
    render_example,
    render_prompt,
    tools_json,
)
from convert.chat import TextStream as _TextStream
from convert.v2.config import BOS_ID, EOS_ID, MARKER_IDS, PAD_ID, UNK_ID

SPECIAL_IDS = {"pad": PAD_ID, "eos": EOS_ID, "bos": BOS_ID, "unk": UNK_ID}
FORMAT = ChatFormat("Needle 2", SPECIAL_IDS, MARKER_IDS)

check_tokenizer = FORMAT.check_tokenizer
load_chat_tokenizer = FORMAT.load_tokenizer
prompt_ids = FORMAT.prompt_ids
training_ids = FORMAT.training_ids
decode = FORMAT.decode


class TextStream(_TextStream):
    """`convert.chat.TextStream` that ends at Needle 2's EOS."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, EOS_ID)


def generate_cached_cap(max_seq_len: int) -> int:
    """How many prompt ids (BOS included) upstream's `generate_cached` keeps: `max_seq_len - 1`."""
    return max_seq_len - 1


def batched_generate_cap(max_seq_len: int, max_new_tokens: int) -> int:
    """How many prompt ids (BOS included) upstream's `batched_generate` keeps: `max(1, max_seq_len - max_new)`."""
    return max(1, max_seq_len - max_new_tokens)


__all__ = [
    "BOS_ID", "EOS_ID", "FORMAT", "IM_END", "IM_START", "LENGTH_BUCKET", "MARKER_IDS", "PAD_ID", "THINK_END",
    "THINK_START", "TOOLS_END", "TOOLS_START", "TOOL_CALL_END", "TOOL_CALL_START", "Call", "TextStream", "ToolCall",
    "ToolCallError", "batched_generate_cap", "check_tokenizer", "decode", "extract_tool_call", "generate_cached_cap",
    "length_bucket", "load_chat_tokenizer", "load_tools", "prompt_ids", "render_example", "render_prompt",
    "tools_json", "training_ids",
]
