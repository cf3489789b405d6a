"""Needle 3's ladder and width halving (NEEDLE_V3.md §4) as framework-free functions on upstream's param tree.

Names, signatures and results are upstream's (`needle.model.architecture`): `ladder_config(cfg, d)` and
`ladder_slice(params, cfg, d)` cut depth rung d (every depth 2..L is a deployable model), `width_config(cfg, w)`
and `width_slice(params, cfg, w)` the width half. Trees are nested dicts of arrays (numpy, jax or anything that
indexes like numpy); slices index, never copy arithmetic. Upstream asserts where these raise ConfigError naming
the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from convert.errors import ConfigError
from convert.v3.config import TransformerConfig, hada_blocks

HEAD_KEYS = ("embedding_head", "confidence_head", "router_head")


def bisection_order(num_layers: int) -> tuple[int, ...]:
    """Upstream's `_ladder_layer_order`: both ends, then the midpoint of the widest gap (leftmost on ties)."""
    if num_layers < 1:
        raise ConfigError("models require at least one layer")
    if num_layers == 1:
        return (0,)
    selected = [0, num_layers - 1]
    order = list(selected)
    while len(order) < num_layers:
        selected.sort()
        _, left, right = max(((hi - lo, lo, hi) for lo, hi in zip(selected, selected[1:], strict=False) if hi - lo > 1),
                             key=lambda gap: (gap[0], -gap[1]))
        selected.append((left + right) // 2)
        order.append((left + right) // 2)
    return tuple(order)


def ladder_order(spec: int | TransformerConfig) -> tuple[int, ...]:
    """The layer selection order: a config's own `ladder_order` (a sliced rung carries its parent's), else the
    bisection order of its depth."""
    if isinstance(spec, int):
        return bisection_order(spec)
    return tuple(spec.ladder_order) or bisection_order(spec.num_layers)


def ladder_layer_ranks(spec: int | TransformerConfig) -> tuple[int, ...]:
    """rank[l]: layer l's position in the ladder order (layer l runs at exit depth d iff rank[l] < d)."""
    ranks = [0] * len(ladder_order(spec))
    for rank, layer in enumerate(ladder_order(spec)):
        ranks[layer] = rank
    return tuple(ranks)


def ladder_layer_indices(spec: int | TransformerConfig, depth: int) -> tuple[int, ...]:
    """The original layers rung `depth` keeps, ascending (2 <= depth <= L)."""
    num_layers = spec if isinstance(spec, int) else spec.num_layers
    if not 2 <= depth <= num_layers:
        raise ConfigError(f"ladder depth must be in [2, {num_layers}], got {depth}")
    return tuple(sorted(ladder_order(spec)[:depth]))


def ladder_config(config: TransformerConfig, depth: int) -> TransformerConfig:
    """The config of rung `depth` (< L): kept layers renumbered, their order, sites and global layers carried."""
    if not depth < config.num_layers:
        raise ConfigError(f"a ladder rung needs depth < num_layers={config.num_layers}, got {depth}; the full model "
                          "is the checkpoint itself")
    if tuple(config.engram_layers) != tuple(sorted(config.engram_layers)):
        raise ConfigError(f"config.engram_layers={list(config.engram_layers)} is not sorted; upstream's ladder needs "
                          "sorted engram sites")
    selected = ladder_layer_indices(config, depth)
    remap = {layer: i for i, layer in enumerate(selected)}
    return dataclasses.replace(
        config, num_layers=depth,
        ladder_order=tuple(remap[layer] for layer in ladder_order(config) if layer in remap),
        global_layers=tuple(remap[layer] for layer in config.global_layers if layer in remap),
        engram_layers=tuple(remap[layer] for layer in config.engram_layers if layer in remap),
        ladder_depths=(), ladder_sample=False)


def ladder_slice(params: Mapping[str, Any], config: TransformerConfig, depth: int) -> dict[str, Any]:
    """The params of rung `depth`: stacked leaves (mhc_* too, not final_norm) at the kept layers, heads' rows
    (0, kept+1), the engram sites of kept layers renumbered, the rest as is."""
    selected = ladder_layer_indices(config, depth)
    keep = np.asarray(selected, np.int32)
    rows = np.asarray((0, *(layer + 1 for layer in selected)), np.int32)
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key == "stack":
            out[key] = {k: v if k == "final_norm" else _map(lambda a: a[keep], v) for k, v in value.items()}
        elif key in HEAD_KEYS:
            out[key] = {**value, "probes": value["probes"][rows], "gain": value["gain"][rows],
                        "row_bias": value["row_bias"][:, rows]}
        elif key.startswith("engrams_"):
            site = int(key.rsplit("_", 1)[1])
            if config.engram_layers[site] in selected:
                out[f"engrams_{sum(layer in selected for layer in config.engram_layers[:site])}"] = value
        else:
            out[key] = value
    return out


def width_config(config: TransformerConfig, w: int) -> TransformerConfig:
    """The config of the width half w = D/2: half the query heads, engram seeds kept by σ."""
    D = config.d_model
    why = None
    if 2 * w != D:
        why = f"width {w} is not half of d_model={D}"
    elif D & (D - 1):
        why = f"d_model={D} is not a power of two"
    elif config.num_heads % 2:
        why = f"num_heads={config.num_heads} is odd"
    elif hada_blocks(w)[1] != hada_blocks(D)[1]:
        why = f"the Monarch factor b of width {w} differs from d_model {D}'s (only D = 4^m halves)"
    elif config.engram_layers and config.engram_heads_resolved % 2:
        why = f"the engram has {config.engram_heads_resolved} head(s) per order, not an even number"
    if why:
        raise ConfigError(f"cannot halve this config's width: {why} (upstream asserts it)")
    return dataclasses.replace(config, d_model=w, num_heads=config.num_heads // 2,
                               engram_seed_heads=config.engram_seed_stride, ladder_depths=(), ladder_sample=False,
                               ladder_widths=())


def width_slice(params: Mapping[str, Any], config: TransformerConfig, w: int) -> dict[str, Any]:
    """The leading part of every parameter for the width half w (NEEDLE_V3.md §4's table)."""
    D, heads, sub_dim, orders = config.d_model, config.engram_heads_resolved, config.engram_sub_dim, \
        config.engram_orders
    hq, hv = config.head_dims
    q_cols, o_rows = config.num_heads // 2 * hq, config.num_heads // 2 * hv
    a_child = hada_blocks(1 << (w - 1).bit_length())[0]
    tables = np.concatenate([oi * heads + np.arange(heads // 2) for oi in range(len(orders))])
    kv_rows = (tables[:, None] * sub_dim + np.arange(sub_dim)).ravel()
    lane_rows = (np.arange(config.mhc_lanes)[:, None] * D + np.arange(w)).ravel()

    def cut(path: str, a):
        name = path.rsplit("/", 1)[-1]
        if path.startswith("ab_scales"):
            return a
        if path.startswith("engrams_"):
            if name == "embedding":
                return a[tables]
            if path.endswith(("key_proj/kernel", "value_proj/kernel")):
                return a[kv_rows][:, :w]
            return a[..., :w] if name == "taps" else a
        if path.startswith(HEAD_KEYS):
            if name in ("probes", "query"):
                return a[..., :w]
            if path.endswith("proj/kernel"):
                return a.reshape(-1, D, a.shape[-1])[:, :w].reshape(-1, a.shape[-1])
            return a
        if "mhc_phi" in path:
            return a[:, lane_rows]
        if "/hadamard_mlp/" in path:
            if name in ("w1a", "w2a", "w3a"):
                return a[..., :a_child, :a_child]
            if name in ("d1", "d2", "b2", "d3", "d4", "cond_u"):
                return a[..., :w]
            return a[..., :w, :] if name == "cond_v" else a
        cuts = {"q_proj/kernel": lambda: a[..., :w, :q_cols], "gate_proj/kernel": lambda: a[..., :w, :o_rows],
                "k_proj/kernel": lambda: a[..., :w, :], "v_proj/kernel": lambda: a[..., :w, :],
                "out_proj/kernel": lambda: a[..., :o_rows, :w], "/q_taps": lambda: a[..., :q_cols]}
        for suffix, take in cuts.items():
            if path.endswith(suffix):
                return take()
        if path.endswith(("/k_taps", "/v_taps", "q_norm/scale", "k_norm/scale")):
            return a
        if path.endswith("/scale") or path == "embedding/embedding":
            return a[..., :w]
        return a

    return _map_with_path(cut, params)


def _map(fn, tree):
    return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, Mapping) else fn(tree)


def _map_with_path(fn, tree, prefix: str = ""):
    if isinstance(tree, Mapping):
        return {k: _map_with_path(fn, v, f"{prefix}{k}/") for k, v in tree.items()}
    return fn(prefix[:-1], tree)
