"""Needle 3 quantization damage (parity_tests/v3/quant.py) against upstream's goldens: tests/data/v3/needle-v3-tiny
(.safetensors, .cact, .npz: float, quant=True, subnetwork and greedy goldens; .cact.npz: logits of `read_export`'s
tree with and without upstream's deploy numerics; README-v3.md). The direct computations are written here from the
definitions (numpy, float64), never with the code under test. Relative error is max|Δ| / max|ref|.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import cli
from convert.io import read_checkpoint
from convert.trees import flatten_tree, unflatten_tree
from convert.v3.cact import write_cact
from convert.v3.lora import merged_params, read_adapter
from parity_tests import flips
from parity_tests.quant_report import load_json, to_json
from parity_tests.v3.quant import (
    SITES,
    build_model,
    compare,
    cq_check_section,
    deploy_sites,
    logits_of,
    quant,
    quant_batch,
    read_cact_tree,
    widen,
)
from tests.cq_boundary import straddle
from tests.torch_threads import torch_threads
from tests.v3.goldens import twin_quant_flips

DATA = "tests/data/v3/"
CKPT, CACT = DATA + "needle-v3-tiny.safetensors", DATA + "needle-v3-tiny.cact"
GOLD = np.load(DATA + "needle-v3-tiny.npz")
READ = np.load(DATA + "needle-v3-tiny.cact.npz")
TOKENS = GOLD["tokens"]  # (3, 20): row 1 left-padded, row 2 right-padded; pad 0
REAL = TOKENS != 0
F32_REL = 1e-5  # the project's float32 budget (the torch twin against upstream's float32: measured 3.8e-7)
ACCEPT_KL = 0.10  # the report's KL mean against the direct one: the acceptance bound (measured 1e-7 relative)


def direct_kl(float_logits, quant_logits, real) -> np.ndarray:
    """KL(p_float ‖ p_quant) per real position, float64 log-sum-exp written out."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)[real]
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    lf, lq = log_softmax(float_logits), log_softmax(quant_logits)
    return (np.exp(lf) * (lf - lq)).sum(-1)


def rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(CKPT)


@pytest.fixture(scope="module")
def params32(ckpt):
    return widen(ckpt.params)


@pytest.fixture(scope="module")
def report(ckpt, params32):
    """The fixture .cact against the fixture checkpoint on the fixture's tokens, every rung."""
    cact = read_cact_tree(CACT, ckpt.config, params32)
    return compare(params32, ckpt.config, quant_batch(ckpt.config, inputs=TOKENS), cact=cact, steps=3,
                   depths=range(2, ckpt.config.num_layers + 1))


# ----------------------------------------------------------------------------- against upstream's goldens


def test_kl_mean_equals_the_direct_kl_of_upstreams_logits(report):
    """Acceptance: the report's KL mean against the KL computed here from upstream's float logits and its logits of
    the .cact as read (deploy numerics on, and off)."""
    direct = direct_kl(GOLD["f32/logits"], READ["quant_logits"], REAL).mean()
    assert abs(report.kld["mean"] - direct) <= ACCEPT_KL * direct, (report.kld["mean"], direct)
    off = direct_kl(GOLD["f32/logits"], READ["logits"], REAL).mean()
    got = report.deploy["models"]["cact_weights_only"]["kld_mean"]
    assert abs(got - off) <= ACCEPT_KL * off, (got, off)
    assert report.positions == {"real": int(REAL.sum()), "total": REAL.size}
    assert report.kld["max"] == pytest.approx(direct_kl(GOLD["f32/logits"], READ["quant_logits"], REAL).max(),
                                              rel=ACCEPT_KL)


@pytest.mark.slow  # traces both twins' quant=True forward (the Flax one compiles with callbacks): ~35 s on 2 cores
def test_logits_equal_upstreams_outside_rounding_flips(report, ckpt):
    """Float logits at the float32 budget; the .cact's quant=True logits at the same budget outside the positions an
    A8 rounding flip reached (found between the two twins' traces of that forward, parity_tests/flips.py)."""
    assert rel(report.arrays["float_logits"], GOLD["f32/logits"]) <= F32_REL
    config = ckpt.config.replace(dtype="float32")
    tree = read_cact_tree(CACT, ckpt.config, widen(ckpt.params)).params
    found, _ = twin_quant_flips(config, tree, TOKENS)  # twin against twin: both codes known
    assert found.ok, found.summary()
    assert flips.masked_rel(report.arrays["quant_logits"], READ["quant_logits"], found.affected) <= F32_REL


def test_deploy_sites_all_on_is_the_models_quant_and_none_on_its_float(ckpt, params32):
    """deploy_sites only switches: every site on is the model's own quant=True bit for bit (which
    tests/v3/test_torch_model.py holds to upstream's f32/quant_logits outside flips), none on its float forward."""
    config = ckpt.config.replace(dtype="float32")
    model = build_model(params32, config, torch.device("cpu"))
    tokens = torch.as_tensor(TOKENS).long()
    with torch.no_grad():
        plain, plain_float = model(tokens, quant=True).numpy(), model(tokens).numpy()
    assert np.array_equal(logits_of(model, tokens, True, SITES), plain)
    assert np.array_equal(logits_of(model, tokens, True, ()), plain_float)
    with torch.no_grad():
        assert np.array_equal(model(tokens, quant=True).numpy(), plain)  # the wrappers are gone afterwards
    with pytest.raises(Exception, match="unknown deploy site"), deploy_sites(("weights",)):
        pass


def test_cact_cq_records_equal_this_projects_cq(report):
    c = report.cq_check
    assert c["ok"] and c["divergent_groups"] == 0 and c["flips"] == 0 and c["groups"] > 0, c
    assert len(c["per_tensor"]) == 24  # 21 CQ kernels / tables / φ leaves + the three heads' probes and query
    assert report.quantized["cq_bits"] == [4]


def test_rungs_against_upstreams_subnetwork_logits(report, ckpt, params32):
    """The depth-3 float rung is upstream's subnetwork golden; the full-depth row is the headline."""
    config = ckpt.config.replace(dtype="float32")
    model = build_model(params32, config, torch.device("cpu"))
    sub = logits_of(model, torch.as_tensor(TOKENS).long(), False, depth=3)
    assert rel(sub, GOLD["f32/subnetwork_logits"]) <= F32_REL
    rows = {r["depth"]: r for r in report.per_rung}
    assert sorted(rows) == [2, 3, 4, 5] and rows[3]["layers"] == [0, 2, 4]  # README-v3: depth_layers
    direct = direct_kl(GOLD["f32/logits"], GOLD["f32/subnetwork_logits"], REAL).mean()
    assert rows[3]["float"]["kld_mean"] == pytest.approx(direct, rel=1e-3)  # logits agree to ~1e-6
    assert rows[5]["float"]["kld_mean"] == 0 and rows[5]["cact"]["kld_mean"] == report.kld["mean"]
    assert rows[5]["fake_quant"]["kld_mean"] == report.deploy["models"]["fake_quant"]["kld_mean"]
    assert rows[2]["float"]["kld_mean"] > rows[4]["float"]["kld_mean"] > 0  # fewer layers, further from the model


def test_greedy_float_tokens_equal_upstreams(ckpt, params32):
    prompt = GOLD["prompt"]
    r = compare(params32, ckpt.config, quant_batch(ckpt.config, inputs=prompt), steps=10)
    assert r.arrays["float_tokens"].tolist() == GOLD["f32/greedy_tokens"].tolist()
    assert r.greedy["steps"] == 10 and r.greedy["rows"] == 1


# ----------------------------------------------------------------------------- sites, layers, tensors


def test_each_site_costs_something_and_the_last_row_is_the_fake_quant(report):
    rows = {r["site"]: r for r in report.per_site}
    assert list(rows) == ["weights", *SITES]
    assert rows["heads"]["cumulative"] == {k: v for k, v in report.deploy["models"]["fake_quant"].items()
                                           if k != "what"}
    for site in ("act", "routing", "query", "kv"):  # each reaches the logits on its own
        assert rows[site]["alone"]["kld_mean"] > 0, site
    assert rows["heads"]["alone"]["kld_mean"] == 0 and rows["heads"]["kld_mean_added"] == 0  # heads only
    assert rows["heads"]["heads"] != rows["kv"]["heads"]  # ... where they move the heads' outputs
    assert rows["weights"]["alone"] is None and rows["weights"]["sites_on"] == []


def test_routing_is_the_mhc_input_and_act_the_rest(ckpt, params32):
    """The routing site is the quantiser call an MHCLayer makes (one per layer); act is every other A8 call."""
    config = ckpt.config.replace(dtype="float32")
    model = build_model(params32, config, torch.device("cpu"))
    tokens = torch.as_tensor(TOKENS).long()
    counts = {}
    for site in ("act", "routing"):
        with flips.trace_torch(model) as calls, torch.no_grad(), deploy_sites((site,)):
            model(tokens, quant=True)
        counts[site] = [c.site.split(":")[0] for c in calls]
    assert counts["routing"] == [f"stack.layers.{i}" for i in range(config.num_layers)]
    assert counts["act"] and not any(s in counts["routing"] for s in counts["act"])


def test_a_unit_alone_equals_an_independently_built_model(report, ckpt, params32):
    """layer02 alone: the float tree with only layer 2's slices of the .cact's leaves, run with quant off."""
    config = ckpt.config.replace(dtype="float32")
    cact = flatten_tree(read_cact_tree(CACT, ckpt.config, params32).params)
    flat = {k: np.array(v) for k, v in flatten_tree(params32).items()}
    for path, a in flat.items():
        if path.startswith("stack/") and not path.startswith("stack/final_norm") and a.shape[:1] == (5,):
            a[2] = cact[path][2]
    model = build_model(unflatten_tree(flat), config, torch.device("cpu"))
    logits = logits_of(model, torch.as_tensor(TOKENS).long(), False)
    row = next(r for r in report.per_layer if r["layer"] == "layer02")
    assert row["kld_mean"] == pytest.approx(direct_kl(report.arrays["float_logits"], logits, REAL).mean(), rel=1e-9)
    assert [r["layer"] for r in report.per_layer] == ["embedding", "layer00", "engram0", "layer01", "layer02",
                                                      "engram1", "layer03", "layer04", "final_norm"]
    assert all(r["state_rel_rms"] > 0 for r in report.per_layer)


def test_sqnr_per_tensor(report, params32):
    cact = flatten_tree(read_cact_tree(CACT, read_checkpoint(CKPT).config, params32).params)
    t = next(t for t in report.per_tensor if t["name"] == "layer03.q_proj")
    w = np.asarray(flatten_tree(params32)[t["param"]][3], np.float64)
    q = np.asarray(cact[t["param"]][3], np.float64)
    assert t["sqnr_db"] == pytest.approx(10 * np.log10((w**2).sum() / ((w - q) ** 2).sum()), rel=1e-12)
    assert t["bits"] == 4 and t["layer"] == "layer03"
    heads = [t for t in report.per_tensor if t["name"].startswith("router_head")]
    assert {t["name"] for t in heads} == {"router_head.probes", "router_head.query", "router_head.proj"}
    assert not any(t["logits_path"] for t in heads)


def test_lora_is_merged_before_quantizing(ckpt, params32, tmp_path):
    """The float model is base + adapter as upstream merges it (its f32/lora_logits golden); a .cact built from the
    merged tree (`needle build --lora`) is then this model's CQ in every group, and without --lora it is not."""
    lora = DATA + "needle-v3-tiny.lora.safetensors"
    built = tmp_path / "lora.cact"
    write_cact(merged_params(read_adapter(lora), params32), ckpt.config, built)
    r = quant(CKPT, cact=str(built), lora=lora, inputs=TOKENS, steps=0, ckpt=ckpt)
    assert r.quantized["lora"]["path"].endswith("lora.safetensors")
    assert rel(r.arrays["float_logits"], GOLD["f32/lora_logits"]) <= F32_REL
    assert rel(r.arrays["float_logits"], GOLD["f32/logits"]) > 1e-3  # the adapter does change the model
    assert r.cq_check["ok"] and r.cq_check["divergent_groups"] == 0 and r.passed
    base = cq_check_section(params32, read_cact_tree(built, ckpt.config, params32))
    assert not base["ok"] and base["divergent_groups"] > 0  # judged against the base alone, it is not its CQ


# ----------------------------------------------------------------------------- the command


def _run(*args):
    return CliRunner().invoke(cli.app, ["quant", *args])


def test_command_kl_equals_upstreams_and_sections_rescore(tmp_path):
    """Acceptance, through the command: `quant CKPT --cact X.cact --json q.json` on upstream's tokens gives the KL
    mean computed here from upstream's float and .cact-read logits; the sections are written and re-score."""
    j, h, r2 = tmp_path / "q.json", tmp_path / "q.html", tmp_path / "r.json"
    res = _run(CKPT, "--cact", CACT, "--json", str(j), "--html", str(h), "--depth", "all", "--steps", "2",
               "--inputs", DATA + "needle-v3-tiny.npz", "--quiet")
    assert res.exit_code == 0 and "QUANT PARITY HOLDS" in res.output, res.output  # the .cact's CQ is judged
    d = json.loads(j.read_text())
    direct = direct_kl(GOLD["f32/logits"], READ["quant_logits"], REAL).mean()
    assert abs(d["kld"]["mean"] - direct) <= ACCEPT_KL * direct, (d["kld"]["mean"], direct)
    assert d["positions"]["real"] == int(REAL.sum()) and d["checks"][0]["name"] == "cq_check"
    assert [r["site"] for r in d["per_site"]] == ["weights", *SITES]
    assert [r["depth"] for r in d["per_rung"]] == [2, 3, 4, 5]
    assert set(d["deploy"]["models"]) == {"fake_quant", "cact", "cact_weights_only", "cact_vs_fake_quant"}
    assert d["cq_check"]["ok"] and d["model"]["family"] == "v3"
    page = h.read_text()
    assert page.count("<svg") >= 7 and "Per deploy-numerics site" in page and "Per ladder rung" in page
    res = CliRunner().invoke(cli.app, ["rescore", str(j), "--max-kld", "1e-9", "--json", str(r2), "--quiet"])
    assert res.exit_code == 1 and "FAILED" in res.output
    again = json.loads(r2.read_text())
    for key in ("deploy", "per_site", "per_rung", "cq_check", "kld"):
        assert again[key] == d[key], key
    assert load_json(r2).per_rung == d["per_rung"]
    assert [c["name"] for c in again["checks"]] == ["kld.mean", "cq_check"]  # the .cact check stays judged
    res = CliRunner().invoke(cli.app, ["rescore", str(j), "--max-kld", "1", "--quiet"])
    assert res.exit_code == 0 and "HOLDS" in res.output


def test_schema_doc_names_every_field(report):
    """parity_tests/QUANT_SCHEMA.md documents every key the Needle 3 sections write."""
    import re

    doc = open("parity_tests/QUANT_SCHEMA.md", encoding="utf-8").read()
    documented = set(re.findall(r"`([a-z_0-9]+)`", doc))
    d = json.loads(to_json(report))
    keys = set(d) | set(d["deploy"]) | set(d["deploy"]["models"]) | set(d["deploy"]["models"]["cact"])
    keys |= set(d["per_site"][1]) | set(d["per_site"][1]["cumulative"]) | set(d["per_rung"][0])
    keys |= set(d["cq_check"]) | set(d["cq_check"]["per_tensor"][0]) | set(d["per_layer"][0])
    keys |= set(d["per_tensor"][0]) | set(d["quantized"]) | set(d["quantized"]["deploy"]) | set(d["model"])
    keys |= {k for row in d["per_site"] for h in row["heads"].values() for k in h}
    assert keys - documented == set()


@pytest.mark.parametrize("ckpt_path, args, words", [
    (CKPT, ["--cact", "tests/data/needle-v2-tiny.q4.cact"], "Needle 2 file"),
    (CKPT, ["--cact", DATA + "missing.cact"], "no such file"),
    (CKPT, ["--cact", CKPT], "not a Needle 3 .cact file"),
    (CKPT, ["--cact", CACT, "--depth", "9"], "outside the ladder"),
    (CKPT, ["--bits", "7"], "width of 1, 2, 3 or 4"),
    (CKPT, ["--dtype", "bfloat16"], "float32 only"),
    (CKPT, ["--lora", DATA + "flashsplit.lora.safetensors"], "the adapter is for another base"),
    (CKPT, ["--device", "cuda:99"], "--device cuda:99"),
    ("tests/data/needle-v1-tiny.pkl", ["--cact", CACT], "quantization parity is for Needle 2 and Needle 3"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, ckpt_path, args, words):
    j = tmp_path / "q.json"
    res = _run(ckpt_path, *args, "--json", str(j))
    assert res.exit_code == 2 and words in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not j.exists()


def test_a_2_bit_cact_is_judged_at_its_own_widths(tmp_path, ckpt, params32):
    """A .cact written at 2 bits (the heads stay CQ-4, as the exporter writes them): each CQ leaf is checked at its
    record's width, and the fake-quant runs at the file's weight width."""
    path = tmp_path / "q2.cact"
    write_cact(params32, ckpt.config, path, bits=2)
    r = quant(CKPT, cact=str(path), batch=2, seq_len=8, steps=0, ckpt=ckpt)
    assert r.quantized["cq_bits"] == [2, 4] and "params, 2)" in r.deploy["models"]["fake_quant"]["what"]
    assert r.cq_check["ok"] and r.cq_check["divergent_groups"] == 0 and r.passed
    bits = {t["name"]: t["bits"] for t in r.per_tensor}
    assert bits["layer01.q_proj"] == bits["engram0.tables"] == bits["embedding"] == 2
    assert bits["router_head.proj"] == bits["router_head.probes"] == 4
    assert r.deploy["models"]["cact_vs_fake_quant"]["kld_mean"] < r.kld["mean"] / 10  # alike: same widths


def test_a_cact_of_another_model_is_refused(tmp_path):
    j = tmp_path / "q.json"
    res = _run(DATA + "mqa.safetensors", "--cact", CACT, "--json", str(j))
    assert res.exit_code == 2 and "describes another model" in res.output and not j.exists()


def test_a_cact_of_other_weights_is_refused(tmp_path, ckpt):
    """Same geometry, other weights (every weight moved by 10 % of itself, as another training run's would be): most
    CQ groups differ beyond rounding flips."""
    flat = {k: np.asarray(v, np.float32) for k, v in flatten_tree(ckpt.params).items()}
    rng = np.random.default_rng(0)
    other = unflatten_tree({k: (v * (1 + 0.1 * rng.standard_normal(v.shape))).astype(np.float32)
                            for k, v in flat.items()})
    write_cact(other, ckpt.config, tmp_path / "other.cact")
    j = tmp_path / "q.json"
    res = _run(CKPT, "--cact", str(tmp_path / "other.cact"), "--json", str(j))
    assert res.exit_code == 2 and "not exported from this checkpoint" in res.output, res.output
    assert not j.exists()


def test_a_cq_flip_in_the_cact_is_reported_and_the_rest_judged(tmp_path, ckpt, params32):
    """A weight group of layer 1's q_proj (output row 5) moved so one rotated coordinate sits on a codebook midpoint
    (tests/cq_boundary.py); the checkpoint holds it one nudge below, the .cact is written from it one nudge above: the
    report's cq_check names that one flip, judges every other group (exactly equal) and the report passes."""
    path, layer, out_row = "stack/layers/block/self_attn/q_proj/kernel", 1, 5
    flat = {k: np.array(a) for k, a in flatten_tree(params32).items()}
    below, above, j = straddle(flat[path][layer, :, out_row])  # (in,): one CQ group (in = 64, zero-padded to 128)
    trees = []
    for w in (below, above):
        k = flat[path].copy()
        k[layer, :, out_row] = w
        trees.append(unflatten_tree({**flat, path: k}))
    write_cact(trees[1], ckpt.config, tmp_path / "flip.cact")
    cact = read_cact_tree(tmp_path / "flip.cact", ckpt.config, trees[0])
    r = compare(trees[0], ckpt.config, quant_batch(ckpt.config, batch=2, seq_len=8), cact=cact, steps=0)
    c = r.cq_check
    assert c["ok"] and c["flips"] == 1 and c["divergent_groups"] == 0 and c["rel_outside_max"] == 0.0, c
    (e,) = c["flip_events"]
    assert (e["tensor"], e["kind"], e["coordinate"]) == (path, "code", j)
    assert e["row"] == layer * flat[path].shape[2] + out_row and e["margin_ulps"] <= 1
    assert r.passed and r.exit_code == 0

    # a real change in the same place: that layer's q_proj moved by ±1e-3 of itself (~10^4 float32 steps)
    k = flat[path].copy()
    k[layer] *= 1 + 1e-3 * np.random.default_rng(0).choice([-1.0, 1.0], k[layer].shape)
    write_cact(unflatten_tree({**flat, path: k.astype(np.float32)}), ckpt.config, tmp_path / "moved.cact")
    r = compare(params32, ckpt.config, quant_batch(ckpt.config, batch=2, seq_len=8),
                cact=read_cact_tree(tmp_path / "moved.cact", ckpt.config, params32), steps=0)
    assert not r.cq_check["ok"] and r.cq_check["divergent_groups"] > 0
    assert {e["tensor"] for e in r.cq_check["divergence_events"]} == {path}
    assert not r.passed and r.exit_code == 1 and [c["name"] for c in r.checks if not c["passed"]] == ["cq_check"]
