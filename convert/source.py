"""What every format reader returns: tensors by stored name, the config it carries, and where they came from."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convert.errors import CheckpointError
from convert.rules import FLAX, TORCH
from convert.tensors import TensorRef
from convert.trees import as_numpy, flatten_tree

_HASH_WINDOW = 64 * 2**20  # a multiple of mmap.ALLOCATIONGRANULARITY


@dataclass
class Source:
    """A checkpoint opened for reading; tensor data stays on disk until a TensorRef is loaded."""

    path: Path
    format: str
    layout: str
    tensors: dict[str, TensorRef]
    config_dict: dict[str, Any] | None = None  # as stored (upstream pickles: only non-default fields)
    config_origin: str = ""  # where config_dict came from, for error messages
    metadata: dict[str, str] = field(default_factory=dict)
    sha256: Callable[[], str] | None = None  # hex digest of the source file(s), computed on demand
    family: str | None = None  # the family the file itself names (our metadata, upstream's format_version)
    extra: dict[str, Any] = field(default_factory=dict)  # upstream's other top-level entries (v2: step, run)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def checkpoint_size(path: Path) -> int:
    """A checkpoint file's size in bytes; an empty file is refused, in the same words by every reader."""
    size = os.stat(path).st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes); re-copy the checkpoint")
    return size


def file_sha256(path: Path) -> str:
    """SHA-256 of a file; of a directory, over its files' relative paths and hashes in sorted order."""
    if path.is_dir():
        outer = hashlib.sha256()
        for p in sorted(q for q in path.rglob("*") if q.is_file()):
            outer.update(f"{p.relative_to(path).as_posix()}\0{file_sha256(p)}\n".encode())
        return outer.hexdigest()
    digest = hashlib.sha256()
    # Window by window from the page cache, mapped: no copy into our memory (the hash is what costs), and
    # only one window counts towards our RSS at a time.
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        for start in range(0, size, _HASH_WINDOW):
            with mmap.mmap(f.fileno(), min(_HASH_WINDOW, size - start), offset=start, access=mmap.ACCESS_READ) as m:
                digest.update(m)
    return digest.hexdigest()


def source_from_tree(params: Mapping[str, Any], path: str | Path = "<params>") -> Source:
    """An in-memory Flax tree (numpy, jax or torch leaves) as a Source."""
    tensors = {name: TensorRef.of(as_numpy(leaf)) for name, leaf in flatten_tree(params).items()}
    return Source(Path(path), "memory", FLAX, tensors)


def source_from_state(state: Mapping[str, Any], path: str | Path = "<state_dict>") -> Source:
    """An in-memory torch state_dict (tensors or numpy arrays) as a Source."""
    return Source(Path(path), "memory", TORCH, {name: TensorRef.of(as_numpy(v)) for name, v in state.items()})
