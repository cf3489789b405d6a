"""`needle-twin generate` on Needle 2 checkpoints: upstream's greedy tokens through the CLI, chat prompts, windows with
sinks, sampling, and the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sentencepiece as spm
from typer.testing import CliRunner

from cli import app
from parity_tests.fixtures import FIXTURE_PKL, V2_NPZ, V2_PKL, V2_SPM

FIXTURE = np.load(V2_NPZ)
PROMPT = " ".join(map(str, FIXTURE["dec_prompt"][0].tolist()))  # BOS included
G = FIXTURE["f32/dec_tokens"].shape[1]

pytestmark = pytest.mark.filterwarnings("error::needle_torch.fast.kernels.CompileFallbackWarning")


def _generate(*args: str):
    return CliRunner().invoke(app, ["generate", str(V2_PKL), *args])


def _streamed(stdout: str) -> list[int]:
    return [int(t) for t in stdout.splitlines()[0].split()]


@pytest.mark.parametrize("backend", ["torch", "flax"])
@pytest.mark.parametrize("window, golden", [(0, "f32/dec_tokens"), (6, "f32/decw_tokens")])
def test_tokens_reproduce_upstream_generate_cached(backend, window, golden):
    # upstream's D.generate_cached(..., kv_window=window) in float32 (it casts the params), greedy, G new tokens
    result = _generate("--tokens", PROMPT, "--dtype", "float32", "--backend", backend, "--max-new-tokens", str(G),
                       "--kv-window", str(window))
    assert result.exit_code == 0, result.output
    assert _streamed(result.stdout) == FIXTURE[golden][0].tolist()


def test_compiled_torch_step_reproduces_upstream():
    result = _generate("--tokens", PROMPT, "--dtype", "float32", "--compile", "--max-new-tokens", str(G))
    assert result.exit_code == 0, result.output
    assert _streamed(result.stdout) == FIXTURE["f32/dec_tokens"][0].tolist()


def test_query_renders_upstreams_chat_prompt_and_decodes_text():
    # The expected prompt is built here from the spec's rendering rule (NEEDLE_V2.md §8), not by our chat module:
    # [BOS] + sp.Encode(system turn + user turn with compact tools + assistant cue).
    tools = [{"name": "get_weather", "parameters": {"city": "string"}}]
    query, system = "weather in Paris", "be brief"
    rendered = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n<tools>"
                '[{"name":"get_weather","parameters":{"city":"string"}}]</tools>\nweather in Paris<|im_end|>\n'
                "<|im_start|>assistant\n")
    sp = spm.SentencePieceProcessor(model_file=str(V2_SPM))
    expected_prompt = [2] + sp.encode(rendered)
    result = _generate("--query", query, "--tools", json.dumps(tools, indent=2), "--system", system, "--tokenizer",
                       str(V2_SPM), "--max-new-tokens", "6", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    ids = [int(t) for t in lines[1].removeprefix("ids: ").split()]
    assert len(ids) == 6 and lines[0] == sp.decode([i for i in ids if i != 1])
    assert f"{len(expected_prompt)} prompt tokens" in result.stderr
    # the same ids as the prompt decoded directly by --tokens (so the rendered prompt is the one above)
    direct = _generate("--tokens", " ".join(map(str, expected_prompt)), "--max-new-tokens", "6", "--dtype",
                       "float32")
    assert direct.exit_code == 0, direct.output
    assert _streamed(direct.stdout) == ids
    # the random fixture model writes no tool call: said on stderr, not raised
    assert "no tool call: no <tool_call> tag in the output" in result.stderr


def test_tools_file_is_rendered_as_the_inline_json(tmp_path):
    tools = [{"name": "t", "parameters": {}}]
    args = ("--query", "hi", "--tokenizer", str(V2_SPM), "--max-new-tokens", "3", "--dtype", "float32")
    inline = _generate(*args, "--tools", json.dumps(tools))
    (tmp_path / "tools.json").write_text(json.dumps(tools, indent=4))
    from_file = _generate(*args, "--tools", str(tmp_path / "tools.json"))
    assert inline.exit_code == from_file.exit_code == 0, (inline.output, from_file.output)
    assert inline.stdout == from_file.stdout and "prompt tokens" in inline.stderr


def test_sink_tools_pins_the_prompt_up_to_tools_end():
    sp = spm.SentencePieceProcessor(model_file=str(V2_SPM))
    rendered = "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt = [2] + sp.encode(rendered)
    pinned = prompt.index(9) + 1  # </tools> is id 9 (upstream's fixed marker ids), pinned with everything before it
    result = _generate("--query", "hi", "--tokenizer", str(V2_SPM), "--kv-window", "4", "--sink-tools",
                       "--max-new-tokens", "4", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert f"kv_window 4 with {pinned} sinks" in result.stderr


def test_sampling_is_reproducible_by_seed_and_differs_across_seeds():
    def run(seed: int) -> list[int]:
        result = _generate("--tokens", PROMPT, "--temperature", "1.5", "--seed", str(seed), "--max-new-tokens", "10",
                           "--dtype", "float32")
        assert result.exit_code == 0, result.output
        return _streamed(result.stdout)

    first = run(1)
    assert run(1) == first
    # 10 draws at T=1.5 from a 512-way distribution: three seeds giving the same sequence would mean the seed is
    # not used (deterministic given the seeds, so this cannot flake)
    assert len({tuple(first), tuple(run(2)), tuple(run(3))}) > 1


@pytest.mark.parametrize("args, message", [
    (["--tokens", PROMPT, "--suppress", "3"], "--suppress does not apply to Needle 2"),
    (["--tokens", PROMPT, "--max-enc-len", "4"], "--max-enc-len does not apply to Needle 2"),
    (["--tokens", PROMPT, "--tools", "[]"], "--tools and --system are rendered into a --query prompt"),
    (["--tokens", PROMPT, "--sink-tools"], "--sink-tools pins positions that --kv-window would hide"),
    (["--tokens", PROMPT, "--kv-window", "3", "--sink-tools"], "the prompt has no </tools>"),
    (["--tokens", PROMPT, "--seed", "3"], "--temperature is 0"),
    (["--tokens", PROMPT, "--backend", "flax", "--compile"], "--compile is for the torch backend"),
    (["--tokens", "2 999"], "outside the model's vocabulary"),
    (["--tokens", " ".join(["2"] * 64)], "no room for a new token"),
    (["--query", "hi", "--tokenizer", str(V2_SPM), "--tools", "[{"], "not valid JSON"),
    (["--query", "hi", "--tokenizer", str(V2_SPM), "--tools", "missing.json"], "cannot read the tools file"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = _generate(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_needle2_options_are_refused_for_v1():
    result = CliRunner().invoke(app, ["generate", str(FIXTURE_PKL), "--tokens", "5 6", "--kv-window", "4"])
    assert result.exit_code == 2 and "--kv-window does not apply to Needle v1" in result.output, result.output
