"""torch.save'd state_dicts (.pt/.bin), read with torch.load(weights_only=True): tensors and plain data only."""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from convert.errors import CheckpointError, one_line
from convert.formats.upstream_pickle import plain_config
from convert.source import TORCH, Source, file_sha256
from convert.tensors import TensorRef

FORMAT = "torch-pt"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default container since torch 1.6
_LEGACY_PICKLES = 5  # a legacy (non-zip) torch.save file: magic, protocol, sys_info, object, storage keys; then data
_STATE_KEYS = ("state_dict", "model_state_dict", "model")  # where training scripts commonly nest the weights


def read(path: Path) -> Source:
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes); re-download or re-save the checkpoint")
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a torch file; reading it needs torch (pip install 'needle-twin[torch]')") \
            from None
    try:
        # weights_only: torch's own allowlist unpickler, so a hostile .pt cannot run code.
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, OSError, EOFError... for bad files
        raise _load_error(path, e) from None
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
        return f.read(4) == _ZIP_MAGIC


def _load_error(path: Path, e: Exception) -> CheckpointError:
    """Our one-line error for a failed torch.load: damage first (a cut-off pickle fakes odd globals), then safety."""
    damage = _damage(path, e)
    if damage:
        return CheckpointError(f"{path}: truncated or damaged torch checkpoint: {damage}; re-download the file or "
                               "re-save it with torch.save")
    if isinstance(e, pickle.UnpicklingError):
        name = _forbidden_global(str(e))
        if name:
            return CheckpointError(f"{path}: refused: its pickle references the forbidden global {name}, which "
                                   "would run code if the file were loaded unsafely; get the weights from a trusted "
                                   "source, ideally as .safetensors")
        detail = _torch_detail(str(e))
        return CheckpointError(f"{path}: refused: its pickle holds objects beyond tensors and plain data"
                               f"{f' ({detail})' if detail else ''}, so loading it unsafely could run code; "
                               "re-save it as a plain state_dict of tensors or as .safetensors")
    return CheckpointError(f"{path}: torch.load cannot read this file ({type(e).__name__}: {_torch_detail(str(e))}); "
                           "re-download the file or re-save it with torch.save")


def _damage(path: Path, e: Exception) -> str | None:
    """What is cut off or broken in a torch file's container, or None when its structure is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC or (len(head) < 4 and _ZIP_MAGIC.startswith(head)):
        return _zip_damage(path, size)
    if head[:1] == b"\x80":
        return _legacy_damage(path, size, e)
    return f"it is neither a zip archive nor a legacy torch pickle (starts with {head!r})"


def _zip_damage(path: Path, size: int) -> str | None:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        # A cut-off zip loses its central directory, which sits at the very end of the file.
        return f"the zip archive is incomplete ({size} bytes, its central directory at the end is missing)"
    except (OSError, ValueError, EOFError, struct.error) as e:  # zipfile's other complaints about mangled records
        return f"the zip archive is corrupt ({type(e).__name__}: {one_line(e, 80)})"
    with archive:
        pkl = next((n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
        if pkl is None:
            return "the zip archive has no data.pkl, so torch.save did not write it"
        try:
            data = archive.read(pkl)  # the pickle only (tensor bytes live in other members): small
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError) as e:
            return f"its {pkl} cannot be read ({one_line(e, 80)})"
    broken = _pickle_break(io.BytesIO(data))
    return f"its {pkl} is cut short or corrupt ({broken})" if broken else None


def _legacy_damage(path: Path, size: int, e: Exception) -> str | None:
    with open(path, "rb") as f:
        for i in range(_LEGACY_PICKLES):
            broken = _pickle_break(f)
            if broken:
                return f"the legacy (non-zip) file's pickle {i + 1} of {_LEGACY_PICKLES} is cut short or corrupt " \
                       f"({broken}; {size} bytes in all)"
    # The pickles are whole: a short read past them means the raw tensor bytes are cut off.
    if isinstance(e, (EOFError, struct.error)) or "unexpected EOF" in str(e):
        return f"the legacy (non-zip) file's tensor data is cut short ({size} bytes)"
    return None


def _pickle_break(stream: BinaryIO) -> str | None:
    """Why the pickle at `stream` is incomplete or malformed, or None; decodes opcodes only, never builds objects."""
    try:
        for _ in pickletools.genops(stream):
            pass
    except ValueError as e:  # genops' only complaint: truncated argument, missing STOP, unknown opcode
        return one_line(e, 80)
    return None


_GLOBAL_PATTERNS = (
    r"GLOBAL (\S+) was not an allowed global",  # "Unsupported global: GLOBAL eval was not an allowed global ..."
    r"GLOBAL (\S+) whose module \S+ is blocked",  # "Trying to load unsupported GLOBAL posix.system whose module ..."
    r"reduce for unrecognized function (.+?)(?: which belongs to|\n|$)",  # "Trying to call reduce for ..."
)


def _forbidden_global(text: str) -> str | None:
    """The global torch's weights-only unpickler refused, from its message (torch drops "builtins.")."""
    for pattern in _GLOBAL_PATTERNS:
        m = re.search(pattern, text, flags=re.MULTILINE)
        if m:
            name = m.group(1)
            return name if "." in name or name.startswith("<") else f"builtins.{name}"
    return None


def _torch_detail(text: str) -> str:
    """torch's error without its advice: it suggests weights_only=False, i.e. running the file's code."""
    parts = [p for p in re.split(r"\n\s*\n|\n\t", text) if p.strip()]
    keep = [p for p in parts if not re.search(r"weights_only|Weights only load failed|documentation|trust", p)]
    return one_line(" ".join(keep).split(" This is an internal miniz error")[0], 120)


def _split(obj: Any, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state_dict, config) from a bare state_dict or {"state_dict"|"model_state_dict"|"model": ..., "config": ...}."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, expected a state_dict (dict of tensors)")
    for key in _STATE_KEYS:
        if isinstance(obj.get(key), dict):
            config = obj.get("config")
            return obj[key], (plain_config(config, path) if config is not None else None)
    return obj, None
