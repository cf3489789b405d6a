"""Needle 3's `.cact` (convert.v3.cact over the shared container convert.cact) against upstream's own file:
`needle-v3-tiny.cact` was written by cactus-needle 3.2.8's `write_export(params, cfg, path, bits=4, group=128,
tokenizer=tok, kv_window=160)` from `needle-v3-tiny.safetensors`, and `needle-v3-tiny.cact.npz` holds what its
`read_export` reads back (README-v3.md)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from convert.errors import CheckpointError, ConfigError
from convert.io import read_checkpoint
from convert.trees import flatten_tree
from convert.v3 import cact

FIXTURES = Path("/work/shared/fixtures")
CACT, NPZ = FIXTURES / "needle-v3-tiny.cact", FIXTURES / "needle-v3-tiny.cact.npz"
CKPT, SPM = FIXTURES / "needle-v3-tiny.safetensors", FIXTURES / "needle-v3-tiny.spm.model"
pytestmark = pytest.mark.skipif(not CACT.exists(), reason="the shared Needle 3 fixtures are not here")
RUNNER = CliRunner()


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(CKPT)


@pytest.fixture(scope="module")
def golden():
    with np.load(NPZ) as z:
        return {k: z[k] for k in z.files}


def test_write_is_upstreams_bytes(ckpt):
    buf = cact.build_cact(ckpt.params, ckpt.config, bits=4, group=128, tokenizer=SPM, kv_window=160)
    assert buf == CACT.read_bytes()


def test_read_is_upstreams_tree_header_and_records(golden, ckpt):
    back = cact.to_params(CACT)
    flat = flatten_tree(back.params)
    tree = {k.removeprefix("tree/"): v for k, v in golden.items() if k.startswith("tree/")}
    assert sorted(flat) == sorted(tree)
    for path, want in tree.items():  # exactly: read_export's float32 values, upstream's layout
        assert flat[path].dtype == want.dtype and flat[path].shape == want.shape and np.array_equal(flat[path], want)
    for name, value in back.constants.items():
        assert np.array_equal(value, golden[f"const/{name}"]), name
    assert back.config == ckpt.config  # every stored field, and the defaults for the rest
    f = cact.read_cact(CACT)
    assert np.array_equal(np.array([r.row() for r in f.records]), golden["records"])
    assert f.names == json.loads(str(golden["names_json"]))
    assert np.array_equal(f.codebook, golden["codebook"])
    info = {k: list(v) if isinstance(v, tuple) else v for k, v in f.info.items() if k != "codebook"}
    assert {k: info[k] for k in json.loads(str(golden["header_json"]))} == json.loads(str(golden["header_json"]))
    assert f.tensor("tokenizer") == golden["tokenizer_blob"].tobytes()
    assert cact.lint(CACT) == []


def test_read_checkpoint_gives_tree_and_config(ckpt):
    back = read_checkpoint(CACT)
    assert back.config == ckpt.config and back.family.name == "v3"
    assert float(back.params["embedding_head"]["bias"]) == -10.0  # not exported: upstream's initial value


@pytest.mark.parametrize("bits", [1, 2, 3, 1.58])
def test_other_widths_round_trip(bits, ckpt, tmp_path):
    """Beyond upstream's writer (4-bit only): its packing rules at 1, 2, 3 bits and ternary; codes exact."""
    path = tmp_path / "x.cact"
    cact.write_cact(ckpt.params, ckpt.config, path, bits=bits, tokenizer=SPM)
    f = cact.read_cact(path)
    assert cact.lint(path) == []
    rec = f.record("layer00.q_proj")
    assert rec.bits == cact.record_bits(bits) and f.record("embedding_head.probes").bits == 4  # heads stay 4-bit
    w = np.asarray(ckpt.params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"][0]).T  # (out, in)
    idx, norms = cact.container.cq_encode(w, rec.bits)
    got_idx, got_norms = f.codes("layer00.q_proj")
    assert np.array_equal(got_idx, idx) and np.array_equal(got_norms, norms)
    # Read back within the CQ error: the relative error of a Lloyd-Max code of that width (1 bit: ~0.6).
    err = np.linalg.norm(f.tensor("layer00.q_proj") - w) / np.linalg.norm(w)
    assert err < {1: 0.65, 2: 0.4, 3: 0.25, 1.58: 0.5}[bits]
    assert cact.to_params(path).config == ckpt.config


def test_layers_writes_the_rung(ckpt, tmp_path):
    from convert.v3.ladder import ladder_config
    path = tmp_path / "rung.cact"
    cact.write_cact(ckpt.params, ckpt.config, path, layers=3)
    back = cact.to_params(path)
    assert back.config.num_layers == 3 and back.config.global_layers == ladder_config(ckpt.config, 3).global_layers


def test_refuses_widths_and_configs_it_cannot_write(ckpt):
    with pytest.raises(ConfigError, match="bits=5 is not a CQ width"):
        cact.build_cact(ckpt.params, ckpt.config, bits=5)


# ----------------------------------------------------------------------------- hostile files


def damaged(tmp_path: Path, edit) -> Path:
    b = bytearray(CACT.read_bytes())
    edited = edit(b)
    b = b if edited is None or isinstance(edited, tuple) else edited
    path = tmp_path / "bad.cact"
    path.write_bytes(bytes(b))
    return path


def put_record(b: bytearray, i: int, column: int, value: int) -> None:
    base = cact.HEADER_SIZE + 4 * 28 + i * cact.container.RECORD_SIZE
    row = list(struct.unpack_from(cact.container.RECORD_FMT, b, base))
    row[column] = value
    struct.pack_into(cact.container.RECORD_FMT, b, base, *row)


def put_header(b: bytearray, name: str, value: int) -> None:
    struct.pack_into("<I", b, 4 * cact.HEADER_FIELDS.index(name), value)


HOSTILE = [
    ("zero-bytes", lambda b: b[:0], "0 bytes, shorter than the 196-byte .cact header"),
    ("truncated", lambda b: b[:-100], "lies outside the data area"),
    ("header-vs-directory", lambda b: put_header(b, "num_layers", 4), "records do not fit the header's geometry: "
                                                                       "L=4 layers"),
    ("record-past-end", lambda b: put_record(b, 3, 7, 10**12), "record 3 (layer00.k_proj): its blob [1000000000000"),
    ("v2-tag", lambda b: put_header(b, "tag", 0x05E12A83),
     "wrong tag 0x05E12A83, expected 0x05E12A84: a Needle 2 file"),
    ("wrong-tag", lambda b: put_header(b, "tag", 0x12345678), "wrong tag 0x12345678, expected 0x05E12A84: not a "
                                                              "Needle 3 .cact file"),
]


@pytest.mark.parametrize(("case", "edit", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_are_one_line_refusals(case, edit, message, tmp_path):
    path = damaged(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        cact.read_cact(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    problems = cact.lint(path)
    assert problems and message in problems[0]
    out = tmp_path / "out.safetensors"
    r = RUNNER.invoke(app, ["convert", str(path), str(out), "--to", "torch"])
    assert r.exit_code == 2 and not out.exists(), r.output


def test_misaligned_offset_and_shape_are_named_by_lint(tmp_path):
    f = cact.read_cact(CACT)
    rec = f.record("layer00.q_proj")
    path = damaged(tmp_path, lambda b: put_record(b, rec.index, 7, rec.offset + 8))
    assert any(f"record 2 (layer00.q_proj): offset {rec.offset + 8} is not 64-byte aligned" in p
               for p in cact.lint(path))
    shape = damaged(tmp_path, lambda b: (put_record(b, 1, 3, 32), put_record(b, 1, 8, 64)))  # norm_in (32,)
    assert "record 1 (layer00.norm_in): FP16 (32,), but the header's geometry gives FP16 (64,)" in cact.lint(shape)
    r = RUNNER.invoke(app, ["inspect", str(shape)])
    assert r.exit_code == 1 and "layer00.norm_in" in r.output


def test_inspect_shows_header_fields_and_records():
    r = RUNNER.invoke(app, ["inspect", str(CACT), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["family"] == "v3" and info["lint"] == [] and len(info["record_table"]) == 177
    assert info["engine_config"]["tag"] == "0x05E12A84" and info["engine_config"]["site15"] == 0


def test_cli_convert_writes_upstreams_bytes(tmp_path):
    out = tmp_path / "out.cact"
    r = subprocess.run([sys.executable, "-m", "cli", "convert", str(CKPT), str(out), "--tokenizer", str(SPM)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == CACT.read_bytes()
