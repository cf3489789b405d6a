"""The Needle 3 parity suite: both twins through the engine and the CLI on upstream's golden checkpoint.

float32 holds 1e-5 relative on every probe, bf16 its profile; `--depth all` compares every rung 2..5 of the
5-layer golden; a torch file with one corrupted layer exits 1 with the first divergence at that layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from cli import app
from convert.io import read_checkpoint
from convert.mapping import flax_to_torch_numpy
from parity_tests.engine import run_parity
from parity_tests.metrics import max_rel_of
from parity_tests.v3.inputs import random_batch

TINY = Path(__file__).resolve().parents[1] / "tests" / "data" / "v3" / "needle-v3-tiny.safetensors"
F32_PROMISE = 1e-5  # README: float32 twins agree to 1e-5 relative, probe by probe
PER_LAYER = ("lanes_in", "hpre", "u", "attn_out", "mlp_out", "hpost", "hres", "lanes_out")
HEADS = ("embedding", "confidence", "router")


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(TINY)


def test_float32_every_layer_head_and_rung(tmp_path, ckpt):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["parity", str(TINY), "--depth", "all", "--generate", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    probes = {p["name"]: p for p in report["probes"]}
    L = ckpt.config.num_layers
    expected = ["embed", "engram_k", "engram_v", "final_hidden", "logits", "hidden_cells", *HEADS]
    expected += [f"layers.{i}.{n}" for i in range(L) for n in PER_LAYER]
    expected += [f"depth{d}.{o}" for d in range(2, L + 1) for o in ("exit_logits", "sub_logits")]
    assert set(expected) <= set(probes)
    for name, p in probes.items():
        assert p["rel_l2"] <= F32_PROMISE and max_rel_of(p) <= F32_PROMISE, name
    assert any("agree on every rung" in n for n in report["notes"])


def test_bfloat16_passes_its_profile(ckpt):
    batch = random_batch(ckpt.config, batch=3, seq_len=24, seed=1, empty_rows=1)
    report = run_parity(ckpt.config, ckpt.params, batch, dtype="bfloat16", grads=False, generate=0)
    assert report.passed, report.first_divergence
    assert {f"layers.{ckpt.config.num_layers - 1}.lanes_out", *HEADS} <= {p.name for p in report.probes}


def test_a_torch_file_with_one_corrupted_layer_exits_1_naming_it(tmp_path, ckpt):
    state = {k: np.ascontiguousarray(v) for k, v in flax_to_torch_numpy(ckpt.params, ckpt.config).items()}
    name = "stack.layers.2.block.self_attn.q_proj.weight"
    state[name] = state[name] + np.float32(0.05) * np.random.default_rng(0).standard_normal(state[name].shape,
                                                                                              np.float32)
    bad = tmp_path / "bad.safetensors"
    save_file(state, bad)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["parity", str(TINY), "--torch", str(bad), "--no-grads", "--generate", "0",
                                      "--json", str(out)])
    assert result.exit_code == 1, result.output
    first = json.loads(out.read_text())["first_divergence"]
    assert first.startswith("layers.2."), first
