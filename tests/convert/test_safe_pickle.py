"""The allowlist unpickler: loads exactly what pickle.load loads for real checkpoints, and nothing dangerous."""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert import safe_pickle
from convert.errors import CheckpointError
from convert.trees import flatten_tree
from parity_tests.fixtures import FIXTURE_PKL
from tests.convert_helpers import RunsCommand

REPO = Path(__file__).resolve().parents[2]


def safe_loads(data: bytes):
    return safe_pickle.load(io.BytesIO(data), len(data))


def assert_same_tree(a, b) -> None:
    fa, fb = flatten_tree(a), flatten_tree(b)
    assert list(fa) == list(fb)
    for k in fa:
        assert type(fa[k]) is np.ndarray, k
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert fa[k].tobytes() == fb[k].tobytes(), k


def test_fixture_loads_identically_to_pickle_load():
    data = FIXTURE_PKL.read_bytes()
    ours, theirs = safe_loads(data), pickle.loads(data)
    assert ours["config"] == theirs["config"]
    assert_same_tree(ours["params"], theirs["params"])


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_protocol_and_dtype(protocol, dtype):
    rng = np.random.default_rng(0)
    tree = {"a": {"kernel": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)},
            "gate": np.asarray(rng.standard_normal(()), dtype=np.float32), "big": rng.standard_normal(4000)}
    obj = {"params": tree, "config": {"d_model": np.int64(32), "rope_theta": np.float64(500.0), "dtype": "float32"}}
    loaded = safe_loads(pickle.dumps(obj, protocol=protocol))
    assert_same_tree(loaded["params"], tree)
    assert loaded["config"] == {"d_model": 32, "rope_theta": 500.0, "dtype": "float32"}


def test_numpy1_module_paths_load():
    """Pickles written under numpy 1.x name numpy.core.multiarray; protocol 2 spells globals as plain text lines."""
    arr = np.arange(12, dtype=np.float16).reshape(3, 4)
    data = pickle.dumps({"w": arr}, protocol=2)
    assert b"numpy._core.multiarray\n" in data  # numpy 2 wrote it; rewrite it the way numpy 1 would
    data = data.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    out = safe_loads(data)
    assert out["w"].dtype == np.float16 and out["w"].tobytes() == arr.tobytes()


def test_frozendict_becomes_dict_without_importing_flax(tmp_path):
    from flax.core import FrozenDict

    arr = np.arange(6, dtype=np.float16)
    path = tmp_path / "frozen.pkl"
    path.write_bytes(pickle.dumps({"params": FrozenDict({"layer": {"kernel": arr}}), "config": {}}))
    code = (
        "import sys; sys.modules['flax'] = None; sys.modules['jax'] = None\n"
        "from convert import safe_pickle\n"
        f"p = {str(path)!r}\n"
        "import os\n"
        "obj = safe_pickle.load(open(p, 'rb'), os.path.getsize(p))\n"
        "assert type(obj['params']) is dict and type(obj['params']['layer']) is dict, type(obj['params'])\n"
        "print(obj['params']['layer']['kernel'].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(arr.tolist())


def test_reduce_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"params": {"w": RunsCommand(marker)}, "config": {}})
    with pytest.raises(CheckpointError, match=r"forbidden global (posix|nt|os)\.system"):
        safe_loads(data)
    assert not marker.exists()
    pickle.loads(data)  # control: the stock unpickler does run it, so the test above is meaningful
    assert marker.exists()


@pytest.mark.parametrize("module, name", [
    ("builtins", "eval"), ("builtins", "getattr"), ("subprocess", "Popen"), ("numpy", "load"),
    ("numpy.testing._private.utils", "runstring"), ("torch._utils", "_rebuild_tensor_v2"),
    ("copyreg", "_reconstructor"), ("builtins", "bytearray"),  # bytearray(10**11) would zero-fill 100 GB
])
def test_other_globals_are_refused_by_name(module, name):
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."
    with pytest.raises(CheckpointError, match=f"forbidden global {module}.{name}"):
        safe_loads(data)


def test_ndarray_cannot_be_called_directly():
    # GLOBAL numpy.ndarray; ((10**6,),) REDUCE: would allocate through the constructor, must be refused.
    data = b"\x80\x02cnumpy\nndarray\nJ\x40\x42\x0f\x00\x85\x85R."
    with pytest.raises(CheckpointError):
        safe_loads(data)


def test_object_arrays_are_refused():
    data = pickle.dumps(np.array([1, "x"], dtype=object))
    with pytest.raises(CheckpointError, match="dtype"):
        safe_loads(data)


def test_truncated_and_trailing_bytes():
    data = FIXTURE_PKL.read_bytes()
    with pytest.raises(CheckpointError, match="truncated"):
        safe_loads(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="trailing bytes"):
        safe_loads(data + b"junk")
    with pytest.raises(CheckpointError, match="empty or truncated"):
        safe_loads(b"")


def test_forged_length_prefix_does_not_allocate():
    # BINBYTES8 claiming 2**60 bytes: must fail as truncated, not try to allocate an exabyte.
    data = b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"abc"
    with pytest.raises(CheckpointError, match="truncated|not a valid pickle"):
        safe_loads(data)


def test_hash_covers_every_byte():
    import hashlib

    data = FIXTURE_PKL.read_bytes()
    digest = hashlib.sha256()
    safe_pickle.load(io.BytesIO(data), len(data), digest=digest)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_deeply_nested_pickle_is_a_clean_error():
    depth = 100_000
    data = b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."  # lists inside lists: no globals needed
    with pytest.raises(CheckpointError, match="nested too deeply"):
        safe_loads(data)


# ----------------------------------------------------------------------------- mapped loading (load_file)


def test_load_file_equals_pickle_load(tmp_path):
    ours, theirs = safe_pickle.load_file(FIXTURE_PKL), pickle.loads(FIXTURE_PKL.read_bytes())
    assert ours["config"] == theirs["config"]
    assert_same_tree(ours["params"], theirs["params"])
    assert ours["params"]["embedding"]["embedding"].flags.writeable


def test_lazy_load_file_leaves_large_arrays_in_the_file():
    lazy = safe_pickle.load_file(FIXTURE_PKL, lazy=True)
    theirs = pickle.loads(FIXTURE_PKL.read_bytes())
    ref = lazy["params"]["embedding"]["embedding"]  # 512 x 64 float16 = 64 KiB: left in the file
    assert isinstance(ref, safe_pickle.FileArray) and ref.shape == (512, 64) and not ref.fortran
    expected = theirs["params"]["embedding"]["embedding"]
    raw = FIXTURE_PKL.read_bytes()[ref.offset:ref.offset + expected.nbytes]
    assert raw == expected.tobytes()  # the offset points at exactly the array's bytes
    assert np.array_equal(ref.load(), expected)
    assert isinstance(lazy["params"]["log_temp"], np.ndarray)  # small arrays are built right away


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_load_file_every_protocol(tmp_path, protocol):
    rng = np.random.default_rng(1)
    tree = {"big": rng.standard_normal((300, 200)).astype(ml_dtypes.bfloat16),
            "fortran": np.asfortranarray(rng.standard_normal((200, 90))), "small": np.arange(3, dtype=np.int32)}
    path = tmp_path / "p.pkl"
    path.write_bytes(pickle.dumps({"params": tree, "config": {"d_model": 8}}, protocol=protocol))
    loaded = safe_pickle.load_file(path)
    for k, v in tree.items():
        assert loaded["params"][k].dtype == v.dtype and np.array_equal(loaded["params"][k], v), k


def test_load_file_payload_inside_a_frame(tmp_path):
    """Framed payloads count towards the frame length, so they are copied rather than mapped."""
    arr = np.arange(40_000, dtype=np.float32)  # 160 KB
    body = pickle.dumps({"w": arr}, protocol=3)[2:]  # protocol 3: BINBYTES, no frames; drop PROTO
    framed = b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body
    path = tmp_path / "framed.pkl"
    path.write_bytes(framed)
    assert np.array_equal(safe_pickle.load_file(path)["w"], arr)


def test_load_file_big_endian_arrays_come_out_native(tmp_path):
    arr = np.arange(50_000, dtype=">f4")
    path = tmp_path / "be.pkl"
    path.write_bytes(pickle.dumps({"w": arr}))
    out = safe_pickle.load_file(path)["w"]
    assert out.dtype == np.dtype("<f4") and np.array_equal(out, arr)
    assert safe_loads(path.read_bytes())["w"].dtype.isnative


def test_load_file_refuses_what_load_refuses(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"params": {"w": RunsCommand(marker), "a": np.zeros(50_000)}}))
    with pytest.raises(CheckpointError, match=r"forbidden global (posix|nt|os)\.system"):
        safe_pickle.load_file(path)
    assert not marker.exists()
    path.write_bytes(b"\x80\x04\x8c\x03abcQ.")  # a persistent id of the file's own
    with pytest.raises(CheckpointError, match="persistent ids"):
        safe_pickle.load_file(path)
    data = FIXTURE_PKL.read_bytes()
    for cut in (1, 3, len(data) // 3, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            safe_pickle.load_file(path)
    path.write_bytes(data + b"x")
    with pytest.raises(CheckpointError, match="trailing bytes"):
        safe_pickle.load_file(path)
