"""Needle 2 checkpoints through every format both ways: format-v2 pickles, safetensors, HF dirs, msgpack, Orbax.

The family travels with the file (our metadata and config.json, upstream's format_version, else the tensor
names); upstream's config dict (only the fields that were set, tuples as tuples, unknown keys included) and its
step/run come back unchanged; every array comes back bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from convert import commands, io
from convert.errors import CheckpointError
from convert.mapping import flax_to_torch_numpy, random_flax_params
from convert.trees import flatten_tree, np_dtype, unflatten_tree
from convert.v2 import FAMILY
from convert.v2.config import TransformerConfig
from needle_torch import from_pretrained as auto_from_pretrained
from needle_torch.v2 import SimpleAttentionNetwork
from parity_tests.fixtures import V2_PKL

FORMATS = {"safetensors": "m.safetensors", "hf-dir": "hf", "flax-msgpack": "m.msgpack", "orbax": "orbax"}
UPSTREAM = pickle.load(open(V2_PKL, "rb"))  # our own fixture file: the stock unpickler is fine here


def _same_arrays(a: dict, b: dict) -> bool:
    fa, fb = flatten_tree(a), flatten_tree(b)
    return fa.keys() == fb.keys() and all(
        fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape and fa[k].tobytes() == fb[k].tobytes() for k in fa)


def _through(tmp_path, src, fmt):
    """src -> fmt -> a format-v2 pickle; returns the pickle's dict (read with the stock unpickler: our output)."""
    mid = tmp_path / FORMATS[fmt]
    io.write_source(io.open_source(src), io.read_checkpoint(src).config, mid, format=fmt)
    back = tmp_path / f"back-{fmt}.pkl"
    source = io.open_source(mid)
    io.write_source(source, io.resolve_config(source), back)
    return mid, pickle.load(open(back, "rb"))


def _write_v2_pickle(path, params, config_dict, step=1000, run=None):
    """A format-v2 pickle the way upstream's trainer writes one (the stock pickler, upstream's key order)."""
    with open(path, "wb") as f:
        pickle.dump({"format_version": 2, "params": params, "config": config_dict, "step": step,
                     "run": run or {"name": "t"}}, f)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fixture_round_trip_keeps_arrays_config_step_and_run(tmp_path, fmt):
    mid, back = _through(tmp_path, V2_PKL, fmt)
    assert list(back) == list(UPSTREAM)  # format_version, params, config, step, run: upstream's order
    assert back["format_version"] == 2 and back["step"] == UPSTREAM["step"] and back["run"] == UPSTREAM["run"]
    assert back["config"] == UPSTREAM["config"]
    assert type(back["config"]["engram_layers"]) is tuple  # as upstream's __init__ leaves it
    assert _same_arrays(back["params"], UPSTREAM["params"])
    assert io.source_family(io.open_source(mid)).name == "v2"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["safetensors", "flax-msgpack"])
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype, fmt):
    params = {k: v for k, v in UPSTREAM["params"].items()}
    params = unflatten_tree({k: np.asarray(v, np.float32).astype(np_dtype(dtype))
                             for k, v in flatten_tree(params).items()})
    src = _write_v2_pickle(tmp_path / "src.pkl", params, dict(UPSTREAM["config"]))
    if dtype == "bfloat16":  # the stock pickler stores ml_dtypes arrays by their dtype; our reader must take them
        assert io.read_checkpoint(src).params["embedding"]["embedding"].dtype == np_dtype("bfloat16")
    _, back = _through(tmp_path, src, fmt)
    assert _same_arrays(back["params"], params) and back["config"] == UPSTREAM["config"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_unknown_config_keys_are_kept_verbatim_and_listed(tmp_path, fmt):
    """Older checkpoints carry keys upstream no longer knows: never dropped, never fatal, listed by inspect."""
    config = {**UPSTREAM["config"], "batch_size": 64, "qk_head_dim": 16, "lexicon_layers": (3,), "note": None}
    src = _write_v2_pickle(tmp_path / "old.pkl", UPSTREAM["params"], config)
    ckpt = io.read_checkpoint(src)
    assert ckpt.config.extra_keys() == {"batch_size": 64, "qk_head_dim": 16, "lexicon_layers": (3,), "note": None}
    assert ckpt.config == io.read_checkpoint(V2_PKL).config  # the model is the same: extras never reach it
    mid, back = _through(tmp_path, src, fmt)
    assert back["config"] == config and list(back["config"]) == list(config)
    info = commands.inspect(mid)
    assert info["unknown_config_keys"] == ["batch_size", "lexicon_layers", "note", "qk_head_dim"]
    assert info["family"] == "v2" and info["check"] == "ok"


def test_a_pickled_upstream_config_object_is_rebuilt_from_its_state(tmp_path):
    """A config stored as a TransformerConfig object: its __dict__ is read back without importing upstream."""

    @dataclasses.dataclass
    class UpstreamConfig:  # stands in for needle.model.architecture.TransformerConfig at pickling time
        def __init__(self, **kw):
            self.__dict__.update(kw)

    module = types.ModuleType("needle.model.architecture")
    UpstreamConfig.__module__, UpstreamConfig.__qualname__, UpstreamConfig.__name__ = (
        module.__name__, "TransformerConfig", "TransformerConfig")
    module.TransformerConfig = UpstreamConfig
    names = ("needle", "needle.model", "needle.model.architecture")
    for name in names:
        sys.modules[name] = module if name == module.__name__ else types.ModuleType(name)
    try:
        state = {**UPSTREAM["config"], "qk_head_dim": 16}
        src = tmp_path / "object.pkl"
        with open(src, "wb") as f:
            pickle.dump({"format_version": 2, "params": UPSTREAM["params"], "config": UpstreamConfig(**state),
                         "step": 5, "run": {}}, f)
    finally:
        for name in names:
            del sys.modules[name]
    assert b"needle.model.architecture" in src.read_bytes()  # it really is a pickled object of that class
    ckpt = io.read_checkpoint(src)
    assert ckpt.config == io.read_checkpoint(V2_PKL).config and ckpt.config.extra_keys() == {"qk_head_dim": 16}
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "plain.pkl", metadata=ckpt.metadata, extra=ckpt.extra)
    assert pickle.load(open(tmp_path / "plain.pkl", "rb"))["config"] == state  # a plain dict, upstream loads it


def test_our_format_v2_pickle_is_what_upstreams_loader_takes(tmp_path):
    """upstream's load_checkpoint: pickle.load, format_version == 2, params a nested dict of numpy arrays, config a
    dict for TransformerConfig(**cfg), step and run read with .get."""
    st = tmp_path / "m.safetensors"
    io.write_source(io.open_source(V2_PKL), io.read_checkpoint(V2_PKL).config, st)
    out = tmp_path / "home.pkl"
    io.write_source(io.open_source(st), io.resolve_config(io.open_source(st)), out)
    obj = pickle.load(open(out, "rb"))
    assert obj["format_version"] == 2 and isinstance(obj["config"], dict)
    leaves = flatten_tree(obj["params"])
    assert all(type(v) is np.ndarray for v in leaves.values()) and len(leaves) == len(flatten_tree(UPSTREAM["params"]))
    assert set(obj["config"]) <= set(TransformerConfig.field_names())  # TransformerConfig(**cfg) takes every key


def test_optional_groups_stay_absent_through_every_format(tmp_path):
    """upstream applies a tree without the MTP head or without the probe heads; so do we, in every format."""
    config = io.read_checkpoint(V2_PKL).config
    for groups in ((), ("mtp",), ("contrastive", "confidence")):
        params = random_flax_params(config, seed=1, groups=groups)
        src = io.write_checkpoint(params, config, tmp_path / f"g{len(groups)}.safetensors")
        ckpt = io.read_checkpoint(src)
        assert _same_arrays(ckpt.params, params)
        assert FAMILY.groups_in(flatten_tree(ckpt.params), "flax", config) == groups
        info = commands.inspect(src)
        assert info["optional_groups"] == {g: g in groups for g in FAMILY.groups}


def test_a_group_half_present_is_named(tmp_path):
    config = io.read_checkpoint(V2_PKL).config
    state = flax_to_torch_numpy(random_flax_params(config, seed=2), config)
    del state["mtp_final_norm.scale"]
    save_file(state, str(tmp_path / "half.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(UPSTREAM["config"] | {"engram_layers": [1, 3]}))
    with pytest.raises(CheckpointError, match=r"missing 1: mtp_final_norm\.scale"):
        io.read_checkpoint(tmp_path / "half.safetensors")


def test_the_family_is_recognised_from_tensor_names_alone(tmp_path):
    """A bare safetensors file (no metadata) and a v1-style {params, config} pickle of a v2 tree are v2."""
    ckpt = io.read_checkpoint(V2_PKL)
    save_file(flax_to_torch_numpy(ckpt.params, ckpt.config), str(tmp_path / "bare.safetensors"))
    assert io.source_family(io.open_source(tmp_path / "bare.safetensors")).name == "v2"
    bare = tmp_path / "bare.pkl"
    with open(bare, "wb") as f:
        pickle.dump({"params": UPSTREAM["params"], "config": UPSTREAM["config"]}, f)
    assert io.read_checkpoint(bare).family.name == "v2"
    io.write_source(io.open_source(bare), ckpt.config, tmp_path / "v2.pkl")
    assert pickle.load(open(tmp_path / "v2.pkl", "rb"))["format_version"] == 2  # upstream's loader needs it now


def test_from_pretrained_of_the_v2_safetensors_gives_the_twins_logits(tmp_path):
    ckpt = io.read_checkpoint(V2_PKL)
    path = tmp_path / "m.safetensors"
    io.write_checkpoint(ckpt.params, ckpt.config, path)
    tokens = torch.randint(14, 512, (2, 9))
    with torch.inference_mode():
        want = SimpleAttentionNetwork.from_flax(ckpt.params, ckpt.config).float()(tokens)
        for model in (SimpleAttentionNetwork.from_pretrained(path, dtype=torch.float32),
                      auto_from_pretrained(path, dtype=torch.float32)):
            assert isinstance(model, SimpleAttentionNetwork)
            assert torch.equal(model(tokens), want)


def test_a_v1_model_class_refuses_a_v2_file(tmp_path):
    from needle_torch.v1 import SimpleAttentionNetwork as V1Model

    path = tmp_path / "m.safetensors"
    io.write_checkpoint(io.read_checkpoint(V2_PKL).params, io.read_checkpoint(V2_PKL).config, path)
    with pytest.raises(CheckpointError, match="holds a Needle 2 .* checkpoint; load it with needle_torch.v2"):
        V1Model.from_pretrained(path)
