"""What every format reader and writer shares: our file-format version, config dicts as JSON, plain values.

Upstream's config dict holds only the fields that were set, with Python types a JSON file
cannot tell apart (Needle 2's `engram_layers` is a tuple, a list elsewhere); round trips
must give the same dict back, so wherever we store it as JSON the top-level keys whose
values were tuples are listed under "__tuples__".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert.errors import CheckpointError, ConfigError, one_line

FORMAT_VERSION = "1"  # of the files needle-twin writes (safetensors metadata "format_version")
SHA_PLACEHOLDER = "0" * 64  # fixed width, patched in place once the source hash is known
FAMILY_KEY = "family"  # in our safetensors metadata and config.json files: the model family
TUPLES_KEY = "__tuples__"


def plain_value(value: Any, where: str) -> Any:
    """A config value as plain Python data (numpy scalars to Python ones); anything else is refused."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [plain_value(v, where) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return {str(k): plain_value(v, where) for k, v in value.items()}
    raise CheckpointError(f"{where} is a {type(value).__name__}; expected numbers, strings, bools or lists of them")


def plain_config(config: Any, path: Path | str) -> dict[str, Any]:
    """A stored config dict with plain values; its keys must be strings."""
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{path}: 'config' is a {type(config).__name__}, expected a dict of fields")
    out = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: config key {key!r} is not a string")
        out[key] = plain_value(value, f"{path}: config.{key}")
    return out


def config_to_json(d: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict as a JSON object: tuple values as lists, their keys listed under "__tuples__"."""
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    tuples = [k for k, v in d.items() if isinstance(v, tuple)]
    return {**out, TUPLES_KEY: tuples} if tuples else out


def config_from_json(d: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of config_to_json (a dict without "__tuples__" comes back as it is)."""
    tuples = d.get(TUPLES_KEY, [])
    if not isinstance(tuples, list):
        raise ConfigError(f"config {TUPLES_KEY!r} must list key names, got {tuples!r}")
    return {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in d.items() if k != TUPLES_KEY}


def load_json_object(path: Path, what: str = "config") -> dict[str, Any]:
    """A JSON file holding one object (a config.json, an index, an adapter_config.json)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON {what} ({one_line(e)}); fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {what} must be a JSON object, got {type(data).__name__}")
    return data


def load_config_json(path: Path) -> dict[str, Any]:
    """A config.json (or --config file): a JSON object of config fields (our "family" entry stays in it)."""
    return config_from_json(load_json_object(path))
