"""`needle-twin generate` through typer's CliRunner and as a real subprocess; the tokenizer helpers."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from convert.errors import TokenizerError
from convert.v1.tokenizer import build_encoder_input, decode_tokens, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "tests" / "data" / "needle-v1-tiny.pkl"
FIXTURE = np.load(REPO / "tests" / "data" / "needle-v1-tiny.npz")
SPECIAL = "0 1 2 3 4 5"  # what the fixture's greedy loop never chose

# `--compile` runs must test compiled code: a fallback to eager past dynamo's recompile limit fails them.
pytestmark = pytest.mark.filterwarnings("error::needle_torch.fast.kernels.CompileFallbackWarning")


def _row(r: int) -> tuple[str, list[int]]:
    """Fixture encoder row r without its padding (a single sequence needs no mask), and its greedy tokens."""
    src = [int(t) for t in FIXTURE["src"][r] if t != 0]
    return " ".join(map(str, src)), FIXTURE["f32/greedy_tokens"][r].tolist()


def _streamed_ids(stdout: str) -> list[int]:
    return [int(t) for t in stdout.split("\n")[0].split()]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """A 512-piece BPE SentencePiece model (the fixture's vocabulary size) with Needle's special ids."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = [f"w{i}" for i in range(600)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    prefix = tmp_path_factory.mktemp("tok") / "needle"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=512, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<tool_call>", "<tools>"], minloglevel=2)
    return prefix.with_suffix(".model")


# ----------------------------------------------------------------------------- tokenizer helpers


def test_encoder_input_is_query_then_tools_marker_then_tools(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    q, t = tok.encode("w1 w2 w3", out_type=int), tok.encode('[{"name": "w4"}]', out_type=int)
    assert [tok.id_to_piece(i) for i in range(6)] == ["<pad>", "</s>", "<s>", "<unk>", "<tool_call>", "<tools>"]
    assert build_encoder_input(tok, "w1 w2 w3", '[{"name": "w4"}]') == q + [5] + t
    # upstream's truncation: the query keeps max_len - 2, the tools what is left after <tools>
    assert build_encoder_input(tok, "w1 w2 w3", '[{"name": "w4"}]', max_len=4) == q[:2] + [5] + t[:1]
    assert decode_tokens(tok, q) == "w1 w2 w3"


def test_tokenizer_errors_name_the_fix(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a readable SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


# ----------------------------------------------------------------------------- CliRunner


@pytest.mark.parametrize("backend", ["torch", "flax", "torch --compile"])
def test_generate_tokens_reproduces_upstream_greedy(backend):
    src, expected = _row(0)
    result = CliRunner().invoke(app, ["generate", str(CKPT), "--tokens", src, "--dtype", "float32", "--backend",
                                      *backend.split(), "--suppress", SPECIAL, "--max-new-tokens", "11"])
    assert result.exit_code == 0, result.output
    assert _streamed_ids(result.stdout) == expected[1:]


def test_generate_query_and_tools_streams_text_and_ids(tokenizer_path):
    import torch

    from convert.io import read_checkpoint
    from needle_torch.v1.model import SimpleAttentionNetwork

    query, tools = "w5 w17 w230", '[{"name": "w42"}]'
    result = CliRunner().invoke(app, ["generate", str(CKPT), "--query", query, "--tools", tools, "--tokenizer",
                                      str(tokenizer_path), "--suppress", SPECIAL, "--max-new-tokens", "6",
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    text, ids_line = result.stdout.splitlines()[:2]
    ids = [int(t) for t in ids_line.removeprefix("ids: ").split()]
    tok = load_tokenizer(tokenizer_path)
    assert text == decode_tokens(tok, ids[1:]) and len(ids) == 7 and ids[0] == 1
    ckpt = read_checkpoint(CKPT)
    model = SimpleAttentionNetwork.from_flax(ckpt.params, ckpt.config.replace(dtype="float32"), dtype=torch.float32)
    src = torch.tensor([build_encoder_input(tok, query, tools)])
    assert model.generate(src, None, 6, suppress_tokens=range(6))[0].tolist() == ids


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one input: --tokens IDS, or --query TEXT"),
    (["--tokens", "1 2", "--query", "hi"], "give exactly one input: --tokens IDS, or --query TEXT"),
    (["--query", "hi"], "--query needs --tokenizer"),
    (["--tokens", "1 x"], "not a list of integer token ids"),
    (["--tokens", "1 999"], "outside the model's vocabulary"),
    (["--tokens", "7 8", "--backend", "jax"], "--backend 'jax' is unknown"),
    (["--tokens", "7 8", "--dtype", "float64"], "--dtype 'float64' is unknown"),
    (["--tokens", "7 8", "--suppress", "600"], "outside the vocabulary"),
    (["--tokens", "7 8", "--backend", "flax", "--compile"], "--compile is for the torch backend"),
])
def test_generate_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(app, ["generate", str(CKPT), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


# Ids no integer dtype holds: int32 (Flax's), int64 (torch's), uint64.
HUGE_IDS = ["5 3000000000", f"5 {2**63}", f"5 {2**64}", f"5 -{2**70}"]


@pytest.mark.parametrize("backend", ["torch", "flax", "torch --compile"])
@pytest.mark.parametrize("ids", HUGE_IDS)
def test_generate_huge_ids_are_out_of_vocabulary_one_line_exit_2(ids, backend):
    result = CliRunner().invoke(app, ["generate", str(CKPT), "--tokens", ids, "--backend", *backend.split()])
    assert result.exit_code == 2, result.output
    bad = ids.split()[1]
    assert result.output.strip().splitlines() == [
        f"error: src has ids [{bad}] outside the model's vocabulary [0, 512); is the tokenizer the one this model "
        "was trained with?"]


def test_generate_bad_tools_json_and_missing_checkpoint(tokenizer_path, tmp_path):
    bad_json = CliRunner().invoke(app, ["generate", str(CKPT), "--query", "w1", "--tools", "[{", "--tokenizer",
                                        str(tokenizer_path)])
    assert bad_json.exit_code == 2 and "--tools is not valid JSON" in bad_json.output
    missing = CliRunner().invoke(app, ["generate", str(tmp_path / "nope.pkl"), "--tokens", "7 8"])
    assert missing.exit_code == 2 and "nope.pkl" in missing.output


# ----------------------------------------------------------------------------- subprocess


def test_generate_subprocess_streams_upstream_tokens():
    src, expected = _row(2)
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "generate", str(CKPT), "--tokens", src, "--dtype", "float32", "--suppress",
         SPECIAL, "--max-new-tokens", "11"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _streamed_ids(proc.stdout) == expected[1:]
    assert "11 tokens in" in proc.stderr


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_generate_subprocess_huge_id_is_one_line_exit_2(backend):
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "generate", str(CKPT), "--tokens", f"5 {2**64}", "--backend", backend],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: src has ids [{2**64}] outside the model's vocabulary "
                                                "[0, 512); is the tokenizer the one this model was trained with?"]


def test_generate_subprocess_with_tokenizer_and_flax(tokenizer_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "generate", str(CKPT), "--query", "w5 w17", "--tools", "[]", "--tokenizer",
         str(tokenizer_path), "--backend", "flax", "--max-new-tokens", "4", "--suppress", SPECIAL],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text, ids_line = proc.stdout.splitlines()[:2]
    ids = [int(t) for t in ids_line.removeprefix("ids: ").split()]
    assert len(ids) == 5 and text == decode_tokens(load_tokenizer(tokenizer_path), ids[1:])
