"""`needle-twin generate` and `needle-twin embed` on Needle 3 checkpoints: upstream's greedy tokens, confidence,
router values and sentence vectors through the CLI, `.cact` inputs, rungs, and the one-line refusals.

Goldens from upstream's code (tools/upstream_goldens.py): tests/data/v3/needle-v3-tiny.npz (`prompt`,
`f32/greedy_tokens`) and needle-v3-tiny.text.npz (forward_embedding / forward_confidence / forward_router on
six texts and the rendered prompt of TEXT_EXAMPLE).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from parity_tests.fixtures import V2_PKL

DATA = Path(__file__).resolve().parents[1] / "data" / "v3"
CKPT, CACT, SPM = DATA / "needle-v3-tiny.safetensors", DATA / "needle-v3-tiny.cact", DATA / "needle-v3-tiny.spm.model"
GREEDY = np.load(DATA / "needle-v3-tiny.npz")
TEXT = np.load(DATA / "needle-v3-tiny.text.npz")
TEXTS = json.loads(str(TEXT["texts_json"]))
# The prompt half of upstream's F.render_example(TEXT_EXAMPLE) (tools/upstream_goldens.py), TEXTS[-1]
QUERY, TOOLS = "What's the weather in Paris?", '[{"name":"get_weather","parameters":{"city":{"type":"string"}}}]'
EMBED_ABS = 1e-5  # the acceptance bound for unit vectors in float32 (--json prints float32 values exactly)
PRINTED_REL = 1e-5  # confidence and router are printed to 6 significant digits (≤ 5e-6 relative) + float32 noise


def _run(*args: str):
    return CliRunner().invoke(app, [*args])


def _lines(stdout: str) -> dict[str, str]:
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in stdout.splitlines() if ":" in line}


@pytest.mark.parametrize("backend", ["torch", pytest.param("flax", marks=pytest.mark.slow)])
def test_generate_gives_upstreams_greedy_tokens(backend):
    prompt = " ".join(map(str, GREEDY["prompt"][0].tolist()))
    golden = GREEDY["f32/greedy_tokens"][0].tolist()
    result = _run("generate", str(CKPT), "--tokens", prompt, "--dtype", "float32", "--backend", backend,
                  "--max-new-tokens", str(len(golden)))
    assert result.exit_code == 0, result.output
    assert [int(t) for t in _lines(result.stdout)["ids"].split()] == golden


def test_generate_reports_upstreams_confidence_and_router_for_the_prompt():
    result = _run("generate", str(CKPT), "--query", QUERY, "--tools", TOOLS, "--tokenizer", str(SPM),
                  "--dtype", "float32", "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    lines = _lines(result.stdout)
    assert abs(float(lines["confidence"]) - TEXT["f32/confidence"][-1]) <= PRINTED_REL * abs(TEXT["f32/confidence"][-1])
    router = dict(part.rsplit(" ", 1) for part in lines["router"].split(", "))
    assert list(router) == ["router_head[0]", "router_head[1]", "router_head[2]"]
    ref = TEXT["f32/router"][-1]
    assert np.abs(np.array([float(v) for v in router.values()]) - ref).max() <= PRINTED_REL * np.abs(ref).max()


def test_embed_json_is_upstreams_forward_embedding():
    result = _run("embed", str(CKPT), *TEXTS[:3], "--tokenizer", str(SPM), "--dtype", "float32", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    vectors = np.asarray(out["vectors"])
    assert out["texts"] == TEXTS[:3] and out["dim"] == 128
    assert np.abs(vectors - TEXT["f32/embedding"][:3]).max() <= EMBED_ABS
    ref = TEXT["f32/embedding"][:3].astype(np.float64)
    assert np.abs(np.asarray(out["similarities"]) - ref @ ref.T).max() <= 1e-5  # unit vectors to float32 rounding


def test_embed_prints_a_similarity_table():
    result = _run("embed", str(CKPT), "a cat", "a dog", "--tokenizer", str(SPM))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("2 vectors of 128 (torch, ") and "cosine similarities:" in lines
    row0 = lines[lines.index("cosine similarities:") + 2].split()
    assert row0[0] == "[0]" and float(row0[1]) == pytest.approx(1.0, abs=1e-4)


def test_a_cact_decodes_with_its_deploy_numerics_and_a_rung_runs():
    result = _run("generate", str(CACT), "--tokens", "2 40 50 60", "--max-new-tokens", "4", "--layers", "3")
    assert result.exit_code == 0, result.output
    assert len(_lines(result.stdout)["ids"].split()) == 4 and "confidence" in _lines(result.stdout)
    assert "deploy numerics of the .cact, rung 3" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", str(CKPT), "--tokens", "2 40", "--context", "x"], "--context is rendered into a --query prompt"),
    (["generate", str(CKPT), "--tokens", "2 40", "--layers", "6"], "not a ladder rung"),
    (["generate", str(CKPT), "--tokens", "2 40", "--backend", "jax"], "--backend 'jax' is unknown"),
    (["generate", str(CKPT), "--tokens", "2 40", "--seed", "3"], "--seed draws samples"),
    (["generate", str(CKPT), "--tokens", "2 4000"], "outside the model's vocabulary"),
    (["generate", str(CKPT), "--query", "q", "--tokenizer", str(SPM), "--schema", "{x"], "--schema is not valid JSON"),
    (["embed", str(V2_PKL), "x", "--tokenizer", str(SPM)], "has no embedding head; `needle-twin embed` runs Needle 3"),
    (["embed", str(CKPT), "x", "--tokenizer", str(SPM), "--dtype", "f8"], "--dtype 'f8' is unknown"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
