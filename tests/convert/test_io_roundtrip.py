"""Every format both ways, bit-exact: arrays, dtypes (f16/bf16 kept), config dicts, metadata."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest

from convert import io, plan
from convert.errors import CheckpointError, NeedleTwinError
from convert.mapping import flax_to_torch_numpy, random_flax_params
from convert.plan import Piece, Planned
from convert.registry import family_named, family_of
from convert.tensors import TensorRef
from convert.trees import flatten_tree, unflatten_tree
from convert.v1.config import TransformerConfig
from parity_tests.fixtures import FIXTURE_PKL
from tests.convert_helpers import (
    REPO,
    TINY,
    TINY_FFN,
    assert_trees_bit_identical,
    read_pickle,
    tiny_config_json,
    tiny_pickle,
    write_upstream_pickle,
)

# ----------------------------------------------------------------------------- detection


def test_detect_format_reads_content_not_extension(tmp_path):
    disguised = tmp_path / "weights.safetensors"
    disguised.write_bytes(FIXTURE_PKL.read_bytes())
    assert io.detect_format(disguised) == io.PICKLE
    st = tmp_path / "model.bin"
    io.write_source(io.open_source(FIXTURE_PKL), io.read_checkpoint(FIXTURE_PKL).config, tmp_path / "a.safetensors")
    st.write_bytes((tmp_path / "a.safetensors").read_bytes())
    assert io.detect_format(st) == io.SAFETENSORS


@pytest.mark.parametrize("dst, to, fmt", [
    ("m.safetensors", None, io.SAFETENSORS), ("m.pkl", None, io.PICKLE), ("m.msgpack", None, io.MSGPACK),
    ("outdir", None, io.HF_DIR), ("outdir", "torch", io.HF_DIR), ("outdir", "flax", io.ORBAX),
])
def test_output_format_from_destination(tmp_path, dst, to, fmt):
    assert io.infer_write_format(tmp_path / dst, to) == fmt


def test_contradicting_to_is_an_error(tmp_path):
    with pytest.raises(NeedleTwinError, match="contradicts"):
        io.infer_write_format(tmp_path / "m.pkl", "torch")


def test_safetensors_layout_follows_the_family(tmp_path):
    """Upstream writes safetensors itself only for Needle 3: there --to picks the layout; Needle 2's are pickles."""
    dst = tmp_path / "m.safetensors"
    assert io.infer_write_format(dst, "flax", family_named("v3")) == io.UPSTREAM_SAFETENSORS
    assert io.infer_write_format(dst, "torch", family_named("v3")) == io.SAFETENSORS
    with pytest.raises(NeedleTwinError, match="--to torch.*--to flax"):
        io.infer_write_format(dst, None, family_named("v3"))
    with pytest.raises(NeedleTwinError, match="pickles"):
        io.infer_write_format(dst, "flax", family_named("v2"))
    assert io.infer_write_format(dst, None, family_named("v2")) == io.SAFETENSORS


# ----------------------------------------------------------------------------- round trips


def test_upstream_pickle_safetensors_pickle_is_bit_exact(tmp_path):
    original = read_pickle(FIXTURE_PKL)
    src = io.open_source(FIXTURE_PKL)
    io.write_source(src, io.resolve_config(src), tmp_path / "m.safetensors")
    back = io.open_source(tmp_path / "m.safetensors")
    io.write_source(back, io.resolve_config(back), tmp_path / "back.pkl")
    again = read_pickle(tmp_path / "back.pkl")  # plain pickle.load, as upstream code reads it
    assert_trees_bit_identical(again["params"], original["params"])
    assert again["config"] == original["config"]
    assert list(again["config"]) == list(original["config"])  # even the key order
    assert type(again["params"]["embedding"]["embedding"]) is np.ndarray


@pytest.mark.parametrize("via", ["m.safetensors", "hfdir", "m.msgpack", "orbax"])
def test_upstream_config_dict_survives_every_format_exactly(tmp_path, via):
    """A pickle whose config names default-valued fields too (and in its own order) gets that dict back, not
    the canonical non-default one, through each format we write."""
    params = random_flax_params(TINY, seed=3, dtype="float16")
    stored = {"num_decoder_layers": TINY.num_decoder_layers, "vocab_size": TINY.vocab_size, "d_model": TINY.d_model,
              "num_heads": TINY.num_heads, "num_kv_heads": TINY.num_kv_heads, "dropout_rate": 0.1,
              "num_encoder_layers": TINY.num_encoder_layers, "no_feedforward": True}
    assert stored != TINY.to_dict(only_non_default=True)  # dropout_rate and no_feedforward are defaults
    src = write_upstream_pickle(tmp_path / "up.pkl", params, stored)
    middle = tmp_path / via
    to = {"hfdir": "torch", "orbax": "flax"}.get(via)
    io.write_source(io.open_source(src), io.resolve_config(io.open_source(src)), middle,
                    format=io.infer_write_format(middle, to))
    back = io.open_source(middle)
    io.write_source(back, io.resolve_config(back), tmp_path / "back.pkl")
    again = read_pickle(tmp_path / "back.pkl")
    assert again["config"] == stored and list(again["config"]) == list(stored)
    assert_trees_bit_identical(again["params"], params)


@pytest.mark.parametrize("direct", [True, False])
def test_byte_identical_through_small_bands_and_write_blocks(tmp_path, monkeypatch, direct):
    """The paths big checkpoints take, at fixture size: tensors made in bands of rows (of the source's columns
    where transposed), files written in many blocks through a ring that wraps (O_DIRECT where /tmp allows it)
    with a padded, cut-back tail."""
    from convert import plan, sink

    monkeypatch.setattr(plan, "PART_BYTES", 300)  # the (256, 64) f32 embedding: 1 row per band, 256 bands
    monkeypatch.setattr(plan, "TRANSPOSE_PART_BYTES", 300)  # Dense kernels: bands of the source's columns
    monkeypatch.setattr(sink, "RING_FROM", 0)  # the ring writer at fixture size
    monkeypatch.setattr(sink, "_BLOCK", 2 * sink._ALIGN)  # ~120 KB fixture: dozens of blocks
    if not direct:
        monkeypatch.setattr(sink, "_set_direct", lambda fd, on: False)
    src = io.open_source(FIXTURE_PKL)
    for name in ("m.safetensors", "m.msgpack"):
        io.write_source(src, io.resolve_config(src), tmp_path / name)
        back = io.open_source(tmp_path / name)
        io.write_source(back, io.resolve_config(back), tmp_path / f"{name}.pkl")
    assert_trees_bit_identical(read_pickle(tmp_path / "m.safetensors.pkl")["params"],
                               read_pickle(FIXTURE_PKL)["params"])
    monkeypatch.undo()  # default bands and blocks write the same bytes
    io.write_source(src, io.resolve_config(src), tmp_path / "default.safetensors")
    back = io.open_source(tmp_path / "default.safetensors")
    io.write_source(back, io.resolve_config(back), tmp_path / "default.pkl")
    default = {suffix: (tmp_path / f"default{suffix}").read_bytes() for suffix in (".safetensors", ".pkl")}
    assert (tmp_path / "m.safetensors").read_bytes() == default[".safetensors"]
    assert (tmp_path / "m.safetensors.pkl").read_bytes() == default[".pkl"]
    assert (tmp_path / "m.msgpack.pkl").read_bytes() == default[".pkl"]


def failing_pwrite(monkeypatch, call: int, code: int, hold_later: threading.Event | None = None) -> list[int]:
    """The sink's pwrite fails with OSError(code) on its `call`-th call (later calls first wait for `hold_later`
    when given); returns the offsets of every call."""
    from convert import sink

    real_pwrite, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == call:
            raise OSError(code, os.strerror(code))
        if hold_later is not None and len(calls) > call:
            hold_later.wait(60)  # s: a bound on a hang, not a timing; the event comes as soon as the writer stops
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(sink.os, "pwrite", pwrite)
    return calls


def test_direct_io_refused_mid_file_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    """A filesystem that accepts O_DIRECT at open but rejects the writes (EINVAL) still gets the whole file."""
    from convert import sink

    calls = failing_pwrite(monkeypatch, 1, errno.EINVAL)
    monkeypatch.setattr(sink, "RING_FROM", 0)  # the ring writer at fixture size
    monkeypatch.setattr(sink, "_BLOCK", 2 * sink._ALIGN)
    payload = np.arange(5000, dtype=np.float32)  # 20,000 bytes: two full blocks and a tail
    sink.write_file(tmp_path / "out.bin", [b"head", Planned.of("x", payload), b"tail"])
    assert (tmp_path / "out.bin").read_bytes() == b"head" + payload.tobytes() + b"tail"
    assert len(calls) >= 4  # the refused write was retried, then the rest went through


def test_full_disk_mid_file_leaves_nothing_and_says_so(tmp_path, tmp_path_factory, monkeypatch):
    """ENOSPC on a block write: one NeedleTwinError naming the output, no temp file left, queued writes dropped."""
    from convert import sink

    monkeypatch.setattr(sink, "RING_FROM", 0)  # the ring writer at fixture size
    monkeypatch.setattr(sink, "_BLOCK", sink._ALIGN)
    src = io.open_source(FIXTURE_PKL)
    whole = tmp_path_factory.mktemp("whole") / "m.safetensors"
    io.write_source(src, io.resolve_config(src), whole)
    blocks = math.ceil(whole.stat().st_size / sink._BLOCK)  # the writes had every one gone through (56)
    stopped = threading.Event()  # the sink has shut its writer down (dropping its queue, if it does)
    real_executor = sink.ThreadPoolExecutor

    def executor(*args, **kwargs):
        pool = real_executor(*args, **kwargs)
        if kwargs.get("thread_name_prefix") == "needle-twin-write":
            shutdown = pool.shutdown

            def watched(wait=True, *, cancel_futures=False):
                shutdown(wait=False, cancel_futures=cancel_futures)  # the queued writes are cancelled here, or not
                stopped.set()
                shutdown(wait=wait)

            pool.shutdown = watched
        return pool

    monkeypatch.setattr(sink, "ThreadPoolExecutor", executor)
    # writes after the failed one wait until the writer is shut down, so every block queued by then is either
    # dropped by the sink or written: which one does not depend on how the threads happen to be scheduled
    calls = failing_pwrite(monkeypatch, 2, errno.ENOSPC, hold_later=stopped)
    with pytest.raises(NeedleTwinError, match=r"m\.safetensors failed: No space left on device.*nothing was written"):
        io.write_source(src, io.resolve_config(src), tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []
    # 3: the write before the failed one, the failed one, and the one the writer thread may already have taken
    # off its queue; every other block queued behind the failure (up to the ring's 18, of the 56) was dropped
    assert len(calls) <= 3 < blocks, (len(calls), blocks)
    assert not [t for t in threading.enumerate() if t.name.startswith("needle-twin")]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("via", ["m.safetensors", "hfdir", "m.msgpack", "m.pkl"])
def test_round_trip_through_each_format_keeps_dtype(tmp_path, dtype, via):
    config = TINY_FFN
    params = random_flax_params(config, seed=1, dtype=dtype)
    io.write_checkpoint(params, config, tmp_path / via)
    ckpt = io.read_checkpoint(tmp_path / via)
    assert ckpt.config == config
    assert_trees_bit_identical(ckpt.params, params)
    assert ckpt.params["embedding"]["embedding"].dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16"
                                                                   else dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_orbax_round_trip(tmp_path, dtype):
    params = random_flax_params(TINY, seed=2, dtype=dtype)
    io.write_checkpoint(params, TINY, tmp_path / "orbax", format=io.ORBAX)
    assert io.detect_format(tmp_path / "orbax") == io.ORBAX
    ckpt = io.read_checkpoint(tmp_path / "orbax")
    assert ckpt.config == TINY
    assert_trees_bit_identical(ckpt.params, params)
    # and on to safetensors and back to a pickle, still bit-exact
    src = io.open_source(tmp_path / "orbax")
    io.write_source(src, TINY, tmp_path / "o.safetensors")
    io.write_source(io.open_source(tmp_path / "o.safetensors"), TINY, tmp_path / "o.pkl")
    assert_trees_bit_identical(read_pickle(tmp_path / "o.pkl")["params"], params)


def test_orbax_saved_sharded_over_two_devices_restores_to_numpy(tmp_path):
    """Saved from a 2-device mesh in another process; restored here (1 device) as host numpy."""
    params = random_flax_params(TINY, seed=3, dtype="bfloat16")
    np.savez(tmp_path / "p.npz", **{k.replace("/", "|"): v.view(np.uint16) for k, v in flatten_tree(params).items()})
    script = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import jax, jax.numpy as jnp, numpy as np, ml_dtypes
        import orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from convert.mapping import unflatten_tree
        mesh = Mesh(np.array(jax.devices()), ("x",))
        flat = {{}}
        with np.load({str(tmp_path / "p.npz")!r}) as z:
            for k in z.files:
                a = z[k].view(ml_dtypes.bfloat16)
                spec = P("x") if a.ndim and a.shape[0] % 2 == 0 else P()  # shard the layer/vocab axis
                flat[k.replace("|", "/")] = jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
        assert len(jax.devices()) == 2
        ck = ocp.StandardCheckpointer()
        ck.save({str(tmp_path / "sharded")!r}, {{"params": unflatten_tree(flat)}})
        ck.wait_until_finished()
        ck.close()
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    ckpt = io.read_checkpoint(tmp_path / "sharded", TINY)
    assert_trees_bit_identical(ckpt.params, params)


def test_msgpack_is_compatible_with_flax_serialization(tmp_path):
    from flax import serialization

    params = random_flax_params(TINY, seed=4, dtype="bfloat16")
    io.write_checkpoint(params, TINY, tmp_path / "ours.msgpack")
    restored = serialization.msgpack_restore((tmp_path / "ours.msgpack").read_bytes())
    assert_trees_bit_identical({k: np.asarray(v) for k, v in flatten_tree(restored["params"]).items()},
                               flatten_tree(params))
    assert restored["config"] == TINY.to_dict(only_non_default=True)
    # A bare params tree written by flax itself, config beside it.
    (tmp_path / "flax.msgpack").write_bytes(serialization.to_bytes(params))
    tiny_config_json(tmp_path / "config.json")
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "flax.msgpack").params, params)


def test_safetensors_is_compatible_with_the_safetensors_library(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from convert.mapping import flax_to_torch

    params = random_flax_params(TINY, seed=5, dtype="bfloat16")
    io.write_checkpoint(params, TINY, tmp_path / "ours.safetensors")
    theirs = load_file(tmp_path / "ours.safetensors")
    expected = flax_to_torch(params, TINY)
    assert sorted(theirs) == sorted(expected)
    assert all(theirs[k].dtype == torch.bfloat16 and torch.equal(theirs[k], expected[k]) for k in expected)
    save_file(expected, tmp_path / "lib.safetensors", metadata={"config": json.dumps(TINY.to_dict())})
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "lib.safetensors").params, params)


def test_torch_pt_files_are_read(tmp_path):
    import torch

    from convert.mapping import flax_to_torch

    params = random_flax_params(TINY, seed=6, dtype="float16")
    state = flax_to_torch(params, TINY)
    torch.save({"state_dict": state, "config": TINY.to_dict()}, tmp_path / "nested.pt")
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "nested.pt").params, params)
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    assert io.detect_format(tmp_path / "legacy.bin") == io.TORCH_PT
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "legacy.bin", TINY).params, params)


def test_sharded_hf_directory(tmp_path):
    from safetensors.torch import load_file

    params = random_flax_params(TINY, seed=7, dtype="float32")
    io.write_checkpoint(params, TINY, tmp_path / "hf", max_shard_size="40KB")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "config.json" in files
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    torch_names = set(flax_to_torch_numpy(params, TINY))
    assert set(index["weight_map"]) == torch_names
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in flatten_tree(params).values())
    for shard in shards:  # each shard is a valid file on its own and holds exactly what the index says
        held = set(load_file(tmp_path / "hf" / shard))
        assert held == {k for k, v in index["weight_map"].items() if v == shard}
        assert (tmp_path / "hf" / shard).stat().st_size <= 40_000 + 4096  # limit + header (a few KiB here)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"family": "v1", **TINY.to_dict()}
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "hf").params, params)


def test_edited_config_json_of_our_directory_is_named_field_by_field(tmp_path):
    io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "hf")
    config_json = tmp_path / "hf" / "config.json"
    original = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({**original, "rope_scaling": 2.0}))
    with pytest.raises(CheckpointError, match=r"recorded in model\.safetensors \(.*rope_scaling"):
        io.open_source(tmp_path / "hf")
    config_json.write_text(json.dumps({**original, "max_seq_len": 77}))
    with pytest.raises(CheckpointError, match=r"\(max_seq_len: 77 there, \d+ recorded\); restore the original"):
        io.open_source(tmp_path / "hf")


# ----------------------------------------------------------------------------- metadata, casts


def test_safetensors_metadata(tmp_path):
    from safetensors import safe_open

    src = io.open_source(FIXTURE_PKL)
    io.write_source(src, io.resolve_config(src), tmp_path / "m.safetensors", dtype="bfloat16")
    with safe_open(tmp_path / "m.safetensors", "np") as f:
        meta = f.metadata()
    assert meta["source_sha256"] == hashlib.sha256(FIXTURE_PKL.read_bytes()).hexdigest()
    assert meta["format"] == "needle-twin" and meta["format_version"] == io.FORMAT_VERSION
    assert meta["tool_version"] == io.tool_version() and meta["tool_version"] != "0+unknown"
    assert meta["dtype_cast"] == "bfloat16"
    assert json.loads(meta["config"]) == io.resolve_config(src).to_dict()
    assert json.loads(meta["upstream_config"]) == read_pickle(FIXTURE_PKL)["config"]


def test_float64_weights_need_an_explicit_cast_and_then_round_once(tmp_path):
    """JAX with x64 saves float64: refused as is (naming the fix, not blaming the config), cast exactly."""
    params = random_flax_params(TINY, seed=4, dtype="float32")
    wide = {k: v.astype(np.float64) + 1e-12 for k, v in flatten_tree(params).items()}  # not float32-exact
    src = io.open_source(write_upstream_pickle(tmp_path / "f64.pkl", unflatten_tree(wide),
                                               TINY.to_dict(only_non_default=True)))
    with pytest.raises(CheckpointError, match=r"\d+ tensors are float64 \(.*cast other floats with needle-twin "
                       r"convert --dtype\)") as e:
        io.write_source(src, TINY, tmp_path / "a.safetensors")
    assert "Is the config" not in str(e.value) and not (tmp_path / "a.safetensors").exists()
    io.write_source(src, TINY, tmp_path / "b.safetensors", dtype="float32")
    back = io.read_checkpoint(tmp_path / "b.safetensors").params
    assert_trees_bit_identical(back, unflatten_tree({k: v.astype(np.float32) for k, v in wide.items()}))
    huge = {**wide, "log_temp": np.asarray(1e6)}  # finite in float64, past float16's 65504
    src = io.open_source(write_upstream_pickle(tmp_path / "huge.pkl", unflatten_tree(huge),
                                               TINY.to_dict(only_non_default=True)))
    with pytest.raises(CheckpointError, match=r"after the cast to float16: log_temp; values beyond float16's range "
                       r"overflow to Inf .*cast to a wider dtype"):
        io.write_source(src, TINY, tmp_path / "c.safetensors", dtype="float16")
    assert not (tmp_path / "c.safetensors").exists()


def test_sha256_of_a_safetensors_source(tmp_path):
    from safetensors import safe_open

    io.write_checkpoint(random_flax_params(TINY, dtype="float16"), TINY, tmp_path / "a.safetensors")
    io.write_source(io.open_source(tmp_path / "a.safetensors"), TINY, tmp_path / "b.safetensors", dtype="float32")
    with safe_open(tmp_path / "b.safetensors", "np") as f:
        assert f.metadata()["source_sha256"] == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()


def test_dtype_cast_widens_exactly(tmp_path):
    src = io.open_source(FIXTURE_PKL)
    io.write_source(src, io.resolve_config(src), tmp_path / "f32.safetensors", dtype="float32")
    wide = flatten_tree(io.read_checkpoint(tmp_path / "f32.safetensors").params)
    narrow = flatten_tree(read_pickle(FIXTURE_PKL)["params"])
    for k, v in narrow.items():
        assert wide[k].dtype == np.float32
        assert np.array_equal(wide[k], v.astype(np.float32))  # float16 -> float32 is exact


def test_mixed_dtypes_need_an_explicit_cast(tmp_path):
    params = random_flax_params(TINY, dtype="float16")
    params["log_temp"] = params["log_temp"].astype(np.float32)
    with pytest.raises(CheckpointError, match="mixed dtypes: log_temp is float32"):
        io.write_checkpoint(params, TINY, tmp_path / "m.safetensors")
    io.write_checkpoint(params, TINY, tmp_path / "m.safetensors", dtype="float16")
    assert io.read_checkpoint(tmp_path / "m.safetensors").params["log_temp"].dtype == np.float16


def test_pickle_writer_output_names_only_allowlisted_globals(tmp_path):
    import pickletools

    params = random_flax_params(TINY, dtype="bfloat16")
    io.write_checkpoint(params, TINY, tmp_path / "m.pkl")
    strings = [arg for op, arg, _ in pickletools.genops((tmp_path / "m.pkl").read_bytes())
               if op.name == "SHORT_BINUNICODE"]
    assert {"numpy._core.multiarray", "_reconstruct", "ndarray", "dtype", "ml_dtypes", "bfloat16"} <= set(strings)
    assert_trees_bit_identical(read_pickle(tmp_path / "m.pkl")["params"], params)


def test_read_checkpoint_refuses_a_config_that_contradicts_the_file():
    with pytest.raises(NeedleTwinError, match="d_model: stored 64, given 32"):
        io.read_checkpoint(FIXTURE_PKL, io.read_checkpoint(FIXTURE_PKL).config.replace(d_model=32, num_heads=4))


def test_existing_output_needs_force(tmp_path):
    dst = tmp_path / "m.pkl"
    dst.write_bytes(b"keep me")
    params = random_flax_params(TINY, dtype="float16")
    with pytest.raises(NeedleTwinError, match="already exists; pass --force"):
        io.write_checkpoint(params, TINY, dst)
    assert dst.read_bytes() == b"keep me"
    io.write_checkpoint(params, TINY, dst, force=True)
    assert_trees_bit_identical(read_pickle(dst)["params"], params)
    assert sorted(os.listdir(tmp_path)) == ["m.pkl"]


def test_tiny_pickle_helper_matches_upstream_layout(tmp_path):
    path = tiny_pickle(tmp_path / "t.pkl")
    assert set(read_pickle(path)) == {"params", "config"}
    assert io.read_checkpoint(path).config == TINY


def test_checkpoint_metadata_can_be_passed_back_to_write_checkpoint(tmp_path):
    """read -> write with the old metadata: the upstream config survives, stale owned keys are recomputed."""
    ckpt = io.read_checkpoint(FIXTURE_PKL)
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "m.pkl",
                        metadata={**ckpt.metadata, "config": "{stale}", "source_sha256": "f" * 64})
    assert read_pickle(tmp_path / "m.pkl")["config"] == read_pickle(FIXTURE_PKL)["config"]
    io.write_checkpoint(ckpt.params, ckpt.config, tmp_path / "m.safetensors", metadata={"config": "{stale}",
                                                                                       "run": "exp-7"})
    meta = io.open_source(tmp_path / "m.safetensors").metadata
    assert json.loads(meta["config"]) == ckpt.config.to_dict() and meta["run"] == "exp-7"
    assert "source_sha256" not in meta  # an in-memory tree has no source file to hash


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [io.PICKLE, io.MSGPACK, io.ORBAX])
def test_flax_format_to_safetensors_and_back(tmp_path, fmt, dtype):
    """X -> safetensors -> X for every Flax format: same arrays (bytes, dtype) and the same config dict."""
    names = {io.PICKLE: "a.pkl", io.MSGPACK: "a.msgpack", io.ORBAX: "a_orbax"}
    params = random_flax_params(TINY_FFN, seed=9, dtype=dtype)
    first, back = tmp_path / names[fmt], tmp_path / ("back_" + names[fmt])
    io.write_checkpoint(params, TINY_FFN, first, format=fmt)
    src = io.open_source(first)
    io.write_source(src, io.resolve_config(src), tmp_path / "mid.safetensors")
    mid = io.open_source(tmp_path / "mid.safetensors")
    io.write_source(mid, io.resolve_config(mid), back, format=fmt)
    if fmt == io.PICKLE:
        a, b = read_pickle(first), read_pickle(back)
        assert a["config"] == b["config"] == TINY_FFN.to_dict(only_non_default=True)
        assert_trees_bit_identical(b["params"], params)
    elif fmt == io.MSGPACK:
        from flax import serialization

        b = serialization.msgpack_restore(back.read_bytes())
        assert b["config"] == TINY_FFN.to_dict(only_non_default=True)
        assert_trees_bit_identical({k: np.asarray(v) for k, v in flatten_tree(b["params"]).items()},
                                   flatten_tree(params))
    else:
        assert json.loads((back / "config.json").read_text()) == TINY_FFN.to_dict(only_non_default=True)
        assert_trees_bit_identical(io.read_checkpoint(back).params, params)


def test_orbax_manager_folder_points_at_a_step(tmp_path):
    for step in ("20", "100"):
        (tmp_path / "run" / step).mkdir(parents=True)
        (tmp_path / "run" / step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(CheckpointError, match=r"steps 20, 100; point at one step, e.g. .*run/100"):
        io.detect_format(tmp_path / "run")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_finite_check_bit_test(dtype):
    from convert import tensors

    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    big = max(ml_dtypes.finfo(np_dt).max, 0)
    ok = np.array([0.0, -0.0, 1.0, -1.0, big, -big, ml_dtypes.finfo(np_dt).smallest_subnormal], dtype=np_dt)
    assert tensors.is_finite(ok) and tensors.is_finite(np.zeros((0, 4), np_dt))
    for bad in (np.nan, -np.nan, np.inf, -np.inf):
        # past the first block, so the blockwise loop is exercised too
        arr = np.zeros(tensors._FINITE_BLOCK + 7, np_dt)
        arr[-1] = bad
        assert not tensors.is_finite(arr), bad
        assert not tensors.is_finite(np.asarray(bad, dtype=np_dt))


@pytest.mark.parametrize("pipeline, fallocate", [(True, True), (False, False)])
@pytest.mark.parametrize("writer", ["plain", "ring"])
def test_sink_lays_out_segments_and_fills_tensors_in_place(tmp_path, monkeypatch, pipeline, fallocate, writer):
    from convert import sink

    if not fallocate:  # e.g. a network filesystem: the file just grows as it is written

        def unsupported(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(sink.os, "posix_fallocate", unsupported)
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((3, 40, 24)).astype(np.float16)  # stacked (L, in, out), 40 rows: banded path
    layers = [np.ascontiguousarray(kernel[i].T) for i in range(3)]  # torch layout (out, in) per layer
    gate = np.asarray(0.5, np.float32)
    pieces = tuple(Piece(TensorRef.of(a)) for a in layers)
    segments = [b"head", Planned("k", kernel.shape, kernel.dtype, pieces, stacked=True, transpose=True),
                b"mid", Planned.of("gate", gate), Planned.of("empty", np.zeros((0, 5), np.float32)), b"tail"]
    seen, done = [], []
    sink.write_file(tmp_path / "out.bin", segments, check=lambda name, a: seen.append(name), on_bytes=done.append,
                    pipeline=pipeline, writer=writer)
    expected = b"head" + kernel.tobytes() + b"mid" + gate.tobytes() + b"tail"
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert sorted(seen) == ["empty", "gate", "k", "k", "k"]  # every part is checked: one per layer of k
    assert sum(done) == kernel.nbytes + gate.nbytes


@pytest.mark.parametrize("pipeline, direct", [(True, True), (True, False), (False, True)])
def test_sink_ring_wraps_inside_parts_and_byte_segments(tmp_path, monkeypatch, pipeline, direct):
    """Items of every size through a ring of 4 KiB blocks (sink._BLOCKS, 6, patched to 3 here; grown to 8, sized up
    front for the largest item): items the wrap cuts (made in the overhang, then folded to the front), items bigger
    than a block."""
    from convert import sink

    monkeypatch.setattr(sink, "RING_FROM", 0)  # the ring writer at fixture size
    monkeypatch.setattr(sink, "_BLOCK", sink._ALIGN)
    monkeypatch.setattr(sink, "_BLOCKS", 3)
    if not direct:
        monkeypatch.setattr(sink, "_set_direct", lambda fd, on: False)
    rng = np.random.default_rng(5)
    segments, expected = [], []
    for i in range(60):
        n = int(rng.choice([1, 7, 100, 1000, 4095, 4096, 5000, 9000]))
        if i == 40:
            n = 5 * sink._ALIGN + 3  # bigger than the 3-block ring: it is made ceil(n / block) + 2 = 8 blocks long
        if i % 3 == 0:
            data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            segments.append(data)
            expected.append(data)
        else:
            array = rng.integers(0, 256, n, dtype=np.uint8)
            segments.append(Planned.of(f"t{i}", array))
            expected.append(array.tobytes())
    sink.write_file(tmp_path / "out.bin", segments, pipeline=pipeline)
    assert (tmp_path / "out.bin").read_bytes() == b"".join(expected)


@pytest.mark.parametrize("writer", ["plain", "ring"])
def test_sink_stops_on_the_first_failing_tensor(tmp_path, writer):
    from convert import sink

    def broken():
        raise CheckpointError("disk went away")

    segments = [Planned.of(f"ok{i}", np.ones(1000, np.float32)) for i in range(5)]
    segments.append(Planned("bad", (10,), np.dtype(np.float32), (Piece(TensorRef((10,), np.dtype(np.float32),
                                                                                broken)),)))
    with pytest.raises(CheckpointError, match="disk went away"):
        sink.write_file(tmp_path / "out.bin", segments, writer=writer)


def test_msgpack_chunked_arrays_both_ways(tmp_path, monkeypatch):
    """flax splits leaves over 2**30 bytes into chunks; shrink the limit so tiny arrays take that path."""
    from flax import serialization

    from convert.formats import msgpack_format

    params = random_flax_params(TINY, seed=8, dtype="bfloat16")
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 1000)
    (tmp_path / "flax.msgpack").write_bytes(serialization.msgpack_serialize({"params": params,
                                                                             "config": TINY.to_dict()}))
    assert b"__msgpack_chunked_array__" in (tmp_path / "flax.msgpack").read_bytes()
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "flax.msgpack").params, params)
    monkeypatch.setattr(msgpack_format, "MAX_CHUNK_SIZE", 1000)
    io.write_checkpoint(params, TINY, tmp_path / "ours.msgpack")
    assert b"__msgpack_chunked_array__" in (tmp_path / "ours.msgpack").read_bytes()
    restored = serialization.msgpack_restore((tmp_path / "ours.msgpack").read_bytes())
    assert_trees_bit_identical({k: np.asarray(v) for k, v in flatten_tree(restored["params"]).items()},
                               flatten_tree(params))


@pytest.mark.parametrize("layout", ["c", "fortran", "big-endian"])
def test_lazy_pickle_source_reads_exactly_what_pickle_load_gives(tmp_path, layout):
    """Arrays >= 64 KiB stay in the pickle until read: per layer for writers, whole for read_checkpoint."""
    config = TransformerConfig(vocab_size=256, d_model=128, num_heads=4, num_kv_heads=2, num_encoder_layers=2,
                               num_decoder_layers=2)
    params = random_flax_params(config, seed=11, dtype="float16")
    stored = {k: (np.asfortranarray(v) if layout == "fortran" and v.ndim >= 2  # (asfortranarray makes 0-d 1-d)
                  else v.astype(">f2") if layout == "big-endian" else v)
              for k, v in flatten_tree(params).items()}
    path = write_upstream_pickle(tmp_path / "m.pkl", unflatten_tree(stored), config.to_dict(only_non_default=True))
    source = io.open_source(path)
    q = "encoder/layers/EncoderBlock_0/self_attn/q_proj/kernel"  # (2, 128, 128) float16 = 64 KiB: lazy
    assert (source.tensors[q].span is not None) == (layout == "c")
    expected_torch = flax_to_torch_numpy(params, config)
    for p in plan.torch_view(source, plan.validate(source, family_of(config), config)):
        assert p.array().dtype == np.float16 and np.array_equal(p.array(), expected_torch[p.name]), p.name
    assert_trees_bit_identical(io.read_checkpoint(path).params, params)
    io.write_source(source, config, tmp_path / "m.safetensors")
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "m.safetensors").params, params)


def test_big_endian_arrays_in_memory_are_written_as_numbers_not_bytes(tmp_path):
    params = random_flax_params(TINY, seed=12, dtype="float32")
    swapped = {k: v.astype(">f4") for k, v in flatten_tree(params).items()}
    io.write_checkpoint(unflatten_tree(swapped), TINY, tmp_path / "m.safetensors")
    assert_trees_bit_identical(io.read_checkpoint(tmp_path / "m.safetensors").params, params)


# (rows, cols): plain bands, tiny (one copy), and the 4-at-a-time path for 2-byte rows of >= 1024 values, with
# row counts that are not multiples of its 8-row steps or 128-row blocks.
@pytest.mark.parametrize("rows, cols", [(1000, 37), (33, 500), (4096, 8), (31, 9), (133, 1024), (300, 2048)])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_transposes_and_casts_are_exact(rows, cols, dtype):
    from convert import plan

    source = np.random.default_rng(rows).standard_normal((rows, cols)).astype(dtype)
    out = np.empty((cols, rows), dtype)
    plan.copy_into(out, source, transpose=True)
    np.testing.assert_array_equal(out.view(f"u{out.itemsize}"), source.T.view(f"u{out.itemsize}"))
    band = np.random.default_rng(cols).standard_normal((rows, cols + 8)).astype(dtype)[:, 4:cols + 4]
    assert not band.flags.c_contiguous  # a band of a source's columns: strided rows
    plan.copy_into(out, band, transpose=True, scratch=lambda n: np.empty(n, np.uint8))
    np.testing.assert_array_equal(out.view(f"u{out.itemsize}"), band.T.view(f"u{out.itemsize}"))
    widened = np.empty((cols, rows), np.float64)  # a cast on the way
    plan.copy_into(widened, source, transpose=True, scratch=lambda n: np.empty(n, np.uint8))
    np.testing.assert_array_equal(widened, source.T.astype(np.float64))
