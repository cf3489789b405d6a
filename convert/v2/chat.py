"""Needle 2's text side: upstream's chat rendering, prompt/training ids, decoding and tool-call extraction.

NEEDLE_V2.md §8 (rendering, training ids) and §6 (how `generate_cached` / `batched_generate` build a prompt).
Upstream renders with `finetune.render_example` and encodes with plain `sp.Encode` (no BOS): every
caller prepends BOS itself. The model is decoder-only, so a prompt is the rendered chat up to
`<|im_start|>assistant\\n`, and the model continues with `<think>…</think>\\n<tool_call>[…]</tool_call><|im_end|>`.

Upstream hard-codes PAD/EOS/BOS/UNK at 0–3 and the ten chat markers at 4–13; `check_tokenizer` refuses a
SentencePiece model that puts them elsewhere. sentencepiece is imported lazily by `convert.sentencepiece`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from convert.errors import GenerationError, TokenizerError, one_line
from convert.sentencepiece import decode_tokens, load_tokenizer
from convert.v2.config import BOS_ID, EOS_ID, MARKER_IDS, PAD_ID, UNK_ID

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

SPECIAL_IDS = {"pad": PAD_ID, "eos": EOS_ID, "bos": BOS_ID, "unk": UNK_ID}
LENGTH_BUCKET = 128  # finetune pads training rows to 128·2^k ids (fit_max_len)


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer checks


def check_tokenizer(tokenizer: Any, vocab_size: int | None = None, source: str = "tokenizer") -> Any:
    """`tokenizer` unchanged if its special ids and chat markers sit where upstream hard-codes them (§8) and it fits
    a model vocabulary of `vocab_size` (None: not checked); otherwise a one-line TokenizerError."""
    for name, want in SPECIAL_IDS.items():
        got = getattr(tokenizer, f"{name}_id")()
        if got != want:
            raise TokenizerError(f"{source}: its {name} id is {got}, but Needle 2 hard-codes {name}={want} "
                                 "(PAD 0, EOS 1, BOS 2, UNK 3); use the tokenizer the model was trained with")
    size = tokenizer.get_piece_size()
    for marker, want in MARKER_IDS.items():
        got = tokenizer.piece_to_id(marker)
        if got == want:
            continue
        if got == tokenizer.unk_id():
            where = "is not in its vocabulary"
        else:
            where = f"is at id {got}"
        held = f", where it has {tokenizer.id_to_piece(want)!r}" if want < size else ""
        raise TokenizerError(f"{source}: chat marker {marker} {where}, but upstream hard-codes it at id {want}"
                             f"{held}; Needle 2 needs the markers at ids 4-13 in upstream's order "
                             "(train with user_defined_symbols=CHAT_MARKERS)")
    if vocab_size is not None and size > vocab_size:
        raise TokenizerError(f"{source}: has {size} pieces but the model's vocabulary holds {vocab_size}; "
                             "use the tokenizer the model was trained with")
    return tokenizer


def load_chat_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Any:
    """The SentencePiece model at `path`, checked by `check_tokenizer` (markers at 4–13, at most `vocab_size`)."""
    return check_tokenizer(load_tokenizer(path), vocab_size, source=os.fspath(path))


# --------------------------------------------------------------------------------------------------------------------
# Rendering (finetune.render_example)


def _compact_json(value: Any) -> str:
    """Upstream's JSON for tools and answers: compact separators, non-ASCII escaped (json.dumps' default)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def tools_json(tools: Any) -> str:
    """The `<tools>` body: a string unchanged (it must parse as JSON), anything else as upstream's compact JSON."""
    if isinstance(tools, str):
        try:
            json.loads(tools)
        except ValueError as e:
            raise TokenizerError(f"tools is a string but not valid JSON ({one_line(e)}); pass the tool list as "
                                 'JSON, e.g. \'[{"name": "get_weather", "parameters": {}}]\', or as a list') \
                from None
        return tools
    try:
        return _compact_json(tools)
    except (TypeError, ValueError) as e:
        raise TokenizerError(f"tools cannot be written as JSON ({one_line(e)}); pass a list of tool dicts "
                             "of JSON values") from None


def _prompt(query: str, tools: str, system: str | None) -> str:
    prefix = IM_START + "system\n" + system + IM_END + "\n" if system else ""
    return (prefix + IM_START + "user\n" + TOOLS_START + tools + TOOLS_END + "\n"
            + query + IM_END + "\n" + IM_START + "assistant\n")


def render_prompt(query: str, tools: Any = None, system: str | None = None) -> str:
    """The prompt upstream's `render_example` builds for this query: what the model continues at inference.

    tools: a list of tool schemas (written as compact ASCII JSON), a JSON string (used unchanged), or None for [].
    system: an optional system turn; empty or None leaves it out, as upstream does.
    """
    if not isinstance(query, str):
        raise TokenizerError(f"query must be a string, got {type(query).__name__}")
    if system is not None and not isinstance(system, str):
        raise TokenizerError(f"system must be a string or None, got {type(system).__name__}")
    return _prompt(query, tools_json([] if tools is None else tools), system)


def render_example(example: Mapping[str, Any]) -> tuple[str, str]:
    """(prompt, target) exactly as upstream's `finetune.render_example` (§8) renders a training example.

    example: {"query", "tools"?, "system"?, "reasoning"?, "answers" (or "function_calls")?}; tools and answers
    that are strings are used unchanged (tools must still parse as JSON), others become compact ASCII JSON.
    A None reasoning renders as "" (upstream would fail on it).
    """
    if not isinstance(example, Mapping) or not isinstance(example.get("query"), str):
        raise TokenizerError("an example needs a string 'query' (and optionally tools, system, reasoning, "
                             f"answers); got {_describe(example)}")
    # Upstream reads the fields with these .get defaults, so a present None is rendered as JSON null.
    answers = example.get("answers", example.get("function_calls", []))
    answers = answers if isinstance(answers, str) else _compact_json(answers)
    reasoning = example.get("reasoning", "") or ""
    system = example.get("system", "")
    prompt = _prompt(example["query"], tools_json(example.get("tools", [])), system)
    target = THINK_START + reasoning + THINK_END + "\n" + TOOL_CALL_START + answers + TOOL_CALL_END + IM_END
    return prompt, target


def load_tools(path: str | os.PathLike) -> Any:
    """The tool schemas in a JSON file, parsed, so that `render_prompt` writes them compact as in training."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read the tools file ({one_line(e)}); give a JSON file with the tool "
                             "list") from None
    except ValueError as e:
        raise TokenizerError(f"{path}: not valid JSON ({one_line(e)}); the tools file must hold a JSON list of "
                             "tool schemas") from None


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


# --------------------------------------------------------------------------------------------------------------------
# Token ids


def generate_cached_cap(max_seq_len: int) -> int:
    """How many prompt ids (BOS included) upstream's `generate_cached` keeps: `max_seq_len - 1`."""
    return max_seq_len - 1


def batched_generate_cap(max_seq_len: int, max_new_tokens: int) -> int:
    """How many prompt ids (BOS included) upstream's `batched_generate` keeps: `max(1, max_seq_len - max_new)`."""
    return max(1, max_seq_len - max_new_tokens)


def prompt_ids(tokenizer: Any, prompt: str, max_len: int | None = None) -> list[int]:
    """`([BOS] + sp.Encode(prompt))[:max_len]`, as upstream's generate paths build a prompt.

    max_len: None keeps every id; upstream's caps are `generate_cached_cap(max_seq_len)` and
    `batched_generate_cap(max_seq_len, max_new_tokens)`. Cutting keeps the start, so a long prompt loses its end
    (the `<|im_start|>assistant\\n` cue first).
    """
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise GenerationError(f"max_len={max_len!r} leaves no room for the prompt; use an integer >= 1 "
                              "(upstream: max_seq_len - 1, or max(1, max_seq_len - max_new_tokens))")
    ids = [BOS_ID] + _encode(tokenizer, prompt)
    return ids if max_len is None else ids[:max_len]


def training_ids(tokenizer: Any, prompt: str, target: str, max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) as upstream's finetune `_encode`: `[BOS] + enc(prompt) + enc(target) + [EOS]`.

    The two parts are encoded separately, so the target starts with its own dummy-prefix piece "▁" (unlike the
    encoding of prompt + target as one string). The mask is 0 on BOS and the prompt, 1 on the target and EOS.
    max_len: cut both to max_len and PAD-fill (mask 0) up to it, as upstream does; None leaves them as they are.
    """
    p, t = _encode(tokenizer, prompt), _encode(tokenizer, target)
    ids = [BOS_ID] + p + t + [EOS_ID]
    mask = [0] * (1 + len(p)) + [1] * (len(t) + 1)
    if max_len is None:
        return ids, mask
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise GenerationError(f"max_len={max_len!r} must be an integer >= 1")
    ids, mask = ids[:max_len], mask[:max_len]
    pad = max_len - len(ids)
    return ids + [PAD_ID] * pad, mask + [0] * pad


def length_bucket(longest: int, cap: int) -> int:
    """upstream's `fit_max_len`: the smallest 128·2^k that holds `longest` ids, but at most `cap`."""
    bucket = LENGTH_BUCKET
    while bucket < min(longest, cap):
        bucket *= 2
    return min(bucket, cap)


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise TokenizerError(f"can only encode a string, got {type(text).__name__}")
    return list(tokenizer.encode(text, out_type=int))


# --------------------------------------------------------------------------------------------------------------------
# Decoding


def _until_eos(ids: Iterable[int]) -> list[int]:
    out = []
    for i in ids:
        if int(i) == EOS_ID:
            break
        out.append(int(i))
    return out


def decode(tokenizer: Any, ids: Iterable[int]) -> str:
    """Text of generated ids up to the first EOS (excluded); PAD/BOS decode to nothing, markers to their text."""
    return decode_tokens(tokenizer, _until_eos(ids))


def _utf8_pending(data: bytes) -> int:
    """How many trailing bytes of `data` start a UTF-8 character that is not complete yet (0 if none)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


@dataclass
class TextStream:
    """Incremental decoding: `feed(id)` returns the text that id makes printable ("" while it waits).

    SentencePiece joins pieces (the leading "▁" of the first one is dropped), so each step decodes the whole
    prefix and prints what is new. Byte-fallback pieces that start a multi-byte UTF-8 character are held back
    until the character is complete, so a replacement character is printed only where the final text has one.
    EOS ends the stream (later ids are ignored); `finish()` returns whatever is still held back.
    """

    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything printed so far
    done: bool = False

    def __post_init__(self) -> None:
        size = self.tokenizer.get_piece_size()
        self._byte = {}  # id -> byte value, for the byte-fallback pieces "<0xNN>"
        for i in range(size):
            if self.tokenizer.is_byte(i):
                self._byte[i] = int(self.tokenizer.id_to_piece(i)[3:5], 16)

    def feed(self, token: int) -> str:
        """The newly printable text after appending `token`."""
        if self.done:
            return ""
        token = int(token)
        if token == EOS_ID:
            return self.finish()
        self.ids.append(token)
        tail = bytearray()
        for i in reversed(self.ids[-3:]):  # a held-back character is at most 3 byte pieces
            if i not in self._byte:
                break
            tail.insert(0, self._byte[i])
        stable = len(self.ids) - _utf8_pending(bytes(tail))
        return self._emit(decode_tokens(self.tokenizer, self.ids[:stable]))

    def finish(self) -> str:
        """Ends the stream and returns the text still held back (an unfinished character decodes as U+FFFD)."""
        self.done = True
        return self._emit(decode_tokens(self.tokenizer, self.ids))

    def _emit(self, full: str) -> str:
        # Decoding a longer prefix extends the shorter one (held-back bytes aside); if it ever did not, print the
        # text after the common part rather than repeat what is already on screen.
        n = len(self.text) if full.startswith(self.text) else len(os.path.commonprefix([full, self.text]))
        new = full[n:]
        self.text += new
        return new


# --------------------------------------------------------------------------------------------------------------------
# Tool-call extraction


@dataclass(frozen=True)
class Call:
    """One tool call: the tool's name and its arguments (a dict)."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCall:
    """A well-formed tool-call block: its calls (empty for upstream's "no tool applies" answer `[]`)."""

    calls: tuple[Call, ...]
    think: str | None = None  # the <think> text, if there was one
    body: str = ""  # the JSON between <tool_call> and </tool_call>
    ok = True


@dataclass(frozen=True)
class ToolCallError:
    """Model output that holds no usable tool call; `reason` is one line saying why."""

    reason: str
    think: str | None = None
    body: str | None = None
    calls: tuple[Call, ...] = ()
    ok = False


def _split_think(text: str) -> tuple[str | None, str, str | None]:
    """(think text or None, the text without its <think>…</think> parts, error reason or None)."""
    thoughts, rest = [], text
    while THINK_START in rest:
        before, after = rest.split(THINK_START, 1)
        if THINK_END not in after:
            return ("".join(thoughts) + after) or None, before, (
                "the <think> part is not closed by </think> (the output may be cut short; allow more new tokens)")
        thought, rest_after = after.split(THINK_END, 1)
        thoughts.append(thought)
        rest = before + rest_after
    return ("".join(thoughts) if thoughts else None), rest, None


def _call(item: Any, k: int, many: bool) -> Call | str:
    which = f"call {k + 1}" if many else "the call"
    if not isinstance(item, dict):
        return f"{which} is a JSON {_json_kind(item)}, not an object with a name and arguments"
    name = item.get("name")
    if not isinstance(name, str) or not name:
        got = "has no name" if name is None else f"has name {json.dumps(name)}, not a non-empty string"
        return f"{which} {got}"
    # Upstream's scorer reads `c.get("arguments") or {}`: missing or null arguments are an empty call.
    arguments = item.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"{which} ({name}) has arguments that are a JSON {_json_kind(arguments)}, not an object"
    return Call(name, arguments)


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def extract_tool_call(text: str) -> ToolCall | ToolCallError:
    """The tool calls in model output `…<tool_call>[{"name": …, "arguments": {…}}, …]</tool_call>…`.

    Upstream's answers are a JSON list of calls; a single call object is accepted too. The `<think>…</think>`
    part is stripped first and returned as `think`. Only the first block is read (as upstream's scorer does);
    text after `</tool_call>` (`<|im_end|>`) is ignored. Malformed output is reported in a ToolCallError with a
    one-line reason, never raised.
    """
    if not isinstance(text, str):
        return ToolCallError(f"the output is a {type(text).__name__}, not text")
    think, rest, reason = _split_think(text)
    if reason:
        return ToolCallError(reason, think=think)
    if TOOL_CALL_START not in rest:
        return ToolCallError("no <tool_call> tag in the output", think=think)
    after = rest.split(TOOL_CALL_START, 1)[1]
    if TOOL_CALL_END not in after:
        return ToolCallError("the <tool_call> block is not closed by </tool_call> (the output may be cut short; "
                             "allow more new tokens)", think=think, body=after)
    body = after.split(TOOL_CALL_END, 1)[0]
    try:
        parsed = json.loads(body)
    except ValueError as e:
        return ToolCallError(f"the <tool_call> block is not valid JSON ({one_line(e)})", think=think, body=body)
    if isinstance(parsed, dict):
        items, many = [parsed], False
    elif isinstance(parsed, list):
        items, many = parsed, True
    else:
        return ToolCallError(f"the <tool_call> block is a JSON {_json_kind(parsed)}, not a list of calls or a call "
                             "object", think=think, body=body)
    calls = []
    for k, item in enumerate(items):
        call = _call(item, k, many)
        if isinstance(call, str):
            return ToolCallError(call, think=think, body=body)
        calls.append(call)
    return ToolCall(tuple(calls), think=think, body=body)


__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "Call", "TextStream", "ToolCall", "ToolCallError", "batched_generate_cap",
    "check_tokenizer", "decode", "extract_tool_call", "generate_cached_cap", "length_bucket", "load_chat_tokenizer",
    "load_tools", "prompt_ids", "render_example", "render_prompt", "tools_json", "training_ids",
]
