"""Cached generation for the Needle 3 Flax twin, compiled once per shape, and upstream's recompute loop.

Upstream removed its cached decoder with Needle 3: `run.generate` re-runs the whole PAD-filled buffer for every
token (NEEDLE_V3.md §6). `generate_recompute` is that loop, the reference; `generate` computes the same function
from a cache holding Needle 3's state, as ONE jitted function (a prefill, then a `lax.while_loop` of single
steps with the token choice inside: no step recompiles, nothing returns to the host between steps):
- per layer, K (after k_norm and RoPE) and V in a ring of C slots: C = min(M, sliding_window) on local layers
  (a query there sees itself and w - 1 earlier keys, §3.5), C = min(M, kv_window) on global layers, kv_window
  defaulting to upstream's `config.effective_kv_window` (the deploy cache's bound; the whole context whenever
  M fits in it), plus on global layers a store of the sink positions' K and V, which stay visible past the ring;
- per layer, the last τ - 1 rows of projected q, k and v before the conv (§3.2: the conv runs on projected
  channels before the norms and RoPE; tap j >= 1 reads position t - j where the layer's mask lets t see it,
  tap 0 always);
- the buffer's tokens and validity: the engram (§3.4) at a position reads W = (max(O) - 1) + 3·max(O) tokens
  back (its n-grams, and the value rows its dilated taps read with theirs), so each step runs the forward's
  own `_engram_kv` on that short window.
The forward's own modules (Dense, ZCRMSNorm, HadamardMLP, the engram, the lane helpers) do the arithmetic with
the layer's params; this file only composes them around the cache, in the forward's order of operations. The
layers are a Python loop (local and global rings differ in size), as in the torch twin.

Contract (Needle 2's, shared with needle_torch.v3.generate): prompts (B, P) left-padded with pad_token_id, valid
from each row's first non-pad token on, the mask (causal ∧ valid) ∨ diagonal (plain causal for unpadded
prompts, run.py's); where a kv_window bounds the buffer, upstream's windowed mask of `hidden_cells` (§3.8):
(causal ∧ valid ∧ (q - k < kv_window ∨ k a sink)) ∨ diagonal, which every layer, conv tap and engram row reads
(local layers within their sliding window too); greedy or seeded sampling; each row stops at its first EOS (kept)
and holds pad_token_id after it; streaming; per-step logits and log-probabilities on request. RoPE reads absolute
buffer positions.

Shapes: B batch, P prompt length (padded), G = max_new_tokens, M = P + G buffer positions, S tokens fed in one
call, C ring slots, N_s sink positions, Z leading buffer columns before position 0, D d_model, H heads, K kv heads,
hq qk head dim, hv v head dim, n mHC lanes, N engram tables, V_out output vocab.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from convert.errors import GenerationError
from convert.v2.generation import check_generate_args, prompt_validity
from convert.v3.config import ENGRAM_TAPS, EOS_ID, PAD_ID
from convert.v3.ladder import ladder_layer_ranks
from needle_flax.layers import ZCRMSNorm, apply_rope, compute_dtype, make_causal_mask, precompute_rope_freqs, repeat_kv
from needle_flax.streaming import Streamer, emit, run_streaming
from needle_flax.v2.generate import _next_key, _result, pick
from needle_flax.v2.lanes import (
    flat_lanes,
    post_weights,
    pre_weights,
    project,
    read_lanes,
    rms_unit,
    sinkhorn,
    write_lanes,
)
from needle_flax.v3.model import HadamardMLP, SimpleAttentionNetwork, _aq
from needle_flax.v3.quant import quant_kv, quant_query

# ----------------------------------------------------------------------------- the cache


class LayerCache(NamedTuple):
    """One layer's state: K, V in a ring of C slots and the last τ - 1 projected q, k, v rows before the conv. In a
    DecodeCache every leaf carries a leading axis: the layers of one ring size, stacked for the layer scan."""

    k: jax.Array  # (B, K, C, hq) after k_norm and RoPE, in dt
    v: jax.Array  # (B, K, C, hv) in dt
    slot_pos: jax.Array  # (C,) int32: the buffer position each slot holds, -1 while empty
    rows: tuple | None  # (B, τ - 1, H·hq), (B, τ - 1, K·hq), (B, τ - 1, K·hv); None: τ = 0
    # the sink positions' K, V once fed (global layers under a kv_window with sinks; else None): past the ring's
    # window a sink is read from here
    store_k: jax.Array | None = None  # (B, K, N_s, hq)
    store_v: jax.Array | None = None  # (B, K, N_s, hv)
    store_pos: jax.Array | None = None  # (N_s,) int32: the position each store slot holds, -1 until fed


class DecodeCache(NamedTuple):
    """One request's state for M buffer positions. tokens/valid hold Z leading zeros/False so that a look back
    before position 0 is a slice (position p is column Z + p)."""

    rings: tuple  # per ring kind (_ring_kinds: (window, C)) the LayerCaches of its layers, stacked on axis 0
    tokens: jax.Array  # (B, Z + M) int32: the engram's token history (it rebuilds its n-grams and value rows)
    valid: jax.Array  # (B, Z + M) bool: upstream's validity, False before position 0
    cos: jax.Array  # (M, hq/2)
    sin: jax.Array  # (M, hq/2)
    sink: jax.Array | None = None  # (B, Z + M) bool: positions visible past the kv window (prompt positions only)
    sink_cols: jax.Array | None = None  # (N_s,) int32: the positions that are a sink in some row


def _engram_history(config) -> int:
    """W: the tokens before a position that its engram key and value read: max(O) - 1 for its n-grams, then 3·max(O)
    more for the value rows of its dilated taps and their n-grams (0 without sites)."""
    if not config.engram_layers:
        return 0
    return max(config.engram_orders) - 1 + (ENGRAM_TAPS - 1) * config.engram_dilation


def _lead(config) -> int:
    """Z: the deepest look back before a position: a conv tap or the engram's token history."""
    return max(1, config.qkv_conv_taps - 1, _engram_history(config))


def kv_bound(config, max_len: int, kv_window: int | None) -> int:
    """The kv_window the masks read: kv_window (None: config.effective_kv_window) where the buffer is longer, else
    0 (none)."""
    bound = config.effective_kv_window if kv_window is None else kv_window
    return bound if bound < max_len else 0


def _layer_plan(config, max_len: int, kv_window: int | None,
                layers: int | None) -> list[tuple[int, int, bool, int] | None]:
    """Per layer (window, ring slots C, global, lane), or None for a layer rung `layers` skips. window: keys
    q - k < window (0: all); local layers the sliding window, global ones the kv bound (kv_bound). lane: l mod n,
    or on a rung the layer's position among the rung's layers mod n. A global layer with a window keeps the sinks
    in a store."""
    bound = kv_bound(config, max_len, kv_window)
    plan, position = [], 0
    for i, active in enumerate(_active_layers(config, layers)):
        if not active:
            plan.append(None)
            continue
        local = config.sliding_window and i not in config.global_layers
        window = config.sliding_window if local else bound
        lane = (i if layers is None else position) % config.mhc_lanes
        plan.append((window, min(max_len, window or max_len), not local, lane))
        position += 1
    return plan


def _ring_kinds(plan) -> list[tuple[int, int, bool]]:
    """The distinct (window, C, global) of the running layers (local and global: at most two), in a fixed order;
    the layer scan stacks each kind's caches and picks a layer's kind with lax.switch."""
    return sorted({spec[:3] for spec in plan if spec is not None})


def new_cache(model: SimpleAttentionNetwork, batch: int, max_len: int, valid=None, kv_window: int | None = None,
              layers: int | None = None, sink=None, sink_cols=None) -> DecodeCache:
    """An empty DecodeCache for `batch` rows and max_len positions. valid (B, max_len) bool (None: all True);
    kv_window bounds the global layers' ring (None: config.effective_kv_window); layers: decode rung d only;
    sink (B, max_len) bool and sink_cols (N_s,) int32 (the positions a sink in some row), or None: positions that
    stay visible past the kv window."""
    cfg, dt = model.config, compute_dtype(model.config)
    if sink is None or not kv_bound(cfg, max_len, kv_window):
        sink = sink_cols = None
    H, K, tau = cfg.num_heads, cfg.num_kv_heads, cfg.qkv_conv_taps
    hq, hv = cfg.head_dims
    plan = _layer_plan(cfg, max_len, kv_window, layers)
    rings = []
    for window, C, global_layer in _ring_kinds(plan):
        n = sum(spec is not None and spec[:3] == (window, C, global_layer) for spec in plan)  # layers of this kind
        rows = None if not tau else tuple(jnp.zeros((n, batch, tau - 1, c), dt) for c in (H * hq, K * hq, K * hv))
        store = (None,) * 3
        if sink_cols is not None and global_layer:  # a global layer's ring ends at kv; its sinks live on here
            Ns = sink_cols.shape[0]
            store = (jnp.zeros((n, batch, K, Ns, hq), dt), jnp.zeros((n, batch, K, Ns, hv), dt),
                     jnp.full((n, Ns), -1, jnp.int32))
        rings.append(LayerCache(jnp.zeros((n, batch, K, C, hq), dt), jnp.zeros((n, batch, K, C, hv), dt),
                                jnp.full((n, C), -1, jnp.int32), rows, *store))
    Z = _lead(cfg)
    valid = jnp.ones((batch, max_len), jnp.bool_) if valid is None else jnp.asarray(valid, jnp.bool_)
    cos, sin = precompute_rope_freqs(hq, max_len, cfg.rope_theta)  # the forward's _rope table
    return DecodeCache(tuple(rings), jnp.zeros((batch, Z + max_len), jnp.int32), jnp.pad(valid, ((0, 0), (Z, 0))),
                       cos, sin, None if sink is None else jnp.pad(jnp.asarray(sink, jnp.bool_), ((0, 0), (Z, 0))),
                       sink_cols)


def _active_layers(config, layers: int | None) -> list[bool]:
    """Which layers run: all, or rung d's (ladder rank < d, subnetwork_only's stream)."""
    if layers is None:
        return [True] * config.num_layers
    if not 2 <= layers <= config.num_layers:
        raise GenerationError(f"layers={layers!r} is not a ladder rung of this {config.num_layers}-layer model; "
                              f"use a depth in [2, {config.num_layers}] (or None for the full model)")
    return [r < layers for r in ladder_layer_ranks(config)]


def _seen(cache: DecodeCache, lead: int, kv: int, positions, back: int):
    """(B, S) bool: may a query at `positions` see position - back under the request's mask (module docstring)?"""
    if back == 0:  # the diagonal: always (tap 0 is never masked, an order-1 n-gram always valid)
        return jnp.ones((cache.valid.shape[0], positions.shape[0]), jnp.bool_)
    ok = jnp.take(cache.valid, lead + positions - back, axis=1)
    if kv and back >= kv:  # past the kv window only a sink is seen
        return jnp.zeros_like(ok) if cache.sink is None else ok & jnp.take(cache.sink, lead + positions - back, axis=1)
    return ok


def _visible(cache: DecodeCache, lead: int, kv: int, positions, keys):
    """(ok (B, S, C') bool, back (S, C')): which keys (C',) (-1: an empty slot) queries at `positions` see under
    the request's mask without the diagonal: causal ∧ valid (∧ q - k < kv ∨ k a sink)."""
    back = positions[:, None] - keys[None, :]  # (S, C')
    cols = lead + jnp.maximum(keys, 0)
    ok = (keys >= 0) & (back >= 0) & jnp.take(cache.valid, cols, axis=1)[:, None, :]  # (B, S, C')
    if kv:
        near = back < kv
        ok = ok & (near if cache.sink is None else near | jnp.take(cache.sink, cols, axis=1)[:, None, :])
    return ok, back


# ----------------------------------------------------------------------------- one cached step


def _conv_step(z, taps, rows, tap_ok):
    """model.conv_taps on the chunk z (B, S, C) behind the cached rows (B, τ - 1, C), in its order of operations:
    Σ_j taps[j] ⊙ (z[t - j]·ok_j[t]), tap 0 unmasked. (output (B, S, C), the new rows)."""
    S, lead = z.shape[1], rows.shape[1]
    ext = jnp.concatenate([rows, z], axis=1)  # (B, τ - 1 + S, C)
    out = 0
    for j in range(taps.shape[0]):
        shifted = ext[:, lead - j:lead - j + S]  # z[t - j] for the chunk's rows
        if j:
            shifted = shifted * tap_ok[j]
        out = out + taps[j] * shifted
    return out, ext[:, S:]


def _attend(config, q, k, v, mask):
    """The forward's attention arithmetic (MultiHeadAttention.__call__, flash or not) on q (B, H, S, hq) over keys
    k (B, K, C', hq), v (B, K, C', hv) with mask (B, 1, S, C') -> (B, S, H·hv)."""
    B, H, S, hq = q.shape
    K, hv = k.shape[1], v.shape[-1]
    if config.flash:
        Fd = max(hq, hv)
        qf = q * jnp.asarray(math.sqrt(Fd / hq), q.dtype)
        if Fd > hq:
            qf = jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, Fd - hq)))  # (B, H, S, F)
            k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, Fd - hq)))  # (B, K, C', F)
        vf = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, Fd - hv))) if Fd > hv else v  # (B, K, C', F)
        impl = "cudnn" if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else None
        out = jax.nn.dot_product_attention(
            qf.transpose(0, 2, 1, 3),  # (B, S, H, F)
            k.transpose(0, 2, 1, 3),  # (B, C', K, F)
            vf.transpose(0, 2, 1, 3),  # (B, C', K, F)
            mask=mask, implementation=impl)
        return out[..., :hv].reshape(B, S, H * hv)  # (B, S, H·hv)
    k, v = repeat_kv(k, H // K), repeat_kv(v, H // K)  # (B, H, C', hq), (B, H, C', hv)
    w = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(hq))  # (B, H, S, C')
    w = jnp.where(mask, w, jnp.finfo(w.dtype).min)
    out = jnp.matmul(nn.softmax(w, axis=-1), v)  # (B, H, S, hv)
    return out.transpose(0, 2, 1, 3).reshape(B, S, H * hv)  # (B, S, H·hv)


def _dense(p, x, dt):
    """nn.Dense(dtype=dt, use_bias=False) with the params p = {"kernel": ...}."""
    return nn.Dense(p["kernel"].shape[-1], dtype=dt, use_bias=False).apply({"params": p}, x)


def _norm(p, x, dt):
    return ZCRMSNorm(dtype=dt).apply({"params": p}, x)


def _attention_step(config, p, x, lc: LayerCache, window: int, kv: int, cache: DecodeCache, positions,
                    quant: bool = False):
    """MultiHeadAttention.__call__ for the chunk x (B, S, D) at `positions`, over this layer's ring and the chunk's
    own keys: (output (B, S, D), the updated LayerCache)."""
    cfg, dt = config, compute_dtype(config)
    B, S, _ = x.shape
    H, K = cfg.num_heads, cfg.num_kv_heads
    hq, hv = cfg.head_dims
    lead = _lead(cfg)
    x = _aq(x, quant, cfg.act_bits)
    q, k, v = _dense(p["q_proj"], x, dt), _dense(p["k_proj"], x, dt), _dense(p["v_proj"], x, dt)
    rows = lc.rows
    if rows is not None:
        # tap j >= 1 reads t - j where this layer's mask lets t see it: the request's mask, within the window
        tap_ok = [None] + [(_seen(cache, lead, kv, positions, j) & (not window or j < window))[..., None]
                           .astype(q.dtype) for j in range(1, cfg.qkv_conv_taps)]  # (B, S, 1) each
        convs = [_conv_step(z, p[f"{name}_taps"].astype(dt), r, tap_ok)
                 for z, name, r in zip((q, k, v), ("q", "k", "v"), rows, strict=True)]
        (q, qr), (k, kr), (v, vr) = convs
        rows = (qr, kr, vr)
    q = q.reshape(B, S, H, hq).transpose(0, 2, 1, 3)  # (B, H, S, hq)
    k = k.reshape(B, S, K, hq).transpose(0, 2, 1, 3)  # (B, K, S, hq)
    v = v.reshape(B, S, K, hv).transpose(0, 2, 1, 3)  # (B, K, S, hv)
    q, k = _norm(p["q_norm"], q, dt), _norm(p["k_norm"], k, dt)
    rope = cache.cos[positions], cache.sin[positions]  # (S, hq/2) each
    q, k = apply_rope(q, *rope).astype(q.dtype), apply_rope(k, *rope).astype(k.dtype)
    q, k, v = quant_query(q, quant, cfg), quant_kv(k, quant, cfg), quant_kv(v, quant, cfg)  # the cache holds them so

    C = lc.slot_pos.shape[0]
    stored = 0 if lc.store_pos is None else lc.store_pos.shape[0]
    keys = jnp.concatenate([lc.slot_pos, positions] if not stored else [lc.store_pos, lc.slot_pos, positions])
    ok, back = _visible(cache, lead, kv, positions, keys)  # (B, S, N_s + C + S), (S, N_s + C + S)
    if window:
        near = back < window
        if stored:  # the ring within the kv window, the store past it: each sink read once; the chunk as _visible
            near = jnp.concatenate([~near[:, :stored], near[:, stored:stored + C],
                                    jnp.ones_like(near[:, stored + C:])], axis=1)
        ok = ok & near
    mask = (ok | (back == 0))[:, None]  # (B, 1, S, N_s + C + S)
    ks, vs = ([lc.k, k], [lc.v, v]) if not stored else ([lc.store_k, lc.k, k], [lc.store_v, lc.v, v])
    out = _attend(cfg, q, jnp.concatenate(ks, axis=2), jnp.concatenate(vs, axis=2), mask)

    kept = positions[-C:]  # the chunk's last C positions go into slots position mod C
    store = (lc.store_k, lc.store_v, lc.store_pos)
    if stored:
        at = cache.sink_cols - positions[0]  # (N_s,): each sink's row in the chunk
        fed = (at >= 0) & (at < S)
        at = jnp.clip(at, 0, S - 1)
        store = (jnp.where(fed[:, None], k[:, :, at], lc.store_k), jnp.where(fed[:, None], v[:, :, at], lc.store_v),
                 jnp.where(fed, cache.sink_cols, lc.store_pos))
    lc = LayerCache(lc.k.at[:, :, kept % C].set(k[:, :, -C:]), lc.v.at[:, :, kept % C].set(v[:, :, -C:]),
                    lc.slot_pos.at[kept % C].set(kept), rows, *store)
    out = out * nn.sigmoid(_dense(p["gate_proj"], x, dt))
    return _dense(p["out_proj"], _aq(out, quant, cfg.act_bits), dt), lc


def _block_step(config, p, x, attention, engram_kv, site_flags):
    """Block.__call__ with attention(x) -> (output, state) in place of self_attn: (output (B, S, D), state)."""
    dt = compute_dtype(config)
    if engram_kv is not None:
        ek, ev = engram_kv
        alpha = nn.sigmoid(jnp.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(config.d_model))
        x = x + jnp.einsum("s,sbt,sbtd->btd", site_flags, alpha, ev.astype(jnp.float32)).astype(x.dtype)  # (B, S, D)
    skip = x
    x, state = attention(_norm(p["ZCRMSNorm_0"], x, dt))
    x = skip + nn.sigmoid(p["attn_gate"]).astype(dt) * _norm(p["post_attn_norm"], x, dt)
    return x + HadamardMLP(config).apply({"params": p["hadamard_mlp"]}, _norm(p["pre_hada_norm"], x, dt)), state


def _layer_step(config, p, hc, offsets, lanes, attention, engram_kv, site_flags, quant: bool = False):
    """MHCLayer.__call__ with the cached block: lanes (B, S, n, D) in dt -> (new lanes, state)."""
    dt, n = compute_dtype(config), config.mhc_lanes
    pre_off, post_off = offsets
    xf = lanes.astype(jnp.float32)
    nx = _aq(flat_lanes(lanes), quant, config.act_bits)  # (B, S, n·D) float32
    r_pre, r_post, r_res = project(nx, (hc["phi_pre"], hc["phi_post"], hc["phi_res"]))
    u = read_lanes(pre_weights(r_pre, hc["a_pre"], hc["b_pre"], pre_off), xf, dt)  # (B, S, D)
    y, state = _block_step(config, p, u, attention, engram_kv, site_flags)
    hpost = post_weights(r_post, hc["a_post"], hc["b_post"], post_off)
    # lanes.sinkhorn's fori_loop, not the forward's unrolled form (an ulp apart where they differ): XLA:CPU compiles
    # the unrolled chain ~4 s longer per layer body.
    hres = sinkhorn(hc["a_res"] * r_res.reshape(*r_res.shape[:-1], n, n) + hc["b_res"])  # (B, S, n, n)
    return write_lanes(hres, xf, hpost, y - u, dt), state  # (B, S, n, D)


def _engram_step(model, params, cache: DecodeCache, pos, S: int, kv: int, quant: bool = False):
    """Every site's (key, value) for the chunk, each (G, B, S, D): the forward's own `_engram_kv` on the chunk behind
    its token history of W = (max(O) - 1) + 3·max(O) positions (the oldest value row its dilated taps read, and that
    row's oldest n-gram token), under (causal ∧ valid) ∨ diagonal as the forward's full mask. Exact: no row kept
    reads past the window's start, and the positions before 0 are invalid zeros, as the forward's zero fill. Under a
    kv window the mask is the windowed one (the module docstring), as the forward reads its mask."""
    cfg = model.config
    if not cfg.engram_layers:
        return None
    W = _engram_history(cfg)
    start = _lead(cfg) + pos - W
    valid = jax.lax.dynamic_slice_in_dim(cache.valid, start, W + S, axis=1)  # (B, W + S)
    tokens = jax.lax.dynamic_slice_in_dim(cache.tokens, start, W + S, axis=1)  # (B, W + S)
    T = W + S
    back = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]  # (T, T)
    ok = (back >= 0) & valid[:, None, :]  # (B, T, T)
    if kv:
        near = back < kv
        sink = None if cache.sink is None else jax.lax.dynamic_slice_in_dim(cache.sink, start, T, axis=1)  # (B, T)
        ok = ok & (near if sink is None else near | sink[:, None, :])
    mask = (ok | (back == 0))[:, None]  # (B, 1, T, T)
    keys, values = model.apply({"params": params}, tokens, mask, quant, method="_engram_kv")  # (G, B, T, D) each
    return keys[:, :, W:], values[:, :, W:]


def decode_step(model: SimpleAttentionNetwork, params, cache: DecodeCache, tokens, pos, plan, last_only=False,
                kv: int = 0, quant: bool = False):
    """Feed tokens (B, S) at buffer positions pos..pos + S - 1 (pos 0 with the prompts: the prefill; then one token
    a step; pos may be traced): (float32 logits (B, S, V_out), or (B, 1, V_out) with last_only; the new cache).
    plan: _layer_plan's static per-layer (window, C, global, lane); kv: kv_bound's; quant: deploy numerics. The
    running layers are one lax.scan (one layer body
    to compile, as the forward's nn.scan); each picks its ring kind's cache with lax.switch."""
    cfg, dt = model.config, compute_dtype(model.config)
    B, S = tokens.shape
    positions = pos + jnp.arange(S)  # (S,)
    cache = cache._replace(tokens=jax.lax.dynamic_update_slice(cache.tokens, tokens.astype(jnp.int32),
                                                               (0, _lead(cfg) + pos)))
    engram_kv = _engram_step(model, params, cache, pos, S, kv, quant)
    x = model.apply({"params": params}, tokens, method="_embed")  # (B, S, D)
    lanes = jnp.broadcast_to(x.astype(dt)[:, :, None, :], (B, S, cfg.mhc_lanes, cfg.d_model))  # (B, S, n, D)

    stack, kinds = params["stack"], _ring_kinds(plan)
    running = np.asarray([i for i, spec in enumerate(plan) if spec is not None])  # (A,) the layers that run
    kind = [kinds.index(plan[i][:3]) for i in running]
    slot = [kind[:a].count(kind[a]) for a in range(len(running))]  # each layer's row in its kind's stack
    lane = jax.nn.one_hot(np.asarray([plan[i][3] for i in running]), cfg.mhc_lanes, dtype=jnp.float32)  # (A, n)
    flags = np.asarray([[float(site == i) for site in cfg.engram_layers] for i in running], np.float32)  # (A, G)
    rung = (lambda t: t) if len(running) == cfg.num_layers else (lambda t: t[running])  # a rung's layers only
    xs = (jax.tree_util.tree_map(rung, stack["layers"]["block"]),
          {name: rung(stack[f"mhc_{name}"]) for name in ("phi_pre", "phi_post", "phi_res", "b_pre", "b_post", "b_res",
                                                          "a_pre", "a_post", "a_res")},
          (8 * lane - 4, -4 * (1 - lane)), jnp.asarray(flags), jnp.asarray(kind, jnp.int32),
          jnp.asarray(slot, jnp.int32))

    def layer(carry, xs):
        lanes, rings = carry
        p, hc, offsets, site_flags, kind_l, slot_l = xs

        def attention(x):
            def on(k):  # this layer's attention over the ring kind k's cache row slot_l
                def run(rings):
                    lc = jax.tree_util.tree_map(lambda t: t[slot_l], rings[k])
                    out, lc = _attention_step(cfg, p["self_attn"], x, lc, kinds[k][0], kv, cache, positions, quant)
                    ring = jax.tree_util.tree_map(lambda t, u: t.at[slot_l].set(u), rings[k], lc)
                    return out, rings[:k] + (ring,) + rings[k + 1:]
                return run
            return jax.lax.switch(kind_l, [on(k) for k in range(len(kinds))], rings)

        lanes, rings = _layer_step(cfg, p, hc, offsets, lanes, attention, engram_kv,
                                   site_flags if cfg.engram_layers else None, quant)
        return (lanes, rings), None

    (lanes, rings), _ = jax.lax.scan(layer, (lanes, cache.rings), xs)
    x = _norm(stack["final_norm"], jnp.mean(lanes, axis=2), dt)  # (B, S, D)
    logits = model.apply({"params": params}, x[:, -1:] if last_only else x, quant, method="_logits")
    return logits, cache._replace(rings=rings)


# ----------------------------------------------------------------------------- the loops


class _Request(NamedTuple):
    """Checked inputs as device arrays: prompts (B, P) int32, valid (B, M), the scalars, and the sinks: sink (B, M)
    bool and sink_cols (N_s,) int32 (the positions a sink in some row), or None."""

    prompts: jax.Array
    valid: jax.Array
    eos: jax.Array
    pad: jax.Array
    temperature: jax.Array
    key: jax.Array | None
    sink: jax.Array | None = None
    sink_cols: jax.Array | None = None


def _prepare(model, tokens, max_new_tokens, kv_window, sink, layers, temperature, seed, eos_token_id,
             pad_token_id) -> _Request:
    """The arguments checked as given, then as device arrays. seed None: one drawn from NumPy's global generator."""
    cfg = model.config
    prompts = check_generate_args(cfg, tokens, max_new_tokens, 0, sink, temperature, seed, eos_token_id,
                                  pad_token_id)
    if kv_window is not None and (isinstance(kv_window, bool) or not isinstance(kv_window, int) or kv_window < 1):
        raise GenerationError(f"kv_window must be None (config.effective_kv_window) or an integer >= 1, got "
                              f"{kv_window!r}")
    _active_layers(cfg, layers)
    valid = np.pad(prompt_validity(prompts, pad_token_id), ((0, 0), (0, int(max_new_tokens))), constant_values=True)
    key = None
    if temperature > 0:
        key = jax.random.PRNGKey(np.random.randint(0, 2**62) if seed is None else int(seed))
    eos = -1 if eos_token_id is None else int(eos_token_id)
    sink_cols = None
    if sink is not None:  # generated positions are no sinks
        sink = np.pad(np.asarray(sink) != 0, ((0, 0), (0, int(max_new_tokens))))
        sink_cols = jnp.asarray(np.flatnonzero(sink.any(axis=0)), jnp.int32)
        sink = jnp.asarray(sink)
    return _Request(jnp.asarray(prompts, jnp.int32), jnp.asarray(valid), jnp.int32(eos), jnp.int32(pad_token_id),
                    jnp.float32(temperature), key, sink, sink_cols)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "layers", "kv_window", "quant", "stream",
                                             "return_logits", "return_logprobs"))
def _cached_loop(params, request: _Request, *, model: SimpleAttentionNetwork, max_new_tokens: int,
                 layers: int | None, kv_window: int | None, quant: bool, stream: bool, return_logits: bool,
                 return_logprobs: bool):
    """Prefill, then single steps in a while_loop: (tokens (B, G), steps, logits (B, G, V_out) or None, logp (B, G)
    or None). Only shapes, greedy-or-sampled and the static options select a compilation."""
    r = request
    B, P = r.prompts.shape
    G = max_new_tokens
    plan, kv = _layer_plan(model.config, P + G, kv_window, layers), kv_bound(model.config, P + G, kv_window)
    cache = new_cache(model, B, P + G, r.valid, kv_window, layers, r.sink, r.sink_cols)
    logits, cache = decode_step(model, params, cache, r.prompts, 0, plan, last_only=True, kv=kv, quant=quant)

    def choose(t, logits, done, key, out, all_logits, all_logp):
        key, sub = _next_key(key)
        nxt, done, logp = pick(logits, done, r.eos, r.pad, sub, r.temperature)
        out = out.at[:, t].set(nxt)
        if return_logits:
            all_logits = all_logits.at[:, t].set(logits)
        if return_logprobs:
            all_logp = all_logp.at[:, t].set(logp)
        if stream:
            io_callback(emit, None, nxt, ordered=True)
        return done, key, out, all_logits, all_logp

    out = jnp.full((B, G), r.pad, jnp.int32)  # (B, G)
    all_logits = jnp.zeros((B, G, logits.shape[-1]), jnp.float32) if return_logits else None
    all_logp = jnp.zeros((B, G), jnp.float32) if return_logprobs else None
    state = choose(0, logits[:, 0], jnp.zeros((B,), jnp.bool_), r.key, out, all_logits, all_logp)

    def cond(carry):
        t, done = carry[0], carry[1]
        return (t < G) & ~jnp.all(done)

    def body(carry):
        t, done, key, out, all_logits, all_logp, cache = carry
        # token t - 1 goes in at position P + t - 1; its logits choose token t
        fed = jax.lax.dynamic_slice_in_dim(out, t - 1, 1, axis=1)  # (B, 1)
        logits, cache = decode_step(model, params, cache, fed, P + t - 1, plan, kv=kv, quant=quant)
        done, key, out, all_logits, all_logp = choose(t, logits[:, 0], done, key, out, all_logits, all_logp)
        return t + 1, done, key, out, all_logits, all_logp, cache

    steps, _, _, out, all_logits, all_logp, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), *state, cache))
    return out, steps, all_logits, all_logp


def generate(model: SimpleAttentionNetwork, params, tokens, max_new_tokens: int = 64, *, layers: int | None = None,
             kv_window: int | None = None, sink=None, quant: bool = False, temperature: float = 0.0,
             seed: int | None = None, eos_token_id: int | None = EOS_ID, pad_token_id: int = PAD_ID,
             return_logits: bool = False, return_logprobs: bool = False, streamer: Streamer | None = None):
    """Cached generation: the new tokens (B, max_new_tokens) int32, plus (logits, logprobs) on request.

    tokens: (B, P) prompts (BOS included), left-padded with pad_token_id; P + max_new_tokens <= max_seq_len.
    One prefill pass over the prompts, then one token a step over the cache, in the config's dtype with the params
    as given. layers: decode on ladder rung d (the layers of rank < d, `subnetwork_only` with exit_depth=d).
    kv_window: the global layers' ring (None: config.effective_kv_window, upstream's deploy bound); where the
    buffer is longer, a query sees its last kv_window positions and the `sink` positions ((B, P) bool or 0/1 over
    the prompts), under upstream's windowed mask (`hidden_cells`' window and sink) in every layer, conv tap and
    engram row. quant: upstream's deploy numerics, the forward's `quant=True` (A8 activations and q, the KV cache
    at config.kv_bits: a .cact's). temperature 0 is greedy (argmax, ties to the first index); above 0
    jax.random.categorical(logits / T) with a key from `seed` split once per step.
    Each row stops at its first eos_token_id (kept; None: never) and holds pad_token_id after it.
    return_logits: the float32 logits (B, steps, V_out) each token came from; return_logprobs: the chosen tokens'
    log-probabilities (B, steps), 0 after a row's EOS. streamer: called with each step's (B,) tokens as numpy.
    Compiles once per (model, batch, prompt length, max_new_tokens, layers, kv_window, sink columns, greedy or
    sampled, the return and stream flags); a new request of those shapes reuses it."""
    request = _prepare(model, tokens, max_new_tokens, kv_window, sink, layers, temperature, seed, eos_token_id,
                       pad_token_id)

    def loop():
        out, steps, logits, logp = _cached_loop(params, request, model=model, max_new_tokens=int(max_new_tokens),
                                                layers=layers, kv_window=kv_window, quant=bool(quant),
                                                stream=streamer is not None,
                                                return_logits=return_logits, return_logprobs=return_logprobs)
        return out, int(steps), logits, logp  # int(): waits for the loop, so every streamed step has been emitted

    return _result(*run_streaming(loop, streamer), return_logits, return_logprobs)


@functools.partial(jax.jit, static_argnames=("model", "layers", "quant"))
def _forward_at(params, buf, mask, pos, *, model: SimpleAttentionNetwork, layers: int | None, quant: bool = False):
    """Upstream's per-step work: `__call__` on the whole (B, M) buffer, the float32 logits (B, V_out) at `pos`."""
    rung = {} if layers is None else {"exit_depth": layers, "subnetwork_only": True}
    logits = model.apply({"params": params}, buf, mask, quant, **rung)  # (B, M, V_out)
    return jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False)


def generate_recompute(model: SimpleAttentionNetwork, params, tokens, max_new_tokens: int = 64, *,
                       layers: int | None = None, kv_window: int | None = None, sink=None, quant: bool = False,
                       temperature: float = 0.0, seed: int | None = None, eos_token_id: int | None = EOS_ID,
                       pad_token_id: int = PAD_ID, return_logits: bool = False, return_logprobs: bool = False,
                       streamer: Streamer | None = None):
    """Upstream's run.py loop, the reference: `__call__` on the PAD-filled buffer (B, P + G) re-run for every new
    token, the logits read at the current position; with layers=d the rung's `subnetwork_only` logits. Same
    contract and results as `generate`. The mask is causal, and for left-padded rows (causal ∧ valid) ∨ diagonal,
    so pad keys stay unseen; kv_window (None: none, as run.py) and sink add `hidden_cells`' window and sinks:
    (causal ∧ valid ∧ (q - k < kv_window ∨ k a sink)) ∨ diagonal."""
    r = _prepare(model, tokens, max_new_tokens, kv_window, sink, layers, temperature, seed, eos_token_id,
                 pad_token_id)
    B, P = r.prompts.shape
    G = int(max_new_tokens)
    M = P + G
    buf = np.full((B, M), pad_token_id, np.int32)  # (B, M): the fixed-length upstream buffer
    buf[:, :P] = np.asarray(r.prompts)
    causal = make_causal_mask(M)  # (1, 1, M, M)
    eye = jnp.eye(M, dtype=jnp.bool_)
    mask = causal if bool(r.valid.all()) else (causal & r.valid[:, None, None, :]) | eye  # (B|1, 1, M, M)
    if kv_window is not None and kv_window < M:
        near = (jnp.arange(M)[:, None] - jnp.arange(M)[None, :] < kv_window)[None, None]  # (1, 1, M, M)
        mask = (mask & (near if r.sink is None else near | r.sink[:, None, None, :])) | eye
    out = np.full((B, G), pad_token_id, np.int32)
    done = jnp.zeros((B,), jnp.bool_)
    key, step_logits, step_logp = r.key, [], []
    for t in range(G):
        if t:
            buf[:, P + t - 1] = out[:, t - 1]
        logits = _forward_at(params, jnp.asarray(buf), mask, P - 1 + t, model=model, layers=layers,
                             quant=bool(quant))  # (B, V_out)
        key, sub = _next_key(key)
        nxt, done, logp = pick(logits, done, r.eos, r.pad, sub, r.temperature)
        out[:, t] = np.asarray(nxt)
        step_logits.append(logits)
        step_logp.append(logp)
        if streamer is not None:
            streamer(out[:, t].copy())
        if bool(done.all()):
            break
    logits = jnp.stack(step_logits, axis=1) if return_logits else None  # (B, steps, V_out)
    logp = jnp.stack(step_logp, axis=1) if return_logprobs else None  # (B, steps)
    return _result(jnp.asarray(out), len(step_logits), logits, logp, return_logits, return_logprobs)


__all__ = ["DecodeCache", "LayerCache", "decode_step", "generate", "generate_recompute", "kv_bound", "new_cache"]
