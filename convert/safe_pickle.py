"""An allowlist unpickler for upstream Needle checkpoints: builds numpy arrays and plain data, nothing else.

Pickle runs code on load: every global a pickle names is a callable the stock unpickler
will call. This one resolves only the handful of globals numpy needs to rebuild arrays,
dtypes and scalars (numpy 1.x `numpy.core` and 2.x `numpy._core` paths), maps a flax
`FrozenDict` to a plain dict without importing flax, and refuses every other global by
name before anything is called.

`load_file` does not read array data through the unpickler: a first pass over the opcodes
(payloads skipped, not copied) swaps every large bytes payload for a reference to its place
in the file. Arrays are then read straight from the file into their own memory, or, with
lazy=True, left in the file as `FileArray`s for a converter to read slice by slice.
"""

from __future__ import annotations

import io
import math
import mmap
import operator
import pickle
import pickletools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from convert.errors import CheckpointError, one_line
from convert.tensors import load_span

# Array dtypes we rebuild: booleans and numbers. Object/structured dtypes would let a
# pickle smuggle arbitrary objects through numpy's own unpickling, so they are refused.
_NUMERIC_KINDS = frozenset("biufc")


class UnsafePickleError(CheckpointError):
    """The pickle would run or build something beyond plain data: refused before anything is called."""


class _NdarrayMarker:
    """Stands in for numpy.ndarray: only `_reconstruct` may use it, nobody may call it."""

    def __repr__(self) -> str:
        return "numpy.ndarray"


_NDARRAY = _NdarrayMarker()


class _FrozenDict(dict):
    """A flax FrozenDict rebuilt as a dict (via __reduce__ or via __setstate__ of older flax)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if args or kwargs:
            self.update(dict(*args, **kwargs))

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            inner = state.get("_dict", state)
            if isinstance(inner, dict):
                self.update(inner)
                return
        raise CheckpointError("unsupported FrozenDict state in pickle; re-save the params as a plain dict")


class UpstreamObject:
    """Stands in for a pickled upstream config object (a `TransformerConfig` dataclass instance): NEWOBJ makes
    one without calling anything of upstream's, BUILD hands it the instance's __dict__, kept as `state`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError("pickle calls an upstream config class; only its saved state is loaded")

    def __new__(cls, *args: Any, **kwargs: Any) -> UpstreamObject:
        if cls is UpstreamObject or args or kwargs:  # only NEWOBJ's cls.__new__(cls) on a named stand-in
            raise CheckpointError("pickle builds an upstream config object with arguments; only its state loads")
        obj = object.__new__(cls)
        obj.state = {}
        return obj

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointError(f"a pickled {type(self).__name__} carries state of type {type(state).__name__}; "
                                  "expected a dict of config fields")
        self.state = dict(state)


def _stand_in(module: str, name: str) -> type:
    """A fresh UpstreamObject subclass named after the pickled class (for messages; never upstream's code)."""
    return type(name, (UpstreamObject,), {"__module__": f"needle_twin_stand_in.{module}"})


def _check_dtype(dtype: Any) -> np.dtype:
    if not isinstance(dtype, np.dtype):
        raise CheckpointError(f"pickle passes {type(dtype).__name__} where a numpy dtype is expected")
    if dtype.kind not in _NUMERIC_KINDS and dtype.name != "bfloat16":
        raise CheckpointError(f"pickle holds an array of dtype {dtype!r}; only numeric arrays are loaded")
    return dtype


def _safe_dtype(obj: Any, align: bool = False, copy: bool = True) -> np.dtype:
    """numpy.dtype(...) restricted to numeric type codes and ml_dtypes.bfloat16."""
    if isinstance(obj, str):
        if not obj.isascii() or len(obj) > 16:
            raise CheckpointError(f"pickle asks for dtype {obj[:40]!r}; only numeric dtypes are loaded")
    elif obj is not _bfloat16_type():
        raise CheckpointError(f"pickle asks for dtype from {type(obj).__name__}; only numeric dtypes are loaded")
    return _check_dtype(np.dtype(obj, align=bool(align), copy=bool(copy)))


class _Span:
    """A bytes payload left in the file: `length` bytes at `offset` of `path`."""

    __slots__ = ("path", "offset", "length", "lazy")

    def __init__(self, path: Path, offset: int, length: int, lazy: bool) -> None:
        self.path, self.offset, self.length, self.lazy = path, offset, length, lazy


@dataclass(frozen=True)
class FileArray:
    """An array whose bytes stay in the pickle file until `load()` (lazy loading)."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype  # as stored; may be non-native
    fortran: bool

    def load(self) -> np.ndarray:
        flat = load_span(self.path, self.offset, (math.prod(self.shape),), self.dtype)
        return _native(flat.reshape(self.shape, order="F" if self.fortran else "C"))


class _ArrayBuild:
    """What `_reconstruct` returns: BUILD hands it numpy's array state and it makes the array (or refuses)."""

    array: np.ndarray | FileArray | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise CheckpointError("malformed ndarray state in pickle")
        shape, dtype, fortran, raw = state[-4:]
        shape = _shape(shape)
        dtype = _check_dtype(dtype)
        if isinstance(raw, _Span):
            self.array = _from_span(raw, dtype, shape, "F" if fortran else "C")
        elif isinstance(raw, bytes):
            _check_length(len(raw), dtype, shape)
            array = np.ndarray.__new__(np.ndarray, (0,), np.uint8)
            array.__setstate__((1, shape, dtype, bool(fortran), raw))  # numpy keeps large data without a copy
            self.array = _native(array)
        else:
            raise CheckpointError(f"pickle gives ndarray data as {type(raw).__name__}; expected bytes")


def _shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise CheckpointError(f"malformed array shape {shape!r} in pickle") from None
    if any(d < 0 for d in dims):
        raise CheckpointError(f"negative array shape {dims} in pickle")
    return dims


def _check_length(nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes != need:
        raise CheckpointError(f"array {dtype}{list(shape)} needs {need} bytes, the pickle holds {nbytes}")


def _native(array: np.ndarray) -> np.ndarray:
    """Big-endian pickles: convert to native order so the raw bytes we write later mean the same numbers."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _from_span(raw: _Span, dtype: np.dtype, shape: tuple[int, ...], order: str) -> np.ndarray | FileArray:
    _check_length(raw.length, dtype, shape)
    array = FileArray(raw.path, raw.offset, shape, dtype, order == "F")
    return array if raw.lazy else array.load()


def _safe_reconstruct(subtype: Any, shape: Any, typecode: Any) -> _ArrayBuild:
    """numpy's ndarray._reconstruct, only for plain ndarrays; BUILD then fills in the data."""
    if subtype is not _NDARRAY:
        raise CheckpointError(f"pickle reconstructs an array of type {subtype!r}; only numpy.ndarray is loaded")
    return _ArrayBuild()


def _safe_frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray | FileArray:
    """numpy's protocol-5 `_frombuffer`, with the dtype checked first."""
    dtype = _check_dtype(dtype)
    if order not in ("C", "F"):
        raise CheckpointError(f"pickle asks for array order {order!r}; expected 'C' or 'F'")
    shape = _shape(shape)
    if isinstance(buf, _Span):
        return _from_span(buf, dtype, shape, order)
    if not isinstance(buf, (bytes, bytearray, memoryview, pickle.PickleBuffer)):
        raise CheckpointError(f"pickle builds an array from a {type(buf).__name__}; expected bytes")
    _check_length(memoryview(buf).nbytes, dtype, shape)
    return _native(np.frombuffer(buf, dtype=dtype).reshape(shape, order=order))


def _safe_scalar(dtype: Any, data: Any = None) -> Any:
    """numpy's multiarray.scalar (numpy scalars in a config), numeric dtypes only."""
    dtype = _check_dtype(dtype)
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise CheckpointError(f"pickle holds a malformed numpy {dtype} scalar")
    return np.frombuffer(data, dtype=dtype)[0]


def _safe_codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    """Protocol 0-2 pickles spell bytes as _codecs.encode(str, 'latin1')."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError("pickle uses _codecs.encode beyond the latin1 bytes encoding")
    return text.encode("latin1")


def _bfloat16_type() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


_NUMPY_CORE = ("numpy.core.multiarray", "numpy._core.multiarray")
_NUMPY_NUMERIC = ("numpy.core.numeric", "numpy._core.numeric")

_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    **{(m, "_reconstruct"): (lambda: _safe_reconstruct) for m in _NUMPY_CORE},
    **{(m, "scalar"): (lambda: _safe_scalar) for m in _NUMPY_CORE},
    **{(m, "_frombuffer"): (lambda: _safe_frombuffer) for m in _NUMPY_NUMERIC},
    ("numpy", "ndarray"): lambda: _NDARRAY,
    ("numpy", "dtype"): lambda: _safe_dtype,
    ("ml_dtypes", "bfloat16"): _bfloat16_type,
    ("flax.core.frozen_dict", "FrozenDict"): lambda: _FrozenDict,
    ("collections", "OrderedDict"): lambda: dict,
    ("builtins", "set"): lambda: set,
    ("builtins", "frozenset"): lambda: frozenset,
    ("_codecs", "encode"): lambda: _safe_codecs_encode,
}
# Upstream's config class may be pickled as an object (any module path: it moved between versions). Pickle
# protocols >= 2 rebuild a dataclass instance with NEWOBJ (cls.__new__(cls)) and BUILD (its __dict__), so the
# stand-in needs nothing else: copyreg._reconstructor (protocols 0-1) stays forbidden.
_CONFIG_CLASSES = ("TransformerConfig",)


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allowlisted globals and refuses the rest by name."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _CONFIG_CLASSES:
            return _stand_in(module, name)
        factory = _ALLOWED.get((module, name))
        if factory is None:
            raise UnsafePickleError(
                f"refusing to load: the pickle references the forbidden global {module}.{name}; "
                "a checkpoint may only hold numpy arrays and plain dicts/lists/scalars (it may be malicious)"
            )
        return factory()

    def __init__(self, file: Any, mapped: dict[str, _Span] | None = None) -> None:
        super().__init__(file)
        self._mapped = mapped or {}

    def persistent_load(self, pid: Any) -> Any:
        # Only the references `load_file` put in place of large payloads; a file's own ids are refused.
        if isinstance(pid, str) and pid in self._mapped:
            return self._mapped[pid]
        raise UnsafePickleError("refusing to load: the pickle uses persistent ids (a torch or custom format?)")


class BoundedReader(io.RawIOBase):
    """File wrapper that never reads past `size` bytes (nor a line past max_line) and feeds every byte read to an
    optional hash: a forged length prefix must not make a reader allocate more than the file holds."""

    def __init__(self, f: BinaryIO, size: int, digest: Any = None, max_line: int | None = None) -> None:
        super().__init__()
        self._f, self._left, self._digest, self._max_line = f, size, digest, max_line

    def readable(self) -> bool:
        return True

    def tell(self) -> int:  # pickletools.genops reports opcode positions with it
        return self._f.tell()

    def _bound(self, n: int | None) -> int:
        return self._left if n is None or n < 0 else min(n, self._left)

    def _consumed(self, data: Any) -> None:
        self._left -= len(data)
        if self._digest is not None:
            self._digest.update(data)

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(self._bound(n))
        self._consumed(data)
        return data

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: self._left]
        got = self._f.readinto(view)
        self._consumed(view[:got])
        return got

    def readline(self, limit: int = -1) -> bytes:
        if self._max_line is not None and not 0 <= limit <= self._max_line:
            limit = self._max_line
        data = self._f.readline(self._bound(limit))
        self._consumed(data)
        return data


def load(f: BinaryIO, size: int, what: str = "pickle", digest: Any = None) -> Any:
    """Unpickle `size` bytes from f with the allowlist; plain dicts replace FrozenDicts; errors name `what`."""
    reader = BoundedReader(f, size, digest)
    obj = _unpickle(SafeUnpickler(reader), what)
    if reader.read(1):
        raise CheckpointError(f"{what}: trailing bytes after the pickle end; the file is corrupt or not a pickle")
    return obj


def _unpickle(unpickler: SafeUnpickler, what: str) -> Any:
    """Run the unpickler; every failure becomes one CheckpointError naming `what`."""
    try:
        return _plain(unpickler.load())
    except RecursionError:
        raise CheckpointError(f"{what}: the pickle is nested too deeply to be a checkpoint") from None
    except CheckpointError as e:
        raise type(e)(f"{what}: {e}") from None
    except EOFError:
        raise CheckpointError(f"{what}: the pickle is empty or truncated; re-copy or re-save the file") from None
    except (pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what}: not a valid pickle ({type(e).__name__}: {one_line(e)}); "
                              "re-copy or re-save the file") from None


def _plain(obj: Any) -> Any:
    """FrozenDict/OrderedDict -> dict and array builders -> arrays, recursively: only plain data comes out."""
    if isinstance(obj, _ArrayBuild):
        if obj.array is None:
            raise CheckpointError("an ndarray in the pickle never receives its data; the file is corrupt")
        return obj.array
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    if isinstance(obj, UpstreamObject):
        obj.state = _plain(obj.state)
    return obj


# ----------------------------------------------------------------------------- mapped loading

# Length-prefixed bytes payloads (opcode -> prefix width): the ones worth leaving in the file.
_PAYLOADS = {b"C": 1, b"B": 4, b"\x8e": 8, b"\x96": 8}  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
_MAP_MIN_BYTES = 1 << 16  # smaller payloads are cheaper to copy than to track
_OPCODES = {op.code.encode("latin-1"): op for op in pickletools.opcodes}


class _Cursor:
    """A read position over a buffer, with the read/readline pickletools' argument readers need."""

    def __init__(self, buf: memoryview, mapping: mmap.mmap) -> None:
        self.buf, self.pos, self._find = buf, 0, mapping.find

    def read(self, n: int) -> bytes:
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += len(data)
        return data

    def readline(self) -> bytes:
        end = self._find(b"\n", self.pos)
        end = len(self.buf) - 1 if end < 0 else end
        data = bytes(self.buf[self.pos:end + 1])
        self.pos = min(end + 1, len(self.buf))
        return data


def _rewrite(buf: memoryview, mapping: mmap.mmap, path: Path, lazy: bool) -> tuple[bytes, dict[str, _Span]]:
    """Walk the opcodes once; large payloads outside frames become persistent ids pointing into the file.

    Returns the rewritten stream (opcodes only, small) and the id -> file span table.
    """
    nonce = secrets.token_hex(8)
    out, mapped = bytearray(), {}
    cursor, copied_to, frame_end = _Cursor(buf, mapping), 0, 0
    while True:
        start = cursor.pos
        code = cursor.read(1)
        if not code:
            raise EOFError("no STOP opcode")
        op = _OPCODES.get(code)
        if op is None:
            raise CheckpointError(f"not a pickle: unknown opcode {code!r} at byte {start}")
        if op.name in ("PERSID", "BINPERSID"):
            raise UnsafePickleError("refusing to load: the pickle uses persistent ids (a torch or custom format?)")
        if code in _PAYLOADS:
            width = _PAYLOADS[code]
            prefix = cursor.read(width)
            if len(prefix) != width:
                raise EOFError("truncated length prefix")
            n = int.from_bytes(prefix, "little")
            if n > len(buf) - cursor.pos:
                raise EOFError(f"a {n}-byte payload runs past the end of the file")
            data_at = cursor.pos
            cursor.pos += n
            # Inside a FRAME the frame length counts these bytes: leave them alone there.
            if n >= _MAP_MIN_BYTES and start >= frame_end:
                pid = f"{nonce}:{len(mapped)}"
                mapped[pid] = _Span(path, data_at, n, lazy)
                out += buf[copied_to:start]
                out += b"\x8c" + bytes([len(pid)]) + pid.encode() + b"Q"  # SHORT_BINUNICODE pid, BINPERSID
                copied_to = cursor.pos
            continue
        if op.arg is not None:
            try:
                value = op.arg.reader(cursor)
            except ValueError as e:
                raise EOFError(str(e)) from None
            if op.name == "FRAME":
                frame_end = cursor.pos + value
        if op.name == "STOP":
            break
    out += buf[copied_to:cursor.pos]
    if cursor.pos != len(buf):
        raise CheckpointError("trailing bytes after the pickle end; the file is corrupt or not a pickle")
    return bytes(out), mapped


def load_file(path: str | Path, what: str | None = None, *, lazy: bool = False) -> Any:
    """Unpickle a file with the allowlist (see module doc); lazy=True leaves large arrays as FileArrays."""
    path = Path(path)
    what = what or str(path)
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        if size == 0:
            raise CheckpointError(f"{what}: empty file (0 bytes); re-copy the checkpoint")
        # Mapped only to walk the opcodes: payload pages are skipped, never touched.
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mapping)
    try:
        try:
            stream, mapped = _rewrite(buf, mapping, path, lazy)
        except CheckpointError as e:
            raise type(e)(f"{what}: {e}") from None
        except EOFError:
            raise CheckpointError(f"{what}: the pickle is truncated; re-copy or re-save the file") from None
    finally:
        buf.release()
        mapping.close()
    return _unpickle(SafeUnpickler(io.BytesIO(stream), mapped), what)
