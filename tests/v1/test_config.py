"""TransformerConfig: upstream fields and defaults, partial dicts, validation that names the fix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import needle_flax
import needle_torch
from convert.errors import ConfigError
from convert.mapping import count_parameters
from convert.v1.config import NEEDLE_V1_PUBLISHED, TransformerConfig

# NEEDLE_V1.md, "Config fields and upstream defaults".
UPSTREAM_DEFAULTS = {
    "vocab_size": 8192, "d_model": 128, "num_heads": 4, "num_kv_heads": 2, "num_encoder_layers": 2,
    "num_decoder_layers": 2, "d_ff": 512, "max_seq_len": 128, "pad_token_id": 0, "rope_theta": 10000.0,
    "dtype": "bfloat16", "activation": "drelu", "num_memory_slots": 64, "dropout_rate": 0.1,
    "contrastive_dim": 128, "no_feedforward": True,
}


def test_fields_and_defaults_are_exactly_upstreams():
    assert TransformerConfig().to_dict() == UPSTREAM_DEFAULTS
    assert [f.name for f in dataclasses.fields(TransformerConfig)] == list(UPSTREAM_DEFAULTS)


def test_both_twins_export_the_same_class():
    assert needle_flax.TransformerConfig is needle_torch.TransformerConfig is TransformerConfig


def test_partial_dict_fills_defaults_and_round_trips():
    partial = {"vocab_size": 512, "d_model": 64, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 64}
    cfg = TransformerConfig(**partial)
    assert cfg.d_ff == 512 and cfg.no_feedforward is True and cfg.head_dim == 16
    # num_heads=4 / num_kv_heads=2 happen to equal the defaults, so they are not "non-default".
    assert cfg.to_dict(only_non_default=True) == {"vocab_size": 512, "d_model": 64, "max_seq_len": 64}
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_numpy_scalars_from_pickles_are_accepted():
    cfg = TransformerConfig(d_model=np.int64(64), rope_theta=np.float32(500.0), no_feedforward=np.bool_(False))
    assert type(cfg.d_model) is int and type(cfg.rope_theta) is float and cfg.no_feedforward is False


@pytest.mark.parametrize("kwargs,needle", [
    ({"d_model": 100, "num_heads": 8}, "config.d_model=100 is not divisible by num_heads=8; pick num_heads from"),
    ({"num_heads": 4, "num_kv_heads": 3}, "config.num_heads=4 is not divisible by num_kv_heads=3"),
    ({"activation": "gelu"}, "config.activation='gelu' is unknown; use one of drelu, swiglu, geglu"),
    ({"dtype": "float64"}, "config.dtype='float64' is unknown; use one of float32, bfloat16, float16"),
    ({"d_model": 64.5}, "config.d_model must be an integer"),
    ({"no_feedforward": "yes"}, "config.no_feedforward must be true or false"),
    ({"num_encoder_layers": 0}, "config.num_encoder_layers must be >= 1"),
    ({"d_model": 12, "num_heads": 4}, "head_dim = d_model/num_heads = 3 is odd"),
    ({"dropout_rate": 1.5}, "config.dropout_rate must be in [0, 1)"),
    ({"pad_token_id": 9000}, "config.pad_token_id=9000 is outside the vocabulary"),
])
def test_invalid_values_name_the_field_and_the_fix(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        TransformerConfig(**kwargs)
    assert needle in str(err.value)


def test_unknown_keys_are_reported_not_dropped():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) 'dmodel', 'n_layers'"):
        TransformerConfig.from_dict({"dmodel": 64, "n_layers": 2, "vocab_size": 10})


def test_config_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransformerConfig().d_model = 3  # type: ignore[misc]


def test_published_model_size():
    # NEEDLE_V1.md: 26,315,421 parameters.
    assert count_parameters(NEEDLE_V1_PUBLISHED) == 26_315_421
    assert sum(p.numel() for p in needle_torch.SimpleAttentionNetwork(NEEDLE_V1_PUBLISHED).parameters()) == 26_315_421
