"""Needle 3's text side: upstream's tokenizer checks and chat rendering, prompt/training ids, decoding and tool calls.

NEEDLE_V3.md §8. The rule, decoding, streaming and extraction are `convert.chat`'s (Needle 3 renders with the same
`finetune.render_example` as Needle 2 since 2.0.15); this module binds them to Needle 3's ids and markers.
Upstream hard-codes PAD/EOS/BOS/UNK at 0–3 and the first ten chat markers at 4–13; the six new markers
(`<context>`, `</context>`, `<extract>`, `</extract>`, `<schema>`, `</schema>`) have no fixed id, so
`check_tokenizer` only requires them to be single pieces.

The `<context>`/`<extract>`/`<schema>` blocks are **our placement, not upstream's**. Upstream's Python renders none
of them: `render_example`, `run.build_prompt` (`needle run --tools`) and the data generator never write them, and
its extraction path (`needle.extract`, the README's "the record as the only tool") passes the schema as the only
tool and the text as the query, to the C++ engine, whose prompt is unverified. `render_prompt` therefore renders
them only when asked, shaped like the one input block upstream does place: `<tools>{json}</tools>\\n`. Each block is
`{open}{body}{close}\\n` inside the user turn, after the tools block and before the query (as tools precede the
query), in the order upstream declares the markers (`CHAT_MARKERS`: context, extract, schema); a schema is written as
upstream writes tools (compact JSON, raw UTF-8), context and extract text verbatim. With none of them given, the
prompt is upstream's byte for byte. A model trained only on upstream's Python rendering has never seen these
blocks; for upstream's trained extraction format use `render_prompt(text, tools=[schema])`.
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
    render_turns,
    tools_json,
)
from convert.chat import TextStream as _TextStream
from convert.errors import TokenizerError
from convert.v3.config import BOS_ID, CHAT_MARKERS, EOS_ID, PAD_ID, UNK_ID

CONTEXT_START, CONTEXT_END = "<context>", "</context>"
EXTRACT_START, EXTRACT_END = "<extract>", "</extract>"
SCHEMA_START, SCHEMA_END = "<schema>", "</schema>"

SPECIAL_IDS = {"pad": PAD_ID, "eos": EOS_ID, "bos": BOS_ID, "unk": UNK_ID}
MARKER_IDS = {marker: 4 + i for i, marker in enumerate(CHAT_MARKERS[:10])}  # upstream's tokenizer.py: 4..13
FREE_MARKERS = CHAT_MARKERS[10:]  # no fixed id (NEEDLE_V3.md §8)
FORMAT = ChatFormat("Needle 3", SPECIAL_IDS, MARKER_IDS, FREE_MARKERS)

check_tokenizer = FORMAT.check_tokenizer
load_chat_tokenizer = FORMAT.load_tokenizer
prompt_ids = FORMAT.prompt_ids
training_ids = FORMAT.training_ids
decode = FORMAT.decode


class TextStream(_TextStream):
    """`convert.chat.TextStream` that ends at Needle 3's EOS."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, EOS_ID)


def _text_block(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TokenizerError(f"{name} must be a string or None, got {type(value).__name__}")
    return value


def render_prompt(query: str, tools: Any = None, system: str | None = None, context: str | None = None,
                  extract: str | None = None, schema: Any = None) -> str:
    """The prompt the model continues: upstream's `render_example` prompt half, plus our optional blocks.

    tools: a list of tool schemas (compact JSON, raw UTF-8), a JSON string (used unchanged), or None for [].
    system: an optional system turn, stripped; empty or None leaves it out, as upstream does.
    context, extract: text for a `<context>` / `<extract>` block (verbatim); None or "" leaves the block out.
    schema: a JSON schema (dict/list, or a JSON string) for a `<schema>` block; None leaves it out.
    The three blocks are not upstream's rendering (see the module docstring for where they go and why).
    """
    if not isinstance(query, str):
        raise TokenizerError(f"query must be a string, got {type(query).__name__}")
    if system is not None and not isinstance(system, str):
        raise TokenizerError(f"system must be a string or None, got {type(system).__name__}")
    blocks = [(start, end, _text_block(value, name))
              for start, end, value, name in ((CONTEXT_START, CONTEXT_END, context, "context"),
                                              (EXTRACT_START, EXTRACT_END, extract, "extract"))
              if value is not None and _text_block(value, name)]
    if schema is not None:
        blocks.append((SCHEMA_START, SCHEMA_END, tools_json(schema, what="schema")))
    return render_turns(query, tools_json([] if tools is None else tools), (system or "").strip(), blocks)


__all__ = [
    "BOS_ID", "CONTEXT_END", "CONTEXT_START", "EOS_ID", "EXTRACT_END", "EXTRACT_START", "FORMAT", "FREE_MARKERS",
    "IM_END", "IM_START", "LENGTH_BUCKET", "MARKER_IDS", "PAD_ID", "SCHEMA_END", "SCHEMA_START", "THINK_END",
    "THINK_START", "TOOLS_END", "TOOLS_START", "TOOL_CALL_END", "TOOL_CALL_START", "Call", "TextStream", "ToolCall",
    "ToolCallError", "check_tokenizer", "decode", "extract_tool_call", "length_bucket", "load_chat_tokenizer",
    "load_tools", "prompt_ids", "render_example", "render_prompt", "tools_json", "training_ids",
]
