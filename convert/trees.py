"""Nested param trees, dtype names and the numpy <-> torch edge, for every family.

torch is imported only inside the two edge functions, when a torch tensor is actually met,
so `convert` itself imports neither torch nor jax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def flatten_tree(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict (or FrozenDict) -> {"a/b/c": leaf}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, path + "/"))
        else:
            flat[path] = value
    return flat


def unflatten_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/c": leaf} -> nested dict."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for "float32", "bfloat16", "float16", ... (bfloat16 and float8 kinds via ml_dtypes)."""
    if name.startswith(("bfloat16", "float8")):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous copy only when needed; unlike np.ascontiguousarray, keeps 0-d arrays 0-d."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def as_numpy(x: Any) -> np.ndarray:
    """numpy, jax or torch array (bfloat16 included) as a numpy array."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def numpy_to_torch(a: np.ndarray):
    """numpy -> torch sharing memory where possible; bfloat16 through its bit pattern."""
    import torch

    a = contiguous(np.asarray(a))
    if not a.flags.writeable:  # torch tensors are writable: never alias read-only (e.g. mmapped) memory
        a = a.copy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
