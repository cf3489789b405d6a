"""The declarative Flax <-> torch mapping: complete, strict, and bit-exact both ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import needle_flax
import needle_torch
from convert.errors import CheckpointError
from convert.mapping import count_parameters, flax_to_torch, random_flax_params, torch_to_flax
from convert.trees import flatten_tree
from convert.v1 import FAMILY
from convert.v1.config import TransformerConfig

SMALL = dict(vocab_size=50, d_model=16, num_heads=2, num_kv_heads=1, d_ff=24, contrastive_dim=8)


@st.composite
def configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([4, 6]))
    return TransformerConfig(
        vocab_size=draw(st.integers(8, 40)), d_model=heads * head_dim, num_heads=heads, num_kv_heads=kv,
        num_encoder_layers=draw(st.integers(1, 3)), num_decoder_layers=draw(st.integers(1, 3)),
        d_ff=draw(st.integers(1, 12)), contrastive_dim=draw(st.integers(1, 6)),
        no_feedforward=draw(st.booleans()),
    )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 2**16))
def test_round_trip_is_bit_exact(config, dtype, seed):
    params = random_flax_params(config, seed=seed, dtype=dtype)
    # Special values must survive too: signed zero, inf, nan payloads are copied, not computed.
    emb = params["embedding"]["embedding"]
    emb.reshape(-1)[:3] = np.array([-0.0, np.inf, np.nan], dtype=np.float32).astype(emb.dtype)
    state = flax_to_torch(params, config)
    assert all(t.dtype == {"float32": torch.float32, "float16": torch.float16,
                           "bfloat16": torch.bfloat16}[dtype] for t in state.values())
    back = torch_to_flax(state, config)
    flat_a, flat_b = flatten_tree(params), flatten_tree(back)
    assert flat_a.keys() == flat_b.keys()
    assert all(_same_bits(flat_a[k], flat_b[k]) for k in flat_a)
    # And torch -> Flax -> torch.
    again = flax_to_torch(back, config)
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    assert state.keys() == again.keys()
    assert all(state[k].dtype == again[k].dtype and torch.equal(bits(state[k]), bits(again[k])) for k in state)


@pytest.mark.parametrize("overrides", [{}, {"no_feedforward": False}, {"num_kv_heads": 2, "num_encoder_layers": 3}])
def test_table_covers_both_twins_exactly(overrides):
    config = TransformerConfig(**{**SMALL, **overrides})
    torch_shapes = {k: tuple(v.shape) for k, v in needle_torch.SimpleAttentionNetwork(config).state_dict().items()}
    assert torch_shapes == FAMILY.table(config).expected("torch")
    model = needle_flax.SimpleAttentionNetwork(config)
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3), jnp.int32), jnp.ones((1, 2), jnp.int32),
                           method="init_all")
    flax_shapes = {k: tuple(v.shape) for k, v in flatten_tree(variables["params"]).items()}
    assert flax_shapes == FAMILY.table(config).expected("flax")
    assert sum(int(np.prod(s)) for s in flax_shapes.values()) == count_parameters(config)


def test_state_dict_loads_strictly_and_keeps_dtype():
    config = TransformerConfig(**SMALL)
    state = flax_to_torch(random_flax_params(config, dtype="bfloat16"), config)
    model = needle_torch.SimpleAttentionNetwork.from_flax(random_flax_params(config, dtype="bfloat16"), config)
    assert model.dtype == torch.bfloat16
    missing, unexpected = needle_torch.SimpleAttentionNetwork(config).load_state_dict(state, strict=True)
    assert not missing and not unexpected


def test_transpose_and_stacking_are_the_documented_ones():
    config = TransformerConfig(**SMALL, num_encoder_layers=2)
    params = random_flax_params(config, seed=5)
    state = flax_to_torch(params, config)
    kernel = params["encoder"]["layers"]["EncoderBlock_0"]["self_attn"]["k_proj"]["kernel"]  # (L, D, KH)
    np.testing.assert_array_equal(state["encoder.layers.1.self_attn.k_proj.weight"].numpy(), kernel[1].T)
    gate = params["decoder"]["layers"]["DecoderBlock_0"]["cross_attn_gate"]  # (L,)
    assert state["decoder.layers.0.cross_attn_gate"].shape == ()
    assert state["decoder.layers.0.cross_attn_gate"] == gate[0]


def test_one_error_lists_every_missing_unexpected_and_misshaped_entry():
    config = TransformerConfig(**SMALL)
    params = random_flax_params(config)
    del params["log_temp"]
    del params["encoder"]["final_norm"]
    params["extra"] = {"kernel": np.zeros(3, np.float32)}
    params["decoder"]["ZCRMSNorm_0"]["scale"] = np.zeros(7, np.float32)
    with pytest.raises(CheckpointError) as err:
        flax_to_torch(params, config)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in ("missing 2", "log_temp", "encoder/final_norm/scale", "unexpected 1", "extra/kernel",
                   "decoder/ZCRMSNorm_0/scale is (7,), expected (16,)"):
        assert needle in msg, needle


def test_layer_count_mismatch_is_named():
    config = TransformerConfig(**SMALL, num_decoder_layers=2)
    state = flax_to_torch(random_flax_params(config), config)
    with pytest.raises(CheckpointError, match=r"missing .*decoder\.layers\.2\.self_attn\.q_proj\.weight"):
        torch_to_flax(state, config.replace(num_decoder_layers=3))


def test_mixed_layer_dtypes_are_refused():
    config = TransformerConfig(**SMALL)
    state = flax_to_torch(random_flax_params(config), config)
    state["encoder.layers.1.attn_gate"] = state["encoder.layers.1.attn_gate"].half()
    with pytest.raises(CheckpointError, match="mixed dtypes"):
        torch_to_flax(state, config)


def test_convert_package_imports_neither_torch_nor_jax():
    import subprocess
    import sys

    code = ("import sys, convert, convert.mapping, convert.v1.config, convert.v2.config; "
            "bad = [m for m in ('torch', 'jax', 'flax') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
