"""safetensors files and HF-style directories, read and written tensor by tensor without torch.

The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the raw little-endian data. We implement it directly because safetensors.numpy has
no bfloat16, and to control memory: tensors are read one at a time (a writer maps one
layer, or band of rows, at a time), never the whole file (see convert.sink).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert import sink
from convert.errors import CheckpointError, NeedleTwinError, one_line
from convert.formats.common import (
    FAMILY_KEY,
    FORMAT_VERSION,
    SHA_PLACEHOLDER,
    load_config_json,
    load_json_object,
)
from convert.rules import TORCH
from convert.source import Source, checkpoint_size, file_sha256
from convert.tensors import TensorRef, dtype_name
from convert.trees import np_dtype

FORMAT, DIR_FORMAT = "safetensors", "hf-dir"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference implementation's limit
INDEX_NAME, SINGLE_NAME, CONFIG_NAME = "model.safetensors.index.json", "model.safetensors", "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # the transformers default
_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
          "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_NAMES = {v: k for k, v in _CODES.items()}


def _numpy_dtype(code: str) -> np.dtype:
    return np_dtype(_CODES[code])


# ----------------------------------------------------------------------------- reading


def read_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str], int]:
    """Parse and fully check a safetensors header: (lazy tensors by name, metadata, data start offset)."""
    size = checkpoint_size(path)
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, shorter than the 8-byte header "
                              "length); re-copy it")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt safetensors header: it declares {n} bytes of JSON, over the "
                                  f"{MAX_HEADER_BYTES} byte limit; the file is damaged or not safetensors")
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file: the header declares {n} bytes of JSON but "
                                  f"only {size - 8} follow; re-copy it")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {one_line(e, 120)}); "
                              "the file is damaged") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings")
    start, data_len = 8 + n, size - 8 - n
    tensors, spans = {}, []
    for name, entry in header.items():
        shape, dtype, (begin, end) = _entry(path, name, entry)
        need = math.prod(shape) * dtype.itemsize
        if end - begin != need:
            raise CheckpointError(f"{path}: corrupt safetensors header: {name} spans {end - begin} bytes but "
                                  f"{dtype_name(dtype)}{list(shape)} needs {need}")
        spans.append((begin, end, name))
        tensors[name] = TensorRef.in_file(path, start + begin, shape, dtype)
    _check_spans(path, spans, data_len)
    return tensors, metadata, start


def _entry(path: Path, name: str, entry: Any) -> tuple[tuple[int, ...], np.dtype, tuple[int, int]]:
    bad = f"{path}: corrupt safetensors header entry {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{bad}: not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in _CODES:
        raise CheckpointError(f"{bad}: unknown dtype {code!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{bad}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{bad}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    return tuple(shape), _numpy_dtype(code), (offsets[0], offsets[1])


def _check_spans(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Tensors must tile the data section exactly (the spec forbids holes and overlaps)."""
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            kind = "overlaps the previous tensor" if begin < position else f"leaves a gap at byte {position}"
            raise CheckpointError(f"{path}: corrupt safetensors header: {name} {kind}")
        position = end
    if position > data_len:
        raise CheckpointError(f"{path}: truncated safetensors file: tensors need {position} bytes of data, the "
                              f"file holds {data_len}; re-copy it")
    if position < data_len:
        raise CheckpointError(f"{path}: corrupt safetensors file: {data_len - position} bytes after the last tensor")


def _stored_config(path: Path, metadata: Mapping[str, str]) -> dict[str, Any] | None:
    _check_version(path, metadata)
    raw = metadata.get("config")
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: the 'config' metadata is not JSON; the file is damaged") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the 'config' metadata is not a JSON object")
    return config


def _check_version(path: Path, metadata: Mapping[str, str]) -> None:
    if metadata.get("format") == "needle-twin" and metadata.get("format_version", "1") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: written with needle-twin format version {metadata['format_version']}; "
                              f"this tool reads version {FORMAT_VERSION}, upgrade needle-twin")


def read_file(path: Path) -> Source:
    tensors, metadata, _ = read_header(path)
    return Source(path, FORMAT, TORCH, tensors, _stored_config(path, metadata), f"{path} (metadata 'config')",
                  dict(metadata), lambda: file_sha256(path), metadata.get(FAMILY_KEY))


FamilyFor = Callable[[str | None, Mapping[str, TensorRef], str], Any]  # (recorded family, tensors, where) -> Family


def read_dir(path: Path, family_for: FamilyFor) -> Source:
    """HF-style directory: config.json plus model.safetensors or index-listed shards. family_for: the family of a
    recorded name, else of the tensor names (convert.io passes the registry's rule; this module is below it)."""
    index_path = path / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_index(index_path)
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_NAME).is_file():
        weight_map, files = None, [SINGLE_NAME]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}; not an HF-style checkpoint directory")
    tensors: dict[str, TensorRef] = {}
    metadata: dict[str, str] = {}
    for file in files:
        shard_tensors, shard_meta, _ = read_header(path / file)
        metadata = metadata or dict(shard_meta)
        if weight_map is not None:
            listed = {n for n, f in weight_map.items() if f == file}
            if set(shard_tensors) != listed:
                extra, absent = sorted(set(shard_tensors) - listed), sorted(listed - set(shard_tensors))
                raise CheckpointError(f"{path / file} disagrees with {INDEX_NAME}: "
                                      + "; ".join(filter(None, [extra and f"not in the index: {', '.join(extra)}",
                                                                absent and f"missing: {', '.join(absent)}"])))
        tensors.update(shard_tensors)
    config, origin = _stored_config(path / files[0], metadata), f"{path / files[0]} (metadata 'config')"
    family = metadata.get(FAMILY_KEY)
    config_path = path / CONFIG_NAME
    if config_path.is_file():
        on_disk = load_config_json(config_path)
        family = family or on_disk.get(FAMILY_KEY)
        on_disk.pop(FAMILY_KEY, None)
        problem = None if config is None else \
            _contradiction(on_disk, config, lambda: family_for(family, tensors, str(path)))
        if problem:
            raise CheckpointError(f"{config_path} contradicts the config recorded in {files[0]} ({problem}); "
                                  "restore the original config.json")
        config, origin = on_disk, str(config_path)
    return Source(path, DIR_FORMAT, TORCH, tensors, config, origin, metadata, lambda: file_sha256(path), family)


def _contradiction(on_disk: Mapping[str, Any], recorded: Mapping[str, Any], kind: Callable[[], Any]) -> str | None:
    """Why config.json contradicts the recorded config (its own error, or the fields that differ), or None."""
    try:
        family = kind()
        mine, theirs = family.config_from_dict(on_disk), family.config_from_dict(recorded)
    except NeedleTwinError as e:
        return None if dict(on_disk) == dict(recorded) else str(e)
    return "; ".join(f"{k}: {a!r} there, {b!r} recorded" for k, (a, b) in mine.differences(theirs).items()) or None


def _read_index(index_path: Path) -> dict[str, str]:
    index = load_json_object(index_path, "index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: no 'weight_map' object; the index is damaged")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not re.fullmatch(r"[\w.-]+\.safetensors", file) or file.startswith("."):
            raise CheckpointError(f"{index_path}: {name} maps to {file!r}, not a .safetensors file in the directory")
        if not (index_path.parent / file).is_file():
            raise CheckpointError(f"{index_path}: shard {file} is missing; re-copy the whole directory")
    return weight_map


# ----------------------------------------------------------------------------- writing


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB" (10^9) or "5GiB" (2^30); the error shows the accepted forms."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
        if not m:
            raise NeedleTwinError(f"cannot read the size {size!r}; use bytes or a unit, e.g. 500MB, 2GB, 1GiB")
        unit = (m.group(2) or "B").upper().replace("IB", "iB")
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
        value = int(float(m.group(1)) * scale)
    if value < 1:
        raise NeedleTwinError(f"--max-shard-size must be positive, got {size!r}")
    return value


def _header_bytes(view: list, metadata: Mapping[str, str]) -> tuple[bytes, list]:
    """Header JSON padded to 8 bytes, tensors in write order (largest itemsize first keeps every tensor aligned)."""
    order = sorted(view, key=lambda p: -p.dtype.itemsize)  # stable: table order within a dtype
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for p in order:
        code = _NAMES.get(dtype_name(p.dtype))
        if code is None:
            raise NeedleTwinError(f"safetensors cannot hold dtype {dtype_name(p.dtype)} ({p.name})")
        header[p.name] = {"dtype": code, "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-(len(raw) + 8) % 8), order


def write_file(path: Path, view: Iterable, metadata: Mapping[str, str],
               on_bytes: Callable[[int], None] | None = None, source_sha256: Callable[[], str | None] | None = None,
               check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """Write planned tensors as one safetensors file, each straight into its place; patch in the source hash last."""
    raw, order = _header_bytes(list(view), metadata)
    sink.write_file(path, [struct.pack("<Q", len(raw)) + raw, *order], on_bytes=on_bytes, check=check)
    _patch_sha(path, raw, metadata, source_sha256)


def _patch_sha(path: Path, raw: bytes, metadata: Mapping[str, str],
               source_sha256: Callable[[], str | None] | None) -> None:
    """The header went out with a fixed-width placeholder hash; overwrite it now the hash is known."""
    if metadata.get("source_sha256") != SHA_PLACEHOLDER:
        return
    digest = source_sha256() if source_sha256 is not None else None
    if digest is None or len(digest) != len(SHA_PLACEHOLDER):
        raise AssertionError("source hash placeholder written but no hash available")
    needle = b'"source_sha256":"' + SHA_PLACEHOLDER.encode()
    at = raw.index(needle) + len(needle) - len(SHA_PLACEHOLDER)
    with open(path, "r+b") as f:
        f.seek(8 + at)
        f.write(digest.encode("ascii"))


def shard(view: list, max_bytes: int) -> list[list]:
    """Consecutive tensors grouped so each group stays under max_bytes (a bigger tensor gets its own shard)."""
    shards: list[list] = [[]]
    size = 0
    for p in view:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def write_dir(path: Path, view: list, metadata: Mapping[str, str], config,
              max_shard_size: int | str | None, on_bytes: Callable[[int], None] | None = None,
              source_sha256: Callable[[], str | None] | None = None,
              check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """HF-style directory: config.json and model.safetensors, or shards + model.safetensors.index.json."""
    path.mkdir()
    on_disk = {FAMILY_KEY: config.family, **config.to_dict()}  # our whole config: tuples may become lists here
    (path / CONFIG_NAME).write_text(json.dumps(on_disk, indent=2) + "\n", encoding="utf-8")
    shards = shard(list(view), parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE))
    cached = source_sha256 or (lambda: None)  # idempotent: the hash is computed once upstream
    if len(shards) == 1:
        write_file(path / SINGLE_NAME, shards[0], metadata, on_bytes, cached, check)
        return
    weight_map = {}
    for i, group in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_file(path / name, group, metadata, on_bytes, cached, check)
        weight_map.update({p.name: name for p in group})
    index_meta = {"total_size": sum(p.nbytes for p in view), **metadata}
    if "source_sha256" in index_meta:
        index_meta["source_sha256"] = cached()
    index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


