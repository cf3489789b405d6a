"""Upstream's own safetensors checkpoint (Needle 3's `checkpoints.write_checkpoint`), read lazily and safely.

The file is the Flax param tree flattened with '/' (`stack/layers/block/self_attn/q_proj/kernel`), each tensor in
its own dtype, and `__metadata__` strings: `format_version` "2", `config` (JSON of the config dict), `step` ("" or
an integer) and `run` (JSON). Metadata is parsed as JSON data, never evaluated. Our own safetensors files hold the
torch layout (dotted names) and say `format: needle-twin`; upstream's hold Flax paths, which is how the two are
told apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert.errors import CheckpointError
from convert.formats.safetensors_format import read_header, write_file
from convert.rules import FLAX
from convert.source import Source, file_sha256
from convert.tensors import TensorRef

FORMAT = "upstream-safetensors"
VERSION = "2"  # upstream's format_version, the same number as Needle 2's pickles
KEYS = ("format_version", "config", "step", "run")  # upstream's metadata, every one always written


def is_upstream(tensors: Mapping[str, TensorRef], metadata: Mapping[str, str]) -> bool:
    """Flax paths and no needle-twin marker: upstream's layout, not ours."""
    return metadata.get("format") != "needle-twin" and bool(tensors) and all("/" in name for name in tensors)


def read(path: Path) -> Source:
    tensors, metadata, _ = read_header(path)
    version = metadata.get("format_version")
    if version != VERSION:
        raise CheckpointError(f"{path}: upstream checkpoint format_version {version!r}; needle-twin reads upstream's "
                              f"safetensors format_version {VERSION!r} (cactus-needle 3.x)")
    return Source(path, FORMAT, FLAX, tensors, _config(path, metadata), f"{path} (metadata 'config')",
                  dict(metadata), lambda: file_sha256(path), None, _extra(path, metadata))


def _config(path: Path, metadata: Mapping[str, str]) -> dict[str, Any]:
    raw = metadata.get("config")
    if raw is None:
        raise CheckpointError(f"{path}: the metadata has no 'config'; an upstream Needle checkpoint carries its "
                              "config there (pass --config with the model's config to read it anyway)")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: the 'config' metadata is not JSON; the file is damaged") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: the 'config' metadata is a JSON {type(config).__name__}, not an object")
    return config


def _extra(path: Path, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Upstream's `step` (an int, or None for "") and `run` (JSON), as its loader returns them."""
    out: dict[str, Any] = {}
    if "step" in metadata:
        step = metadata["step"]
        if step and not step.lstrip("-").isdigit():
            raise CheckpointError(f"{path}: the 'step' metadata {step[:40]!r} is not an integer; the file is damaged")
        out["step"] = int(step) if step else None
    if "run" in metadata:
        try:
            out["run"] = json.loads(metadata["run"])
        except json.JSONDecodeError:
            raise CheckpointError(f"{path}: the 'run' metadata is not JSON; the file is damaged") from None
    return out


def metadata_for(config_dict: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, str]:
    """The metadata upstream's `write_checkpoint` writes for this config dict, step and run."""
    step = extra.get("step")
    return {"format_version": VERSION, "config": json.dumps(dict(config_dict), default=str),
            "step": "" if step is None else str(step), "run": json.dumps(extra.get("run") or {}, default=str)}


def write(path: Path, view: Iterable, metadata: Mapping[str, str], on_bytes: Callable[[int], None] | None = None,
          check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """The tensors in upstream's file order (safetensors' own: wider dtypes first, then by name) and its metadata."""
    write_file(path, sorted(view, key=lambda p: p.name), metadata, on_bytes, None, check)
