"""The probe table and capture in both twins: complete, in order, read-only, and matching upstream's numbers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import needle_flax
import needle_torch
from convert.mapping import random_flax_params
from convert.v1.config import TransformerConfig
from needle_flax import SimpleAttentionNetwork as FlaxNet
from needle_torch import SimpleAttentionNetwork as TorchNet
from parity_tests import probes
from parity_tests.devices import pinned_precision
from parity_tests.twins import build_twins
from parity_tests.v1.adapter import ADAPTER
from parity_tests.v1.inputs import random_batch
from parity_tests.v1.probes import probe_table
from parity_tests.v1.runs import flax_probes as flax_run
from parity_tests.v1.runs import torch_probes as torch_run

ATTN_ONLY = TransformerConfig(vocab_size=128, d_model=32, num_heads=4, num_kv_heads=2, num_encoder_layers=2,
                              num_decoder_layers=1, dtype="float32")
WITH_FFN = ATTN_ONLY.replace(no_feedforward=False, d_ff=48, num_encoder_layers=1, num_decoder_layers=2)


def test_table_names_and_order():
    names = [p.name for p in probe_table(ATTN_ONLY)]
    assert names == [
        "encoder.embed",
        "encoder.layers.0.self_attn", "encoder.layers.0.self_attn_residual", "encoder.layers.0.out",
        "encoder.layers.1.self_attn", "encoder.layers.1.self_attn_residual", "encoder.layers.1.out",
        "encoder.out", "decoder.embed",
        "decoder.layers.0.self_attn", "decoder.layers.0.cross_attn", "decoder.layers.0.out",
        "decoder.out", "logits", "contrastive",
    ]


def test_table_with_ffn():
    names = [p.name for p in probe_table(WITH_FFN)]
    assert names[1:5] == ["encoder.layers.0.self_attn", "encoder.layers.0.self_attn_residual",
                          "encoder.layers.0.ffn", "encoder.layers.0.out"]
    assert "decoder.layers.1.ffn" in names
    assert names.index("decoder.layers.1.cross_attn") < names.index("decoder.layers.1.ffn") \
        < names.index("decoder.layers.1.out")


@pytest.mark.parametrize("cfg", [ATTN_ONLY, WITH_FFN], ids=["attn-only", "ffn"])
def test_every_probe_exists_in_both_twins(cfg):
    table = probe_table(cfg)
    assert len({p.name for p in table}) == len(table)
    modules = dict(TorchNet(cfg).named_modules())
    assert [p.torch for p in table if p.torch not in modules] == []
    src = np.ones((1, 5), np.int32)
    model = FlaxNet(cfg)
    params = random_flax_params(cfg, 0)
    _, text = model.apply({"params": params}, src, src, mutable=["intermediates"])
    _, contrastive = model.apply({"params": params}, src, method="encode_contrastive", mutable=["intermediates"])
    values = probes.flax_probes(table, {"text": text["intermediates"], "contrastive": contrastive["intermediates"]})
    assert set(values) == {p.name for p in table}
    for p in table:
        if p.layer is not None:  # stacked on axis 0 by nn.scan: one slice per layer
            stacked = np.asarray(jax.tree_util.tree_leaves(
                text["intermediates"][p.flax[0]][p.flax[1]][p.flax[2]][p.flax[3]])[0])
            n = cfg.num_encoder_layers if p.flax[0] == "encoder" else cfg.num_decoder_layers
            assert stacked.shape[0] == n


def test_flax_probes_reproduce_upstream_goldens(fixture_checkpoint, golden, fixture_batch):
    """The probes read the right values: upstream's own per-layer outputs, computed by upstream's code."""
    with pinned_precision():
        twins = build_twins(ADAPTER, fixture_checkpoint.config, fixture_checkpoint.params, "float32")
        flax = flax_run(twins, fixture_batch)
    cfg = fixture_checkpoint.config
    pairs = [(f"encoder.layers.{i}.out", golden["f32/encoder_layers"][i]) for i in range(cfg.num_encoder_layers)]
    pairs += [(f"decoder.layers.{i}.out", golden["f32/decoder_layers"][i]) for i in range(cfg.num_decoder_layers)]
    pairs += [("encoder.out", golden["f32/encoder_out"]), ("logits", golden["f32/logits"]),
              ("contrastive", golden["f32/contrastive"])]
    for name, want in pairs:
        got = flax[name]
        # upstream f32 on CPU vs this twin: ~1e-6 of the tensor's scale (tests/data/README.md says ~1e-5 abs)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name


def _torch_inputs(batch):
    src, tgt = torch.from_numpy(batch.src).long(), torch.from_numpy(batch.tgt).long()
    return src, tgt, needle_torch.make_padding_mask(src), needle_torch.make_attention_mask(tgt)


def test_capture_changes_no_output():
    """Hooks and sown collections are observers: outputs with and without them are bit-identical."""
    with pinned_precision():
        twins = build_twins(ADAPTER, WITH_FFN, random_flax_params(WITH_FFN, 1), "float32")
        batch = random_batch(WITH_FFN, 3, 9, 6, seed=0, empty_rows=1)
        table = probe_table(twins.config)

        src, tgt, src_mask, tgt_mask = _torch_inputs(batch)
        with torch.inference_mode():
            plain = twins.torch_model(src, tgt, src_mask, tgt_mask, src_mask)
            with probes.torch_capture(twins.torch_model, table) as captured:
                hooked = twins.torch_model(src, tgt, src_mask, tgt_mask, src_mask)
        assert torch.equal(plain, hooked)
        assert torch.equal(captured["logits"], hooked)

        model, params = twins.flax_model, twins.flax_params
        fm = needle_flax.make_padding_mask(batch.src)
        tm = needle_flax.make_attention_mask(batch.tgt)
        plain = jax.jit(lambda p: model.apply({"params": p}, batch.src, batch.tgt, fm, tm, fm))(params)
        sown, _ = jax.jit(lambda p: model.apply({"params": p}, batch.src, batch.tgt, fm, tm, fm,
                                                mutable=["intermediates"]))(params)
        assert np.array_equal(np.asarray(plain), np.asarray(sown))


def test_hooks_are_removed_even_after_an_error():
    model = build_twins(ADAPTER, ATTN_ONLY, random_flax_params(ATTN_ONLY, 0), "float32").torch_model
    table = probe_table(ATTN_ONLY)
    with pytest.raises(RuntimeError, match="boom"):
        with probes.torch_capture(model, table):
            assert any(m._forward_hooks for m in model.modules())
            raise RuntimeError("boom")
    assert not any(m._forward_hooks for m in model.modules())


def test_missing_module_is_named():
    model = build_twins(ADAPTER, ATTN_ONLY, random_flax_params(ATTN_ONLY, 0), "float32").torch_model
    bad = [probes.Probe("x", ("x",), "encoder.nope")]
    with pytest.raises(KeyError, match="encoder.nope"):
        with probes.torch_capture(model, bad):
            pass


def test_substitution_feeds_downstream_modules():
    """A substituted boundary output is what the next stage sees; the captured value is the module's own."""
    twins = build_twins(ADAPTER, ATTN_ONLY, random_flax_params(ATTN_ONLY, 2), "float32")
    batch = random_batch(ATTN_ONLY, 2, 7, 5, seed=1)
    own = torch_run(twins, batch)
    fake = {name: np.zeros_like(v) for name, v in own.items()}
    fed = torch_run(twins, batch, substitute=fake)
    assert np.array_equal(fed["encoder.embed"], own["encoder.embed"])  # the capture precedes the swap
    src, _, src_mask, _ = _torch_inputs(batch)
    with torch.inference_mode():
        zeros = torch.zeros_like(torch.from_numpy(own["encoder.embed"]))
        rope = twins.torch_model._rope(batch.src.shape[1])
        want = twins.torch_model.encoder.layers[0](zeros, src_mask, rope)
    assert np.array_equal(fed["encoder.layers.0.out"], want.numpy())
    # decoder.out is swapped for zeros, so the tied logits are exactly zero
    assert not np.any(fed["logits"])
