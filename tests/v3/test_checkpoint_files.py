"""Upstream's Needle 3 safetensors checkpoints through `needle-twin convert` and `inspect`: both layouts, round trips
that give upstream's file back, rungs as files, and every damaged file refused in one line with nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from convert import io
from convert.trees import flatten_tree
from convert.v3 import ladder_config, ladder_slice
from tests.convert_helpers import assert_refused, run_cli
from tests.v3.goldens import DATA

TINY = DATA / "needle-v3-tiny.safetensors"


def header(path: Path) -> tuple[dict, bytes]:
    """(the parsed header, the data bytes): what must match (upstream's writer orders the metadata keys by hash)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def rewrite(src: Path, dst: Path, *, metadata=None, entries=None, data=None) -> Path:
    """src with its metadata, tensor entries or data replaced (a damaged or hostile copy)."""
    h, body = header(src)
    meta = h.pop("__metadata__")
    h = {"__metadata__": meta if metadata is None else metadata, **(h if entries is None else entries(h))}
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + (body if data is None else data(body, h)))
    return dst


def cli_ok(*args) -> str:
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_read_checkpoint_gives_upstreams_tree_and_config():
    ck = io.read_checkpoint(TINY)
    assert ck.family.name == "v3" and ck.format == "upstream-safetensors"
    assert ck.config.sliding_window == 8 and ck.config.qkv_conv_taps == 3 and ck.config.head_dims == (16, 24)
    assert ck.extra["step"] == 1000 and ck.extra["run"]["name"] == "needle-v3-tiny"
    assert ck.params["stack"]["layers"]["block"]["self_attn"]["q_taps"].shape == (5, 3, 64)


@pytest.mark.parametrize("middle", ["torch.safetensors", "hf"])
def test_upstream_to_torch_to_upstream_gives_the_same_file(tmp_path, middle):
    """Every tensor's name, dtype, shape and bytes, every metadata string verbatim (the parsed header)."""
    mid, back = tmp_path / middle, tmp_path / "back.safetensors"
    cli_ok("convert", TINY, mid, *(["--to", "torch"] if middle.endswith(".safetensors") else []))
    assert io.detect_format(mid) in ("safetensors", "hf-dir") and io.read_checkpoint(mid).family.name == "v3"
    cli_ok("convert", mid, back, "--to", "flax")
    assert header(back) == header(TINY)


def test_inspect_names_the_layout_and_shows_step_and_run():
    out = cli_ok("inspect", TINY)
    assert "upstream-safetensors (flax layout)" in out and "family:     v3" in out
    assert "step = 1000" in out and "run = " in out and "sliding_window=8" in out


def test_a_safetensors_dst_without_to_names_both_layouts(tmp_path):
    assert_refused(tmp_path, TINY, r"--to torch.*--to flax", "out.safetensors")


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_rung_file_is_upstreams_ladder_slice(tmp_path, depth):
    out = tmp_path / f"rung{depth}.safetensors"
    cli_ok("convert", TINY, out, "--to", "flax", "--layers", depth)
    rung, ck = io.read_checkpoint(out), io.read_checkpoint(TINY)
    assert rung.config == ladder_config(ck.config, depth) and rung.format == "upstream-safetensors"
    expected = flatten_tree(ladder_slice(ck.params, ck.config, depth))
    got = flatten_tree(rung.params)
    assert got.keys() == expected.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)


def test_rung_options_are_checked(tmp_path):
    assert_refused(tmp_path, TINY, r"--layers must be in \[2, 5\]", "r.safetensors", "--to", "flax", "--layers", "9")
    assert_refused(tmp_path, TINY, r"cannot halve.*engram", "w.safetensors", "--to", "flax", "--width", "32")


# ----------------------------------------------------------------------------- damaged and hostile files


def _meta(**changes):
    h, _ = header(TINY)
    return {**h["__metadata__"], **changes}


def _config(**changes):
    return json.dumps({**json.loads(header(TINY)[0]["__metadata__"]["config"]), **changes})


HOSTILE = {
    "zero bytes": (lambda src, dst: dst.write_bytes(b""), r"empty file"),
    "truncated": (lambda src, dst: dst.write_bytes(src.read_bytes()[:-100]), r"truncated"),
    "offsets lie": (lambda src, dst: rewrite(src, dst, entries=lambda h: {
        k: {**v, "data_offsets": [v["data_offsets"][0], v["data_offsets"][1] + 4]} if k == "embedding/embedding"
        else v for k, v in h.items()}), r"corrupt safetensors header.*embedding/embedding"),
    "dtype lies": (lambda src, dst: rewrite(src, dst, entries=lambda h: {
        k: {**v, "dtype": "F16"} if k == "stack/final_norm/scale" else v for k, v in h.items()}),
        r"stack/final_norm/scale spans"),
    "config not JSON": (lambda src, dst: rewrite(src, dst, metadata=_meta(config="{not json")), r"not JSON"),
    "no config": (lambda src, dst: rewrite(src, dst, metadata={k: v for k, v in _meta().items() if k != "config"}),
                  r"no 'config'"),
    "config invalid": (lambda src, dst: rewrite(src, dst, metadata=_meta(config=_config(num_kv_heads=3))),
                       r"num_kv_heads"),
    "needle 2 config": (lambda src, dst: rewrite(src, dst, metadata=_meta(config=json.dumps(
        {"d_model": 64, "num_heads": 4, "attn_dim": 64}))), r"Needle 2"),
    "wrong format_version": (lambda src, dst: rewrite(src, dst, metadata=_meta(format_version="7")),
                             r"format_version '7'"),
    "NaN tensor": (lambda src, dst: rewrite(src, dst, data=lambda body, h: _poison(body, h)), r"NaN|non-finite"),
}


def _poison(body: bytes, h: dict) -> bytes:
    begin, _ = h["stack/final_norm/scale"]["data_offsets"]
    out = bytearray(body)
    out[begin:begin + 4] = struct.pack("<f", float("nan"))
    return bytes(out)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_damaged_checkpoints_are_refused_in_one_line(tmp_path, case):
    make, pattern = HOSTILE[case]
    src = tmp_path / "bad.safetensors"
    make(TINY, src)
    assert_refused(tmp_path, src, pattern, "out.safetensors", "--to", "torch")


def test_nothing_is_overwritten_without_force(tmp_path):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"keep")
    r = run_cli("convert", TINY, dst, "--to", "torch")
    assert r.returncode == 2 and "--force" in r.stderr and dst.read_bytes() == b"keep"
    cli_ok("convert", TINY, dst, "--to", "torch", "--force")
    assert io.read_checkpoint(dst).family.name == "v3"


def test_a_300_style_pickle_is_read_as_needle3(tmp_path):
    """cactus-needle 3.0.0 wrote format-v2 pickles, as Needle 2 does: the tensor names tell the family."""
    pkl = tmp_path / "needle3.pkl"
    cli_ok("convert", TINY, pkl)
    ck, ref = io.read_checkpoint(pkl), io.read_checkpoint(TINY)
    assert ck.family.name == "v3" and ck.config == ref.config and ck.extra == ref.extra
    for k, v in flatten_tree(ref.params).items():
        np.testing.assert_array_equal(flatten_tree(ck.params)[k], v, err_msg=k)
