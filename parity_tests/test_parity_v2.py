"""The Needle 2 parity suite: both twins through the engine the CLI uses, every probe of the lane stack.

float32 holds 1e-5 relative on every probe in both modes (upstream fixture and random configs); half precision
passes its profile; a corrupted layer or routing parameter is caught at that layer, and isolated mode confines
the failure to it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from convert.io import read_checkpoint
from convert.mapping import random_flax_params
from convert.v2.config import TransformerConfig
from convert.v2.lora import read_upstream_adapter
from parity_tests import flips
from parity_tests.engine import pinned_precision, run_parity
from parity_tests.fixtures import V2_LORA, V2_NPZ, V2_PKL
from parity_tests.inputs import Batch
from parity_tests.metrics import max_rel, max_rel_of
from parity_tests.twins import build_twins
from parity_tests.v2 import runs
from parity_tests.v2.adapter import ADAPTER
from parity_tests.v2.inputs import random_batch

F32_PROMISE = 1e-5  # README: float32 twins agree to 1e-5 relative, probe by probe


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(V2_PKL)


@pytest.fixture(scope="module")
def fixture_batch():
    with np.load(V2_NPZ) as z:  # BOS first, right-padded: lengths 16, 11, 6
        return Batch({"tokens": z["tokens"]}, "upstream fixture")


def run(config, params, batch, **kw):
    """The engine with gradients and generation off unless a test asks (each compiles for seconds)."""
    return run_parity(config, params, batch, **{"grads": False, "generate": 0, **kw})


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_float32_fixture_within_1e_5_on_every_probe(ckpt, fixture_batch, mode):
    report = run(ckpt.config, ckpt.params, fixture_batch, mode=mode)
    assert report.passed and report.first_divergence is None
    names = [p.name for p in report.probes]
    for expected in ("embed", "engram_k", "layers.0.hpre", "layers.1.engram_gate", "layers.3.engram_inject",
                     "layers.4.hres", "layers.4.state", "final_hidden", "logits", "mtp_logits", "hidden_cells",
                     "contrastive", "confidence"):
        assert expected in names
    assert "layers.0.engram_gate" not in names  # sites are layers 1 and 3 only
    for p in report.probes:
        assert p.metrics["rel_l2"] <= F32_PROMISE and max_rel_of(p.metrics) <= F32_PROMISE, p.name


CONFIGS = {  # the shapes twin-vs-twin must cover (D not a power of two, MHA/GQA/MQA, attn_dim != D, ...)
    "d48-mqa-orders234": dict(d_model=48, num_heads=4, num_kv_heads=1, engram_orders=(2, 3, 4), mhc_lanes=3,
                              engram_layers=(0, 2), engram_slots=31),
    "attn-dim-mha-4lanes-heads2": dict(d_model=64, attn_dim=32, num_heads=2, num_kv_heads=2, engram_heads=2,
                                       mhc_lanes=4, engram_layers=(1,), engram_slots=17),
    "no-sites-1lane-gqa": dict(d_model=32, num_heads=4, num_kv_heads=2, mhc_lanes=1, engram_layers=(),
                               engram_slots=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_random_configs_with_a_fully_padded_row(name):
    cfg = TransformerConfig(vocab_size=128, num_layers=3, max_seq_len=32, contrastive_dim=8, **CONFIGS[name])
    report = run(cfg, random_flax_params(cfg, seed=3), random_batch(cfg, 4, 11, seed=2, empty_rows=1))
    assert report.passed, report.first_divergence
    pooled = [p for p in report.probes if p.name in ("contrastive", "confidence")]
    assert all(p.metrics.get("nan_matched") for p in pooled)  # the all-pad row: NaN in both, as upstream


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_half_precision_fixture_passes_its_profile(ckpt, fixture_batch, dtype, mode):
    report = run(ckpt.config, ckpt.params, fixture_batch, dtype=dtype, mode=mode)
    assert report.passed, report.first_divergence
    # float16 on CPU: XLA's dot has no f16 -> f32 accumulation for the flash path (upstream fails the same way), so
    # the run takes the non-flash path and says so
    assert any("non-flash" in n for n in report.notes) == (dtype == "float16")
    # Both twins really computed in half precision: float32 agreement would be ~1e-6.
    assert max(p.metrics["rel_l2"] for p in report.probes) > {"bfloat16": 1e-3, "float16": 1e-4}[dtype]


def _corrupt(params, path, fn):
    out = copy.deepcopy(params)
    node = out
    *parents, leaf = path.split("/")
    for p in parents:
        node = node[p]
    node[leaf] = fn(np.asarray(node[leaf], np.float32))
    return out


def _swap_rows(layer):
    """Swap two output features of one layer's Dense kernel (L, in, out): two rows of its torch weight."""
    def change(a):
        a = a.copy()
        a[layer, :, [0, 1]] = a[layer, :, [1, 0]]
        return a
    return change


def _nudge(layer, by=0.05):
    def change(a):
        a = a.copy()
        a[layer] += by
        return a
    return change


CORRUPTIONS = {  # flax path, change, the first probe that must fail
    "layer-1-v_proj-rows-swapped": ("stack/layers/block/self_attn/v_proj/kernel", _swap_rows(1), "layers.1.attn_out"),
    "layer-2-routing-a_res-nudged": ("stack/mhc_a_res", _nudge(2, 0.5), "layers.2.hres"),
    "layer-0-routing-phi_post-nudged": ("stack/mhc_phi_post", _nudge(0), "layers.0.hpost"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_localised(ckpt, fixture_batch, case):
    path, change, first = CORRUPTIONS[case]
    bad = _corrupt(ckpt.params, path, change)
    propagated = run(ckpt.config, ckpt.params, fixture_batch, torch_params=bad)
    assert not propagated.passed and propagated.first_divergence == first
    names = [p.name for p in propagated.probes]
    assert all(p.passed for p in propagated.probes[: names.index(first)])  # nothing upstream of it moved
    isolated = run(ckpt.config, ckpt.params, fixture_batch, torch_params=bad, mode="isolated")
    assert isolated.first_divergence == first
    layer = first.split(".")[1]
    failing = {p.name for p in isolated.probes if not p.passed}
    # Isolated mode feeds every later layer the Flax lanes: only this layer's probes (and the passes that reread
    # the corrupted layer: quant, cells and heads) fail.
    assert all(n.startswith(f"layers.{layer}.") or n in ("quant_logits", "hidden_cells", "contrastive", "confidence")
               for n in failing), failing


# ----------------------------------------------------------------------------- gradients


def test_float32_gradients_full_fine_tuning_and_lora(ckpt, fixture_batch):
    """Every parameter's gradient of upstream's masked CE, and every adapter A/B (Flax: merge inside the loss;
    torch: PEFT), within 1e-5 relative as one vector; per tensor within the reasoned per-parameter budget."""
    adapter = read_upstream_adapter(V2_LORA)
    report = run(ckpt.config, ckpt.params, fixture_batch, grads=True, lora=adapter)
    assert report.passed, report.first_divergence
    for g in (report.gradients, report.lora_gradients):
        assert g.passed and g.total.metrics["rel_l2"] <= F32_PROMISE
        assert abs(g.loss_flax - g.loss_torch) <= F32_PROMISE * abs(g.loss_flax)
    names = {p.name for p in report.lora_gradients.params}
    assert len(names) == 10 and "stack/layers/block/self_attn/gate_proj/kernel/B" in names  # 5 targets x (A, B)
    assert all(p.metrics["rel_l2"] <= F32_PROMISE for p in report.lora_gradients.params)


def test_a_wrong_adapter_on_the_torch_side_fails_lora_gradient_parity(ckpt, fixture_batch, monkeypatch):
    """The comparison can fail: a torch side that reads A and B swapped in one layer is caught by name."""
    from parity_tests import lora as lora_parity

    adapter = read_upstream_adapter(V2_LORA)
    real = lora_parity.peft_model

    def broken(model, a):
        target = "stack/layers/block/self_attn/v_proj/kernel"
        A = a.lora[target]["A"].copy()
        A[2] = A[2][::-1]  # layer 2: rows of A reversed
        return real(model, type(a)({**a.lora, target: {"A": A, "B": a.lora[target]["B"]}}, a.scale, a.rank,
                                   a.base))

    monkeypatch.setattr(lora_parity, "peft_model", broken)
    report = run(ckpt.config, ckpt.params, fixture_batch, lora=adapter)
    assert not report.passed and report.first_divergence is None  # activations (the base) agree
    assert not report.lora_gradients.passed
    assert report.lora_gradients.first_failure.startswith("stack/layers/block/self_attn/")


def test_quant_pass_twins_agree_on_the_fixture(ckpt, fixture_batch):
    """The 8-bit activation fake-quant pass, traced: every quantiser call of both twins walked, the float32 promise
    held on the whole quant logits (flips, if any, aligned), and the pass really quantizes."""
    twins = build_twins(ADAPTER, ckpt.config, ckpt.params, "float32", None, "cpu", "cpu")
    with pinned_precision(True):
        ref = runs.flax_probes(twins, fixture_batch)
        test = runs.torch_probes(twins, fixture_batch, None)
    found = flips.rounding_flips(twins, ref, test)
    assert found["ok"] and found["divergences"] == 0 and found["aligned"], found["summary"]
    # attention input and output per layer, one per engram site, the logits' input
    assert found["calls"] == 2 * ckpt.config.num_layers + len(ckpt.config.engram_layers) + 1
    assert {"quant_logits", "logits"} <= set(ref) and set(ref) == set(test)
    assert max_rel(test["quant_logits"], ref["quant_logits"]) <= F32_PROMISE
    # and the pass really quantizes: its logits are not the float ones
    assert max_rel(ref["quant_logits"], ref["logits"]) > 1e-3


@pytest.mark.parametrize("source", ["fixture", "random-d48"])
def test_float32_generation_cached_equals_recompute_and_twins(ckpt, fixture_batch, source):
    if source == "fixture":
        config, params, batch = ckpt.config, ckpt.params, fixture_batch
    else:
        config = TransformerConfig(vocab_size=128, num_layers=3, max_seq_len=32, contrastive_dim=8,
                                   **CONFIGS["d48-mqa-orders234"])
        params, batch = random_flax_params(config, seed=3), random_batch(config, batch=3, seq_len=12, seed=2,
                                                                         empty_rows=1)
    report = run(config, params, batch, generate=6)
    gen = report.generation
    # greedy tokens identical in float32, cached within 1e-5 of the recompute loop at every step
    assert gen["tokens_equal"] and gen["first_diff_step"] is None and gen["steps_compared"] >= 1
    assert gen["logits_max_rel"] <= F32_PROMISE
    assert gen["flax_cached_vs_recompute_max_rel"] <= F32_PROMISE
    assert gen["torch_cached_vs_recompute_max_rel"] <= F32_PROMISE
    assert gen["cached_equals_recompute_tokens"]
    # the rows are the batch's prompts, left-padded: each run starts from the prompt's last real token
    lengths = (batch.arrays["tokens"] != config.pad_token_id).sum(axis=1)
    last = [int(row[n - 1]) if n else 2 for row, n in zip(batch.arrays["tokens"], lengths, strict=True)]
    assert [row[0] for row in gen["flax_tokens"]] == last
