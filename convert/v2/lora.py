"""Needle 2 LoRA adapters (`needle finetune`, NEEDLE_V2.md §7.2): upstream's merge rule, framework-free.

An adapter is {"lora": {flax path: {"A": (L, in, r), "B": (L, r, out)}}, "scale": alpha / rank,
"base": base checkpoint path, "rank": r}. Upstream merges W' = W + cast_{W.dtype}(scale * (A @ B)):
the product in float32, batched over the layer axis, cast to W's dtype before the addition, so
the sum happens in W's dtype (float16 when `needle build` merges into a float16 checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from convert.trees import flatten_tree, unflatten_tree


def merge_lora(params: Mapping[str, Any], lora: Mapping[str, Mapping[str, np.ndarray]], scale: float
               ) -> dict[str, Any]:
    """A new param tree with every adapter target merged by upstream's rule; other leaves are shared, not copied."""
    flat = flatten_tree(params)
    for path, ab in lora.items():
        w = np.asarray(flat[path])
        a, b = np.asarray(ab["A"], np.float32), np.asarray(ab["B"], np.float32)
        delta = np.float32(scale) * np.matmul(a, b)  # (L, in, out), float32 like jnp's f32 @ f32
        flat[path] = w + delta.astype(w.dtype)
    return unflatten_tree(flat)
