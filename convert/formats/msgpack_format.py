"""flax.serialization msgpack files, read and written without importing jax or flax.

The encoding (flax/serialization.py): a msgpack tree whose array leaves are ext type 1
holding msgpack (shape, dtype name, C-order bytes); numpy scalars are ext type 3; arrays
over 2**30 bytes become {"__msgpack_chunked_array__": True, "shape": {...}, "chunks": {...}}.
We write the upstream pickle's layout ({"params": tree, "config": dict}, and for Needle 2 also
its format_version, step and run), each array's bytes filled in place; we read that, a
TrainState-like {"params": ..., ...}, or a bare params tree.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert import registry, sink
from convert.errors import CheckpointError, one_line
from convert.formats.common import config_from_json, config_to_json, plain_config, plain_value
from convert.plan import Planned
from convert.rules import FLAX
from convert.source import Source, checkpoint_size, file_sha256
from convert.tensors import TensorRef, dtype_name
from convert.trees import flatten_tree, np_dtype, unflatten_tree

FORMAT = "flax-msgpack"
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3
MAX_CHUNK_SIZE = 2**30  # flax's limit per msgpack leaf
CHUNKED = "__msgpack_chunked_array__"
_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "bfloat16", "float32", "float64", "complex64", "complex128")


# ----------------------------------------------------------------------------- reading


def _array_from_ext(data: bytes) -> np.ndarray:
    import msgpack

    shape, name, buffer = msgpack.unpackb(data, raw=True)
    name = name.decode("ascii", "replace") if isinstance(name, bytes) else str(name)
    if name not in _DTYPES:
        raise CheckpointError(f"array of dtype {name!r}; only numeric arrays are loaded")
    dtype = np_dtype(name)
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"array shape {shape!r} is not a list of non-negative integers")
    count = int(np.prod(shape, dtype=np.int64))
    if not isinstance(buffer, bytes) or len(buffer) != count * dtype.itemsize:
        raise CheckpointError(f"array {name}{list(shape)} has {len(buffer)} bytes of data, "
                              f"needs {count * dtype.itemsize}")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_NDARRAY:
        return _array_from_ext(data)
    if code == EXT_NPSCALAR:
        return _array_from_ext(data)[()]
    if code == EXT_COMPLEX:
        import msgpack

        real, imag = msgpack.unpackb(data)
        return complex(real, imag)
    raise CheckpointError(f"unknown msgpack extension type {code}; not a flax.serialization file")


def _unchunk(node: Any) -> Any:
    """Chunked oversized arrays back into single arrays (flax's _unchunk_array_leaves_in_place)."""
    if not isinstance(node, dict):
        return node
    if node.get(CHUNKED) is True:
        shape, chunks = node.get("shape"), node.get("chunks")
        if not isinstance(shape, dict) or not isinstance(chunks, dict):
            raise CheckpointError("malformed chunked array (needs 'shape' and 'chunks')")
        dims = tuple(shape[str(i)] for i in range(len(shape)))
        return np.concatenate([chunks[str(i)] for i in range(len(chunks))]).reshape(dims)
    return {k: _unchunk(v) for k, v in node.items()}


def read(path: Path) -> Source:
    import msgpack

    size = checkpoint_size(path)
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, ext_hook=_ext_hook, raw=False, strict_map_key=False,
                                        max_buffer_size=min(size, 2**31 - 1))
            tree = unpacker.unpack()
            try:
                unpacker.unpack()
                trailing = True
            except msgpack.OutOfData:
                trailing = False
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except msgpack.OutOfData:
        raise CheckpointError(f"{path}: truncated msgpack file; re-copy or re-save it") from None
    except (ValueError, TypeError, msgpack.UnpackException, MemoryError, OverflowError) as e:
        detail = one_line(e, 160) or "nested too deeply or malformed"
        raise CheckpointError(f"{path}: not a valid flax msgpack file ({type(e).__name__}: {detail})") from None
    if trailing:
        raise CheckpointError(f"{path}: trailing data after the msgpack tree; the file is corrupt")
    try:
        params, config, top = split(_unchunk(tree), path)
        leaves = flatten_tree(params)
    except RecursionError:
        raise CheckpointError(f"{path}: the msgpack tree is nested too deeply to be a checkpoint") from None
    tensors = {}
    for name, leaf in leaves.items():
        if isinstance(leaf, np.generic):
            leaf = np.asarray(leaf)
        if not isinstance(leaf, np.ndarray):
            raise CheckpointError(f"{path}: params/{name} is a {type(leaf).__name__}, expected an array")
        tensors[name] = TensorRef.of(leaf)
    family, extra = _family_and_extra(top, path)
    return Source(path, FORMAT, FLAX, tensors, config, f"{path} ('config')", {}, lambda: file_sha256(path),
                  family, extra)


def split(tree: Any, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(params, config, our other top-level entries) from {"params", "config", ...} or a bare params tree.

    A TrainState's other fields are ignored; format_version, step and run are kept when a format_version says the
    file has upstream's layout."""
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: the msgpack holds a {type(tree).__name__}, expected a dict of params")
    if "params" in tree:
        params, config = tree["params"], tree.get("config")
        if isinstance(params, dict) and set(params) == {"params"}:
            params = params["params"]  # flax variables {"params": ...} stored as the params field
        if not isinstance(params, dict):
            raise CheckpointError(f"{path}: 'params' is a {type(params).__name__}, expected a nested dict of arrays")
        top = {k: v for k, v in tree.items() if k not in ("params", "config")} if "format_version" in tree else {}
        return params, (config_from_json(plain_config(config, path)) if config is not None else None), top
    return tree, None, {}


def _family_and_extra(top: dict[str, Any], path: Path) -> tuple[str | None, dict[str, Any]]:
    """The family a stored format_version names, and the other upstream entries (step, run)."""
    if not top:
        return None, {}
    version = plain_value(top.pop("format_version"), f"{path}: format_version")
    family = next((f.name for f in registry.FAMILIES.values() if f.pickle_version == version), None)
    if family is None:
        raise CheckpointError(f"{path}: format_version {version!r} is not one needle-twin reads")
    return family, {k: plain_value(v, f"{path}: {k}") for k, v in top.items()}


# ----------------------------------------------------------------------------- writing


def _ext_header(n: int, code: int) -> bytes:
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed:
        return struct.pack(">BB", fixed[n], code)
    if n < 2**8:
        return struct.pack(">BBB", 0xC7, n, code)
    if n < 2**16:
        return struct.pack(">BHB", 0xC8, n, code)
    return struct.pack(">BIB", 0xC9, n, code)


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return struct.pack(">BB", 0xC4, n)
    if n < 2**16:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _array(f: sink.Segments, planned: Planned) -> None:
    """One ndarray ext, as flax packs it; the data bytes are filled in place by convert.sink."""
    import msgpack

    packer = msgpack.Packer(use_bin_type=True)
    inner_head = packer.pack_array_header(3) + packer.pack(list(planned.shape)) \
        + packer.pack(dtype_name(planned.dtype)) + _bin_header(planned.nbytes)
    f.write(_ext_header(len(inner_head) + planned.nbytes, EXT_NDARRAY) + inner_head)
    f.tensor(planned)


def _value(f: sink.Segments, v: Any) -> None:
    import msgpack

    if isinstance(v, dict):
        f.write(msgpack.Packer().pack_map_header(len(v)))
        for key in sorted(v):  # sorted, as jax trees are flattened
            f.write(msgpack.packb(key, use_bin_type=True))
            _value(f, v[key])
    elif isinstance(v, Planned):
        if v.nbytes > MAX_CHUNK_SIZE:  # flax's layout for leaves msgpack cannot hold in one piece
            flat = v.array().reshape(-1)
            step = max(1, MAX_CHUNK_SIZE // v.dtype.itemsize)
            pieces = [Planned.of(v.name, flat[i:i + step]) for i in range(0, flat.size, step)]
            _value(f, {CHUNKED: True, "shape": {str(i): d for i, d in enumerate(v.shape)},
                       "chunks": {str(i): p for i, p in enumerate(pieces)}})
        else:
            _array(f, v)
    else:
        f.write(msgpack.packb(v, use_bin_type=True))


def write(path: Path, view: Iterable[Planned], config_dict: Mapping[str, Any], top: Mapping[str, Any] | None = None,
          on_bytes: Callable[[int], None] | None = None,
          check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """{"params": tree, "config": config_dict, **top} as flax msgpack, each array filled in place.

    top: upstream's other entries (Needle 2: format_version, step, run), written after the config."""
    import msgpack

    top = dict(top or {})
    f = sink.Segments()
    f.write(msgpack.Packer().pack_map_header(2 + len(top)))
    f.write(msgpack.packb("params", use_bin_type=True))
    _value(f, unflatten_tree({p.name: p for p in view}))
    f.write(msgpack.packb("config", use_bin_type=True))
    f.write(msgpack.packb(config_to_json(config_dict), use_bin_type=True))
    for key, value in top.items():
        f.write(msgpack.packb(key, use_bin_type=True) + msgpack.packb(value, use_bin_type=True))
    sink.write_file(path, f.done(), on_bytes=on_bytes, check=check)
