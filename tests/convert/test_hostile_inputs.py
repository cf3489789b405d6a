"""Hostile and broken inputs through `needle-twin convert`: exit 2, one line naming the problem, nothing written."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import cli
from convert import io
from convert.mapping import flax_to_torch_numpy, random_flax_params
from tests.convert_helpers import (
    TINY,
    RunsCommand,
    assert_refused,
    leftovers,
    read_pickle,
    tiny_pickle,
    write_upstream_pickle,
)

runner = CliRunner()


def _truncate(path: Path, size: int) -> Path:
    with open(path, "r+b") as f:
        f.truncate(size)
    return path


def _safetensors(tmp_path: Path, name: str = "m.safetensors", dtype: str = "float16") -> Path:
    io.write_checkpoint(random_flax_params(TINY, dtype=dtype), TINY, tmp_path / name)
    return tmp_path / name


def _raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


# ----------------------------------------------------------------------------- code execution


def test_malicious_pickle_does_not_run(tmp_path):
    marker = tmp_path / "marker"
    params = random_flax_params(TINY, dtype="float16")
    params["log_temp"] = RunsCommand(marker)
    src = write_upstream_pickle(tmp_path / "evil.pkl", params, TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"forbidden global (posix|nt|os)\.system")
    assert not marker.exists()


def test_malicious_pickle_disguised_as_safetensors(tmp_path):
    marker = tmp_path / "marker"
    src = tmp_path / "innocent.safetensors"
    src.write_bytes(pickle.dumps({"params": {"x": RunsCommand(marker)}, "config": {}}))
    assert_refused(tmp_path, src, r"forbidden global", "out.pkl")
    assert not marker.exists()


# ----------------------------------------------------------------------------- empty and truncated files


def _make(tmp_path: Path, fmt: str) -> Path:
    """A valid checkpoint of each file format."""
    if fmt == "pkl":
        return tiny_pickle(tmp_path / "m.pkl")
    if fmt == "safetensors":
        return _safetensors(tmp_path)
    if fmt == "msgpack":
        io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "m.msgpack")
        return tmp_path / "m.msgpack"
    if fmt == "pt":
        import torch

        from convert.mapping import flax_to_torch

        torch.save({"state_dict": flax_to_torch(random_flax_params(TINY), TINY), "config": TINY.to_dict()},
                   tmp_path / "m.pt")
        return tmp_path / "m.pt"
    raise AssertionError(fmt)


FILE_FORMATS = ["pkl", "safetensors", "msgpack", "pt"]


@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_zero_byte_file(tmp_path, fmt):
    src = tmp_path / f"empty.{fmt}"
    src.write_bytes(b"")
    assert_refused(tmp_path, src, r"empty file \(0 bytes\)")


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.98])
@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_truncated_file(tmp_path, fmt, fraction):
    src = _make(tmp_path, fmt)
    _truncate(src, max(1, int(src.stat().st_size * fraction)))
    dst = "out.pkl" if fmt == "safetensors" else "out.safetensors"
    assert_refused(tmp_path, src, r"truncated|corrupt|not a valid|refused|unrecognised|empty", dst)


def test_truncated_shard_in_hf_directory(tmp_path):
    io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "hf", max_shard_size="20KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    _truncate(shard, shard.stat().st_size - 10)
    assert_refused(tmp_path, tmp_path / "hf", rf"{shard.name}: truncated safetensors file", "out.pkl")


def test_zero_byte_model_in_hf_directory(tmp_path):
    io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert_refused(tmp_path, tmp_path / "hf", r"model.safetensors: empty file", "out.pkl")


@pytest.mark.parametrize("damage", ["zero", "truncate"])
def test_damaged_orbax_directory(tmp_path, damage):
    io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "orbax", format=io.ORBAX)
    for f in (tmp_path / "orbax").rglob("*"):
        if f.is_file() and f.name != "config.json" and f.stat().st_size > 0:
            _truncate(f, 0 if damage == "zero" else f.stat().st_size // 2)
    assert_refused(tmp_path, tmp_path / "orbax", r"Orbax checkpoint", "out.safetensors")


# ----------------------------------------------------------------------------- corrupt safetensors headers


def test_oversized_safetensors_header(tmp_path):
    src = tmp_path / "huge.safetensors"
    src.write_bytes(struct.pack("<Q", 2**40) + b'{"a":1}' + b"\0" * 64)
    assert_refused(tmp_path, src, r"corrupt safetensors header: it declares 1099511627776 bytes", "out.pkl")


def test_header_longer_than_file(tmp_path):
    src = _raw_safetensors(tmp_path / "short.safetensors", b'{"a": {"dtype": "F16", "shape": [2]')
    src.write_bytes(struct.pack("<Q", 5000) + src.read_bytes()[8:])
    assert_refused(tmp_path, src, r"truncated safetensors file: the header declares 5000 bytes", "out.pkl")


@pytest.mark.parametrize("header, pattern", [
    (b"{not json at all}", r"not JSON"),
    (b'["a list"]', r"not an object"),
    (b'{"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}, '
     b'"v": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}', r"overlaps the previous tensor"),
    (b'{"w": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 4]}}', r"unknown dtype 'Q99'"),
    (b'{"w": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}', r"w spans 4 bytes but float16\[3\] needs 6"),
    (b'{"w": {"dtype": "F16", "shape": [-1], "data_offsets": [0, 4]}}', r"not a list of non-negative integers"),
    (b'{"__metadata__": {"config": 5}, "w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}',
     r"__metadata__ must map strings to strings"),
])
def test_corrupt_safetensors_header(tmp_path, header, pattern):
    src = _raw_safetensors(tmp_path / "bad.safetensors", header, b"\0" * 6)
    if b"[0, 4]}}" in header and b"[2, 6]" not in header:
        src.write_bytes(src.read_bytes()[:-2])  # data exactly 4 bytes so only the intended flaw remains
    assert_refused(tmp_path, src, pattern, "out.pkl")


# ----------------------------------------------------------------------------- strictness


def _torch_state(dtype: str = "float32") -> dict[str, np.ndarray]:
    return flax_to_torch_numpy(random_flax_params(TINY, dtype=dtype), TINY)


def _save_state(path: Path, state: dict[str, np.ndarray], config: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    save_file(state, path, metadata={"config": json.dumps(config or TINY.to_dict())})
    return path


def test_missing_unexpected_misshaped_and_wrong_dtype_in_one_message(tmp_path):
    state = _torch_state()
    del state["decoder.layers.1.cross_attn.v_proj.weight"]
    state["encoder.layers.0.self_attn.q_proj.weight"] = np.zeros((32, 16), np.float32)
    state["encoder.layers.0.attn_gate"] = np.zeros((), np.int32)
    state["extra.bias"] = np.zeros(3, np.float32)
    message = assert_refused(tmp_path, _save_state(tmp_path / "m.safetensors", state), r"missing 1", "out.pkl")
    for expected in ("missing 1: decoder.layers.1.cross_attn.v_proj.weight", "unexpected 1: extra.bias",
                     "encoder.layers.0.self_attn.q_proj.weight is (32, 16), expected (32, 32)",
                     "encoder.layers.0.attn_gate is int32"):
        assert expected in message, message


def test_q_proj_contradicting_d_model_is_named(tmp_path):
    params = random_flax_params(TINY, dtype="float16")
    params["encoder"]["layers"]["EncoderBlock_0"]["self_attn"]["q_proj"]["kernel"] = np.zeros((1, 48, 32), np.float16)
    src = write_upstream_pickle(tmp_path / "m.pkl", params, TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"encoder/layers/EncoderBlock_0/self_attn/q_proj/kernel is \(1, 48, 32\), "
                                  r"expected \(1, 32, 32\)")


def test_config_contradicting_embedding_gets_a_hint(tmp_path):
    src = tiny_pickle(tmp_path / "m.pkl")
    wrong = TINY.replace(d_model=64)
    params = read_pickle(src)["params"]
    src2 = write_upstream_pickle(tmp_path / "w.pkl", params, wrong.to_dict(only_non_default=True))
    assert_refused(tmp_path, src2, r"The embedding \(64, 32\) says d_model=32 but config.d_model=64; fix the config")


def test_layer_count_inconsistent_with_config(tmp_path):
    state = _torch_state()
    for name in [k for k in state if k.startswith("decoder.layers.1.")]:
        state[name.replace("layers.1.", "layers.2.")] = state[name]
    src = _save_state(tmp_path / "m.safetensors", state)
    assert_refused(tmp_path, src, r"decoder tensors cover layers 0-2 but config.num_decoder_layers=2", "out.pkl")


def test_stacked_layer_counts_disagree(tmp_path):
    params = random_flax_params(TINY, dtype="float16")
    block = params["decoder"]["layers"]["DecoderBlock_0"]
    block["self_attn_gate"] = np.zeros((3,), np.float16)
    src = write_upstream_pickle(tmp_path / "m.pkl", params, TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"decoder stacked tensors disagree on the layer count: 2 in .*, 3 in "
                                  r"decoder/layers/DecoderBlock_0/self_attn_gate")


def test_unknown_config_key(tmp_path):
    src = write_upstream_pickle(tmp_path / "m.pkl", random_flax_params(TINY, dtype="float16"),
                                {**TINY.to_dict(only_non_default=True), "use_flash": True})
    assert_refused(tmp_path, src, r"unknown config key\(s\) 'use_flash'")


def test_missing_config_says_how_to_supply_one(tmp_path):
    src = tmp_path / "bare.safetensors"
    from safetensors.numpy import save_file

    save_file(_torch_state(), src)
    assert_refused(tmp_path, src, r"carries no config; put its config.json next to it or pass --config", "out.pkl")


def test_nan_and_inf_weights_are_named(tmp_path):
    params = random_flax_params(TINY, dtype="bfloat16")
    params["decoder"]["layers"]["DecoderBlock_0"]["cross_attn"]["k_proj"]["kernel"][1, 3, 5] = np.nan
    params["contrastive_proj"]["kernel"][0, 0] = np.inf
    src = write_upstream_pickle(tmp_path / "m.pkl", params, TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"NaN or Inf values in 2 tensor\(s\): contrastive_proj.weight, "
                                  r"decoder.layers.1.cross_attn.k_proj.weight")


def test_cast_overflowing_to_inf_is_refused(tmp_path):
    params = random_flax_params(TINY, dtype="float32")
    params["log_temp"] = np.asarray(1e6, np.float32)  # beyond float16's 65504
    src = write_upstream_pickle(tmp_path / "m.pkl", params, TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"NaN or Inf values in 1 tensor\(s\) after the cast to float16: log_temp; values "
                   r"beyond float16's range overflow to Inf", "out.safetensors", "--dtype", "float16")


# ----------------------------------------------------------------------------- never clobber


def test_existing_output_survives_without_force(tmp_path):
    src = tiny_pickle(tmp_path / "m.pkl")
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"precious")
    result = runner.invoke(cli.app, ["convert", str(src), str(dst)])
    assert result.exit_code == 2 and "already exists; pass --force" in result.stderr
    assert dst.read_bytes() == b"precious"


def test_existing_output_survives_a_failed_forced_conversion(tmp_path):
    params = random_flax_params(TINY, dtype="float16")
    params["log_temp"] = np.asarray(np.nan, np.float16)
    src = write_upstream_pickle(tmp_path / "m.pkl", params, TINY.to_dict(only_non_default=True))
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"precious")
    result = runner.invoke(cli.app, ["convert", str(src), str(dst), "--force"])
    assert result.exit_code == 2 and "NaN or Inf" in result.stderr
    assert dst.read_bytes() == b"precious"
    assert leftovers(tmp_path) == []


def test_force_will_not_delete_a_foreign_directory(tmp_path):
    src = tiny_pickle(tmp_path / "m.pkl")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    result = runner.invoke(cli.app, ["convert", str(src), str(tmp_path / "photos"), "--force"])
    assert result.exit_code == 2 and "not a needle-twin checkpoint; refusing to delete it" in result.stderr
    assert (tmp_path / "photos" / "cat.jpg").read_bytes() == b"meow"


@pytest.mark.parametrize("dst_name, extra", [("out.safetensors", []), ("out.pkl", []),
                                             ("hf", ["--max-shard-size", "20KB"])])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, dst_name, extra):
    src = tiny_pickle(tmp_path / "m.pkl")
    calls = {"n": 0}
    real = io.is_finite

    def interrupt_midway(chunk):
        calls["n"] += 1
        if calls["n"] == 12:  # well inside the tensor stream: some bytes are already on disk
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(io, "is_finite", interrupt_midway)
    result = runner.invoke(cli.app, ["convert", str(src), str(tmp_path / dst_name), *extra])
    assert result.exit_code == 130 and "interrupted; nothing was written" in result.stderr
    assert calls["n"] >= 12  # (other tensors may finish on the second writer thread meanwhile)
    assert not (tmp_path / dst_name).exists() and leftovers(tmp_path) == []


def test_feed_forward_weights_against_a_no_ffn_config_get_a_hint(tmp_path):
    ffn = TINY.replace(no_feedforward=False, d_ff=16)
    src = write_upstream_pickle(tmp_path / "m.pkl", random_flax_params(ffn, dtype="float16"),
                                TINY.to_dict(only_non_default=True))
    assert_refused(tmp_path, src, r"unexpected 10: .*has feed-forward weights but config.no_feedforward=True")
