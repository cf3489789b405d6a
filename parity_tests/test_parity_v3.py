"""The Needle 3 parity suite: both twins through the engine and the CLI on upstream's golden checkpoints.

float32 holds 1e-5 relative on every probe, bf16 its profile, on every golden in tests/data/v3; `--depth all`
compares every rung 2..5 of the 5-layer golden (exit_depth, subnetwork_only and the sliced rung model); a torch
file with one corrupted layer exits 1 with the first divergence at that layer. Batches are small (2 x 16): the
cost is compiling the twins, and every probe, layer and head is there at any length.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from cli import app
from convert.io import read_checkpoint
from convert.mapping import flax_to_torch_numpy
from convert.v3.lora import read_adapter
from parity_tests import flips
from parity_tests.engine import pinned_precision, run_parity
from parity_tests.flips import Call
from parity_tests.metrics import max_rel_of
from parity_tests.report import _judged_gradients
from parity_tests.tolerances import get_profile
from parity_tests.twins import build_twins
from parity_tests.v3.adapter import ADAPTER
from parity_tests.v3.inputs import random_batch

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "v3"
TINY = DATA / "needle-v3-tiny.safetensors"
# checkpoints with goldens (NAME.npz beside NAME.safetensors; .cact.npz, .text.npz, .window.npz belong to others)
GOLDENS = sorted(p.stem for p in DATA.glob("*.npz") if (DATA / f"{p.stem}.safetensors").exists())
F32_PROMISE = 1e-5  # README: float32 twins agree to 1e-5 relative, probe by probe
SMALL = ["--batch", "2", "--seq-len", "16", "--generate", "0"]
HEADS = ("embedding", "confidence", "router")


def per_layer(config) -> tuple[str, ...]:
    names = ["lanes_in", "hpre", "u", "q", "k", "v", "attn_out", "mlp_out", "hpost", "hres", "lanes_out"]
    if config.num_sites:
        names.append("engram_gate")
    if config.qkv_conv_taps:
        names += ["q_conv", "k_conv", "v_conv"]
    return tuple(names)


def expected_probes(config, depths=(), dtype="float32") -> set[str]:
    names = {"embed", "final_hidden", "logits", "hidden_cells", *HEADS, *(f"{h}.pooled" for h in HEADS)}
    if dtype == "float32":  # the quant pass (flip margins are float32 noise)
        names.add("quant_logits")
    if config.num_sites:
        names |= {"engram_k", "engram_v"}
    names |= {f"layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer(config)}
    for d in depths:
        names |= {f"depth{d}.exit_logits", f"depth{d}.sub_logits"}
        if d < config.num_layers:
            names.add(f"depth{d}.sliced_logits")
    return names


def cli_parity(tmp_path, *args) -> tuple[int, dict | None, str]:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["parity", *args, "--json", str(out), "--force"])
    return result.exit_code, (json.loads(out.read_text()) if out.exists() else None), result.output


@pytest.fixture(scope="module")
def tiny():
    return read_checkpoint(TINY)


def test_float32_every_layer_head_and_rung(tmp_path, tiny):
    code, report, output = cli_parity(tmp_path, str(TINY), "--depth", "all", "--no-grads", *SMALL)
    assert code == 0, output
    probes = {p["name"]: p for p in report["probes"]}
    L = tiny.config.num_layers
    assert L == 5
    assert expected_probes(tiny.config, range(2, L + 1)) <= set(probes)
    for name, p in probes.items():
        assert p["rel_l2"] <= F32_PROMISE and max_rel_of(p) <= F32_PROMISE, name
    # The quant pass (quant=True): every quantiser call walked, its flips (if any) reported, judged at 1e-5 above.
    flips = report["flips"]
    assert flips["ok"] and flips["divergences"] == 0 and flips["calls"] > 0, flips["summary"]
    assert flips["count"] == len(flips["flips"]) and flips["noise_ulp"] <= flips["flip_ulps"]
    [note] = [n for n in report["notes"] if n.startswith("depth rungs")]
    assert "the twins agree on every rung" in note and "sliced rung models vs subnetwork_only logits" in note, note
    assert ": agree," in note, note  # each twin's sliced rung model computes its subnetwork_only logits


def test_bfloat16_passes_its_profile(tiny):
    batch = random_batch(tiny.config, batch=2, seq_len=16, seed=1, empty_rows=1)
    report = run_parity(tiny.config, tiny.params, batch, dtype="bfloat16", grads=False, generate=0)
    assert report.passed, report.first_divergence
    assert expected_probes(tiny.config, dtype="bfloat16") <= {p.name for p in report.probes}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in GOLDENS if n != "needle-v3-tiny"])
def test_every_golden_passes_in_float32_and_bfloat16(tmp_path, name):
    ckpt = DATA / f"{name}.safetensors"
    config = read_checkpoint(ckpt).config
    for dtype in ("float32", "bfloat16"):
        code, report, output = cli_parity(tmp_path, str(ckpt), "--dtype", dtype, "--no-grads", *SMALL)
        assert code == 0, (dtype, output)
        assert expected_probes(config, dtype=dtype) <= {p["name"] for p in report["probes"]}, dtype


def test_a_torch_file_with_one_corrupted_layer_exits_1_naming_it(tmp_path, tiny):
    # np.array keeps 0-d leaves 0-d (np.ascontiguousarray would make them (1,)).
    state = {k: np.array(v) for k, v in flax_to_torch_numpy(tiny.params, tiny.config).items()}
    name = "stack.layers.2.block.self_attn.q_proj.weight"
    noise = np.random.default_rng(0).standard_normal(state[name].shape, np.float32)
    state[name] = state[name] + np.float32(0.05) * noise  # ~1e-1 relative: far past float32 noise
    bad = tmp_path / "bad.safetensors"
    save_file(state, bad)
    code, report, output = cli_parity(tmp_path, str(TINY), "--torch", str(bad), "--no-grads", *SMALL)
    assert code == 1, output
    assert report["first_divergence"] == "layers.2.q", report["first_divergence"]
    assert all(p["passed"] for p in report["probes"] if p["name"].startswith(("layers.0.", "layers.1.")))
    # Far past float32 noise, the quant pass's codes at layer 2 differ away from any boundary: no flip hides it.
    assert not report["flips"]["ok"] and report["flips"]["first_divergences"][0]["layer"] == 2, report["flips"]
    assert not next(p for p in report["probes"] if p["name"] == "quant_logits")["passed"]
    # Isolated mode feeds every torch layer the Flax lanes: the failure stays in layer 2.
    code, report, output = cli_parity(tmp_path, str(TINY), "--torch", str(bad), "--no-grads", "--mode", "isolated",
                                      *SMALL)
    assert code == 1, output
    failed = {p["name"].split(".")[1] for p in report["probes"] if not p["passed"] and p["name"].startswith("layers.")}
    assert failed == {"2"}, failed
    assert next(p for p in report["probes"] if p["name"] == "logits")["passed"]


def test_isolated_float32_and_every_parameter_gradient(tiny):
    batch = random_batch(tiny.config, batch=2, seq_len=16, seed=0)
    report = run_parity(tiny.config, tiny.params, batch, mode="isolated", generate=0)
    assert report.passed, report.first_divergence
    grads = report.gradients
    assert grads.passed and len(grads.params) >= 60  # every parameter, judged at 1e-4 (tolerances.py)
    assert grads.total.metrics["rel_l2"] <= F32_PROMISE


LORA = DATA / "needle-v3-tiny.lora.safetensors"
LORA_TARGETS = {f"stack/layers/block/self_attn/{m}/kernel/{w}" for m in ("q_proj", "k_proj", "v_proj", "out_proj",
                                                                        "gate_proj") for w in "AB"}


def test_lora_gradients_per_target_and_a_wrong_b_fails(monkeypatch, tiny):
    """Upstream's merge-inside-the-loss (Flax) against PEFT on the torch twin: each target's A and B within the
    gradient budget; a torch side that reads one layer's B wrong fails (the CLI's exit 1: report.score's rule).
    The engine and CLI call exactly ADAPTER.lora_gradients for --lora; the probes are left out to keep this fast."""
    from parity_tests import lora as lora_parity

    twins = build_twins(ADAPTER, tiny.config, tiny.params, "float32", None, "cpu", "cpu")
    batch, adapter = random_batch(tiny.config, batch=2, seq_len=16, seed=0), read_adapter(LORA)
    profile = get_profile(ADAPTER.budgets, "float32")

    def judged():
        with pinned_precision(True):  # as the CLI runs it
            return _judged_gradients(ADAPTER.lora_gradients(twins, batch, adapter), profile)

    good = judged()
    assert good.passed and {p.name for p in good.params} == LORA_TARGETS
    assert good.total.metrics["rel_l2"] <= F32_PROMISE  # measured 1.2e-6 (2 x 16 batch)

    real = lora_parity.peft_model

    def wrong_b(model, a):
        target = "stack/layers/block/self_attn/v_proj/kernel"
        B = a.lora[target]["B"].copy()
        B[1] = -B[1]  # layer 1: B negated
        return real(model, type(a)({**a.lora, target: {"A": a.lora[target]["A"], "B": B}}, a.scale, a.rank,
                                   a.base))

    monkeypatch.setattr(lora_parity, "peft_model", wrong_b)
    bad = judged()
    assert not bad.passed and not bad.total.passed
    assert not next(p for p in bad.params if p.name.endswith("v_proj/kernel/B")).passed


def test_a_flip_in_the_quant_pass_is_reported_and_the_logits_judged_whole():
    """flips.rounding_flips on recorded calls: one code a step apart on a boundary (row 1, position 4) is a flip,
    reported; the torch pass ran aligned to the Flax codes, so no position is set aside and the logits stay as
    computed for the budget to judge."""
    x = np.full((2, 8, 4), 0.25, np.float32)
    x[..., 0] = 127  # scale 1: x / scale = x
    ref_x, got_x = x.copy(), x.copy()
    ref_x[1, 4, 2] = np.nextafter(np.float32(6.5), np.float32(0))  # codes 6 and 7, within an ulp of 6.5
    got_x[1, 4, 2] = np.nextafter(np.float32(6.5), np.float32(10))

    def call(v):
        return Call(v, np.clip(np.rint(v), -128, 127).astype(np.float32), 8, "stack.layers.0.block.self_attn:act", 0)

    twins = SimpleNamespace(quant_calls={"flax": [call(ref_x)], "torch": [call(got_x)]})
    ref = {"quant_logits": np.zeros((2, 8, 3), np.float32)}
    test = {"quant_logits": np.ones((2, 8, 3), np.float32)}
    found = flips.rounding_flips(twins, ref, test)
    assert found["ok"] and found["aligned"] and found["count"] == 1 and found["divergences"] == 0
    (flip,) = found["flips"]
    assert (flip["layer"], flip["row"], flip["position"], flip["codes"]) == (0, 1, 4, [6, 7])
    assert max(flip["margins_ulp"]) <= 1 and found["affected_positions"] == 0
    assert (test["quant_logits"] == 1).all()
    # Two steps apart is no flip: the report fails.
    got_x[1, 4, 2] = 8.5
    found = flips.rounding_flips(SimpleNamespace(quant_calls={"flax": [call(ref_x)], "torch": [call(got_x)]}), ref,
                                test)
    assert not found["ok"] and found["divergences"] == 1


def test_depth_outside_the_ladder_is_refused_in_one_line(tmp_path):
    for depth, fix in (("1", "rungs run 2..5"), ("6", "rungs run 2..5"), ("deep", "give d with 2 <= d <= 5")):
        code, report, output = cli_parity(tmp_path, str(TINY), "--depth", depth, *SMALL)
        assert code == 2 and report is None, output
        assert fix in output and len(output.strip().splitlines()) == 1, output
    v2 = Path(__file__).resolve().parents[1] / "tests" / "data" / "needle-v2-tiny.pkl"
    code, report, output = cli_parity(tmp_path, str(v2), "--depth", "2", "--generate", "0")
    assert code == 2 and report is None and "has no depth ladder; drop --depth" in output, output
