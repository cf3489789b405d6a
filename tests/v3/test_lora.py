"""Needle 3 LoRA adapters (convert.v3.lora) against upstream's fixture, PEFT 0.21 itself and the CLI.

Golden: f32/lora_logits in tests/data/v3/needle-v3-tiny.npz, upstream's `merge_lora` of needle-v3-tiny.lora.safetensors
into the fixture checkpoint run through upstream's forward with a float32 config (README-v3.md). Relative error is
max|Δ| / max|ref| over the whole array.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_safetensors
from typer.testing import CliRunner

from cli import app
from convert import registry
from convert.errors import CheckpointError
from convert.io import read_checkpoint
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import lora as L2
from convert.v3 import lora as L
from convert.v3.mapping import rules
from needle_torch.v2 import peft as npeft
from needle_torch.v3 import SimpleAttentionNetwork
from tests.v3.goldens import DATA

peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
BASE, ADAPTER = DATA / "needle-v3-tiny.safetensors", DATA / "needle-v3-tiny.lora.safetensors"
# float32: PEFT's unmerged x·Wᵀ + s·(x·Aᵀ)·Bᵀ and upstream's W + s·A·B differ from upstream's logits only by float32
# rounding through 5 layers (measured 5.9e-7 for PEFT, 5.5e-7 for the merged checkpoint).
REL = 1e-5
Q = "stack/layers/block/self_attn/q_proj/kernel"
runner = CliRunner()


def rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's parsed header and its data bytes (upstream's writer orders metadata keys by hash)."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(BASE)


@pytest.fixture(scope="module")
def config32(ckpt):
    return dataclasses.replace(ckpt.config, dtype="float32")


@pytest.fixture(scope="module")
def adapter():
    return L.read_upstream_adapter(ADAPTER)


@pytest.fixture(scope="module")
def golden():
    z = np.load(DATA / "needle-v3-tiny.npz")
    return torch.from_numpy(z["tokens"]).long(), z["f32/lora_logits"].astype(np.float64), z["f32/logits"]


@pytest.fixture(scope="module")
def peft_dir(adapter, ckpt, tmp_path_factory):
    return L.write_peft(adapter, ckpt.config, tmp_path_factory.mktemp("peft") / "adapter")


@torch.no_grad()
def run(model, tokens) -> np.ndarray:
    return model(tokens).numpy()


def twin(params, config) -> SimpleAttentionNetwork:
    return SimpleAttentionNetwork.from_flax(params, config).eval()


# ----------------------------------------------------------------------------- upstream's file


def test_fixture_adapter_reads(adapter):
    assert set(adapter.targets) == set(L.LORA_TARGETS)
    assert (adapter.rank, adapter.scale, adapter.base, adapter.seed, adapter.pieces, adapter.languages,
            adapter.rows, adapter.num_layers, adapter.alpha) == (4, 2.0, "needle-v3-tiny.safetensors", 7, None, None,
                                                                 None, 5, 8.0)
    assert adapter.lora[Q]["A"].shape == (5, 64, 4) and adapter.lora[L.LORA_TARGETS[2]]["B"].shape == (5, 4, 48)
    info = L.describe(adapter)
    assert (info["format"], info["whistle"], info["seed"]) == ("Needle 3 LoRA adapter", False, 7)
    assert registry.adapter_format(ADAPTER).name == "needle3-lora"


def test_targets_are_the_v3_mapping_rules(ckpt):
    """Needle 2's PEFT layout is reused: its five targets' torch modules are the v3 mapping's own names."""
    table = {r.flax: r.torch for r in rules(ckpt.config)}
    for t in L.LORA_TARGETS:
        assert table[t].format(i=3) == L2.module_name(t, 3) + ".weight"


def test_writer_gives_back_upstreams_file(adapter, tmp_path):
    """Tensors byte for byte and the same header (metadata strings verbatim) as upstream's write_adapter."""
    out = L.write_upstream_adapter(adapter, tmp_path / "a.safetensors")
    assert header(out) == header(ADAPTER)


def test_a_300_adapter_without_pieces_and_languages(adapter, tmp_path):
    """3.0.0 wrote no pieces/languages: read as None; written back with upstream's "null"s."""
    src = tmp_path / "old.safetensors"
    _rewrite(ADAPTER, src, metadata=lambda m: [m.pop("pieces"), m.pop("languages")])
    old = L.read_upstream_adapter(src)
    assert (old.pieces, old.languages, old.seed) == (None, None, 7)
    assert L.write_upstream_adapter(old, tmp_path / "new.safetensors") and \
        header(tmp_path / "new.safetensors") == header(ADAPTER)


def test_a_whistle_adapter_is_read_and_named(adapter, ckpt, tmp_path):
    src = tmp_path / "w.safetensors"
    rows = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    _rewrite(ADAPTER, src, metadata=lambda m: m.update(languages='["en", "fr"]', pieces='["▁a", "b"]', rank='4'),
             tensors=lambda t: t.update(rows=rows))
    w = L.read_upstream_adapter(src)
    assert (w.languages, w.pieces, w.rows.tobytes()) == (["en", "fr"], ["▁a", "b"], rows.tobytes())
    info = L.describe(w)
    assert info["whistle"] and info["rows"] == [3, 64] and "Whistle adapter (languages en, fr)" in info["note"]
    assert header(L.write_upstream_adapter(w, tmp_path / "back.safetensors")) == header(src)
    r = invoke("convert", src, tmp_path / "merged", "--base", BASE, "--merge")
    assert r.exit_code == 2 and "is a Whistle adapter (languages ['en', 'fr'])" in r.output
    assert "needle whistle build" in r.output and not (tmp_path / "merged").exists()


# ----------------------------------------------------------------------------- PEFT


def test_peft_from_pretrained_matches_upstream(peft_dir, adapter, ckpt, config32, golden):
    tokens, lora_logits, base_logits = golden
    model = twin(ckpt.params, config32)
    wrapped = peft.PeftModel.from_pretrained(model, peft_dir).eval()
    adapted = npeft.lora_modules(wrapped)
    assert len(adapted) == 5 * ckpt.config.num_layers
    assert all(n.startswith("base_model.model.stack.layers.") for n in adapted)  # no engram, no head projection
    got = run(wrapped, tokens)
    assert rel(base_logits, lora_logits) > 0.1  # the adapter matters (it moves logits by up to 0.86)
    assert rel(got, lora_logits) <= REL
    assert rel(run(twin(L.merged_params(adapter, ckpt.params), config32), tokens), lora_logits) <= REL


def test_round_trip_through_peft_is_exact(peft_dir, adapter, tmp_path):
    """adapter -> PEFT -> adapter: the same tensors byte for byte and the same metadata, base and seed included."""
    back = L.read_peft(peft_dir)
    assert back.metadata() == adapter.metadata()
    assert header(L.write_upstream_adapter(back, tmp_path / "back.safetensors")) == header(ADAPTER)
    assert registry.adapter_format(peft_dir).name == "needle3-lora"
    files = load_safetensors(peft_dir / L.PEFT_WEIGHTS)
    np.testing.assert_array_equal(files[L2.peft_key(Q, 2, "A")], adapter.lora[Q]["A"][2].T)


def test_cli_round_trip_and_merge(tmp_path, ckpt, config32, golden):
    tokens, lora_logits, _ = golden
    peft_out, back = tmp_path / "peft", tmp_path / "back.safetensors"
    assert invoke("convert", ADAPTER, peft_out, "--base", BASE).exit_code == 0
    assert peft.PeftConfig.from_pretrained(peft_out).base_model_name_or_path == str(BASE)
    assert invoke("convert", peft_out, back, "--base", BASE).exit_code == 0
    assert header(back) == header(ADAPTER)  # upstream's own base name kept, not --base's path
    # --merge from either form, into the twin's formats and upstream's
    for src, dst, extra in ((ADAPTER, "hf", ()), (ADAPTER, "flax.safetensors", ("--to", "flax")),
                            (peft_out, "torch.safetensors", ("--to", "torch"))):
        out = tmp_path / f"merged_{dst}"
        r = invoke("convert", src, out, "--base", BASE, "--merge", *extra)
        assert r.exit_code == 0, r.output
        merged = read_checkpoint(out)
        assert rel(run(twin(merged.params, config32), tokens), lora_logits) <= REL


def test_cli_as_a_subprocess(tmp_path):
    out = tmp_path / "peft"
    r = subprocess.run([sys.executable, "-m", "cli", "convert", str(ADAPTER), str(out), "--base", str(BASE)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / L.PEFT_CONFIG).is_file() and (out / L.PEFT_WEIGHTS).is_file()


def test_trained_in_torch_comes_back_as_upstreams_file(ckpt, config32, tmp_path):
    """A PEFT adapter trained on the torch twin -> upstream's file (with its metadata) -> upstream's merge ==
    PEFT's merge_and_unload."""
    torch.manual_seed(0)
    model = peft.get_peft_model(twin(ckpt.params, config32), npeft.lora_config(rank=4, alpha=8.0))
    assert len(npeft.lora_modules(model)) == 25
    tokens = torch.randint(20, ckpt.config.vocab_size, (1, 10))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(2):
        logits = model(tokens)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(tmp_path / "trained")
    assert registry.adapter_format(tmp_path / "trained").name == "needle3-lora"  # k and v widths differ: v3
    out = tmp_path / "trained.safetensors"
    r = invoke("convert", tmp_path / "trained", out, "--base", BASE)
    assert r.exit_code == 0, r.output
    meta, _ = header(out)
    assert meta["__metadata__"] == {"scale": "2.0", "base": json.dumps(str(BASE)), "rank": "4", "seed": "null",
                                    "pieces": "null", "languages": "null"}
    merged = run(twin(L.merged_params(L.read_upstream_adapter(out), ckpt.params), config32), tokens)
    reference = run(model.merge_and_unload(), tokens).astype(np.float64)
    assert rel(run(twin(ckpt.params, config32), tokens), reference) > 1e-3  # training moved the model
    assert rel(merged, reference) <= REL


# ----------------------------------------------------------------------------- half-precision merges


@pytest.mark.parametrize("adapter_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base_dtype", ["float32", "float16", "bfloat16"])
def test_half_precision_merge_is_finite_and_upstreams_rule(adapter_dtype, base_dtype, adapter, ckpt):
    """A and B whose products overflow float16 term by term while their sum is small (upstream issues #53, #59:
    NaN from inf - inf): widened to float32 first, the delta cast once to W's dtype and added in W's dtype."""
    from convert.trees import np_dtype

    half = np_dtype(adapter_dtype)
    lora = {t: {x: a.astype(half) for x, a in ab.items()} for t, ab in adapter.lora.items()}
    lora[Q]["A"][1, 3, :] = 300.0
    lora[Q]["B"][1, :, 5] = [300.0, 300.0, -300.0, -300.0]  # each term 90000 > float16's 65504; the sum is 0
    big = dataclasses.replace(adapter, lora=lora)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(300.0) * np.float16(300.0))  # what a float16 A @ B would meet
    params = unflatten_tree({k: np.asarray(v).astype(np_dtype(base_dtype)) for k, v in
                             flatten_tree(ckpt.params).items()})
    L.check_adapter(big, params, ckpt.config)
    merged = flatten_tree(L.merged_params(big, params))
    w = flatten_tree(params)[Q]
    delta = np.float32(2.0) * np.matmul(lora[Q]["A"].astype(np.float32), lora[Q]["B"].astype(np.float32))
    assert merged[Q].dtype == w.dtype and np.isfinite(merged[Q].astype(np.float32)).all()
    np.testing.assert_array_equal(merged[Q], w + delta.astype(w.dtype))


# ----------------------------------------------------------------------------- hostile adapters


def _rewrite(src: Path, dst: Path, *, metadata=None, tensors=None) -> Path:
    """A copy of an adapter file with its metadata strings and/or tensors edited (our own test data)."""
    hdr, _ = header(src)
    meta = dict(hdr["__metadata__"])
    arrays = load_safetensors(src)
    if metadata is not None:
        metadata(meta)
    if tensors is not None:
        tensors(arrays)
    from safetensors.numpy import save_file
    save_file(arrays, dst, metadata=meta)
    return dst


def _nan(t):
    t[f"lora/{Q}/B"][0, 0, 0] = np.nan


def _four_layers(t):
    for k in list(t):
        t[k] = t[k][:4].copy()


def _narrow(t):
    t[f"lora/{Q}/B"] = t[f"lora/{Q}/B"][:, :, :32].copy()


HOSTILE = {
    "zero bytes": (lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    "truncated data": (lambda p: p.write_bytes(ADAPTER.read_bytes()[:-100]), "truncated safetensors file: tensors "
                                                                           "need 52480 bytes of data"),
    "truncated header": (lambda p: p.write_bytes(ADAPTER.read_bytes()[:600]), "truncated safetensors file: the "
                                                                             "header declares 1280 bytes"),
    "scale not JSON": (lambda p: _rewrite(ADAPTER, p, metadata=lambda m: m.update(scale="two")),
                       "the 'scale' metadata 'two' is not JSON"),
    "base not JSON": (lambda p: _rewrite(ADAPTER, p, metadata=lambda m: m.update(base="needle3.safetensors")),
                      "the 'base' metadata 'needle3.safetensors' is not JSON"),
    "code in metadata": (lambda p: _rewrite(ADAPTER, p, metadata=lambda m: m.update(
        seed="__import__('os').system('touch /tmp/needle-twin-v3-lora-marker')")), "the 'seed' metadata "),
    "no scale": (lambda p: _rewrite(ADAPTER, p, metadata=lambda m: m.pop("scale")), "the metadata has no 'scale'"),
    "seed a string": (lambda p: _rewrite(ADAPTER, p, metadata=lambda m: m.update(seed='"7"')),
                      "'seed' is \"7\"; expected null or an integer"),
    "NaN": (lambda p: _rewrite(ADAPTER, p, tensors=_nan), f"{Q} B holds NaN or Inf values"),
    "another base (layers)": (lambda p: _rewrite(ADAPTER, p, tensors=_four_layers),
                              "the adapter is for another base: it has 4 layers, the base has 5"),
    "another base (widths)": (lambda p: _rewrite(ADAPTER, p, tensors=_narrow),
                              f"adapter/base shape mismatch at {Q}: the adapter's A @ B is [5, 64, 32], the base's "
                              "kernel is [5, 64, 64]"),
    "another target": (lambda p: _rewrite(ADAPTER, p, tensors=lambda t: t.update(
        {"lora/engrams_0/key_proj/kernel/A": t[f"lora/{Q}/A"], "lora/engrams_0/key_proj/kernel/B": t[f"lora/{Q}/B"]})),
        "'engrams_0/key_proj/kernel' is not one of upstream's LoRA targets"),
    "stray tensor": (lambda p: _rewrite(ADAPTER, p, tensors=lambda t: t.update({"lora/x": t[f"lora/{Q}/A"]})),
                     "tensor 'lora/x' is neither lora/<param path>/A|B nor rows"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("merge", [False, True])
def test_hostile_adapter(case, merge, tmp_path):
    make, message = HOSTILE[case]
    src = tmp_path / "bad.lora.safetensors"
    make(src)
    marker = Path("/tmp/needle-twin-v3-lora-marker")
    marker.unlink(missing_ok=True)
    out = tmp_path / ("merged" if merge else "peft")
    r = invoke("convert", src, out, "--base", BASE, *(["--merge"] if merge else []))
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert message in line and "\n" not in line, line
    assert sorted(os.listdir(tmp_path)) == ["bad.lora.safetensors"]  # nothing written, no leftovers
    assert not marker.exists()  # nothing ran


def test_an_adapter_for_another_family(tmp_path):
    r = invoke("convert", ADAPTER, tmp_path / "out", "--base", DATA.parent / "needle-v2-tiny.pkl")
    assert r.exit_code == 2 and "is a Needle 3 (laddered decoder) adapter but --base" in r.output
    assert not (tmp_path / "out").exists()


def test_upstream_file_needs_its_suffix(adapter, tmp_path):
    with pytest.raises(CheckpointError, match="upstream's adapter must be a .safetensors file"):
        L.write_upstream_adapter(adapter, tmp_path / "a.bin")
    assert os.listdir(tmp_path) == []


def test_zero_byte_adapter_read_directly(tmp_path):
    (tmp_path / "e.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty file \(0 bytes\)"):
        L.read_adapter(tmp_path / "e.safetensors")
