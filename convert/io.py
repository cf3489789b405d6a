"""Read and write Needle checkpoints in every supported format: the converter's front door.

Formats (detected from content first, the extension only as a fallback):
  upstream-pickle  {"params", "config"} pickle, read with the allowlist unpickler
  safetensors      torch layout, one file; metadata holds the config
  hf-dir           directory: config.json + model.safetensors, or shards + model.safetensors.index.json
  flax-msgpack     flax.serialization bytes of {"params", "config"} (or of a bare params tree)
  orbax            Orbax PyTree checkpoint directory (config in config.json inside it)
  torch-pt         torch.save'd state_dict (.pt/.bin), read with torch.load(weights_only=True); read only

Torch, jax and orbax are imported only by the formats that need them.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convert import atomic, plan
from convert.config import TransformerConfig
from convert.errors import CheckpointError, ConfigError, ConfigMismatchError, NeedleTwinError, one_line
from convert.mapping import flatten_tree, unflatten_tree
from convert.source import FLAX, TORCH, Source, checkpoint_size
from convert.tensors import TensorRef, is_finite, weight_dtype

FORMAT_VERSION = "1"
PICKLE, SAFETENSORS, HF_DIR, MSGPACK, ORBAX, TORCH_PT = (
    "upstream-pickle", "safetensors", "hf-dir", "flax-msgpack", "orbax", "torch-pt")
READ_FORMATS = (PICKLE, SAFETENSORS, HF_DIR, MSGPACK, ORBAX, TORCH_PT)
WRITE_FORMATS = (SAFETENSORS, HF_DIR, PICKLE, MSGPACK, ORBAX)
TORCH_FORMATS, FLAX_FORMATS = (SAFETENSORS, HF_DIR), (PICKLE, MSGPACK, ORBAX)
_EXTENSIONS = {".pkl": PICKLE, ".pickle": PICKLE, ".safetensors": SAFETENSORS, ".msgpack": MSGPACK,
               ".pt": TORCH_PT, ".pth": TORCH_PT, ".bin": TORCH_PT}
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")
SHA_PLACEHOLDER = "0" * 64  # fixed width, patched in place once the source hash is known
# Metadata keys the writer owns; caller-supplied values for them are ignored (always recomputed).
_RESERVED_METADATA = ("format", "format_version", "tool_version", "config", "source_format", "source_sha256",
                      "dtype_cast")


@dataclass
class Checkpoint:
    """A checkpoint in memory: the upstream Flax tree (numpy, dtypes as stored) and its full config."""

    params: dict[str, Any]
    config: TransformerConfig
    format: str
    metadata: dict[str, str] = field(default_factory=dict)
    path: Path | None = None


# ----------------------------------------------------------------------------- detection


def detect_format(path: str | Path) -> str:
    """Format of a checkpoint file or directory, from its content (extension only when content is unclear)."""
    path = Path(path)
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        if "model.safetensors.index.json" in names or "model.safetensors" in names:
            return HF_DIR
        if any(marker in names for marker in _ORBAX_MARKERS):
            return ORBAX
        steps = sorted((p.name for p in path.iterdir() if p.is_dir() and (p / "_CHECKPOINT_METADATA").exists()),
                       key=lambda s: (len(s), s))  # numeric step names in numeric order
        if steps:
            raise CheckpointError(f"{path} is an Orbax CheckpointManager folder with steps {', '.join(steps)}; "
                                  f"point at one step, e.g. {path / steps[-1]}")
        raise CheckpointError(f"{path} is a directory but neither an HF-style checkpoint (config.json + "
                              "model.safetensors) nor an Orbax checkpoint (_CHECKPOINT_METADATA); check the path")
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory; check the path")
    checkpoint_size(path)
    with open(path, "rb") as f:
        head = f.read(16)
    by_content = _sniff(head)
    if by_content:
        return by_content
    by_extension = _EXTENSIONS.get(path.suffix.lower())
    if by_extension:
        return by_extension  # its reader names what is wrong with the content
    raise CheckpointError(f"{path}: unrecognised checkpoint format (starts with {head[:8]!r}); expected an upstream "
                          "pickle, .safetensors, flax .msgpack, torch .pt or a checkpoint directory")


def _sniff(head: bytes) -> str | None:
    if head[:4] == b"PK\x03\x04":
        return TORCH_PT  # torch.save's zip container
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        # Legacy (non-zip) torch.save pickles open with its magic number as a 10-byte LONG1.
        return TORCH_PT if head[2:4] == b"\x8a\x0a" else PICKLE
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") >= 2:
        return SAFETENSORS
    if head[:1] in (b"}", b"("):
        return PICKLE  # protocol 0/1 dict
    if 0x81 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF):
        return MSGPACK  # a msgpack map
    return None


# ----------------------------------------------------------------------------- reading


# format -> (module under convert.formats, reader function); imported on use, so reading a pickle
# never imports torch, flax or orbax.
_READERS = {
    PICKLE: ("upstream_pickle", "read"),
    SAFETENSORS: ("safetensors_format", "read_file"),
    HF_DIR: ("safetensors_format", "read_dir"),
    MSGPACK: ("msgpack_format", "read"),
    ORBAX: ("orbax_format", "read"),
    TORCH_PT: ("torch_format", "read"),
}


def open_source(path: str | Path, fmt: str | None = None) -> Source:
    """Open a checkpoint for reading without converting it; lazily for safetensors."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise CheckpointError(f"unknown format {fmt!r}; use one of {', '.join(READ_FORMATS)}")
    module, reader = _READERS[fmt]
    return getattr(importlib.import_module(f"convert.formats.{module}"), reader)(path)


def resolve_config(source: Source, config: TransformerConfig | Mapping[str, Any] | None = None) -> TransformerConfig:
    """The explicit config, else the one stored in the checkpoint, else a config.json beside it."""
    stored = _stored_config(source)
    if config is None:
        if stored is None:
            raise ConfigError(f"{source.path} carries no config; put its config.json next to it or pass --config")
        return stored
    given = config if isinstance(config, TransformerConfig) else TransformerConfig.from_dict(config)
    if stored is not None and stored != given:
        fields = stored.differences(given)
        diff = "; ".join(f"{k}: stored {a!r}, given {b!r}" for k, (a, b) in fields.items())
        raise ConfigMismatchError(f"the config given contradicts the one in {source.config_origin}: {diff}; "
                                  "drop --config or fix it", fields)
    return given


def _stored_config(source: Source) -> TransformerConfig | None:
    if source.config_dict is not None:
        try:
            return TransformerConfig.from_dict(source.config_dict)
        except ConfigError as e:
            raise ConfigError(f"{source.config_origin}: {e}") from None
    sidecar = (source.path if source.path.is_dir() else source.path.parent) / "config.json"
    if source.format in (SAFETENSORS, MSGPACK, ORBAX, TORCH_PT) and sidecar.is_file():
        source.config_dict, source.config_origin = load_config_json(sidecar), str(sidecar)
        return _stored_config(source)
    return None


def load_config_json(path: Path) -> dict[str, Any]:
    """A config.json (or --config file): a JSON object of config fields."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({one_line(e)}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a JSON object of fields, got {type(data).__name__}")
    return data


def read_checkpoint(path: str | Path, config: TransformerConfig | Mapping[str, Any] | None = None, *,
                    check_finite: bool = True) -> Checkpoint:
    """Read any supported checkpoint into the upstream Flax tree (numpy, stored dtypes) after strict checks."""
    source = open_source(path)
    cfg = resolve_config(source, config)
    plan.validate(source, cfg)
    arrays = {p.name: p.array() for p in plan.flax_view(source, cfg)}
    if check_finite:
        bad = [name for name, array in arrays.items() if not is_finite(array)]
        if bad:
            raise plan.non_finite_error(source.path, bad)
    params = unflatten_tree(arrays)
    return Checkpoint(params, cfg, source.format, _checkpoint_metadata(source), Path(path))


# Formats whose stored config dict is upstream's own (only the fields that were set, in their order).
_UPSTREAM_CONFIG_FORMATS = (PICKLE, MSGPACK, ORBAX)


def _upstream_config(source: Source) -> str | None:
    """Upstream's own config dict as JSON (only the fields that were set), kept for a faithful round trip: the
    source's stored dict in a Flax format, else what our safetensors metadata recorded of it."""
    if source.format in _UPSTREAM_CONFIG_FORMATS and source.config_dict is not None:
        return json.dumps(source.config_dict)
    return source.metadata.get("upstream_config")


def _checkpoint_metadata(source: Source) -> dict[str, str]:
    upstream = _upstream_config(source)
    return {**source.metadata, **({"upstream_config": upstream} if upstream is not None else {})}


def source_from_params(params: Mapping[str, Any], path: str | Path = "<params>") -> Source:
    """An in-memory Flax tree (numpy, jax or torch leaves) as a Source."""
    from convert.mapping import _as_numpy

    tensors = {name: TensorRef.of(_as_numpy(leaf)) for name, leaf in flatten_tree(params).items()}
    return Source(Path(path), "memory", FLAX, tensors)


# ----------------------------------------------------------------------------- writing


def infer_write_format(dst: str | Path, to: str | None = None) -> str:
    """Output format from DST's form: .safetensors / a directory -> torch; .pkl / .msgpack -> Flax."""
    dst = Path(dst)
    if to not in (None, "torch", "flax"):
        raise NeedleTwinError(f"--to {to!r} is unknown; use torch or flax")
    suffix = dst.suffix.lower()
    by_suffix = {".safetensors": SAFETENSORS, ".pkl": PICKLE, ".pickle": PICKLE, ".msgpack": MSGPACK}.get(suffix)
    if by_suffix is None and (dst.is_dir() or not suffix):
        return ORBAX if to == "flax" else HF_DIR
    if by_suffix is None:
        raise NeedleTwinError(f"cannot tell the output format from {dst.name!r}; use .safetensors or a directory "
                              "(torch), .pkl or .msgpack (Flax), or a directory with --to flax (Orbax)")
    side = "torch" if by_suffix in TORCH_FORMATS else "flax"
    if to is not None and to != side:
        raise NeedleTwinError(f"--to {to} contradicts the output name {dst.name!r}, which is a {side} format; "
                              f"drop --to or rename the output")
    return by_suffix


def write_checkpoint(params: Mapping[str, Any], config: TransformerConfig | Mapping[str, Any], dst: str | Path, *,
                     format: str | None = None, force: bool = False, dtype: str | None = None,
                     metadata: Mapping[str, str] | None = None, max_shard_size: int | str | None = None,
                     check_finite: bool = True, on_bytes: Callable[[int], None] | None = None) -> Path:
    """Write an in-memory Flax tree in any writable format (atomically; never over dst without force).

    metadata: extra safetensors metadata; keys the writer owns (config, hashes, versions) are recomputed.
    """
    cfg = config if isinstance(config, TransformerConfig) else TransformerConfig.from_dict(config)
    source = source_from_params(params)
    return write_source(source, cfg, dst, format=format, force=force, dtype=dtype, metadata=metadata,
                        max_shard_size=max_shard_size, check_finite=check_finite, on_bytes=on_bytes)


def write_source(source: Source, config: TransformerConfig, dst: str | Path, *, format: str | None = None,
                 force: bool = False, dtype: str | None = None, metadata: Mapping[str, str] | None = None,
                 max_shard_size: int | str | None = None, check_finite: bool = True,
                 on_bytes: Callable[[int], None] | None = None) -> Path:
    """Convert an opened checkpoint to dst after strict checks; nothing is left at dst on any failure."""
    dst = Path(dst)
    fmt = format or infer_write_format(dst)
    if fmt not in WRITE_FORMATS:
        raise NeedleTwinError(f"cannot write format {fmt!r}; writable: {', '.join(WRITE_FORMATS)}")
    directory = fmt in (HF_DIR, ORBAX)
    if max_shard_size is not None and fmt != HF_DIR:
        raise NeedleTwinError("--max-shard-size applies to a directory output (HF-style shards); "
                              "give a directory as DST or drop the option")
    cast = weight_dtype(dtype) if dtype is not None else None
    atomic.check_target(dst, force=force, directory=directory)  # fail before reading anything big
    plan.validate(source, config, cast)
    meta = _output_metadata(source, config, dtype, metadata, with_hash=fmt in (SAFETENSORS, HF_DIR))
    with atomic.atomic_output(dst, force=force, directory=directory) as tmp:
        try:
            bad = _write(fmt, source, config, cast, tmp, meta, max_shard_size, check_finite, on_bytes)
        except OSError as e:  # disk full, quota, read-only folder...: our temp file goes, DST is untouched
            raise NeedleTwinError(f"converting to {dst} failed: {e.strerror or e} ({e.filename or tmp}); "
                                  "nothing was written") from None
        if bad:
            raise plan.non_finite_error(source.path, bad, dtype)
    return dst


def _output_metadata(source: Source, config: TransformerConfig, dtype: str | None,
                     extra: Mapping[str, str] | None, with_hash: bool = True) -> dict[str, str]:
    meta = {"format": "needle-twin", "format_version": FORMAT_VERSION, "tool_version": tool_version(),
            "config": json.dumps(config.to_dict(), sort_keys=True), "source_format": source.format}
    upstream = _upstream_config(source)
    if upstream is not None:
        meta["upstream_config"] = upstream
    if dtype is not None:
        meta["dtype_cast"] = dtype
    if with_hash and source.sha256 is not None:
        meta["source_sha256"] = SHA_PLACEHOLDER
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise NeedleTwinError(f"metadata must map strings to strings, got {key!r}: {value!r}")
        if key not in _RESERVED_METADATA:  # e.g. a Checkpoint's old metadata: its config/hash are stale now
            meta[key] = value
    return meta


class _SourceHash:
    """The source's SHA-256, computed in a background thread while the conversion runs (hashlib drops the GIL)."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self._fn, self._result, self._error = fn, None, None
        self._thread = threading.Thread(target=self._run, name="needle-twin-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as e:  # re-raised in the main thread by get()
            self._error = e

    def get(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def upstream_config_dict(config: TransformerConfig, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Config dict for an upstream pickle: the source's own dict when it matches, else the non-default fields."""
    raw = metadata.get("upstream_config")
    if raw is not None:
        try:
            stored = json.loads(raw)
            if isinstance(stored, dict) and TransformerConfig.from_dict(stored) == config:
                return stored
        except (json.JSONDecodeError, NeedleTwinError):
            pass  # a stale or foreign value: fall back to the canonical dict
    return config.to_dict(only_non_default=True)


def _write(fmt: str, source: Source, config: TransformerConfig, cast: np.dtype | None, tmp: Path,
           meta: dict[str, str], max_shard_size: int | str | None, check_finite: bool,
           on_bytes: Callable[[int], None] | None) -> list[str]:
    """Dispatch to the format writer; returns the names of non-finite tensors (the caller aborts on any)."""
    bad: list[str] = []
    check = _FiniteChecker(bad) if check_finite else None
    if fmt in (SAFETENSORS, HF_DIR):
        from convert.formats import safetensors_format

        view = plan.torch_view(source, config, cast)
        # Only safetensors has room for the source hash (a placeholder in meta when there is one to compute).
        sha = _SourceHash(source.sha256).get if "source_sha256" in meta else None
        if fmt == SAFETENSORS:
            safetensors_format.write_file(tmp, view, meta, on_bytes, sha, check)
        else:
            safetensors_format.write_dir(tmp, view, meta, config, max_shard_size, on_bytes, sha, check)
        return bad
    view = plan.flax_view(source, config, cast)
    if fmt == PICKLE:
        from convert.formats import upstream_pickle

        upstream_pickle.write(tmp, {p.name: p for p in view}, upstream_config_dict(config, meta), on_bytes, check)
    elif fmt == MSGPACK:
        from convert.formats import msgpack_format

        msgpack_format.write(tmp, view, upstream_config_dict(config, meta), on_bytes, check)
    elif fmt == ORBAX:
        from convert.formats import orbax_format

        orbax_format.write(tmp, view, upstream_config_dict(config, meta), on_bytes, check)
    return bad


class _FiniteChecker:
    """Records the tensors that hold NaN/Inf (called from the writer threads, once per part of a tensor)."""

    def __init__(self, bad: list[str]) -> None:
        self.bad, self._lock = bad, threading.Lock()

    def __call__(self, name: str, array: np.ndarray) -> None:
        if not is_finite(array):
            with self._lock:
                if name not in self.bad:
                    self.bad.append(name)


def tool_version() -> str:
    """The installed needle-twin version (recorded in every file we write)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("needle-twin")
    except PackageNotFoundError:
        return "0+unknown"


__all__ = [
    "FLAX", "TORCH", "Checkpoint", "Source", "detect_format", "infer_write_format", "open_source",
    "read_checkpoint", "resolve_config", "source_from_params", "write_checkpoint", "write_source",
]
