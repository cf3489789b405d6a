"""Upstream Needle pickles, read and written: v1's {"params", "config"} and Needle 2's format-v2 dict.

Needle 2's file is {"format_version": 2, "params", "config", "step", "run"} (NEEDLE_V2.md §7.1);
its config may be a dict or a pickled upstream `TransformerConfig` object, which the
allowlist unpickler rebuilds from its state as a plain dict without importing upstream.
Reading goes through that unpickler (convert.safe_pickle), with arrays mapped from the file.
Writing emits the pickle opcodes ourselves, so each array's bytes go straight from its source
into its place in the file instead of being assembled in memory; the stream is what
`pickle.dump` would produce for the same dict of numpy arrays (same globals, same ndarray
state, no memo and no frames), loadable by plain `pickle.load` and so by upstream's loader.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert import registry, safe_pickle, sink
from convert.errors import CheckpointError
from convert.formats.common import plain_config, plain_value
from convert.plan import Planned
from convert.rules import FLAX
from convert.source import Source, file_sha256
from convert.tensors import TensorRef
from convert.trees import flatten_tree, unflatten_tree

FORMAT = "upstream-pickle"
VERSION_KEY = "format_version"


def read(path: Path) -> Source:
    obj = safe_pickle.load_file(path, lazy=True)  # large arrays stay in the file until a writer reads them
    if not isinstance(obj, dict) or "params" not in obj:
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path}: an upstream checkpoint is a dict with 'params' and 'config', got {keys}")
    version = obj.get(VERSION_KEY)
    families = [f for f in registry.FAMILIES.values() if f.pickle_version == version]
    family = families[0] if families else None
    if family is None:
        known = ", ".join(f"{f.title}: {f.pickle_version}" for f in registry.FAMILIES.values())
        raise CheckpointError(f"{path}: format_version {version!r} is not one needle-twin reads ({known}); "
                              "is it a Needle checkpoint?")
    extra = sorted(set(map(str, obj)) - set(family.pickle_keys))
    if extra:
        raise CheckpointError(f"{path}: unexpected top-level key(s) {', '.join(extra)}; an upstream "
                              f"{family.title} checkpoint holds only {', '.join(family.pickle_keys)}")
    params, config = obj["params"], obj.get("config")
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: 'params' is a {type(params).__name__}, expected a nested dict of arrays")
    if isinstance(config, safe_pickle.UpstreamObject):
        config = config.state  # a pickled TransformerConfig: its __dict__, as upstream's __init__ left it
    tensors = {name: _leaf_ref(name, leaf, path) for name, leaf in flatten_tree(params).items()}
    others = {k: plain_value(v, f"{path}: {k}") for k, v in obj.items() if k not in ("params", "config", VERSION_KEY)}
    # Needle 2 and Needle 3.0.0 both wrote format-v2 pickles: then the tensor names tell (convert.io).
    named = family.name if version is not None and len(families) == 1 else None
    return Source(path, FORMAT, FLAX, tensors, plain_config(config, path) if config is not None else None,
                  f"{path} ('config')", {}, lambda: file_sha256(path), named, others)


def _leaf_ref(name: str, leaf: Any, path: Path) -> TensorRef:
    if isinstance(leaf, safe_pickle.FileArray):
        if leaf.dtype.isnative and not leaf.fortran:  # bytes usable as they are in the file
            return TensorRef.in_file(leaf.path, leaf.offset, leaf.shape, leaf.dtype)
        return TensorRef(leaf.shape, leaf.dtype.newbyteorder("="), leaf.load)
    return TensorRef.of(_leaf_array(name, leaf, path))


def _leaf_array(name: str, leaf: Any, path: Path) -> np.ndarray:
    if isinstance(leaf, np.ndarray):
        return leaf
    if isinstance(leaf, np.generic):  # a 0-d value saved as a numpy scalar
        return np.asarray(leaf)
    raise CheckpointError(f"{path}: params/{name} is a {type(leaf).__name__}, expected a numpy array")


# ----------------------------------------------------------------------------- writing

# Pickle opcodes (see pickletools); protocol 4 without framing, which every unpickler accepts.
PROTO, STOP, MARK = b"\x80\x04", b".", b"("
EMPTY_DICT, SETITEMS, EMPTY_TUPLE, TUPLE = b"}", b"u", b")", b"t"
EMPTY_LIST, APPENDS = b"]", b"e"
PARAMS = object()  # in `write`'s top-level dict: where the param tree goes
TUPLES = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"
REDUCE, BUILD, STACK_GLOBAL = b"R", b"b", b"\x93"


class PickleWriter:
    """Writes pickle opcodes for plain data, numpy dtypes and planned arrays into a file layout."""

    def __init__(self, f: sink.Segments) -> None:
        self.f = f
        # The globals `pickle.dump(ndarray)` names under the running numpy (numpy._core in 2.x).
        reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
        self._reconstruct = (reconstruct.__module__, reconstruct.__name__)

    def write(self, b: bytes) -> None:
        self.f.write(b)

    def global_(self, module: str, name: str) -> None:
        self.value(module)
        self.value(name)
        self.write(STACK_GLOBAL)

    def value(self, v: Any) -> None:
        """None, bool, int, float, str, bytes, tuple, dict, numpy dtype or scalar type."""
        if v is None:
            self.write(NONE)
        elif isinstance(v, bool):
            self.write(NEWTRUE if v else NEWFALSE)
        elif isinstance(v, int):
            if -(2 ** 31) <= v < 2 ** 31:
                self.write(b"J" + struct.pack("<i", v))
            else:
                raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                self.write(b"\x8a" + struct.pack("<B", len(raw)) + raw)
        elif isinstance(v, float):
            self.write(b"G" + struct.pack(">d", v))
        elif isinstance(v, str):
            raw = v.encode("utf-8", "surrogatepass")
            short = len(raw) < 256
            self.write(b"\x8c" + struct.pack("<B", len(raw)) if short else b"X" + struct.pack("<I", len(raw)))
            self.write(raw)
        elif isinstance(v, bytes):
            self.bytes_header(len(v))
            self.write(v)
        elif isinstance(v, tuple):
            self.tuple_(v)
        elif isinstance(v, list):
            self.write(EMPTY_LIST)
            if v:
                self.write(MARK)
                for item in v:
                    self.value(item)
                self.write(APPENDS)
        elif isinstance(v, dict):
            self.write(EMPTY_DICT)
            if v:
                self.write(MARK)
                for key, item in v.items():
                    self.value(key)
                    self.value(item)
                self.write(SETITEMS)
        elif isinstance(v, np.dtype):
            cls, args, state = v.__reduce__()
            self.global_("numpy", "dtype")
            self.tuple_(args)
            self.write(REDUCE)
            self.value(state)
            self.write(BUILD)
        elif isinstance(v, type):  # e.g. ml_dtypes.bfloat16 inside a dtype's reduce args
            self.global_(v.__module__, v.__name__)
        else:
            raise TypeError(f"cannot pickle {type(v).__name__}")

    def tuple_(self, items: tuple) -> None:
        if not items:
            self.write(EMPTY_TUPLE)
            return
        if len(items) > 3:
            self.write(MARK)
        for item in items:
            self.value(item)
        self.write(TUPLES.get(len(items), TUPLE))

    def bytes_header(self, n: int) -> None:
        if n < 256:
            self.write(b"C" + struct.pack("<B", n))
        elif n < 2 ** 32:
            self.write(b"B" + struct.pack("<I", n))
        else:
            self.write(b"\x8e" + struct.pack("<Q", n))

    def array(self, planned: Planned) -> None:
        """numpy's own reduce: _reconstruct(ndarray, (0,), b'b') then BUILD (1, shape, dtype, False, data)."""
        self.global_(*self._reconstruct)
        self.global_("numpy", "ndarray")
        self.tuple_((0,))
        self.value(b"b")
        self.write(TUPLES[3] + REDUCE + MARK)
        self.value(1)
        self.tuple_(tuple(int(d) for d in planned.shape))
        self.value(np.dtype(planned.dtype))
        self.value(False)
        self.bytes_header(planned.nbytes)
        self.f.tensor(planned)  # the raw C-order bytes, filled in place by convert.sink
        self.write(TUPLE + BUILD)


def write(path: Path, tensors: Mapping[str, Planned], top: Mapping[str, Any],
          on_bytes: Callable[[int], None] | None = None,
          check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """Write the top-level dict `top` (its `PARAMS` value: the tree of `tensors`, flax path -> planned tensor)."""
    segments = sink.Segments()
    w = PickleWriter(segments)
    w.write(PROTO + EMPTY_DICT + MARK)
    for key, value in top.items():
        w.value(key)
        if value is PARAMS:
            _tree(w, unflatten_tree(dict(tensors)))
        else:
            w.value(value)
    w.write(SETITEMS + STOP)
    sink.write_file(path, segments.done(), on_bytes=on_bytes, check=check)


def _tree(w: PickleWriter, node: Mapping[str, Any]) -> None:
    # Sorted keys, as jax/flax trees come out of `jax.tree` and as the upstream files are ordered.
    w.write(EMPTY_DICT + MARK)
    for key in sorted(node):
        w.value(key)
        item = node[key]
        if isinstance(item, dict):
            _tree(w, item)
        else:
            w.array(item)
    w.write(SETITEMS)
