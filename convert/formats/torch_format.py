"""torch.save'd state_dicts (.pt/.bin), read with torch.load(weights_only=True): tensors and plain data only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from convert.errors import CheckpointError, one_line
from convert.formats.upstream_pickle import plain_config
from convert.source import TORCH, Source, file_sha256
from convert.tensors import TensorRef

FORMAT = "torch-pt"
_STATE_KEYS = ("state_dict", "model_state_dict", "model")  # where training scripts commonly nest the weights


def read(path: Path) -> Source:
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes); re-copy the checkpoint")
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a torch file; reading it needs torch (pip install 'needle-twin[torch]')") \
            from None
    try:
        # weights_only: torch's own allowlist unpickler, so a hostile .pt cannot run code.
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
        raise CheckpointError(f"{path}: torch.load(weights_only=True) refused the file ({type(e).__name__}: "
                              f"{one_line(e)})") from None
    state, config = _split(obj, path)
    from convert.mapping import _torch_to_numpy

    tensors = {}
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(value).__name__}, expected a tensor")
        tensors[name] = TensorRef.of(_torch_to_numpy(value))
    return Source(path, FORMAT, TORCH, tensors, config, f"{path} ('config')", {}, lambda: file_sha256(path))


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _split(obj: Any, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state_dict, config) from a bare state_dict or {"state_dict"|"model_state_dict"|"model": ..., "config": ...}."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, expected a state_dict (dict of tensors)")
    for key in _STATE_KEYS:
        if isinstance(obj.get(key), dict):
            config = obj.get("config")
            return obj[key], (plain_config(config, path) if config is not None else None)
    return obj, None
