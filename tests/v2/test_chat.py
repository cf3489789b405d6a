"""Needle 2's text side (convert/v2/chat.py) against upstream's rendering rule and the fixture tokenizer.

Goldens (tests/data/README-cact.md "Tokenizer"): `needle-v2-tiny.spm.model` and `quant.npz`'s `tok/texts_json`
(6 strings; [0] is upstream 2.0.8's `render_example` prompt+target) with `tok/sp_ids_json` (upstream's `sp.Encode`
of each). Expected prompts and targets are written out in this file from the 2.0.15 rule (NEEDLE_V3.md §13.1:
`<think>\n{reasoning}\n</think>\n` only with reasoning, system and reasoning stripped, raw UTF-8 JSON) and
encoded with sentencepiece directly, never by the renderer under test.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from convert.errors import GenerationError, TokenizerError
from convert.v2 import chat
from convert.v2.config import CHAT_MARKERS

DATA = Path(__file__).resolve().parents[1] / "data"
SPM_PATH = DATA / "needle-v2-tiny.spm.model"
QUANT = np.load(DATA / "needle-v2-tiny.quant.npz")
TEXTS = json.loads(str(QUANT["tok/texts_json"]))
SP_IDS = json.loads(str(QUANT["tok/sp_ids_json"]))
SP = spm.SentencePieceProcessor(model_file=str(SPM_PATH))  # the reference encoder, used directly
TOK = chat.load_chat_tokenizer(SPM_PATH, vocab_size=512)

# The example behind TEXTS[0], read off the string itself (no system turn; the README names no source).
FIXTURE_EXAMPLE = {
    "tools": [{"name": "get_weather", "parameters": {"location": "string"}}],
    "query": "What's the weather in Paris tomorrow?",
    "reasoning": "Weather lookup.",
    "answers": [{"name": "get_weather", "arguments": {"location": "Paris"}}],
}


# --------------------------------------------------------------------------------------------------------------------
# Fixture texts and rendering


def test_fixture_texts_encode_as_upstream():
    assert len(TEXTS) == 6
    for text, want in zip(TEXTS, SP_IDS, strict=True):
        assert chat.prompt_ids(TOK, text) == [2] + want  # BOS, then upstream's sp.Encode ids


def test_render_example_follows_2_0_15_on_the_fixture_example():
    prompt, target = chat.render_example(FIXTURE_EXAMPLE)
    # The fixture is 2.0.8's rendering (`<think>{reasoning}</think>`); 2.0.15 puts the reasoning on its own lines.
    old_think = "<think>Weather lookup.</think>\n"
    assert TEXTS[0].count(old_think) == 1
    assert prompt + target == TEXTS[0].replace(old_think, "<think>\nWeather lookup.\n</think>\n")
    assert prompt == TEXTS[0].split(old_think)[0]  # the prompt half did not change
    assert prompt.endswith("<|im_start|>assistant\n") and target.endswith("</tool_call><|im_end|>")


def _prompt_by_hand(tools_text, query, system=None):
    """§8's rule written out, independently of the renderer."""
    head = "<|im_start|>system\n" + system + "<|im_end|>\n" if system else ""
    return (head + "<|im_start|>user\n<tools>" + tools_text + "</tools>\n" + query + "<|im_end|>\n"
            + "<|im_start|>assistant\n")


PROMPT_CASES = [
    # (render_prompt kwargs, the <tools> body as upstream writes it, system)
    (dict(query="Set a timer for 25 minutes.", tools=[{"name": "set_timer", "parameters": {"minutes": "int"}}]),
     '[{"name":"set_timer","parameters":{"minutes":"int"}}]', None),
    (dict(query="Wetter in Zürich?", tools=[{"name": "w", "description": "météo €"}], system="Be brief."),
     '[{"name":"w","description":"météo €"}]', "Be brief."),  # ensure_ascii=False: raw UTF-8
    (dict(query="q", system="  Be brief.\n"), "[]", "Be brief."),  # system is stripped
    (dict(query="hi", tools='[ {"name": "x"} ]'), '[ {"name": "x"} ]', None),  # a string is used unchanged
    (dict(query="hi", tools=None, system=""), "[]", None),  # no tools is [], an empty system is left out
]


@pytest.mark.parametrize("kwargs, tools_text, system", PROMPT_CASES)
def test_prompt_ids_follow_the_spec_rule(kwargs, tools_text, system):
    text = _prompt_by_hand(tools_text, kwargs["query"], system)
    assert chat.render_prompt(**kwargs) == text
    assert chat.prompt_ids(TOK, chat.render_prompt(**kwargs)) == [2] + SP.Encode(text)


def _target_by_hand(answers_text, reasoning=""):
    """The 2.0.15 target rule written out: the think block only for non-empty (stripped) reasoning."""
    think = "<think>\n" + reasoning + "\n</think>\n" if reasoning else ""
    return think + "<tool_call>" + answers_text + "</tool_call><|im_end|>"


def test_render_example_fields():
    ex = {"query": "q", "system": " S\n", "function_calls": [{"name": "f", "arguments": {"a": "ü"}}]}
    prompt, target = chat.render_example(ex)
    assert prompt == _prompt_by_hand("[]", "q", system="S")
    assert target == _target_by_hand('[{"name":"f","arguments":{"a":"ü"}}]')  # no reasoning: no <think>
    # answers win over function_calls; a string answer is used unchanged
    _, target = chat.render_example({"query": "q", "answers": "[ ]", "function_calls": [1]})
    assert target == _target_by_hand("[ ]")
    # None and whitespace-only reasoning are empty; reasoning is stripped; a whitespace system is left out
    for reasoning in (None, "", " \n "):
        prompt, target = chat.render_example({"query": "q", "reasoning": reasoning, "system": "  "})
        assert target == "<tool_call>[]</tool_call><|im_end|>" and prompt == _prompt_by_hand("[]", "q")
    _, target = chat.render_example({"query": "q", "reasoning": "  because.\n"})
    assert target == _target_by_hand("[]", "because.")
    with pytest.raises(TokenizerError, match="string 'query'"):
        chat.render_example({"tools": []})


def test_training_ids_follow_the_spec_rule():
    ex = dict(FIXTURE_EXAMPLE, system="Be brief.", tools=[{"name": "météo"}])
    prompt_text = _prompt_by_hand('[{"name":"météo"}]', ex["query"], system="Be brief.")
    target_text = _target_by_hand('[{"name":"get_weather","arguments":{"location":"Paris"}}]', "Weather lookup.")
    ids, mask = chat.training_ids(TOK, *chat.render_example(ex))
    assert ids == [2] + SP.Encode(prompt_text) + SP.Encode(target_text) + [1]
    assert sum(mask) == len(SP.Encode(target_text)) + 1


def test_tools_string_must_be_json():
    with pytest.raises(TokenizerError, match=r"^tools is a string but not valid JSON \(") as e:
        chat.render_prompt("q", tools="[{name: x}]")
    assert "\n" not in str(e.value)
    with pytest.raises(TokenizerError, match="not valid JSON"):
        chat.render_example({"query": "q", "tools": "nope"})


def test_load_tools(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"name": "a", "parameters": {}}], indent=2))
    assert chat.tools_json(chat.load_tools(path)) == '[{"name":"a","parameters":{}}]'  # pretty file -> compact
    path.write_text("[oops")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        chat.load_tools(path)


# --------------------------------------------------------------------------------------------------------------------
# Ids: prompt truncation, training ids


def test_prompt_truncation_caps():
    text = _prompt_by_hand("[]", "word " * 100)
    full = [2] + SP.Encode(text)
    assert len(full) > 100
    assert chat.generate_cached_cap(64) == 63
    assert chat.prompt_ids(TOK, text, chat.generate_cached_cap(64)) == full[:63]
    assert chat.batched_generate_cap(64, 16) == 48
    assert chat.prompt_ids(TOK, text, chat.batched_generate_cap(64, 16)) == full[:48]
    assert chat.batched_generate_cap(64, 96) == 1
    assert chat.prompt_ids(TOK, text, chat.batched_generate_cap(64, 96)) == [2]
    with pytest.raises(GenerationError, match="max_len=0"):
        chat.prompt_ids(TOK, text, chat.generate_cached_cap(1))


def test_training_ids_encode_parts_separately():
    prompt, target = chat.render_example(FIXTURE_EXAMPLE)
    p, t = SP.Encode(prompt), SP.Encode(target)
    ids, mask = chat.training_ids(TOK, prompt, target)
    assert ids == [2] + p + t + [1]
    assert mask == [0] * (1 + len(p)) + [1] * (len(t) + 1)
    # Encoding the target on its own gives it a dummy-prefix "▁" that the one-string encoding has not.
    assert ids[1 + len(p)] == SP.PieceToId("▁") and ids != [2] + SP_IDS[0] + [1]
    short, short_mask = chat.training_ids(TOK, prompt, target, max_len=20)
    assert short == ids[:20] and short_mask == mask[:20]
    padded, padded_mask = chat.training_ids(TOK, prompt, target, max_len=128)
    assert padded == ids + [0] * (128 - len(ids)) and padded_mask == mask + [0] * (128 - len(ids))


def test_length_bucket():
    assert [chat.length_bucket(n, 2048) for n in (1, 128, 129, 300, 5000)] == [128, 128, 256, 512, 2048]
    assert chat.length_bucket(300, 200) == 200


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer checks


def test_fixture_markers_at_4_to_13():
    assert [SP.IdToPiece(4 + i) for i in range(10)] == list(CHAT_MARKERS)
    assert (SP.pad_id(), SP.eos_id(), SP.bos_id(), SP.unk_id()) == (0, 1, 2, 3)
    assert chat.check_tokenizer(SP, vocab_size=512) is SP


def _train(path: Path, markers, **ids) -> Path:
    """A tiny BPE SentencePiece model with `markers` as user-defined symbols (trains in well under a second)."""
    corpus = ["the quick brown fox jumps over the lazy dog", "tool call weather in paris", "set a timer"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=60,
        user_defined_symbols=list(markers), hard_vocab_limit=False, num_threads=1,
        **({"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3} | ids))
    path.write_bytes(model.getvalue())
    return path


def test_markers_elsewhere_are_refused(tmp_path):
    path = _train(tmp_path / "reversed.model", reversed(CHAT_MARKERS))
    with pytest.raises(TokenizerError) as e:
        chat.load_chat_tokenizer(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: chat marker <|im_start|> is at id 13, but upstream hard-codes it at id 4")
    assert "\n" not in msg


def test_missing_markers_and_wrong_specials_are_refused(tmp_path):
    with pytest.raises(TokenizerError, match=r"chat marker <\|im_start\|> is not in its vocabulary"):
        chat.load_chat_tokenizer(_train(tmp_path / "plain.model", ()))
    # sentencepiece's own defaults: unk 0, bos 1, eos 2, no pad
    defaults = _train(tmp_path / "defaults.model", CHAT_MARKERS, pad_id=-1, unk_id=0, bos_id=1, eos_id=2)
    with pytest.raises(TokenizerError, match="its pad id is -1, but Needle 2 hard-codes pad=0"):
        chat.load_chat_tokenizer(defaults)


def test_tokenizer_larger_than_vocab_is_refused():
    with pytest.raises(TokenizerError, match="has 512 pieces but the model's vocabulary holds 300"):
        chat.load_chat_tokenizer(SPM_PATH, vocab_size=300)


# --------------------------------------------------------------------------------------------------------------------
# Decoding


def test_decode_stops_at_eos_and_drops_control_ids():
    ids = SP.Encode("Set a timer.")
    assert chat.decode(TOK, [2] + ids + [0]) == "Set a timer."
    assert chat.decode(TOK, ids + [1] + SP.Encode(" junk")) == "Set a timer."
    assert chat.decode(TOK, [4, 6, 7, 5]) == "<|im_start|><think></think><|im_end|>"  # markers are text


def _stream(ids):
    stream = chat.TextStream(TOK)
    chunks = [stream.feed(i) for i in ids]
    chunks.append(stream.finish())
    return stream, chunks


@pytest.mark.parametrize("index", range(6))
def test_text_stream_rebuilds_every_fixture_text(index):
    stream, chunks = _stream(SP_IDS[index])
    assert "".join(chunks) == stream.text == TEXTS[index]
    assert not any("\ufffd" in c for c in chunks)


def test_text_stream_holds_partial_characters():
    text = TEXTS[4]  # 'café ☕ 東京 42€': byte-fallback pieces
    stream, chunks = _stream(SP_IDS[4])
    assert [SP.IsByte(i) for i in SP_IDS[4]].count(True) == 14  # é 2 + ☕ 3 + 東京 6 + € 3 bytes
    assert "".join(chunks) == text
    assert max(len(c) for c in chunks) == 1  # each character printed once complete, nothing twice
    emoji = SP.Encode("ok 😀!")  # a 4-byte character: held for 3 ids
    stream, chunks = _stream(emoji)
    assert "".join(chunks) == "ok 😀!" and "\ufffd" not in "".join(chunks)


def test_text_stream_eos_and_broken_bytes():
    byte = {SP.IdToPiece(i): i for i in range(512) if SP.IsByte(i)}
    broken = [byte["<0xE2>"], byte["<0x98>"]] + SP.Encode("a")  # a lead byte, one continuation, then no third
    stream, chunks = _stream(broken)
    assert "".join(chunks) == SP.Decode(broken) and chunks[:2] == ["", ""]  # printed once it cannot complete
    stream = chat.TextStream(TOK)
    assert stream.feed(byte["<0xC3>"]) == ""
    assert stream.feed(1) == SP.Decode([byte["<0xC3>"]]) and stream.done  # EOS flushes what is held
    assert stream.feed(SP.Encode("x")[0]) == ""


# --------------------------------------------------------------------------------------------------------------------
# Tool-call extraction


def test_extract_single_and_multiple_calls():
    result = chat.extract_tool_call(TEXTS[0].split("<|im_start|>assistant\n", 1)[1])
    assert result.ok and result.think == "Weather lookup."
    assert result.calls == (chat.Call("get_weather", {"location": "Paris"}),)
    many = chat.extract_tool_call('<tool_call>[{"name":"a","arguments":{"x":1}},{"name":"b","arguments":{}}]'
                                  "</tool_call><|im_end|>")
    assert many.ok and many.think is None
    assert [(c.name, c.arguments) for c in many.calls] == [("a", {"x": 1}), ("b", {})]
    one = chat.extract_tool_call('<tool_call>{"name":"a","arguments":{"k":[1,2]}}</tool_call>')
    assert one.ok and one.calls == (chat.Call("a", {"k": [1, 2]}),)
    none = chat.extract_tool_call("<think>off topic</think>\n<tool_call>[]</tool_call>")  # upstream's refusal
    assert none.ok and none.calls == () and none.think == "off topic"
    bare = chat.extract_tool_call('<tool_call>[{"name":"a"}]</tool_call>')  # upstream reads missing as {}
    assert bare.ok and bare.calls == (chat.Call("a", {}),)


def test_extract_from_generated_ids():
    ex = dict(FIXTURE_EXAMPLE, answers=[{"name": "book", "arguments": {"city": "Zürich", "note": "東京 €"}}])
    prompt, target = chat.render_example(ex)
    ids, mask = chat.training_ids(TOK, prompt, target)
    generated = [i for i, m in zip(ids, mask, strict=True) if m]  # target ids then EOS
    text = chat.decode(TOK, generated)
    assert text == target and "Zürich" in text  # the model writes raw UTF-8 JSON (ensure_ascii=False)
    result = chat.extract_tool_call(text)
    assert result.ok and result.calls == (chat.Call("book", {"city": "Zürich", "note": "東京 €"}),)
    raw = chat.extract_tool_call('<tool_call>[{"name":"b","arguments":{"city":"Zürich"}}]</tool_call>')
    assert raw.ok and raw.calls[0].arguments == {"city": "Zürich"}


MALFORMED = [
    ("just text", "no <tool_call> tag in the output"),
    ('<tool_call>[{"name":"a","arguments":{}}]', "the <tool_call> block is not closed by </tool_call>"),
    ("<tool_call>[{name: a}]</tool_call>", "the <tool_call> block is not valid JSON (Expecting property name"),
    ("<tool_call>42</tool_call>", "the <tool_call> block is a JSON number, not a list of calls or a call object"),
    ('<tool_call>[{"arguments":{}}]</tool_call>', "call 1 has no name"),
    ('<tool_call>{"name":"","arguments":{}}</tool_call>', 'the call has name "", not a non-empty string'),
    ('<tool_call>[{"name":"a"},{"name":3}]</tool_call>', "call 2 has name 3, not a non-empty string"),
    ('<tool_call>[{"name":"a","arguments":"{}"}]</tool_call>',
     "call 1 (a) has arguments that are a JSON string, not an object"),
    ('<tool_call>["a"]</tool_call>', "call 1 is a JSON string, not an object with a name and arguments"),
    ("<think>still thinking", "the <think> part is not closed by </think>"),
    ('<think>x</think><tool_call>[{"name":"a"}]</tool_call>'.replace("</tool_call>", ""),
     "the <tool_call> block is not closed"),
]


@pytest.mark.parametrize("text, reason", MALFORMED)
def test_extract_reports_malformed_output(text, reason):
    result = chat.extract_tool_call(text)
    assert isinstance(result, chat.ToolCallError) and not result.ok and result.calls == ()
    assert result.reason.startswith(reason), result.reason
    assert "\n" not in result.reason


def test_extract_strips_think_first():
    # a tag inside the thought is not the answer
    result = chat.extract_tool_call('<think>maybe <tool_call>[]</tool_call>?</think>\n<tool_call>[{"name":"z"}]'
                                    "</tool_call>")
    assert result.ok and result.calls == (chat.Call("z", {}),) and result.think == "maybe <tool_call>[]</tool_call>?"
