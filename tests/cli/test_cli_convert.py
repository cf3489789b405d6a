"""`needle-twin convert / inspect / diff` through typer's CliRunner and as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

import cli
from convert.mapping import flax_to_torch_numpy, random_flax_params
from convert.trees import flatten_tree, unflatten_tree
from parity_tests.fixtures import FIXTURE_PKL
from tests.convert_helpers import (
    REPO,
    TINY,
    assert_trees_bit_identical,
    leftovers,
    read_pickle,
    run_cli,
    tiny_config_json,
    tiny_pickle,
    write_upstream_pickle,
)

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(cli.app, [str(a) for a in args])


def test_convert_both_ways_in_process(tmp_path):
    st, back = tmp_path / "m.safetensors", tmp_path / "back.pkl"
    result = invoke("convert", FIXTURE_PKL, st)
    assert result.exit_code == 0, result.stderr
    assert "wrote" in result.stdout and "upstream-pickle" in result.stdout and "float16" in result.stdout
    assert invoke("convert", st, back, "--quiet").stdout == ""
    original, again = read_pickle(FIXTURE_PKL), read_pickle(back)
    assert_trees_bit_identical(again["params"], original["params"])
    assert again["config"] == original["config"]


def test_convert_as_subprocess(tmp_path):
    st = tmp_path / "m.safetensors"
    result = run_cli("convert", FIXTURE_PKL, st)
    assert result.returncode == 0, result.stderr
    assert st.is_file() and result.stderr == ""
    again = run_cli("convert", FIXTURE_PKL, st)  # exists, no --force
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "already exists; pass --force" in again.stderr
    assert run_cli("convert", FIXTURE_PKL, st, "--force", "--dtype", "bfloat16").returncode == 0


def test_hostile_pickle_as_subprocess(tmp_path):
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(b"\x80\x02cposix\nsystem\n(X" + f"touch {marker}".encode().__len__().to_bytes(4, "little")
                     + f"touch {marker}".encode() + b"tR.")
    result = run_cli("convert", evil, tmp_path / "out.safetensors")
    assert result.returncode == 2
    assert "forbidden global posix.system" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_to_flax_directory_writes_orbax_and_diff_sees_no_change(tmp_path):
    result = invoke("convert", FIXTURE_PKL, tmp_path / "ck", "--to", "flax")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "ck" / "_CHECKPOINT_METADATA").is_file() and (tmp_path / "ck" / "config.json").is_file()
    diff = invoke("diff", FIXTURE_PKL, tmp_path / "ck")
    assert diff.exit_code == 0, diff.stdout + diff.stderr
    assert "checkpoints are identical" in diff.stdout


def test_directory_defaults_to_hf_layout_and_shards(tmp_path):
    result = invoke("convert", FIXTURE_PKL, tmp_path / "hf", "--max-shard-size", "50KB")
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert sum(n.startswith("model-") for n in names) >= 3  # ~220 KB of weights over 50 KB shards
    assert invoke("diff", tmp_path / "hf", FIXTURE_PKL).exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["--to", "flax"], "checkpoints are pickles, not safetensors"),
    (["--max-shard-size", "1GB"], "--max-shard-size applies to a directory output"),
    (["--dtype", "float64"], "unknown dtype 'float64'"),
    (["--to", "jax"], "--to 'jax' is unknown"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    result = invoke("convert", FIXTURE_PKL, tmp_path / "m.safetensors", *args)
    assert result.exit_code == 2 and message in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "m.safetensors").exists()


def test_bad_max_shard_size(tmp_path):
    result = invoke("convert", FIXTURE_PKL, tmp_path / "hf", "--max-shard-size", "lots")
    assert result.exit_code == 2 and "cannot read the size 'lots'" in result.stderr
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_config_option_for_a_bare_state_dict(tmp_path):
    import torch

    from convert.mapping import flax_to_torch

    params = random_flax_params(TINY, dtype="bfloat16")
    torch.save(flax_to_torch(params, TINY), tmp_path / "ft.pt")
    (tmp_path / "cfg").mkdir()
    tiny_config_json(tmp_path / "cfg" / "tiny.json")
    assert invoke("convert", tmp_path / "ft.pt", tmp_path / "x.pkl").exit_code == 2  # no config anywhere
    result = invoke("convert", tmp_path / "ft.pt", tmp_path / "x.pkl", "--config", tmp_path / "cfg" / "tiny.json")
    assert result.exit_code == 0, result.stderr
    assert_trees_bit_identical(read_pickle(tmp_path / "x.pkl")["params"], params)


def test_inspect_json_lists_everything(tmp_path):
    invoke("convert", FIXTURE_PKL, tmp_path / "m.safetensors")
    result = invoke("inspect", tmp_path / "m.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    original = read_pickle(FIXTURE_PKL)
    assert info["format"] == "safetensors" and info["layout"] == "torch" and info["check"] == "ok"
    assert info["config"]["d_model"] == original["config"]["d_model"] == 64
    flat = flatten_tree(original["params"])
    assert info["num_parameters"] == sum(a.size for a in flat.values())
    assert info["num_bytes"] == sum(a.nbytes for a in flat.values())
    assert info["dtypes"] == {"float16": info["num_tensors"]}
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["encoder.layers.1.self_attn.q_proj.weight"] == {
        "name": "encoder.layers.1.self_attn.q_proj.weight", "shape": [64, 64], "dtype": "float16", "layer": 1}
    assert info["metadata"]["source_format"] == "upstream-pickle"


def test_inspect_text_and_a_broken_checkpoint(tmp_path):
    result = invoke("inspect", FIXTURE_PKL)
    assert result.exit_code == 0
    assert "format:     upstream-pickle (flax layout)" in result.stdout
    assert "encoder/layers/EncoderBlock_0/self_attn/k_proj/kernel" in result.stdout
    params = random_flax_params(TINY, dtype="float16")
    del params["log_temp"]
    src = write_upstream_pickle(tmp_path / "broken.pkl", params, TINY.to_dict(only_non_default=True))
    info = json.loads(invoke("inspect", src, "--json").stdout)  # inspect still shows what is there
    assert "missing 1: log_temp" in info["check"]


def test_inspect_names_the_config_it_used_and_what_its_check_covers(tmp_path):
    from safetensors.numpy import save_file

    save_file({k: v.copy() for k, v in flax_to_torch_numpy(
        random_flax_params(TINY, dtype="float16"), TINY).items()}, tmp_path / "bare.safetensors")  # no metadata
    cfg = tiny_config_json(tmp_path / "cfg.json")
    result = invoke("inspect", tmp_path / "bare.safetensors", "--config", cfg)
    assert result.exit_code == 0, result.output
    assert f"from {cfg}" in result.stdout
    assert "check:      ok (names, shapes and dtypes against the config; convert and diff read the values)" \
        in result.stdout


def test_diff_reports_key_and_value_differences(tmp_path):
    params = random_flax_params(TINY, seed=0, dtype="float32")
    a = write_upstream_pickle(tmp_path / "a.pkl", params, TINY.to_dict(only_non_default=True))
    changed = {k: v.copy() for k, v in flatten_tree(params).items()}
    kernel = "decoder/layers/DecoderBlock_0/self_attn/v_proj/kernel"
    changed[kernel][1, 2, 3] += 0.25
    changed[kernel][0, 0, 0] -= 0.5
    b = write_upstream_pickle(tmp_path / "b.pkl", unflatten_tree(changed), TINY.to_dict(only_non_default=True))
    invoke("convert", b, tmp_path / "b.safetensors")
    result = invoke("diff", a, tmp_path / "b.safetensors", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["identical"] is False and report["only_in_a"] == [] and report["config"] == {}
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows[kernel]["status"] == "values" and rows[kernel]["num_different"] == 2
    expected = float(np.max(np.abs(flatten_tree(params)[kernel].astype(np.float64) - changed[kernel])))
    assert rows[kernel]["max_abs"] == expected
    assert all(t["status"] == "identical" for n, t in rows.items() if n != kernel)
    text = invoke("diff", a, tmp_path / "b.safetensors")
    assert text.exit_code == 1 and kernel in text.stdout and "checkpoints differ" in text.stdout


def test_diff_reports_config_and_missing_keys(tmp_path):
    a = tiny_pickle(tmp_path / "a.pkl")
    ffn = TINY.replace(no_feedforward=False, d_ff=16)
    b = write_upstream_pickle(tmp_path / "b.pkl", random_flax_params(ffn, dtype="float16"),
                              ffn.to_dict(only_non_default=True))
    report = json.loads(invoke("diff", a, b, "--json").stdout)
    assert report["config"]["no_feedforward"] == {"a": True, "b": False}
    assert "encoder/layers/EncoderBlock_0/FeedForward_0/up_proj/kernel" in report["only_in_b"]


def test_diff_lists_missing_and_unknown_tensors_instead_of_refusing(tmp_path):
    """A tensor missing from one side (a torch file) or unknown to the config (a pickle) is a key-level
    difference; the tensors both sides have are still compared."""
    from safetensors.numpy import load_file, save_file

    params = random_flax_params(TINY, seed=2, dtype="float16")
    a = write_upstream_pickle(tmp_path / "a.pkl", params, TINY.to_dict(only_non_default=True))
    extra = {**params, "probe_head": {"kernel": np.ones((2, 3), np.float16)}}
    b = write_upstream_pickle(tmp_path / "b.pkl", extra, TINY.to_dict(only_non_default=True))
    invoke("convert", a, tmp_path / "full.safetensors")
    tensors = load_file(tmp_path / "full.safetensors")
    gone = "decoder.layers.0.cross_attn.k_proj.weight"
    del tensors[gone]
    save_file(tensors, tmp_path / "partial.safetensors")
    cfg = tiny_config_json(tmp_path / "cfg.json")
    result = invoke("diff", b, tmp_path / "partial.safetensors", "--config-b", cfg, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    # layer 0 of the stacked kernel is gone from b: that stack is compared layer by layer (TINY: 2 decoder layers)
    assert report["only_in_a"] == ["decoder/layers/DecoderBlock_0/cross_attn/k_proj/kernel[0]", "probe_head/kernel"]
    assert report["only_in_b"] == []
    assert len(report["tensors"]) == len(flatten_tree(params)) - 1 + 1  # the stack's row became its layer 1's
    assert all(t["status"] == "identical" for t in report["tensors"])
    text = invoke("diff", b, tmp_path / "partial.safetensors", "--config-b", cfg)
    assert text.exit_code == 1 and "probe_head/kernel" in text.stdout


def test_diff_compares_the_layers_present_when_a_torch_file_lacks_some(tmp_path):
    """Both sides lack layer 1 of a stacked norm and differ in layer 0: the diff says so layer by layer (not
    'identical'); against the complete file the missing layer is a key only one side has."""
    from safetensors.numpy import load_file, save_file

    invoke("convert", tiny_pickle(tmp_path / "a.pkl"), tmp_path / "full.safetensors")
    full = load_file(tmp_path / "full.safetensors")
    norm = "decoder/layers/DecoderBlock_0/ZCRMSNorm_0/scale"
    torch_norm = {i: f"decoder.layers.{i}.self_attn_norm.scale" for i in range(2)}
    assert set(torch_norm.values()) <= set(full)
    a = {k: v for k, v in full.items() if k != torch_norm[1]}
    b = {**a, torch_norm[0]: (a[torch_norm[0]].astype(np.float32) + 5).astype(a[torch_norm[0]].dtype)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    cfg = tiny_config_json(tmp_path / "cfg.json")
    report = json.loads(invoke("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--config-a", cfg,
                               "--config-b", cfg, "--json").stdout)
    rows = {t["name"]: t for t in report["tensors"]}
    assert report["identical"] is False and rows[f"{norm}[0]"]["status"] == "values"
    expected = np.max(np.abs(b[torch_norm[0]].astype(np.float64) - a[torch_norm[0]].astype(np.float64)))
    assert rows[f"{norm}[0]"]["max_abs"] == float(expected) and norm not in rows
    report = json.loads(invoke("diff", tmp_path / "full.safetensors", tmp_path / "a.safetensors", "--config-b", cfg,
                               "--json").stdout)
    assert report["only_in_a"] == [f"{norm}[1]"] and report["only_in_b"] == []
    assert {t["name"]: t["status"] for t in report["tensors"]}[f"{norm}[0]"] == "identical"


def test_sigterm_mid_conversion_leaves_nothing(tmp_path):
    """A real process gets SIGTERM while writing: it exits 130 and removes its temporary file."""
    src = tiny_pickle(tmp_path / "m.pkl")
    dst = tmp_path / "out.safetensors"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import convert.io as io
        real, calls = io.is_finite, [0]
        def slow(chunk):
            calls[0] += 1
            if calls[0] == 10:  # part of the output is on disk by now
                os.kill(os.getpid(), signal.SIGTERM)
            return real(chunk)
        io.is_finite = slow
        sys.argv = ["needle-twin", "convert", {str(src)!r}, {str(dst)!r}]
        import cli
        cli.main()
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr  # default SIGTERM handling would give -15 and leave the temp
    assert "interrupted; nothing was written" in result.stderr
    assert not dst.exists() and leftovers(tmp_path) == []
    assert os.listdir(tmp_path) == ["m.pkl"]
