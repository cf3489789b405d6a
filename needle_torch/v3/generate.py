"""Cached generation for the Needle 3 torch twin (`SimpleAttentionNetwork.generate` calls this), and the reference.

Upstream removed its cached decoder with Needle 3: `run.generate` re-runs the whole PAD-filled buffer for every
token (NEEDLE_V3.md §6). `generate_recompute` is that loop, the reference; `generate` computes the same function
from a cache holding Needle 3's state, so each step feeds one token:
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
The forward's own submodules (projections, norms, the Monarch MLP, the engram's tables) and its engram hashing do the
arithmetic; this file composes them around the cache, in the forward's order of operations.

Contract (Needle 2's, shared with needle_flax.v3.generate): prompts (B, P) left-padded with pad_token_id, valid
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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.errors import GenerationError
from convert.v2.generation import check_generate_args, prompt_validity
from convert.v3.config import ENGRAM_TAPS, EOS_ID, PAD_ID
from convert.v3.ladder import ladder_layer_ranks
from needle_torch.fast.seam import fast_paths, forms
from needle_torch.layers import apply_rope, make_causal_mask
from needle_torch.v2.generate import Streamer, _loop, _Sampler, pick
from needle_torch.v2.lanes import fake_quant_act, rms_unit, sinkhorn
from needle_torch.v3.engram import engram_indices
from needle_torch.v3.quant import quant_kv, quant_query

# The model file imports this one (its `generate` method), so nothing here imports it back: the forward's pieces
# are reached through the model instance (submodules and its _rope, _input_embeddings, _logits), and the few lines
# of its module-level arithmetic that decoding needs are restated below, each naming its original.
F32_MIN = torch.finfo(torch.float32).min  # model.F32_MIN: the non-flash masked logit
FLASH_NEG = -0.7 * torch.finfo(torch.float32).max  # model.FLASH_NEG: jax.nn.dot_product_attention's masked logit


def _sigmoid(x: Tensor) -> Tensor:
    """model._sigmoid: torch's in float32; in bf16/f16 1 / (1 + exp(-x)) rounded after every op, as XLA:CPU."""
    return torch.sigmoid(x) if x.dtype == torch.float32 else 1 / (1 + torch.exp(-x))


def _aq(x: Tensor, quant: bool, bits: int) -> Tensor:
    """model._aq: per-row A`bits` fake-quant over the last axis under quant, else x."""
    return fake_quant_act(x, bits) if quant else x


def _lane_offsets(lane: int, n: int, device=None) -> tuple[Tensor, Tensor]:
    """model._lane_offsets: (pre_off, post_off) (n,) float32, +4 / 0 on lane `lane`, -4 on the others."""
    one_hot = (torch.arange(n, device=device) == lane).float()  # (n,)
    return 8 * one_hot - 4, -4 * (1 - one_hot)


# ----------------------------------------------------------------------------- the cache


@dataclass
class LayerCache:
    """One layer's state: K, V in a ring of C slots and the last τ - 1 projected q, k, v rows before the conv."""

    k: Tensor  # (B, K, C, hq) after k_norm and RoPE, in dt
    v: Tensor  # (B, K, C, hv) in dt
    slot_pos: Tensor  # (C,) int64: the buffer position each slot holds, -1 while empty
    window: int  # a query at q sees keys with q - k < window (0: every earlier key)
    rows: tuple[Tensor, Tensor, Tensor] | None  # (B, τ - 1, H·hq), (B, τ - 1, K·hq), (B, τ - 1, K·hv); None: τ = 0
    # model._lane_offsets of this layer's lane in its stream (l mod n, or its position among a rung's layers mod n):
    # (pre_off, post_off) (n,) float32
    offsets: tuple[Tensor, Tensor]
    site_flags: Tensor  # (G,) float32: 1 at this layer's engram site (if it is one), else 0
    # the sink positions' K, V once fed (global layers under a kv_window with sinks; else None): past the ring's
    # window a sink is read from here
    store_k: Tensor | None = None  # (B, K, N_s, hq)
    store_v: Tensor | None = None  # (B, K, N_s, hv)
    store_pos: Tensor | None = None  # (N_s,) int64: the position each store slot holds, -1 until fed


@dataclass
class DecodeCache:
    """One request's state for M buffer positions. tokens/valid hold Z leading zeros/False so that a look back
    before position 0 is a slice (position p is column Z + p)."""

    layers: list[LayerCache | None]  # None: a layer the rung skips
    tokens: Tensor  # (B, Z + M) int64: the engram's token history (it rebuilds its n-grams and value rows)
    valid: Tensor  # (B, Z + M) bool: upstream's validity, False before position 0
    cos: Tensor  # (M, hq/2)
    sin: Tensor  # (M, hq/2)
    lead: int  # Z
    kv: int = 0  # the kv_window every mask reads (0: none, the buffer fits in it)
    sink: Tensor | None = None  # (B, Z + M) bool: positions visible past kv (prompt positions only)
    sink_cols: Tensor | None = None  # (N_s,) int64: the positions that are a sink in some row
    quant: bool = False  # upstream's deploy numerics (`quant=True` with the config's act_bits and kv_bits)


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
                layers: int | None) -> list[tuple[int, int, int, bool] | None]:
    """Per layer (window, ring slots C, lane, global), or None for a layer rung `layers` skips. window: keys
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
        plan.append((window, min(max_len, window or max_len), lane, not local))
        position += 1
    return plan


def new_cache(model: nn.Module, batch: int, max_len: int, valid: Tensor | None = None, kv_window: int | None = None,
              layers: int | None = None, sink: Tensor | None = None, quant: bool = False) -> DecodeCache:
    """An empty DecodeCache for `batch` rows and max_len positions. valid (B, max_len) bool (None: all True);
    kv_window bounds the global layers' ring (None: config.effective_kv_window); layers: decode rung d only;
    sink (B, max_len) bool or None: positions that stay visible past the kv window; quant: deploy numerics."""
    cfg, device = model.config, model.embedding.weight.device
    kv = kv_bound(cfg, max_len, kv_window)
    sink = None if sink is None or not kv else sink.to(device)
    sink_cols = None if sink is None else torch.nonzero(sink.any(dim=0))[:, 0]  # (N_s,)
    dt = model.stack.compute_dtype
    H, K, tau = cfg.num_heads, cfg.num_kv_heads, cfg.qkv_conv_taps
    hq, hv = cfg.head_dims
    slots = []
    for i, spec in enumerate(_layer_plan(cfg, max_len, kv_window, layers)):
        if spec is None:
            slots.append(None)
            continue
        window, C, lane, global_layer = spec
        rows = None if not tau else tuple(torch.zeros(batch, tau - 1, c, dtype=dt, device=device)
                                          for c in (H * hq, K * hq, K * hv))
        lc = LayerCache(torch.zeros(batch, K, C, hq, dtype=dt, device=device),
                        torch.zeros(batch, K, C, hv, dtype=dt, device=device),
                        torch.full((C,), -1, dtype=torch.long, device=device), window, rows,
                        _lane_offsets(lane, cfg.mhc_lanes, device),
                        torch.tensor([float(site == i) for site in cfg.engram_layers], device=device))
        if sink_cols is not None and global_layer:  # a global layer's ring ends at kv; its sinks live on here
            Ns = sink_cols.shape[0]
            lc.store_k = torch.zeros(batch, K, Ns, hq, dtype=dt, device=device)
            lc.store_v = torch.zeros(batch, K, Ns, hv, dtype=dt, device=device)
            lc.store_pos = torch.full((Ns,), -1, dtype=torch.long, device=device)
        slots.append(lc)
    Z = _lead(cfg)
    valid = torch.ones(batch, max_len, dtype=torch.bool, device=device) if valid is None else valid.to(device)
    cos, sin = model._rope(max_len, device)
    return DecodeCache(slots, torch.zeros(batch, Z + max_len, dtype=torch.long, device=device),
                       F.pad(valid, (Z, 0), value=False), cos, sin, Z, kv,
                       None if sink is None else F.pad(sink, (Z, 0), value=False), sink_cols, bool(quant))


def _active_layers(config, layers: int | None) -> list[bool]:
    """Which layers run: all, or rung d's (ladder rank < d, subnetwork_only's stream)."""
    if layers is None:
        return [True] * config.num_layers
    if not 2 <= layers <= config.num_layers:
        raise GenerationError(f"layers={layers!r} is not a ladder rung of this {config.num_layers}-layer model; "
                              f"use a depth in [2, {config.num_layers}] (or None for the full model)")
    return [r < layers for r in ladder_layer_ranks(config)]


def _seen(cache: DecodeCache, positions: Tensor, back: int) -> Tensor:
    """(B, S) bool: may a query at `positions` see position - back under the request's mask (module docstring)?"""
    if back == 0:  # the diagonal: always (tap 0 is never masked, an order-1 n-gram always valid)
        return torch.ones(cache.valid.shape[0], positions.shape[0], dtype=torch.bool, device=positions.device)
    ok = cache.valid[:, cache.lead + positions - back]
    if cache.kv and back >= cache.kv:  # past the kv window only a sink is seen
        return torch.zeros_like(ok) if cache.sink is None else ok & cache.sink[:, cache.lead + positions - back]
    return ok


def _visible(cache: DecodeCache, positions: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """(ok (B, S, C') bool, back (S, C')): which keys (C',) (-1: an empty slot) queries at `positions` see under
    the request's mask without the diagonal: causal ∧ valid (∧ q - k < kv ∨ k a sink)."""
    back = positions[:, None] - keys[None, :]  # (S, C')
    cols = cache.lead + keys.clamp(min=0)
    ok = (keys >= 0) & (back >= 0) & cache.valid[:, cols][:, None, :]  # (B, S, C')
    if cache.kv:
        near = back < cache.kv
        ok = ok & (near if cache.sink is None else near | cache.sink[:, cols][:, None, :])
    return ok, back


# ----------------------------------------------------------------------------- one cached step


def _conv_step(z: Tensor, taps: Tensor, rows: Tensor, tap_ok: list[Tensor | None]) -> Tensor:
    """model.conv_taps on the chunk z (B, S, C) behind the cached rows (B, τ - 1, C), in its order of operations:
    Σ_j taps[j] ⊙ (z[t - j]·ok_j[t]), tap 0 unmasked -> (B, S, C); the chunk's last τ - 1 rows go into `rows`."""
    S, lead = z.shape[1], rows.shape[1]
    ext = torch.cat([rows, z], dim=1)  # (B, τ - 1 + S, C)
    out = 0
    for j in range(taps.shape[0]):
        shifted = ext[:, lead - j:lead - j + S]  # z[t - j] for the chunk's rows
        if j:
            shifted = shifted * tap_ok[j]
        out = out + taps[j] * shifted
    rows.copy_(ext[:, S:])
    return out


def _attend(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """The forward's attention arithmetic (MultiHeadAttention.forward, flash or not) on q (B, H, S, hq) over keys
    k (B, K, C', hq), v (B, K, C', hv) with mask (B, 1, S, C') -> (B, S, H·hv). Query heads k·g .. k·g + g - 1 read
    kv head k as a group (repeat_kv's order) instead of from repeated copies of the cache, and the flash form's zero
    padding to F = max(hq, hv) is left out: its columns add exact zeros to the logits and are sliced off the output."""
    B, H, S, hq = q.shape
    K, hv = k.shape[1], v.shape[-1]
    g = H // K
    q = q.reshape(B, K, g * S, hq)  # (B, K, g·S, hq)
    mask = mask[:, :, None]  # (B, 1, 1, S, C')
    if attn.flash:
        Fd = max(hq, hv)
        qf = q * torch.tensor(math.sqrt(Fd / hq), dtype=q.dtype)
        logits = (qf.float() @ k.float().transpose(-1, -2)).view(B, K, g, S, -1)  # (B, K, g, S, C')
        logits = logits * torch.tensor(1 / math.sqrt(Fd), dtype=torch.float32)
        p = logits.masked_fill(~mask, FLASH_NEG).softmax(dim=-1).to(v.dtype)
        out = p.view(B, K, g * S, -1) @ v  # (B, K, g·S, hv)
    else:
        logits = (q @ k.transpose(-1, -2)).float() / torch.sqrt(torch.tensor(hq, dtype=torch.float32))
        p = logits.view(B, K, g, S, -1).masked_fill(~mask, F32_MIN).softmax(dim=-1)  # (B, K, g, S, C')
        out = p.view(B, K, g * S, -1) @ v.float()  # (B, K, g·S, hv)
    return out.view(B, H, S, hv).transpose(1, 2).reshape(B, S, H * hv)  # (B, S, H·hv)


def _attention_step(attn: nn.Module, x: Tensor, lc: LayerCache, cache: DecodeCache, positions: Tensor) -> Tensor:
    """MultiHeadAttention.forward for the chunk x (B, S, D) at `positions`, over this layer's ring and the chunk's
    own keys; writes the chunk into the ring and the conv rows."""
    B, S, _ = x.shape
    H, K, hq, hv, dt = attn.num_heads, attn.num_kv_heads, attn.hq, attn.hv, attn.compute_dtype
    quant, cfg = cache.quant, attn.config
    x = _aq(x, quant, cfg.act_bits)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)  # (B, S, H·hq), (B, S, K·hq), (B, S, K·hv)
    if lc.rows is not None:
        # tap j >= 1 reads t - j where this layer's mask lets t see it: the request's mask, within the window
        tap_ok = [None] + [(_seen(cache, positions, j) & (not lc.window or j < lc.window))[..., None].to(q.dtype)
                           for j in range(1, attn.config.qkv_conv_taps)]  # (B, S, 1) each
        q, k, v = (_conv_step(z, taps.to(dt), rows, tap_ok)
                   for z, taps, rows in zip((q, k, v), (attn.q_taps, attn.k_taps, attn.v_taps), lc.rows, strict=True))
    q = q.reshape(B, S, H, hq).transpose(1, 2)  # (B, H, S, hq)
    k = k.reshape(B, S, K, hq).transpose(1, 2)  # (B, K, S, hq)
    v = v.reshape(B, S, K, hv).transpose(1, 2)  # (B, K, S, hv)
    q, k = attn.q_norm(q), attn.k_norm(k)
    rope = cache.cos[positions], cache.sin[positions]  # (S, hq/2) each
    q, k = apply_rope(q, *rope).to(q.dtype), apply_rope(k, *rope).to(k.dtype)
    q, k, v = quant_query(q, quant, cfg), quant_kv(k, quant, cfg), quant_kv(v, quant, cfg)  # the cache holds them so

    C = lc.slot_pos.shape[0]
    stored = 0 if lc.store_pos is None else lc.store_pos.shape[0]
    keys = torch.cat([lc.slot_pos, positions] if not stored else [lc.store_pos, lc.slot_pos, positions])
    ok, back = _visible(cache, positions, keys)  # (B, S, N_s + C + S), (S, N_s + C + S)
    if lc.window:
        near = back < lc.window
        if stored:  # the ring within the kv window, the store past it: each sink read once; the chunk as _visible
            near = torch.cat([~near[:, :stored], near[:, stored:stored + C], torch.ones_like(near[:, stored + C:])], 1)
        ok = ok & near
    mask = (ok | (back == 0))[:, None]  # (B, 1, S, N_s + C + S)
    ks, vs = ([lc.k, k], [lc.v, v]) if not stored else ([lc.store_k, lc.k, k], [lc.store_v, lc.v, v])
    out = _attend(attn, q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask)  # (B, S, H·hv)

    kept = positions[-C:]  # the chunk's last C positions go into slots position mod C
    lc.k[:, :, kept % C], lc.v[:, :, kept % C], lc.slot_pos[kept % C] = k[:, :, -C:], v[:, :, -C:], kept
    if stored:  # by selection, not a boolean index: no data-dependent shape, so a traced step is one graph
        at = cache.sink_cols - positions[0]  # (N_s,): each sink's row in the chunk
        fed, at = (at >= 0) & (at < S), at.clamp(0, S - 1)
        lc.store_k.copy_(torch.where(fed[:, None], k[:, :, at], lc.store_k))
        lc.store_v.copy_(torch.where(fed[:, None], v[:, :, at], lc.store_v))
        lc.store_pos.copy_(torch.where(fed, cache.sink_cols, lc.store_pos))
    out = out * _sigmoid(attn.gate_proj(x))
    return attn.out_proj(_aq(out, quant, cfg.act_bits))


def _block_step(block: nn.Module, x: Tensor, attention: Callable[[Tensor], Tensor],
                engram_kv: tuple[Tensor, Tensor] | None, site_flags: Tensor | None) -> Tensor:
    """Block.forward with attention(x) (the cached one) in place of self_attn."""
    if engram_kv is not None:
        ek, ev = engram_kv
        alpha = torch.sigmoid(torch.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(x.shape[-1]))
        x = x + torch.einsum("s,sbt,sbtd->btd", site_flags, alpha, ev.float()).to(x.dtype)  # (B, S, D)
    skip = x
    x = attention(block.pre_attn_norm(x))
    x = skip + _sigmoid(block.attn_gate).to(block.compute_dtype) * block.post_attn_norm(x)
    return x + block.hadamard_mlp(block.pre_hada_norm(x))


def _layer_step(layer: nn.Module, lanes: Tensor, offsets: tuple[Tensor, Tensor], attention: Callable[[Tensor], Tensor],
                engram_kv: tuple[Tensor, Tensor] | None, site_flags: Tensor | None, quant: bool) -> Tensor:
    """MHCLayer.forward with the cached block: lanes (B, S, n, D) in dt -> the new lanes."""
    B, S, n, D = lanes.shape
    pre_off, post_off = offsets
    xf = lanes.float()
    nx = _aq(rms_unit(lanes.reshape(B, S, n * D)), quant, layer.act_bits)  # (B, S, n·D) float32
    hpre = torch.sigmoid(layer.a_pre * F.linear(nx, layer.phi_pre.weight.float()) + layer.b_pre + pre_off)
    u = torch.einsum("btn,btnc->btc", hpre, xf).to(layer.compute_dtype)  # (B, S, D)
    y = _block_step(layer.block, u, attention, engram_kv, site_flags) - u
    hpost = 2 * torch.sigmoid(layer.a_post * F.linear(nx, layer.phi_post.weight.float()) + layer.b_post + post_off)
    res = F.linear(nx, layer.phi_res.weight.float())  # (B, S, n·n)
    hres = sinkhorn(layer.a_res * res.reshape(B, S, n, n) + layer.b_res)  # (B, S, n, n)
    return (torch.einsum("btij,btjc->btic", hres, xf)
            + hpost[..., None] * y.float()[:, :, None, :]).to(layer.compute_dtype)  # (B, S, n, D)


def engram_step(model: nn.Module, cache: DecodeCache, positions: Tensor) -> tuple[Tensor, Tensor] | None:
    """Every site's (key, value) for the chunk at `positions` (S,) (consecutive), each (G, B, S, D): Engram.forward's
    arithmetic (and model._engram_kv's validity) on the rows the chunk reads only: its own keys, and the value rows
    its dilated taps read (t - j·dilation), hashed from the token history of W = (max(O) - 1) + 3·max(O) positions
    before the chunk. Validity is the request's mask (_seen), as the forward reads its full mask: an n-gram row
    r is valid where r sees r - (o - 1), a tap where t sees t - j·dilation; positions before 0 are invalid, as the
    forward's zero fill."""
    if not len(model.engrams):
        return None
    cfg, device, S = model.config, positions.device, positions.shape[0]
    W, dil, E = _engram_history(cfg), cfg.engram_dilation, cfg.engram_heads_resolved
    # window offsets of the value rows the chunk reads (ascending), and for each tap j where row t - j·dil sits
    rows = sorted({W + t - j * dil for t in range(S) for j in range(ENGRAM_TAPS)})
    at = [[rows.index(W + t - j * dil) for t in range(S)] for j in range(ENGRAM_TAPS)]
    window = positions[0] - W + torch.arange(W + S, device=device)  # (W + S,) positions, the oldest first
    indices = engram_indices(cache.tokens[:, cache.lead + window], cfg)[:, rows]  # (B, R, N)
    ngram_ok = torch.stack([_seen(cache, window[rows], o - 1) for o in cfg.engram_orders for _ in range(E)],
                           dim=-1)  # (B, R, N)
    tap_ok = [_seen(cache, positions, j * dil)[..., None] for j in range(ENGRAM_TAPS)]  # (B, S, 1) each
    keys, values = [], []
    for site in model.engrams:
        dt, N = site.compute_dtype, site.embedding.shape[0]
        fetched = site.embedding[torch.arange(N, device=device), indices] * ngram_ok[..., None]  # (B, R, N, s)
        e = _aq(fetched.flatten(2).to(dt), cache.quant, site.act_bits)  # (B, R, N·s)
        v = site.value_proj(e)  # (B, R, D)
        taps = site.taps.to(dt)
        keys.append(site.key_proj(e[:, at[0]]))  # (B, S, D)
        values.append(sum(taps[j] * v[:, at[j]] * tap_ok[j] for j in range(ENGRAM_TAPS)))  # (B, S, D)
    return torch.stack(keys), torch.stack(values)


def layer_decode(layer: nn.Module, lanes: Tensor, lc: LayerCache, cache: DecodeCache, positions: Tensor,
                 engram_kv: tuple[Tensor, Tensor] | None) -> Tensor:
    """One layer of decode_step at `positions` (S,): lanes (B, S, n, D) in dt -> the new lanes, updating lc. Its
    arguments are tensors, the layer and the cache, so that one traced graph serves every layer of a kind
    (needle_torch.fast.v3)."""
    attention = functools.partial(_attention_step, layer.block.self_attn, lc=lc, cache=cache, positions=positions)
    return _layer_step(layer, lanes, lc.offsets, attention, engram_kv, lc.site_flags, cache.quant)


def decode_step(model: nn.Module, tokens: Tensor, cache: DecodeCache, pos: int, last_only: bool = False,
                step: Callable[..., Tensor] | None = None) -> Tensor:
    """Feed tokens (B, S) at buffer positions pos..pos + S - 1 (pos 0 with the prompts: the prefill; then one token
    a step), updating the cache: float32 logits (B, S, V_out), or (B, 1, V_out) with last_only. step: what runs
    decode_positions' arguments (needle_torch.fast.v3 passes one with compiled parts)."""
    S = tokens.shape[1]
    cache.tokens[:, cache.lead + pos:cache.lead + pos + S] = tokens
    positions = torch.arange(pos, pos + S, device=tokens.device)  # (S,)
    return (step or decode_positions)(model, tokens, cache, positions, last_only)


def decode_layers(layers: list[tuple[nn.Module, LayerCache]], lanes: Tensor, cache: DecodeCache, positions: Tensor,
                  engram_kv: tuple[Tensor, Tensor] | None) -> Tensor:
    """The (layer, its cache) pairs in turn on lanes (B, S, n, D) -> the new lanes."""
    for layer, lc in layers:
        lanes = layer_decode(layer, lanes, lc, cache, positions, engram_kv)
    return lanes


def step_logits(model: nn.Module, lanes: Tensor, quant: bool) -> Tensor:
    """Stack.forward's end and the logits: lanes (B, S, n, D) -> float32 (B, S, V_out)."""
    return model._logits(model.stack.final_norm(lanes.mean(dim=2)), quant)


def decode_positions(model: nn.Module, tokens: Tensor, cache: DecodeCache, positions: Tensor, last_only: bool,
                     engram: Callable = engram_step, layers: Callable = decode_layers,
                     logits: Callable = step_logits) -> Tensor:
    """decode_step's model part: the tokens (B, S), already in cache.tokens, at `positions` (S,) -> the logits.
    engram, layers, logits: engram_step's, decode_layers' and step_logits' arguments (the fast step compiles them)."""
    cfg = model.config
    B, S = tokens.shape
    engram_kv = engram(model, cache, positions)
    x = model._input_embeddings(tokens)  # (B, S, D)
    lanes = x.to(model.stack.compute_dtype)[:, :, None, :].expand(B, S, cfg.mhc_lanes, cfg.d_model)  # (B, S, n, D)
    active = [(layer, lc) for layer, lc in zip(model.stack.layers, cache.layers, strict=True) if lc is not None]
    lanes = layers(active, lanes, cache, positions, engram_kv)
    return logits(model, lanes[:, -1:] if last_only else lanes, cache.quant)


# ----------------------------------------------------------------------------- the loops


def _prepare(model: nn.Module, tokens, max_new_tokens, kv_window, sink, layers, temperature, seed, eos_token_id,
             pad_token_id) -> tuple[Tensor, Tensor, Tensor | None, _Sampler, int]:
    """Checked inputs on the model's device: (prompts (B, P) int64, valid (B, M), sink (B, M) bool or None, sampler,
    eos id (-1: none))."""
    cfg = model.config
    prompts = check_generate_args(cfg, tokens, max_new_tokens, 0, sink, temperature, seed, eos_token_id,
                                  pad_token_id)
    if kv_window is not None and (isinstance(kv_window, bool) or not isinstance(kv_window, int) or kv_window < 1):
        raise GenerationError(f"kv_window must be None (config.effective_kv_window) or an integer >= 1, got "
                              f"{kv_window!r}")
    _active_layers(cfg, layers)
    device = model.embedding.weight.device
    valid = F.pad(torch.from_numpy(prompt_validity(prompts, pad_token_id)), (0, int(max_new_tokens)), value=True)
    if sink is not None:  # generated positions are no sinks
        sink = F.pad(torch.as_tensor(np.asarray(sink) != 0), (0, int(max_new_tokens))).to(device)
    sampler = _Sampler(float(temperature), seed, (prompts.shape[0], cfg.output_vocab), device)
    eos = -1 if eos_token_id is None else int(eos_token_id)
    return torch.from_numpy(prompts).to(device), valid.to(device), sink, sampler, eos


@torch.inference_mode()
def generate(model: nn.Module, tokens, max_new_tokens: int = 64, *, layers: int | None = None,
             kv_window: int | None = None, sink=None, quant: bool = False, temperature: float = 0.0,
             seed: int | None = None, eos_token_id: int | None = EOS_ID, pad_token_id: int = PAD_ID,
             return_logits: bool = False, return_logprobs: bool = False, streamer: Streamer | None = None,
             compile: bool = False, fast: bool = True):
    """Cached generation: the new tokens LongTensor (B, max_new_tokens), plus (logits, logprobs) on request.

    tokens: (B, P) prompts (BOS included), left-padded with pad_token_id; P + max_new_tokens <= max_seq_len.
    One prefill pass over the prompts, then one token a step over the cache, in the model's dtype and on its
    device. layers: decode on ladder rung d (the layers of rank < d, `subnetwork_only` with exit_depth=d).
    kv_window: the global layers' ring (None: config.effective_kv_window, upstream's deploy bound); where the
    buffer is longer, a query sees its last kv_window positions and the `sink` positions ((B, P) bool or 0/1 over
    the prompts), under upstream's windowed mask (`hidden_cells`' window and sink) in every layer, conv tap and
    engram row. quant: upstream's deploy numerics, the forward's `quant=True` (A8 activations and q, the KV cache
    at config.kv_bits: a .cact's). temperature 0 is greedy (argmax, ties to the first index); above 0
    categorical(logits / T) from a torch.Generator seeded with `seed` (torch's stream,
    not JAX's: sampled tokens follow upstream's distribution, not its draws). Each row stops at its first
    eos_token_id (kept; None: never) and holds pad_token_id after it. return_logits: the float32 logits
    (B, steps, V_out) each token came from; return_logprobs: the chosen tokens' log-probabilities (B, steps), 0
    after a row's EOS. streamer: called with each step's (B,) tokens on the CPU. compile: the one-token steps
    through torch.compile (needle_torch.fast.v3.compiled_step: the same tokens, logits up to the order of float32
    sums; the first request of a shape compiles). fast: the compiled graphs take needle_torch.fast.v3's forms of
    the plain pieces (few-row products as fused multiply-and-sums; the same function up to the order of float32
    sums); False compiles the plain pieces. Eager steps run the plain pieces either way."""
    prompts, valid, sink, sampler, eos = _prepare(model, tokens, max_new_tokens, kv_window, sink, layers,
                                                  temperature, seed, eos_token_id, pad_token_id)
    with fast_paths(model, fast and compile):
        return _generate(model, prompts, valid, sink, sampler, eos, int(max_new_tokens), kv_window, layers, quant,
                         pad_token_id, return_logits, return_logprobs, streamer, compile)


def _generate(model, prompts, valid, sink, sampler, eos, G, kv_window, layers, quant, pad_token_id, return_logits,
              return_logprobs, streamer, compile):
    """generate's body, inside seam.fast_paths."""
    B, P = prompts.shape
    device = prompts.device
    cache = new_cache(model, B, P + G, valid, kv_window, layers, sink, quant)
    prefill = decode_step(model, prompts, cache, 0, last_only=True)[:, 0]  # (B, V_out): chooses token 0
    eos_t, pad_t = (torch.tensor(i, device=device) for i in (eos, pad_token_id))
    step = forms(model).compiled_step(model) if compile else decode_step

    def advance(t: int, out: Tensor, done: Tensor, noise: Tensor | None):
        # token t - 1 goes in at position P + t - 1; its logits choose token t
        logits = prefill if t == 0 else step(model, out[:, t - 1:t], cache, P + t - 1)[:, 0]
        return (logits, *pick(logits, done, eos_t, pad_t, noise, sampler.inv_temp))

    return _loop(advance, sampler, B, G, device, eos, pad_token_id, streamer, return_logits, return_logprobs)


@torch.inference_mode()
def generate_recompute(model: nn.Module, tokens, max_new_tokens: int = 64, *, layers: int | None = None,
                       kv_window: int | None = None, sink=None, quant: bool = False, temperature: float = 0.0,
                       seed: int | None = None, eos_token_id: int | None = EOS_ID, pad_token_id: int = PAD_ID,
                       return_logits: bool = False, return_logprobs: bool = False, streamer: Streamer | None = None):
    """Upstream's run.py loop, the reference: the forward on the PAD-filled buffer (B, P + G) re-run for every new
    token, the logits read at the current position; with layers=d the rung's `subnetwork_only` logits. Same
    contract and results as `generate`. The mask is causal, and for left-padded rows (causal ∧ valid) ∨ diagonal,
    so pad keys stay unseen; kv_window (None: none, as run.py) and sink add `hidden_cells`' window and sinks:
    (causal ∧ valid ∧ (q - k < kv_window ∨ k a sink)) ∨ diagonal."""
    prompts, valid, sink, sampler, eos = _prepare(model, tokens, max_new_tokens, kv_window, sink, layers,
                                                  temperature, seed, eos_token_id, pad_token_id)
    B, P = prompts.shape
    G, device = int(max_new_tokens), prompts.device
    M = P + G
    buf = F.pad(prompts, (0, G), value=pad_token_id)  # (B, M)
    causal = make_causal_mask(M, device)  # (1, 1, M, M)
    eye = torch.eye(M, dtype=torch.bool, device=device)[None, None]  # (1, 1, M, M)
    mask = causal if bool(valid.all()) else (causal & valid[:, None, None, :]) | eye  # (B|1, 1, M, M)
    if kv_window is not None and kv_window < M:
        here = torch.arange(M, device=device)
        near = (here[:, None] - here[None, :] < kv_window)[None, None]  # (1, 1, M, M)
        keep = near if sink is None else near | sink[:, None, None, :]  # (B|1, 1, M, M)
        mask = (mask & keep) | eye
    rung = {} if layers is None else {"exit_depth": layers, "subnetwork_only": True}
    eos_t, pad_t = (torch.tensor(i, device=device) for i in (eos, pad_token_id))

    def advance(t: int, out: Tensor, done: Tensor, noise: Tensor | None):
        if t:
            buf[:, P + t - 1] = out[:, t - 1]
        logits = model(buf, mask, quant, **rung)[:, P - 1 + t]  # (B, V_out) float32
        return (logits, *pick(logits, done, eos_t, pad_t, noise, sampler.inv_temp))

    return _loop(advance, sampler, B, G, device, eos, pad_token_id, streamer, return_logits, return_logprobs)


__all__ = ["DecodeCache", "LayerCache", "decode_layers", "decode_positions", "decode_step", "engram_step", "generate",
           "generate_recompute", "kv_bound", "layer_decode", "new_cache", "step_logits"]
