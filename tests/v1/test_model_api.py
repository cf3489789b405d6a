"""Model methods of both twins: signatures, dtypes, dropout, rope_keys_only, contrastive."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import needle_flax as nf
import needle_torch as nt
from convert.mapping import random_flax_params
from convert.v1.config import TransformerConfig
from tests.v1.helpers import padded_tokens, rel_err, to_np, torch_model

CFG = TransformerConfig(vocab_size=60, d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, no_feedforward=False,
                        contrastive_dim=8, dtype="float32", dropout_rate=0.5)
F32_REL = 1e-5  # float32 roundoff through 2+2 layers is ~1e-7; see test_twin_parity.py


@pytest.fixture(scope="module")
def setup():
    params = random_flax_params(CFG, seed=7, std=0.2)
    rng = np.random.default_rng(0)
    src = padded_tokens(rng, [6, 4], 6, CFG.vocab_size)
    tgt = padded_tokens(rng, [5, 3], 5, CFG.vocab_size)
    return params, src, tgt


def test_call_equals_encode_then_decode_in_both_twins(setup):
    params, src, tgt = setup
    model = nf.SimpleAttentionNetwork(CFG)
    v = {"params": params}
    sm = nf.make_padding_mask(jnp.asarray(src))
    tm = nf.make_attention_mask(jnp.asarray(tgt))
    enc, mask = model.apply(v, src, sm, method="encode")
    assert mask is sm or np.array_equal(np.asarray(mask), np.asarray(sm))
    via_call = model.apply(v, src, tgt, sm, tm)
    np.testing.assert_array_equal(np.asarray(via_call), np.asarray(model.apply(v, tgt, enc, tm, sm, method="decode")))
    assert via_call.dtype == jnp.float32

    tmodel = torch_model(params, CFG)
    s, t = torch.from_numpy(src).long(), torch.from_numpy(tgt).long()
    tsm, ttm = nt.make_padding_mask(s), nt.make_attention_mask(t)
    with torch.no_grad():
        tenc, tmask = tmodel.encode(s, tsm)
        assert tmask is tsm
        np.testing.assert_array_equal(tmodel(s, t, tsm, ttm).numpy(), tmodel.decode(t, tenc, ttm, tsm).numpy())
        assert rel_err(tmodel(s, t, tsm, ttm).numpy(), np.asarray(via_call)) <= F32_REL


def test_forward_contrastive_in_both_twins(setup):
    params, src, tgt = setup
    q_emb, t_emb, log_temp = nf.SimpleAttentionNetwork(CFG).apply({"params": params}, src, tgt,
                                                                  method="forward_contrastive")
    assert q_emb.shape == (2, 8) and t_emb.shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(q_emb), axis=-1), 1.0, rtol=1e-5)
    assert float(log_temp) == float(params["log_temp"])
    with torch.no_grad():
        tq, tt, tlog = torch_model(params, CFG).forward_contrastive(torch.from_numpy(src).long(),
                                                                    torch.from_numpy(tgt).long())
    assert rel_err(tq.numpy(), np.asarray(q_emb)) <= F32_REL and rel_err(tt.numpy(), np.asarray(t_emb)) <= F32_REL
    assert float(tlog.detach()) == float(log_temp)


def test_dropout_only_in_training(setup):
    params, src, tgt = setup
    model = nf.SimpleAttentionNetwork(CFG)
    det = model.apply({"params": params}, src, tgt)
    # one jitted training forward for every seed (a traced input): 8 s for this test here, 21 s with eager calls
    train = jax.jit(lambda seed: model.apply({"params": params}, src, tgt, deterministic=False,
                                             rngs={"dropout": jax.random.PRNGKey(seed)}))
    first, again, other = (np.asarray(train(seed)) for seed in (0, 0, 1))
    assert not np.allclose(first, np.asarray(det))
    assert not np.allclose(first, other)
    np.testing.assert_array_equal(first, again)

    tmodel = torch_model(params, CFG)
    s, t = torch.from_numpy(src).long(), torch.from_numpy(tgt).long()
    with torch.no_grad():
        evaluated = tmodel(s, t)
        tmodel.train()
        trained = tmodel(s, t, deterministic=False)
        default = tmodel(s, t)  # deterministic=True by default in both twins (upstream's Flax default)
    assert not torch.allclose(evaluated, trained)
    assert torch.equal(evaluated, default)
    assert rel_err(evaluated.numpy(), np.asarray(det)) <= F32_REL


def test_init_all_gives_upstream_initialisation():
    model = nf.SimpleAttentionNetwork(CFG)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 3), jnp.int32),
                        method="init_all")["params"]
    block = params["encoder"]["layers"]["EncoderBlock_0"]
    assert not np.asarray(block["attn_gate"]).any() and not np.asarray(block["ZCRMSNorm_0"]["scale"]).any()
    assert 0.01 < float(np.std(np.asarray(params["embedding"]["embedding"]))) < 0.03  # N(0, 0.02)
    tmodel = nt.SimpleAttentionNetwork(CFG)
    assert not tmodel.encoder.layers[0].attn_gate.any() and not tmodel.encoder.final_norm.scale.any()
    assert 0.01 < float(tmodel.embedding.weight.detach().std()) < 0.03
    # out_proj uses the residual initialiser N(0, 0.02 / sqrt(2 * total_layers)) in both twins.
    expected = 0.02 / np.sqrt(2 * CFG.total_layers)
    assert abs(float(np.std(np.asarray(block["self_attn"]["out_proj"]["kernel"]))) - expected) < 0.4 * expected
    assert abs(float(tmodel.encoder.layers[0].self_attn.out_proj.weight.detach().std()) - expected) < 0.4 * expected


def test_rope_keys_only_attention_matches_between_twins():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    flax_attn = nf.MultiHeadAttention(4, 2, 16, 4, jnp.float32, rope_keys_only=True)
    params = flax_attn.init(jax.random.PRNGKey(0), x, x)["params"]
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * rng.standard_normal(p.shape).astype(np.float32), params)
    rope = nf.precompute_rope_freqs(4, 5)
    expected = flax_attn.apply({"params": params}, x, x, mask=nf.make_causal_mask(5), rope=rope)

    torch_attn = nt.MultiHeadAttention(CFG, rope_keys_only=True)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            getattr(torch_attn, name).weight.copy_(torch.from_numpy(np.array(params[name]["kernel"]).T))
        for name in ("q_norm", "k_norm"):
            getattr(torch_attn, name).scale.copy_(torch.from_numpy(np.array(params[name]["scale"])))
        got = torch_attn(torch.from_numpy(x), torch.from_numpy(x), nt.make_causal_mask(5),
                         nt.precompute_rope_freqs(4, 5))
    assert rel_err(got.numpy(), np.asarray(expected)) <= F32_REL
    # and it is a different function from full RoPE
    full = nf.MultiHeadAttention(4, 2, 16, 4, jnp.float32).apply({"params": params}, x, x,
                                                                  mask=nf.make_causal_mask(5), rope=rope)
    assert rel_err(np.asarray(full), np.asarray(expected)) > 1e-3


def test_torch_twin_computes_in_its_parameter_dtype(setup):
    params, src, tgt = setup
    model = torch_model(params, CFG, "bfloat16")
    with torch.no_grad():
        enc, _ = model.encode(torch.from_numpy(src).long())
        logits = model.decode(torch.from_numpy(tgt).long(), enc)
        emb = model.encode_contrastive(torch.from_numpy(src).long())
    assert (enc.dtype, logits.dtype, emb.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert np.isfinite(to_np(logits)).all()
