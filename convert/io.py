"""Read and write Needle checkpoints of every family in every supported format: the converter's front door.

Formats (detected from content first, the extension only as a fallback):
  upstream-pickle  v1's {"params", "config"} or Needle 2's format-v2 pickle, read with the allowlist unpickler
  safetensors      torch layout, one file; metadata holds the config
  hf-dir           directory: config.json + model.safetensors, or shards + model.safetensors.index.json
  flax-msgpack     flax.serialization bytes of {"params", "config"} (or of a bare params tree)
  orbax            Orbax PyTree checkpoint directory (config in config.json inside it)
  torch-pt         torch.save'd state_dict (.pt/.bin), read with torch.load(weights_only=True); read only

The family (Needle v1, Needle 2, ...) comes from the file itself: our metadata, upstream's
format_version, else its tensor names (convert.registry). Torch, jax and orbax are imported
only by the formats that need them, when they read or write.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convert import atomic, plan, registry
from convert.errors import CheckpointError, ConfigError, ConfigMismatchError, NeedleTwinError
from convert.family import Family
from convert.fields import FamilyConfig
from convert.formats import (
    msgpack_format,
    orbax_format,
    safetensors_format,
    torch_format,
    upstream_pickle,
    upstream_safetensors,
)
from convert.formats.common import (
    FAMILY_KEY,
    FORMAT_VERSION,
    SHA_PLACEHOLDER,
    config_from_json,
    config_to_json,
    load_config_json,
)
from convert.rules import FLAX, TORCH, ParamTable
from convert.source import Source, checkpoint_size, source_from_tree
from convert.tensors import is_finite, weight_dtype
from convert.trees import unflatten_tree

PICKLE, SAFETENSORS, HF_DIR, MSGPACK, ORBAX, TORCH_PT = (
    "upstream-pickle", "safetensors", "hf-dir", "flax-msgpack", "orbax", "torch-pt")
UPSTREAM_SAFETENSORS = upstream_safetensors.FORMAT
READ_FORMATS = (PICKLE, UPSTREAM_SAFETENSORS, SAFETENSORS, HF_DIR, MSGPACK, ORBAX, TORCH_PT, *registry.FORMATS)
WRITE_FORMATS = (SAFETENSORS, HF_DIR, PICKLE, UPSTREAM_SAFETENSORS, MSGPACK, ORBAX,
                 *(n for n, f in registry.FORMATS.items() if f.write))
TORCH_FORMATS, FLAX_FORMATS = (SAFETENSORS, HF_DIR), (PICKLE, UPSTREAM_SAFETENSORS, MSGPACK, ORBAX)
_EXTENSIONS = {".pkl": PICKLE, ".pickle": PICKLE, ".safetensors": SAFETENSORS, ".msgpack": MSGPACK,
               ".pt": TORCH_PT, ".pth": TORCH_PT, ".bin": TORCH_PT,
               **{ext: f.name for f in registry.FORMATS.values() for ext in f.extensions}}
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")
# Metadata keys the writer owns; caller-supplied values for them are ignored (always recomputed).
_RESERVED_METADATA = ("format", "format_version", "tool_version", "config", "source_format", "source_sha256",
                      "dtype_cast", FAMILY_KEY, "upstream_metadata")


@dataclass
class Checkpoint:
    """A checkpoint in memory: the upstream Flax tree (numpy, dtypes as stored), its full config (whose class says
    the family) and upstream's other top-level entries (Needle 2: step, run)."""

    params: dict[str, Any]
    config: FamilyConfig
    format: str
    metadata: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> Family:
        return registry.family_of(self.config)


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
    for owned in registry.FORMATS.values():  # first: a .cact tag would read as a msgpack map below
        if owned.sniff(head):
            return owned.name
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


def _family_for(name: str | None, tensors: Mapping[str, Any], where: str) -> Family:
    """The family a torch-layout file records by name, else the one its tensor names fit."""
    return registry.family_named(name) if name else registry.detect(tensors, TORCH, where)


# format -> reader; the readers import torch, jax or orbax only when they run.
_READERS = {
    PICKLE: upstream_pickle.read,
    SAFETENSORS: lambda path: _read_safetensors(path),
    UPSTREAM_SAFETENSORS: upstream_safetensors.read,
    HF_DIR: lambda path: safetensors_format.read_dir(path, _family_for),
    MSGPACK: msgpack_format.read,
    ORBAX: orbax_format.read,
    TORCH_PT: torch_format.read,
    **{f.name: f.read for f in registry.FORMATS.values()},
}


def _read_safetensors(path: Path) -> Source:
    """Both layouts end in .safetensors: upstream's Flax paths (Needle 3's own checkpoints) or our torch names."""
    tensors, metadata, _ = safetensors_format.read_header(path)
    if upstream_safetensors.is_upstream(tensors, metadata):
        return upstream_safetensors.read(path)
    return safetensors_format.read_file(path)


def open_source(path: str | Path, fmt: str | None = None) -> Source:
    """Open a checkpoint for reading without converting it; lazily for safetensors."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise CheckpointError(f"unknown format {fmt!r}; use one of {', '.join(READ_FORMATS)}")
    return _READERS[fmt](path)


def source_family(source: Source) -> Family:
    """The checkpoint's family: as its file names it (our metadata, upstream's format_version), else its tensors'."""
    if source.family is not None:
        return registry.family_named(source.family)
    return registry.detect(source.tensors, source.layout, str(source.path))


def resolve_config(source: Source, config: FamilyConfig | Mapping[str, Any] | None = None) -> FamilyConfig:
    """The explicit config, else the one stored in the checkpoint, else a config.json beside it; of the
    checkpoint's family."""
    family = source_family(source)
    stored = _stored_config(source, family)
    if config is None:
        if stored is None:
            raise ConfigError(f"{source.path} carries no config; put its config.json next to it or pass --config")
        return stored
    if isinstance(config, FamilyConfig):
        if registry.family_of(config) is not family:
            raise ConfigError(f"the config given is a {registry.family_of(config).title} config but {source.path} "
                              f"holds a {family.title} checkpoint; give a config of that family")
        given = config
    else:
        given = family.config_from_dict(_without_family(dict(config), family, "--config"))
    if stored is not None and stored != given:
        fields = stored.differences(given)
        diff = "; ".join(f"{k}: stored {a!r}, given {b!r}" for k, (a, b) in fields.items())
        raise ConfigMismatchError(f"the config given contradicts the one in {source.config_origin}: {diff}; "
                                  "drop --config or fix it", fields)
    return given


def _without_family(d: dict[str, Any], family: Family, origin: str) -> dict[str, Any]:
    """A config dict without our "family" entry, which must name the checkpoint's family if present."""
    named = d.pop(FAMILY_KEY, family.name)
    if named != family.name:
        raise ConfigError(f"{origin} is a config for family {named!r} but the checkpoint is {family.title}; give the "
                          "config of this checkpoint")
    return d


def _stored_config(source: Source, family: Family) -> FamilyConfig | None:
    if source.config_dict is not None:
        try:
            return family.config_from_dict(_without_family(dict(source.config_dict), family, source.config_origin))
        except ConfigError as e:
            raise ConfigError(f"{source.config_origin}: {e}") from None
    sidecar = (source.path if source.path.is_dir() else source.path.parent) / "config.json"
    if source.format in (SAFETENSORS, MSGPACK, ORBAX, TORCH_PT) and sidecar.is_file():
        source.config_dict, source.config_origin = load_config_json(sidecar), str(sidecar)
        return _stored_config(source, family)
    return None


def read_checkpoint(path: str | Path, config: FamilyConfig | Mapping[str, Any] | None = None, *,
                    check_finite: bool = True) -> Checkpoint:
    """Read any supported checkpoint of any family into the upstream Flax tree (numpy, stored dtypes) after
    strict checks; `.config` is the family's config, `.extra` upstream's other entries (Needle 2: step, run)."""
    source = open_source(path)
    cfg = resolve_config(source, config)
    table = plan.validate(source, registry.family_of(cfg), cfg)
    arrays = {p.name: p.array() for p in plan.flax_view(source, table)}
    if check_finite:
        bad = [name for name, array in arrays.items() if not is_finite(array)]
        if bad:
            raise plan.non_finite_error(source.path, bad)
    params = unflatten_tree(arrays)
    return Checkpoint(params, cfg, source.format, _checkpoint_metadata(source), Path(path), upstream_extra(source))


# Formats whose stored config dict is upstream's own (only the fields that were set, in their order).
_UPSTREAM_CONFIG_FORMATS = (PICKLE, UPSTREAM_SAFETENSORS, MSGPACK, ORBAX)


def _upstream_config(source: Source) -> str | None:
    """Upstream's own config dict as JSON (only the fields that were set), kept for a faithful round trip: the
    source's stored dict in a Flax format, else what our safetensors metadata recorded of it."""
    if source.format in _UPSTREAM_CONFIG_FORMATS and source.config_dict is not None:
        return json.dumps(config_to_json(source.config_dict))
    return source.metadata.get("upstream_config")


def upstream_extra(source: Source) -> dict[str, Any]:
    """Upstream's other top-level entries (Needle 2's step and run): as read, or as our metadata recorded them."""
    if source.extra:
        return dict(source.extra)
    raw = source.metadata.get("upstream_extra")
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(f"{source.path}: the 'upstream_extra' metadata is not JSON; the file is damaged") \
            from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{source.path}: the 'upstream_extra' metadata is not a JSON object")
    return value


def upstream_metadata(source: Source) -> dict[str, str] | None:
    """Upstream's own safetensors metadata strings, verbatim: the source's, or as our metadata recorded them."""
    if source.format == UPSTREAM_SAFETENSORS:
        return dict(source.metadata)
    raw = source.metadata.get("upstream_metadata")
    try:
        value = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        raise CheckpointError(f"{source.path}: the 'upstream_metadata' metadata is not JSON; the file is damaged") \
            from None
    if value is not None and not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        raise CheckpointError(f"{source.path}: the 'upstream_metadata' metadata is not an object of strings")
    return value


def _checkpoint_metadata(source: Source) -> dict[str, str]:
    upstream = _upstream_config(source)
    return {**source.metadata, **({"upstream_config": upstream} if upstream is not None else {})}


# ----------------------------------------------------------------------------- writing


def infer_write_format(dst: str | Path, to: str | None = None, family: Family | None = None) -> str:
    """Output format from DST's form: .safetensors / a directory -> torch; .pkl / .msgpack -> Flax.

    family: the checkpoint's. A family whose upstream writes safetensors itself (Needle 3) has both layouts in
    .safetensors, so there --to must say which."""
    dst = Path(dst)
    if to not in (None, "torch", "flax"):
        raise NeedleTwinError(f"--to {to!r} is unknown; use torch or flax")
    suffix = dst.suffix.lower()
    if suffix == ".safetensors":
        return _safetensors_layout(dst, to, family)
    by_suffix = {".pkl": PICKLE, ".pickle": PICKLE, ".msgpack": MSGPACK,
                 **{ext: f.name for f in registry.FORMATS.values()
                    if f.write and (family is None or f.family == family.name) for ext in f.extensions}}.get(suffix)
    owners = [registry.family_named(f.family).title for f in registry.FORMATS.values() if suffix in f.extensions]
    if by_suffix is None and owners:
        raise NeedleTwinError(f"a {suffix} file holds a {' or '.join(owners)} model, but this checkpoint is "
                              f"{family.title}; pick another output format")
    if by_suffix is None and (dst.is_dir() or not suffix):
        return ORBAX if to == "flax" else HF_DIR
    if by_suffix is None:
        raise NeedleTwinError(f"cannot tell the output format from {dst.name!r}; use .safetensors or a directory "
                              "(torch), .pkl or .msgpack (Flax), a directory with --to flax (Orbax), or .cact "
                              "(a quantised deployment build)")
    if by_suffix in registry.FORMATS:
        if to is not None:
            raise NeedleTwinError(f"--to does not apply to {dst.name!r}, a {by_suffix} file; drop --to")
        return by_suffix
    side = "torch" if by_suffix in TORCH_FORMATS else "flax"
    if to is not None and to != side:
        raise NeedleTwinError(f"--to {to} contradicts the output name {dst.name!r}, which is a {side} format; "
                              f"drop --to or rename the output")
    return by_suffix


def _safetensors_layout(dst: Path, to: str | None, family: Family | None) -> str:
    upstream_has_one = family is not None and family.safetensors_version is not None
    if to == "flax":
        if family is not None and not upstream_has_one:
            raise NeedleTwinError(f"--to flax with {dst.name!r}: upstream's {family.title} checkpoints are pickles, "
                                  "not safetensors; write a .pkl, or drop --to flax for a torch .safetensors")
        return UPSTREAM_SAFETENSORS
    if to is None and upstream_has_one:
        raise NeedleTwinError(f"{dst.name!r} could hold either layout of a {family.title} checkpoint; add --to torch "
                              "(our torch state_dict) or --to flax (upstream's own checkpoint file)")
    return SAFETENSORS


def write_checkpoint(params: Mapping[str, Any], config: FamilyConfig, dst: str | Path, *,
                     format: str | None = None, force: bool = False, dtype: str | None = None,
                     metadata: Mapping[str, str] | None = None, max_shard_size: int | str | None = None,
                     check_finite: bool = True, on_bytes: Callable[[int], None] | None = None,
                     extra: Mapping[str, Any] | None = None, **options: Any) -> Path:
    """Write an in-memory Flax tree in any writable format (atomically; never over dst without force).

    config: the family's config object (its class picks the family). metadata: extra safetensors metadata; keys
    the writer owns (config, hashes, versions) are recomputed. extra: upstream's other top-level entries (Needle 2:
    step, run), written into a format-v2 pickle and kept by every other format. options: a family format's (a
    .cact: bits, tokenizer).
    """
    if not isinstance(config, FamilyConfig):
        raise ConfigError(f"write_checkpoint needs a family config object (e.g. convert.v2.TransformerConfig), got "
                          f"{type(config).__name__}")
    source = source_from_tree(params)
    source.extra = dict(extra or {})
    return write_source(source, config, dst, format=format, force=force, dtype=dtype, metadata=metadata,
                        max_shard_size=max_shard_size, check_finite=check_finite, on_bytes=on_bytes, **options)


def write_source(source: Source, config: FamilyConfig, dst: str | Path, *, format: str | None = None,
                 force: bool = False, dtype: str | None = None, metadata: Mapping[str, str] | None = None,
                 max_shard_size: int | str | None = None, check_finite: bool = True,
                 on_bytes: Callable[[int], None] | None = None, **options: Any) -> Path:
    """Convert an opened checkpoint to dst after strict checks; nothing is left at dst on any failure.

    options: a family format's write options (a .cact: bits, tokenizer); None values are left out."""
    dst = Path(dst)
    fmt = format or infer_write_format(dst)
    if fmt not in WRITE_FORMATS:
        raise NeedleTwinError(f"cannot write format {fmt!r}; writable: {', '.join(WRITE_FORMATS)}")
    options = {k: v for k, v in options.items() if v is not None}
    owned = registry.FORMATS.get(fmt)
    allowed = owned.options if owned is not None else ()
    stray = sorted(set(options) - set(allowed))
    if stray:
        raise NeedleTwinError(f"{', '.join('--' + k for k in stray)} only apply to a "
                              f"{' or '.join(n for n, f in registry.FORMATS.items() if set(stray) <= set(f.options))} "
                              f"output, not {fmt}; drop them or change DST")
    if owned is not None and registry.family_of(config).name != owned.family:
        raise NeedleTwinError(f"a {fmt} file holds a {registry.family_named(owned.family).title} model, but this "
                              f"checkpoint is {registry.family_of(config).title}")
    directory = fmt in (HF_DIR, ORBAX)
    if max_shard_size is not None and fmt != HF_DIR:
        raise NeedleTwinError("--max-shard-size applies to a directory output (HF-style shards); "
                              "give a directory as DST or drop the option")
    cast = weight_dtype(dtype) if dtype is not None else None
    atomic.check_target(dst, force=force, directory=directory)  # fail before reading anything big
    family = registry.family_of(config)
    table = plan.validate(source, family, config, cast)
    meta = _output_metadata(source, config, dtype, metadata, with_hash=fmt in (SAFETENSORS, HF_DIR))
    with atomic.atomic_output(dst, force=force, directory=directory) as tmp:
        try:
            bad = _write(fmt, source, table, config, cast, tmp, meta, max_shard_size, check_finite, on_bytes,
                         options)
        except OSError as e:  # disk full, quota, read-only folder...: our temp file goes, DST is untouched
            raise NeedleTwinError(f"converting to {dst} failed: {e.strerror or e} ({e.filename or tmp}); "
                                  "nothing was written") from None
        if bad:
            raise plan.non_finite_error(source.path, bad, dtype)
    return dst


def _output_metadata(source: Source, config: FamilyConfig, dtype: str | None,
                     extra: Mapping[str, str] | None, with_hash: bool = True) -> dict[str, str]:
    meta = {"format": "needle-twin", "format_version": FORMAT_VERSION, "tool_version": tool_version(),
            FAMILY_KEY: config.family, "config": json.dumps(config.to_dict(), sort_keys=True),
            "source_format": source.format}
    upstream = _upstream_config(source)
    if upstream is not None:
        meta["upstream_config"] = upstream
    verbatim = upstream_metadata(source)
    if verbatim is not None:
        meta["upstream_metadata"] = json.dumps(verbatim)
    others = upstream_extra(source)  # the source's own; else the caller's metadata may carry them (below)
    if others:
        meta["upstream_extra"] = json.dumps(others)
    if dtype is not None:
        meta["dtype_cast"] = dtype
    if with_hash and source.sha256 is not None:
        meta["source_sha256"] = SHA_PLACEHOLDER
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise NeedleTwinError(f"metadata must map strings to strings, got {key!r}: {value!r}")
        if key not in _RESERVED_METADATA and not (key == "upstream_extra" and others):
            meta[key] = value  # e.g. a Checkpoint's old metadata: its config/hash are recomputed above
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


def upstream_config_dict(config: FamilyConfig, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Config dict for an upstream file: the source's own dict when it still describes this config, else the dict
    upstream's trainer would write for it (FamilyConfig.upstream_dict)."""
    raw = metadata.get("upstream_config")
    if raw is not None:
        try:
            stored = config_from_json(json.loads(raw))
            if isinstance(stored, dict) and registry.family_of(config).config_from_dict(stored) == config:
                return stored
        except (json.JSONDecodeError, NeedleTwinError):
            pass  # a stale or foreign value: fall back to the canonical dict
    return config.upstream_dict()


def _write(fmt: str, source: Source, table: ParamTable, config: FamilyConfig, cast: np.dtype | None,
           tmp: Path, meta: dict[str, str], max_shard_size: int | str | None, check_finite: bool,
           on_bytes: Callable[[int], None] | None, options: Mapping[str, Any]) -> list[str]:
    """Dispatch to the format writer; returns the names of non-finite tensors (the caller aborts on any)."""
    bad: list[str] = []
    check = _FiniteChecker(bad) if check_finite else None
    if fmt in registry.FORMATS:  # a family's own format: it takes the whole tree in memory
        arrays = {p.name: p.array() for p in plan.flax_view(source, table, cast)}
        for name, array in arrays.items():
            if check is not None:
                check(name, array)
        if not bad:
            registry.FORMATS[fmt].write(unflatten_tree(arrays), config, tmp, **options)
        return bad
    if fmt in (SAFETENSORS, HF_DIR):
        view = plan.torch_view(source, table, cast)
        # Only safetensors has room for the source hash (a placeholder in meta when there is one to compute).
        sha = _SourceHash(source.sha256).get if "source_sha256" in meta else None
        if fmt == SAFETENSORS:
            safetensors_format.write_file(tmp, view, meta, on_bytes, sha, check)
        else:
            safetensors_format.write_dir(tmp, view, meta, config, max_shard_size, on_bytes, sha, check)
        return bad
    view = plan.flax_view(source, table, cast)
    family, config_dict = registry.family_of(config), upstream_config_dict(config, meta)
    others = json.loads(meta["upstream_extra"]) if "upstream_extra" in meta else {}
    if fmt == UPSTREAM_SAFETENSORS:
        upstream_safetensors.write(tmp, view, _upstream_file_metadata(meta, config, config_dict, others), on_bytes,
                                   check)
    elif fmt == PICKLE:
        upstream_pickle.write(tmp, {p.name: p for p in view}, pickle_layout(family, config_dict, others), on_bytes,
                              check)
    elif fmt == MSGPACK:
        top = {} if family.pickle_version is None else {"format_version": family.pickle_version, **others}
        msgpack_format.write(tmp, view, config_dict, top, on_bytes, check)
    elif fmt == ORBAX:
        orbax_format.write(tmp, view, config_dict, family.name, others, on_bytes, check)
    return bad


def _upstream_file_metadata(meta: Mapping[str, str], config: FamilyConfig, config_dict: Mapping[str, Any],
                            others: Mapping[str, Any]) -> dict[str, str]:
    """Upstream's four metadata strings: the source's verbatim while its config still describes this model, else
    made as upstream's writer makes them."""
    recorded = json.loads(meta.get("upstream_metadata", "null"))
    if recorded is not None and set(upstream_safetensors.KEYS) <= set(recorded):
        try:
            same = registry.family_of(config).config_from_dict(json.loads(recorded["config"])) == config
        except (json.JSONDecodeError, NeedleTwinError, TypeError):
            same = False
        if same:
            return {k: recorded[k] for k in upstream_safetensors.KEYS}
    return upstream_safetensors.metadata_for(config_dict, others)


def pickle_layout(family: Family, config_dict: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level dict of the family's upstream pickle, in upstream's key order (params: the PARAMS marker)."""
    values = {"format_version": family.pickle_version, "params": upstream_pickle.PARAMS, "config": dict(config_dict),
              **extra}
    return {k: values[k] for k in family.pickle_keys if k in values and values[k] is not None}


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
    "read_checkpoint", "resolve_config", "source_family", "write_checkpoint", "write_source",
]
