"""Quantization parity (parity_tests.v2.quant): the figures against upstream's CQ goldens and against direct numpy.

Goldens: tests/data/needle-v2-tiny.{q4,q2,mixed,t158}.cact, `needle-v2-tiny.quant.npz` (tokens, upstream's
logits of the float and each CQ tree, per-layer lane metrics), `needle-v2-tiny.quant.layers.npz` (upstream's
per-layer lane states), `needle-v2-tiny.quant.V.cq.npz` (upstream's fake-quant leaves) and, for LoRA and greedy
decoding, `needle-v2-tiny.npz` (tests/data/README-cact.md and README.md). The direct computations here are
written in this file from the definitions (numpy / scipy, float64), never with the code under test. Relative
error is max|Δ| / max|ref| over the whole array.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import scipy.special
import torch
from rich.console import Console
from typer.testing import CliRunner

import cli
from convert.atomic import OutputExistsError
from convert.errors import ConfigError, NeedleTwinError
from convert.io import read_checkpoint
from convert.mapping import random_flax_params
from convert.safe_pickle import load_file
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import cact
from convert.v2.bits import groups_along_input
from convert.v2.config import BOS_ID, TransformerConfig
from convert.v2.cq import cq_mixed_params
from convert.v2.lora import merge_lora
from needle_torch.v2 import SimpleAttentionNetwork
from parity_tests.cq_flips import compare_cq, group_view
from parity_tests.inputs import Batch, InputError
from parity_tests.quant import greedy_decode
from parity_tests.quant_report import (
    SCHEMA,
    QuantReport,
    ReportError,
    load_json,
    render_html,
    render_terminal,
    rescore,
    to_json,
    verdict_text,
)
from parity_tests.v2.quant import (
    LOGITS_PATH,
    compare,
    from_cact,
    logit_figures,
    quant,
    quant_batch,
    quantize_bits,
    run_quant,
    state_error,
    unquantized,
    widen,
)
from tests.cq_boundary import straddle

torch.set_float32_matmul_precision("highest")  # float32 parity: no reduced-precision matmul passes

DATA = "tests/data/"
CKPT = DATA + "needle-v2-tiny.pkl"
VARIANTS = ("q4", "q2", "mixed", "t158")
SPECS = {"q4": "4", "q2": "2", "mixed": "default=2,embedding=4,attn.q_proj=3", "t158": "1.58"}
README_TOP1 = {"q4": 0.67, "q2": 0.08, "mixed": 0.17, "t158": 0.02}  # README-cact "Checks", all 48 positions
F32_REL = 1e-5  # the project's float32 parity budget: the twin vs upstream's float32 (measured here <= 2.3e-6)
FIGURE_REL = 1e-5  # KL / Δp figures from our logits vs from upstream's: logits agree to 2.3e-6 (measured <= 1.3e-6)
QUANT = np.load(DATA + "needle-v2-tiny.quant.npz")
LAYERS = np.load(DATA + "needle-v2-tiny.quant.layers.npz")
TOKENS = QUANT["tokens"]  # (3, 16), right-padded with 0; upstream's goldens use the causal mask only
REAL = TOKENS != 0


def rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# ----------------------------------------------------------------------------- direct computations (numpy)


def direct_figures(quant_logits, float_logits, real) -> dict:
    """KL(p_float ‖ p_quant), same top-1 and RMS Δp of the float top token over the positions `real`, from
    scipy's softmax and rel_entr (not the metrics module the code under test uses)."""
    f = np.asarray(float_logits, np.float64)[real]  # (R, V)
    q = np.asarray(quant_logits, np.float64)[real]
    pf, pq = scipy.special.softmax(f, axis=-1), scipy.special.softmax(q, axis=-1)
    kl = scipy.special.rel_entr(pf, pq).sum(-1)  # Σ p_f log(p_f / p_q)
    top = f.argmax(-1)
    rows = np.arange(len(f))
    return {"kl": kl, "same_top1": float(np.mean(q.argmax(-1) == top)),
            "rms_dp": float(np.sqrt(np.mean((pq[rows, top] - pf[rows, top]) ** 2))),
            "kld": {"mean": kl.mean(), "stderr": kl.std(ddof=1) / np.sqrt(kl.size), "median": np.median(kl),
                    "p99": np.percentile(kl, 99), "p999": np.percentile(kl, 99.9), "max": kl.max()}}


def test_the_direct_computation_itself():
    """The direct formulas reproduce README-cact's top-1 figures over all 48 positions, and their KL equals the
    log-sum-exp form written out by hand (so a mistake in either would show)."""
    every = np.ones_like(REAL)
    for v in VARIANTS:
        d = direct_figures(QUANT[f"logits/{v}"], QUANT["logits/float"], every)
        assert round(d["same_top1"], 2) == README_TOP1[v], v
        f, q = QUANT["logits/float"].astype(np.float64).reshape(48, -1), QUANT[f"logits/{v}"].astype(np.float64)
        q = q.reshape(48, -1)
        lf = f - f.max(-1, keepdims=True) - np.log(np.exp(f - f.max(-1, keepdims=True)).sum(-1, keepdims=True))
        lq = q - q.max(-1, keepdims=True) - np.log(np.exp(q - q.max(-1, keepdims=True)).sum(-1, keepdims=True))
        np.testing.assert_allclose(d["kl"], (np.exp(lf) * (lf - lq)).sum(-1), rtol=1e-9, atol=1e-15)
    assert int(REAL.sum()) == 16 + 11 + 6  # the fixture's row lengths (README: 16, 11, 6)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module: the tiny model's matmuls are microseconds, and on a busy 2-core machine
    torch's thread pool costs far more than they do."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(CKPT)


@pytest.fixture(scope="module")
def params32(ckpt):
    return widen(ckpt.params)


@pytest.fixture(scope="module")
def reports(ckpt) -> dict[str, QuantReport]:
    """Each fixture .cact against the fixture checkpoint on the fixture's tokens."""
    return {v: run_quant(ckpt.params, ckpt.config, cact=f"{DATA}needle-v2-tiny.{v}.cact", inputs=TOKENS, steps=4)
            for v in VARIANTS}


# ----------------------------------------------------------------------------- against upstream's goldens


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_upstreams(variant, reports):
    r = reports[variant]
    assert rel(r.arrays["float_logits"], QUANT["logits/float"]) <= F32_REL
    assert rel(r.arrays["quant_logits"], QUANT[f"logits/{variant}"]) <= F32_REL


@pytest.mark.parametrize("variant", VARIANTS)
def test_figures_equal_the_direct_computation(variant, reports):
    """The report's figures (from our torch logits, real positions only) against numpy on upstream's logits."""
    r = reports[variant]
    d = direct_figures(QUANT[f"logits/{variant}"], QUANT["logits/float"], REAL)
    assert r.positions == {"real": 33, "total": 48}
    assert r.same_top1 == d["same_top1"]  # no argmax is near a tie here: the rate is exact
    for k in ("mean", "stderr", "median", "p99", "p999", "max"):
        assert math.isclose(r.kld[k], d["kld"][k], rel_tol=FIGURE_REL), (k, r.kld[k], d["kld"][k])
    assert math.isclose(r.rms_dp, d["rms_dp"], rel_tol=FIGURE_REL)
    # the figure code alone, on the very same arrays: float64 rounding only
    same = logit_figures(QUANT[f"logits/{variant}"], QUANT["logits/float"], REAL)
    for k, v in d["kld"].items():
        assert math.isclose(same["kld"][k], v, rel_tol=1e-9), k
    assert same["same_top1"] == d["same_top1"] and math.isclose(same["rms_dp"], d["rms_dp"], rel_tol=1e-9)


@pytest.mark.parametrize("variant", VARIANTS)
def test_lane_errors_equal_upstreams(variant, reports):
    r = reports[variant]
    f, q = r.arrays["float_states"], r.arrays["quant_states"]
    for i in range(5):
        assert rel(f[f"state.{i}"], LAYERS["float/state"][i]) <= F32_REL, i
        assert rel(q[f"state.{i}"], LAYERS[f"{variant}/state"][i]) <= F32_REL, i
    # upstream's layers/V/* count every position (pads included, causal mask): the same metric over all of them
    for k in ("rel_rms", "max_abs", "rms_diff", "rms_ref", "cos"):
        mine = np.array([state_error(q[f"state.{i}"], f[f"state.{i}"])[k] for i in range(5)])
        np.testing.assert_allclose(mine, QUANT[f"layers/{variant}/{k}"], rtol=F32_REL, err_msg=k)
    embed = state_error(q["embed"], f["embed"])["max_abs"]
    assert math.isclose(embed, float(QUANT[f"layers/{variant}/embed_max_abs"]), rel_tol=F32_REL)
    # the report's figure: the same over real positions, directly from upstream's states
    rows = {row["layer"]: row for row in r.per_layer}
    for i in range(5):
        d = LAYERS[f"{variant}/state"][i][REAL].astype(np.float64) - LAYERS["float/state"][i][REAL]
        direct = np.sqrt(np.mean(d ** 2)) / np.sqrt(np.mean(LAYERS["float/state"][i][REAL].astype(np.float64) ** 2))
        assert math.isclose(rows[f"layer{i:02d}"]["state_rel_rms"], direct, rel_tol=F32_REL), i


@pytest.mark.parametrize("variant", VARIANTS)
def test_bits_spec_gives_the_cact_tree_and_figures(variant, ckpt, params32, reports):
    """--bits on the checkpoint = the .cact read back (the leaves it holds), and so the same figures."""
    from_bits = quantize_bits(params32, ckpt.config, SPECS[variant])
    read = from_cact(f"{DATA}needle-v2-tiny.{variant}.cact", ckpt.config)
    fb, fr = flatten_tree(from_bits.params), flatten_tree(read.params)
    assert set(read.cq_paths) <= set(from_bits.cq_paths)
    for path in read.cq_paths:  # both dequantise through cq_decode on the same rows: bit-identical
        np.testing.assert_array_equal(fb[path], fr[path], err_msg=path)
    for path in fr:
        if path not in read.cq_paths and path.startswith(LOGITS_PATH):  # FP16 records = the fp16 checkpoint
            np.testing.assert_array_equal(fb[path], fr[path], err_msg=path)
    # off the logits path they part, as README-cact says: the quantizer CQs the head kernels, the .cact keeps FP16
    assert not np.array_equal(fb["confidence_head/proj/kernel"], fr["confidence_head/proj/kernel"])
    assert {k: from_bits.widths[k] for k in read.widths} == read.widths
    golden = np.load(f"{DATA}needle-v2-tiny.quant.{variant}.cq.npz")
    bits = json.loads(str(golden["paths_json"])), json.loads(str(golden["bits_json"]))
    for path in bits[0]:  # upstream's JAX quantizer: README-cact's ~1e-6 abs, outside groups a rounding flip moved
        along = groups_along_input(path)
        c = compare_cq(group_view(flatten_tree(params32)[path], along), group_view(golden[path], along),
                       group_view(fb[path], along), bits[1][path], name=path)
        assert not c.divergences and c.max_abs_outside <= 1e-6, (path, [str(e) for e in c.divergences[:3]])
    check = reports[variant].cq_check  # the report's own check of the .cact against this CQ
    assert check["ok"] and check["divergent_groups"] == 0 and check["groups"] > 0, check
    r = run_quant(ckpt.params, ckpt.config, bits=SPECS[variant], inputs=TOKENS, steps=4)
    c = reports[variant]
    assert r.kld == c.kld and r.same_top1 == c.same_top1 and r.rms_dp == c.rms_dp  # identical logits path
    assert r.greedy["first_divergence"] == c.greedy["first_divergence"]
    assert [row["kld_mean"] for row in r.per_layer] == [row["kld_mean"] for row in c.per_layer]
    assert r.quantized["source"] == "bits" and c.quantized["source"] == "cact"
    assert any("off the logits path" in n for n in r.notes)  # bits: MTP and head kernels CQ'd but not compared
    assert any("cannot hold" in n and "mtp" in n for n in c.notes)  # .cact: the MTP head is absent


# ----------------------------------------------------------------------------- attribution


def test_quantizing_nothing_changes_nothing(ckpt, params32):
    batch = quant_batch(ckpt.config, batch=3, seq_len=12, seed=1)
    r = compare(params32, unquantized(params32), ckpt.config, batch, steps=4)
    assert all(v == 0 for k, v in r.kld.items() if k != "stderr") and r.kld["stderr"] == 0
    assert r.same_top1 == 1.0 and r.rms_dp == 0.0 and r.logits_max_rel == 0.0
    assert r.greedy["agree_fraction"] == 1.0 and r.greedy["first_divergence"] == [None, None, None]
    assert r.greedy["float_tokens"] == r.greedy["quant_tokens"]
    assert r.per_tensor == [] and r.attribution["units"] == 0
    assert all(row["kld_mean"] == 0 and row["same_top1"] == 1 and row["state_rel_rms"] == 0 for row in r.per_layer)
    assert r.worst_layer is None and r.worst_tensor is None and r.passed


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_alone_attribution(variant, reports):
    r = reports[variant]
    units = [row["layer"] for row in r.per_layer]
    assert units == ["embedding", "layer00", "engram0", "layer01", "layer02", "engram1", "layer03", "layer04"]
    # what must hold: every unit swapped in at once is exactly the quantized model on the logits path ...
    assert r.attribution["all_units_vs_quantized_max_abs"] == 0.0
    assert r.attribution["units"] == 8
    for row in r.per_layer:
        assert row["kld_mean"] >= 0 and row["kld_max"] >= row["kld_p99"] >= 0  # KL is non-negative
        assert row["other_params"] == []  # the .cact's FP16 records equal the fp16 checkpoint: only CQ differs
        assert row["tensors"]  # ... and each unit holds CQ tensors
    layers = {row["layer"]: row for row in r.per_layer}
    assert layers["layer02"]["tensors"] == [f"layer02.{t}" for t in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                      "out_proj", "mhc_phi_pre", "mhc_phi_post",
                                                                      "mhc_phi_res")]
    assert layers["engram1"]["tensors"] == ["engram1.tables", "engram1.key_proj", "engram1.value_proj"]
    assert layers["engram1"]["site_layer"] == 3
    # Not asserted, because nothing makes it hold (interactions can make a part alone worse than the whole):
    # on this fixture each unit alone moves the mean KL less than everything quantized, while the max KL of a
    # unit alone exceeds the whole model's for t158.


def test_fp16_rounding_of_a_float32_checkpoint_is_attributed_too(tmp_path):
    """A float32 checkpoint's .cact also rounds the norms, gates and routing biases to fp16: those changes land in
    their layer's unit (`other_params`) or a unit of their own (final_norm), so every unit together is still
    exactly the quantized model."""
    config = TransformerConfig(vocab_size=128, d_model=32, num_heads=2, num_kv_heads=1, num_layers=2, mhc_lanes=2,
                               engram_layers=(1,), engram_slots=31, max_seq_len=32)
    params = random_flax_params(config, seed=4, groups=("mtp",))
    path = tmp_path / "f32.cact"
    cact.write_cact(params, config, path, bits=4)
    r = run_quant(params, config, cact=path, batch=2, seq_len=8, steps=2)
    units = {row["layer"]: row for row in r.per_layer}
    assert list(units) == ["embedding", "layer00", "engram0", "layer01", "final_norm"]  # engram0 injects at 1
    assert "stack.final_norm.scale" in units["final_norm"]["other_params"] and units["final_norm"]["tensors"] == []
    assert "stack.layers.1.block.attn_gate" in units["layer01"]["other_params"]
    assert "engrams.0.taps" in units["engram0"]["other_params"]
    assert r.attribution["all_units_vs_quantized_max_abs"] == 0.0
    assert units["final_norm"]["kld_mean"] > 0  # fp16 rounding alone moves the logits a little ...
    assert units["final_norm"]["kld_mean"] < min(units[u]["kld_mean"] for u in ("embedding", "layer00"))  # ... less
    b = run_quant(params, config, bits="4", batch=2, seq_len=8, steps=0)
    assert any("not fp16 values" in n for n in b.notes)


def test_bfloat16_compute(ckpt, reports):
    r = run_quant(ckpt.params, ckpt.config, cact=DATA + "needle-v2-tiny.q4.cact", inputs=TOKENS, steps=2,
                  dtype="bfloat16")
    assert r.environment["dtype"] == "bfloat16" and r.attribution["all_units_vs_quantized_max_abs"] == 0.0
    # bf16 rounding adds to the damage but does not dominate it at 4 bits (measured: mean KL 0.0315 vs 0.0311)
    assert math.isclose(r.kld["mean"], reports["q4"].kld["mean"], rel_tol=0.5)


def test_the_callers_trees_are_left_alone(ckpt, params32):
    """The attribution swaps tensors in and out of the float model: never through memory the caller owns."""
    before = {k: v.copy() for k, v in flatten_tree(params32).items()}
    quantized = quantize_bits(params32, ckpt.config, "2")
    q_before = {k: np.array(v, copy=True) for k, v in flatten_tree(quantized.params).items()}
    compare(params32, quantized, ckpt.config, Batch({"tokens": TOKENS}, "fixture"), steps=0)
    for k, v in flatten_tree(params32).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    for k, v in flatten_tree(quantized.params).items():
        np.testing.assert_array_equal(v, q_before[k], err_msg=k)


def test_a_unit_alone_equals_an_independently_built_model(ckpt, params32, reports):
    """The in-place swap against a fresh model of the float tree with layer 2's slices (and nothing else) taken
    from the quantized tree."""
    read = from_cact(DATA + "needle-v2-tiny.q2.cact", ckpt.config)
    flat, q = copy.deepcopy(flatten_tree(params32)), flatten_tree(read.params)
    for path in read.cq_paths:
        if path.startswith(("stack/layers/", "stack/mhc_")):
            flat[path][2] = q[path][2]
    model = SimpleAttentionNetwork.from_flax(unflatten_tree(flat), ckpt.config, dtype="float32")
    with torch.no_grad():
        alone = model(torch.from_numpy(TOKENS).long()).numpy()
    d = direct_figures(alone, reports["q2"].arrays["float_logits"], REAL)
    row = next(row for row in reports["q2"].per_layer if row["layer"] == "layer02")
    assert math.isclose(row["kld_mean"], d["kld"]["mean"], rel_tol=1e-9)
    assert row["same_top1"] == d["same_top1"] and math.isclose(row["rms_dp"], d["rms_dp"], rel_tol=1e-9)


def test_the_same_tensor_at_the_same_width_gives_the_same_attribution(reports):
    """mixed = default 2, embedding 4, q_proj 3: its embedding alone is q4's, its engram sites alone are q2's."""
    mixed = {row["layer"]: row for row in reports["mixed"].per_layer}
    q4 = {row["layer"]: row for row in reports["q4"].per_layer}
    q2 = {row["layer"]: row for row in reports["q2"].per_layer}
    for key in ("kld_mean", "kld_max", "same_top1", "rms_dp"):
        assert mixed["embedding"][key] == q4["embedding"][key]
        assert mixed["engram0"][key] == q2["engram0"][key] and mixed["engram1"][key] == q2["engram1"][key]
    widths = {t["name"]: t["bits"] for t in reports["mixed"].per_tensor}
    assert widths["embedding"] == 4 and widths["layer03.q_proj"] == 3 and widths["layer03.k_proj"] == 2
    assert widths["engram0.tables"] == 2 and widths["layer00.mhc_phi_res"] == 2
    assert {t["bits"] for t in reports["t158"].per_tensor} == {1.58}


def test_sqnr_per_tensor(ckpt, params32, reports):
    r = reports["q4"]
    read = flatten_tree(from_cact(DATA + "needle-v2-tiny.q4.cact", ckpt.config).params)
    flat = flatten_tree(params32)
    t = next(t for t in r.per_tensor if t["name"] == "layer03.v_proj")
    w = flat["stack/layers/block/self_attn/v_proj/kernel"][3].astype(np.float64)
    q = read["stack/layers/block/self_attn/v_proj/kernel"][3].astype(np.float64)
    assert math.isclose(t["sqnr_db"], 10 * np.log10((w ** 2).sum() / ((w - q) ** 2).sum()), rel_tol=1e-12)
    assert t["bits"] == 4 and t["numel"] == 64 * 32 and t["layer"] == "layer03" and t["logits_path"]
    names = [t["name"] for t in r.per_tensor]
    assert len(names) == 1 + 5 * 8 + 2 * 3 and len(set(names)) == len(names)  # embedding, 8 per layer, 3 per site
    # lower widths cost SQNR: every tensor's q2 SQNR is below its q4 one (Lloyd-Max: ~6 dB a bit)
    q2 = {t["name"]: t["sqnr_db"] for t in reports["q2"].per_tensor}
    assert all(q2[t["name"]] < t["sqnr_db"] for t in r.per_tensor)


# ----------------------------------------------------------------------------- greedy decoding, LoRA


def test_greedy_loop_reproduces_upstreams_recompute_tokens(params32, ckpt):
    """needle-v2-tiny.npz f32/rec_tokens: upstream's non-cached greedy loop on the float model."""
    golden = np.load(DATA + "needle-v2-tiny.npz")
    model = SimpleAttentionNetwork.from_flax(params32, ckpt.config, dtype="float32")
    prompt, want = golden["dec_prompt"], golden["f32/rec_tokens"]
    def logits(t):
        return model(t).float().numpy()

    got = greedy_decode(logits, prompt, 0, want.shape[1], torch.device("cpu"))
    np.testing.assert_array_equal(got, want)
    # right-padded rows decode as their own prompt would alone
    padded = np.zeros((2, prompt.shape[1] + 3), np.int32)
    padded[0, : prompt.shape[1]], padded[1, :4] = prompt[0], prompt[0, :4]
    both = greedy_decode(logits, padded, 0, 5, torch.device("cpu"))
    np.testing.assert_array_equal(both[0], want[0, :5])
    np.testing.assert_array_equal(both[1], greedy_decode(logits, prompt[:, :4], 0, 5, torch.device("cpu"))[0])


def test_greedy_figures(reports):
    g = reports["q4"].greedy
    f, q = np.array(g["float_tokens"]), np.array(g["quant_tokens"])
    firsts = [int(np.flatnonzero(a != b)[0]) if (a != b).any() else None for a, b in zip(f, q, strict=True)]
    assert g["first_divergence"] == firsts and g["rows"] == 3 and g["steps"] == 4
    assert g["agree_fraction"] == sum(4 if s is None else s for s in firsts) / 12


def test_lora_is_merged_before_quantizing(ckpt, params32):
    golden = np.load(DATA + "needle-v2-tiny.npz")
    adapter = load_file(DATA + "needle-v2-tiny.lora.pkl")
    r = run_quant(params32, ckpt.config, bits="4", lora=DATA + "needle-v2-tiny.lora.pkl", inputs=TOKENS, steps=0)
    # float32 params, so the merge happens in float32 as the golden's (upstream's build would merge into the
    # fp16 checkpoint as stored; run_quant merges into whatever tree it is given)
    assert rel(r.arrays["float_logits"], golden["f32/lora_logits"]) <= F32_REL
    assert rel(r.arrays["float_logits"], golden["f32/logits"]) > 1e-3  # the adapter does change the model
    merged = cq_mixed_params(merge_lora(params32, adapter["lora"], adapter["scale"]), {}, 4)
    model = SimpleAttentionNetwork.from_flax(merged, ckpt.config, dtype="float32")
    with torch.no_grad():
        np.testing.assert_array_equal(r.arrays["quant_logits"], model(torch.from_numpy(TOKENS).long()).numpy())
    assert r.quantized["lora"]["scale"] == 2.0 and len(r.quantized["lora"]["targets"]) == 5
    with pytest.raises(NeedleTwinError, match="not in the checkpoint"):
        bad = {"lora": {"stack/nothing/kernel": adapter["lora"]["stack/layers/block/self_attn/q_proj/kernel"]},
               "scale": 1.0}
        run_quant(params32, ckpt.config, bits="4", lora=bad, inputs=TOKENS, steps=0)


# ----------------------------------------------------------------------------- inputs and refusals


def test_inputs(ckpt, tmp_path):
    config = ckpt.config
    b = quant_batch(config, batch=4, seq_len=10, seed=3)
    t = b.tokens
    assert t.shape == (4, 10) and t.dtype == np.int32 and (t[:, 0] == BOS_ID).all()
    lengths = (t != 0).sum(1)
    assert lengths[0] == 10 and (lengths[1:] < 10).all() and (lengths >= 1).all()
    assert all((row[n:] == 0).all() and (row[1:n] >= 14).all() for row, n in zip(t, lengths, strict=True))
    np.testing.assert_array_equal(t, quant_batch(config, batch=4, seq_len=10, seed=3).tokens)  # seeded
    np.save(tmp_path / "ids.npy", TOKENS)
    np.testing.assert_array_equal(quant_batch(config, inputs=str(tmp_path / "ids.npy")).tokens, TOKENS)
    np.testing.assert_array_equal(quant_batch(config, inputs=[[2, 20, 30], [2, 40]]).tokens, [[2, 20, 30], [2, 40, 0]])
    with pytest.raises(InputError, match="only the pad id"):
        quant_batch(config, inputs=[[0, 0]])
    with pytest.raises(InputError, match="outside the vocabulary"):
        quant_batch(config, inputs=[[2, 512]])


def test_refusals(ckpt, params32, tmp_path):
    with pytest.raises(NeedleTwinError, match="exactly one"):
        run_quant(params32, ckpt.config, inputs=TOKENS)
    with pytest.raises(NeedleTwinError, match="exactly one"):
        run_quant(params32, ckpt.config, bits="4", cact=DATA + "needle-v2-tiny.q4.cact", inputs=TOKENS)
    with pytest.raises(ConfigError, match="not a CQ width"):
        run_quant(params32, ckpt.config, bits="5", inputs=TOKENS)
    with pytest.raises(ConfigError, match="no default"):
        run_quant(params32, ckpt.config, bits="embedding=4", inputs=TOKENS)
    other = TransformerConfig(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, num_layers=5, mhc_lanes=2,
                              engram_layers=(1, 3), engram_slots=257, max_seq_len=64)
    path = tmp_path / "other.cact"
    cact.write_cact(random_flax_params(other, seed=0, groups=()), other, path, bits=2)
    with pytest.raises(ConfigError, match="mhc_lanes"):
        run_quant(params32, ckpt.config, cact=path, inputs=TOKENS)


def _with_row(params32, path: str, layer: int, out_row: int, w: np.ndarray) -> dict:
    flat = {k: np.array(a) for k, a in flatten_tree(params32).items()}
    flat[path][layer, :, out_row] = w
    return unflatten_tree(flat)


def test_a_cq_flip_in_the_cact_is_reported_and_a_real_difference_fails(ckpt, params32, tmp_path):
    """A weight group of layer 2's q_proj (output row 7) placed on a CQ rounding boundary (tests/cq_boundary.py):
    the checkpoint holds it one nudge below, the .cact is written from it one nudge above. The report names that one
    flip, judges every other group (exactly equal) and passes; the same group moved by ±1e-3 of itself (~10^4
    float32 steps) is a real difference and the report fails (exit 1)."""
    path, layer, out_row = "stack/layers/block/self_attn/q_proj/kernel", 2, 7
    row = flatten_tree(params32)[path][layer, :, out_row]  # (in,): one CQ group (in = 64, zero-padded to 128)
    below, above, j = straddle(row)
    cact.write_cact(_with_row(params32, path, layer, out_row, above), ckpt.config, tmp_path / "flip.cact", bits=4)
    r = run_quant(_with_row(params32, path, layer, out_row, below), ckpt.config, cact=tmp_path / "flip.cact",
                  batch=2, seq_len=8, steps=0)
    c = r.cq_check
    assert c["ok"] and c["flips"] == 1 and c["divergent_groups"] == 0 and c["rel_outside_max"] == 0.0, c
    (e,) = c["flip_events"]
    assert (e["tensor"], e["kind"], e["coordinate"]) == (path, "code", j) and e["margin_ulps"] <= 1
    assert e["row"] == layer * flatten_tree(params32)[path].shape[2] + out_row  # the (L·out, in) group view
    assert r.passed and r.exit_code == 0

    moved = (row * (1 + 1e-3 * np.random.default_rng(0).choice([-1.0, 1.0], row.shape))).astype(np.float32)
    cact.write_cact(_with_row(params32, path, layer, out_row, moved), ckpt.config, tmp_path / "moved.cact", bits=4)
    r = run_quant(params32, ckpt.config, cact=tmp_path / "moved.cact", batch=2, seq_len=8, steps=0)
    assert not r.cq_check["ok"] and [e["tensor"] for e in r.cq_check["divergence_events"]] == [path]
    assert not r.passed and r.exit_code == 1 and [c["name"] for c in r.checks if not c["passed"]] == ["cq_check"]
    assert "differ from this checkpoint's CQ in 1 group" in verdict_text(r)
    page = render_html(r)
    assert '<span class="verdict fail">FAIL</span>' in page and "DIVERGENCE" in page


def test_a_cact_of_other_weights_is_refused(ckpt, params32, tmp_path):
    """Same geometry, other weights (each moved by 10 % of itself, as another training run's): most CQ groups
    differ beyond rounding flips, so the file is refused before any model runs (exit 2, nothing written)."""
    rng = np.random.default_rng(0)
    other = unflatten_tree({k: (a * (1 + 0.1 * rng.standard_normal(a.shape))).astype(np.float32)
                            for k, a in flatten_tree(params32).items()})
    cact.write_cact(other, ckpt.config, tmp_path / "other.cact", bits=4)
    out = tmp_path / "q.json"
    r = CliRunner().invoke(cli.app, ["quant", CKPT, "--cact", str(tmp_path / "other.cact"), "--json", str(out)])
    assert r.exit_code == 2 and "not exported from this checkpoint" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_imports_no_jax():
    code = "import sys, parity_tests.v2.quant; assert 'jax' not in sys.modules and 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- report: JSON, rescore, outputs


def _strict_json(text: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=reject)


def test_json_round_trip(reports, tmp_path):
    r = reports["mixed"]
    d = _strict_json(to_json(r))
    assert d["schema"] == SCHEMA and d["schema_version"] == 1
    assert set(d["kld"]) == {"mean", "stderr", "median", "p99", "p999", "max"}
    assert {"same_top1", "rms_dp", "per_layer", "per_tensor", "greedy", "checks", "thresholds"} <= set(d)
    assert {"layer", "kld_mean", "state_rel_rms", "tensors"} <= set(d["per_layer"][0])
    assert {"name", "bits", "sqnr_db"} <= set(d["per_tensor"][0])
    assert d["worst"] == {"layer": r.worst_layer["layer"], "tensor": r.worst_tensor["name"]}
    path = tmp_path / "r.json"
    path.write_text(to_json(r))
    back = load_json(path)
    assert back.to_dict() == r.to_dict()
    assert QuantReport.from_dict(d).to_dict() == d
    for broken, match in (({**d, "schema": "x"}, "not a needle-twin quantization"),
                          ({**d, "schema_version": 99}, "schema version"),
                          ({k: v for k, v in d.items() if k != "kld"}, "lacks kld")):
        with pytest.raises(ReportError, match=match):
            QuantReport.from_dict(broken)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ReportError, match="not valid JSON"):
        load_json(tmp_path / "bad.json")


def test_schema_doc_names_every_field(reports):
    """QUANT_SCHEMA.md documents every key the report writes (top level, per_layer, per_tensor, greedy, kld)."""
    doc = open("parity_tests/QUANT_SCHEMA.md", encoding="utf-8").read()
    documented = set(re.findall(r"`([a-z_0-9]+)`", doc))
    d = _strict_json(to_json(reports["q4"]))
    keys = set(d) | set(d["per_layer"][0]) | set(d["per_tensor"][0]) | set(d["greedy"]) | set(d["kld"])
    keys |= set(d["thresholds"]) | set(d["attribution"]) | set(d["positions"]) | set(d["quantized"])
    assert keys - documented == set()


def test_rescore(reports, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(to_json(reports["q4"]))
    saved = load_json(path)
    kl, top1 = saved.kld["mean"], saved.same_top1
    ok = rescore(saved, max_kld=kl * 1.01, min_top1=top1)
    assert ok.passed and ok.exit_code == 0 and [c["passed"] for c in ok.checks] == [True, True, True]
    assert [c["name"] for c in ok.checks] == ["kld.mean", "same_top1", "cq_check"]  # the .cact's CQ stays judged
    bad = rescore(saved, max_kld=kl * 0.99)
    assert not bad.passed and bad.exit_code == 1 and bad.checks[0]["name"] == "kld.mean"
    assert not rescore(saved, min_top1=min(1.0, top1 + 0.01)).passed
    assert rescore(saved, max_kld=saved.kld["max"], kld_stat="max").passed
    assert not rescore(saved, max_kld=saved.kld["max"] * 0.99, kld_stat="max").passed
    unjudged = rescore(bad)
    assert unjudged.passed and [c["name"] for c in unjudged.checks] == ["cq_check"]
    assert "re-scored" in unjudged.notes[-1]
    assert bad.kld == saved.kld and bad.per_layer == saved.per_layer  # figures untouched
    for kwargs in ({"max_kld": -1}, {"min_top1": 1.5}, {"max_kld": 1, "kld_stat": "stderr"}):
        with pytest.raises(ReportError):
            rescore(saved, **kwargs)


def test_null_figure_fails_its_threshold(reports):
    d = _strict_json(to_json(reports["q4"]))
    d["kld"]["mean"] = None  # a non-finite KL is written as null
    assert not rescore(QuantReport.from_dict(d), max_kld=1e9).passed


def test_html_is_self_contained(reports):
    r = reports["t158"]
    page = render_html(r)
    assert "http" not in page and "<script" not in page.lower() and "src=" not in page
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 3
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    assert r.worst_layer["layer"] in page and r.worst_tensor["name"] in page
    assert 'class="worst"' in page


def test_terminal_names_the_worst_layer_and_tensor(reports):
    r = rescore(reports["q2"], max_kld=0.01)
    out = io.StringIO()
    render_terminal(r, Console(file=out, width=120, color_system=None))
    text = out.getvalue()
    assert f"worst layer: {r.worst_layer['layer']}" in text
    assert f"worst tensor: {r.worst_tensor['name']}" in text
    assert "WORST" in text and "QUANT PARITY FAILED" in text and "33 real positions" in text


def test_command(tmp_path):
    j, h = tmp_path / "q.json", tmp_path / "q.html"
    q4 = DATA + "needle-v2-tiny.q4.cact"
    # argument checks come before any checkpoint is read: a missing checkpoint is not what is reported
    with pytest.raises(NeedleTwinError, match="exactly one"):
        quant("missing.pkl")
    with pytest.raises(ConfigError, match="not a CQ width"):
        quant("missing.pkl", bits="7")
    with pytest.raises(ReportError, match="min-top1"):
        quant("missing.pkl", bits="4", min_top1=2)
    with pytest.raises(NeedleTwinError, match="--steps"):
        quant("missing.pkl", bits="4", steps=-1)
    with pytest.raises(NeedleTwinError, match="FLOAT_CKPT"):
        quant("missing.pkl", bits="4")
    r = quant(CKPT, cact=q4, json_path=str(j), html_path=str(h), steps=2, batch=2, seq_len=8, max_kld=10.0)
    assert r.passed and r.exit_code == 0 and load_json(j).to_dict() == r.to_dict()
    assert "<svg" in h.read_text() and r.model["checkpoint"] == CKPT
    before = j.read_bytes()
    with pytest.raises(OutputExistsError):
        quant(CKPT, cact=q4, json_path=str(j), steps=0)
    assert j.read_bytes() == before
    r = quant(CKPT, bits="2", json_path=str(j), force=True, steps=0, batch=2, seq_len=8, min_top1=1.0)
    assert not r.passed and r.exit_code == 1 and load_json(j).quantized["source"] == "bits"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    with pytest.raises(NeedleTwinError, match="same file"):
        quant(CKPT, bits="4", json_path=str(j), html_path=str(j), force=True)


def test_batch_object_inputs(ckpt, params32):
    """compare takes any Batch with a `tokens` array (the parity inputs type)."""
    r = compare(params32, quantize_bits(params32, ckpt.config, "4"), ckpt.config,
                Batch({"tokens": TOKENS}, "fixture"), steps=0)
    assert r.greedy is None and r.inputs["source"] == "fixture" and r.inputs["tokens_lengths"] == [16, 11, 6]
