"""`needle-twin parity` and `needle-twin rescore`: exit codes, files, and errors, in-process and as real processes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli import app
from tests.convert_helpers import run_cli

FIXTURE = "tests/data/needle-v1-tiny.pkl"
FIXTURE_NPZ = "tests/data/needle-v1-tiny.npz"
FAST = ["--no-grads", "--generate", "0"]  # the gradient and generation checks have their own tests
PROCESS_TIMEOUT = 600  # s: a real parity process imports and compiles both twins from scratch on 2 shared cores

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, fixture_checkpoint):
    """The fixture written as an independently converted torch safetensors file."""
    from convert.io import write_checkpoint

    path = tmp_path_factory.mktemp("torch") / "good.safetensors"
    write_checkpoint(fixture_checkpoint.params, fixture_checkpoint.config, path)
    return path


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory, fixture_checkpoint):
    """The fixture as a torch file whose decoder layer 1 has two rows of self_attn.v_proj swapped."""
    from convert.io import write_checkpoint
    from convert.mapping import flax_to_torch_numpy, torch_numpy_to_flax

    state = flax_to_torch_numpy(fixture_checkpoint.params, fixture_checkpoint.config)
    w = state["decoder.layers.1.self_attn.v_proj.weight"].copy()  # (K*h, D) torch layout: rows = out features
    w[[0, 1]] = w[[1, 0]]
    state["decoder.layers.1.self_attn.v_proj.weight"] = w
    path = tmp_path_factory.mktemp("torch") / "bad.safetensors"
    write_checkpoint(torch_numpy_to_flax(state, fixture_checkpoint.config), fixture_checkpoint.config, path)
    return path


@pytest.mark.slow  # a real process: imports and compiles from scratch
def test_corrupted_layer_fails_with_exit_1_naming_the_layer(corrupted, tmp_path):
    """The acceptance run, as a real process: exit 1, first_divergence names decoder layer 1."""
    out = tmp_path / "out.json"
    r = run_cli("parity", FIXTURE, "--torch", corrupted, "--json", out, *FAST, timeout=PROCESS_TIMEOUT)
    assert r.returncode == 1, r.stderr
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["first_divergence"] == "decoder.layers.1.self_attn"
    assert all(p["passed"] for p in report["probes"][: [p["name"] for p in report["probes"]].index(
        "decoder.layers.1.self_attn")])
    assert report["model"]["torch_checkpoint"] == str(corrupted)
    assert "FIRST DIVERGENCE" in r.stdout and "PARITY FAILED" in r.stdout


def test_converted_file_passes(converted, tmp_path):
    out = tmp_path / "out.json"
    r = _invoke("parity", FIXTURE, "--torch", converted, "--json", out, "--mode", "isolated", *FAST)
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["first_divergence"] is None and report["mode"] == "isolated"
    assert report["model"]["torch_format"] == "safetensors"


def test_torch_file_without_a_config_takes_the_flax_one(tmp_path, fixture_checkpoint):
    from safetensors.numpy import save_file

    from convert.mapping import flax_to_torch_numpy

    bare = tmp_path / "bare.safetensors"  # tensors only, no metadata, no config.json beside it
    save_file(flax_to_torch_numpy(fixture_checkpoint.params, fixture_checkpoint.config), str(bare))
    r = _invoke("parity", FIXTURE, "--torch", bare, "--quiet", *FAST)
    assert r.exit_code == 0 and "PARITY HOLDS" in r.output


def test_torch_file_of_another_model_exits_2(tmp_path, fixture_checkpoint):
    from convert.io import write_checkpoint
    from convert.mapping import random_flax_params

    cfg = fixture_checkpoint.config.replace(num_decoder_layers=1)
    other = tmp_path / "other.safetensors"
    write_checkpoint(random_flax_params(cfg, 0), cfg, other)
    r = _invoke("parity", FIXTURE, "--torch", other, *FAST)
    assert r.exit_code == 2 and "different config" in r.output and "num_decoder_layers: 2 vs 1" in r.output


def test_in_memory_conversion_with_all_outputs(tmp_path):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    r = _invoke("parity", FIXTURE, "--inputs", FIXTURE_NPZ, "--json", out, "--html", page, "--generate", "2")
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["inputs"]["src_lengths"] == [16, 11, 6]  # the fixture's own inputs
    assert report["gradients"]["passed"] is True and report["generation"]["max_new_tokens"] == 2
    assert report["environment"]["precision"]["pinned"] is True
    assert "<svg" in page.read_text() and "PARITY HOLDS" in r.output


def test_bfloat16_isolated_passes(tmp_path):
    r = _invoke("parity", FIXTURE, "--dtype", "bfloat16", "--mode", "isolated", "--src-len", "12", "--tgt-len", "6",
                "--quiet", *FAST)
    assert r.exit_code == 0, r.output
    assert "PARITY HOLDS" in r.output and "bfloat16-cpu" in r.output
    assert "┏" not in r.output  # --quiet: the verdict line only


def test_tolerance_override_turns_a_pass_into_a_fail(tmp_path):
    out = tmp_path / "r.json"
    r = _invoke("parity", FIXTURE, "--rtol", "0", "--atol", "0", "--json", out, *FAST)
    assert r.exit_code == 1
    report = json.loads(out.read_text())
    assert "overridden" in report["profile"]["name"]
    assert report["first_divergence"] == next(p["name"] for p in report["probes"] if p["max_abs"] > 0)


def test_rescore(tmp_path):
    first = tmp_path / "r.json"
    assert _invoke("parity", FIXTURE, "--json", first, *FAST).exit_code == 0
    saved = json.loads(first.read_text())

    tight = tmp_path / "tight.json"
    r = run_cli("rescore", first, "--rtol", "1e-9", "--json", tight, "--html", tmp_path / "tight.html",
                timeout=PROCESS_TIMEOUT)
    assert r.returncode == 1, r.stderr
    again = json.loads(tight.read_text())
    assert again["passed"] is False and again["first_divergence"] is not None
    assert [p["rel_l2"] for p in again["probes"]] == [p["rel_l2"] for p in saved["probes"]]
    assert (tmp_path / "tight.html").is_file()

    r = _invoke("rescore", tight, "--profile", "float32-cpu")
    assert r.exit_code == 0 and "PARITY HOLDS" in r.output
    assert _invoke("rescore", first).exit_code == 0

    r = _invoke("rescore", first, "--profile", "bfloat16")
    assert r.exit_code == 2 and "computed in float32" in r.output


@pytest.mark.parametrize("args, message", [
    (["--torch", FIXTURE], "--torch needs the Flax checkpoint"),
    (["--dtype", "int8"], "--dtype 'int8' is not one of float32, bfloat16, float16"),
    (["--mode", "sideways"], "--mode 'sideways' is not one of propagated, isolated"),
    (["--jax-platform", "quantum"], "--jax-platform 'quantum' is not one of cpu, gpu, tpu"),
    (["--precision", "low"], "--precision 'low'"),
    (["--generate", "-1"], "--generate must be >= 0"),
    (["--rtol", "-1"], "--rtol must be a finite number >= 0"),
    (["--profile", "float64"], "unknown tolerance profile 'float64'"),
    ([FIXTURE, "--torch-device", "tpu"], "--torch-device 'tpu' is not one of"),
    (["missing.pkl"], "missing.pkl"),
    ([FIXTURE, "--inputs", "missing.json"], "no such token file"),
    ([FIXTURE, "--query", "hello"], "--query needs --tokenizer"),
])
def test_usage_errors_exit_2(args, message):
    r = _invoke("parity", *FAST, *args)  # args last: a repeated option takes its last value
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())


def test_unavailable_devices_exit_2():
    import jax
    import torch

    if not torch.cuda.is_available():
        r = _invoke("parity", FIXTURE, "--torch-device", "cuda", *FAST)
        assert r.exit_code == 2 and "sees no CUDA device" in r.output
    if not any(d.platform == "tpu" for d in jax.devices()):
        r = _invoke("parity", FIXTURE, "--jax-platform", "tpu", *FAST)
        assert r.exit_code == 2 and "JAX sees no tpu device" in r.output
    r = _invoke("parity", FIXTURE, "--torch-device", "cuda:99", *FAST)
    assert r.exit_code == 2 and "cuda:99" in r.output


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("keep me")
    r = _invoke("parity", FIXTURE, "--json", out, *FAST)
    assert r.exit_code == 2 and "--force" in r.output
    assert out.read_text() == "keep me"
    r = _invoke("parity", FIXTURE, "--json", out, "--force", *FAST)
    assert r.exit_code == 0 and json.loads(out.read_text())["passed"] is True


def test_same_path_for_json_and_html(tmp_path):
    r = _invoke("parity", FIXTURE, "--json", tmp_path / "x", "--html", tmp_path / "x", *FAST)
    assert r.exit_code == 2 and "same file" in r.output


def test_bad_inputs_leave_no_file(tmp_path):
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps({"src": [[7, 100000]]}))
    out = tmp_path / "r.json"
    r = _invoke("parity", FIXTURE, "--inputs", tokens, "--json", out, *FAST)
    assert r.exit_code == 2 and "outside the vocabulary" in r.output
    assert not out.exists()


def test_rescore_bad_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = run_cli("rescore", bad, timeout=PROCESS_TIMEOUT)
    assert r.returncode == 2 and "not a needle-twin parity report" in r.stderr
    assert "Traceback" not in r.stderr


def test_tokenizer_text_inputs(tmp_path):
    """Text through a SentencePiece model, in upstream's [query, <tools>, tools] layout."""
    import sentencepiece as spm  # installed with the project's test extras

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"what is the weather in city {i} today" for i in range(200)))
    prefix = tmp_path / "tok"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=40, pad_id=0, eos_id=1,
                                   bos_id=2, unk_id=3, user_defined_symbols=["<tool_call>", "<tools>"])
    out = tmp_path / "r.json"
    r = _invoke("parity", FIXTURE, "--tokenizer", f"{prefix}.model", "--query", "weather in city 3",
                "--query", "what is today", "--tools", '[{"name": "weather"}]', "--json", out, *FAST)
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["inputs"]["batch"] == 2 and report["inputs"]["source"].startswith("text via")
    from convert.v1.tokenizer import build_encoder_input, load_tokenizer

    tok = load_tokenizer(f"{prefix}.model")
    want = build_encoder_input(tok, "weather in city 3", '[{"name": "weather"}]')
    assert report["inputs"]["src_lengths"][0] == len(want) and 5 in want


@pytest.mark.slow
def test_embedded_default_runs_as_the_readme_says(tmp_path):
    """The README's main command: no checkpoint, Needle 3 at upstream's default config, seeded random weights."""
    out = tmp_path / "r.json"
    r = run_cli("parity", "--json", out, "--no-grads", timeout=PROCESS_TIMEOUT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["num_params"] == 127_849_765 and report["passed"] is True  # upstream's count with the three heads
    assert report["model"]["family"] == "v3"
    assert report["model"]["seed"] == 0 and report["environment"]["seeds"] == {"inputs": 0, "model": 0}


@pytest.mark.slow
def test_embedded_v2_default_runs_with_family_v2(tmp_path):
    """--family v2: the seeded random published-size Needle 2 (with both heads), generation compared too."""
    out = tmp_path / "r.json"
    r = run_cli("parity", "--family", "v2", "--json", out, "--no-grads", "--generate", "2", timeout=PROCESS_TIMEOUT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["num_params"] == 45_211_383 and report["passed"] is True  # the published count with both heads
    assert report["model"]["family"] == "v2"
    assert report["generation"]["steps_compared"] == 2


def test_embedded_v1_default_runs_with_family_v1(tmp_path):
    """--family v1: Needle v1's published-size embedded model, as before Needle 2 became the default."""
    out = tmp_path / "r.json"
    r = run_cli("parity", "--family", "v1", "--json", out, "--no-grads", "--generate", "2", timeout=PROCESS_TIMEOUT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["num_params"] == 26_315_421 and report["passed"] is True
    assert report["model"]["family"] == "v1"
    assert len(report["probes"]) == 1 + 12 * 3 + 1 + 1 + 8 * 3 + 1 + 2
    assert report["generation"]["steps_compared"] == 2  # special ids suppressed: no stop at EOS


def test_help_lists_the_options():
    r = _invoke("parity", "--help")
    for opt in ("--torch", "--dtype", "--mode", "--batch", "--src-len", "--tgt-len", "--seed", "--json", "--html",
                "--torch-device", "--jax-platform", "--rtol", "--grads"):
        assert opt in r.output
