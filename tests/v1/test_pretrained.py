"""SimpleAttentionNetwork.from_pretrained / save_pretrained: exact weights, same logits, no JAX needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from convert import io
from convert.errors import CheckpointError, NeedleTwinError
from convert.mapping import flax_to_torch, random_flax_params
from needle_torch import SimpleAttentionNetwork, make_attention_mask, make_padding_mask
from parity_tests.fixtures import FIXTURE_PKL
from tests.convert_helpers import REPO, TINY, TINY_FFN, leftovers, read_pickle, write_upstream_pickle


def _inputs(golden):
    src, tgt = torch.from_numpy(golden["src"]).long(), torch.from_numpy(golden["tgt"]).long()
    src_mask = make_padding_mask(src)
    tgt_mask = make_attention_mask(tgt)
    return src, tgt, src_mask, tgt_mask


def _in_memory_model(params, config, dtype):
    """The reference: the mapping's state_dict loaded into a freshly built model."""
    model = SimpleAttentionNetwork(config).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in flax_to_torch(params, config).items()}, strict=True)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_computes_the_same_logits(tmp_path, golden, dtype):
    ckpt = io.read_checkpoint(FIXTURE_PKL)
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "m.safetensors")
    loaded = SimpleAttentionNetwork.from_pretrained(tmp_path / "m.safetensors", dtype=dtype)
    reference = _in_memory_model(ckpt.params, ckpt.config, dtype)
    src, tgt, src_mask, tgt_mask = _inputs(golden)
    with torch.no_grad():
        ours, theirs = loaded(src, tgt, src_mask, tgt_mask), reference(src, tgt, src_mask, tgt_mask)
    # Same weights, same code, same CPU: nothing may differ, so no tolerance.
    assert torch.equal(ours, theirs)
    if dtype == torch.float32:
        # And it is the upstream function: the golden logits agree to float32 round-off (README: ~1e-5 absolute).
        assert np.abs(ours.numpy() - golden["f32/logits"]).max() < 1e-4


def test_from_pretrained_keeps_the_stored_dtype(tmp_path):
    ckpt = io.read_checkpoint(FIXTURE_PKL)
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "hf")
    model = SimpleAttentionNetwork.from_pretrained(tmp_path / "hf")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert not model.training
    expected = flax_to_torch(ckpt.params, ckpt.config)
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_save_pretrained_round_trip_and_force(tmp_path):
    torch.manual_seed(0)
    model = SimpleAttentionNetwork(TINY_FFN).to(torch.bfloat16)
    model.reset_parameters()
    with torch.no_grad():  # zero-initialised scales/gates would hide a swapped tensor
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    for target in (tmp_path / "m.safetensors", tmp_path / "dir"):
        model.save_pretrained(target)
        again = SimpleAttentionNetwork.from_pretrained(target)
        assert again.config == model.config
        for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
        with pytest.raises(NeedleTwinError, match="already exists; pass --force"):
            model.save_pretrained(target)
        model.save_pretrained(target, force=True)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="10KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 SimpleAttentionNetwork.from_pretrained(tmp_path / "sharded")
                                                 .state_dict().values(), strict=True))
    assert leftovers(tmp_path) == []


def test_save_pretrained_output_converts_to_an_upstream_pickle(tmp_path):
    model = SimpleAttentionNetwork(TINY)
    model.save_pretrained(tmp_path / "m.safetensors")
    source = io.open_source(tmp_path / "m.safetensors")
    io.write_source(source, io.resolve_config(source), tmp_path / "m.pkl")
    data = read_pickle(tmp_path / "m.pkl")
    assert data["config"] == TINY.to_dict(only_non_default=True)
    q = data["params"]["decoder"]["layers"]["DecoderBlock_0"]["self_attn"]["q_proj"]["kernel"]  # (L, in, out)
    assert np.array_equal(q[1], model.decoder.layers[1].self_attn.q_proj.weight.detach().numpy().T)


def test_from_pretrained_is_strict(tmp_path):
    params = random_flax_params(TINY, dtype="float32")
    params["encoder"]["final_norm"]["scale"][3] = np.nan
    src = write_upstream_pickle(tmp_path / "nan.pkl", params, TINY.to_dict(only_non_default=True))
    with pytest.raises(CheckpointError, match=r"NaN or Inf values in 1 tensor\(s\): encoder.final_norm.scale"):
        SimpleAttentionNetwork.from_pretrained(src)
    params = random_flax_params(TINY, dtype="float32")
    del params["contrastive_hidden"]["bias"]
    src = write_upstream_pickle(tmp_path / "missing.pkl", params, TINY.to_dict(only_non_default=True))
    with pytest.raises(CheckpointError, match=r"missing 1: contrastive_hidden/bias"):
        SimpleAttentionNetwork.from_pretrained(src)


def test_from_pretrained_without_jax_installed(tmp_path, golden):
    ckpt = io.read_checkpoint(FIXTURE_PKL)
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "m.safetensors")
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "hf", max_shard_size="100KB")
    np.save(tmp_path / "src.npy", golden["src"])
    script = textwrap.dedent(f"""
        import sys
        for name in ("jax", "jaxlib", "flax", "orbax", "orbax.checkpoint"):
            sys.modules[name] = None  # any import of these now raises ImportError
        import numpy as np, torch
        from needle_torch import SimpleAttentionNetwork, make_padding_mask
        src = torch.from_numpy(np.load({str(tmp_path / "src.npy")!r})).long()
        outs = []
        for path in ({str(tmp_path / "m.safetensors")!r}, {str(tmp_path / "hf")!r}):
            model = SimpleAttentionNetwork.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                outs.append(model.encode_contrastive(src))
        assert torch.equal(outs[0], outs[1])
        assert not any(m.split(".")[0] in ("jax", "flax", "orbax") for m in sys.modules if sys.modules[m] is not None)
        np.save({str(tmp_path / "out.npy")!r}, outs[0].numpy())
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # README: the float32 contrastive golden is reproduced to ~1e-5 by a faithful float32 implementation.
    assert np.abs(np.load(tmp_path / "out.npy") - golden["f32/contrastive"]).max() < 1e-4
