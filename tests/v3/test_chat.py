"""Needle 3's text side (convert/v3/chat.py) against upstream's rendering rule and the fixture tokenizer.

Goldens (/work/shared/fixtures/README-v3.md): `needle-v3-tiny.spm.model` (512 pieces, the 16 chat markers as
user-defined pieces 4–19) and `needle-v3-tiny.cact.npz`'s `tok/texts_json` (6 strings; [0] is upstream 3.2.8's
`render_example` prompt + target) with `tok/sp_ids_json` (upstream's `sp.Encode` of each). Expected prompts and
targets are written out here from NEEDLE_V3.md §8 and encoded with sentencepiece directly, never by the renderer
under test; BOS (2) is prepended by hand.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from convert.errors import TokenizerError
from convert.v3 import chat
from convert.v3.config import CHAT_MARKERS

DATA = Path(__file__).resolve().parents[1] / "data" / "v3"
SPM_PATH = DATA / "needle-v3-tiny.spm.model"
CACT = np.load(DATA / "needle-v3-tiny.cact.npz")
TEXTS = json.loads(str(CACT["tok/texts_json"]))
SP_IDS = json.loads(str(CACT["tok/sp_ids_json"]))
SP = spm.SentencePieceProcessor(model_file=str(SPM_PATH))  # the reference encoder, used directly
TOK = chat.load_chat_tokenizer(SPM_PATH, vocab_size=512)
BOS, EOS = 2, 1

# The example behind TEXTS[0], read off the string itself (no system turn).
FIXTURE_EXAMPLE = {
    "tools": [{"name": "get_weather", "parameters": {"location": "string"}}],
    "query": "What's the weather in Paris tomorrow?",
    "reasoning": "Weather lookup.",
    "answers": [{"name": "get_weather", "arguments": {"location": "Paris"}}],
}


def _prompt_by_hand(tools_text, query, system=None, blocks=""):
    """§8's prompt rule written out, independently of the renderer (`blocks`: our extra blocks' text)."""
    head = "<|im_start|>system\n" + system + "<|im_end|>\n" if system else ""
    return (head + "<|im_start|>user\n<tools>" + tools_text + "</tools>\n" + blocks + query + "<|im_end|>\n"
            + "<|im_start|>assistant\n")


def _target_by_hand(answers_text, reasoning=""):
    """§8's target rule: `<think>\\n{reasoning}\\n</think>\\n` only for non-empty reasoning."""
    think = "<think>\n" + reasoning + "\n</think>\n" if reasoning else ""
    return think + "<tool_call>" + answers_text + "</tool_call><|im_end|>"


# --------------------------------------------------------------------------------------------------------------------
# Upstream's fixture texts


def test_fixture_texts_encode_as_upstream():
    assert len(TEXTS) == 6
    assert json.loads(str(CACT["tok/ref_ids_json"])) == SP_IDS
    for text, want in zip(TEXTS, SP_IDS, strict=True):
        assert chat.prompt_ids(TOK, text) == [BOS] + want


def test_render_example_reproduces_upstreams_rendering():
    prompt, target = chat.render_example(FIXTURE_EXAMPLE)
    assert prompt + target == TEXTS[0]  # written by upstream 3.2.8's render_example
    assert prompt == _prompt_by_hand('[{"name":"get_weather","parameters":{"location":"string"}}]',
                                     FIXTURE_EXAMPLE["query"])
    assert target == _target_by_hand('[{"name":"get_weather","arguments":{"location":"Paris"}}]', "Weather lookup.")


# --------------------------------------------------------------------------------------------------------------------
# Rendering against ids built from the rule


PROMPT_CASES = [
    # (render_prompt kwargs, the prompt text the rule gives)
    (dict(query="Set a timer for 25 minutes.", tools=[{"name": "set_timer", "parameters": {"minutes": "int"}}]),
     _prompt_by_hand('[{"name":"set_timer","parameters":{"minutes":"int"}}]', "Set a timer for 25 minutes.")),
    # ensure_ascii=False: non-ASCII tools are raw UTF-8 (byte-fallback pieces), not \u escapes; system stripped
    (dict(query="Wetter in Zürich?", tools=[{"name": "w", "description": "météo € 東京"}], system=" Be brief.\n"),
     _prompt_by_hand('[{"name":"w","description":"météo € 東京"}]', "Wetter in Zürich?", "Be brief.")),
    (dict(query="hi", tools='[ {"name": "x"} ]'), _prompt_by_hand('[ {"name": "x"} ]', "hi")),  # string verbatim
    (dict(query="hi", tools=None, system="  "), _prompt_by_hand("[]", "hi")),  # [] tools; blank system left out
]


@pytest.mark.parametrize("kwargs, text", PROMPT_CASES)
def test_prompt_ids_follow_the_spec_rule(kwargs, text):
    assert chat.render_prompt(**kwargs) == text
    assert chat.prompt_ids(TOK, chat.render_prompt(**kwargs)) == [BOS] + SP.Encode(text)


def test_non_ascii_tools_are_raw_utf8():
    prompt = chat.render_prompt("q", tools=[{"name": "météo"}])
    assert "météo" in prompt and "\\u" not in prompt
    ids = chat.prompt_ids(TOK, prompt)
    assert ids == [BOS] + SP.Encode(_prompt_by_hand('[{"name":"météo"}]', "q"))
    assert SP.PieceToId("<0xC3>") in ids and SP.PieceToId("<0xA9>") in ids  # é as its two UTF-8 bytes


def test_think_only_with_reasoning():
    answers = [{"name": "f", "arguments": {"a": "ü"}}]
    for reasoning in (None, "", "  \n"):
        _, target = chat.render_example({"query": "q", "answers": answers, "reasoning": reasoning})
        assert target == _target_by_hand('[{"name":"f","arguments":{"a":"ü"}}]')
        assert "<think>" not in target
    _, target = chat.render_example({"query": "q", "reasoning": None})
    assert target == "<tool_call>[]</tool_call><|im_end|>"  # §8's checked value
    _, target = chat.render_example({"query": "q", "answers": answers, "reasoning": "  a, so f.\n"})
    assert target == _target_by_hand('[{"name":"f","arguments":{"a":"ü"}}]', "a, so f.")
    # function_calls is the fallback for answers; a string answer is used unchanged
    _, target = chat.render_example({"query": "q", "function_calls": [{"name": "g"}]})
    assert target == _target_by_hand('[{"name":"g"}]')
    _, target = chat.render_example({"query": "q", "answers": "[ ]", "function_calls": [1]})
    assert target == _target_by_hand("[ ]")


def test_training_ids_follow_the_spec_rule():
    ex = dict(FIXTURE_EXAMPLE, system="  Be brief.", tools=[{"name": "météo"}])
    prompt_text = _prompt_by_hand('[{"name":"météo"}]', ex["query"], system="Be brief.")
    target_text = _target_by_hand('[{"name":"get_weather","arguments":{"location":"Paris"}}]', "Weather lookup.")
    ids, mask = chat.training_ids(TOK, *chat.render_example(ex))
    assert ids == [BOS] + SP.Encode(prompt_text) + SP.Encode(target_text) + [EOS]
    assert mask == [0] * (1 + len(SP.Encode(prompt_text))) + [1] * (len(SP.Encode(target_text)) + 1)


def test_render_example_ignores_our_blocks_as_upstream_does():
    ex = dict(FIXTURE_EXAMPLE, context="c", extract="e", schema={"type": "object"})
    assert chat.render_example(ex) == chat.render_example(FIXTURE_EXAMPLE)


# --------------------------------------------------------------------------------------------------------------------
# <context>/<extract>/<schema>: our placement (module docstring), written out here


def test_blocks_sit_after_tools_in_marker_order():
    schema = {"name": "record", "parameters": {"type": "object", "properties": {"ville": {"type": "string"}}}}
    prompt = chat.render_prompt("extract it", tools=[], system="S", context="date: 2026-05-01",
                                extract="Réservé à Zürich", schema=schema)
    blocks = ("<context>date: 2026-05-01</context>\n<extract>Réservé à Zürich</extract>\n"
              '<schema>{"name":"record","parameters":{"type":"object","properties":{"ville":{"type":"string"}}}}'
              "</schema>\n")
    text = _prompt_by_hand("[]", "extract it", "S", blocks)
    assert prompt == text
    ids = chat.prompt_ids(TOK, prompt)
    assert ids == [BOS] + SP.Encode(text)
    for marker in CHAT_MARKERS[10:]:  # each new marker is one id in the prompt
        assert ids.count(SP.PieceToId(marker)) == 1


def test_absent_blocks_leave_upstreams_prompt():
    plain = chat.render_prompt("q", tools=[{"name": "a"}], system="S")
    assert chat.render_prompt("q", tools=[{"name": "a"}], system="S", context=None, extract="", schema=None) == plain
    only_schema = chat.render_prompt("q", schema='{"type": "object"}')  # a JSON string is used verbatim
    assert only_schema == _prompt_by_hand("[]", "q", blocks='<schema>{"type": "object"}</schema>\n')


def test_bad_block_values_are_refused():
    with pytest.raises(TokenizerError, match="^schema is a string but not valid JSON"):
        chat.render_prompt("q", schema="{oops")
    with pytest.raises(TokenizerError, match="context must be a string or None, got int"):
        chat.render_prompt("q", context=3)
    with pytest.raises(TokenizerError, match="query must be a string"):
        chat.render_prompt(None)


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer checks


def test_fixture_tokenizer_passes():
    assert [SP.IdToPiece(4 + i) for i in range(16)] == list(CHAT_MARKERS)
    assert (SP.pad_id(), SP.eos_id(), SP.bos_id(), SP.unk_id()) == (0, 1, 2, 3)
    assert chat.MARKER_IDS == {m: 4 + i for i, m in enumerate(CHAT_MARKERS[:10])}
    assert chat.check_tokenizer(SP, vocab_size=512) is SP


def _train(path: Path, markers, **ids) -> Path:
    """A tiny BPE SentencePiece model with `markers` as user-defined symbols (trains in well under a second)."""
    corpus = ["the quick brown fox jumps over the lazy dog", "tool call weather in paris", "set a timer"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=70,
        user_defined_symbols=list(markers), hard_vocab_limit=False, num_threads=1,
        **({"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3} | ids))
    path.write_bytes(model.getvalue())
    return path


def test_new_markers_may_sit_anywhere(tmp_path):
    reordered = CHAT_MARKERS[:10] + ("<x>",) + tuple(reversed(CHAT_MARKERS[10:]))  # the six at 15..20, reversed
    tok = chat.load_chat_tokenizer(_train(tmp_path / "moved.model", reordered))
    assert tok.piece_to_id("</schema>") == 15 and tok.piece_to_id("<context>") == 20


def test_missing_new_marker_is_refused(tmp_path):
    path = _train(tmp_path / "no-schema.model", CHAT_MARKERS[:14])
    with pytest.raises(TokenizerError) as e:
        chat.load_chat_tokenizer(path)
    assert str(e.value).startswith(f"{path}: chat marker <schema> is not one piece (it encodes as [")
    assert "\n" not in str(e.value)


def test_fixed_markers_elsewhere_and_wrong_specials_are_refused(tmp_path):
    path = _train(tmp_path / "shifted.model", ("<x>",) + CHAT_MARKERS)
    with pytest.raises(TokenizerError, match=r"chat marker <\|im_start\|> is at id 5, but upstream hard-codes it at "
                                             r"id 4, where it has '<x>'; Needle 3 needs the markers at ids 4-13"):
        chat.load_chat_tokenizer(path)
    defaults = _train(tmp_path / "defaults.model", CHAT_MARKERS, pad_id=-1, unk_id=0, bos_id=1, eos_id=2)
    with pytest.raises(TokenizerError, match="its pad id is -1, but Needle 3 hard-codes pad=0"):
        chat.load_chat_tokenizer(defaults)


def test_tokenizer_larger_than_vocab_is_refused():
    with pytest.raises(TokenizerError, match="has 512 pieces but the model's vocabulary holds 300"):
        chat.load_chat_tokenizer(SPM_PATH, vocab_size=300)


# --------------------------------------------------------------------------------------------------------------------
# Decoding and streaming


def test_decode_stops_at_eos_and_keeps_markers():
    ids = SP.Encode("Set a timer.")
    assert chat.decode(TOK, [BOS] + ids + [0]) == "Set a timer."
    assert chat.decode(TOK, ids + [EOS] + SP.Encode(" junk")) == "Set a timer."
    assert chat.decode(TOK, [10, 11, 14, 15, 5]) == "<tool_call></tool_call><context></context><|im_end|>"


@pytest.mark.parametrize("index", range(6))
def test_text_stream_rebuilds_every_fixture_text(index):
    stream = chat.TextStream(TOK)
    chunks = [stream.feed(i) for i in SP_IDS[index] + [EOS]] + [stream.finish()]
    assert "".join(chunks) == stream.text == TEXTS[index] and stream.done
    assert not any("\ufffd" in c for c in chunks)


# --------------------------------------------------------------------------------------------------------------------
# Tool-call extraction


def test_extract_two_calls_in_order_from_generated_ids():
    answers = [{"name": "book", "arguments": {"city": "Zürich", "note": "東京 €"}},
               {"name": "notify", "arguments": {"to": "me"}}]
    prompt, target = chat.render_example(dict(FIXTURE_EXAMPLE, answers=answers))
    ids, mask = chat.training_ids(TOK, prompt, target)
    generated = [i for i, m in zip(ids, mask, strict=True) if m]  # the target ids, then EOS
    text = chat.decode(TOK, generated + SP.Encode("after eos"))
    assert text == target and "Zürich" in text
    result = chat.extract_tool_call(text)
    assert result.ok and result.think == "Weather lookup."  # the rule's newlines are not part of the thought
    assert result.calls == (chat.Call("book", {"city": "Zürich", "note": "東京 €"}), chat.Call("notify", {"to": "me"}))


def test_extract_no_tool_is_an_empty_list():
    _, target = chat.render_example({"query": "write a poem", "answers": []})
    result = chat.extract_tool_call(target)
    assert result.ok and result.calls == () and result.think is None and result.body == "[]"


MALFORMED = [
    ("just text", "no <tool_call> tag in the output"),
    ('<tool_call>[{"name":"a","arguments":{}}]', "the <tool_call> block is not closed by </tool_call>"),
    ("<tool_call>[{name: a}]</tool_call>", "the <tool_call> block is not valid JSON (Expecting property name"),
    ("<tool_call>null</tool_call>", "the <tool_call> block is a JSON null, not a list of calls or a call object"),
    ('<tool_call>[{"name":"a"},{"arguments":{}}]</tool_call>', "call 2 has no name"),
    ('<tool_call>[{"name":"a","arguments":[1]}]</tool_call>',
     "call 1 (a) has arguments that are a JSON list, not an object"),
    ("<think>\nstill thinking", "the <think> part is not closed by </think>"),
]


@pytest.mark.parametrize("text, reason", MALFORMED)
def test_extract_reports_malformed_output(text, reason):
    result = chat.extract_tool_call(text)  # reported, never raised
    assert isinstance(result, chat.ToolCallError) and not result.ok and result.calls == ()
    assert result.reason.startswith(reason), result.reason
    assert "\n" not in result.reason
