"""`needle-twin convert` and `inspect` on Needle 2 files: .cact builds byte for byte, lossy reads said, damage named."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from convert import io
from convert.trees import flatten_tree
from parity_tests.fixtures import DATA, V2_LORA, V2_NPZ, V2_PKL, V2_SPM
from parity_tests.metrics import max_rel
from tests.convert_helpers import run_cli

runner = CliRunner()


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("variant, bits", [("q4", None), ("q4", "4"), ("q2", "2"), ("t158", "1.58"),
                                           ("mixed", "default=2,embedding=4,attn.q_proj=3")])
def test_convert_to_cact_gives_upstreams_bytes(tmp_path, variant, bits):
    """No --bits: the checkpoint's weight_bits, else 4, as upstream's `needle build` does."""
    out = tmp_path / "m.cact"
    r = _invoke("convert", V2_PKL, out, *(["--bits", bits] if bits else []))
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == (DATA / f"needle-v2-tiny.{variant}.cact").read_bytes()


def test_convert_to_cact_with_the_tokenizer(tmp_path):
    out = tmp_path / "m.cact"
    assert _invoke("convert", V2_PKL, out, "--tokenizer", V2_SPM).exit_code == 0
    assert out.read_bytes() == (DATA / "needle-v2-tiny.q4tok.cact").read_bytes()


def test_reading_a_cact_is_said_to_be_lossy(tmp_path):
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", DATA / "needle-v2-tiny.q2.cact", out)
    assert r.returncode == 0, r.stderr
    assert "lossy" in r.stderr and "no MTP head" in r.stderr
    ckpt = io.read_checkpoint(out)
    assert ckpt.family.name == "v2" and "mtp_combine" not in ckpt.params


@pytest.mark.parametrize("variant", ["q4", "q2", "mixed", "t158", "q4tok"])
def test_inspect_lints_every_fixture_cact_clean(variant):
    r = _invoke("inspect", DATA / f"needle-v2-tiny.{variant}.cact")
    assert r.exit_code == 0, r.output
    assert "lint:       ok" in r.output and "engine:" in r.output and "family:     v2" in r.output


def _broken(tmp_path, name, change):
    data = bytearray((DATA / "needle-v2-tiny.q4.cact").read_bytes())
    change(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


DAMAGE = {
    # name: (change to the q4 file, what lint must say)
    "wrong-tag": (lambda d: d.__setitem__(slice(0, 4), struct.pack("<I", 0x05E12A82)), "wrong tag 0x05E12A82"),
    "truncated": (lambda d: d.__delitem__(slice(len(d) - 1000, None)), "lies outside the data area"),
    "offset-past-end": (lambda d: struct.pack_into("<Q", d, 120 + 112 + 20, 10**9), "lies outside the data area"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_inspect_names_the_damage_of_a_broken_copy(tmp_path, case):
    change, needle = DAMAGE[case]
    r = _invoke("inspect", _broken(tmp_path, f"{case}.cact", change))
    assert r.exit_code == 1, r.output
    assert needle in r.output and "lint:" in r.output


@pytest.mark.parametrize("case", list(DAMAGE))
def test_converting_a_broken_cact_is_one_line_exit_2_and_no_file(tmp_path, case):
    change, _ = DAMAGE[case]
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", _broken(tmp_path, f"{case}.cact", change), out)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()


def test_zero_byte_cact_is_refused(tmp_path):
    empty = tmp_path / "e.cact"
    empty.write_bytes(b"")
    r = _invoke("convert", empty, tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "empty file" in r.output


def test_cact_options_on_another_output_are_refused(tmp_path):
    r = _invoke("convert", V2_PKL, tmp_path / "o.safetensors", "--bits", "4")
    assert r.exit_code == 2 and "--bits only apply to a cact output" in r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_bad_bits_name_the_choices(tmp_path):
    r = _invoke("convert", V2_PKL, tmp_path / "o.cact", "--bits", "5")
    assert r.exit_code == 2 and "use 2, 3, 4 or 1.58" in r.output and not (tmp_path / "o.cact").exists()


def test_a_v1_checkpoint_cannot_become_a_cact(tmp_path):
    r = _invoke("convert", DATA / "needle-v1-tiny.pkl", tmp_path / "o.cact")
    assert r.exit_code == 2 and "Needle 2" in r.output and not (tmp_path / "o.cact").exists()


def test_diff_names_the_layer_that_differs(tmp_path):
    """A stacked array that differs in one layer only: diff says which (per-layer slices of stacked tensors)."""
    ckpt = io.read_checkpoint(V2_PKL)
    params = ckpt.params
    q = params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"].copy()
    q[3, 0, 0] += 1
    params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["kernel"] = q
    other = io.write_checkpoint(params, ckpt.config, tmp_path / "other.safetensors")
    r = _invoke("diff", V2_PKL, other)
    assert r.exit_code == 1
    line = next(x for x in r.output.splitlines() if "stack/layers/block/self_attn/q_proj/kernel" in x)
    assert "(layers 3)" in line and "1 elements differ" in line


# ----------------------------------------------------------------------------- LoRA adapters


def test_adapter_to_peft_and_back_through_the_cli(tmp_path):
    from convert.v2 import lora

    peft_dir, back = tmp_path / "peft", tmp_path / "back.pkl"
    assert _invoke("convert", V2_LORA, peft_dir, "--base", V2_PKL).exit_code == 0
    assert (peft_dir / "adapter_config.json").is_file() and (peft_dir / "adapter_model.safetensors").is_file()
    assert _invoke("convert", peft_dir, back, "--base", V2_PKL).exit_code == 0
    a, b = lora.read_upstream_adapter(V2_LORA), lora.read_upstream_adapter(back)
    assert a.scale == b.scale and a.rank == b.rank and a.lora.keys() == b.lora.keys()
    assert all(np.array_equal(a.lora[t][k], b.lora[t][k]) for t in a.lora for k in ("A", "B"))


def test_merged_adapter_gives_upstreams_lora_logits(tmp_path):
    """The goldens merge into the float32 widening of the float16 base, so the base is converted first (merging into
    the float16 file itself sums in float16, as upstream's `needle build` does, and moves logits by ~1e-3)."""
    import torch

    from needle_torch.v2 import SimpleAttentionNetwork

    base32, out = tmp_path / "base32.pkl", tmp_path / "merged.safetensors"
    assert _invoke("convert", V2_PKL, base32, "--dtype", "float32").exit_code == 0
    merged = _invoke("convert", V2_LORA, out, "--base", base32, "--merge")
    assert merged.exit_code == 0
    count = sum(np.asarray(a).size for a in flatten_tree(io.read_checkpoint(base32).params).values())
    assert f"{count:,} parameters, float32" in merged.output  # the merged model's size, not the adapter's
    with np.load(V2_NPZ) as z:
        tokens, want = z["tokens"], z["f32/lora_logits"]
    model = SimpleAttentionNetwork.from_pretrained(out)
    with torch.inference_mode():
        got = model(torch.from_numpy(tokens).long()).numpy()
    assert max_rel(got, want) <= 1e-5  # float32 twin of upstream's merge: ~1e-6


def test_inspect_an_adapter(tmp_path):
    r = _invoke("inspect", V2_LORA)
    assert r.exit_code == 0 and "rank:       4, scale 2" in r.output and "q_proj/kernel" in r.output


@pytest.mark.parametrize("args, needle", [
    ((), "needs its base checkpoint: add --base BASE"),
    (("--base", DATA / "needle-v1-tiny.pkl"), "Needle v1 (encoder-decoder) checkpoint; give its own base"),
    (("--base", V2_PKL, "--bits", "4"), "they need --merge"),
])
def test_adapter_usage_errors(tmp_path, args, needle):
    out = tmp_path / "out"
    r = _invoke("convert", V2_LORA, out, *args)
    assert r.exit_code == 2 and needle in r.output and not out.exists()


def test_a_hostile_adapter_pickle_runs_nothing(tmp_path):
    import pickle

    from tests.convert_helpers import RunsCommand

    marker, bad = tmp_path / "pwned", tmp_path / "bad.pkl"
    bad.write_bytes(pickle.dumps({"lora": {"x": RunsCommand(marker)}, "scale": 2.0, "rank": 4, "base": "b"}))
    r = run_cli("convert", bad, tmp_path / "out", "--base", V2_PKL)
    assert r.returncode == 2 and "forbidden global" in r.stderr and not marker.exists()
    assert not (tmp_path / "out").exists()


def test_checkpoint_options_for_adapters_only_are_refused(tmp_path):
    r = _invoke("convert", V2_PKL, tmp_path / "o.safetensors", "--base", V2_PKL)
    assert r.exit_code == 2 and "not an adapter" in r.output
