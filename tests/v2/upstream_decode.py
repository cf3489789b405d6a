"""Upstream's cached decoding (`needle/model/decode.py`, NEEDLE_V2.md §6), ported as it is: the reference.

This is the code the fixture's `dec_*`, `decw_*` and `batch_*` goldens came from, kept in
upstream's shape on purpose: the benchmark's baseline (benchmarks/bench_flax_v2.py) must pay
what upstream pays. So it works on the raw param tree (every leaf cast to float32: decode
always runs in f32, whatever `config.dtype` says), with no quant, no MTP and no heads;
`forward_cached` unrolls the L layers in a Python loop inside one jit (and each layer's
Sinkhorn iterations too, as upstream's `_sinkhorn` does), which is what makes its compile
take minutes at the published size. Our fast path is needle_flax/v2/generate.py.

Where upstream calls a tokenizer this port takes token ids: `prompt_ids` is `tok.encode(prompt)`
(BOS is prepended here, as upstream does) and the generated ids come back undecoded, which is
what the fixture's identity tokenizer gave upstream.

Shapes: B batch, S chunk length, M max_len (cache positions), V vocab, D d_model, H heads,
K kv heads, g = H/K query heads per kv head, h head dim, L layers, n lanes, N engram tables,
s engram sub dim, W = 4·max(O) engram history.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from convert.errors import GenerationError
from convert.v2.config import BOS_ID, ENGRAM_TAPS, EOS_ID, PAD_ID, TransformerConfig
from needle_flax.layers import precompute_rope_freqs
from needle_flax.v2.engram import HASH_PRIME, HASH_SEED, HASH_SHIFT, shift_right
from needle_flax.v2.lanes import SINKHORN_ITERS, lane_offsets, rms_unit, sinkhorn
from needle_flax.v2.model import walsh_matrix

NORM_EPS = 1e-6


class DecodeCfg(NamedTuple):
    """The static part of a decoding request (upstream's namedtuple): hashable, so `forward_cached` can be jitted
    with it as a static argument. engram_heads is the resolved E."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    attn_dim: int
    mhc_lanes: int
    engram_layers: tuple[int, ...]
    engram_orders: tuple[int, ...]
    engram_heads: int
    engram_slots: int
    kv_window: int


def decode_cfg(config: TransformerConfig, kv_window: int = 0) -> DecodeCfg:
    return DecodeCfg(config.d_model, config.num_heads, config.num_kv_heads, config.num_layers, config.attn_dim,
                     config.mhc_lanes, tuple(config.engram_layers), tuple(config.engram_orders),
                     config.engram_heads_resolved, config.engram_slots, int(kv_window))


def init_kv_cache(config: TransformerConfig, batch: int, max_len: int):
    """(k_cache, v_cache): float32 zeros (L, B, K, M, h)."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def _f32(params):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


# ----------------------------------------------------------------------------- pieces (all float32)


def _norm(x, scale):
    """ZCRMSNorm without the cast back: ((1 + scale)·x) / sqrt(mean(x²) + eps)."""
    return ((1 + scale) * x) / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + NORM_EPS)


def _rope(x, cos, sin):
    """Half-split RoPE on (B, heads, S, h) with tables (S, h/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _sinkhorn(logits):
    """Upstream's form: the iterations unrolled in Python (each one rows, then columns), exp at the end."""
    for _ in range(SINKHORN_ITERS):
        logits = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        logits = logits - jax.nn.logsumexp(logits, axis=-2, keepdims=True)
    return jnp.exp(logits)


def _hash(tokens, orders, E: int, slots: int):
    """(B, S, N) int32 table rows of every position (§3.6), zeros before the start hashed like tokens."""
    u = tokens.astype(jnp.uint32)
    rows = []
    for oi, order in enumerate(orders):
        for e in range(E):
            acc = jnp.full_like(u, jnp.uint32((HASH_SEED * (oi * E + e + 1)) & 0xFFFFFFFF))
            for j in range(order):
                acc = (acc ^ shift_right(u, j)) * jnp.uint32(HASH_PRIME)
            acc = acc ^ (acc >> jnp.uint32(HASH_SHIFT))
            rows.append((acc % jnp.uint32(slots)).astype(jnp.int32))
    return jnp.stack(rows, axis=-1)


def _engram(params, dcfg: DecodeCfg, window, window_valid, S: int):
    """Every site's (key, value), each (G, B, S, D), from the token history window (B, W + S) and its validity:
    n-gram validity is the valid flag o - 1 back, tap j's the flag j·dil back (no attention mask, no window)."""
    orders, E = dcfg.engram_orders, dcfg.engram_heads
    dil, N = max(orders), len(orders) * E
    idx = _hash(window, orders, E, dcfg.engram_slots)  # (B, W + S, N)
    ngram_ok = jnp.stack([shift_right(window_valid, o - 1) for o in orders for _ in range(E)], axis=-1)
    tap_ok = [shift_right(window_valid, j * dil) for j in range(ENGRAM_TAPS)]
    keys, values = [], []
    for g in range(len(dcfg.engram_layers)):
        p = params[f"engrams_{g}"]
        fetched = p["embedding"][jnp.arange(N), idx] * ngram_ok[..., None]  # (B, W + S, N, s)
        e = fetched.reshape(*idx.shape[:2], -1)  # (B, W + S, N·s)
        k = e @ p["key_proj"]["kernel"]
        v = e @ p["value_proj"]["kernel"]
        v = sum(p["taps"][j] * shift_right(v, j * dil) * tap_ok[j][..., None] for j in range(ENGRAM_TAPS))
        keys.append(k[:, -S:])
        values.append(v[:, -S:])
    return jnp.stack(keys), jnp.stack(values)


def _hadamard(p, x, walsh):
    D, P = x.shape[-1], walsh.shape[0]
    z = jnp.pad(x, ((0, 0), (0, 0), (0, P - D))) if P > D else x  # (B, S, P)
    z = (p["d1"] * z) @ walsh
    z = jax.nn.silu(p["d2"] * z) @ walsh
    return (p["d3"] * z)[..., :D]


# ----------------------------------------------------------------------------- forward_cached


def _forward_cached(params, dcfg: DecodeCfg, tokens, k_cache, v_cache, pos, cos, sin, key_valid=None, flash=False,
                    hist=None, hist_valid=None, sink=None, *, fast_compile: bool = False):
    """Feed tokens (B, S) at positions pos..pos+S-1: (logits (B, S, V) float32, k_cache, v_cache).

    k_cache, v_cache: (L, B, K, M, h); K after k_norm and RoPE, V raw. cos, sin: (M, h/2) tables. key_valid,
    sink: (B, M) bool or None. hist, hist_valid: (B, M) token history and its validity for the engram (None: the
    chunk's own tokens, all valid, pos treated as 0). flash: prefill (S > 1 at pos 0 only) through
    jax.nn.dot_product_attention over the chunk's own keys, mask (causal [∧ window ∨ sink]) ∧ key_valid ∨ eye.
    fast_compile (not upstream's): Sinkhorn's iterations in a fori_loop (lanes.sinkhorn) rather than unrolled,
    the same values to an ulp for ~5x less XLA compile time; the tests use it, the benchmark does not."""
    D, H, K, L, A, n = (dcfg.d_model, dcfg.num_heads, dcfg.num_kv_heads, dcfg.num_layers, dcfg.attn_dim,
                        dcfg.mhc_lanes)
    h, g, window = A // H, H // K, dcfg.kv_window
    B, S = tokens.shape
    M = k_cache.shape[3]
    emb = params["embedding"]["embedding"]
    x = emb[tokens] * math.sqrt(D)  # (B, S, D); jnp indexing clamps out-of-range ids
    cs, sn = jax.lax.dynamic_slice_in_dim(cos, pos, S), jax.lax.dynamic_slice_in_dim(sin, pos, S)  # (S, h/2)

    ek = ev = None
    if dcfg.engram_layers:
        W = ENGRAM_TAPS * max(dcfg.engram_orders)
        if hist is None:
            hist, hist_valid, hpos = tokens, jnp.ones((B, S), jnp.bool_), 0
        else:
            hpos = pos
        padded = jnp.pad(hist, ((0, 0), (W, 0)))  # (B, W + M): zeros before the start
        padded_valid = jnp.pad(hist_valid.astype(jnp.bool_), ((0, 0), (W, 0)))
        window_tokens = jax.lax.dynamic_slice_in_dim(padded, hpos, W + S, axis=1)  # hist[pos - W : pos + S]
        window_valid = jax.lax.dynamic_slice_in_dim(padded_valid, hpos, W + S, axis=1)
        ek, ev = _engram(params, dcfg, window_tokens, window_valid, S)  # (G, B, S, D)

    qpos = pos + jnp.arange(S)
    if flash and S > 1:
        i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
        ok = (j <= i)[None]  # (1, S, S)
        if window:
            near = (i - j) < window
            ok = ok & (near[None] if sink is None else near[None] | sink[:, None, :S])
        if key_valid is not None:
            ok = ok & key_valid[:, None, :S]
        attn_mask = (ok | jnp.eye(S, dtype=jnp.bool_)[None])[:, None]  # (B|1, 1, S, S)
    else:
        kpos = jnp.arange(M)
        ok = (kpos[None, :] <= qpos[:, None])[None]  # (1, S, M)
        if window:
            near = (qpos[:, None] - kpos[None, :]) < window
            ok = ok & (near[None] if sink is None else near[None] | sink[:, None, :])
        if key_valid is not None:
            ok = ok & key_valid[:, None, :]
        attn_mask = ok[:, None, None]  # (B|1, 1, 1, S, M)

    st, blocks = params["stack"], params["stack"]["layers"]["block"]
    pre_off, post_off = lane_offsets(L, n)
    walsh = walsh_matrix(blocks["hadamard_mlp"]["d1"].shape[-1])
    lanes = jnp.broadcast_to(x[:, :, None, :], (B, S, n, D))  # (B, S, n, D)
    for layer in range(L):
        p = jax.tree.map(lambda a, layer=layer: a[layer], blocks)
        nx = rms_unit(lanes.reshape(B, S, n * D))  # (B, S, n·D)
        hpre = jax.nn.sigmoid(st["mhc_a_pre"][layer] * (nx @ st["mhc_phi_pre"][layer]) + st["mhc_b_pre"][layer]
                              + pre_off[layer])
        hpost = 2 * jax.nn.sigmoid(st["mhc_a_post"][layer] * (nx @ st["mhc_phi_post"][layer])
                                   + st["mhc_b_post"][layer] + post_off[layer])
        res = (nx @ st["mhc_phi_res"][layer]).reshape(B, S, n, n)  # (B, S, n, n)
        hres = (sinkhorn if fast_compile else _sinkhorn)(st["mhc_a_res"][layer] * res + st["mhc_b_res"][layer])
        u = jnp.einsum("bsn,bsnd->bsd", hpre, lanes)

        bx = u
        if layer in dcfg.engram_layers:  # only the first site at this layer, as upstream
            site = dcfg.engram_layers.index(layer)
            alpha = jax.nn.sigmoid(jnp.sum(rms_unit(u) * rms_unit(ek[site]), axis=-1) / math.sqrt(D))  # (B, S)
            bx = u + alpha[..., None] * ev[site]

        a = p["self_attn"]
        xn = _norm(bx, p["ZCRMSNorm_0"]["scale"])
        q = (xn @ a["q_proj"]["kernel"]).reshape(B, S, H, h).transpose(0, 2, 1, 3)  # (B, H, S, h)
        k = (xn @ a["k_proj"]["kernel"]).reshape(B, S, K, h).transpose(0, 2, 1, 3)  # (B, K, S, h)
        v = (xn @ a["v_proj"]["kernel"]).reshape(B, S, K, h).transpose(0, 2, 1, 3)  # (B, K, S, h)
        q = _rope(_norm(q, a["q_norm"]["scale"]), cs, sn)
        k = _rope(_norm(k, a["k_norm"]["scale"]), cs, sn)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k[None], (layer, 0, 0, pos, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v[None], (layer, 0, 0, pos, 0))
        if flash and S > 1:
            out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                               v.transpose(0, 2, 1, 3), mask=attn_mask)  # (B, S, H, h)
            out = out.reshape(B, S, A)  # (B, S, A)
        else:
            qg = q.reshape(B, K, g, S, h)  # (B, K, g, S, h): query head k·g + i reads kv head k
            w = jnp.einsum("bkgsh,bkmh->bkgsm", qg, k_cache[layer]) / math.sqrt(h)  # (B, K, g, S, M)
            w = jax.nn.softmax(jnp.where(attn_mask, w, jnp.finfo(w.dtype).min), axis=-1)
            out = jnp.einsum("bkgsm,bkmh->bkgsh", w, v_cache[layer])  # (B, K, g, S, h)
            out = out.reshape(B, H, S, h).transpose(0, 2, 1, 3).reshape(B, S, A)  # (B, S, A)
        out = (out * jax.nn.sigmoid(xn @ a["gate_proj"]["kernel"])) @ a["out_proj"]["kernel"]
        bx = bx + jax.nn.sigmoid(p["attn_gate"]) * _norm(out, p["post_attn_norm"]["scale"])
        bx = bx + _hadamard(p["hadamard_mlp"], _norm(bx, p["pre_hada_norm"]["scale"]), walsh)

        y = bx - u
        lanes = jnp.einsum("bsij,bsjd->bsid", hres, lanes) + hpost[..., None] * y[:, :, None, :]

    x = _norm(jnp.mean(lanes, axis=2), st["final_norm"]["scale"])
    return x @ emb.T, k_cache, v_cache


forward_cached = jax.jit(_forward_cached, static_argnums=(1, 9), static_argnames=("fast_compile",))


# ----------------------------------------------------------------------------- the two drivers


def generate_cached(config: TransformerConfig, params, prompt_ids, max_new_tokens: int = 96, max_len=None,
                    kv_window: int = 0, *, fast_compile: bool = False) -> list[int]:
    """Greedy cached decoding of one prompt (upstream's `generate_cached`): the new ids, EOS excluded.

    prompt_ids: the encoded prompt without BOS (upstream prepends it and cuts to max_seq_len - 1). At most
    min(max_new_tokens, max_len - len(ids)) ids. kv_window > 0 masks attention to the last kv_window positions;
    as in upstream, the window never touches the engram (its validity is the history's, all True).
    fast_compile: see _forward_cached (not upstream's)."""
    p32 = _f32(params)
    ids = ([BOS_ID] + [int(t) for t in prompt_ids])[: config.max_seq_len - 1]
    if max_len is None:
        max_len = min(config.max_seq_len, len(ids) + max_new_tokens)
    dcfg = decode_cfg(config, kv_window)
    k_cache, v_cache = init_kv_cache(config, 1, max_len)
    cos, sin = precompute_rope_freqs(config.head_dim, max_len, config.rope_theta)
    hist = jnp.zeros((1, max_len), jnp.int32).at[0, : len(ids)].set(jnp.asarray(ids, jnp.int32))
    valid = jnp.ones((1, max_len), jnp.bool_)
    sink = jnp.zeros((1, max_len), jnp.bool_) if kv_window else None  # upstream's _doc_prefix_len is always 0
    prompt = jnp.asarray([ids], jnp.int32)
    logits, k_cache, v_cache = forward_cached(p32, dcfg, prompt, k_cache, v_cache, 0, cos, sin, None, False,
                                              hist, valid, sink, fast_compile=fast_compile)
    token = int(jnp.argmax(logits[0, -1]))
    generated, pos = [], len(ids)
    while len(generated) < max_new_tokens:
        if token == EOS_ID or pos >= max_len:
            break
        generated.append(token)
        hist = hist.at[0, pos].set(token)
        logits, k_cache, v_cache = forward_cached(p32, dcfg, jnp.asarray([[token]], jnp.int32), k_cache, v_cache,
                                                  pos, cos, sin, None, False, hist, valid, sink,
                                                  fast_compile=fast_compile)
        token = int(jnp.argmax(logits[0, -1]))
        pos += 1
    return generated


def _choose(logits, key, temperature: float):
    """(token (B,), log-probability (B,)): argmax, or categorical(logits / max(T, 1e-6)); the log-probability of
    the unscaled logits."""
    if temperature <= 0:
        token = jnp.argmax(logits, axis=-1)
    else:
        token = jax.random.categorical(key, logits / max(temperature, 1e-6), axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
    return token.astype(jnp.int32), logp


_ROLLOUTS: dict = {}


def _make_rollout(dcfg: DecodeCfg, max_p: int, max_len: int, scan_len: int, temperature: float, head_dim: int,
                  rope_theta: float, fast_compile: bool):
    """The jitted rollout of one request shape (upstream caches it per shape): flash prefill, then a lax.scan of
    single steps, the PRNG key split at every choice. Upstream pmaps it over the local devices; on one device
    that is this jit."""
    key = (dcfg, max_p, max_len, scan_len, temperature, head_dim, rope_theta, fast_compile)
    if key in _ROLLOUTS:
        return _ROLLOUTS[key]

    def rollout(params, buf, valid, sink, rng):
        B = buf.shape[0]
        shape = (dcfg.num_layers, B, dcfg.num_kv_heads, max_len, head_dim)
        k_cache, v_cache = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        cos, sin = precompute_rope_freqs(head_dim, max_len, rope_theta)
        hist = jnp.pad(buf, ((0, 0), (0, max_len - max_p)))  # (B, M): the prompts, zeros after
        logits, k_cache, v_cache = _forward_cached(params, dcfg, buf, k_cache, v_cache, 0, cos, sin, valid, True,
                                                   hist, valid, sink, fast_compile=fast_compile)
        rng, sub = jax.random.split(rng)
        token, logp = _choose(logits[:, -1], sub, temperature)

        def step(carry, _):
            token, pos, k_cache, v_cache, hist, rng = carry
            hist = jax.lax.dynamic_update_slice(hist, token[:, None], (0, pos))
            logits, k_cache, v_cache = _forward_cached(params, dcfg, token[:, None], k_cache, v_cache, pos, cos, sin,
                                                       valid, hist=hist, hist_valid=valid, sink=sink,
                                                       fast_compile=fast_compile)
            rng, sub = jax.random.split(rng)
            nxt, lp = _choose(logits[:, -1], sub, temperature)
            return (nxt, pos + 1, k_cache, v_cache, hist, rng), (nxt, lp)

        carry = (token, jnp.int32(max_p), k_cache, v_cache, hist, rng)
        _, (tokens, logps) = jax.lax.scan(step, carry, None, length=scan_len)
        return (jnp.concatenate([token[:, None], tokens.T], axis=1),  # (B, 1 + scan_len)
                jnp.concatenate([logp[:, None], logps.T], axis=1))

    _ROLLOUTS[key] = jax.jit(rollout)
    return _ROLLOUTS[key]


def batched_generate(config: TransformerConfig, params, prompts, max_new_tokens: int = 96, temperature: float = 0.0,
                     seed: int = 0, pad_to=None, kv_window: int = 0, *, fast_compile: bool = False):
    """Upstream's `batched_generate` on encoded prompts (lists of ids without BOS): (ids cut at the first EOS per
    row, ids (B, 1 + scan_len) int32, log-probabilities (B, 1 + scan_len) float32).

    Prompts get BOS, are cut to cap = max(1, max_seq_len - max_new_tokens) and left-padded with PAD to the longest
    (or to pad_to); valid is False on the pads and True from each row's first token on. The batch is filled up to
    a multiple of the local device count with [BOS] rows, which are not returned. fast_compile: see
    _forward_cached (not upstream's)."""
    p32 = _f32(params)
    cap = max(1, config.max_seq_len - max_new_tokens)
    rows = [([BOS_ID] + [int(t) for t in ids])[:cap] for ids in prompts]
    real = len(rows)
    devices = jax.local_device_count()
    rows += [[BOS_ID]] * (-real % devices)
    longest = max(len(r) for r in rows)
    if pad_to is not None and pad_to < longest:
        raise GenerationError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} ids with BOS); pass "
                              f"pad_to >= {longest} or None")
    max_p = min(cap, pad_to) if pad_to is not None else longest
    max_len = min(config.max_seq_len, max_p + max_new_tokens)
    scan_len = max_len - max_p - 1
    if scan_len <= 0:
        raise GenerationError(f"no room to generate: {max_p} prompt positions leave max_len={max_len} of "
                              f"max_seq_len={config.max_seq_len}; ask for max_new_tokens >= 2 or shorter prompts")
    buf = np.full((len(rows), max_p), PAD_ID, np.int32)
    valid = np.ones((len(rows), max_len), bool)
    for r, ids in enumerate(rows):
        buf[r, max_p - len(ids):] = ids
        valid[r, : max_p - len(ids)] = False
    sink = np.zeros((len(rows), max_len), bool)  # upstream's _doc_prefix_len is always 0: no sinks
    rollout = _make_rollout(decode_cfg(config, kv_window), max_p, max_len, scan_len, float(temperature),
                            config.head_dim, config.rope_theta, bool(fast_compile))
    ids, logp = rollout(p32, jnp.asarray(buf), jnp.asarray(valid), jnp.asarray(sink), jax.random.PRNGKey(seed))
    ids, logp = np.asarray(ids)[:real], np.asarray(logp)[:real]
    texts = []
    for row in ids.tolist():
        texts.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
    return texts, ids, logp
