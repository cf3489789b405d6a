"""The parity suite: both twins through the engine the CLI uses, on every available device.

float32 holds the README's promise (1e-5 relative on every probe and every gradient, on the
upstream fixture); half precision passes its profile; deliberately corrupted torch weights are
caught at the right probe, and isolated mode confines the failure to the corrupted stage.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest
import torch

from convert.errors import NeedleTwinError
from convert.mapping import random_flax_params
from convert.v1.config import TransformerConfig
from parity_tests.devices import DeviceError, jax_device, torch_device
from parity_tests.engine import run_parity
from parity_tests.families import profile
from parity_tests.metrics import max_rel_of as max_rel
from parity_tests.report import verdict_line
from parity_tests.v1.inputs import random_batch

F32_PROMISE = 1e-5  # README: float32 twins agree to 1e-5 relative, probe by probe and gradient by gradient

CONFIGS = {
    "ffn-swiglu": TransformerConfig(vocab_size=256, d_model=64, num_heads=4, num_kv_heads=2, num_encoder_layers=2,
                                    num_decoder_layers=2, no_feedforward=False, d_ff=96, activation="swiglu"),
    "ffn-geglu-mqa": TransformerConfig(vocab_size=256, d_model=32, num_heads=4, num_kv_heads=1, num_encoder_layers=1,
                                       num_decoder_layers=2, no_feedforward=False, d_ff=64, activation="geglu"),
    "drelu-mha": TransformerConfig(vocab_size=256, d_model=32, num_heads=2, num_kv_heads=2, num_encoder_layers=2,
                                   num_decoder_layers=1, no_feedforward=False, d_ff=48, activation="drelu"),
}


def run(*args, **kw):
    """The engine with gradients and generation off unless a test asks (each compiles for seconds)."""
    return run_parity(*args, **{"grads": False, "generate": 0, **kw})


def _run(ckpt_or_cfg, batch, device, **kw):
    if isinstance(ckpt_or_cfg, TransformerConfig):
        cfg, params = ckpt_or_cfg, random_flax_params(ckpt_or_cfg, seed=0)
    else:
        cfg, params = ckpt_or_cfg.config, ckpt_or_cfg.params
    return run(cfg, params, batch, torch_device=device.torch, jax_platform=device.jax, **kw)


# ----------------------------------------------------------------------------- float32


@pytest.mark.slow  # the Flax gradient compiles for a minute on 2 busy cores
@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_float32_fixture_within_1e_5_everywhere(device, mode, fixture_checkpoint, fixture_batch):
    report = _run(fixture_checkpoint, fixture_batch, device, dtype="float32", mode=mode, grads=mode == "propagated")
    assert report.passed and report.first_divergence is None
    for p in report.probes:
        assert p.metrics["rel_l2"] <= F32_PROMISE, p.name
        assert max_rel(p.metrics) <= F32_PROMISE, p.name
    logits = next(p for p in report.probes if p.name == "logits")
    assert logits.metrics["top1"] == 1.0
    if mode == "propagated":
        g = report.gradients
        assert g.passed and g.total.metrics["rel_l2"] <= F32_PROMISE
        assert abs(g.loss_flax - g.loss_torch) <= F32_PROMISE * abs(g.loss_flax)
        for p in g.params:
            assert p.metrics["rel_l2"] <= F32_PROMISE, p.name


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "ffn-swiglu" else n for n in CONFIGS])
def test_float32_configs_with_a_fully_padded_row(device, name):
    cfg = CONFIGS[name]
    batch = random_batch(cfg, 3, 12, 7, seed=4, empty_rows=1)
    grads = name == "ffn-swiglu"  # one FFN config is enough for gradients; each compile costs seconds
    report = _run(cfg, batch, device, dtype="float32", grads=grads)
    assert report.passed, report.first_divergence or report.gradients.first_failure
    assert all(np.isfinite(p.metrics["rel_l2"]) for p in report.probes)
    assert any(n.endswith(".ffn") for n in (p.name for p in report.probes))


# ----------------------------------------------------------------------------- half precision


@pytest.mark.slow  # bf16 gradients compile slowly
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_half_precision_fixture_passes_its_profile(device, dtype, mode, fixture_checkpoint, fixture_batch):
    grads = mode == "propagated" and dtype == "bfloat16"
    report = _run(fixture_checkpoint, fixture_batch, device, dtype=dtype, mode=mode, grads=grads)
    assert report.passed, report.first_divergence
    assert report.profile.dtype == dtype and report.dtype == dtype
    # Both twins really computed in half precision: float32 agreement would be ~1e-7.
    assert max(p.metrics["rel_l2"] for p in report.probes) > {"bfloat16": 1e-3, "float16": 1e-4}[dtype]
    if grads:
        assert report.gradients.passed and all(p.passed is None for p in report.gradients.params)
        assert "and the whole gradient within budget" in verdict_line(report)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_configs_pass(device, name):
    cfg = CONFIGS[name]
    report = _run(cfg, random_batch(cfg, 3, 12, 7, seed=5, empty_rows=1), device, dtype="bfloat16")
    assert report.passed, report.first_divergence


# ----------------------------------------------------------------------------- corrupted weights

E0, E1, D0, D1 = (f"{s}/layers/{b}_0" for s, b in (("encoder", "EncoderBlock"), ("encoder", "EncoderBlock"),
                                                   ("decoder", "DecoderBlock"), ("decoder", "DecoderBlock")))


def _permute_out_features(a, layer):
    """Swap two output features of one layer's Dense kernel (L, in, out): rows of the torch weight."""
    a = a.copy()
    a[layer, :, [0, 1]] = a[layer, :, [1, 0]]
    return a


def _nudge(a, layer=None, by=0.05):
    a = a.astype(np.float32)  # copy
    if layer is None:
        a = a + by
    else:
        a[layer] = a[layer] + by
    return a


def _corrupt(params, path, fn):
    out = copy.deepcopy(params)
    node = out
    *parents, leaf = path.split("/")
    for p in parents:
        node = node[p]
    node[leaf] = fn(node[leaf])
    return out


CORRUPTIONS = {
    # flax path, change, first probe that must fail, probes isolated mode must fail (and no others)
    "decoder-1-q_proj-permuted": (
        f"{D1}/self_attn/q_proj/kernel", lambda a: _permute_out_features(a, 1), "decoder.layers.1.self_attn",
        {"decoder.layers.1.self_attn", "decoder.layers.1.cross_attn", "decoder.layers.1.out"}),
    "encoder-0-v_proj-permuted": (
        f"{E0}/self_attn/v_proj/kernel", lambda a: _permute_out_features(a, 0), "encoder.layers.0.self_attn",
        {"encoder.layers.0.self_attn", "encoder.layers.0.self_attn_residual", "encoder.layers.0.out"}),
    "encoder-1-gate-nudged": (
        f"{E1}/attn_gate", lambda a: _nudge(a, 1), "encoder.layers.1.self_attn_residual",
        {"encoder.layers.1.self_attn_residual", "encoder.layers.1.out"}),
    "decoder-0-cross-k_norm-nudged": (
        f"{D0}/cross_attn/k_norm/scale", lambda a: _nudge(a, 0), "decoder.layers.0.cross_attn",
        {"decoder.layers.0.cross_attn", "decoder.layers.0.out"}),
    "decoder-final-norm-nudged": (
        "decoder/ZCRMSNorm_0/scale", _nudge, "decoder.out", {"decoder.out"}),
    "contrastive-head-nudged": (
        "contrastive_hidden/bias", _nudge, "contrastive", {"contrastive"}),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_localised(case, fixture_checkpoint, fixture_batch):
    path, change, first, isolated_failures = CORRUPTIONS[case]
    params = fixture_checkpoint.params
    bad = _corrupt(params, path, change)
    cfg = fixture_checkpoint.config
    kw = dict(dtype="float32", torch_params=bad)

    propagated = run(cfg, params, fixture_batch, mode="propagated", **kw)
    assert not propagated.passed and propagated.first_divergence == first
    names = [p.name for p in propagated.probes]
    assert all(p.passed for p in propagated.probes[: names.index(first)])  # nothing upstream of it moved

    isolated = run(cfg, params, fixture_batch, mode="isolated", **kw)
    assert isolated.first_divergence == first
    assert {p.name for p in isolated.probes if not p.passed} == isolated_failures


def test_corrupted_bfloat16_is_still_caught(fixture_checkpoint, fixture_batch):
    """A swapped pair of query features is far outside even the bf16 budget."""
    path, change, first, _ = CORRUPTIONS["decoder-1-q_proj-permuted"]
    bad = _corrupt(fixture_checkpoint.params, path, change)
    report = run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, torch_params=bad,
                        dtype="bfloat16", mode="isolated")
    assert report.first_divergence == first


def test_corrupted_weights_fail_gradient_parity(fixture_checkpoint, fixture_batch):
    bad = _corrupt(fixture_checkpoint.params, f"{D0}/cross_attn/v_proj/kernel", lambda a: _permute_out_features(a, 0))
    report = run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, torch_params=bad,
                        grads=True)
    assert not report.gradients.passed and report.gradients.first_failure is not None


# ----------------------------------------------------------------------------- report contents and errors


def test_environment_and_precision_are_recorded_and_restored(fixture_checkpoint, fixture_batch):
    before = (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision())
    report = run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, seeds={"inputs": 7})
    env = report.environment
    assert env["precision"]["pinned"] is True
    assert env["precision"]["jax_default_matmul_precision"] == "highest"
    assert env["precision"]["torch_float32_matmul_precision"] == "highest"
    assert env["precision"]["torch_cuda_matmul_allow_tf32"] is False
    assert env["devices"]["torch"] == "cpu" and env["devices"]["jax"].startswith("cpu:")
    for lib in ("torch", "jax", "flax", "numpy"):
        assert env["versions"][lib]
    assert env["seeds"] == {"inputs": 7}
    assert (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision()) == before
    assert report.num_params == 110_295 and report.model["config"]["d_model"] == 64
    assert report.inputs["src_lengths"] == [16, 11, 6]


def test_unpinned_precision_is_recorded(fixture_checkpoint, fixture_batch):
    report = run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, pin_precision=False)
    assert report.environment["precision"]["pinned"] is False


def test_bad_engine_arguments(fixture_checkpoint, fixture_batch):
    cfg, params = fixture_checkpoint.config, fixture_checkpoint.params
    with pytest.raises(NeedleTwinError, match="--mode 'sideways'"):
        run(cfg, params, fixture_batch, mode="sideways")
    with pytest.raises(NeedleTwinError, match="profile bfloat16-cpu is for bfloat16"):
        run(cfg, params, fixture_batch, dtype="float32", profile=profile(fixture_checkpoint.config, "bfloat16"))


def test_device_names_are_checked():
    with pytest.raises(DeviceError, match="not one of cpu, cuda, cuda:N, mps"):
        torch_device("tpu")
    with pytest.raises(DeviceError, match="cuda:99"):
        torch_device("cuda:99")  # either no CUDA at all or fewer than 100 devices
    with pytest.raises(DeviceError, match="not one of cpu, gpu, tpu"):
        jax_device("quantum")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_jax_platform_is_found_or_named(platform):
    """JAX's own backend list decides which outcome is right: the device when JAX has the platform, else an error
    that names it and what JAX sees (so a wrong refusal on an accelerator machine, or a bogus device on a CPU one,
    fails)."""
    try:
        present = bool(jax.devices(platform))
    except RuntimeError:  # jax: "Unknown backend" / no such platform in this install
        present = False
    if present:
        assert jax_device(platform).platform in ({"gpu", "cuda", "rocm"} if platform == "gpu" else {"tpu"})
    else:
        with pytest.raises(DeviceError, match=f"JAX sees no {platform} device.*--jax-platform"):
            jax_device(platform)
