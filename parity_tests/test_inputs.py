"""Parity inputs: random batches, token files, and their errors."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from convert.v1.config import EOS_ID, TransformerConfig
from parity_tests.inputs import InputError, varied_lengths
from parity_tests.v1.inputs import load_token_file, random_batch

CFG = TransformerConfig(vocab_size=100, d_model=32, num_heads=4, num_kv_heads=2)


def _lengths(tokens, pad=0):
    return (tokens != pad).sum(axis=1).tolist()


def test_random_batch_shapes_and_padding():
    b = random_batch(CFG, batch=5, src_len=20, tgt_len=9, seed=3)
    assert b.src.shape == (5, 20) and b.tgt.shape == (5, 9)
    assert b.src.dtype == np.int32 and b.tgt.dtype == np.int32
    src_len = _lengths(b.src)
    assert src_len[0] == 20 and len(set(src_len)) > 1  # row 0 full, the others varied
    for row, n in zip(b.src, src_len, strict=True):
        assert np.all(row[:n] >= 6) and np.all(row[n:] == 0)  # no special ids inside, right padding only
    assert np.all(b.tgt[:, 0] == EOS_ID)
    for row, n in zip(b.tgt, _lengths(b.tgt), strict=True):
        assert np.all(row[1:n] >= 6) and np.all(row[n:] == 0)


def test_random_batch_is_seeded():
    a, b, c = (random_batch(CFG, 3, 16, 8, seed=s) for s in (1, 1, 2))
    assert np.array_equal(a.src, b.src) and np.array_equal(a.tgt, b.tgt)
    assert not np.array_equal(a.src, c.src)


def test_empty_rows_are_fully_padded():
    b = random_batch(CFG, 4, 16, 8, seed=0, empty_rows=1)
    assert _lengths(b.src)[-1] == 0 and _lengths(b.tgt)[-1] == 0
    assert min(_lengths(b.src)[:-1]) >= 1


def test_varied_lengths_rejects_all_empty():
    with pytest.raises(InputError, match="at least one non-empty row"):
        varied_lengths(np.random.default_rng(0), 2, 8, empty_rows=2)


def test_random_batch_rejects_bad_sizes():
    with pytest.raises(InputError, match="--src-len must be >= 1"):
        random_batch(CFG, 2, 0, 4)


def test_describe():
    b = random_batch(CFG, 3, 10, 5, seed=0)
    d = b.describe(0)
    assert d["batch"] == 3 and d["src_len"] == 10 and d["tgt_len"] == 5
    assert d["src_lengths"] == _lengths(b.src) and d["source"] == "random (seed 0)"


def test_json_rows_are_right_padded(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"src": [[7, 8, 9], [10]], "tgt": [[1, 11], [1]]}))
    b = load_token_file(path, CFG)
    assert b.src.tolist() == [[7, 8, 9], [10, 0, 0]]
    assert b.tgt.tolist() == [[1, 11], [1, 0]]


def test_json_list_means_src_and_tgt_is_drawn(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([[7, 8], [9, 10]]))
    b = load_token_file(path, CFG, tgt_len=6, seed=1)
    assert b.src.tolist() == [[7, 8], [9, 10]]
    assert b.tgt.shape == (2, 6) and np.all(b.tgt[:, 0] == EOS_ID)


def test_npy_and_npz(tmp_path, golden):
    np.save(tmp_path / "s.npy", golden["src"])
    b = load_token_file(tmp_path / "s.npy", TransformerConfig(vocab_size=512, d_model=64), tgt_len=4)
    assert np.array_equal(b.src, golden["src"])
    np.savez(tmp_path / "st.npz", src=golden["src"], tgt=golden["tgt"])
    b = load_token_file(tmp_path / "st.npz", TransformerConfig(vocab_size=512, d_model=64))
    assert np.array_equal(b.src, golden["src"]) and np.array_equal(b.tgt, golden["tgt"])


@pytest.mark.parametrize("content, match", [
    ({"src": [[7, 500]]}, r"src\[0, 1\] = 500 is outside the vocabulary \[0, 100\)"),
    ({"src": [[7, -1]]}, r"src\[0, 1\] = -1 is outside"),
    ({"src": [[7, 1.5]]}, "non-integer"),
    ({"src": []}, "non-empty list"),
    ({"src": [[]]}, "only empty rows"),
    ({"tokens": [[7]]}, "needs a 'src' key"),
    ({"src": [[7]], "tgt": [[1], [1]]}, "src has 1 rows but tgt has 2"),
])
def test_bad_json(tmp_path, content, match):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InputError, match=match):
        load_token_file(path, CFG)


def test_bad_files(tmp_path):
    with pytest.raises(InputError, match="no such token file"):
        load_token_file(tmp_path / "missing.json", CFG)
    (tmp_path / "t.txt").write_text("1 2 3")
    with pytest.raises(InputError, match="unknown token file type"):
        load_token_file(tmp_path / "t.txt", CFG)
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read token ids"):
        load_token_file(tmp_path / "t.json", CFG)
    np.save(tmp_path / "f.npy", np.ones((2, 3), np.float32))
    with pytest.raises(InputError, match="must be integers"):
        load_token_file(tmp_path / "f.npy", CFG)
    np.save(tmp_path / "r.npy", np.ones((2, 3, 4), np.int32))
    with pytest.raises(InputError, match="2-D"):
        load_token_file(tmp_path / "r.npy", CFG)


@pytest.mark.parametrize("family", ["v2", "v3"])
def test_decoder_text_batch_is_the_chat_rule_right_padded(family):
    """--tokenizer/--query for Needle 2 and 3: each row is the family's prompt ids (chat tests check those against
    the rendering rule), BOS first, right-padded with PAD to the longest row."""
    chat = importlib.import_module(f"convert.{family}.chat")
    config_module = importlib.import_module(f"convert.{family}.config")
    inputs = importlib.import_module(f"parity_tests.{family}.inputs")
    spm = {"v2": "tests/data/needle-v2-tiny.spm.model", "v3": "tests/data/v3/needle-v3-tiny.spm.model"}[family]
    cfg = SimpleNamespace(vocab_size=512, pad_token_id=config_module.PAD_ID, max_seq_len=256)  # what text_batch reads
    queries = ["What is the weather in Paris?", "Set a timer"]
    batch = inputs.text_batch(spm, queries, "", cfg)
    tok = chat.load_chat_tokenizer(spm, vocab_size=cfg.vocab_size)
    rows = [chat.prompt_ids(tok, chat.render_prompt(q, None), cfg.max_seq_len) for q in queries]
    tokens = batch.tokens
    assert tokens.shape == (2, max(map(len, rows)))
    for got, want in zip(tokens, rows, strict=True):
        assert got[0] == config_module.BOS_ID and got[:len(want)].tolist() == want
        assert (got[len(want):] == cfg.pad_token_id).all()
    with pytest.raises(InputError, match="at least one --query"):
        inputs.text_batch(spm, [], "", cfg)
