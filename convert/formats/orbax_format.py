"""Orbax PyTree checkpoint directories, restored to host numpy whatever sharding they were saved with.

We write {"params": tree} with Orbax's synchronous PyTreeCheckpointer and put the config in
config.json inside the directory (Orbax ignores files it does not know): upstream's own dict, the
fields that were set (as an upstream pickle stores it), so pickle -> Orbax -> pickle keeps it exactly;
upstream.json beside it holds the family and upstream's other entries (Needle 2: step, run). We read a PyTree
directory, or a CheckpointManager step directory holding one item, and take the params
from {"params": ...} (a TrainState's other fields are ignored) or from a bare params tree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert.errors import CheckpointError, one_line
from convert.formats.common import FAMILY_KEY, config_to_json, load_config_json, load_json_object, plain_value
from convert.formats.msgpack_format import split
from convert.rules import FLAX
from convert.source import Source, file_sha256
from convert.tensors import TensorRef
from convert.trees import flatten_tree, unflatten_tree

FORMAT = "orbax"
CONFIG_NAME, UPSTREAM_NAME = "config.json", "upstream.json"


def _ignore_closed_loop_callbacks() -> None:
    """After a failed restore, tensorstore finishes pending reads on its own threads and calls back into an
    asyncio loop Orbax has already closed; Python reports each as an 'unraisable' RuntimeError. Drop exactly
    those (process-wide, as they arrive late) so a damaged checkpoint gives one error line, not pages."""
    previous = sys.unraisablehook
    if getattr(previous, "_needle_twin", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook._needle_twin = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax logs every save/restore (and every damaged file) through absl; we report errors ourselves."""
    _ignore_closed_loop_callbacks()
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "jax")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _item_dir(path: Path) -> Path:
    """The PyTree item directory: path itself, or the single item inside a CheckpointManager step."""
    if (path / "_METADATA").is_file() or (path / "manifest.ocdbt").is_file():
        return path
    items = [p for p in path.iterdir() if p.is_dir() and (p / "_METADATA").is_file()]
    if len(items) == 1:
        return items[0]
    raise CheckpointError(f"{path}: no Orbax PyTree item (_METADATA) found"
                          + (f"; it holds several items ({', '.join(p.name for p in items)}), point at one" if items
                             else "; is the checkpoint complete?"))


def read(path: Path) -> Source:
    item = _item_dir(path)
    try:
        import jax
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError(f"reading Orbax checkpoints needs orbax-checkpoint and jax ({e}); "
                              "pip install 'needle-twin[orbax]'") from None
    try:
        with _quiet():
            checkpointer = ocp.PyTreeCheckpointer()
            metadata = checkpointer.metadata(item.resolve())
            tree_meta = getattr(getattr(metadata, "item_metadata", None), "tree", None)
            if tree_meta is None:
                raise CheckpointError(f"{path}: cannot read the Orbax checkpoint's metadata; it is incomplete or "
                                      "damaged, re-copy or re-save it")
            # Host numpy for every leaf: no device placement, so any saved sharding restores on any machine.
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree_meta)
            tree = checkpointer.restore(item.resolve(), restore_args=restore_args)
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        raise CheckpointError(f"{path}: cannot restore the Orbax checkpoint ({type(e).__name__}: "
                              f"{one_line(e)}); is it complete and undamaged?") from None
    params, config, _ = split(_to_plain(tree), path)
    tensors = {}
    for name, leaf in flatten_tree(params).items():
        if not isinstance(leaf, (np.ndarray, np.generic)):
            raise CheckpointError(f"{path}: params/{name} is a {type(leaf).__name__}, expected an array")
        tensors[name] = TensorRef.of(np.asarray(leaf))
    config_path = path / CONFIG_NAME
    origin = f"{path} ('config')"
    if config is None and config_path.is_file():
        config, origin = load_config_json(config_path), str(config_path)
    family, extra = None, {}
    if (path / UPSTREAM_NAME).is_file():
        upstream = load_json_object(path / UPSTREAM_NAME, "upstream.json")
        family = upstream.pop(FAMILY_KEY, None)
        extra = {k: plain_value(v, f"{path / UPSTREAM_NAME}: {k}") for k, v in upstream.items()}
    return Source(path, FORMAT, FLAX, tensors, config, origin, {}, lambda: file_sha256(path), family, extra)


def _to_plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _to_plain(v) for k, v in node.items()}
    return node


def write(path: Path, view: Iterable, config_dict: Mapping[str, Any], family: str,
          extra: Mapping[str, Any] | None = None, on_bytes: Callable[[int], None] | None = None,
          check: Callable[[str, np.ndarray], None] | None = None) -> None:
    """{"params": tree} as an Orbax PyTree checkpoint plus config.json and upstream.json; Orbax needs the tree in
    memory."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError(f"writing Orbax checkpoints needs orbax-checkpoint ({e}); "
                              "pip install 'needle-twin[orbax]'") from None
    flat = {}
    for p in view:
        flat[p.name] = p.array()
        if check is not None:
            check(p.name, flat[p.name])
        if on_bytes is not None:
            on_bytes(p.nbytes)
    with _quiet():
        ocp.PyTreeCheckpointer().save(path.resolve(), {"params": unflatten_tree(flat)})
    (path / CONFIG_NAME).write_text(json.dumps(config_to_json(config_dict), indent=2) + "\n", encoding="utf-8")
    upstream = {FAMILY_KEY: family, **(extra or {})}
    (path / UPSTREAM_NAME).write_text(json.dumps(upstream, indent=2) + "\n", encoding="utf-8")
