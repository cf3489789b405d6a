"""Needle 3's framework-free part: the config (upstream's three constructors), parameter counts from the mapping
table, the ladder and width operations against upstream's own rung files, and bit-exact Flax <-> torch mapping."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import convert
from convert.errors import ConfigError
from convert.io import read_checkpoint
from convert.registry import family_named
from convert.trees import flatten_tree
from convert.v3 import (
    TransformerConfig,
    ladder_config,
    ladder_layer_indices,
    ladder_order,
    ladder_slice,
    width_config,
    width_slice,
)
from convert.v3.config import hada_blocks, hada_perms
from tests.v3.goldens import DATA, NAMES, load

V3 = family_named("v3")
HEADS = ("embedding_head", "confidence_head", "router_head")


# ----------------------------------------------------------------------------- config


def test_defaults_are_upstreams_class_defaults():
    c = TransformerConfig()
    assert (c.vocab_size, c.d_model, c.num_heads, c.num_kv_heads, c.num_layers) == (16384, 768, 12, 2, 20)
    assert c.head_dims == (48, 64) and c.hada_dim == 1024 and c.hada_blocks == (32, 32)
    assert (c.engram_heads_resolved, c.num_engram_tables, c.engram_sub_dim) == (3, 6, 128)
    assert c.engram_layers == (3, 7, 11, 15, 19) and c.global_layers == (4, 9, 14, 19)


def test_from_saved_turns_missing_features_off():
    """upstream's loader: a missing feature key is off (no taps, no window, head dims D//H), the rest default."""
    c = TransformerConfig.from_saved({"d_model": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 3,
                                      "engram_layers": [1]})
    assert (c.qkv_conv_taps, c.sliding_window, c.global_layers, c.out_vocab, c.qk_head_dim) == (0, 0, (), 0, 0)
    assert c.head_dims == (16, 16)
    assert c.engram_slots == 18432 and c.dtype == "bfloat16"  # not feature keys: class defaults


def test_legacy_attn_dim_keyword():
    """upstream's constructor: attn_dim sets both head dims and turns window/global off, where not passed."""
    c = TransformerConfig.from_kwargs(d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, attn_dim=32,
                                      engram_layers=(1,), v_head_dim=24)
    assert (c.qk_head_dim, c.v_head_dim, c.sliding_window, c.global_layers) == (8, 24, 0, ())


def test_needle2_config_is_refused_by_name():
    with pytest.raises(ConfigError, match="Needle 2"):
        TransformerConfig.from_saved({"d_model": 64, "attn_dim": 64, "num_heads": 4})
    both = TransformerConfig.from_saved({"d_model": 64, "attn_dim": 32, "num_heads": 4, "qk_head_dim": 8,
                                         "num_kv_heads": 2, "num_layers": 4,
                                         "engram_layers": [1]})
    assert both.qk_head_dim == 8  # with qk_head_dim present upstream loads it and ignores attn_dim


@pytest.mark.parametrize("change, words", [
    ({"num_kv_heads": 5}, "num_kv_heads"), ({"qk_head_dim": 7}, "odd"), ({"engram_layers": (3, 3)}, "repeats"),
    ({"engram_layers": (25,)}, "outside"), ({"ladder_order": (0, 1)}, "permutation"), ({"out_vocab": 10**6},
                                                                                       "out_vocab"),
    ({"dtype": "float64"}, "dtype"),
])
def test_bad_configs_name_the_field(change, words):
    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(TransformerConfig(), **change)


def test_kv_windows_match_upstreams_formula_values():
    """NEEDLE_V3.md §5's checked values: default 3456; the default rungs 4096; the tiny fixture 160."""
    c = TransformerConfig()
    assert c.kv_budget_window == 3456 and c.effective_kv_window == 3456
    assert all(ladder_config(c, d).kv_budget_window == 4096 for d in (2, 4, 8, 12))
    assert dataclasses.replace(c, kv_window=1000).effective_kv_window == 1000


@pytest.mark.parametrize("name", NAMES)
def test_kv_window_equals_upstreams(name):
    g = load(name)
    assert g.config.effective_kv_window == int(g.arrays["effective_kv_window"])


# ----------------------------------------------------------------------------- counts, from the mapping table


def test_parameter_counts_equal_upstreams_init():
    """NEEDLE_V3.md §2 (jax.eval_shape of upstream's init): 127,240,240 plain, 127,849,762 with all three heads."""
    c = TransformerConfig()
    assert convert.count_parameters(c) == 127_240_240
    assert convert.count_parameters(c, HEADS) == 127_849_762
    assert [convert.count_parameters(ladder_config(c, d)) for d in (2, 4, 8)] == [31_718_584, 35_514_992, 58_446_304]
    assert convert.count_parameters(dataclasses.replace(c, vocab_size=8192)) == 120_948_784
    tiny = TransformerConfig(vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2, num_layers=5, qk_head_dim=8,
                             v_head_dim=16, engram_layers=(1, 3), engram_slots=64, embedding_dim=16)
    assert convert.count_parameters(tiny, HEADS) == 163_514


@pytest.mark.parametrize("name", NAMES)
def test_upstream_tree_matches_the_table(name):
    g = load(name)
    flat = {k: v.shape for k, v in flatten_tree(g.params).items()}
    groups = V3.groups_in(flat, "flax", g.config)
    assert flat == V3.table(g.config, groups).expected("flax")


# ----------------------------------------------------------------------------- ladder and width


def test_ladder_order_is_upstreams_bisection():
    assert ladder_order(20) == (0, 19, 9, 14, 4, 6, 11, 16, 2, 7, 12, 17, 1, 3, 5, 8, 10, 13, 15, 18)
    assert ladder_layer_indices(16, 8) == (0, 3, 5, 7, 9, 11, 13, 15)
    assert ladder_layer_indices(20, 12) == (0, 2, 4, 6, 7, 9, 11, 12, 14, 16, 17, 19)
    c4, c8 = ladder_config(TransformerConfig(), 4), ladder_config(TransformerConfig(), 8)
    assert (c4.engram_layers, c4.global_layers, c8.engram_layers, c8.global_layers) == ((3,), (1, 2, 3), (4, 7),
                                                                                      (1, 3, 5, 7))
    with pytest.raises(ConfigError, match="depth"):
        ladder_layer_indices(20, 1)


def test_rungs_of_rungs_stay_nested():
    """A rung carries its parent's order renumbered, so its own rungs are the parent's smaller rungs."""
    c = TransformerConfig()
    parent8 = ladder_layer_indices(c, 8)
    child = ladder_config(c, 8)
    assert tuple(parent8[i] for i in ladder_layer_indices(child, 4)) == ladder_layer_indices(c, 4)


@pytest.mark.parametrize("rung", sorted(p.name for p in DATA.glob("*.rung*.safetensors")))
def test_ladder_slice_equals_upstreams_rung_file(rung):
    """upstream's `needle build --layers d` path wrote these: config and every array equal ours exactly."""
    name, depth = rung.split(".rung")[0], int(rung.split(".rung")[1].split(".")[0])
    g, theirs = load(name), read_checkpoint(DATA / rung)
    assert ladder_config(g.config, depth) == theirs.config
    ours = flatten_tree(ladder_slice(g.params, g.config, depth))
    expected = flatten_tree(theirs.params)
    assert ours.keys() == expected.keys()
    for k in ours:
        np.testing.assert_array_equal(np.asarray(ours[k]), expected[k], err_msg=k)


@pytest.mark.parametrize("d_model, sites", [(64, ()), (1024, (1,))])
def test_width_half_shapes_equal_the_childs_init(d_model, sites):
    """NEEDLE_V3.md §4: the sliced tree's shapes equal the child's (D 64 -> 32 without engram; D 1024 -> 512 with
    E 4 -> 2). An explicit engram_heads at D 64 would not: upstream keeps it, so the child expects more, narrower
    tables than width_slice cuts (README-v3.md: flax refuses that child's params too)."""
    c = TransformerConfig(vocab_size=64, d_model=d_model, num_heads=4, num_kv_heads=2, num_layers=3, qk_head_dim=8,
                          v_head_dim=8, engram_layers=sites, engram_slots=7)
    child = width_config(c, d_model // 2)
    assert (child.d_model, child.num_heads, child.engram_seed_heads) == (d_model // 2, 2, c.engram_heads_resolved)
    params = convert.random_flax_params(c, groups=HEADS)
    sliced = flatten_tree(width_slice(params, c, d_model // 2))
    assert {k: v.shape for k, v in sliced.items()} == V3.table(child, HEADS).expected("flax")


def test_width_refuses_what_upstream_asserts():
    c = TransformerConfig(vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, qk_head_dim=8,
                          v_head_dim=8, engram_layers=(1,), engram_slots=7)
    for bad, words in ((c, "not an even number"), (dataclasses.replace(c, d_model=128), "Monarch factor"),
                       (dataclasses.replace(c, d_model=96), "power of two"),
                       (dataclasses.replace(c, num_heads=3, num_kv_heads=1, engram_layers=()), "odd")):
        with pytest.raises(ConfigError, match=words):
            width_config(bad, bad.d_model // 2)


def test_monarch_sizes_and_permutations():
    assert [hada_blocks(n) for n in (64, 128, 256, 512, 1024)] == [(8, 8), (8, 16), (16, 16), (16, 32), (32, 32)]
    p1, p2 = hada_perms(1024)
    assert list(p1[:4]) == [177, 777, 1006, 410] and list(p2[:4]) == [1013, 559, 1010, 70]
    s1, _ = hada_perms(64, split=True)
    assert sorted(s1[:32]) == list(range(32)) and sorted(s1[32:]) == list(range(32, 64))


# ----------------------------------------------------------------------------- mapping


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("name", NAMES)
def test_flax_torch_round_trip_is_bit_exact(name, dtype):
    g = load(name)
    params = {k: v for k, v in flatten_tree(g.params).items()}
    cast = {k: np.asarray(v).astype(dtype) for k, v in params.items()}
    tree = convert.trees.unflatten_tree(cast)
    back = flatten_tree(convert.torch_to_flax(convert.flax_to_torch(tree, g.config), g.config))
    assert back.keys() == cast.keys()
    for k, v in cast.items():
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes(), k
