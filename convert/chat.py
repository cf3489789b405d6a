"""Chat text shared by the decoder families (Needle 2 and Needle 3): upstream's rendering rule, prompt and training
ids, decoding, streaming text and tool-call extraction.

Both families render with the same `finetune.render_example` (cactus-needle 2.0.15 and 3.x: NEEDLE_V3.md §8,
§13.1) and encode with plain `sp.Encode` (no BOS): every caller prepends BOS itself. A family supplies what
differs, in a `ChatFormat` (its special ids, the marker ids upstream hard-codes, markers with no fixed id) and
in its own `render_prompt` (Needle 3 adds its `<context>`/`<extract>`/`<schema>` blocks); `convert.v2.chat` and
`convert.v3.chat` bind them. sentencepiece is imported lazily by `convert.sentencepiece`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convert.errors import GenerationError, TokenizerError, one_line
from convert.sentencepiece import decode_tokens, load_tokenizer

# The marker text both families share (upstream's `tokenizer.py`).
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

LENGTH_BUCKET = 128  # finetune pads training rows to 128·2^k ids (fit_max_len)


# --------------------------------------------------------------------------------------------------------------------
# Rendering (finetune.render_example, 2.0.15 and 3.x)


def compact_json(value: Any) -> str:
    """Upstream's JSON for tools and answers: compact separators, non-ASCII written as raw UTF-8."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def tools_json(tools: Any, what: str = "tools") -> str:
    """A `<tools>` (or other JSON block) body: a string unchanged (it must parse as JSON), else compact JSON."""
    if isinstance(tools, str):
        try:
            json.loads(tools)
        except ValueError as e:
            raise TokenizerError(f"{what} is a string but not valid JSON ({one_line(e)}); pass it as JSON, e.g. "
                                 '\'[{"name": "get_weather", "parameters": {}}]\', or as a list/dict') from None
        return tools
    try:
        return compact_json(tools)
    except (TypeError, ValueError) as e:
        raise TokenizerError(f"{what} cannot be written as JSON ({one_line(e)}); pass a list or dict of JSON "
                             "values") from None


def render_turns(query: str, tools: str, system: str, blocks: Sequence[tuple[str, str, str]] = ()) -> str:
    """The prompt half of upstream's rule: `[system turn] + user turn with <tools>{tools}</tools>\\n + query +
    the assistant cue`.

    tools: the `<tools>` body, already JSON text. system: already stripped; empty leaves the turn out.
    blocks: (open, close, body) written as `{open}{body}{close}\\n` after the tools block, in the order given;
    upstream renders none (see `convert.v3.chat.render_prompt`).
    """
    head = IM_START + "system\n" + system + IM_END + "\n" if system else ""
    extra = "".join(start + body + end + "\n" for start, end, body in blocks)
    return (head + IM_START + "user\n" + TOOLS_START + tools + TOOLS_END + "\n" + extra
            + query + IM_END + "\n" + IM_START + "assistant\n")


def render_target(answers: str, reasoning: str) -> str:
    """The target half: `<think>\\n{reasoning}\\n</think>\\n` only if reasoning is non-empty, then the answers."""
    think = THINK_START + "\n" + reasoning + "\n" + THINK_END + "\n" if reasoning else ""
    return think + TOOL_CALL_START + answers + TOOL_CALL_END + IM_END


def _stripped(value: Any, name: str) -> str:
    """`(value or "").strip()`, as upstream reads system and reasoning."""
    value = value or ""
    if not isinstance(value, str):
        raise TokenizerError(f"{name} must be a string or None, got {type(value).__name__}")
    return value.strip()


def render_example(example: Mapping[str, Any]) -> tuple[str, str]:
    """(prompt, target) exactly as upstream's `finetune.render_example` (2.0.15 and 3.x) renders an example.

    example: {"query", "tools"?, "system"?, "reasoning"?, "answers" (or "function_calls")?}. tools and answers
    that are strings are used unchanged (tools must still parse as JSON), others become compact JSON with raw
    UTF-8; system and reasoning are stripped and None counts as empty. Other keys are ignored, as upstream does.
    """
    if not isinstance(example, Mapping) or not isinstance(example.get("query"), str):
        raise TokenizerError("an example needs a string 'query' (and optionally tools, system, reasoning, "
                             f"answers); got {_describe(example)}")
    # Upstream reads tools and answers with these .get defaults, so a present None is rendered as JSON null.
    answers = example.get("answers", example.get("function_calls", []))
    answers = answers if isinstance(answers, str) else compact_json(answers)
    prompt = render_turns(example["query"], tools_json(example.get("tools", [])),
                          _stripped(example.get("system"), "system"))
    return prompt, render_target(answers, _stripped(example.get("reasoning"), "reasoning"))


def render_prompt(query: str, tools: Any = None, system: str | None = None) -> str:
    """The prompt half of `render_example` for this query: what the model continues at inference.

    tools: a list of tool schemas (compact JSON, raw UTF-8), a JSON string (used unchanged), or None for [].
    system: an optional system turn, stripped; empty or None leaves it out, as upstream does.
    """
    if not isinstance(query, str):
        raise TokenizerError(f"query must be a string, got {type(query).__name__}")
    return render_turns(query, tools_json([] if tools is None else tools), _stripped(system, "system"))


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


def length_bucket(longest: int, cap: int) -> int:
    """upstream's `fit_max_len`: the smallest 128·2^k that holds `longest` ids, but at most `cap`."""
    bucket = LENGTH_BUCKET
    while bucket < min(longest, cap):
        bucket *= 2
    return min(bucket, cap)


# --------------------------------------------------------------------------------------------------------------------
# A family's tokens: checks, ids, decoding


@dataclass(frozen=True, eq=False)
class ChatFormat:
    """What a family's chat text hard-codes: special ids, marker ids, and markers with no fixed id.

    family: its name in messages ("Needle 2"). special_ids: {"pad", "eos", "bos", "unk"} -> id.
    marker_ids: marker -> the id upstream hard-codes, in upstream's order. free_markers: markers that must be
    single pieces of the tokenizer, at whatever id it gives them.
    """

    family: str
    special_ids: Mapping[str, int]
    marker_ids: Mapping[str, int]
    free_markers: tuple[str, ...] = ()

    def check_tokenizer(self, tokenizer: Any, vocab_size: int | None = None, source: str = "tokenizer") -> Any:
        """`tokenizer` unchanged if its special ids and markers are where upstream needs them and it fits a model
        vocabulary of `vocab_size` (None: not checked); otherwise a one-line TokenizerError."""
        for name, want in self.special_ids.items():
            got = getattr(tokenizer, f"{name}_id")()
            if got != want:
                ids = ", ".join(f"{k.upper()} {v}" for k, v in self.special_ids.items())
                raise TokenizerError(f"{source}: its {name} id is {got}, but {self.family} hard-codes {name}={want} "
                                     f"({ids}); use the tokenizer the model was trained with")
        size = tokenizer.get_piece_size()
        low, high = min(self.marker_ids.values()), max(self.marker_ids.values())
        for marker, want in self.marker_ids.items():
            got = tokenizer.piece_to_id(marker)
            if got == want:
                continue
            where = "is not in its vocabulary" if got == tokenizer.unk_id() else f"is at id {got}"
            held = f", where it has {tokenizer.id_to_piece(want)!r}" if want < size else ""
            raise TokenizerError(f"{source}: chat marker {marker} {where}, but upstream hard-codes it at id {want}"
                                 f"{held}; {self.family} needs the markers at ids {low}-{high} in upstream's order "
                                 "(train with user_defined_symbols=CHAT_MARKERS)")
        for marker in self.free_markers:
            pieces = [p for p in tokenizer.encode(marker, out_type=str) if p != "\u2581"]  # the dummy prefix aside
            if pieces != [marker]:
                raise TokenizerError(f"{source}: chat marker {marker} is not one piece (it encodes as {pieces}); "
                                     f"{self.family} needs all of {', '.join(self.free_markers)} as single pieces "
                                     "(train with user_defined_symbols=CHAT_MARKERS)")
        if vocab_size is not None and size > vocab_size:
            raise TokenizerError(f"{source}: has {size} pieces but the model's vocabulary holds {vocab_size}; "
                                 "use the tokenizer the model was trained with")
        return tokenizer

    def load_tokenizer(self, path: str | os.PathLike, vocab_size: int | None = None) -> Any:
        """The SentencePiece model at `path`, checked by `check_tokenizer` (at most `vocab_size` pieces)."""
        return self.check_tokenizer(load_tokenizer(path), vocab_size, source=os.fspath(path))

    def prompt_ids(self, tokenizer: Any, prompt: str, max_len: int | None = None) -> list[int]:
        """`([BOS] + sp.Encode(prompt))[:max_len]`, as upstream's generate paths build a prompt.

        max_len: None keeps every id. Cutting keeps the start, so a long prompt loses its end (the
        `<|im_start|>assistant\\n` cue first).
        """
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise GenerationError(f"max_len={max_len!r} leaves no room for the prompt; use an integer >= 1 "
                                  "(upstream: max_seq_len - 1, or max(1, max_seq_len - max_new_tokens))")
        ids = [self.special_ids["bos"]] + _encode(tokenizer, prompt)
        return ids if max_len is None else ids[:max_len]

    def training_ids(self, tokenizer: Any, prompt: str, target: str,
                     max_len: int | None = None) -> tuple[list[int], list[int]]:
        """(ids, loss mask) as upstream's finetune `_encode`: `[BOS] + enc(prompt) + enc(target) + [EOS]`.

        The two parts are encoded separately, so the target starts with its own dummy-prefix piece "▁" (unlike
        the encoding of prompt + target as one string). The mask is 0 on BOS and the prompt, 1 on the target and
        EOS. max_len: cut both to max_len and PAD-fill (mask 0) up to it, as upstream does; None leaves them.
        """
        p, t = _encode(tokenizer, prompt), _encode(tokenizer, target)
        ids = [self.special_ids["bos"]] + p + t + [self.special_ids["eos"]]
        mask = [0] * (1 + len(p)) + [1] * (len(t) + 1)
        if max_len is None:
            return ids, mask
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise GenerationError(f"max_len={max_len!r} must be an integer >= 1")
        ids, mask = ids[:max_len], mask[:max_len]
        pad = max_len - len(ids)
        return ids + [self.special_ids["pad"]] * pad, mask + [0] * pad

    def decode(self, tokenizer: Any, ids: Iterable[int]) -> str:
        """Text of generated ids up to the first EOS (excluded); PAD/BOS decode to nothing, markers to their text."""
        return decode_tokens(tokenizer, _until(ids, self.special_ids["eos"]))

    def stream(self, tokenizer: Any) -> TextStream:
        """A `TextStream` that ends at this family's EOS."""
        return TextStream(tokenizer, self.special_ids["eos"])


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise TokenizerError(f"can only encode a string, got {type(text).__name__}")
    return list(tokenizer.encode(text, out_type=int))


def _until(ids: Iterable[int], eos: int) -> list[int]:
    out = []
    for i in ids:
        if int(i) == eos:
            break
        out.append(int(i))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Streaming text


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
    `eos_id` ends the stream (later ids are ignored); `finish()` returns whatever is still held back.
    """

    tokenizer: Any
    eos_id: int
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything printed so far
    done: bool = False

    def __post_init__(self) -> None:
        self._byte = {}  # id -> byte value, for the byte-fallback pieces "<0xNN>"
        for i in range(self.tokenizer.get_piece_size()):
            if self.tokenizer.is_byte(i):
                self._byte[i] = int(self.tokenizer.id_to_piece(i)[3:5], 16)

    def feed(self, token: int) -> str:
        """The newly printable text after appending `token`."""
        if self.done:
            return ""
        token = int(token)
        if token == self.eos_id:
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
    think: str | None = None  # the <think> text, stripped, if there was one
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
    """(think text or None, the text without its <think>…</think> parts, error reason or None).

    The think text is stripped: upstream renders `<think>\\n{reasoning}\\n</think>` from stripped reasoning.
    """
    thoughts, rest = [], text
    while THINK_START in rest:
        before, after = rest.split(THINK_START, 1)
        if THINK_END not in after:
            return ("".join(thoughts) + after).strip() or None, before, (
                "the <think> part is not closed by </think> (the output may be cut short; allow more new tokens)")
        thought, rest_after = after.split(THINK_END, 1)
        thoughts.append(thought)
        rest = before + rest_after
    return ("".join(thoughts).strip() if thoughts else None), rest, None


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
    """The tool calls in model output `…<tool_call>[{"name": …, "arguments": {…}}, …]</tool_call>…`, in order.

    Upstream's answers are a JSON list of calls (`[]`: no tool applies); a single call object is accepted too.
    The `<think>…</think>` part is stripped first and returned as `think`. Only the first block is read (as
    upstream's scorer does); text after `</tool_call>` (`<|im_end|>`) is ignored. Malformed output is reported
    in a ToolCallError with a one-line reason, never raised.
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
    "IM_END", "IM_START", "LENGTH_BUCKET", "THINK_END", "THINK_START", "TOOLS_END", "TOOLS_START", "TOOL_CALL_END",
    "TOOL_CALL_START", "Call", "ChatFormat", "TextStream", "ToolCall", "ToolCallError", "compact_json",
    "extract_tool_call", "length_bucket", "load_tools", "render_example", "render_prompt", "render_target",
    "render_turns", "tools_json",
]
